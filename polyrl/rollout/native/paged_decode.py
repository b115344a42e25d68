"""Triton paged-decode attention (one new query token per sequence), CUDA only.

Decode is bound by reading K/V, so the kernel's job is to read each cached byte once: a program owns one
(sequence, kv head, split) and loads TILE tokens of K and V at a time through the block table; the GQA group's q heads
(padded to 16 rows for `tl.dot`) share that read. Split-K (flash-decoding) keeps the GPU busy when few sequences
remain (the long tail): each split writes a normalised partial output and its log-sum-exp, and `_combine_kernel`
merges them exactly (one launch; the same merge in torch was 4 kernels and ~16 us per layer on an H200).
Zero-length rows (CUDA-graph padding) write zeros. With one split the kernel writes the final output in the
activation dtype itself (no fp32 buffer, no cast kernel: one launch fewer per layer).

FP8 KV (`attention.py` explains the per-(token, head) scales): the kernel loads the e4m3 bytes (half the bf16 bytes,
the point of it), upcasts in registers (to fp16, a single conversion instruction on Hopper, with q cast to fp16
once; scores and the softmax stay fp32), multiplies the score column by K's scales and the probability column by V's
scales before the P.V product, so there is never a dequantised copy in memory.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

if TYPE_CHECKING:  # attention.py imports this module when the kernel is on
    from polyrl.rollout.native.attention import AttnMeta


@triton.jit
def attend(q, k, v, k_sc, v_sc, keep, m, l, acc, scale, IEEE: tl.constexpr, FP8: tl.constexpr):
    """One online-softmax step of q's rows over loaded K/V rows (in q's dtype): scores scaled by `scale`, or with FP8
    by K's per-row scales `k_sc` (scale folded in); only `keep` ([rows, K/V rows]) counts, the rest is -inf; with FP8
    the probabilities take V's scales `v_sc` before P.V. Returns the new (max, sum, accumulator). Shared by every
    paged attention kernel (v1's and the prefill kernel's `token_tile`, v2's page-wise `_step`)."""
    if IEEE:
        sc = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        sc = tl.dot(q, tl.trans(k))
    if FP8:
        sc = sc * k_sc[None, :]
    else:
        sc = sc * scale
    sc = tl.where(keep, sc, float("-inf"))
    m_new = tl.maximum(m, tl.max(sc, 1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(sc - m_new[:, None])
    l = l * alpha + tl.sum(p, 1)
    if FP8:
        p = p * v_sc[None, :]
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l, acc


@triton.jit
def token_tile(q, m, l, acc, t, tm, keep, bt_row, K, V, KS, VS, scale, stride_kb, stride_kt, kv_off, kvh, d,
               BS: tl.constexpr, KVH: tl.constexpr, IEEE: tl.constexpr, FP8: tl.constexpr):
    """`attend` over the cache tokens at positions t (a block-table entry each, from `bt_row`; tm: the tokens to read,
    kv head `kvh` at `kv_off` within a token's row); `keep`: [rows, tokens], the scores that count. Used by this
    kernel and by `paged_prefill.py`'s. FP8: e4m3 bytes -> q's dtype in registers, with their per-(token, head)
    scales."""
    blk = tl.load(bt_row + t // BS, mask=tm, other=0).to(tl.int64)
    off = blk * stride_kb + (t % BS) * stride_kt + kv_off
    k = tl.load(K + off[:, None] + d[None, :], mask=tm[:, None], other=0.0)
    v = tl.load(V + off[:, None] + d[None, :], mask=tm[:, None], other=0.0)
    k_sc = scale  # unused without FP8
    v_sc = scale
    if FP8:
        soff = (blk * BS + t % BS) * KVH + kvh
        k_sc = tl.load(KS + soff, mask=tm, other=0.0) * scale
        v_sc = tl.load(VS + soff, mask=tm, other=0.0)
        k = k.to(q.dtype)
        v = v.to(q.dtype)
    return attend(q, k, v, k_sc, v_sc, keep, m, l, acc, scale, IEEE, FP8)


# SPLITS is a runtime argument that Triton must not specialise: it follows the batch size (few rows, many splits), and
# as a constexpr each new value would compile both kernels again mid-rollout. (SmolLM2-135M's slow steps 6-10 on an
# H100, once suspected of this, turned out to be CUDA-graph captures of new batch sizes: cuda_graph.py.)
# MULTI = SPLITS > 1 stays a constexpr: the one-split variant writes the final output in the activation dtype.
@triton.jit(do_not_specialize=["SPLITS"])
def _paged_decode_kernel(
    Q, K, V, KS, VS, SeqSlots, BT, CL, O, LSE, scale,
    stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_bt,
    stride_ot, stride_oh, stride_os, SPLITS,
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, TILE: tl.constexpr,
    MULTI: tl.constexpr, IEEE: tl.constexpr, FP8: tl.constexpr, KVH: tl.constexpr,
):
    # MULTI False (SPLITS == 1): O is [T, H, D] in the activation dtype and LSE is unused; else O is fp32
    # [T, H, SPLITS, D]
    s = tl.program_id(0)
    kh = tl.program_id(1)
    sp = tl.program_id(2)
    ctx = tl.load(CL + s)
    row = tl.load(SeqSlots + s).to(tl.int64)
    per = tl.cdiv(tl.cdiv(ctx, SPLITS), TILE) * TILE
    lo = sp * per
    hi = tl.minimum(ctx, lo + per)
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    heads = kh * G + g
    q = tl.load(Q + s * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=(g < G)[:, None], other=0.0)
    if FP8:
        if not IEEE:  # e4m3 -> fp16 is one native conversion on Hopper (-> bf16 goes through fp16)
            q = q.to(tl.float16)
    m = tl.full([GP], float("-inf"), tl.float32)
    l = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    bt_row = BT + row * stride_bt
    for start in range(lo, hi, TILE):
        t = start + tl.arange(0, TILE)
        tm = t < hi
        m, l, acc = token_tile(q, m, l, acc, t, tm, tm[None, :], bt_row, K, V, KS, VS, scale, stride_kb, stride_kt,
                               kh * stride_kh, kh, d, BS, KVH, IEEE, FP8)
    has = l > 0
    out = acc / tl.where(has, l, 1.0)[:, None]
    lse = tl.where(has, m + tl.log(tl.where(has, l, 1.0)), -1e30)
    gm = g < G
    o_ptr = O + s * stride_ot + heads[:, None] * stride_oh + sp * stride_os + d[None, :]
    tl.store(o_ptr, out.to(O.dtype.element_ty), mask=gm[:, None])
    if MULTI:
        tl.store(LSE + (s * (G * tl.num_programs(1)) + heads) * SPLITS + sp, lse, mask=gm)


@triton.jit(do_not_specialize=["SPLITS"])
def _combine_kernel(O, LSE, OUT, SPLITS, SP: tl.constexpr, D: tl.constexpr, CHUNK: tl.constexpr):
    # one program per (token, head): out = sum_s softmax(lse)_s * o_s over the splits. Empty splits (lse -1e30, from
    # splits past a short context) get weight 0 and their partials are never read, so many splits cost little there.
    r = tl.program_id(0).to(tl.int64)
    sp = tl.arange(0, SP)
    d = tl.arange(0, D)
    lse = tl.load(LSE + r * SPLITS + sp, mask=sp < SPLITS, other=float("-inf"))
    mx = tl.max(lse, 0)
    total = tl.sum(tl.exp(lse - mx), 0)
    acc = tl.zeros([D], tl.float32)
    for s0 in range(0, SPLITS, CHUNK):
        c = s0 + tl.arange(0, CHUNK)
        lc = tl.load(LSE + r * SPLITS + c, mask=c < SPLITS, other=float("-inf"))
        live = (c < SPLITS) & (lc > -1e29)
        w = tl.where(live, tl.exp(lc - mx), 0.0)
        o = tl.load(O + (r * SPLITS + c[:, None]) * D + d[None, :], mask=live[:, None], other=0.0)
        acc += tl.sum(o * w[:, None], 0)
    tl.store(OUT + r * D + d, (acc / total).to(OUT.dtype.element_ty))


def combine_splits(o: torch.Tensor, lse: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Merge split-K partials o [T, H, SPLITS, D] (fp32) with their log-sum-exps [T, H, SPLITS] into out [T, H, D]."""
    T, H, splits, D = o.shape
    assert splits <= MAX_SPLITS, (splits, MAX_SPLITS)
    chunk = combine_chunk(splits)
    _combine_kernel[(T * H,)](o, lse, out, splits, SP=triton.next_power_of_2(MAX_SPLITS), D=D, CHUNK=chunk,
                              num_warps=4 if chunk <= 32 else 8)
    return out


def combine_chunk(splits: int) -> int:
    """Splits the combine merges per loop step: 16 (the bulk of a rollout, a few splits), or enough for the whole
    split count up to 128 in the long tail. Each step's loads wait on nothing but the program's start, yet the loop
    issues them one step at a time: at 1 row x 27k context (238 splits) the combine took 12.7 us a layer in 15 steps
    of 16 (H100, 2026-11-26), ~15% of such a decode step. With this: s1 8,837 tok/s against 8,789, same call."""
    return 16 if splits <= 16 else min(128, triton.next_power_of_2(splits))


# The most splits per sequence. The long tail of an RL batch decodes a few sequences with the longest contexts: at
# batch 1 with one program per kv head, 16 splits (the old cap) kept 16-32 programs busy on 132 SMs, and a decode step
# of seed 002's 27k-token tail read the cache at a tenth of HBM bandwidth. Splits past a short context do no work and
# `_combine_kernel` skips their partials, so the cap can be as high as one GPU's worth of programs.
MAX_SPLITS = 256

# launch knobs, tuned on H100/H200 by `benchmarks/rollout.py --tune-decode` (see docs/engineering/NOTES_rollout.md)
# (an all-kv-heads-per-program variant reading each page as one contiguous run measured the same 67 us: dropped)
CONFIG = dict(tile=64, num_warps=4, num_stages=3, programs_per_sm=1)
CONFIG_FP8 = dict(tile=128, num_warps=4, num_stages=3, programs_per_sm=1)  # e4m3 K/V: `benchmarks/seed_workloads.py --tune-fp8`


def paged_decode(q_THD: torch.Tensor, k_cache, v_cache, meta: AttnMeta, scale: float, k_scale=None,
                 v_scale=None) -> torch.Tensor:
    T, H, D = q_THD.shape
    kvh = k_cache.shape[2]
    G = H // kvh
    splits = meta.num_splits
    if splits == 1:  # final output straight from the kernel, in the activation dtype
        o = torch.empty(T, H, 1, D, device=q_THD.device, dtype=q_THD.dtype)
        lse = o  # not written
    else:
        o = torch.empty(T, H, splits, D, device=q_THD.device, dtype=torch.float32)
        lse = torch.empty(T, H, splits, device=q_THD.device, dtype=torch.float32)
    fp8 = k_scale is not None
    common = (q_THD, k_cache, v_cache, k_scale if fp8 else q_THD, v_scale if fp8 else q_THD, meta.seq_slots, meta.block_tables, meta.context_lens, o, lse, scale,
              q_THD.stride(0), q_THD.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
              meta.block_tables.stride(0), o.stride(0), o.stride(1), o.stride(2), splits)
    c = CONFIG_FP8 if fp8 else CONFIG
    knobs = dict(D=D, BS=k_cache.shape[1], TILE=c["tile"], MULTI=splits > 1, IEEE=q_THD.dtype == torch.float32,
                 FP8=fp8, KVH=kvh,
                 num_warps=c["num_warps"], num_stages=c["num_stages"])
    _paged_decode_kernel[(T, kvh, splits)](*common, G=G, GP=max(16, triton.next_power_of_2(G)), **knobs)
    if splits == 1:
        return o[:, :, 0]
    return combine_splits(o, lse, torch.empty(T, H, D, device=q_THD.device, dtype=q_THD.dtype))


def choose_num_splits(batch: int, num_kv_heads: int, num_sms: int, fp8: bool = False,
                      num_heads: int | None = None) -> int:
    """Enough (seq, head, split) programs for `programs_per_sm` per SM; 1 when the batch alone gives that.
    num_heads is not needed here (one program per kv head); v2's chooser takes it, and so both share one signature."""
    want = (CONFIG_FP8 if fp8 else CONFIG)["programs_per_sm"] * num_sms
    return max(1, min(MAX_SPLITS, -(-want // max(1, batch * num_kv_heads))))
