"""Where a profiled stage's time went: the top GPU kernels (or CPU ops, on a CPU trace) of torch profiler traces.

    python benchmarks/probes/trace_top.py /tmp/prof/step_2_update_actor_rank0.json [--top 25]

Reads the Chrome trace JSON that `global_profiler.tool=torch` writes (polyrl/utils/profiler.py) and prints:
- the trace's wall span and the GPU's busy time (the union of kernel intervals) inside it, so idle GPU time shows;
- time by kernel family (GEMM, grouped GEMM, attention, NCCL, copies and casts, elementwise, other);
- the top kernels by total time, with count and mean.
Written for issue 47's MoE update (4% MFU on 2 H200s): is it GEMMs, collectives, casts, or an idle GPU?
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict

FAMILIES = [  # first match wins; kernel names as CUDA/cuBLAS/CUTLASS/Triton print them
    ("nccl", r"nccl"),
    ("grouped gemm", r"grouped|_grouped_mm|GroupedGemm|group_gemm"),
    ("gemm", r"gemm|sm90_xmma|cutlass|cublas|nvjet|matmul|wgmma"),
    ("attention", r"flash|fmha|attention|sdpa"),
    ("copy/cast", r"copy|Memcpy|Memset|cast|to_copy|convert"),
    ("elementwise", r"elementwise|vectorized|reduce|triton_"),
]


def family(name: str) -> str:
    for fam, pattern in FAMILIES:
        if re.search(pattern, name, re.I):
            return fam
    return "other"


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def summarize(events: list[dict]) -> dict:
    """Kernel events (cat 'kernel' or 'gpu_memcpy'/'gpu_memset'); on a CPU-only trace, the top-level cpu_ops."""
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    timed = gpu or [e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    wall = (max(e["ts"] + e["dur"] for e in spans) - min(e["ts"] for e in spans)) if spans else 0.0
    by_name: dict[str, list[float]] = defaultdict(list)
    by_family: dict[str, float] = defaultdict(float)
    for e in timed:
        by_name[e["name"]].append(e["dur"])
        by_family[family(e["name"])] += e["dur"]
    return {"kind": "gpu kernels" if gpu else "cpu ops (nested: a parent counts its children too)", "wall_us": wall,
            "busy_us": busy_us([(e["ts"], e["ts"] + e["dur"]) for e in timed]) if gpu else None,
            "families": dict(sorted(by_family.items(), key=lambda kv: -kv[1])),
            "top": sorted(((n, sum(d), len(d)) for n, d in by_name.items()), key=lambda t: -t[1])}


def report(path: str, top: int) -> str:
    s = summarize(json.load(open(path)).get("traceEvents", []))
    total = sum(s["families"].values()) or 1.0
    lines = [f"{path}: wall {s['wall_us'] / 1e6:.3f} s, {s['kind']}"]
    if s["busy_us"] is not None:
        lines[0] += f", GPU busy {s['busy_us'] / 1e6:.3f} s ({100 * s['busy_us'] / max(s['wall_us'], 1):.0f}% of wall)"
    lines.append("  by family: " + ", ".join(f"{k} {v / 1e6:.3f} s ({100 * v / total:.0f}%)"
                                             for k, v in s["families"].items()))
    for name, dur, count in s["top"][:top]:
        lines.append(f"  {dur / 1e6:9.4f} s {count:7d}x {dur / count:10.1f} us  {name[:110]}")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args(argv)
    for path in args.traces:
        print(report(path, args.top))


if __name__ == "__main__":
    main()
