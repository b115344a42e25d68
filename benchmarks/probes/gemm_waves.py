"""Probe: is the 1.5B gate_up's FP8 GEMM at 256 rows (shape (a)'s decode step) losing to wave quantisation?

    PYTHONPATH=. python benchmarks/probes/gemm_waves.py [--rows 129,256] [--ns 17920] [--tiles]

Times `_scaled_mm` (fast accumulation), bf16 cuBLAS and a plain row-major Triton FP8 GEMM (x rows on the MMA's M
side, whole-K loop, one output tile a program) at M = 256, K = 1536 for N around 17,920: N = 16,896 is 132 tiles of
128 columns (one per H100 SM), 17,920 is 140. Cold weights (copies cycled past twice the L2), one CUDA graph of all
calls. Then `wave_fp8.py` (one program per SM, leftover columns as a narrow second dot) in a few configs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/: rollout, seed_workloads
from rollout import copy_bandwidth
from seed_workloads import cold_copies, per_cold_call


@triton.jit
def _rows_mm(X, XS, W, WS, Y, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, N_MAJOR: tl.constexpr):
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(N, BN)
    m_tiles = tl.cdiv(M, BM)
    if N_MAJOR:  # neighbouring programs share the x row block, each its own weight slice
        pid_m = pid // n_tiles
        pid_n = pid % n_tiles
    else:
        pid_n = pid // m_tiles
        pid_m = pid % m_tiles
    m = pid_m * BM + tl.arange(0, BM)
    n = pid_n * BN + tl.arange(0, BN)
    k = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, K, BK):
        a = tl.load(X + m[:, None] * K + (k0 + k)[None, :])
        b = tl.load(W + n[:, None].to(tl.int64) * K + (k0 + k)[None, :])
        acc = tl.dot(a, tl.trans(b), acc)
    y = acc * tl.load(XS + m)[:, None] * tl.load(WS + n)[None, :]
    tl.store(Y + m[:, None] * N + n[None, :], y.to(Y.dtype.element_ty))


def rows_mm(xq, xs, wq, ws, y, BM, BN, BK, warps, stages, n_major=True):
    M, K = xq.shape
    N = wq.shape[0]
    grid = (triton.cdiv(M, BM) * triton.cdiv(N, BN),)
    _rows_mm[grid](xq, xs, wq, ws, y, M, N, K, BM=BM, BN=BN, BK=BK, N_MAJOR=n_major, num_warps=warps,
                   num_stages=stages)
    return y


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="256")
    ap.add_argument("--ns", default="16896,17920,8448,8960,16384,18432")
    ap.add_argument("--k", type=int, default=1536)
    ap.add_argument("--tiles", action="store_true", help="also the plain tile kernel over 10 tile shapes")
    ap.add_argument("--rows-out", default=None, help="append a row per shape (one-wave committed config) here")
    args = ap.parse_args()
    torch.manual_seed(0)
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: {torch.cuda.get_device_properties(0).multi_processor_count} SMs, "
          f"copy bandwidth {bw / 1e12:.2f} TB/s, triton {triton.__version__}", flush=True)
    f8 = torch.float8_e4m3fn
    K = args.k
    configs = [(256, 128, 128, 8, 3), (256, 128, 128, 8, 4), (128, 256, 128, 8, 3), (128, 256, 128, 8, 4),
               (256, 64, 128, 4, 4), (256, 64, 128, 8, 4), (128, 128, 128, 4, 4), (128, 128, 128, 8, 4),
               (256, 128, 64, 8, 5), (64, 128, 128, 4, 4)]
    for M in [int(r) for r in args.rows.split(",")]:
        x = torch.randn(M, K, device="cuda")
        xs = x.abs().amax(1) / 448
        xq = (x / xs[:, None]).to(f8)
        xb = x.bfloat16()
        for N in [int(n) for n in args.ns.split(",")]:
            copies = cold_copies(N * K, at_least=2)
            ws_ = [torch.rand(N, device="cuda") / 100 for _ in range(copies)]
            wq = [torch.randn(N, K, device="cuda").to(f8) for _ in range(copies)]
            wb = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
            y = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
            t_sm = per_cold_call(lambda i: torch._scaled_mm(xq, wq[i].t(), scale_a=xs[:, None], scale_b=ws_[i][None, :],
                                                       out_dtype=torch.bfloat16, use_fast_accum=True), copies)
            t_bf = per_cold_call(lambda i: torch.mm(xb, wb[i].t()), copies)
            flop = 2 * M * N * K
            line = (f"M={M} N={N} K={K}: weight floor {N * K / bw * 1e6:.1f} us; _scaled_mm fast {t_sm:.1f} us "
                    f"({flop / t_sm / 1e6:.0f} TFLOP/s), bf16 cuBLAS {t_bf:.1f} us")
            ref = torch._scaled_mm(xq, wq[0].t(), scale_a=xs[:, None], scale_b=ws_[0][None, :],
                                   out_dtype=torch.float32)
            best = None
            for BM, BN, BK, w, st in configs if args.tiles else ():
                if N % BN or M % BM:
                    continue
                try:
                    err = (rows_mm(xq, xs, wq[0], ws_[0], y, BM, BN, BK, w, st).float() - ref).abs().max().item()
                    t = per_cold_call(lambda i: rows_mm(xq, xs, wq[i], ws_[i], y, BM, BN, BK, w, st), copies)
                except Exception as e:  # out of shared memory, say
                    print(f"  triton {BM}x{BN}x{BK} w{w} s{st}: {type(e).__name__}", flush=True)
                    continue
                line += f"\n  triton {BM}x{BN}x{BK} w{w} s{st}: {t:.1f} us (err {err:.2e})"
                if best is None or t < best[0]:
                    best = (t, (BM, BN, BK, w, st))
            from polyrl.rollout.native import wave_fp8
            from polyrl.rollout.native.attention import FP8Rows, sm_count

            rows = FP8Rows(xq, xs)
            for cfg in ({}, dict(num_stages=3), dict(BK=64, num_stages=5)):
                if wave_fp8.plan(N, K, sm_count(xq.device), {**wave_fp8.CONFIG, **cfg}) is None:
                    break
                err = (wave_fp8.one_wave_fp8_matmul(rows, wq[0], ws_[0], torch.bfloat16, config=cfg).float()
                       - ref).abs().max().item()
                t = per_cold_call(lambda i: wave_fp8.one_wave_fp8_matmul(rows, wq[i], ws_[i], torch.bfloat16, config=cfg),
                             copies)
                line += f"\n  one wave {cfg or 'committed'}: {t:.1f} us (err {err:.2e})"
                if not cfg and args.rows_out:
                    from _record import append_row

                    append_row(torch.cuda.get_device_name(), "gemm_waves.py (cold weights, CUDA graph)",
                               f"FP8 GEMM M={M} N={N} K={K}, e4m3 rows and weight, wave_fp8.py committed config",
                               f"{t:.1f} us", f"_scaled_mm fast accumulation: {t_sm:.1f} us",
                               f"weight bytes at copy BW {N * K / bw * 1e6:.1f} us", f"{t_sm / t:.2f}x",
                               f"{N * K / bw * 1e6 / t:.0%}", args.rows_out)
            print(line + (f"\n  best tile kernel {best}" if best else ""), flush=True)
            del wq, wb


if __name__ == "__main__":
    main()
