"""Wall time and held-out reward of `polyrl flow quickstart` on this machine's CPU, appended to BENCHMARKS.md.

    python benchmarks/flow_quickstart_cpu.py

Fresh model cache, so the time includes building and pretraining the tiny flow model and its reward classifier.
Acceptance (issue 6): held-out reward rises by >= 15 points (0-100) in <= 300 s on 2 cores.
"""

from __future__ import annotations

import os
import platform
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> int:
    os.environ["POLYRL_CACHE"] = tempfile.mkdtemp(prefix="polyrl-bench-cache-")
    from polyrl.trainer import flow_quickstart

    run = tempfile.mkdtemp(prefix="polyrl-bench-flow-")
    r = flow_quickstart.run([f"trainer.run_dir={run}", f"trainer.default_local_dir={run}/checkpoints"])
    gain = r["after"] - r["before"]
    device = f"CPU {platform.machine()} ({os.cpu_count()} cores)"
    print(f"device: {device}\nwall time {r['seconds']:.0f} s (limit 300 s); held-out reward {r['before']:.1f} -> "
          f"{r['after']:.1f} ({gain:+.1f}; acceptance >= +15)")
    from _record import append_row

    steps = flow_quickstart.default_config().trainer.total_training_steps
    append_row(device, "flow_quickstart_cpu", f"tiny flow transformer on rendered digits, FlowGRPO {steps} steps, "
               "classifier reward (0-100)", f"{r['seconds']:.0f} s, reward {r['before']:.1f} -> {r['after']:.1f} "
               f"({gain:+.1f})", limit="300 s budget", ratio_limit=f"{r['seconds'] / 300:.2f} of budget")
    return 0 if gain >= 15 and r["seconds"] <= 300 else 1


if __name__ == "__main__":
    sys.exit(main())
