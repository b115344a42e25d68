"""FP8 GEMM for a decode step's few rows (1-256): y = (x * sx) (W * sw)^T (+ b), e4m3 x and W, one Triton launch.

Why: at decode sizes a GEMM is a pass over its weight bytes, so what counts is how many SMs stream them. cuBLASLt's
FP8 GEMM (`_scaled_mm`) tiles the output 128 x 128, so the 1.5B model's down projection (N = 1536, K = 8960) runs
on 12 programs: with cold weights (as the engine reads them) it took 23 us for 13.8 MB of e4m3, 20% of HBM
bandwidth, against 15 us for bf16 cuBLAS over twice the bytes (H100, `seed_workloads.py --gemms`, 2026-11-26).

How: the weight's rows are the MMA's M side ("swap AB": a [BN, BK] weight tile times a [BK, BM] slice of x^T, BM
the rows padded to 16-64; more rows run in row blocks on a third grid axis, each rereading the weight tile, mostly from
L2), and K is split among `split` programs per output tile so that every GEMM, down and o included, covers the GPU.
The split partial sums are reduced in the same launch, in a fixed order: each program writes its fp32 partial tile and
bumps its output tile's counter; the one that arrives last sums the partials split 0 first and writes y. So the
result is the same bits on every run (no float atomics), and no second launch.

Or the partials go to the consumer (`partials=True`): each program writes its split's scaled partial product into
[split, M, N] and the next kernel sums them (the add_rmsnorm after a down projection: `fp8_linear.PARTIALS`). The
in-launch reduction is serial, one program per output tile reading every split's tile, and it cost the 1.5B down ~4 us
of 12.6-16.9; without it, and with whole-row tiles past 64 rows (each weight tile read once or twice from L2, not four
times), the down takes 7.6-11.9 us at 16-256 rows (H100, cold weights, 2026-11-26).

x comes as `FP8Rows` from a fused producer (add_rmsnorm / silu_mul quantise it in their own pass): e4m3 on both
sides, the tensor cores' FP8 MMA, x's row scale applied with the weight's at the end. A variant that took bf16 x and
upcast the weight tile in registers (as w8a16.py does) was slower at every size (1.5B gate_up 19.6-23.3 us against
12.2-14.1 at 1-64 rows) and is gone. So is a bf16 form (bf16 x and W, no scales; commit 768615f): with the best of a
36-config sweep it lost to cuBLAS at every 1.5B decode GEMM at 32-256 rows except gate_up at 32 (22.5 against 23.2
us), e.g. down at 256 rows 27.5 against 18.9 us and qkv 8.8-10.7 against 5.9-6.2 (H100, 2026-11-26).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from polyrl.rollout.native.attention import FP8Rows, sm_count
from polyrl.rollout.native.counters import arrival_counters, last_to_arrive, reset_arrivals

MAX_ROWS = 256
ROW_BLOCK = 64  # more rows than this: blocks of 64 rows (a grid axis; a TABLE entry may set BM)
# Launch config: BN weight rows x BK bytes of K per step; `programs_per_sm` sets the split of K (enough programs for
# that many per SM, keeping at least `min_k_steps` steps of BK per program).
CONFIG = dict(BN=64, BK=128, num_warps=4, num_stages=4, programs_per_sm=2, min_k_steps=2)
# Launch configs per (N, K, rows rounded up to a power of two >= 16) that beat CONFIG (BM among them past 64 rows),
# from `seed_workloads.py --gemms --splitk-table-out` (H100, 2026-11-26, 12 configs swept with e4m3 rows, cold
# weights): the 1.5B decode GEMMs (qkv, o, gate_up, down) at 16 / 32 / 64 rows, and down at 128 / 256. Times
# there: gate_up 12.7 / 12.9 / 13.9 us (73 / 72 / 67% of copy bandwidth; `_scaled_mm` took 17.6-18.8, bf16 cuBLAS
# 23.6-24.6), down 9.7 / 10.9 / 12.8 us (bf16 15.1-15.8, `_scaled_mm` 23.6), qkv and o 5.5-7.2 us (bf16 5.4-6.0: too
# small to gain from FP8). Other shapes take CONFIG.
TABLE: dict[tuple[int, int, int], dict] = {
    (2048, 1536, 16): dict(BN=64, BK=256, programs_per_sm=4),
    (2048, 1536, 32): dict(BN=64, BK=256, programs_per_sm=2),
    (2048, 1536, 64): dict(BN=64, BK=256, programs_per_sm=2),
    (1536, 1536, 16): dict(BN=64, BK=256, programs_per_sm=1),
    (1536, 1536, 32): dict(BN=64, BK=256, programs_per_sm=2),
    (1536, 1536, 64): dict(BN=64, BK=256, programs_per_sm=1),
    (17920, 1536, 16): dict(BN=64, BK=128, programs_per_sm=1),
    (17920, 1536, 32): dict(BN=64, BK=128, programs_per_sm=2),
    (17920, 1536, 64): dict(BN=64, BK=128, programs_per_sm=2),
    (1536, 8960, 16): dict(BN=64, BK=256, programs_per_sm=1),
    (1536, 8960, 32): dict(BN=64, BK=256, programs_per_sm=1),
    (1536, 8960, 64): dict(BN=64, BK=128, programs_per_sm=1),
    (1536, 8960, 128): dict(BN=64, BK=128, programs_per_sm=1),  # 96-256 rows (row blocks of 64): 13.7 / 16.5 us
    (1536, 8960, 256): dict(BN=64, BK=128, programs_per_sm=1),  # at 128 / 256 rows, bf16 17.1 / 18.5
    # 65-128 rows in one 128-row tile: 16.0 us against `_scaled_mm`'s 19.2 (`--gemm-partials`, H100, 2026-11-26)
    (17920, 1536, 128): dict(BM=128, BN=64, BK=128, num_warps=8, num_stages=3),
}


@triton.jit
def _epilogue(acc, WS, XS, B, Y, n, m, n_ok, m_ok, stride_ym, HAS_BIAS: tl.constexpr):
    y = acc * tl.load(WS + n, mask=n_ok, other=0.0)[:, None] * tl.load(XS + m, mask=m_ok, other=0.0)[None, :]
    if HAS_BIAS:
        y += tl.load(B + n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    tl.store(Y + m[None, :] * stride_ym + n[:, None], y.to(Y.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])


@triton.jit
def _splitk_kernel(X, XS, W, WS, B, Y, P, C, M, N, K, stride_xm, stride_wn, stride_ym, k_per_split,
                   split, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT_K: tl.constexpr,
                   EVEN: tl.constexpr, DOT_FP8: tl.constexpr, HAS_BIAS: tl.constexpr, PARTIALS: tl.constexpr,
                   XS_PER_SPLIT: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    n = pid_n * BN + tl.arange(0, BN)
    m = pid_m * BM + tl.arange(0, BM)
    n_ok = n < N
    m_ok = m < M
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    acc = tl.zeros([BN, BM], tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        k = k0 + tl.arange(0, BK)
        w_ptr = W + n[:, None].to(tl.int64) * stride_wn + k[None, :]
        x_ptr = X + m[None, :] * stride_xm + k[:, None]  # x^T: [BK, BM]
        if EVEN:  # whole K steps and whole column blocks
            w = tl.load(w_ptr)
            xt = tl.load(x_ptr, mask=m_ok[None, :], other=0.0)
        else:
            k_ok = k < k_hi
            w = tl.load(w_ptr, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            xt = tl.load(x_ptr, mask=m_ok[None, :] & k_ok[:, None], other=0.0)
        if DOT_FP8:
            acc = tl.dot(w, xt, acc)
        else:  # Triton's CPU interpreter: e4m3 values are exact in fp16
            acc = tl.dot(w.to(tl.float16), xt.to(tl.float16), acc)
    if PARTIALS:  # Y is [split, M, N]: each program writes its scaled partial, the consumer sums them
        if XS_PER_SPLIT:  # x's scales are [split, M]: one per (K split, row)
            XS += pid_k * M
        _epilogue(acc, WS, XS, B, Y + pid_k.to(tl.int64) * M * N, n, m, n_ok, m_ok, stride_ym, False)
    elif not SPLIT_K:
        _epilogue(acc, WS, XS, B, Y, n, m, n_ok, m_ok, stride_ym, HAS_BIAS)
    else:
        tile = tl.arange(0, BN)[:, None] * BM + tl.arange(0, BM)[None, :]
        out_block = pid_m * tl.num_programs(0) + pid_n  # this program's [BN, BM] tile of y
        block = P + out_block.to(tl.int64) * (split * BN * BM)
        tl.store(block + pid_k * (BN * BM) + tile, acc, cache_modifier=".cg")
        if last_to_arrive(C, out_block, split):  # the last of this output tile: sum the partials in split order
            acc = tl.zeros([BN, BM], tl.float32)
            for s in range(split):
                acc += tl.load(block + s * (BN * BM) + tile, cache_modifier=".cg")
            reset_arrivals(C, out_block)
            _epilogue(acc, WS, XS, B, Y, n, m, n_ok, m_ok, stride_ym, HAS_BIAS)


def plan(M: int, N: int, K: int, config: dict, num_sms: int, bm: int = ROW_BLOCK) -> tuple[int, int, int, int]:
    """(column blocks, split of K, K per split, row blocks of `bm`): enough programs for `programs_per_sm` each, each
    with at least `min_k_steps` steps of BK, the split rounded so every program but the last gets whole steps; a
    `split` key in config sets the split instead (capped so that each program gets at least one step of BK)."""
    tiles, m_blocks = triton.cdiv(N, config["BN"]), triton.cdiv(M, bm)
    steps = triton.cdiv(K, config["BK"])
    want = triton.cdiv(config["programs_per_sm"] * num_sms, tiles * m_blocks)
    split = max(1, min(steps, config["split"]) if config.get("split") else min(steps // config["min_k_steps"], want))
    k_per = triton.cdiv(steps, split) * config["BK"]
    return tiles, triton.cdiv(K, k_per), k_per, m_blocks


def splitk_fp8_matmul(x: FP8Rows, w_NK: torch.Tensor, w_scale_N: torch.Tensor, bias: torch.Tensor | None,
                      out_dtype: torch.dtype, config: dict | None = None, partials: bool = False) -> torch.Tensor:
    """x W^T (+ b) for M <= MAX_ROWS rows: x e4m3 rows [M, K] with one fp32 scale each, W e4m3 [N, K] with one fp32
    scale per row. `config` overrides CONFIG's and TABLE's keys; BM (the row block, a power of two >= 16) defaults to
    the next power of two of M, at most ROW_BLOCK. `partials`: no reduction here; returns the split's scaled partial
    products, [split, M, N] in out_dtype, for a consumer that sums them (`fused.add_rmsnorm`); no bias. With
    partials x may carry [split, M] scales, one per (K split, row), its slices those of `k_slices`."""
    xq = x.q.contiguous()
    M, K = xq.shape
    N = w_NK.shape[0]
    if M > MAX_ROWS:
        raise ValueError(f"splitk_fp8_matmul serves at most {MAX_ROWS} rows, got {M}")
    c, bm = _launch(M, N, K, config)
    if bm < 16 or bm & (bm - 1):
        raise ValueError(f"splitk_fp8_matmul: BM={bm} must be a power of two >= 16")
    if partials and bias is not None:
        raise ValueError("splitk_fp8_matmul: partial products take no bias (the consumer would add it per partial)")
    dev = xq.device
    tiles, split, k_per, m_blocks = plan(M, N, K, c, sm_count(dev), bm)
    per_split = x.scale.dim() == 2
    if per_split and not (partials and tuple(x.scale.shape) == (split, M)):
        raise ValueError(f"splitk_fp8_matmul: scales of shape {tuple(x.scale.shape)} need partials=True and one per "
                         f"(split, row), ({split}, {M}) here")
    y = torch.empty(*((split,) if partials else ()), M, N, dtype=out_dtype, device=dev)
    reduce = split > 1 and not partials
    scratch = torch.empty(m_blocks * tiles * split * c["BN"] * bm if reduce else 1, dtype=torch.float32, device=dev)
    counters = arrival_counters(dev, m_blocks * tiles)
    _splitk_kernel[(tiles, split, m_blocks)](
        xq, x.scale, w_NK, w_scale_N, bias if bias is not None else w_scale_N, y, scratch, counters, M, N, K,
        xq.stride(0), w_NK.stride(0), N, k_per, split, BM=bm, BN=c["BN"], BK=c["BK"], SPLIT_K=reduce,
        EVEN=N % c["BN"] == 0 and K % k_per == 0 and k_per % c["BK"] == 0, DOT_FP8=dev.type == "cuda",
        HAS_BIAS=bias is not None, PARTIALS=partials, XS_PER_SPLIT=per_split, num_warps=c["num_warps"],
        num_stages=c["num_stages"])
    return y


def _launch(M: int, N: int, K: int, config: dict | None) -> tuple[dict, int]:
    """The launch config of an M-row GEMM (CONFIG, then TABLE's entry, then `config`) and its row block."""
    rows = max(16, triton.next_power_of_2(M))
    c = {**CONFIG, **TABLE.get((N, K, rows), {}), **(config or {})}
    return c, c.get("BM") or min(ROW_BLOCK, rows)


def k_slices(M: int, N: int, K: int, config: dict | None, num_sms: int) -> int:
    """The columns of x each split of `splitk_fp8_matmul(..., config)` reads (the last split may read fewer): the
    slice width for scales made per (K split, row) by the producer (`fused.silu_mul`'s slice_cols)."""
    c, bm = _launch(M, N, K, config)
    return plan(M, N, K, c, num_sms, bm)[2]
