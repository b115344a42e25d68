"""What one Python-tool call costs in the sandbox (polyrl/tools/sandbox.py): cold (a sandbox started for the call)
against warm (a child forked by a pooled sandbox), one caller at a time and `--callers` at once, as a multi-turn
rollout's tool threads call it (`rollout.agent.num_workers`, 8). The code is a 3-digit product, the tool calls the
SmolLM2 run makes. Prints ms a call (mean wall time per call seen by a caller) and calls/s through all callers.

    PYTHONPATH=. python benchmarks/probes/sandbox_calls.py --rows-out history
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

from polyrl.tools.sandbox import SandboxLimits, close_warm, isolation, run_python  # noqa: E402

CODE = "print(123 * 456)"


def measure(warm: bool, callers: int, calls: int) -> tuple[float, float]:
    """(mean ms a call as a caller waits for it, calls/s through all callers) for `calls` calls."""
    limits = SandboxLimits()
    for _ in range(callers):  # warm: one pooled sandbox per caller, started before the clock
        run_python(CODE, limits, warm)

    def one(_):
        t = time.perf_counter()
        res = run_python(CODE, limits, warm)
        assert res.stdout.strip() == "56088", res
        return time.perf_counter() - t

    t0 = time.perf_counter()
    with ThreadPoolExecutor(callers) as pool:
        waits = list(pool.map(one, range(calls)))
    wall = time.perf_counter() - t0
    return 1e3 * sum(waits) / len(waits), calls / wall


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--callers", type=int, default=8)
    ap.add_argument("--calls", type=int, default=256, help="calls per concurrent measurement (one step's worth)")
    ap.add_argument("--rows-out", default=None)
    args = ap.parse_args()
    path = isolation()
    import torch

    gpu = f"{torch.cuda.get_device_name()} machine, " if torch.cuda.is_available() else ""
    device = f"{gpu}{os.cpu_count()} CPU cores"  # the sandbox runs on the host's CPUs
    out = {}
    for warm in (False, True):
        for callers, calls in ((1, 32), (args.callers, args.calls)):
            ms, rate = measure(warm, callers, calls)
            out[(warm, callers)] = (ms, rate)
            print(f"{'warm' if warm else 'cold'} sandbox ({path}), {callers} caller(s): {ms:7.1f} ms a call, "
                  f"{rate:7.1f} calls/s", flush=True)
    close_warm()
    if args.rows_out:
        from _record import append_row

        cold, warm = out[(False, args.callers)], out[(True, args.callers)]
        append_row(device, "probes/sandbox_calls.py Python-tool call cost",
                   f"sandbox path {path}; `{CODE}`; {args.calls} calls through {args.callers} threads (one multi-turn "
                   f"step's tool calls); alone: cold {out[(False, 1)][0]:.1f} ms, warm {out[(True, 1)][0]:.1f} ms "
                   "a call",
                   f"warm: {warm[0]:.1f} ms a call, {warm[1]:.0f} calls/s",
                   peer=f"cold: {cold[0]:.1f} ms a call, {cold[1]:.0f} calls/s",
                   ratio_peer=f"{warm[1] / cold[1]:.1f}x calls/s", path=args.rows_out)


if __name__ == "__main__":
    main()
