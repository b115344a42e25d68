"""Per-step clocks for the benchmarks' progress lines: Python's garbage collections and the CUDA caching allocator."""

from __future__ import annotations

import gc
import time

import torch


class GCClock:
    """Wall time of Python's garbage collections since the last `pop()`, full (generation 2) and young (0-1) apart: a
    collection walks the live objects of its generations, and a compiled run holds millions (graphs, guards)."""

    def __init__(self):
        self.t0, self.total, self.count = 0.0, [0.0, 0.0], [0, 0]
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.t0 = time.perf_counter()
            return
        full = int(info["generation"] == 2)
        self.total[full] += time.perf_counter() - self.t0
        self.count[full] += 1

    def close(self) -> None:
        gc.callbacks.remove(self._on_gc)

    def pop(self) -> str:
        words = (f"full gc {self.total[1]:.2f} s ({self.count[1]}x), young gc {self.total[0]:.2f} s "
                 f"({self.count[0]}x)")
        self.total, self.count = [0.0, 0.0], [0, 0]
        return words


class AllocatorClock:
    """The CUDA caching allocator since the last `pop()`: retries (an allocation that failed, so every cached block was
    freed and it tried again: slow), cudaMalloc calls, and the GiB allocated now."""

    def __init__(self):
        self.last = self._counts()

    @staticmethod
    def _counts() -> tuple[int, int]:
        if not torch.cuda.is_available():
            return 0, 0
        stats = torch.cuda.memory_stats()
        return stats.get("num_alloc_retries", 0), stats.get("num_device_alloc", 0)

    def pop(self) -> str:
        now = self._counts()
        (retries, mallocs), self.last = (a - b for a, b in zip(now, self.last)), now
        gib = torch.cuda.memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
        return f"allocator retries {retries}, cudaMalloc {mallocs}, {gib:.1f} GiB allocated"
