#!/usr/bin/env bash
# Whole-GRPO-step scaling (issue 8) in one call on a 4-GPU host: the same per-GPU work on 1, 2 and 4 processes.
# Not yet run (the session that wrote it had no device time left); rows go to $OUT/rows.md.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
FAST="actor_rollout_ref.model.enable_gradient_checkpointing=False actor_rollout_ref.actor.use_torch_compile=True"
for n in 1 2 4; do
  timeout 280 torchrun --standalone --nproc_per_node="$n" benchmarks/grpo_step.py --lengths 1024 --prompts 32 \
    --samples-per-prompt 8 --steps 3 --skip-trl --max-token-len 32768 --work "/tmp/gs_$n" --rows-out "$OUT/rows.md" \
    --extra $FAST 2>&1 | grep -E '^\[' || echo "FAILED: $n processes"
done
