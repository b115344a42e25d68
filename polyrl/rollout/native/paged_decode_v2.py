"""Paged-decode attention, variant 2: whole pages of several kv heads per step (`...native.decode_kernel=v2`).

Same contract as `paged_decode.py` (v1): one new query token per sequence, bf16/fp32 or e4m3 K/V with one fp32 scale
per (token, kv head), split-K partials merged by v1's `_combine_kernel`, zero-length rows write zeros, one split
writes the final output in the activation dtype. What changes is how a program walks the cache. Merging the partials
in the same launch (the last split of each head block to finish) was tried and measured slower (s1 8,408 against
8,438 tok/s, H100, 2026-11-26), so the combine stays a second launch.

Why: with e4m3 K/V, v1 is 1.30-1.36x its bf16 speed on an H100 although it reads half the bytes, and measurements put
the cost on per-token instruction work, not on conversions or the dots (`docs/engineering/NOTES_rollout.md`, session 7).
v1's program owns one (sequence, kv head, split) and, for every token of a tile, loads its block-table entry, builds
its row pointer and loads its two scales with a stride of `kv_heads` floats; all of that is repeated for each kv head.

v2's design:
- A program owns one (sequence, head block, split), where a head block is HB kv heads: as many as fit in the 16 rows
  that `tl.dot` needs anyway for the GQA group (Qwen-1.5B, 12 q / 2 kv heads: HB = 2, every kv head in one program;
  Llama-8B, 32 / 8: HB = 4, 16 q rows). The q rows of all HB heads are stacked into one [R, D] operand.
- The K/V operand of a step is PAGES whole pages read as cache rows: in the [blocks, block_size, kv_heads, D] layout a
  page's rows for HB adjacent heads are (token, head) pairs in memory order, a contiguous run of
  block_size * HB * D elements when HB = kv_heads. So a step does PAGES block-table loads (not one per token per head),
  its pointer math is a [PAGES, block_size * HB] outer sum computed once per step, and the e4m3 scales of a page are
  one contiguous vector in the same row order (coalesced, no per-head stride).
- One q.K^T and one P.V dot per step cover all HB heads: a score column belongs to one kv head, and a row only keeps
  the columns of its own kv head (the others are -inf, so P is 0 there and P.V sums only that head's V rows). This
  costs no more MMA or softmax work than v1, which pads each head's group of G rows to 16 (HB * G <= 16 here).
- Scales fold in as in v1: the score column times K's scale, the probability column times V's scale before P.V; e4m3
  is upcast to fp16 in registers (one conversion instruction on Hopper), scores and softmax stay fp32.
- Whole steps run without token masks; only a split's last, partial step is masked (`_step(MASKED=True)`).

What it buys, measured statically (no GPU here: `benchmarks/probes/decode_kernel.py --sass` compiles both kernels for sm_90
and counts the main loop's SASS instructions per (token, kv head) per warp; Qwen-1.5B heads, committed configs):
bf16 v1 35.1 -> v2 22.4; e4m3 v1 46.6 -> v2 32.1 (-31%). Both pipeline their K/V loads (cp.async), no spills. The
largest remaining e4m3 cost is V: P.V contracts over tokens, but a cache row is contiguous over head_dim, and sm_90
has no transposing ldmatrix for 8-bit data, so Triton gathers V's bytes one LDS.U8 at a time (182 of the 1,026 loop
instructions are shared-memory loads). Storing each V page transposed ([D, block_size * kv_heads]) makes that operand
contiguous along the contraction like K's: 32.1 -> 25.6 in the same count (tried in the kernel, not kept: it needs
the cache writer, the prefill gather and v1 to agree on the layout). Converting V before the layout change instead
(scale, inline-asm conversion) does not help: Triton moves every elementwise op past it.
Not done: TMA / tensor descriptors (Hopper's TMA cannot gather scattered pages into one tile; one descriptor load per
page would shrink the dots to a page).

RoPE and the K/V write in the same launch (`paged_decode_rope`, the engine's path with this kernel; Qwen3's q/k norms
too): the kernel reads the qkv GEMM's output, every program applies RoPE to its q rows (fused.py's `rope_heads`, which
rope_kv uses too, so the values are the same bits), and the program whose split holds the new token ropes, quantises
and writes that token's K/V before its first step reads the cache. So rope_kv's launch (one program per token, 2-3 us
at decode sizes) is gone from every layer: s1 8,616 -> 8,768 and 8,649 -> 8,821 tok/s in two A/B calls on an H100
(2026-11-26), (a) within noise.

One-warp programs where the four-warp launch would split (`fp8_config`, e4m3 only): a four-warp program of 16 q rows spreads each step's score columns and output columns over its warps, so the
softmax's row max and sum and the move of P into the P.V operand cross warps through shared memory every step. A
one-warp program of one page a step does none of that; with 4-8x more programs (more splits) it reads the cache
faster wherever the four-warp launch needed splits anyway. `benchmarks/probes/decode_kernel.py --regimes` (H100, one layer,
2026-11-26): Qwen-1.5B heads at B = 64 x 16k 203 against 214 us, B = 128 x 16k 388 against 419; no better at shape
(a)'s 256 rows (the four-warp launch fills the GPU unsplit: 45.6 us against 55.5+) nor at the last few rows, and
worse where one-warp programs would need many splits of a short context (Llama-8B heads at 8 x 4k: 42.1 us with 60
splits against 35.8), hence FEW_MAX_SPLITS. End to end (seed_workloads.py, A/B in one call): s1 at 64 sequences
8,825 -> 9,124 and 8,864 -> 9,256 tok/s (the latter with a 64-split cap), s2 5,397 -> 5,998.

Measured on an H100 (2026-11-24, `benchmarks/probes/decode_kernel.py`, B = 64/128 x 16k context, one layer in a CUDA graph):
e4m3 v2 is 1.24-1.32x faster than v1 (76-81% of the HBM spec against 58-66%); bf16 v2 was 0.76-1.00x v1 with its
first launch (rows 64, one program an SM). End to end (seed_workloads.py): s1 at 64 sequences 5,930 -> 7,714 tok/s
(FP8 KV + W8), at 128 7,754 -> 10,875; (a) 55.5k -> 63.4k in FP8 KV.
A bf16 cache takes the e4m3 launch since 2026-11-26 (CONFIG: rows 128, two programs an SM), and with it v2 ties or
beats v1 in every regime of `decode_kernel.py --regimes bf16` at its best split count, most in s1's tail (8 x 16k: 54
against 68 us); the split chooser picks the sweep's best count or its neighbour (15 and 30 where 16 and 32 were
timed). So `decode_kernel=auto` (the default, `attention.choose_decode_kernel`) takes v2 for both cache dtypes: s1 in
bf16 at 64 sequences 5,669 -> 6,449 tok/s, at 128 7,157 -> 8,060, (a) 54,068 -> 54,938 (H100, one process each).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from polyrl.rollout.native.attention import sm_count
from polyrl.rollout.native.fused import rope_heads, store_kv_rows
from polyrl.rollout.native.paged_decode import MAX_SPLITS, attend, combine_splits

if TYPE_CHECKING:  # attention.py imports this module when the kernel is on
    from polyrl.rollout.native.attention import AttnMeta


@triton.jit
def _step(q, m, l, acc, start, hi, bt_row, K, V, KS, VS, scale, stride_kb, page_off, page_soff, col_tok, own_head,
          d, pg, N: tl.constexpr, BS: tl.constexpr, KVH: tl.constexpr, IEEE: tl.constexpr, FP8: tl.constexpr,
          MASKED: tl.constexpr):
    """One online-softmax step over the N cache rows of PAGES whole pages from token `start`. MASKED: the step may
    run past `hi` (the split's last, partial step); the full steps skip every token mask (~20% fewer instructions)."""
    page = start // BS + pg
    if MASKED:
        blk = tl.load(bt_row + page, mask=page * BS < hi, other=0).to(tl.int64)
    else:
        blk = tl.load(bt_row + page).to(tl.int64)
    # every row starts at a multiple of 16 elements (Triton specialises the strides so): say so after the reshape,
    # which hides it, so that the row loads vectorise and pipeline
    off = tl.multiple_of(tl.reshape(blk[:, None] * stride_kb + page_off[None, :], [N]), 16)
    soff = tl.reshape(blk[:, None] * (BS * KVH) + page_soff[None, :], [N])
    if MASKED:
        tm = start + col_tok < hi
        k = tl.load(K + off[:, None] + d[None, :], mask=tm[:, None], other=0.0)
        v = tl.load(V + off[:, None] + d[None, :], mask=tm[:, None], other=0.0)
    else:
        k = tl.load(K + off[:, None] + d[None, :])
        v = tl.load(V + off[:, None] + d[None, :])
    k_sc = scale  # unused without FP8
    v_sc = scale
    if FP8:  # e4m3 bytes -> compute dtype in registers; the scales of the step's pages are one vector each
        if MASKED:
            k_sc = tl.load(KS + soff, mask=tm, other=0.0) * scale
            v_sc = tl.load(VS + soff, mask=tm, other=0.0)
        else:
            k_sc = tl.load(KS + soff) * scale
            v_sc = tl.load(VS + soff)
        k = k.to(q.dtype)
        v = v.to(q.dtype)
    keep = own_head
    if MASKED:
        keep = own_head & tm[None, :]
    return attend(q, k, v, k_sc, v_sc, keep, m, l, acc, scale, IEEE, FP8)


@triton.jit(do_not_specialize=["SPLITS"])
def _paged_decode_v2_kernel(
    Q, K, V, KS, VS, SeqSlots, BT, CL, O, LSE, scale, POS, COS, SIN, SLOT, QW, KW, eps,
    stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_bt,
    stride_ot, stride_oh, stride_os, SPLITS,
    G: tl.constexpr, HB: tl.constexpr, R: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, PAGES: tl.constexpr,
    MULTI: tl.constexpr, IEEE: tl.constexpr, FP8: tl.constexpr, KVH: tl.constexpr, ROPE: tl.constexpr,
    HAS_NORM: tl.constexpr, PTX: tl.constexpr,
):
    # SPLITS at run time, MULTI = SPLITS > 1 at compile time: paged_decode.py says why. MULTI False: O is [T, H, D] in
    # the activation dtype and LSE is unused; else O is fp32 [T, H, SPLITS, D]
    TILE: tl.constexpr = PAGES * BS  # tokens per step
    PR: tl.constexpr = BS * HB  # cache rows per page (token-major, then head)
    N: tl.constexpr = PAGES * PR  # cache rows per step: the dots' N
    s = tl.program_id(0)
    hb = tl.program_id(1)
    sp = tl.program_id(2)
    ctx = tl.load(CL + s)
    seq_row = tl.load(SeqSlots + s).to(tl.int64)
    per = tl.cdiv(tl.cdiv(ctx, SPLITS), TILE) * TILE
    lo = sp * per
    hi = tl.minimum(ctx, lo + per)
    d = tl.arange(0, D)
    # q rows: the HB * G q heads of this head block, padded to R; a padding row copies the last kv head (its q is 0)
    r = tl.arange(0, R)
    heads = hb * HB * G + r
    q_ok = r < HB * G
    if ROPE:  # Q is the qkv GEMM's output row: RoPE on q here, and the split holding the new token writes its K/V
        pos = tl.load(POS + s)
        row = Q + s * stride_qt  # heads of D elements (stride_qh == D)
        q = rope_heads(row, heads, q_ok[:, None], pos, COS, SIN, QW, eps, D, HAS_NORM, PTX)
        if (lo <= ctx - 1) & (ctx - 1 < hi):
            slot = tl.load(SLOT + s).to(tl.int64)
            kvh = hb * HB + tl.arange(0, HB)
            every = kvh[:, None] < KVH
            addr = (slot // BS) * stride_kb + (slot % BS) * stride_kt + kvh[:, None] * stride_kh + d[None, :]
            k_new = rope_heads(row, G * KVH + kvh, every, pos, COS, SIN, KW, eps, D, HAS_NORM, PTX)
            store_kv_rows(K, KS, addr, slot * KVH + kvh, k_new, every, FP8)
            v_new = tl.load(row + ((G + 1) * KVH + kvh)[:, None] * stride_qh + d[None, :])
            store_kv_rows(V, VS, addr, slot * KVH + kvh, v_new, every, FP8)
        tl.debug_barrier()  # the new rows are in the cache before this program's steps read them
    else:
        q = tl.load(Q + s * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=q_ok[:, None], other=0.0)
    if FP8:
        if not IEEE:  # e4m3 -> fp16 is one native conversion on Hopper (-> bf16 goes through fp16)
            q = q.to(tl.float16)
    row_kv = tl.minimum(r // G, HB - 1)
    # columns: cache rows of a step, page by page, (token, kv head) within a page; loop-invariant parts hoisted
    pr = tl.arange(0, PR)
    page_off = (pr // HB) * stride_kt + (hb * HB + pr % HB) * stride_kh  # a row's offset inside its page
    page_soff = (pr // HB) * KVH + hb * HB + pr % HB  # the same row in the [blocks, BS, KVH] scale cache
    c = tl.arange(0, N)
    col_tok = c // HB  # token of a column within the step
    own_head = row_kv[:, None] == (c % HB)[None, :]  # [R, N]: a q row sees only its kv head's columns
    pg = tl.arange(0, PAGES)
    m = tl.full([R], float("-inf"), tl.float32)
    l = tl.zeros([R], tl.float32)
    acc = tl.zeros([R, D], tl.float32)
    bt_row = BT + seq_row * stride_bt
    full = lo + tl.maximum(hi - lo, 0) // TILE * TILE  # whole steps end here; a partial one may follow
    for start in range(lo, full, TILE):
        m, l, acc = _step(q, m, l, acc, start, hi, bt_row, K, V, KS, VS, scale, stride_kb, page_off, page_soff,
                          col_tok, own_head, d, pg, N, BS, KVH, IEEE, FP8, MASKED=False)
    if full < hi:
        m, l, acc = _step(q, m, l, acc, full, hi, bt_row, K, V, KS, VS, scale, stride_kb, page_off, page_soff,
                          col_tok, own_head, d, pg, N, BS, KVH, IEEE, FP8, MASKED=True)
    has = l > 0
    out = acc / tl.where(has, l, 1.0)[:, None]
    lse = tl.where(has, m + tl.log(tl.where(has, l, 1.0)), -1e30)
    o_ptr = O + s * stride_ot + heads[:, None] * stride_oh + sp * stride_os + d[None, :]
    tl.store(o_ptr, out.to(O.dtype.element_ty), mask=q_ok[:, None])
    if MULTI:
        tl.store(LSE + (s * (G * KVH) + heads) * SPLITS + sp, lse, mask=q_ok)


# launch knobs: `rows` = cache rows (token, kv head) per step, rounded to whole pages; `benchmarks/probes/decode_kernel.py`
# sweeps them on a GPU. e4m3 (H100, 2026-11-24): rows 128, four warps, two programs an SM (no register spills on
# sm_90; rows 256 with four warps spills). bf16 first had rows 64 and one program an SM (not timed when written) and
# lost to v1; the e4m3 launch beat it in all engine regimes of `decode_kernel.py --regimes bf16` but one (Llama-8B
# heads at 8 x 4k: 54.5 against 53.7 us; H100, 2026-11-26), and one-warp programs gained nothing over it in bf16.
# The two dicts stay apart so either can be retuned alone.
CONFIG = dict(rows=128, num_warps=4, num_stages=3, programs_per_sm=2)
CONFIG_FP8 = dict(rows=128, num_warps=4, num_stages=3, programs_per_sm=2)
# e4m3 with too few (sequence, head block) programs to fill CONFIG_FP8's slots unsplit: one-warp programs of one page a
# step, many splits (`fp8_config`). A program's steps then need no cross-warp reduction or layout exchange
# (the softmax row max and sum, P into the P.V operand), which is what a four-warp program of 16 q rows waits on.
CONFIG_FP8_FEW = dict(rows=32, num_warps=1, num_stages=3, programs_per_sm=8)
FEW_WARPS = True  # False: the four-warp launch everywhere (tests/test_paged_decode_v2_interp_on_cpu.py compares both)
FEW_MAX_SPLITS = 32  # more splits than this for CONFIG_FP8_FEW: CONFIG_FP8 instead


def heads_per_program(num_heads: int, num_kv_heads: int) -> int:
    """HB: the most kv heads (a power of two dividing num_kv_heads) whose q heads fit the dot's minimum 16 rows, or one
    group's rows rounded up to a power of two when a group alone is larger."""
    group = num_heads // num_kv_heads
    rows = max(16, triton.next_power_of_2(group))
    hb = 1
    while num_kv_heads % (2 * hb) == 0 and 2 * hb * group <= rows:
        hb *= 2
    return hb


def paged_decode(q_THD: torch.Tensor, k_cache, v_cache, meta: AttnMeta, scale: float, k_scale=None,
                 v_scale=None) -> torch.Tensor:
    T, H, D = q_THD.shape
    return _launch(q_THD, q_THD.stride(0), q_THD.stride(1), H, D, k_cache, v_cache, meta, scale, k_scale, v_scale)


def paged_decode_rope(qkv_TX: torch.Tensor, positions_T, cos_table, sin_table, k_cache, v_cache, meta: AttnMeta,
                      scale: float, num_heads: int, k_scale=None, v_scale=None, q_norm_w=None, k_norm_w=None,
                      eps: float = 1e-6) -> torch.Tensor:
    """`paged_decode` from the qkv GEMM's output [T, (H + 2 KVH) D]: RoPE on q (after Qwen3's q/k norm if given), and
    the new token's roped K and its V written to the cache (quantised with an FP8 cache), in the same launch, so
    rope_kv's launch is gone. The program whose split holds the new token writes it, then reads it back like any
    other token; the values are rope_kv's (the same `fused.rope_heads`)."""
    D = k_cache.shape[-1]
    norms = (q_norm_w, k_norm_w) if q_norm_w is not None else (qkv_TX, qkv_TX)
    return _launch(qkv_TX, qkv_TX.stride(0), D, num_heads, D, k_cache, v_cache, meta, scale, k_scale, v_scale,
                   rope=(positions_T, cos_table, sin_table, meta.slot_mapping, *norms, eps),
                   has_norm=q_norm_w is not None)


def _launch(q, stride_qt, stride_qh, H, D, k_cache, v_cache, meta, scale, k_scale, v_scale, rope=None,
            has_norm=False):
    T = q.shape[0]
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    if bs & (bs - 1):
        raise ValueError(f"decode_kernel=v2 needs a power-of-two block_size, got {bs}; use decode_kernel=v1.")
    G = H // kvh
    hb = heads_per_program(H, kvh)
    splits = meta.num_splits
    if splits == 1:  # final output straight from the kernel, in the activation dtype
        o = torch.empty(T, H, 1, D, device=q.device, dtype=q.dtype)
        lse = o  # not written
    else:
        o = torch.empty(T, H, splits, D, device=q.device, dtype=torch.float32)
        lse = torch.empty(T, H, splits, device=q.device, dtype=torch.float32)
    fp8 = k_scale is not None
    c = launch_config(T, kvh // hb, sm_count(q.device), fp8)
    rope_args = rope if rope is not None else (q,) * 6 + (0.0,)  # POS, COS, SIN, SLOT, QW, KW, eps
    _paged_decode_v2_kernel[(T, kvh // hb, splits)](
        q, k_cache, v_cache, k_scale if fp8 else q, v_scale if fp8 else q, meta.seq_slots,
        meta.block_tables, meta.context_lens, o, lse, scale, *rope_args,
        stride_qt, stride_qh, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        meta.block_tables.stride(0), o.stride(0), o.stride(1), o.stride(2), splits,
        G=G, HB=hb, R=max(16, triton.next_power_of_2(hb * G)), D=D, BS=bs, PAGES=max(1, c["rows"] // (bs * hb)),
        MULTI=splits > 1, IEEE=q.dtype == torch.float32, FP8=fp8, KVH=kvh, ROPE=rope is not None,
        HAS_NORM=has_norm, PTX=q.is_cuda,
        num_warps=c["num_warps"], num_stages=c["num_stages"],
    )
    if splits == 1:
        return o[:, :, 0]
    return combine_splits(o, lse, torch.empty(T, H, D, device=q.device, dtype=q.dtype))


def choose_num_splits(batch: int, num_kv_heads: int, num_sms: int, fp8: bool = False,
                      num_heads: int | None = None) -> int:
    """The fewest splits (up to MAX_SPLITS) whose (sequence, head block, split) programs fill their last wave of
    `programs_per_sm` per SM at least 90% (else the fullest): v2 has KVH / HB times fewer programs than v1, so
    a batch that fills the GPU with v1 can leave half of it idle, or a second wave nearly empty, with v2.
    num_heads (q heads) sets the head block; None counts one program per kv head, as v1."""
    blocks = num_kv_heads // heads_per_program(num_heads, num_kv_heads) if num_heads else num_kv_heads
    config = launch_config(batch, blocks, num_sms, fp8)
    return _fewest_filling_splits(batch * blocks, config["programs_per_sm"] * num_sms)


@functools.cache  # the launch asks for every layer of an eager decode step: a pure function of two ints
def _fewest_filling_splits(programs: int, slots: int) -> int:
    fill = lambda n: n * programs / (slots * -(-n * programs // slots))  # noqa: E731
    return next((n for n in range(1, MAX_SPLITS + 1) if fill(n) >= 0.9), max(range(1, MAX_SPLITS + 1), key=fill))


def launch_config(batch: int, blocks: int, num_sms: int, fp8: bool) -> dict:
    """The launch knobs for `batch` sequences of `blocks` head blocks: `fp8_config` for an e4m3 cache, CONFIG for bf16.
    The split choice and the launch both ask it, so they agree."""
    return fp8_config(batch, blocks, num_sms) if fp8 else CONFIG


def fp8_config(batch: int, blocks: int, num_sms: int) -> dict:
    """The e4m3 launch for `batch` sequences of `blocks` head blocks: CONFIG_FP8 where its programs fill the GPU
    unsplit (shape (a)'s 256 rows) or need more than FEW_MAX_SPLITS of CONFIG_FP8_FEW's (the last few rows of a long
    tail), CONFIG_FP8_FEW between (s1's bulk). The engine's split choice and the launch both follow it (any launch
    merges any split count correctly; a mismatch would only cost speed)."""
    programs = batch * blocks
    if not FEW_WARPS or _fewest_filling_splits(programs, CONFIG_FP8["programs_per_sm"] * num_sms) == 1:
        return CONFIG_FP8
    few = _fewest_filling_splits(programs, CONFIG_FP8_FEW["programs_per_sm"] * num_sms)
    return CONFIG_FP8_FEW if few <= FEW_MAX_SPLITS else CONFIG_FP8

