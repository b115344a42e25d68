"""Refcounted KV blocks: the paged cache's host-side bookkeeping.

Block 0 is a scratch block that is never handed out: padded rows of a CUDA-graph batch write their K/V there.
A prompt's n samples share its full blocks (refcount n); the last, partly filled prompt block is copied per sample
because each sample appends its own tokens to it. A block returns to the free list when its refcount reaches 0.
"""

from __future__ import annotations


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 2:
            raise ValueError(f"the KV cache has {num_blocks} blocks; it needs at least 2 (raise the memory budget).")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.ref = [0] * num_blocks
        self.free: list[int] = list(range(num_blocks - 1, 0, -1))  # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        return len(self.free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, n: int) -> list[int]:
        assert n <= len(self.free), (n, len(self.free))
        out = [self.free.pop() for _ in range(n)]
        for b in out:
            self.ref[b] = 1
        return out

    def share(self, blocks: list[int]) -> list[int]:
        for b in blocks:
            assert self.ref[b] > 0
            self.ref[b] += 1
        return list(blocks)

    def release(self, blocks: list[int]) -> None:
        for b in blocks:
            self.ref[b] -= 1
            assert self.ref[b] >= 0, b
            if self.ref[b] == 0:
                self.free.append(b)
        blocks.clear()

    def all_free(self) -> bool:
        return len(self.free) == self.num_blocks - 1 and not any(self.ref[1:])
