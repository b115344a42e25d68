"""BENCHMARKS.md is generated from benchmarks/history.jsonl (scripts/gen_benchmarks.py): the two agree, the summary
keeps to its size limits, and a new row recorded by a benchmark script supersedes the older one in the summary while
the history keeps both."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIELDS = ("date", "device", "benchmark", "title", "shape", "polyrl", "peer", "limit", "ratio_peer", "ratio_limit",
          "commit")


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_benchmarks_md_agrees_with_the_history():
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_benchmarks.py"), "--check"], capture_output=True,
                       text=True)
    assert p.returncode == 0, p.stdout + p.stderr
    lines = (ROOT / "BENCHMARKS.md").read_text().splitlines()
    rows = [line for line in lines if line.startswith("| 20")]
    assert 0 < len(rows) <= 40
    assert max(len(line) for line in rows) <= 300


def test_every_history_row_has_the_fields():
    rows = [json.loads(line) for line in (ROOT / "benchmarks" / "history.jsonl").read_text().splitlines()]
    assert len(rows) >= 482  # the rows BENCHMARKS.md held when it became generated; the history is only appended to
    for n, row in enumerate(rows, 1):
        missing = [f for f in FIELDS if not isinstance(row.get(f), str) or not row[f]]
        assert not missing, (n, missing)


def test_a_recorded_row_supersedes_the_older_one_and_check_notices(tmp_path, monkeypatch):
    gen = _load("gen_benchmarks_t", ROOT / "scripts" / "gen_benchmarks.py")
    record = sys.modules["_record"]
    history, summary = tmp_path / "history.jsonl", tmp_path / "BENCHMARKS.md"
    history.write_text("")
    for mod in (gen, record):
        monkeypatch.setattr(mod, "HISTORY", history)
    monkeypatch.setattr(gen, "SUMMARY", summary)
    monkeypatch.setattr(record, "_regenerate", gen.write)

    old = record.make_row("NVIDIA H100 80GB HBM3", "rollout.py native (a)", "1.5B", "50,000 new tok/s",
                          date="2026-01-01", commit_="abc")
    record.append_rows([old], history)
    assert gen.check() == 0 and "50,000" in summary.read_text()
    record.append_row("NVIDIA H100 80GB HBM3", "rollout.py native (a) after a change", "1.5B", "60,000 new tok/s",
                      path=history)
    record.append_row("CPU (2 threads)", "a_bound.py (each op alone)", "probe", "91%", path=history)
    text = summary.read_text()
    assert "60,000" in text and "50,000" not in text  # the newer row of (rollout native (a), H100) wins
    assert "| 2026-01-01" not in text and "a_bound" in text.split("Probes")[1]  # probes stay out of the table
    assert len(history.read_text().splitlines()) == 3  # the history keeps all three
    history.write_text(history.read_text() + json.dumps({**old, "polyrl": "70,000 new tok/s", "date": "2099-01-01"})
                       + "\n")
    assert gen.check() == 1  # the summary no longer matches


def test_device_and_benchmark_names():
    record = _load("_record_t", ROOT / "benchmarks" / "_record.py")
    assert record.device_class("NVIDIA H100 80GB HBM3") == "H100"
    assert record.device_class("2x NVIDIA H200 (one x4 host)") == "2x H200"
    assert record.device_class("NVIDIA H200 (1 GPU of a 4x H200 host)") == "H200"
    assert record.device_class("CPU x86_64 (2 cores)") == "CPU"
    assert record.benchmark_name("seed_workloads.py s1 --max-splits 16") == "seed_workloads s1"
    assert record.benchmark_name("gemm_waves.py --tiles (cold weights, CUDA graph)") == "probes/gemm_waves"
    assert record.benchmark_name("moe_rollout.py 30B-A3B") == "moe_rollout"


def test_add_appends_a_device_runs_rows_and_a_typed_row_then_regenerates(tmp_path, monkeypatch, capsys):
    """`python scripts/gen_benchmarks.py add ROWS.jsonl` and `add --device ... --title ... --polyrl ...`: the one
    command that records new measurements."""
    gen = _load("gen_benchmarks_add", ROOT / "scripts" / "gen_benchmarks.py")
    record = sys.modules["_record"]
    history, summary = tmp_path / "history.jsonl", tmp_path / "BENCHMARKS.md"
    history.write_text("")
    for mod in (gen, record):
        monkeypatch.setattr(mod, "HISTORY", history)
    monkeypatch.setattr(gen, "SUMMARY", summary)
    monkeypatch.setattr(gen, "ROOT", tmp_path)
    monkeypatch.setattr(record, "_regenerate", gen.write)
    rows = tmp_path / "rows.jsonl"  # what a script's --rows-out wrote on the device machine
    record.append_row("NVIDIA H200", "grpo_step perf/throughput tok/s/GPU", "1.5B", "34,000", path=rows)
    assert not summary.exists()  # a --rows-out file is not the history: nothing regenerated yet
    assert gen.main(["add", str(rows)]) == 0
    assert gen.main(["add", "--device", "2x NVIDIA H100 80GB HBM3", "--title", "moe_rollout.py 30B-A3B",
                     "--shape", "Qwen3-30B-A3B shape", "--polyrl", "12,345 tok/s", "--peer", "vLLM: 10,000"]) == 0
    added = [json.loads(line) for line in history.read_text().splitlines()]
    assert [r["benchmark"] for r in added] == ["grpo_step", "moe_rollout"]
    text = summary.read_text()
    assert "| moe_rollout | 2x H100 |" in text and "12,345 tok/s" in text and "34,000" in text
    assert gen.check() == 0


def test_trace_top_counts_overlapping_kernels_once_and_sorts_families(tmp_path):
    """benchmarks/probes/trace_top.py: GPU busy time is the union of kernel intervals, not their sum."""
    spec = importlib.util.spec_from_file_location("trace_top", ROOT / "benchmarks" / "probes" / "trace_top.py")
    top = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(top)
    k = lambda name, ts, dur: {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}  # noqa: E731
    events = [k("sm90_xmma_gemm_bf16", 0, 10), k("ncclDevKernel_AllGather", 5, 10), k("grouped_mm_kernel", 40, 20),
              {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 100}]
    s = top.summarize(events)
    assert s["kind"] == "gpu kernels" and s["wall_us"] == 100 and s["busy_us"] == 35
    assert s["families"] == {"grouped gemm": 20, "gemm": 10, "nccl": 10}
    (tmp_path / "t.json").write_text(json.dumps({"traceEvents": events}))
    assert "GPU busy 0.000 s (35% of wall)" in top.report(str(tmp_path / "t.json"), 3)
