"""The fused sampler's time per decode step (`fused.sample_rows`), by vocabulary chunk count.

    PYTHONPATH=. python benchmarks/probes/sampler_bench.py [--rows 256,64] [--chunks 16,32,64] [--old path/to/fused.py]

bf16 logits of Qwen2.5's vocabulary (151,936), temperature 1, one CUDA graph of 20 calls. Prints microseconds a call
and the logits' bytes over that time against the copy bandwidth. --old times another fused.py's sample_rows beside it
(an earlier commit's: `git show REV:polyrl/rollout/native/fused.py > old_fused.py`).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/: rollout, seed_workloads
from rollout import copy_bandwidth
from seed_workloads import per_cold_call

from polyrl.rollout.native import fused


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="256,64")
    ap.add_argument("--chunks", default="16,32,64")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--old", default=None)
    ap.add_argument("--rows-out", default=None, help="append a row per row count (the default chunks) here")
    args = ap.parse_args()
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    default = fused.SAMPLE_CHUNKS
    old = None
    if args.old:
        spec = importlib.util.spec_from_file_location("old_fused", args.old)
        old = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(old)
    for R in [int(r) for r in args.rows.split(",")]:
        logits = (torch.randn(R, args.vocab, device="cuda") * 3).bfloat16()
        floor = logits.numel() * 2 / bw * 1e6
        runs = [(f"chunks {c}", fused, c) for c in (int(c) for c in args.chunks.split(","))]
        if old is not None:
            runs.append((f"old, chunks {old.SAMPLE_CHUNKS}", old, old.SAMPLE_CHUNKS))
        times = {}
        for name, mod, chunks in runs:
            mod.SAMPLE_CHUNKS = chunks
            t = per_cold_call(lambda i: mod.sample_rows(logits, 1.0, i), 20)  # 20 seeds; the logits stay warm
            times[name] = t
            print(f"rows {R}: {name}: {t:.1f} us (one read of the logits at copy bandwidth {floor:.1f} us)", flush=True)
        ours = times.get(f"chunks {default}")
        if args.rows_out and ours is not None:
            from _record import append_row

            old_name = next((n for n in times if n.startswith("old")), None)
            append_row(torch.cuda.get_device_name(), "sampler_bench.py (CUDA graph)",
                       f"fused.sample_rows, {R} rows x {args.vocab:,} bf16 logits, temperature 1, {default} chunks",
                       f"{ours:.1f} us", f"{old_name}: {times[old_name]:.1f} us" if old_name else "-",
                       f"one read of the logits at copy BW {floor:.1f} us",
                       f"{times[old_name] / ours:.2f}x" if old_name else "-", f"{floor / ours:.0%}", args.rows_out)


if __name__ == "__main__":
    main()
