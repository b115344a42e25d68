#!/usr/bin/env bash
# Whole GRPO step with a Qwen2.5-7B-shaped reward model (random weights), Qwen2.5-1.5B-shaped policy:
#   colocated: policy and RM on GPU 0; the RM sleeps in host memory while the actor trains;
#   own GPU:   the policy on GPU 0, the RM on GPU 1 in a process of its own (reward_model.enable_resource_pool=True;
#              spawned on this host, no Ray needed);
# and, on a host with 3+ GPUs, the one-step off-policy pipeline (trainer GPU 0, rollout GPU 1):
#   offpolicy serial: the RM colocated on the rollout GPU, scored after each generation;
#   offpolicy behind: the RM on GPU 2, scoring batch k while the rollout generates batch k+1
#                     (timing_s/reward_overlap: seconds of scoring hidden behind that generation).
# ROWS_OUT=FILE records one history row a run (benchmarks/_record.py; default: none).
# RUNS="colocated own_gpu" picks runs (each is one `polyrl train` of STEPS steps; the device allows 600 s a call).
# Prints the mean timing_s/* of steps 2..N of each run (step 1 warms up and starts the RM), the device, and the
# bound each layout can reach: colocated step >= gen + reward + update; own GPU the same minus the RM's wake/sleep;
# behind, the reward leaves the rollout's critical path (reward_overlap -> reward).
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/out}; M=${M:-/tmp/rm_step_models}; STEPS=${STEPS:-4}; mkdir -p "$OUT"
NGPU=$(nvidia-smi -L | wc -l)
export DEVICE="${NGPU}x $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | sed "s/^/device: ${NGPU}x /"
[ -d "$M/rm" ] || python benchmarks/reward_model.py --save-models "$M" --policy-shape "${POLICY_SHAPE:-1.5b}"
common=(data.train_files="$M/data/train.parquet" data.train_batch_size=32 data.max_prompt_length=64
  data.max_response_length=512 actor_rollout_ref.model.path="$M/policy" actor_rollout_ref.rollout.n=8
  actor_rollout_ref.actor.ppo_mini_batch_size=32 actor_rollout_ref.rollout.ignore_eos=True
  trainer.total_training_steps="$STEPS" trainer.logger=[file] trainer.save_freq=-1 trainer.resume_mode=disable
  trainer.progress_bar=False reward_model.enable=True reward_model.model.path="$M/rm")
summary() {  # summary <name> <run dir>
  python - "$1" "$2/metrics.jsonl" <<'PY'
import json, os, sys
rows = [json.loads(l) for l in open(sys.argv[2]) if "timing_s/step" in l][1:]
keys = ["timing_s/step", "timing_s/gen", "timing_s/reward", "timing_s/reward_model", "timing_s/reward_fn",
        "timing_s/reward_overlap", "timing_s/exposed_generation", "timing_s/update_actor"]
mean = {k.split("/")[1]: round(sum(r.get(k, 0) for r in rows) / max(1, len(rows)), 3) for k in keys
        if any(k in r for r in rows)}
print(sys.argv[1], mean, f"({len(rows)} steps)")
if rows and os.environ.get("ROWS_OUT"):  # one history row a run (benchmarks/_record.py)
    sys.path.insert(0, "benchmarks")
    from _record import append_row
    bound = mean.get("gen", 0) + mean.get("reward", 0) + mean.get("update_actor", 0)
    append_row(os.environ["DEVICE"], f"reward_model_step.sh {sys.argv[1]} s/step",
               "GRPO whole step, Qwen2.5-1.5B-shape policy, Qwen2.5-7B-shape RM (random weights), 32 prompts x 8, "
               f"resp 512 (ignore_eos); {sys.argv[1]}; mean of steps 2..{len(rows) + 1}: "
               + ", ".join(f"{k} {v} s" for k, v in mean.items() if k != "step"),
               f"{mean['step']:.2f} s/step", limit=f"gen + reward + update = {bound:.2f} s",
               ratio_limit=f"{bound / mean['step']:.2f}" if mean.get("step") else "-", path=os.environ["ROWS_OUT"])
PY
}
RUNS=" ${RUNS:-colocated own_gpu offpolicy_serial offpolicy_behind} "  # a subset fits a shorter time limit
run() {  # run <name> <CUDA_VISIBLE_DEVICES> <keys...>
  local name=$1 gpus=$2; shift 2
  [[ "$RUNS" == *" $name "* ]] || return 0
  CUDA_VISIBLE_DEVICES=$gpus timeout 900 python -m polyrl train "${common[@]}" "$@" trainer.run_dir="$OUT/$name" \
    trainer.default_local_dir="$OUT/$name/ck" > "$OUT/$name.log" 2>&1 || tail -5 "$OUT/$name.log"
  summary "$name" "$OUT/$name"
}
run colocated 0
run own_gpu 0,1 reward_model.enable_resource_pool=True reward_model.n_gpus_per_node=1
if [ "$NGPU" -ge 3 ]; then
  off=(actor_rollout_ref.hybrid_engine=False actor_rollout_ref.rollout.gpu_memory_utilization=0.5)  # room to wake the RM
  run offpolicy_serial 0,1 "${off[@]}"
  run offpolicy_behind 0,1,2 "${off[@]}" reward_model.enable_resource_pool=True reward_model.n_gpus_per_node=1
else
  echo "offpolicy_serial/offpolicy_behind skipped: the pipeline with an RM of its own needs 3 GPUs ($NGPU here)"
fi
