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


def rope_decode_step(qkv, k, v, scales, bt, seq_slots, ctx, splits, num_heads, block_size, fused, device="cpu",
                     norms=None):
    """One decode step from the qkv GEMM's output on copies of the caches: v2's `paged_decode_rope` (fused) or fused.py's
    rope_kv then v2's `paged_decode`; `norms` (q and k RMSNorm weights, Qwen3) first. Each row's new token is at
    position ctx - 1 (an empty row: CUDA-graph padding at slot 0). Returns (output, the caches' bytes past block 0
    (where rope_kv writes padding rows), positions, new slots, cos, sin)."""
    from polyrl.rollout.native import paged_decode_v2 as v2
    from polyrl.rollout.native.fused import rope_kv

    D = k.shape[-1]
    ctx = np.asarray(ctx)
    pos = torch.tensor(np.maximum(ctx - 1, 0), device=device)
    new = torch.tensor([bt[r, (n - 1) // block_size] * block_size + (n - 1) % block_size if n else 0
                        for r, n in zip(seq_slots, ctx)], device=device)
    freqs = torch.arange(4096.0)[:, None] * (1e4 ** (-torch.arange(0, D, 2) / D))[None, :]
    cos, sin = (f(torch.cat([freqs, freqs], -1)).to(device) for f in (torch.cos, torch.sin))
    kc, vc = k.clone(), v.clone()
    ks, vs = (s.clone() for s in scales) if scales is not None else (None, None)
    meta = decode_meta(bt, seq_slots, ctx, splits, device)
    meta.slot_mapping = new
    qn, kn = norms or (None, None)
    if fused:
        out = v2.paged_decode_rope(qkv, pos, cos, sin, kc, vc, meta, D**-0.5, num_heads, ks, vs, qn, kn, 1e-6)
    else:
        q = rope_kv(qkv, pos, cos, sin, kc, vc, new, num_heads, k.shape[2], D, qn, kn, 1e-6, k_scale=ks, v_scale=vs)
        out = v2.paged_decode(q, kc, vc, meta, D**-0.5, ks, vs)
    return out, [x[1:].view(torch.uint8) for x in (kc, vc, ks, vs) if x is not None], pos, new, cos, sin
