"""A test hook that raises `torch.OutOfMemoryError` inside a named stage, and the test for "is this an OOM".

`POLYRL_INJECT_OOM="stage[:times[:at]]"` raises at the `at`-th (default 1st) `oom_point()` of each of the first
`times` (default 1, `*` = every) attempts of `stage` (gen, old_log_prob, ref, update_actor; trainer/oom.py runs them
and sets `ACTIVE`). Point 1 is the stage's start; every policy forward (`actor.logprobs_and_entropy`) is one more, so
`update_actor:1:3` fails the second micro-batch's forward after the first one's backward. No config key: tests and
the GPU sweep set the variable.
"""

from __future__ import annotations

import os
from typing import Any

import torch

INJECT_ENV = "POLYRL_INJECT_OOM"

ACTIVE: dict[str, Any] = {"stage": None, "attempt": 0, "point": 0}


def _inject_spec() -> tuple[str, float, int] | None:
    spec = os.environ.get(INJECT_ENV, "")
    if not spec:
        return None
    stage, times, at = (spec.split(":") + ["1", "1"])[:3]
    return stage, (float("inf") if times == "*" else int(times)), int(at)


def oom_point() -> None:
    """Where a stage allocates: raises the injected OOM when POLYRL_INJECT_OOM asks for this stage and point."""
    if ACTIVE["stage"] is None:
        return
    ACTIVE["point"] += 1
    spec = _inject_spec()
    if spec and spec[0] == ACTIVE["stage"] and ACTIVE["attempt"] < spec[1] and ACTIVE["point"] == spec[2]:
        raise torch.OutOfMemoryError(f"injected by {INJECT_ENV}={os.environ[INJECT_ENV]}")


def is_oom(e: BaseException) -> bool:
    """CUDA OOM, including allocation failures that reach us as RuntimeError (cuBLAS workspaces, Triton)."""
    return isinstance(e, torch.OutOfMemoryError) or (isinstance(e, RuntimeError) and (
        "out of memory" in str(e).lower() or "CUBLAS_STATUS_ALLOC_FAILED" in str(e)))
