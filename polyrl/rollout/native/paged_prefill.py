"""Prefill attention straight from the paged KV cache, one launch a layer, CUDA (on unless
`engine_kwargs.native.prefill_kernel=False`).

A prefill step attends each sequence's chunk of new tokens (positions start .. start + len - 1) to its context so far
(positions 0 .. start + len - 1, the chunk's own K/V already written by rope_kv), causally. The gather path
(`attention.gather_attention`) copies every context into a padded [S, K] batch, dequantises it (FP8 KV), expands the
GQA heads and calls SDPA: about fifteen torch ops a layer. At a 1.5B model's 8,192-token chunks that makes prefill
bound by the host's launches, not the GPU: (a)'s prompts took 0.31-0.43 s of GPU time against 0.23 s of kernels,
with ~2,700 idle gaps of 20-100 us between them (`seed_workloads.py --prefill-kernels`, H100, 2026-11-27), and
16k-token chunks (a quarter of the launches per token) took 0.24 s.

A program here owns one (sequence, block of BQ chunk tokens, q head): it loads its q rows once and walks the context
in tiles of BK tokens with the decode kernel v1's step (`paged_decode.token_tile`: a block-table entry per token, an
online softmax in fp32). FP8 KV as in the decode kernels: e4m3 bytes upcast to fp16 in registers (q too), K's
per-(token, head) scale on the score column, V's on the probability column before P.V; nothing dequantised in
memory. The q heads of a GQA group read the same K/V tiles, from L2 after the first.

Measured (H100, 2026-11-27, A/B one process each; fp8_fused_session.sh in git log): (a)'s prefill 0.22 against 0.25 s
in FP8 KV + W8 (73.4k against 72.4k tok/s end to end), 0.32 / 0.34 s in bf16, s2's (Llama-8B, 128 x 1,024-token
prompts) 0.43 / 0.47 s. Against the gather path's attention on the same cache: 4e-3 (bf16) and 1.3e-2 (e4m3) largest
relative error per row; the engine's log-prob gap to HF 6.1e-3 against 5.9e-3 (bf16) and 6.3e-2 against 6.1e-2 (FP8)
on the 1.5B-MLP test model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from polyrl.rollout.native.paged_decode import token_tile

if TYPE_CHECKING:
    from polyrl.rollout.native.attention import AttnMeta

BQ, BK = 64, 64  # chunk tokens a program owns; context tokens a step reads
NUM_WARPS, NUM_STAGES = 4, 2


@triton.jit
def _paged_prefill_kernel(
    Q, K, V, KS, VS, BT, Rows, O, scale, S,
    stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_bt, stride_ot, stride_oh,
    G: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, BQ: tl.constexpr, BK: tl.constexpr,
    FP8: tl.constexpr, IEEE: tl.constexpr,
):
    # Rows: [4, S] int64, per sequence: its block-table row, its first token's row in Q, the chunk's first position,
    # the chunk's length
    s = tl.program_id(0)
    qb = tl.program_id(1)
    h = tl.program_id(2)
    n = tl.load(Rows + 3 * S + s)
    if qb * BQ < n:
        bt_row = BT + tl.load(Rows + s) * stride_bt
        q0 = tl.load(Rows + S + s)
        start = tl.load(Rows + 2 * S + s)
        kvh = h // G
        i = qb * BQ + tl.arange(0, BQ)
        d = tl.arange(0, D)
        q_ok = i < n
        q = tl.load(Q + (q0 + i)[:, None] * stride_qt + h * stride_qh + d[None, :], mask=q_ok[:, None], other=0.0)
        if FP8:
            if not IEEE:  # e4m3 -> fp16 is one native conversion on Hopper
                q = q.to(tl.float16)
        q_pos = start + i
        hi = start + tl.minimum(n, qb * BQ + BQ)  # the block's last query sees positions below this
        m = tl.full([BQ], float("-inf"), tl.float32)
        l = tl.zeros([BQ], tl.float32)
        acc = tl.zeros([BQ, D], tl.float32)
        for k0 in range(0, hi, BK):
            j = k0 + tl.arange(0, BK)
            k_ok = j < hi
            m, l, acc = token_tile(q, m, l, acc, j, k_ok, (j[None, :] <= q_pos[:, None]) & k_ok[None, :], bt_row, K,
                                   V, KS, VS, scale, stride_kb, stride_kt, kvh * stride_kh, kvh, d, BS, KVH, IEEE, FP8)
        out = acc / l[:, None]  # every query sees at least its own position
        o_ptr = O + (q0 + i)[:, None] * stride_ot + h * stride_oh + d[None, :]
        tl.store(o_ptr, out.to(O.dtype.element_ty), mask=q_ok[:, None])


def paged_prefill(q_THD: torch.Tensor, k_cache, v_cache, meta: AttnMeta, scale: float, k_scale=None,
                  v_scale=None) -> torch.Tensor:
    """Causal attention of a prefill step's tokens [T, H, D] over their sequences' paged context (`meta.prefill_rows`,
    `meta.max_q`); the chunk's own K/V are in the cache already. Returns [T, H, D] in q's dtype."""
    T, H, D = q_THD.shape
    kvh, bs = k_cache.shape[2], k_cache.shape[1]
    rows = meta.prefill_rows
    S = rows.shape[1]
    o = torch.empty_like(q_THD)
    fp8 = k_scale is not None
    _paged_prefill_kernel[(S, triton.cdiv(meta.max_q, BQ), H)](
        q_THD, k_cache, v_cache, k_scale if fp8 else q_THD, v_scale if fp8 else q_THD, meta.block_tables, rows, o,
        scale, S, q_THD.stride(0), q_THD.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        meta.block_tables.stride(0), o.stride(0), o.stride(1),
        G=H // kvh, KVH=kvh, D=D, BS=bs, BQ=BQ, BK=BK, FP8=fp8, IEEE=q_THD.dtype == torch.float32,
        num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )
    return o
