"""FP8-weight GEMM for the few rows of a decode step: y = x (W * s)^T (+ b), e4m3 W, bf16 x, one Triton launch.

Why: in the long tail of an RL batch a decode step has 1-16 rows, so a GEMM is a pass over its weight bytes.
`torch._scaled_mm` (fp8_linear.py) needs the activation quantised first (a launch of its own) and cuBLASLt picks a
128 x 128 tile for 8 rows: gate_up of the 1.5B model took ~17 us for 27.5 MB of e4m3, half of HBM bandwidth
(H100 profile, 2026-11-25). Here the weight is upcast in registers and the activation is read as it is, so one
kernel streams the e4m3 bytes: every program owns BN output columns (whole weight rows) and walks K.
Measured (H100, 8 rows): 1.5B gate_up 12.6 us = 1.39x `_scaled_mm`, 1.9x bf16 cuBLAS; smaller GEMMs (1.5B qkv, o and
down, under fp8_linear's size threshold) stay faster in bf16 cuBLAS, as they are at 64-256 rows.

Numbers: the weight's e4m3 values times its row scale, the activation unquantised, fp32 accumulation, the scale
and the bias applied once at the end; so it is closer to the bf16 GEMM than the W8A8 path (which also rounds x).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# fp8_linear routes at most W8A16_MAX_ROWS rows here (16, measured); the kernel serves up to MAX_ROWS, in tiles of
# 16, 32 or 64 rows (the next power of two), so `seed_workloads.py --gemms` can time 17-64 rows against `_scaled_mm`
# (which took ~37 us for 1.5B gate_up at 32 rows on the H100: bulk decode at 17-64 sequences is most of s1's steps)
MAX_ROWS = 64


@triton.jit
def _w8a16_kernel(X, W, S, B, Y, M, N, K, stride_xm, stride_wn, stride_ym,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr,
                  HAS_BIAS: tl.constexpr):
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    m = tl.arange(0, BM)
    n_ok = n < N
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)
        if EVEN_K:
            x = tl.load(X + m[:, None] * stride_xm + k[None, :], mask=m[:, None] < M, other=0.0)
            w = tl.load(W + n[:, None].to(tl.int64) * stride_wn + k[None, :], mask=n_ok[:, None], other=0.0)
        else:
            x = tl.load(X + m[:, None] * stride_xm + k[None, :], mask=(m[:, None] < M) & (k[None, :] < K),
                        other=0.0)
            w = tl.load(W + n[:, None].to(tl.int64) * stride_wn + k[None, :],
                        mask=n_ok[:, None] & (k[None, :] < K), other=0.0)
        acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    y = acc * tl.load(S + n, mask=n_ok, other=0.0)[None, :]
    if HAS_BIAS:
        y += tl.load(B + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + m[:, None] * stride_ym + n[None, :], y.to(Y.dtype.element_ty), mask=(m[:, None] < M) & n_ok[None, :])


# Launch config, from `benchmarks/seed_workloads.py --gemms` on an H100 (2026-11-25, 8 rows, 18 configs swept): 32
# columns x 256 bytes of K per step, 3 stages, was the best or within 10% of it for every FP8 GEMM of the 1.5B and 8B
# shapes (1.5B gate_up 12.6 us against 17.5 for `_scaled_mm` and 24.0 for bf16; 8B qkv 14.0 vs 20.2, down 32.9 vs
# 49.6); 64 columns and 512-byte steps, the first guess, gave 15.4 us on gate_up and 22 us on a 1.5B-sized down.
CONFIG = dict(BN=32, BK=256, num_warps=4, num_stages=3)


def w8a16_matmul(x_MK: torch.Tensor, w_NK: torch.Tensor, w_scale_N: torch.Tensor, bias: torch.Tensor | None,
                 out_dtype: torch.dtype, config: dict | None = None) -> torch.Tensor:
    """x W^T * s (+ b) for M <= MAX_ROWS rows: W e4m3 [N, K] with one fp32 scale per row, x in bf16/fp16/fp32.
    `config` may name BM (the row tile, a power of two >= 16 and >= M); by default the next power of two of M."""
    M, K = x_MK.shape
    N = w_NK.shape[0]
    if M > MAX_ROWS:
        raise ValueError(f"w8a16_matmul serves at most {MAX_ROWS} rows, got {M}")
    x_MK = x_MK.contiguous()
    y = torch.empty(M, N, dtype=out_dtype, device=x_MK.device)
    c = {**CONFIG, **(config or {})}
    bm = c.get("BM") or max(16, triton.next_power_of_2(M))
    if bm < M or bm < 16 or bm & (bm - 1):
        raise ValueError(f"w8a16_matmul: BM={bm} must be a power of two >= 16 and >= the {M} rows")
    _w8a16_kernel[(triton.cdiv(N, c["BN"]),)](
        x_MK, w_NK, w_scale_N, bias if bias is not None else w_scale_N, y, M, N, K, x_MK.stride(0), w_NK.stride(0),
        y.stride(0), BM=bm, BN=c["BN"], BK=c["BK"], EVEN_K=K % c["BK"] == 0, HAS_BIAS=bias is not None,
        num_warps=c["num_warps"], num_stages=c["num_stages"])
    return y
