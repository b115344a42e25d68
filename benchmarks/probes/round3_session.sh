#!/usr/bin/env bash
# GPU driver for session 30 (issues 47, 48, 49): no 4-GPU kind was lent, so the MoE and TP steps run on 2 GPUs, one
# part per device call, logs in one tarball (the device returns at most 8 files).
#   bash benchmarks/probes/round3_session.sh moe2   # 2 GPUs: MoE host-load smoke (4 layers), then the 12-layer step
#   bash benchmarks/probes/round3_session.sh tp2    # 2 GPUs: Qwen3-32B 16-layer cut, LoRA GRPO, TP 2 vs TP 1 + FP8
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 POLYRL_COMMIT=${POLYRL_COMMIT:-$(cat .commit 2>/dev/null || echo -)}
L=/tmp/logs; mkdir -p $L
run() { local name=$1 t=$2; shift 2; echo "== $name $(date +%T)"; timeout $t "$@" > $L/$name.log 2>&1; echo "$name rc=$? $(date +%T)"; }
nvidia-smi --query-gpu=name,memory.total --format=csv > $L/gpus.txt; free -g >> $L/gpus.txt
case "$1" in
moe2)
  run moe_smoke 170 torchrun --standalone --nproc_per_node=2 benchmarks/moe_step.py --layers 4 --prompts 8 \
      --samples-per-prompt 8 --mini-prompts 4 --mean-len 512 --max-len 1024 --steps 1 --warmup 0 --work /tmp/ms_smoke
  run moe_step12 400 torchrun --standalone --nproc_per_node=2 benchmarks/moe_step.py --layers 12 --prompts 16 \
      --samples-per-prompt 16 --mini-prompts 4 --steps 2 --warmup 1 --rows-out $L/rows.jsonl --json-out $L/moe12.json ;;
tp2)
  for cfg in "tp2:actor_rollout_ref.rollout.tensor_model_parallel_size=2" \
             "tp1fp8:actor_rollout_ref.rollout.tensor_model_parallel_size=1 actor_rollout_ref.rollout.quantization=fp8"; do
    name=${cfg%%:*}; keys=${cfg#*:}
    run tp_$name 270 torchrun --standalone --nproc_per_node=2 benchmarks/grpo_step.py --skip-trl --shape qwen3-32b \
        --layers 16 --lengths 3200 --prompts 16 --samples-per-prompt 8 --steps 2 --work /tmp/tp_$name \
        --rows-out $L/rows.jsonl --json-out $L/tp_$name.json --extra actor_rollout_ref.model.lora_rank=64 $keys
  done ;;
esac
for f in $L/*.log; do echo "--- $f"; grep -v "Warning\|warn(" $f | tail -8; done
tar czf $OUT/logs.tgz -C /tmp logs
