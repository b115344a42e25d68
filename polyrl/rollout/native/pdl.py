"""Programmatic dependent launch (PDL) for the decode step's Triton kernels, on Hopper and later.

A decode step is ~290 short kernels (10 per layer: norms, GEMMs, RoPE/KV write, attention, its combine), and at 17-64
rows most of them run for a few microseconds, so the gap between two kernels is a real share of the step: normally a
kernel is scheduled only once the one before it has completed and its writes are flushed. A kernel launched with PDL
(`launch_pdl=True`, CUDA's programmatic stream serialisation) may be scheduled as soon as the previous kernel's
programs have exited, and its first instruction, `griddepcontrol.wait` (`gdc_wait`), holds it until that kernel has
completed with its memory visible. Every PDL kernel here waits before its first load or store, so reads and writes
happen in the same order as without PDL; only the launch latency overlaps. CUDA-graph capture keeps the dependency
(a programmatic edge). cuBLAS kernels launch as before.

`POLYRL_PDL=0` turns it off (the A/B switch); the interpreter and CPU never use it.
"""

from __future__ import annotations

import functools
import os

import torch

PDL = os.environ.get("POLYRL_PDL", "1") == "1"


@functools.cache
def _capable(index: int) -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "launch_pdl" in CUDAOptions.__dataclass_fields__ and torch.cuda.get_device_capability(index)[0] >= 9


def pdl(t: torch.Tensor) -> bool:
    """Whether kernels reading `t` launch with PDL: a CUDA tensor on sm_90 or later, POLYRL_PDL not 0."""
    if not (PDL and t.is_cuda) or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return _capable(t.device.index if t.device.index is not None else torch.cuda.current_device())
