"""Fused elementwise Triton kernels for the CUDA path (the CPU path uses the plain torch ops in model.py).

Why: at decode batch 256 each torch elementwise op is a separate 3-8 us kernel, and a layer had ~40 of them (RMSNorm
alone is 7); measured on an H200 they cost more than the weight and KV reads together. Three kernels replace them:
  add_rmsnorm      residual add + RMSNorm (one pass per row)
  rope_kv          optional q/k RMSNorm (Qwen3) + RoPE on q and k + K/V cache write, one program per token (decode
                   with the v2 kernel does this in its own launch: paged_decode_v2.paged_decode_rope)
  silu_mul         silu(gate) * up
Each rounds to the activation dtype at the same points as the HF modules (e.g. RMSNorm casts to bf16 before the weight
multiply, RoPE rounds each product), so bf16 logprobs stay close to the trainer's and fp32 stays exact.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from polyrl.rollout.native.attention import FP8 as E4M3
from polyrl.rollout.native.attention import FP8Rows


@triton.jit
def _store_rows(Y, S, row, c, m, y, FP8: tl.constexpr):
    # one row in the activation dtype, or (FP8) as e4m3 with its scale amax / 448: quantize_fp8_rows' numbers
    if FP8:
        yf = y.to(tl.float32)
        sc = tl.maximum(tl.max(tl.abs(yf), 0), 1e-8) / 448.0
        tl.store(S + row, sc)
        tl.store(Y + c, (yf / sc).to(Y.dtype.element_ty), mask=m)
    else:
        tl.store(Y + c, y, mask=m)


@triton.jit
def _add_rmsnorm_kernel(X, R, W, Y, RO, S, eps, T, N: tl.constexpr, BLOCK: tl.constexpr, HAS_RES: tl.constexpr,
                        FP8: tl.constexpr, PARTS: tl.constexpr):
    # PARTS > 1: X holds a split-K GEMM's partial outputs, [PARTS, T, N], summed here in fp32 (with the residual)
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    m = c < N
    x = tl.load(X + row * N + c, mask=m, other=0.0)
    if PARTS > 1:
        xs = x.to(tl.float32)
        for p in tl.static_range(1, PARTS):
            xs += tl.load(X + (p * T + row) * N + c, mask=m, other=0.0).to(tl.float32)
        x = xs.to(X.dtype.element_ty)
    if HAS_RES:
        x = (x.to(tl.float32) + tl.load(R + row * N + c, mask=m, other=0.0).to(tl.float32)).to(X.dtype.element_ty)
        tl.store(RO + row * N + c, x, mask=m)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, 0) / N
    y = (xf * tl.rsqrt(var + eps)).to(X.dtype.element_ty).to(tl.float32)
    w = tl.load(W + c, mask=m, other=0.0).to(tl.float32)
    _store_rows(Y + row * N, S, row, c, m, (y * w).to(X.dtype.element_ty), FP8)


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, fp8: bool = False):
    """Returns (norm(x + residual) * weight, x + residual); residual None: (norm(x) * weight, x). fp8: the first comes
    back as `FP8Rows` (the same values, quantised in the same pass) for an FP8 GEMM (`fp8_linear.takes_fp8_rows`).
    x may be [P, T, N], a split-K GEMM's P partial outputs (`model.sliced_linear`): they are summed in fp32 first,
    rounded to the activation dtype as one GEMM's output would be, then added to the residual."""
    parts = x.shape[0] if x.dim() == 3 else 1
    if parts > 1 and residual is None:
        raise ValueError("add_rmsnorm sums partial outputs only together with a residual")
    T, N = x.shape[-2:]
    y = torch.empty(T, N, dtype=E4M3 if fp8 else x.dtype, device=x.device)
    s = torch.empty(T, dtype=torch.float32, device=x.device) if fp8 else y
    res_out = torch.empty_like(residual) if residual is not None else x
    _add_rmsnorm_kernel[(T,)](x, residual if residual is not None else x, weight, y, res_out, s, eps, T, N=N,
                              BLOCK=triton.next_power_of_2(N), HAS_RES=residual is not None, FP8=fp8, PARTS=parts,
                              num_warps=4)
    return (FP8Rows(y, s) if fp8 else y), res_out


