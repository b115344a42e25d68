"""Arrival counters for kernels whose last program of a group finishes the group's work in the same launch.

A program writes its partial result, then bumps its group's counter (an acq_rel atomic after a barrier); the one that
sees `group size - 1` reads every partial in a fixed order, writes the result and sets the counter back to zero. So
the counters are zero between launches and one buffer serves every such kernel on a device (launches on a stream run
one after another). User: splitk_fp8.py (split-K partial sums).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_COUNTERS: dict[torch.device, torch.Tensor] = {}


def arrival_counters(device: torch.device, n: int) -> torch.Tensor:
    """At least n int32 zeros on `device`, the same buffer on every call that fits it."""
    c = _COUNTERS.get(device)
    if c is None or c.numel() < n:
        c = _COUNTERS[device] = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
    return c


@triton.jit
def last_to_arrive(C, group, n):
    """Called by every program of a group once its partial is stored: True in the one that arrives last."""
    tl.debug_barrier()  # every thread's partial is written before the counter says so
    return tl.atomic_add(C + group, 1, sem="acq_rel") == n - 1


@triton.jit
def reset_arrivals(C, group):
    """The last program, done reading the partials: the counter is zero for the next launch (and graph replay)."""
    tl.atomic_xchg(C + group, 0)
