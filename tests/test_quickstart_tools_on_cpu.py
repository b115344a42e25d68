"""`polyrl quickstart --task tools`: the tiny model learns to call a calculator for 3-digit products (held-out greedy
accuracy rises by >= 30 points), and the control, the same model and recipe with multi-turn off, stays low. The SFT
warm-up is shared by both runs (cached in the session's POLYRL_CACHE). Measured: 133 CPU-seconds in all (194 before
the SFT's micro-batches were grouped by length: tool calls are 3x longer than direct answers), on one torch thread;
most of it is the SFT warm-up, which needs its 900 steps (under transformers 5.25, 600 left the copying of the tool's
answer weak: +17 to +34 points over rollout seeds; 400 gave no reward at all). Both runs take 8 of the quickstart's 12
GRPO steps: +73, +70 and +70 points with rollout seeds 1, 2, 3 (2026-12-06, one thread; control 0.0), more than
twice the 30 asked. The multi-turn rollout repeats for a seed (agents/server.py), so the rise does not depend on how
busy the machine is."""

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


@pytest.mark.parametrize("argv, flag", [(["--task", "tools", "--scale", "gpu"], "--scale gpu"),
                                        (["--task", "tools", "--arch", "qwen3_moe"], "--arch qwen3_moe"),
                                        (["--task", "tools", "--fast"], "--fast"), (["--no-tools"], "--no-tools")])
def test_flags_the_tools_quickstart_does_not_take_are_refused_not_ignored(argv, flag):
    from polyrl.errors import UserError
    from polyrl.trainer.quickstart import main

    with pytest.raises(UserError, match=flag):
        main(argv)
