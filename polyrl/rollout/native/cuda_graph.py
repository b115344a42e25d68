"""CUDA graphs for the decode forward, one per batch size in a fixed set (a batch pads up to the next size).

Decode at small models is launch-bound (hundreds of small kernels per step), so each captured size replays the whole
forward (embedding, all layers, paged attention, LM head) as one graph. Inputs are read from static buffers the
engine fills before `run`; the graph's logits tensor is returned (it is overwritten by the next replay). The graphs
share one memory pool. They hold pointers into the KV cache and the weights, so `release_memory` drops them and the
next `generate` captures again, lazily (see `DecodeGraphs`).
"""

from __future__ import annotations

import bisect
import time
from collections import Counter
from typing import Callable

import torch


def default_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512, 640, 768, 896]
    sizes = [b for b in sizes if b < max_num_seqs] + [max_num_seqs]
    return sizes


CAPTURE_AFTER = 16  # steps a batch size must be asked for before it gets a graph of its own


class DecodeGraphs:
    """Captured lazily: a batch size is captured the first time a step needs it, so a `release_memory`/`resume`
    cycle (every RL step with `free_cache_engine=True`) pays only for the sizes the next rollout actually uses
    (measured on an H200: capturing all 17 sizes up front added 0.33 s to a 1.0 s rollout).

    And only where a call uses it for a while: while a larger size is captured, a smaller one replays that graph
    (padding rows are cheap) until one `generate` call has asked for it `CAPTURE_AFTER` times (`new_call` resets the
    counts). A short rollout whose batch shrinks through many sizes as rows stop (SmolLM2's 32-token answers on an
    H100: ~20 captures, 0.7 s of a 0.8 s rollout) then captures one graph, in every call; a long tail at a size still
    gets its own graph after a few steps. (Counted over calls instead, those sizes all reached the count together
    some steps later and were captured in one 0.57 s rollout.)"""

    def __init__(self, forward: Callable[[int], torch.Tensor], batch_sizes: list[int]):
        self.forward = forward
        self.sizes = sorted(batch_sizes)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.asked: Counter[int] = Counter()
        self.pool = None  # one memory pool shared by every captured size
        self.capture_s = 0.0

    def new_call(self) -> None:
        self.asked.clear()

    def size_for(self, batch: int) -> int:
        """The graph size a step of `batch` rows runs at (the engine pads its inputs to it, then calls `run`)."""
        i = bisect.bisect_left(self.sizes, batch)
        assert i < len(self.sizes), (batch, self.sizes)
        bs = self.sizes[i]
        if bs in self.graphs:
            return bs
        self.asked[bs] += 1
        larger = [s for s in self.graphs if s > bs]
        return min(larger) if larger and self.asked[bs] < CAPTURE_AFTER else bs

    def run(self, size: int) -> torch.Tensor:
        """Replay the graph of `size` rows (a size from `size_for`), capturing it first if it is new."""
        if size not in self.graphs:
            self._capture(size)
        self.graphs[size].replay()
        return self.outputs[size]

    def _capture(self, bs: int) -> None:
        t0 = time.perf_counter()
        # warm-up outside capture (Triton compiles, cuBLAS picks kernels); it reads the static inputs this step
        # filled and rewrites the same K/V slots the replay writes, so running it mid-rollout changes nothing
        self.forward(bs)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool):
            self.outputs[bs] = self.forward(bs)
        self.pool = g.pool()
        self.graphs[bs] = g
        self.capture_s += time.perf_counter() - t0
