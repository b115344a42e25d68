#!/usr/bin/env bash
# Issue 18 on the GPU machine: one part per device call (each under ~8 min). Run from the repository root:
#   bash benchmarks/probes/oom_session.sh sweep_short   # H100: resp 256,1024 x user budgets 8k..64k (12 runs)
#   bash benchmarks/probes/oom_session.sh sweep_4096    # H100: resp 4096 x the same budgets (6 runs, 8 prompts x 8)
#   bash benchmarks/probes/oom_session.sh readme49152   # H100: the README recipe that crashed (budget 49152, no ckpt)
#   bash benchmarks/probes/oom_session.sh defaults      # H100 or H200: grpo_step with only model/data/batch/length keys
#   bash benchmarks/probes/oom_session.sh tuned         # the same device: the best hand-tuned settings, same call shape
#   bash benchmarks/probes/oom_session.sh defaults_7b   # 2x H200: the 7B shape, defaults, torchrun
#   bash benchmarks/probes/oom_session.sh tuned_7b      # 2x H200: the same shape, the best hand-tuned 7B row's settings
#   bash benchmarks/probes/oom_session.sh flow          # H100: Qwen-Image 20B LoRA CFG 512^2, auto memory, latent reward (needs diffusers)
# Rows go to $OUT/rows.jsonl (then: python scripts/gen_benchmarks.py add rows.jsonl), JSON and logs beside them.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.:${PYTHONPATH:-} HF_HUB_OFFLINE=1 POLYRL_CACHE=/tmp/pcache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$OUT/gpu.txt"
# run NAME CMD...: full log in $OUT/NAME.log; prints the auto choices, OOM warnings/stops and the log's tail
run() {
  local name=$1; shift
  "$@" 2>&1 | grep -v "Warn\|warn(\|Loading\|Writing" > "$OUT/$name.log"
  grep -h "polyrl: auto\|polyrl: warning\|polyrl: error\|stopped:\|Traceback\|OutOfMemoryError" "$OUT/$name.log" \
    | sort | uniq -c
  tail -16 "$OUT/$name.log"
}
FAST="actor_rollout_ref.model.enable_gradient_checkpointing=False actor_rollout_ref.actor.use_torch_compile=True"
case "${1:?part}" in
  sweep_short)
    run sweep_short timeout 560 python3 benchmarks/oom_sweep.py --lengths 256,1024 --out "$OUT/sweep_short" ;;
  sweep_4096)
    run sweep_4096 timeout 560 python3 benchmarks/oom_sweep.py --lengths 4096 --prompts 8 --out "$OUT/sweep_4096" ;;
  readme49152)  # before issue 18: native OOM -> "retrying with rollout.name=hf" -> raw torch.OutOfMemoryError
    run readme49152 timeout 560 python3 benchmarks/grpo_step.py --lengths 1024 --skip-trl --steps 2 \
      --max-token-len 49152 --json-out "$OUT/readme49152.json" --extra $FAST ;;
  defaults)
    run defaults timeout 560 python3 benchmarks/grpo_step.py --lengths 256,1024 --skip-trl --steps 3 --defaults \
      --rows-out "$OUT/rows.jsonl" --json-out "$OUT/defaults.json" ;;
  tuned)  # the hand-tuned H100 recipe of the issue (use --max-token-len 32768 on an H200: its best rows)
    run tuned timeout 560 python3 benchmarks/grpo_step.py --lengths 256,1024 --skip-trl --steps 3 \
      --max-token-len "${TUNED_BUDGET:-24576}" --rows-out "$OUT/rows.jsonl" --json-out "$OUT/tuned.json" --extra $FAST ;;
  defaults_7b)
    run defaults_7b timeout 580 torchrun --standalone --nproc_per_node=2 benchmarks/grpo_step.py --shape 7b \
      --skip-trl --lengths 1024 --prompts 32 --steps 3 --defaults --rows-out "$OUT/rows.jsonl" \
      --json-out "$OUT/defaults_7b.json" ;;
  tuned_7b)  # the 2026-11-21 7B row (7,124 tok/s/GPU): gradient checkpointing, compile, 16k token budget
    run tuned_7b timeout 580 torchrun --standalone --nproc_per_node=2 benchmarks/grpo_step.py --shape 7b \
      --skip-trl --lengths 1024 --prompts 32 --steps 3 --max-token-len 16384 --rows-out "$OUT/rows.jsonl" \
      --json-out "$OUT/tuned_7b.json" --extra actor_rollout_ref.model.enable_gradient_checkpointing=True \
      actor_rollout_ref.actor.use_torch_compile=True ;;
  flow)  # --latent-reward: the H200 reference (0.965 img/GPU/s, 106 GiB peak) is the DiT-only recipe, no TE/VAE/OCR
    run flow timeout 580 python3 benchmarks/flow_grpo.py --compile --micro 4 --rollout-micro 16 --auto-memory \
      --latent-reward --steps 2 --record --rows-out "$OUT/rows.jsonl" ;;
  *) echo "unknown part $1"; exit 2 ;;
esac
