"""FP8 GEMM in one wave: one program per SM, for fed e4m3 rows whose output tiles would spill into a second wave.

Why: shape (a)'s decode step runs the 1.5B gate_up (N = 17,920, K = 1,536) at 256 rows. Tiled 128 columns wide that
is 140 output tiles for 132 SMs, so 8 tiles run as a second wave while the rest of the GPU waits. `_scaled_mm` took
20.9 us there and 16.0 us for N = 16,896 (132 tiles); a plain Triton tile kernel 26.3 against 16.4 (cold weights,
H100, `benchmarks/probes/gemm_waves.py --tiles`, 2026-11-27). So the leftover columns cost a whole tile's time.

How: every program owns 128 columns of the first `programs * 128` and, while it streams the x tile through shared
memory anyway, one more chunk of the leftover columns (16 here: 64 chunks for 1,024 columns) as a second, narrow
dot on the same x tile. The programs without a chunk load nothing for it (a fully masked load) and multiply zeros.
x's rows are the MMA's M side, all of them in one tile (BM, 256 at most), so the weight is read once.

Measured (H100, cold weights, `gemm_waves.py`, 2026-11-27): 19.8 / 19.5 / 19.0 us at 256 / 192 / 129 rows against
`_scaled_mm`'s 21.2 / 20.4 / 20.0. The narrow second dot costs ~2.5 us (17.2 us at N = 16,896, where there is no
leftover); the leftover in a loop of its own after the main one (rereading x) cost more (22.7 us). Row masks when the
rows fill the tile cost ~1 us, so they go (EVEN_M). The GEMM stays L2-bound: every program reads all of x (393 KB),
~80 MB from L2 in all. End to end, (a) in FP8 KV + W8 at 73,340 / 73,793 tok/s against 72,562 / 73,524 without it
(A/B in one call, one process each): +0.7%.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from polyrl.rollout.native.attention import FP8Rows, sm_count

MAX_ROWS = 256
CONFIG = dict(BN=128, BK=128, num_warps=8, num_stages=4)
MAX_EXTRA = 64  # the widest leftover chunk a program takes
# (N, K) -> the fewest fed rows where this kernel replaces `_scaled_mm` (fewer: the split-K kernel), measured: the 1.5B
# gate_up (`gemm_waves.py`)
TABLE: dict[tuple[int, int], int] = {(17920, 1536): 129}


@triton.jit
def _one_wave_kernel(X, XS, W, WS, Y, M, N, K, stride_xm, n_main, BM: tl.constexpr, BN: tl.constexpr,
                     BE: tl.constexpr, BK: tl.constexpr, DOT_FP8: tl.constexpr, EVEN_M: tl.constexpr,
                     EXTRA: tl.constexpr):
    # EXTRA: leftover columns exist (N > n_main); EVEN_M: M == BM, no row masks (the row mask cost ~1 us at 256 rows)
    p = tl.program_id(0)
    m = tl.arange(0, BM)
    m_ok = m < M
    n = p * BN + tl.arange(0, BN)
    e = n_main + p * BE + tl.arange(0, BE)  # this program's leftover chunk (none: every column past N)
    e_ok = e < N
    k = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], tl.float32)
    acc_e = tl.zeros([BM, BE], tl.float32)
    for k0 in range(0, K, BK):
        if EVEN_M:
            a = tl.load(X + m[:, None] * stride_xm + (k0 + k)[None, :])
        else:
            a = tl.load(X + m[:, None] * stride_xm + (k0 + k)[None, :], mask=m_ok[:, None], other=0.0)
        b = tl.load(W + n[:, None].to(tl.int64) * K + (k0 + k)[None, :])
        acc = _dot(a, b, acc, DOT_FP8)
        if EXTRA:
            b_e = tl.load(W + e[:, None].to(tl.int64) * K + (k0 + k)[None, :], mask=e_ok[:, None], other=0.0)
            acc_e = _dot(a, b_e, acc_e, DOT_FP8)
    xs = tl.load(XS + m, mask=m_ok, other=0.0)[:, None]
    y = acc * xs * tl.load(WS + n)[None, :]
    tl.store(Y + m[:, None] * N + n[None, :], y.to(Y.dtype.element_ty), mask=m_ok[:, None])
    if EXTRA:
        y_e = acc_e * xs * tl.load(WS + e, mask=e_ok, other=0.0)[None, :]
        tl.store(Y + m[:, None] * N + e[None, :], y_e.to(Y.dtype.element_ty), mask=m_ok[:, None] & e_ok[None, :])


@triton.jit
def _dot(a, b, acc, DOT_FP8: tl.constexpr):
    if DOT_FP8:
        return tl.dot(a, tl.trans(b), acc)
    return tl.dot(a.to(tl.float16), tl.trans(b.to(tl.float16)), acc)  # Triton's CPU interpreter: e4m3 exact in fp16


def plan(N: int, K: int, programs: int, config: dict = CONFIG) -> tuple[int, int] | None:
    """(columns in whole BN blocks, leftover chunk width) for `programs` programs, or None where the kernel does not
    fit the shape: fewer columns than one BN block a program, a leftover wider than MAX_EXTRA a program, or K not in
    whole BK steps."""
    n_main = programs * config["BN"]
    if N < n_main or K % config["BK"]:
        return None
    extra = max(16, triton.next_power_of_2(triton.cdiv(N - n_main, programs)))
    return (n_main, extra) if extra <= MAX_EXTRA else None


def serves(rows: int, n: int, k: int, device: torch.device) -> bool:
    """Whether `one_wave_fp8_matmul` runs an FP8 GEMM of `rows` fed rows and an [n, k] weight: the weights in TABLE
    from its row count up to MAX_ROWS, where the shape fits one wave of this GPU's SMs."""
    lo = TABLE.get((n, k))
    return (lo is not None and lo <= rows <= MAX_ROWS and device.type == "cuda"
            and plan(n, k, sm_count(device)) is not None)


def one_wave_fp8_matmul(x: FP8Rows, w_NK: torch.Tensor, w_scale_N: torch.Tensor, out_dtype: torch.dtype,
                        programs: int | None = None, config: dict | None = None) -> torch.Tensor:
    """x W^T for M <= MAX_ROWS e4m3 rows with one fp32 scale each and an e4m3 [N, K] weight with one fp32 scale per
    row, in `programs` programs (default: the SM count) of one output column block plus a leftover chunk each."""
    c = {**CONFIG, **(config or {})}
    xq = x.q
    M, K = xq.shape
    N = w_NK.shape[0]
    programs = programs or sm_count(xq.device)
    fit = plan(N, K, programs, c)
    if fit is None or M > MAX_ROWS or x.scale.dim() != 1 or xq.stride(1) != 1 or not w_NK.is_contiguous():
        raise ValueError(f"one_wave_fp8_matmul: a [{M}, {K}] x [{N}, {K}] GEMM does not fit {programs} programs of "
                         f"{c['BN']} columns; use fp8_linear.fp8_matmul")
    n_main, extra = fit
    y = torch.empty(M, N, dtype=out_dtype, device=xq.device)
    bm = max(16, triton.next_power_of_2(M))
    _one_wave_kernel[(programs,)](xq, x.scale, w_NK, w_scale_N, y, M, N, K, xq.stride(0), n_main,
                                  BM=bm, BN=c["BN"], BE=extra, BK=c["BK"], DOT_FP8=xq.is_cuda, EVEN_M=M == bm,
                                  EXTRA=N > n_main, num_warps=c["num_warps"], num_stages=c["num_stages"])
    return y
