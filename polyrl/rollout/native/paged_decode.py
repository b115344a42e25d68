"""Triton paged-decode attention (one new query token per sequence), CUDA only.

Decode is bound by reading K/V, so the kernel's job is to read each cached byte once: a program owns one
(sequence, kv head, split) and loads TILE tokens of K and V at a time through the block table; the GQA group's q heads
(padded to 16 rows for `tl.dot`) share that read. Split-K (flash-decoding) keeps the GPU busy when few sequences
remain (the long tail): each split writes a normalised partial output and its log-sum-exp, and `_combine_kernel`
merges them exactly (one launch; the same merge in torch was 4 kernels and ~16 us per layer on an H200).
Zero-length rows (CUDA-graph padding) write zeros. With one split the kernel writes the final output in the
activation dtype itself (no fp32 buffer, no cast kernel: one launch fewer per layer).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from polyrl.rollout.native.attention import AttnMeta
from polyrl.rollout.native.fused import _head_norm, _rope


@triton.jit
def _paged_decode_kernel(
    Q, K, V, SeqSlots, BT, CL, O, LSE, scale,
    stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_bt,
    stride_ot, stride_oh, stride_os,
    POS, COS, SIN, SLOT, QW, KW, eps,
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, TILE: tl.constexpr,
    SPLITS: tl.constexpr, IEEE: tl.constexpr, ROPE: tl.constexpr, HAS_NORM: tl.constexpr, H: tl.constexpr,
    KVH: tl.constexpr,
):
    # SPLITS == 1: O is [T, H, D] in the activation dtype and LSE is unused; else O is fp32 [T, H, SPLITS, D].
    # ROPE: Q is the raw qkv projection [T, (H + 2 KVH) * D]; the kernel applies the optional q/k RMSNorm and RoPE
    # (same rounding as fused.rope_kv), split 0 writes this token's K/V to the cache, and every split that covers the
    # new position attends to it from registers (no split reads a slot another program of this launch writes).
    s = tl.program_id(0)
    kh = tl.program_id(1)
    sp = tl.program_id(2)
    ctx = tl.load(CL + s)
    row = tl.load(SeqSlots + s).to(tl.int64)
    per = tl.cdiv(tl.cdiv(ctx, SPLITS), TILE) * TILE
    lo = sp * per
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    heads = kh * G + g
    gm = g < G
    if ROPE:
        HALF: tl.constexpr = D // 2
        dt = Q.dtype.element_ty
        hh = tl.arange(0, HALF)
        pos = tl.load(POS + s)
        c = tl.load(COS + pos * D + hh).to(dt).to(tl.float32)[None, :]
        sn = tl.load(SIN + pos * D + hh).to(dt).to(tl.float32)[None, :]
        qrow = Q + s.to(tl.int64) * stride_qt
        q1 = tl.load(qrow + heads[:, None] * D + hh[None, :], mask=gm[:, None], other=0.0).to(tl.float32)
        q2 = tl.load(qrow + heads[:, None] * D + HALF + hh[None, :], mask=gm[:, None], other=0.0).to(tl.float32)
        krow = qrow + (H + kh) * D
        k1 = tl.load(krow + hh)[None, :].to(tl.float32)
        k2 = tl.load(krow + HALF + hh)[None, :].to(tl.float32)
        if HAS_NORM:
            q1, q2 = _head_norm(q1, q2, QW, eps, HALF, D)
            k1, k2 = _head_norm(k1, k2, KW, eps, HALF, D)
        q1, q2 = _rope(q1, q2, c, sn, dt)
        k1, k2 = _rope(k1, k2, c, sn, dt)
        v_new = tl.load(qrow + (H + KVH + kh) * D + d)
        if sp == 0:
            slot = tl.load(SLOT + s).to(tl.int64)
            dst = (slot // BS) * stride_kb + (slot % BS) * stride_kt + kh * stride_kh
            tl.store(K + dst + hh[None, :], k1)
            tl.store(K + dst + HALF + hh[None, :], k2)
            tl.store(V + dst + d, v_new)
        q = tl.reshape(tl.permute(tl.join(q1, q2), (0, 2, 1)), (GP, D))
        hi = tl.minimum(ctx - 1, lo + per)  # cached tokens; the new one (position ctx - 1) is added below
    else:
        q = tl.load(Q + s * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=gm[:, None], other=0.0)
        hi = tl.minimum(ctx, lo + per)
    m = tl.full([GP], float("-inf"), tl.float32)
    l = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    for start in range(lo, hi, TILE):
        t = start + tl.arange(0, TILE)
        tm = t < hi
        blk = tl.load(BT + row * stride_bt + t // BS, mask=tm, other=0).to(tl.int64)
        off = blk * stride_kb + (t % BS) * stride_kt + kh * stride_kh
        k = tl.load(K + off[:, None] + d[None, :], mask=tm[:, None], other=0.0)
        v = tl.load(V + off[:, None] + d[None, :], mask=tm[:, None], other=0.0)
        if IEEE:
            sc = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        else:
            sc = tl.dot(q, tl.trans(k)) * scale
        sc = tl.where(tm[None, :], sc, float("-inf"))
        m_new = tl.maximum(m, tl.max(sc, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(sc - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    if ROPE:  # the new token, in the split whose range covers position ctx - 1
        mine = (ctx > 0) & (lo <= ctx - 1) & (ctx - 1 < lo + per)
        sc = tl.sum(q1.to(tl.float32) * k1.to(tl.float32), 1) + tl.sum(q2.to(tl.float32) * k2.to(tl.float32), 1)
        sc = sc * scale
        m_new = tl.where(mine, tl.maximum(m, sc), m)
        alpha = tl.where(mine, tl.exp(m - m_new), 1.0)  # m may still be -inf (no cached token in this split)
        p = tl.where(mine, tl.exp(sc - m_new), 0.0)
        l = l * alpha + p
        acc = acc * alpha[:, None] + p[:, None] * v_new.to(tl.float32)[None, :]
        m = m_new
    has = l > 0
    out = acc / tl.where(has, l, 1.0)[:, None]
    lse = tl.where(has, m + tl.log(tl.where(has, l, 1.0)), -1e30)
    o_ptr = O + s * stride_ot + heads[:, None] * stride_oh + sp * stride_os + d[None, :]
    tl.store(o_ptr, out.to(O.dtype.element_ty), mask=gm[:, None])
    if SPLITS > 1:
        tl.store(LSE + (s * (G * tl.num_programs(1)) + heads) * SPLITS + sp, lse, mask=gm)


@triton.jit
def _combine_kernel(O, LSE, OUT, SPLITS: tl.constexpr, SP: tl.constexpr, D: tl.constexpr):
    # one program per (token, head): out = sum_s softmax(lse)_s * o_s over the splits (empty splits have lse -1e30)
    r = tl.program_id(0).to(tl.int64)
    sp = tl.arange(0, SP)
    d = tl.arange(0, D)
    lse = tl.load(LSE + r * SPLITS + sp, mask=sp < SPLITS, other=float("-inf"))
    w = tl.exp(lse - tl.max(lse, 0))
    w = w / tl.sum(w, 0)
    o = tl.load(O + (r * SPLITS + sp[:, None]) * D + d[None, :], mask=(sp < SPLITS)[:, None], other=0.0)
    tl.store(OUT + r * D + d, tl.sum(o * w[:, None], 0).to(OUT.dtype.element_ty))


# launch knobs, tuned on H100/H200 by `benchmarks/rollout.py --tune-decode` (see benchmarks/NOTES_rollout.md)
# (an all-kv-heads-per-program variant reading each page as one contiguous run measured the same 67 us: dropped)
CONFIG = dict(tile=64, num_warps=4, num_stages=3, programs_per_sm=1)


def paged_decode(q_THD: torch.Tensor, k_cache, v_cache, meta: AttnMeta, scale: float) -> torch.Tensor:
    """Attention of one roped query per sequence over its cached K/V (this step's K/V already in the cache)."""
    T, H, D = q_THD.shape
    return _launch(q_THD, k_cache, v_cache, meta, scale, H, D, None)


def paged_decode_rope(qkv_TX: torch.Tensor, positions_T, cos_table, sin_table, k_cache, v_cache, meta: AttnMeta,
                      scale: float, num_heads: int, q_norm_w=None, k_norm_w=None, eps: float = 0.0) -> torch.Tensor:
    """`fused.rope_kv` and `paged_decode` in one launch: from the raw qkv projection, apply the optional q/k RMSNorm
    and RoPE, write this step's K/V to the cache and attend (one kernel fewer per layer)."""
    D = k_cache.shape[3]
    rope = (positions_T, cos_table, sin_table, meta.slot_mapping, q_norm_w, k_norm_w, eps)
    return _launch(qkv_TX, k_cache, v_cache, meta, scale, num_heads, D, rope)


def _launch(q, k_cache, v_cache, meta: AttnMeta, scale: float, H: int, D: int, rope) -> torch.Tensor:
    T = q.shape[0]
    kvh = k_cache.shape[2]
    G = H // kvh
    splits = meta.num_splits
    if splits == 1:  # final output straight from the kernel, in the activation dtype
        o = torch.empty(T, H, 1, D, device=q.device, dtype=q.dtype)
        lse = o  # not written
    else:
        o = torch.empty(T, H, splits, D, device=q.device, dtype=torch.float32)
        lse = torch.empty(T, H, splits, device=q.device, dtype=torch.float32)
    if rope is None:
        pos, cos, sin, slot, qw, kw, eps = (meta.context_lens,) * 4 + (q, q, 0.0)  # unused
    else:
        pos, cos, sin, slot, qw, kw, eps = rope
    has_norm = rope is not None and qw is not None
    _paged_decode_kernel[(T, kvh, splits)](
        q, k_cache, v_cache, meta.seq_slots, meta.block_tables, meta.context_lens, o, lse, scale,
        q.stride(0), q.stride(1) if rope is None else D, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        meta.block_tables.stride(0), o.stride(0), o.stride(1), o.stride(2),
        pos, cos, sin, slot, qw if has_norm else q, kw if has_norm else q, eps,
        G=G, GP=max(16, triton.next_power_of_2(G)), D=D, BS=k_cache.shape[1], TILE=CONFIG["tile"], SPLITS=splits,
        IEEE=q.dtype == torch.float32, ROPE=rope is not None, HAS_NORM=has_norm, H=H, KVH=kvh,
        num_warps=CONFIG["num_warps"], num_stages=CONFIG["num_stages"],
    )  # fmt: skip
    if splits == 1:
        return o[:, :, 0]
    out = torch.empty(T, H, D, device=q.device, dtype=q.dtype)
    _combine_kernel[(T * H,)](o, lse, out, SPLITS=splits, SP=triton.next_power_of_2(splits), D=D, num_warps=4)
    return out


def choose_num_splits(batch: int, num_kv_heads: int, num_sms: int) -> int:
    """Enough (seq, head, split) programs for `programs_per_sm` per SM; 1 when the batch alone gives that."""
    want = CONFIG["programs_per_sm"] * num_sms
    return max(1, min(16, -(-want // max(1, batch * num_kv_heads))))
