"""Split-K GEMM for the decode step's two output projections (o and down), CUDA only.

Why: at decode batch <= 256 the o projection (N = hidden, K = q size) and the MLP's down projection (N = hidden,
K = intermediate) have only (M / 128) x (N / 128) output tiles, 24 for a 1.5B model at M=256, so most SMs idle unless K
is split. cuBLAS splits K and then runs its own reduce kernel; the down GEMM also waits on a separate silu(gate) * up
kernel. Here both extra launches go away:
  - each program owns one (M tile, N tile, K range) and writes its fp32 partial sum to `[splits, M, N]`;
  - `fused.add_rmsnorm`, which follows both projections anyway, sums the splits while it adds the residual;
  - for down, the program computes silu(gate) * up from the gate_up GEMM's output while loading its A tile, with the
    same bf16 roundings as `fused.silu_mul`.
fp32 inputs keep cuBLAS (the exact path the greedy-equality tests check); so do large M (prefill), where cuBLAS's
tiles fill the GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_M = 256  # the largest decode batch; prefill chunks are larger and stay on cuBLAS


@triton.jit
def _splitk_kernel(A, W, P, M, N, K, stride_am, stride_wn, k_per_split,
                   INTER: tl.constexpr, SILU: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    # P[s] = A[:, ks] @ W[:, ks]^T over this split's K range ks; with SILU, A is [M, 2*INTER] = (gate | up) and the
    # operand is silu(gate) * up, rounded like fused.silu_mul
    pm = tl.program_id(0)
    pn = tl.program_id(1)
    ps = tl.program_id(2)
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    mm = rm < M
    nm = rn < N
    k_lo = ps * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    dt = A.dtype.element_ty
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        rk = k0 + tl.arange(0, BK)
        km = rk < k_hi
        a_ptr = A + rm[:, None].to(tl.int64) * stride_am + rk[None, :]
        am = mm[:, None] & km[None, :]
        if SILU:
            g = tl.load(a_ptr, mask=am, other=0.0).to(tl.float32)
            u = tl.load(a_ptr + INTER, mask=am, other=0.0).to(tl.float32)
            a = ((g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32) * u).to(dt)
        else:
            a = tl.load(a_ptr, mask=am, other=0.0)
        w = tl.load(W + rn[None, :].to(tl.int64) * stride_wn + rk[:, None], mask=nm[None, :] & km[:, None], other=0.0)
        acc += tl.dot(a, w)
    tl.store(P + (ps * M + rm[:, None]).to(tl.int64) * N + rn[None, :], acc, mask=mm[:, None] & nm[None, :])


# launch knobs, picked on an H100/H200 by `benchmarks/decode_kernels.py --splitk` (see benchmarks/NOTES_rollout.md)
# (enabled=False sends every projection to cuBLAS: the A/B switch of benchmarks/rollout.py --no-splitk)
CONFIG = dict(enabled=True, bn=64, bk=64, num_warps=4, num_stages=3, programs_per_sm=1)


def applies(x: torch.Tensor) -> bool:
    """True where the split-K path is the one to take: a CUDA decode-sized bf16/fp16 activation."""
    return (CONFIG["enabled"] and x.is_cuda and x.shape[0] <= MAX_M
            and x.dtype in (torch.bfloat16, torch.float16))


def num_splits(m: int, n: int, k: int, num_sms: int, bm: int, bn: int, bk: int, programs_per_sm: int) -> int:
    """Enough K splits for `programs_per_sm` programs per SM, each split at least one BK block."""
    tiles = -(-m // bm) * -(-n // bn)
    return max(1, min(-(-k // bk), -(-programs_per_sm * num_sms // tiles)))


def block_m(m: int) -> int:
    return min(128, max(16, triton.next_power_of_2(m)))


_NUM_SMS: dict[int, int] = {}


def matmul_partials(a_MK: torch.Tensor, w_NK: torch.Tensor, silu_gate_up: bool = False, cfg: dict | None = None):
    """fp32 split-K partials [splits, M, N] of a @ w^T (sum over dim 0 for the product).

    silu_gate_up: `a` is the gate_up output [M, 2K] and the product is silu(gate) * up @ w^T.
    """
    cfg = cfg or CONFIG
    M = a_MK.shape[0]
    N, K = w_NK.shape
    assert a_MK.shape[1] == (2 * K if silu_gate_up else K) and a_MK.stride(1) == 1 and w_NK.stride(1) == 1
    dev = a_MK.device.index if a_MK.device.index is not None else torch.cuda.current_device()
    if dev not in _NUM_SMS:
        _NUM_SMS[dev] = torch.cuda.get_device_properties(dev).multi_processor_count
    bm, bn, bk = block_m(M), cfg["bn"], cfg["bk"]
    splits = cfg.get("splits") or num_splits(M, N, K, _NUM_SMS[dev], bm, bn, bk, cfg["programs_per_sm"])
    per = triton.cdiv(triton.cdiv(K, splits), bk) * bk
    splits = triton.cdiv(K, per)  # no empty split
    p = torch.empty(splits, M, N, dtype=torch.float32, device=a_MK.device)
    _splitk_kernel[(triton.cdiv(M, bm), triton.cdiv(N, bn), splits)](
        a_MK, w_NK, p, M, N, K, a_MK.stride(0), w_NK.stride(0), per, INTER=K if silu_gate_up else 0,
        SILU=silu_gate_up, BM=bm, BN=bn, BK=bk, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return p
