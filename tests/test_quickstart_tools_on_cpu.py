"""`polyrl quickstart --task tools`: the tiny model learns to call a calculator for 3-digit products (held-out greedy
accuracy rises by >= 30 points), and the control, the same model and recipe with multi-turn off, stays low. The SFT
warm-up is shared by both runs (cached in the session's POLYRL_CACHE). Measured: 133 CPU-seconds in all (194 before
the SFT's micro-batches were grouped by length: tool calls are 3x longer than direct answers), on one torch thread;
most of it is the SFT warm-up, which needs its 600 steps (400 left the digit copying too weak for any reward). One run:
+64 points (0.02 -> 0.66), control 0.0. Both runs take 8 of the quickstart's 12 GRPO steps: +66, +55 and +70 points
with trainer.seed 1, 2, 3 (control 0.0), twice the 30 asked, and a third less RL time."""

import pytest

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]


def test_tools_quickstart_learns_and_the_control_does_not(tmp_path, monkeypatch, quickstart_cache):
    from polyrl.trainer.quickstart_tools import ToolsSettings, run_tools_quickstart

    monkeypatch.setenv("POLYRL_CACHE", str(quickstart_cache))
    settings = ToolsSettings(grpo_steps=8)
    with_tools = run_tools_quickstart(str(tmp_path / "tools"), settings=settings)
    assert with_tools["accuracy_after"] - with_tools["accuracy_before"] >= 0.30, with_tools
    control = run_tools_quickstart(str(tmp_path / "control"), tools=False, settings=settings)
    assert control["accuracy_after"] <= 0.05, control  # it cannot multiply 3-digit numbers alone
