#!/usr/bin/env bash
# Whole GRPO step with a Qwen2.5-7B-shaped reward model (random weights), on a 2-GPU host:
#   colocated: policy (Qwen2.5-1.5B shape) and RM on GPU 0; the RM sleeps in host memory while the actor trains;
#   own GPU:   the policy on GPU 0, the RM in a Ray actor on GPU 1 (reward_model.enable_resource_pool=True).
# Prints the mean timing_s/{step,gen,reward,reward_model,update_actor} of steps 2..N of each run (step 1 warms up).
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/out}; M=${M:-/tmp/rm_step_models}; STEPS=${STEPS:-4}; mkdir -p "$OUT"
[ -d "$M/rm" ] || python benchmarks/reward_model.py --save-models "$M" --policy-shape "${POLICY_SHAPE:-1.5b}"
common=(data.train_files="$M/data/train.parquet" data.train_batch_size=32 data.max_prompt_length=64
  data.max_response_length=512 actor_rollout_ref.model.path="$M/policy" actor_rollout_ref.rollout.n=8
  actor_rollout_ref.actor.ppo_mini_batch_size=32 actor_rollout_ref.rollout.ignore_eos=True
  trainer.total_training_steps="$STEPS" trainer.logger=[file] trainer.save_freq=-1 trainer.resume_mode=disable
  trainer.progress_bar=False reward_model.enable=True reward_model.model.path="$M/rm")
summary() {  # summary <name> <run dir>
  python - "$1" "$2/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[2]) if "timing_s/step" in l][1:]
keys = ["timing_s/step", "timing_s/gen", "timing_s/reward", "timing_s/reward_model", "timing_s/update_actor"]
print(sys.argv[1], {k.split("/")[1]: round(sum(r.get(k, 0) for r in rows) / max(1, len(rows)), 3) for k in keys},
      f"({len(rows)} steps)")
PY
}
CUDA_VISIBLE_DEVICES=0 timeout 900 python -m polyrl train "${common[@]}" trainer.run_dir="$OUT/colocated" \
  trainer.default_local_dir="$OUT/colocated/ck" > "$OUT/colocated.log" 2>&1 || tail -5 "$OUT/colocated.log"
summary colocated "$OUT/colocated"
CUDA_VISIBLE_DEVICES=1 ray start --head --num-gpus=1 --disable-usage-stats > "$OUT/ray.log" 2>&1
CUDA_VISIBLE_DEVICES=0 RAY_ADDRESS=auto timeout 900 python -m polyrl train "${common[@]}" \
  reward_model.enable_resource_pool=True reward_model.n_gpus_per_node=1 trainer.run_dir="$OUT/own_gpu" \
  trainer.default_local_dir="$OUT/own_gpu/ck" > "$OUT/own_gpu.log" 2>&1 || tail -5 "$OUT/own_gpu.log"
summary own_gpu "$OUT/own_gpu"
ray stop > /dev/null 2>&1
