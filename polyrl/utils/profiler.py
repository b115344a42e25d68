"""Step profiler with verl's config surface (`global_profiler.*` plus per-role `actor_rollout_ref.*.profiler.*`).

The trainer calls `step_start(step)` / `step_end(step)` around each step and passes the profiler to
`StepTimer(hooks=[profiler])`, which calls `stage_start(name)` / `stage_end(name)` around each stage. Stage names
reach every tool through the `record_function` and NVTX annotations StepTimer adds, so no tool needs its own.

Tools (a name->class registry, `TOOLS`):
- `torch`: a Chrome/Perfetto trace JSON per profiled step, `<save_path>/step_<N>[_rank<R>].json`; with
  `tool_config.torch.discrete=True` one per stage, `step_<N>_<stage>[_rank<R>].json`;
- `torch_memory`: a CUDA memory snapshot per profiled step, `step_<N>[_rank<R>].pickle`, for
  https://pytorch.org/memory_viz; needs CUDA;
- `nsys`: `maybe_relaunch_under_nsys` re-executes the command under `nsys profile --capture-range=cudaProfilerApi`
  and the profiler opens the capture range (`cudaProfilerStart/Stop`) around the profiled steps only.

Where we differ from verl, on purpose:
- All roles share one process here (actor, ref and rollout are colocated), so the role configs only decide whether
  this rank profiles and with which tool options; enabled roles' options are merged (contents united, discrete if any).
- A rank profiles when a role has `all_ranks`, or the rank is in `ranks`; empty `ranks` means rank 0, so a recipe
  that forgets `ranks` still gets one trace instead of none.
- Setting only `global_profiler.tool` and `steps` (no role enabled) profiles rank 0, instead of silently nothing.
- `tool` set with `steps` null is an error rather than a run that profiles nothing.
- In discrete mode a stage named `step` (a whole-step envelope, if the trainer times one) gets no trace of its own,
  so the stages inside it do; nested stages are covered by their outermost profiled stage.
When `tool` is null every hook returns at once: no profiler object is ever created.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import typing
from dataclasses import dataclass, field
from typing import Any

import torch

from polyrl.errors import ConfigError

TORCH_CONTENTS = ("cpu", "cuda", "memory", "shapes", "stack")
_CHILD_ENV = "POLYRL_UNDER_NSYS"  # set in the relaunched process so it does not relaunch again


@dataclass
class TorchToolConfig:
    contents: list[str] = field(default_factory=list)
    """What torch.profiler records: any of cpu, cuda, memory, shapes, stack; empty means cpu (+cuda on GPU)."""
    discrete: bool = False
    """One trace per stage (gen, old_log_prob, update_actor, ...) instead of one per step."""


@dataclass
class TorchMemoryToolConfig:
    trace_alloc_max_entries: int = 100_000
    """How many allocation events the CUDA memory history keeps (oldest dropped first)."""
    stack_depth: int = 32
    """Accepted for verl compatibility; torch records whole stacks, and 0 turns stack recording off."""


@dataclass
class NsysToolConfig:
    discrete: bool = False
    """One nsys capture range per stage instead of one per step."""


@dataclass
class ToolConfig:
    torch: TorchToolConfig = field(default_factory=TorchToolConfig)
    """Options of tool=torch."""
    torch_memory: TorchMemoryToolConfig = field(default_factory=TorchMemoryToolConfig)
    """Options of tool=torch_memory."""
    nsys: NsysToolConfig = field(default_factory=NsysToolConfig)
    """Options of tool=nsys."""


@dataclass
class RoleProfilerConfig:
    enable: bool = False
    """Profile this role (actor, ref or rollout)."""
    all_ranks: bool = False
    """Profile on every rank."""
    ranks: list[int] = field(default_factory=list)
    """Ranks to profile when all_ranks is false; empty means rank 0."""
    tool: str | None = None
    """Must match global_profiler.tool when both are set; null inherits it."""
    tool_config: ToolConfig = field(default_factory=ToolConfig)
    """Per-tool options."""


@dataclass
class GlobalProfilerConfig:
    tool: str | None = None
    """torch, torch_memory or nsys; null disables profiling."""
    steps: list[int] | None = None
    """Training steps to profile (1-based), e.g. [1,2,5]."""
    profile_continuous_steps: bool = False
    """Keep one trace open across consecutive profiled steps instead of one per step."""
    save_path: str = "outputs/profile"
    """Directory for traces and snapshots."""
    global_tool_config: dict = field(default_factory=dict)
    """Tool-wide options, e.g. {nsys: {worker_nsight_options: {trace: cuda,nvtx}}}."""


def _as_dataclass(cls: type, value: Any) -> Any:
    """Accepts a config dataclass or a plain dict (e.g. straight from YAML); None means the defaults."""
    if value is None:
        return cls()
    if not isinstance(value, dict):
        return value
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(value) - names)
    if unknown:
        raise ConfigError(f"profiler config has unknown keys {unknown}; valid keys here are {sorted(names)}")
    kwargs = {}
    for name, sub in value.items():
        tp = hints[name]
        kwargs[name] = _as_dataclass(tp, sub) if dataclasses.is_dataclass(tp) else sub
    return cls(**kwargs)


class _TorchTrace:
    """torch.profiler around a window; writes a Chrome trace JSON."""

    suffix = ".json"

    def __init__(self, opts: TorchToolConfig):
        contents = set(opts.contents) or {"cpu", "cuda"}
        self._activities = [torch.profiler.ProfilerActivity.CPU] if "cpu" in contents else []
        if "cuda" in contents and torch.cuda.is_available():
            self._activities.append(torch.profiler.ProfilerActivity.CUDA)
        if not self._activities:  # contents=[cuda] on a CPU machine: still record the annotated stages
            self._activities = [torch.profiler.ProfilerActivity.CPU]
        self._kwargs = dict(
            record_shapes="shapes" in contents, profile_memory="memory" in contents, with_stack="stack" in contents
        )
        self._prof = None

    def start(self) -> None:
        self._prof = torch.profiler.profile(activities=self._activities, **self._kwargs)
        self._prof.__enter__()

    def stop(self, path: str) -> None:
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        prof.export_chrome_trace(path)


class _MemorySnapshot:
    """CUDA caching-allocator history; dumps a snapshot pickle for pytorch.org/memory_viz."""

    suffix = ".pickle"

    def __init__(self, opts: TorchMemoryToolConfig):
        self._opts = opts

    def start(self) -> None:
        torch.cuda.memory._record_memory_history(
            max_entries=self._opts.trace_alloc_max_entries,
            context="all" if self._opts.stack_depth > 0 else None,
            stacks="all",
        )

    def stop(self, path: str) -> None:
        torch.cuda.memory._dump_snapshot(path)
        torch.cuda.memory._record_memory_history(enabled=None)


class _NsysRange:
    """Opens and closes the nsys capture range (the process was launched with --capture-range=cudaProfilerApi)."""

    suffix = ".nsys-rep"

    def __init__(self, opts: NsysToolConfig):
        pass

    def start(self) -> None:
        torch.cuda.synchronize()
        torch.cuda.profiler.start()

    def stop(self, path: str) -> None:  # nsys names its own output files
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()


TOOLS: dict[str, type] = {"torch": _TorchTrace, "torch_memory": _MemorySnapshot, "nsys": _NsysRange}


def _merge_tool_config(roles: list[RoleProfilerConfig]) -> ToolConfig:
    merged = ToolConfig()
    for role in roles:
        tc = role.tool_config
        merged.torch.contents = sorted(set(merged.torch.contents) | set(tc.torch.contents))
        merged.torch.discrete |= tc.torch.discrete
        merged.nsys.discrete |= tc.nsys.discrete
        mem = merged.torch_memory
        mem.trace_alloc_max_entries = max(mem.trace_alloc_max_entries, tc.torch_memory.trace_alloc_max_entries)
        mem.stack_depth = max(mem.stack_depth, tc.torch_memory.stack_depth)
    return merged


def _world_size() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


class Profiler:
    """Profiles the configured steps on this rank; a `StageHooks` for `StepTimer`. No-op when tool is null."""

    def __init__(
        self,
        global_cfg: GlobalProfilerConfig | dict | None,
        role_cfgs: dict[str, RoleProfilerConfig | dict] | None = None,
        rank: int = 0,
    ):
        g = _as_dataclass(GlobalProfilerConfig, global_cfg)
        roles = {name: _as_dataclass(RoleProfilerConfig, c) for name, c in (role_cfgs or {}).items()}
        self.enabled = False
        self.tool = None
        self._backend = None
        enabled_roles = {name: c for name, c in roles.items() if c.enable}
        tools = {g.tool} | {c.tool for c in enabled_roles.values()}
        tools.discard(None)
        if len(tools) > 1:
            raise ConfigError(
                f"profiler tools disagree: global_profiler.tool={g.tool!r} but enabled roles ask for "
                f"{sorted(t for t in tools if t != g.tool)}; set the same tool everywhere or leave the role tool null"
            )
        if not tools:
            return
        (tool,) = tools
        if tool not in TOOLS:
            raise ConfigError(f"global_profiler.tool={tool!r} is not supported; use one of {sorted(TOOLS)} or null")
        if not g.steps:
            raise ConfigError(
                f"global_profiler.tool={tool} needs the steps to profile; set e.g. global_profiler.steps=[1]"
            )
        if tool in ("torch_memory", "nsys") and not torch.cuda.is_available():
            raise ConfigError(
                f"global_profiler.tool={tool} needs CUDA and this machine has no GPU; use global_profiler.tool=torch"
            )
        chosen = list(enabled_roles.values()) or [RoleProfilerConfig(enable=True)]
        if not any(c.all_ranks or rank in (c.ranks or [0]) for c in chosen):
            return
        opts = _merge_tool_config(chosen)
        bad = sorted(set(opts.torch.contents) - set(TORCH_CONTENTS))
        if bad:
            raise ConfigError(
                f"profiler tool_config.torch.contents has {bad}, which torch.profiler does not record; "
                f"use any of {list(TORCH_CONTENTS)}"
            )
        self.enabled = True
        self.tool = tool
        self.steps = set(g.steps)
        self.continuous = g.profile_continuous_steps
        self.discrete = {"torch": opts.torch.discrete, "nsys": opts.nsys.discrete}.get(tool, False)
        self.save_path = g.save_path
        self.rank_suffix = f"_rank{rank}" if (rank > 0 or _world_size() > 1) else ""
        self._backend = TOOLS[tool]({"torch": opts.torch, "torch_memory": opts.torch_memory, "nsys": opts.nsys}[tool])
        self._step: int | None = None  # the step being profiled, if any
        self._first: int | None = None  # first step of the open window (continuous mode)
        self._open_stage: str | None = None
        self._stage_depth = 0
        self._names_used: set[str] = set()
        self.written: list[str] = []  # paths written so far, for the trainer's log line
        os.makedirs(self.save_path, exist_ok=True)

    def _path(self, stem: str) -> str:
        name = f"{stem}{self.rank_suffix}"
        base, n = name, 2
        while name in self._names_used:  # a stage that runs twice in a step
            name, n = f"{base}_{n}", n + 1
        self._names_used.add(name)
        return os.path.join(self.save_path, name + self._backend.suffix)

    def _stop(self, stem: str) -> None:
        path = self._path(stem)
        self._backend.stop(path)
        if os.path.exists(path):
            self.written.append(path)

    def step_start(self, step: int) -> None:
        if not self.enabled or step not in self.steps:
            return
        self._step = step
        if not self.discrete and self._first is None:
            self._first = step
            self._backend.start()

    def step_end(self, step: int) -> None:
        if not self.enabled or self._step != step:
            return
        self._step = None
        if self.discrete or self._first is None:
            return
        if self.continuous and step + 1 in self.steps:
            return  # keep the window open into the next step
        stem = f"step_{self._first}" if self._first == step else f"step_{self._first}-{step}"
        self._first = None
        self._stop(stem)

    def stage_start(self, name: str) -> None:
        if not self.enabled or not self.discrete or self._step is None or name == "step":
            return
        if self._open_stage is None:
            self._open_stage = name
            self._backend.start()
        elif name == self._open_stage:
            self._stage_depth += 1

    def stage_end(self, name: str) -> None:
        if not self.enabled or name != self._open_stage:
            return
        if self._stage_depth:
            self._stage_depth -= 1
            return
        self._open_stage = None
        self._stop(f"step_{self._step}_{name}")

    def close(self) -> None:
        """Ends an open window (a run that stops mid-way through a continuous range still writes its trace)."""
        if not self.enabled:
            return
        if self._open_stage is not None:
            self._open_stage = None
            self._stop(f"step_{self._step}_partial")
        elif self._first is not None:
            first, self._first = self._first, None
            self._stop(f"step_{first}-partial")


def nsys_command(cfg: GlobalProfilerConfig | dict, argv: list[str]) -> list[str]:
    """The `nsys profile ... <command>` line; global_tool_config.nsys.worker_nsight_options override our options."""
    g = _as_dataclass(GlobalProfilerConfig, cfg)
    nsys_cfg = dict(g.global_tool_config.get("nsys") or {})
    user = {k: v for k, v in nsys_cfg.items() if not isinstance(v, dict)}
    user.update(nsys_cfg.get("worker_nsight_options") or {})
    os.makedirs(g.save_path, exist_ok=True)
    opts: dict[str, Any] = {
        "trace": "cuda,nvtx,cublas,osrt",
        "cuda-memory-usage": "true",
        "capture-range-end": "repeat",  # one report per profiled step (or continuous window)
        "force-overwrite": "true",
        "output": os.path.join(os.path.abspath(g.save_path), "polyrl_%p"),
    }
    opts.update({k: v for k, v in user.items() if v is not None})
    opts["capture-range"] = "cudaProfilerApi"  # the profiler opens the range only around profiled steps
    flags = [f"--{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in opts.items()]
    # sys.orig_argv starts with the interpreter; a bare script path (sys.argv[0] under `python x.py`) needs one
    runnable = shutil.which(argv[0]) is not None or (os.access(argv[0], os.X_OK) and not argv[0].endswith(".py"))
    command = list(argv) if runnable else [sys.executable, *argv]
    return ["nsys", "profile", *flags, *command]


def maybe_relaunch_under_nsys(cfg: GlobalProfilerConfig | dict, argv: list[str] | None = None) -> None:
    """With global_profiler.tool=nsys, re-executes this command under nsys (never returns); otherwise returns.

    `argv` is the whole command line including the program, as `sys.orig_argv` (the default) gives it, so
    `python -m polyrl.cli train ...` and the `polyrl` console script both relaunch correctly.
    """
    g = _as_dataclass(GlobalProfilerConfig, cfg)
    if g.tool != "nsys" or not g.steps or os.environ.get(_CHILD_ENV) == "1":
        return
    if shutil.which("nsys") is None:
        raise ConfigError(
            "global_profiler.tool=nsys but nsys (NVIDIA Nsight Systems) is not installed or not on PATH; "
            "install it or use global_profiler.tool=torch"
        )
    command = nsys_command(g, list(argv if argv is not None else sys.orig_argv))
    env = dict(os.environ, **{_CHILD_ENV: "1"})
    print("polyrl: relaunching under nsys: " + " ".join(command), file=sys.stderr, flush=True)
    os.execvpe(command[0], command, env)
