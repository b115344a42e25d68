"""Wall time and held-out accuracy of `polyrl quickstart` on this machine's CPU, appended to the benchmark history (benchmarks/history.jsonl).

    python benchmarks/quickstart_cpu.py [--threads N]

The model cache is a fresh temporary directory, so the time includes building the model and the SFT warm-up.
Acceptance (issue 2): accuracy rises by >= 20 points in <= 300 s on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args()
    os.environ["POLYRL_CACHE"] = tempfile.mkdtemp(prefix="polyrl-bench-cache-")
    import torch

    torch.set_num_threads(args.threads)
    from polyrl.trainer.quickstart import run_quickstart

    r = run_quickstart(tempfile.mkdtemp(prefix="polyrl-bench-run-"))
    gain = 100 * (r["accuracy_after"] - r["accuracy_before"])
    device = f"CPU {platform.processor() or platform.machine()} x{args.threads} threads ({os.cpu_count()} cores)"
    print(f"device: {device}")
    print(f"quickstart wall time: {r['wall_s']:.1f} s (limit 300 s)")
    print(f"held-out greedy accuracy: {100 * r['accuracy_before']:.1f}% -> {100 * r['accuracy_after']:.1f}% "
          f"({gain:+.1f} points; acceptance >= +20)")
    if not args.no_record:
        from _record import append_row

        row = append_row(device, "quickstart_cpu", "tiny Llama 2L/128, reverse task, SFT 300 + GRPO 40 steps",
                         f"{r['wall_s']:.0f} s, acc {100 * r['accuracy_before']:.1f}% -> "
                         f"{100 * r['accuracy_after']:.1f}% ({gain:+.1f} pts)",
                         limit="300 s budget", ratio_limit=f"{r['wall_s'] / 300:.2f} of budget")
        print("appended:", row.strip())
    return 0 if gain >= 20 and r["wall_s"] <= 300 else 1


if __name__ == "__main__":
    sys.exit(main())
