import json
import os

import pytest
import torch

from polyrl.errors import ConfigError
from polyrl.utils import profiler as profiler_mod
from polyrl.utils.profiler import (
    GlobalProfilerConfig,
    Profiler,
    RoleProfilerConfig,
    TorchToolConfig,
    ToolConfig,
    maybe_relaunch_under_nsys,
    nsys_command,
)
from polyrl.utils.timing import StepTimer

STAGES = ("gen", "old_log_prob", "update_actor")


def _run(prof: Profiler, steps=(1, 2)) -> None:
    """A tiny training loop: a few timed stages around a small matmul, as the trainers do."""
    timer = StepTimer(hooks=[prof])
    x = torch.randn(32, 32)
    for step in steps:
        prof.step_start(step)
        with timer.stage("step"):
            for name in STAGES:
                with timer.stage(name):
                    x = torch.tanh(x @ x)
        prof.step_end(step)
    prof.close()


def _actor(**kw) -> dict:
    return {"actor": RoleProfilerConfig(enable=True, **kw)}


def _event_names(path: str) -> set[str]:
    with open(path) as f:
        trace = json.load(f)  # a valid Chrome/Perfetto trace is JSON with traceEvents
    return {e.get("name") for e in trace["traceEvents"]}


def test_torch_trace_of_step_1_holds_the_stage_names(tmp_path):
    prof = Profiler(GlobalProfilerConfig(tool="torch", steps=[1], save_path=str(tmp_path)), _actor())
    _run(prof)
    assert sorted(os.listdir(tmp_path)) == ["step_1.json"]  # step 2 is not in steps: nothing written
    names = _event_names(str(tmp_path / "step_1.json"))
    assert set(STAGES) <= names and "aten::mm" in names


def test_discrete_mode_writes_one_trace_per_stage(tmp_path):
    tool_config = ToolConfig(torch=TorchToolConfig(contents=["cpu"], discrete=True))
    prof = Profiler(
        GlobalProfilerConfig(tool="torch", steps=[2], save_path=str(tmp_path)), _actor(tool_config=tool_config)
    )
    _run(prof)
    assert sorted(os.listdir(tmp_path)) == sorted(f"step_2_{s}.json" for s in STAGES)
    for stage in STAGES:
        names = _event_names(str(tmp_path / f"step_2_{stage}.json"))
        assert stage in names and not (set(STAGES) - {stage}) & names


def test_continuous_steps_share_one_trace(tmp_path):
    g = GlobalProfilerConfig(tool="torch", steps=[1, 2, 4], profile_continuous_steps=True, save_path=str(tmp_path))
    _run(Profiler(g, _actor()), steps=(1, 2, 3, 4))
    assert sorted(os.listdir(tmp_path)) == ["step_1-2.json", "step_4.json"]


def test_ranks_are_honoured(tmp_path):
    g = GlobalProfilerConfig(tool="torch", steps=[1], save_path=str(tmp_path))
    assert not Profiler(g, _actor(ranks=[0]), rank=1).enabled
    assert not Profiler(g, _actor(), rank=1).enabled  # empty ranks means rank 0
    prof = Profiler(g, _actor(all_ranks=True), rank=1)
    _run(prof)
    assert os.listdir(tmp_path) == ["step_1_rank1.json"]


def test_disabled_when_tool_is_null(tmp_path):
    save = tmp_path / "profile"
    prof = Profiler(GlobalProfilerConfig(tool=None, steps=[1], save_path=str(save)), _actor())
    assert not prof.enabled
    _run(prof)
    assert not save.exists()


def test_accepts_plain_dicts_and_rejects_unknown_keys(tmp_path):
    g = {"tool": "torch", "steps": [1], "save_path": str(tmp_path)}
    prof = Profiler(g, {"rollout": {"enable": True, "tool_config": {"torch": {"discrete": True}}}})
    assert prof.enabled and prof.discrete
    with pytest.raises(ConfigError, match="unknown keys.*'discret'"):
        Profiler(g, {"actor": {"enable": True, "tool_config": {"torch": {"discret": True}}}})


@pytest.mark.parametrize(
    "global_kw, role_kw, pattern",
    [
        ({"tool": "torch"}, {}, r"global_profiler\.steps=\[1\]"),
        ({"tool": "npu", "steps": [1]}, {}, r"'npu' is not supported"),
        ({"tool": "torch", "steps": [1]}, {"tool": "nsys"}, r"tools disagree"),
        ({"tool": "torch", "steps": [1]}, {"tool_config": ToolConfig(torch=TorchToolConfig(contents=["gpu"]))}, "gpu"),
    ],
)
def test_bad_configs_fail_with_one_sentence(tmp_path, global_kw, role_kw, pattern):
    with pytest.raises(ConfigError, match=pattern):
        Profiler(GlobalProfilerConfig(save_path=str(tmp_path), **global_kw), _actor(**role_kw))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
@pytest.mark.parametrize("tool", ["torch_memory", "nsys"])
def test_cuda_tools_on_cpu_say_so(tmp_path, tool):
    with pytest.raises(ConfigError, match=f"tool={tool} needs CUDA.*use global_profiler.tool=torch"):
        Profiler(GlobalProfilerConfig(tool=tool, steps=[1], save_path=str(tmp_path)), _actor())


def test_nsys_missing_is_a_config_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("POLYRL_UNDER_NSYS", raising=False)
    with pytest.raises(ConfigError, match="nsys.*not installed"):
        maybe_relaunch_under_nsys(GlobalProfilerConfig(tool="nsys", steps=[1]), ["polyrl", "train"])
    maybe_relaunch_under_nsys(GlobalProfilerConfig(tool="torch", steps=[1]), ["polyrl", "train"])  # not nsys: no-op


def test_nsys_relaunch_command(tmp_path, monkeypatch):
    fake = tmp_path / "nsys"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("POLYRL_UNDER_NSYS", raising=False)
    calls = []
    monkeypatch.setattr(profiler_mod.os, "execvpe", lambda f, args, env: calls.append((f, args, env)))
    g = GlobalProfilerConfig(
        tool="nsys",
        steps=[1, 2],
        save_path=str(tmp_path / "prof"),
        global_tool_config={"nsys": {"worker_nsight_options": {"trace": "cuda,nvtx", "capture-range-end": None}}},
    )
    argv = ["/usr/bin/python3", "-m", "polyrl.cli", "train", "global_profiler.tool=nsys"]
    maybe_relaunch_under_nsys(g, argv)
    (f, args, env), = calls
    assert f == "nsys" and args[:2] == ["nsys", "profile"] and env["POLYRL_UNDER_NSYS"] == "1"
    assert "--capture-range=cudaProfilerApi" in args and "--trace=cuda,nvtx" in args
    assert "--capture-range-end=repeat" in args  # a null option keeps our default
    assert args[-len(argv):] == argv
    # a bare script path gets the interpreter in front
    assert nsys_command(g, ["train.py", "x=1"])[-3:] == [profiler_mod.sys.executable, "train.py", "x=1"]
    # inside the relaunched process it does nothing
    monkeypatch.setenv("POLYRL_UNDER_NSYS", "1")
    maybe_relaunch_under_nsys(g, argv)
    assert len(calls) == 1
