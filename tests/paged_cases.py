"""Shared cases for the paged-decode tests (v1 and v2 kernels, CPU interpreter and CUDA): block tables over shuffled
pages, the decode metadata, and the float64 attention every kernel is compared with."""

import numpy as np
import torch


def shuffled_block_table(ctx, seq_slots, rows: int, width: int, num_blocks: int, block_size: int, *, seed: int = 0,
                         dtype=np.int64) -> np.ndarray:
    """[rows, width] block table: sequence i (row `seq_slots[i]`) gets ceil(ctx[i] / block_size) distinct pages in a
    shuffled order from 1..num_blocks-1 (block 0 stays free: the engine's scratch block)."""
    bt = np.zeros((rows, width), dtype=dtype)
    perm, used = np.random.default_rng(seed).permutation(np.arange(1, num_blocks)), 0
    for i, c in enumerate(ctx):
        n = -(-int(c) // block_size)
        bt[seq_slots[i], :n] = perm[used : used + n]
        used += n
    return bt


def decode_meta(bt: np.ndarray, seq_slots, ctx, splits: int, device="cpu"):
    """Decode-step metadata for the paged kernels over block table `bt` (`ctx` keeps its numpy dtype)."""
    from polyrl.rollout.native.attention import AttnMeta

    return AttnMeta(slot_mapping=None, decode=True, seq_slots=torch.tensor(np.asarray(seq_slots), device=device),
                    block_tables=torch.tensor(bt, dtype=torch.int32, device=device),
                    context_lens=torch.tensor(np.asarray(ctx), device=device), num_splits=splits, use_kernel=True)


def dequantised(cache: torch.Tensor, scales: torch.Tensor | None = None) -> torch.Tensor:
    """The cache in float64, times its per-(token, head) scales when it is e4m3."""
    out = cache.double()
    return out if scales is None else out * scales.double()[..., None]


def reference_decode(q: torch.Tensor, k64: torch.Tensor, v64: torch.Tensor, bt: np.ndarray, seq_slots, ctx,
                     block_size: int) -> torch.Tensor:
    """[B, H, D] float64: each sequence's query attending over its float64 K/V pages (`dequantised`); zeros for an
    empty context."""
    B, H, D = q.shape
    kvh = k64.shape[2]
    out = torch.zeros(B, H, D, dtype=torch.float64, device=q.device)
    for i, n in enumerate(ctx):
        if n == 0:
            continue
        pos = np.arange(n)
        rows = torch.tensor(bt[seq_slots[i], pos // block_size].astype(np.int64) * block_size + pos % block_size,
                            device=q.device)
        kk = k64.view(-1, kvh, D)[rows].repeat_interleave(H // kvh, 1)
        vv = v64.view(-1, kvh, D)[rows].repeat_interleave(H // kvh, 1)
        att = torch.softmax(torch.einsum("hd,khd->hk", q[i].double(), kk) * D**-0.5, -1)
        out[i] = torch.einsum("hk,khd->hd", att, vv)
    return out
