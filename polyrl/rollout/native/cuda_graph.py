"""CUDA graphs for the decode forward, one per batch size in a fixed set (a batch pads up to the next size).

Decode at small models is launch-bound (hundreds of small kernels per step), so each captured size replays the whole
forward (embedding, all layers, paged attention, LM head) as one graph. Inputs are read from static buffers the
engine fills before `run`; the graph's logits tensor is returned (it is overwritten by the next replay). The graphs
share one memory pool, captured largest first. They hold pointers into the KV cache and the weights, so
`release_memory` drops them and the next `generate` captures again.
"""

from __future__ import annotations

import bisect
from typing import Callable

import torch


def default_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512]
    sizes = [b for b in sizes if b < max_num_seqs] + [max_num_seqs]
    return sizes


class DecodeGraphs:
    def __init__(self, forward: Callable[[int], torch.Tensor], batch_sizes: list[int]):
        self.sizes = sorted(batch_sizes)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        pool = None
        for bs in reversed(self.sizes):
            forward(bs)  # warm-up outside capture: Triton compiles, cuBLAS picks kernels
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                self.outputs[bs] = forward(bs)
            pool = g.pool()
            self.graphs[bs] = g
        torch.cuda.synchronize()

    def padded(self, batch: int) -> int:
        i = bisect.bisect_left(self.sizes, batch)
        assert i < len(self.sizes), (batch, self.sizes)
        return self.sizes[i]

    def run(self, batch: int) -> torch.Tensor:
        bs = self.padded(batch)
        self.graphs[bs].replay()
        return self.outputs[bs]
