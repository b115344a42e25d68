"""`polyrl quickstart --task tools`: the tiny model learns to call a calculator for 3-digit products (held-out greedy
accuracy rises by >= 30 points), and the control, the same model and recipe with multi-turn off, stays low. The SFT
warm-up is shared by both runs (cached in the session's POLYRL_CACHE). Measured: 133 CPU-seconds in all (194 before
the SFT's micro-batches were grouped by length: tool calls are 3x longer than direct answers), on one torch thread;
most of it is the SFT warm-up, which needs its 600 steps (400 left the digit copying too weak for any reward). One run:
+64 points (0.02 -> 0.66), control 0.0."""

import pytest

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]


def test_tools_quickstart_learns_and_the_control_does_not(tmp_path, monkeypatch, quickstart_cache):
    from polyrl.trainer.quickstart_tools import run_tools_quickstart

    monkeypatch.setenv("POLYRL_CACHE", str(quickstart_cache))
    with_tools = run_tools_quickstart(str(tmp_path / "tools"))
    assert with_tools["accuracy_after"] - with_tools["accuracy_before"] >= 0.30, with_tools
    control = run_tools_quickstart(str(tmp_path / "control"), tools=False)
    assert control["accuracy_after"] <= 0.05, control  # it cannot multiply 3-digit numbers alone
