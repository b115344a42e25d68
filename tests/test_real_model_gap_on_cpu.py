"""benchmarks/real_model_gap.py (issue 16's log-prob gap per rollout dtype) on a tiny local model, CPU: it runs to the
end, prints one table row per config, and the FP8 rows show a wider gap than the bf16 engine's. The real-model
numbers come from SmolLM2 (docs/engineering/NOTES_rollout.md, session 22); this keeps the script runnable."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_real_model_gap_prints_a_row_per_config(tiny_model_dir, tmp_path):
    argv = [sys.executable, str(ROOT / "benchmarks" / "real_model_gap.py"), "--model", str(tiny_model_dir),
            "--configs", "bf16,fp8kv_w8mlp,fp8kv_w8head", "--n", "2", "--new", "24", "--rows-out",
            str(tmp_path / "rows.jsonl")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    rows = {line.split(" | ")[0].strip("| "): line for line in done.stdout.splitlines()
            if line.startswith("| ") and not line.startswith("| config")}
    assert set(rows) == {"bf16", "fp8kv_w8mlp", "fp8kv_w8head"}, done.stdout
    diff = {c: float(r.split(" | ")[1]) for c, r in rows.items()}  # probs_diff_mean
    assert 0 <= diff["bf16"] < diff["fp8kv_w8head"], diff
    recorded = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert [r["benchmark"] for r in recorded] == ["real_model_gap"] * 3, recorded
