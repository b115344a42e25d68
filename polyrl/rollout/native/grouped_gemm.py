"""A Triton grouped GEMM for the MoE experts: y[rows of expert e] = x[rows of expert e] @ w[e]^T, one launch.

The alternative to `torch._grouped_mm` (moe.py's `GROUPED_GEMM`; `benchmarks/moe_decode.py --gemms` measures both).
The design is vLLM's fused-MoE tiling without its padding copy. The rows come sorted by expert, and `offs` holds each
expert's end row (moe.py's `sort_by_expert`). Each expert's run of rows is cut into BLOCK_M tiles, so a tile belongs to
one expert. A program takes one (tile, BLOCK_N columns) pair and reads that expert's weight slab once. At decode sizes
(a few rows per expert), BLOCK_M = 16 wastes less of each tile than a 64- or 128-row tile would.

The tile table (tile -> expert, first row) is built on the device from `offs`, so nothing syncs with the host and CUDA
graphs capture the launch. The grid is sized for the worst case, cdiv(M, BLOCK_M) + E tiles; the programs past the
last real tile exit at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from polyrl.rollout.native.moe import tile_table


@triton.jit
def _grouped_gemm_kernel(X, W, Y, TILE_EXPERT, TILE_ROW, OFFS, N, K, stride_we,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(TILE_EXPERT + t)
    if e < 0:  # past the last real tile
        return
    row0 = tl.load(TILE_ROW + t).to(tl.int64)
    row_end = tl.load(OFFS + e).to(tl.int64)
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    rmask = rows < row_end
    cmask = cols < N
    x_ptr = X + rows[:, None] * K + ks[None, :]
    w_ptr = W + e.to(tl.int64) * stride_we + cols[None, :].to(tl.int64) * K + ks[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kmask = (k0 + ks) < K
        a = tl.load(x_ptr, mask=rmask[:, None] & kmask[None, :], other=0.0)
        b = tl.load(w_ptr, mask=kmask[:, None] & cmask[None, :], other=0.0)
        acc = tl.dot(a, b, acc)
        x_ptr += BLOCK_K
        w_ptr += BLOCK_K
    y_ptr = Y + rows[:, None] * N + cols[None, :]
    tl.store(y_ptr, acc.to(Y.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])


def config(rows: int, num_experts: int, n: int) -> dict:
    """Tile shape by rows per expert: decode sizes (<= 16 a expert on average) take 16-row tiles."""
    per_expert = rows / max(num_experts, 1)
    bm = 16 if per_expert <= 16 else 32 if per_expert <= 32 else 64
    return dict(BLOCK_M=bm, BLOCK_N=64 if bm <= 32 else 128, BLOCK_K=128 if bm <= 32 else 64,
                num_warps=4, num_stages=4 if bm <= 32 else 3)


def grouped_gemm(x_MK: torch.Tensor, w_ENK: torch.Tensor, offs_E: torch.Tensor, cfg: dict | None = None):
    """x rows grouped by expert (`offs`: each expert's end row) times their expert's w^T: [M, N]."""
    M, K = x_MK.shape
    E, N, _ = w_ENK.shape
    cfg = dict(cfg or config(M, E, N))
    bm = cfg.pop("BLOCK_M")
    expert, first = tile_table(offs_E, M, bm)
    y = torch.empty(M, N, dtype=x_MK.dtype, device=x_MK.device)
    x_MK, w_ENK = x_MK.contiguous(), w_ENK.contiguous()
    grid = (expert.shape[0], triton.cdiv(N, cfg["BLOCK_N"]))
    _grouped_gemm_kernel[grid](x_MK, w_ENK, y, expert, first, offs_E, N, K, w_ENK.stride(0), BLOCK_M=bm, **cfg)
    return y
