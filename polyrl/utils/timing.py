"""Stage timing for one RL step, shared by the LLM and diffusion trainers.

`StepTimer.stage("gen")` times a stage under verl's key `timing_s/gen`, wraps it in a named annotation
(`torch.profiler.record_function`, and an NVTX range on CUDA) so every profiler mode sees stage names, and calls
optional hooks (the profiler's discrete mode starts and stops one trace per stage through them).
On CUDA the timer synchronizes at stage boundaries only, never inside a stage.
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator, Protocol

import torch


class StageHooks(Protocol):
    def stage_start(self, name: str) -> None: ...

    def stage_end(self, name: str) -> None: ...


def _sync() -> None:
    # the current stream, not the device: work queued elsewhere (the off-policy pipeline's weight isend, waiting for
    # the rollout process to take it) must not be charged to, or stall, the stage that happens to end next
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.current_stream().synchronize()


class StepTimer:
    """Collects `timing_s/<stage>` for the current step; `pop()` returns and clears them."""

    def __init__(self, hooks: list[StageHooks] | None = None, sync: bool = True):
        """`sync=False`: never synchronize, for a thread that queues no GPU work of its own (the off-policy pipeline's
        scoring thread), which would otherwise wait for the work another thread queued on the same stream."""
        self.hooks = list(hooks or [])
        self.sync = sync
        self._timings: dict[str, float] = {}

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        for h in self.hooks:
            h.stage_start(name)
        nvtx = torch.cuda.is_available() and torch.cuda.is_initialized()
        if nvtx:
            torch.cuda.nvtx.range_push(name)
        if self.sync:
            _sync()
        t0 = time.perf_counter()
        try:
            with torch.profiler.record_function(name):
                yield
        finally:
            if self.sync:
                _sync()
            dt = time.perf_counter() - t0
            if nvtx:
                torch.cuda.nvtx.range_pop()
            key = f"timing_s/{name}"
            self._timings[key] = self._timings.get(key, 0.0) + dt
            for h in reversed(self.hooks):
                h.stage_end(name)

    def add(self, name: str, seconds: float) -> None:
        """Charge `seconds` measured elsewhere (another process's stage) to `timing_s/<name>`."""
        key = f"timing_s/{name}"
        self._timings[key] = self._timings.get(key, 0.0) + seconds

    def pop(self) -> dict[str, float]:
        out, self._timings = self._timings, {}
        return out
