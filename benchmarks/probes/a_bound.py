"""What shape (a) can reach with a kernel per op: each op of a decode step timed alone, summed (#16).

    PYTHONPATH=. python benchmarks/probes/a_bound.py [--rows-out history]

Shape (a) is Qwen2.5-1.5B (tied head), 256 sequences x 256 prompt + 1,024 new tokens. For each config (FP8 KV + FP8
weights, the defaults' choice of kernels; and bf16) every op of one decode layer runs alone at 256 rows, cold weights
(copies cycled past twice the L2) or four layer caches cycled, timed as a CUDA graph; the layer sum times 28, plus
the LM head and the sampler, is a step. The bound is generous on purpose: the paged decode at the run's mean context
(768 tokens, whole steps only, no RoPE or K/V write), gate_up in FP8 as if its leftover columns were free (cuBLAS at
132 tiles, scaled to 140), and every launch with no gap before the next. Then the run: 1,023 steps plus prefill and
host time (taken from seed_workloads.py's rows of the same code: --prefill-s-*, --host-s) against the bf16 roofline
(weights plus every step's KV bytes at the copy bandwidth measured here, as seed_workloads.py counts it).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the probes
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _record, seed_workloads
from _record import append_row  # noqa: E402
from decode_kernel import Cache, copy_bandwidth  # noqa: E402
from seed_workloads import cold_copies, per_cold_call  # noqa: E402

from polyrl.rollout.native import fused, paged_decode_v2, splitk_fp8, wave_fp8  # noqa: E402
from polyrl.rollout.native.attention import FP8Rows, quantize_fp8_rows, sm_count  # noqa: E402
from polyrl.rollout.native.fp8_linear import _rows_matmul, partials_entry  # noqa: E402
from polyrl.rollout.native.model import sliced_linear  # noqa: E402

H, I, L, QH, KVH, V, D = 1536, 8960, 28, 12, 2, 151936, 128
ROWS, PROMPT, NEW = 256, 256, 1024
DEV = "cuda"


def us(fn, copies: int = 1) -> float:
    """Microseconds a call of fn(i), i cycling over `copies` (1: the same inputs every call, L2-warm)."""
    return per_cold_call(fn, copies)


def cold(shape, fp8: bool = False):
    """Enough copies of a weight to pass twice the L2, and how many."""
    n = cold_copies(shape[0] * shape[1] * (1 if fp8 else 2), at_least=2)
    ws = [torch.randn(*shape, device=DEV, dtype=torch.bfloat16) * 0.02 for _ in range(n)]
    return ([quantize_fp8_rows(w) for w in ws] if fp8 else ws), n


def attention(fp8: bool) -> float:
    cache = Cache(KVH, ROWS, PROMPT + NEW // 2, layers=4)
    if fp8:
        cache.to_fp8()
    q = torch.randn(ROWS, QH, D, dtype=torch.bfloat16, device=DEV)
    splits = paged_decode_v2.choose_num_splits(ROWS, KVH, sm_count(q.device), fp8, num_heads=QH)
    meta = cache.meta(ROWS, splits)
    return us(lambda i: paged_decode_v2.paged_decode(q, cache.layers[i][0], cache.layers[i][1], meta, D**-0.5,
                                                     *cache.layers[i][2]), 4)


def layer_ops(fp8: bool) -> dict[str, float]:
    x = torch.randn(ROWS, H, dtype=torch.bfloat16, device=DEV)
    res = torch.randn_like(x)
    ln = torch.ones(H, dtype=torch.bfloat16, device=DEV)
    t = {"paged decode (768 context, no RoPE / K/V write)": attention(fp8)}
    qkv, n = cold((H + 2 * KVH * D, H))
    bias = torch.zeros(H + 2 * KVH * D, dtype=torch.bfloat16, device=DEV)
    t["qkv (bf16)"] = us(lambda i: torch.nn.functional.linear(x, qkv[i], bias), n)
    o, n = cold((H, H))
    t["o (bf16)"] = us(lambda i: torch.nn.functional.linear(x, o[i]), n)
    gu_act = torch.randn(ROWS, 2 * I, dtype=torch.bfloat16, device=DEV)
    if fp8:
        xr = FP8Rows(*quantize_fp8_rows(x))
        gu, n = cold((2 * I, H), fp8=True)
        t["gate_up (FP8, one wave)"] = us(lambda i: wave_fp8.one_wave_fp8_matmul(xr, *gu[i], torch.bfloat16), n)
        part, n = cold((wave_fp8.plan(2 * I, H, sm_count(x.device))[0], H), fp8=True)
        t["gate_up (FP8, cuBLAS at 132 tiles x 140/132: the bound)"] = us(
            lambda i: _rows_matmul(xr.q, xr.scale, *part[i], None, torch.bfloat16, fast_accum=True), n) * (
            2 * I / part[0][0].shape[0])
        cfg = partials_entry(ROWS, H, I)
        cols = splitk_fp8.k_slices(ROWS, H, I, cfg, sm_count(x.device))
        act = fused.silu_mul(gu_act, fp8=True, slice_cols=cols)
        t["silu_mul (FP8 out, a scale per K split)"] = us(lambda i: fused.silu_mul(gu_act, fp8=True, slice_cols=cols))
        dn, n = cold((H, I), fp8=True)
        t["down (FP8 split-K partials)"] = us(
            lambda i: splitk_fp8.splitk_fp8_matmul(act, *dn[i], None, torch.bfloat16, cfg, partials=True), n)
        parts = splitk_fp8.splitk_fp8_matmul(act, *dn[0], None, torch.bfloat16, cfg, partials=True)
    else:
        gu, n = cold((2 * I, H))
        t["gate_up (bf16)"] = us(lambda i: torch.nn.functional.linear(x, gu[i]), n)
        act = fused.silu_mul(gu_act)
        t["silu_mul"] = us(lambda i: fused.silu_mul(gu_act))
        dn, n = cold((H, I))
        t["down (bf16, 4 K slices)"] = us(lambda i: sliced_linear(act, dn[i], 4), n)
        parts = sliced_linear(act, dn[0], 4)
    t["add_rmsnorm (after o)"] = us(lambda i: fused.add_rmsnorm(x, res, ln, 1e-6, fp8=fp8))
    # after down: the next layer's qkv is bf16 in both configs (below fp8_linear's size line)
    t["add_rmsnorm (after down, its partials)"] = us(lambda i: fused.add_rmsnorm(parts, res, ln, 1e-6))
    if fp8:  # the bound takes the one-wave ideal for gate_up, not the kernel the engine runs
        t.pop("gate_up (FP8, one wave)")
    return t


def head_ops() -> dict[str, float]:
    x = torch.randn(ROWS, H, dtype=torch.bfloat16, device=DEV)
    emb = torch.randn(V, H, dtype=torch.bfloat16, device=DEV) * 0.02  # 467 MB: cold by itself
    logits = torch.nn.functional.linear(x, emb)
    return {"LM head (bf16, tied)": us(lambda i: torch.nn.functional.linear(x, emb)),
            "sampler": us(lambda i: fused.sample_rows(logits, 1.0, i))}


def bf16_roofline(bw: float) -> float:
    """seed_workloads.py's bf16 roofline for (a): every step reads the weights (tied head once) and each sequence's
    context K/V."""
    per_layer = H * (H + 2 * KVH * D) + (H + 2 * KVH * D) + H * H + 2 * I * H + I * H + 2 * H
    W = 2 * (L * per_layer + V * H + H)
    kv_tok = 2 * L * KVH * D * 2
    ctx = ROWS * sum(PROMPT + j for j in range(1, NEW + 1))
    return ROWS * NEW / ((NEW * W + ctx * kv_tok) / bw)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefill-s-fp8", type=float, default=0.22, help="(a)'s prefill GPU time in FP8 KV + W8 "
                    "(seed_workloads.py rows, 2026-11-27)")
    ap.add_argument("--prefill-s-bf16", type=float, default=0.32, help="the same in bf16")
    ap.add_argument("--host-s", type=float, default=0.05, help="a run's time outside the GPU's decode and prefill")
    ap.add_argument("--rows-out", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    bw = copy_bandwidth()
    roof = bf16_roofline(bw)
    name = torch.cuda.get_device_name()
    print(f"{name}: copy bandwidth {bw / 1e12:.2f} TB/s; (a)'s bf16 roofline {roof:,.0f} tok/s", flush=True)
    head = head_ops()
    for cname, fp8, prefill in (("fp8kv_w8", True, args.prefill_s_fp8), ("bf16", False, args.prefill_s_bf16)):
        ops = layer_ops(fp8)
        layer = sum(ops.values())
        step = L * layer + sum(head.values())
        run = (NEW - 1) * step * 1e-6 + prefill + args.host_s
        tps = ROWS * NEW / run
        print(f"\n== {cname}: per layer at {ROWS} rows, each op alone", flush=True)
        for k, v in {**ops, **{f"{k} (a step)": v for k, v in head.items()}}.items():
            print(f"  {k}: {v:.1f} us")
        print(f"  layer {layer:.1f} us; step {step / 1e3:.3f} ms; run {run:.2f} s with prefill {prefill} s and host "
              f"{args.host_s} s: {tps:,.0f} tok/s = {tps / roof:.0%} of the bf16 roofline", flush=True)
        if args.rows_out:
            append_row(name, "a_bound.py (each op alone, summed)",
                       f"qwen2.5-1.5b (a), 256 x (256 + 1,024), {cname}: layer {layer:.1f} us ("
                       + ", ".join(f"{k} {v:.1f}" for k, v in ops.items()) + f"), LM head {head['LM head (bf16, tied)']:.0f}"
                       f" + sampler {head['sampler']:.0f} us a step, step {step / 1e3:.2f} ms; prefill {prefill} s and "
                       f"host {args.host_s} s from seed_workloads.py rows", f"{tps:,.0f} tok/s at best",
                       "-", f"bf16 roofline {roof:,.0f} (copy BW {bw / 1e12:.2f} TB/s)", "-", f"{tps / roof:.0%}",
                       args.rows_out)


if __name__ == "__main__":
    main()