@triton.jit
def rounded_product(a, b, dt: tl.constexpr, PTX: tl.constexpr):
    """a * b rounded to dt on its own, as torch rounds it. A plain `(a * b).to(dt)` feeding an add is not: the compiler
    turns the pair into one bf16 FMA (`fma.rn.bf16`, a single rounding of a * b + c), which put RoPE one ulp off HF's
    in ~10% of q and k values (H100, 2026-11-26). PTX: an opaque `mul.rn.f32` (CUDA); the interpreter does not fuse."""
    if PTX:
        p = tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32, is_pure=True,
                                      pack=1)
    else:
        p = a * b
    return p.to(dt).to(tl.float32)


@triton.jit
def rope_heads(row, heads, mask, pos, COS, SIN, W, eps, D: tl.constexpr, HAS_NORM: tl.constexpr, PTX: tl.constexpr):
    """Heads `heads` of one token's qkv row ([n, D], `mask` [n, 1]) after the optional per-head RMSNorm (Qwen3's q/k
    norm, weight W) and RoPE at position `pos`, in the activation dtype, rounded where HF rounds. Whole rows: each
    column is loaded with its rotation partner (d + D/2 mod D). rope_kv and v2's paged_decode_rope both use it, so the
    two give the same bits."""
    dt = row.dtype.element_ty
    d = tl.arange(0, D)
    dp = (d + D // 2) % D
    x = tl.load(row + heads[:, None] * D + d[None, :], mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(row + heads[:, None] * D + dp[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:  # fp32 RMSNorm rounded to dt, then times the weight (HF's Qwen3RMSNorm); the partner shares r
        r = tl.rsqrt(tl.sum(x * x, 1) / D + eps)[:, None]
        x = ((x * r).to(dt).to(tl.float32) * tl.load(W + d).to(tl.float32)[None, :]).to(dt).to(tl.float32)
        xp = ((xp * r).to(dt).to(tl.float32) * tl.load(W + dp).to(tl.float32)[None, :]).to(dt).to(tl.float32)
    c = tl.load(COS + pos * D + d).to(dt).to(tl.float32)[None, :]
    s = tl.load(SIN + pos * D + d).to(dt).to(tl.float32)[None, :]
    sign = tl.where(d < D // 2, -1.0, 1.0)[None, :]
    return (rounded_product(x, c, dt, PTX) + rounded_product(sign * xp, s, dt, PTX)).to(dt)


@triton.jit
def store_kv_rows(C, S, addr, srow, x, mask, FP8: tl.constexpr):
    """Whole K or V head rows [n, D] into the cache at `addr` (`mask` [n, 1]); FP8: one scale per row, amax / 448
    (`srow` its index in the scale cache), values cast to e4m3."""
    if FP8:
        sc = tl.maximum(tl.max(tl.abs(x.to(tl.float32)), 1), 1e-8) / 448.0
        tl.store(S + srow, sc, mask=tl.max(mask.to(tl.int32), 1) > 0)
        x = x.to(tl.float32) / sc[:, None]
    tl.store(C + addr, x.to(C.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kv_kernel(QKV, POS, COS, SIN, SLOT, QO, KC, VC, KS, VS, QW, KW, eps,
                    H: tl.constexpr, KVH: tl.constexpr, HP: tl.constexpr, KVHP: tl.constexpr, D: tl.constexpr,
                    HAS_NORM: tl.constexpr, FP8: tl.constexpr, PTX: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(POS + t)
    slot = tl.load(SLOT + t).to(tl.int64)
    d = tl.arange(0, D)
    row = QKV + t * (H + 2 * KVH) * D
    qh = tl.arange(0, HP)
    qm = (qh < H)[:, None]
    q = rope_heads(row, qh, qm, pos, COS, SIN, QW, eps, D, HAS_NORM, PTX)
    tl.store(QO + t * H * D + qh[:, None] * D + d[None, :], q, mask=qm)
    # k heads -> cache (roped), v heads -> cache
    kh = tl.arange(0, KVHP)
    km = (kh < KVH)[:, None]
    addr = slot * KVH * D + kh[:, None] * D + d[None, :]
    k = rope_heads(row + H * D, kh, km, pos, COS, SIN, KW, eps, D, HAS_NORM, PTX)
    store_kv_rows(KC, KS, addr, slot * KVH + kh, k, km, FP8)
    v = tl.load(row + (H + KVH) * D + kh[:, None] * D + d[None, :], mask=km, other=0.0)
    store_kv_rows(VC, VS, addr, slot * KVH + kh, v, km, FP8)


def rope_kv(qkv_TX, positions_T, cos_table, sin_table, k_cache, v_cache, slot_mapping_T, num_heads, num_kv_heads,
            head_dim, q_norm_w=None, k_norm_w=None, eps=1e-6, k_scale=None, v_scale=None) -> torch.Tensor:
    """RoPE (after the optional per-head q/k RMSNorm) on q and k, K/V written to the cache; returns q [T, H, D].

    With scale caches (FP8 KV) each (token, kv head) row is quantised as it is written (attention.py says why).
    """
    T = qkv_TX.shape[0]
    q = torch.empty(T, num_heads, head_dim, dtype=qkv_TX.dtype, device=qkv_TX.device)
    has_norm = q_norm_w is not None
    fp8 = k_scale is not None
    _rope_kv_kernel[(T,)](
        qkv_TX, positions_T, cos_table, sin_table, slot_mapping_T, q, k_cache, v_cache,
        k_scale if fp8 else qkv_TX, v_scale if fp8 else qkv_TX,
        q_norm_w if has_norm else qkv_TX, k_norm_w if has_norm else qkv_TX, eps,
        H=num_heads, KVH=num_kv_heads, HP=triton.next_power_of_2(num_heads), KVHP=triton.next_power_of_2(num_kv_heads),
        D=head_dim, HAS_NORM=has_norm, FP8=fp8, PTX=qkv_TX.is_cuda, num_warps=4,
    )
    return q


@triton.jit
def _silu_mul_kernel(GU, Y, S, T, I: tl.constexpr, SLICE: tl.constexpr, BLOCK: tl.constexpr, FP8: tl.constexpr):
    # program (row, j): columns [j * SLICE, (j + 1) * SLICE) of the row; FP8: their amax makes scale S[j, row]
    row = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    c = j * SLICE + tl.arange(0, BLOCK)
    m = (tl.arange(0, BLOCK) < SLICE) & (c < I)
    g = tl.load(GU + row * 2 * I + c, mask=m, other=0.0).to(tl.float32)
    u = tl.load(GU + row * 2 * I + I + c, mask=m, other=0.0).to(tl.float32)
    dt = GU.dtype.element_ty
    a = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    _store_rows(Y + row * I, S + j * T, row, c, m, (a * u).to(dt), FP8)


def silu_mul(gate_up_TX: torch.Tensor, fp8: bool = False, slice_cols: int | None = None):
    """silu(gate) * up; fp8: as `FP8Rows`, one scale per row (one program per row then, for the row's amax), or with
    `slice_cols` one per (slice of that many columns, row), [slices, T]: the K splits of the FP8 GEMM that reads it
    (`splitk_fp8`'s partials), each program one slice of one row."""
    T, two_i = gate_up_TX.shape
    inter = two_i // 2
    dev = gate_up_TX.device
    y = torch.empty(T, inter, dtype=E4M3 if fp8 else gate_up_TX.dtype, device=dev)
    span = (slice_cols or inter) if fp8 else 1024
    slices = triton.cdiv(inter, span)
    s = (torch.empty(slices, T, dtype=torch.float32, device=dev) if slice_cols else
         torch.empty(T, dtype=torch.float32, device=dev)) if fp8 else y
    BLOCK = triton.next_power_of_2(span)
    _silu_mul_kernel[(T, slices)](gate_up_TX, y, s, T, I=inter, SLICE=span, BLOCK=BLOCK, FP8=fp8,
                                  num_warps=8 if BLOCK > 4096 else 4)  # fmt: skip
    return FP8Rows(y, s) if fp8 else y


@triton.jit
def _sample_partial_kernel(L, PM, PS, PI, inv_temp, V, stride, per_chunk,
                           NCHUNK: tl.constexpr, BLOCK: tl.constexpr, GREEDY: tl.constexpr):
    # one program per (row, chunk of the vocabulary): the chunk's max and sum-exp (and, greedy, its argmax)
    row = tl.program_id(0).to(tl.int64)
    ch = tl.program_id(1)
    lo = ch * per_chunk
    hi = tl.minimum(V, lo + per_chunk)
    o = row * NCHUNK + ch
    if GREEDY:  # per-lane running max, sum-exp and argmax, reduced at the end
        m = tl.full([BLOCK], float("-inf"), tl.float32)
        s = tl.zeros([BLOCK], tl.float32)
        best_i = tl.zeros([BLOCK], tl.int32)
        for start in range(lo, hi, BLOCK):
            c = start + tl.arange(0, BLOCK)
            x = tl.load(L + row * stride + c, mask=c < hi, other=float("-inf")).to(tl.float32) * inv_temp
            best_i = tl.where(x > m, c, best_i)
            m_new = tl.maximum(m, x)
            live = m_new > float("-inf")  # lanes that have seen a real logit (padding lanes stay at 0)
            s = s * tl.where(live, tl.exp(m - m_new), 1.0) + tl.where(live, tl.exp(x - m_new), 0.0)
            m = m_new
        mx = tl.max(m, 0)
        tl.store(PM + o, mx)
        tl.store(PS + o, tl.sum(tl.where(m > float("-inf"), s * tl.exp(m - mx), 0.0), 0))
        tl.store(PI + o, tl.min(tl.where(m == mx, best_i, 2147483647), 0))  # lowest index among ties
    else:  # one running max for the chunk (a block max a step): one exp a logit, not two
        mx = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), 0)
        s = tl.zeros([BLOCK], tl.float32)  # per-lane sums at the running max
        for start in range(lo, hi, BLOCK):
            c = start + tl.arange(0, BLOCK)
            x = tl.load(L + row * stride + c, mask=c < hi, other=float("-inf")).to(tl.float32) * inv_temp
            m_new = tl.maximum(mx, tl.max(x, 0))
            live = m_new > float("-inf")  # some real logit seen (a chunk of -inf logits keeps a zero sum)
            s = s * tl.where(live, tl.exp(mx - m_new), 1.0) + tl.where(live, tl.exp(x - m_new), 0.0)
            mx = m_new
        tl.store(PM + o, mx)
        tl.store(PS + o, tl.sum(s, 0))


@triton.jit(do_not_specialize=["seed"])
def _sample_pick_kernel(L, PM, PS, PI, TOK, LP, seed, inv_temp, V, stride, per_chunk,
                        NCHUNK: tl.constexpr, BLOCK: tl.constexpr, GREEDY: tl.constexpr):
    # one program per row: log-sum-exp from the chunks, then the token: argmax (greedy) or inverse CDF at one
    # uniform draw keyed by (seed, row), found chunk first and then inside that chunk
    row = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, NCHUNK)
    m = tl.load(PM + row * NCHUNK + k)
    mx = tl.max(m, 0)
    w = tl.where(m > float("-inf"), tl.load(PS + row * NCHUNK + k) * tl.exp(m - mx), 0.0)  # chunk masses
    lse = mx + tl.log(tl.sum(w, 0))
    if GREEDY:
        i = tl.load(PI + row * NCHUNK + k)
        idx = tl.min(tl.where(m == mx, i, 2147483647), 0)
    else:
        target = tl.rand(seed, row.to(tl.int32)) * tl.sum(w, 0)
        cum = tl.cumsum(w, 0)
        ch = tl.minimum(tl.sum((cum <= target).to(tl.int32), 0), NCHUNK - 1)
        target -= tl.sum(tl.where(k < ch, w, 0.0), 0)
        lo = ch * per_chunk
        hi = tl.minimum(V, lo + per_chunk)
        idx = hi - 1  # rounding fallback: the chunk's last token
        found = 0
        run = 0.0
        last = lo
        for start in range(lo, hi, BLOCK):
            c = start + tl.arange(0, BLOCK)
            x = tl.load(L + row * stride + c, mask=c < hi, other=float("-inf")).to(tl.float32) * inv_temp
            p = tl.exp(x - mx)
            cp = run + tl.cumsum(p, 0)
            n_below = tl.sum(((cp <= target) & (c < hi)).to(tl.int32), 0)
            hit = (found == 0) & (n_below < tl.sum((c < hi).to(tl.int32), 0))
            idx = tl.where(hit, start + n_below, idx)
            found = tl.where(hit, 1, found)
            last = tl.where(tl.sum(p, 0) > 0, tl.max(tl.where(p > 0, c, lo), 0), last)
            run = run + tl.sum(p, 0)
        idx = tl.where(found == 1, idx, last)
    x_tok = tl.load(L + row * stride + idx).to(tl.float32) * inv_temp
    tl.store(TOK + row, idx.to(tl.int64))
    tl.store(LP + row, x_tok - lse)


# programs per row for the log-sum-exp pass (256 rows alone would leave the GPU half idle); the pick pass then scans
# one chunk of each row. A power of two up to 256: the pick kernel loads the chunks as one block. 16 before 2026-11-27
# (`benchmarks/probes/sampler_bench.py` times other counts by setting this).
SAMPLE_CHUNKS = 64


def sample_rows(logits_RV: torch.Tensor, temperature: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy or temperature sampling of each row; returns (ids, log_softmax(logits / T)[id]).

    Two read passes over the logits and one uniform per row (inverse CDF): an earlier Gumbel-max version drew a
    Philox number and took two logs per logit and was compute-bound (206 us for 256 x 152k on an H200). The first
    pass keeps one running max per chunk (one exp a logit), and the second scans one of SAMPLE_CHUNKS chunks per row:
    39.7 / 13.9 us at 256 / 64 rows of Qwen2.5's bf16 logits against 52.6 / 22.6 with per-lane maxima (two exps a
    logit) and 16 chunks (H100, `benchmarks/probes/sampler_bench.py`, 2026-11-27; one read of the logits is 25.9 / 6.5 us).
    """
    R, V = logits_RV.shape
    dev = logits_RV.device
    tok = torch.empty(R, dtype=torch.long, device=dev)
    lp = torch.empty(R, dtype=torch.float32, device=dev)
    part = torch.empty(2, R, SAMPLE_CHUNKS, dtype=torch.float32, device=dev)
    part_i = torch.empty(R, SAMPLE_CHUNKS, dtype=torch.int32, device=dev)
    greedy = temperature == 0.0
    inv_temp = 1.0 if greedy else 1.0 / temperature
    BLOCK = 1024
    per_chunk = triton.cdiv(triton.cdiv(V, SAMPLE_CHUNKS), BLOCK) * BLOCK
    _sample_partial_kernel[(R, SAMPLE_CHUNKS)](logits_RV, part[0], part[1], part_i, inv_temp, V, logits_RV.stride(0),
                                               per_chunk, NCHUNK=SAMPLE_CHUNKS, BLOCK=BLOCK, GREEDY=greedy,
                                               num_warps=4)
    _sample_pick_kernel[(R,)](logits_RV, part[0], part[1], part_i, tok, lp, seed, inv_temp, V, logits_RV.stride(0),
                              per_chunk, NCHUNK=SAMPLE_CHUNKS, BLOCK=BLOCK, GREEDY=greedy, num_warps=4)
    return tok, lp


@triton.jit
def _quantize_rows_kernel(X, Q, S, K: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, BLOCK)
    x = tl.load(X + r * K + k, mask=k < K, other=0.0).to(tl.float32)
    sc = tl.maximum(tl.max(tl.abs(x), 0), 1e-8) / 448.0
    tl.store(S + r, sc)
    tl.store(Q + r * K + k, (x / sc).to(Q.dtype.element_ty), mask=k < K)


def quantize_fp8_rows_triton(x_MK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`attention.quantize_fp8_rows` (e4m3 rows, fp32 scales amax / 448) for a CUDA [M, K] matrix in one launch: the
    prologue of an FP8 GEMM."""
    M, K = x_MK.shape
    x_MK = x_MK.contiguous()
    q = torch.empty(M, K, dtype=torch.float8_e4m3fn, device=x_MK.device)
    s = torch.empty(M, dtype=torch.float32, device=x_MK.device)
    _quantize_rows_kernel[(M,)](x_MK, q, s, K=K, BLOCK=triton.next_power_of_2(K), num_warps=8)
    return q, s
