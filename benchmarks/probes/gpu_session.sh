#!/usr/bin/env bash
# One device call for the lead's GPU checks: quickstart scaled up, GRPO step (compiled, no grad ckpt), profiler.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=. HF_HUB_OFFLINE=1 POLYRL_CACHE=/tmp/pcache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
echo "== quickstart --scale gpu"
python3 -m polyrl quickstart --scale gpu --run-dir /tmp/qs_gpu 2>&1 | tr '\r' '\n' | grep -v "Loading\|Writing" | tail -4 | tee "$OUT/quickstart_gpu.txt"
cp /tmp/qs_gpu/metrics.jsonl "$OUT/quickstart_gpu_metrics.jsonl" 2>/dev/null
cp /tmp/qs_gpu/report.html "$OUT/quickstart_gpu_report.html" 2>/dev/null
echo "== grpo_step 256, compiled layers, no grad ckpt"
timeout 300 python3 benchmarks/grpo_step.py --lengths 256 --skip-trl --steps 3 --rows-out "$OUT/rows.jsonl" \
  --json-out "$OUT/grpo_compiled.json" --extra actor_rollout_ref.model.enable_gradient_checkpointing=False \
  actor_rollout_ref.actor.use_torch_compile=True 2>&1 | grep -v Warn | tail -6 | tee "$OUT/grpo_compiled.txt"
echo "== profiler: torch trace (discrete) + torch_memory of step 2 through PPOTrainer"
for tool in torch torch_memory; do
  timeout 150 python3 benchmarks/grpo_step.py --lengths 256 --skip-trl --steps 2 --work /tmp/gprof_$tool \
    --extra global_profiler.tool=$tool "global_profiler.steps=[2]" global_profiler.save_path=/tmp/prof_$tool \
    actor_rollout_ref.actor.profiler.enable=True actor_rollout_ref.actor.profiler.tool_config.torch.discrete=True \
    2>&1 | grep -v Warn | tail -2
  ls -la /tmp/prof_$tool | tee -a "$OUT/profile_files.txt"
done
python3 - <<'PY' | tee "$OUT/profile_check.txt"
import glob, json, os, pickle
for f in sorted(glob.glob("/tmp/prof_torch/*.json")):
    names = {e.get("name") for e in json.load(open(f)).get("traceEvents", [])}
    stages = sorted(n for n in names if n in {"gen", "reward", "old_log_prob", "ref", "adv", "update_actor", "update_weights", "step"})
    print(os.path.basename(f), f"{os.path.getsize(f)/2**20:.0f} MiB", "stages:", stages)
for f in sorted(glob.glob("/tmp/prof_torch_memory/*.pickle")):
    snap = pickle.load(open(f, "rb"))
    frames = json.dumps(snap, default=str)
    print(os.path.basename(f), f"{os.path.getsize(f)/2**20:.0f} MiB", "segments:", len(snap.get("segments", [])),
          "stage names present:", [s for s in ("gen", "update_actor") if s in frames])
PY
