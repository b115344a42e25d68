"""Append one measurement to the benchmark history, benchmarks/history.jsonl (one JSON object a line, only ever
appended), and regenerate the BENCHMARKS.md summary from it (scripts/gen_benchmarks.py).

Every benchmark script records through `append_row`; `--rows-out FILE` sends the rows to another JSON-lines file (a
run on the device machine), which `python scripts/gen_benchmarks.py add FILE` later appends to the history."""

from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HISTORY = ROOT / "benchmarks" / "history.jsonl"
FIELDS = ("date", "device", "benchmark", "title", "shape", "polyrl", "peer", "limit", "ratio_peer", "ratio_limit",
          "commit")

# A row's title names its script and what it measured, often with the issue or the A/B it served; the summary groups
# rows by a short benchmark name: the first pattern the title matches (else its first word without `.py`).
BENCHMARK_NAMES = [
    (r"^seed_workloads\.py (a|s1|s2)\b", r"seed_workloads \1"),
    (r"^rollout\.py native \((a|b)\)", r"rollout native (\1)"),
    (r"^grpo_step", "grpo_step"),
    (r"^offpolicy_step", "offpolicy_step"),
    (r"^multi_gpu", "multi_gpu update_actor"),
    (r"^flow_grpo", "flow_grpo"),
    (r"^flow async reward", "flow_async_reward"),
    (r"^flow_quickstart_cpu", "flow_quickstart_cpu"),
    (r"^quickstart", "quickstart"),
    (r"^examples/grpo_smollm2_addition\.sh", "grpo_smollm2_addition.sh"),
    (r"^reward_model\.py (scoring|judge)", r"reward_model \1"),
    (r"^moe_decode\.py \(engine, decode only\) (\S+)", r"moe_decode \1"),
    (r"^moe_replay\.py (\S+) rollout", r"moe_replay \1"),
    (r"^tp_decode\.py (\S+) (TP \d+( FP8)?)", r"tp_decode \1 \2"),
    # probes: one engineering question each (benchmarks/probes/); kept in the history, left out of the summary
    (r"^seed_workloads\.py --gemms", "probes/seed_workloads --gemms"),
    (r"^moe_decode\.py --gemms", "probes/moe_decode --gemms"),
    (r"^(a_bound|gemm_waves|sampler_bench|decode_kernel|flow_fp8_rollout)\.py", r"probes/\1"),
    (r"^packed attention", "probes/packed attention"),
    (r"^logprob\+entropy", "probes/logprob+entropy"),
]


def benchmark_name(title: str) -> str:
    for pattern, name in BENCHMARK_NAMES:
        if re.match(pattern, title):
            return re.sub(pattern + ".*", name, title, count=1, flags=re.S)
    return re.sub(r"\.(py|sh)$", "", title.split()[0]) if title.split() else "-"


def device_class(device: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'H100', '2x NVIDIA H200 (one x4 host)' -> '2x H200', any CPU -> 'CPU'."""
    if device.upper().startswith("CPU") or device == "cpu":
        return "CPU"
    gpu = re.search(r"\b([A-Z]\d{2,3}[A-Z]?)\b", device)
    count = re.match(r"(\d+)x ", device) or re.search(r" x(\d+)$", device)
    name = gpu.group(1) if gpu else device.split("(")[0].strip()
    return f"{count.group(1)}x {name}" if count and count.group(1) != "1" else name


def commit() -> str:
    """The measured code's commit: $POLYRL_COMMIT when set (a copied tree whose .git is stale or missing: pass the
    commit the copy was made from), else HEAD, marked `+changes` when tracked files differ from it (the device
    machine's copy once reported an older HEAD for newer code)."""
    if os.environ.get("POLYRL_COMMIT"):
        return os.environ["POLYRL_COMMIT"]
    git = lambda *a: subprocess.run(["git", *a], capture_output=True, text=True,  # noqa: E731
                                    cwd=Path(__file__).parent).stdout.strip()
    try:
        head = git("rev-parse", "--short", "HEAD") or "-"
        return head + ("+changes" if head != "-" and git("status", "--porcelain", "--untracked-files=no") else "")
    except OSError:
        return "-"


def make_row(device: str, title: str, shape: str, polyrl: str, peer: str = "-", limit: str = "-",
             ratio_peer: str = "-", ratio_limit: str = "-", date: str | None = None, commit_: str | None = None) -> dict:
    return {"date": date or datetime.date.today().isoformat(), "device": device, "benchmark": benchmark_name(title),
            "title": title, "shape": shape, "polyrl": polyrl, "peer": peer, "limit": limit, "ratio_peer": ratio_peer,
            "ratio_limit": ratio_limit, "commit": commit_ or commit()}


def append_rows(rows: list[dict], path: str | Path | None = None) -> None:
    """Append rows to `path` (default: the history, then BENCHMARKS.md is regenerated)."""
    path = Path(path or HISTORY)
    with open(path, "a") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    if path.resolve() == HISTORY.resolve():
        _regenerate()


def _regenerate() -> None:
    """BENCHMARKS.md from the history (scripts/ is not a package: load the script by its path)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen_benchmarks", ROOT / "scripts" / "gen_benchmarks.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    gen.write()


def append_row(device: str, benchmark: str, shape: str, polyrl: str, peer: str = "-", limit: str = "-",
               ratio_peer: str = "-", ratio_limit: str = "-", path: str | Path | None = None) -> str:
    """Record one measurement (`benchmark` is the row's title: script and what it measured); returns it as JSON.
    `path` (a script's --rows-out): None, 'history' or BENCHMARKS.md mean the history (and the summary is
    regenerated); another name ending in `.md` is taken as its `.jsonl` sibling; os.devnull records nothing."""
    if path is not None and (str(path) == "history" or Path(path).name == "BENCHMARKS.md"):
        path = None
    elif path is not None and str(path).endswith(".md"):
        path = str(path)[:-3] + ".jsonl"
    row = make_row(device, benchmark, shape, polyrl, peer, limit, ratio_peer, ratio_limit)
    if str(path) != os.devnull:  # a smoke run's numbers measure nothing
        append_rows([row], path)
    return json.dumps(row, ensure_ascii=False)
