#!/usr/bin/env bash
# Device calls on one 4x H200 host, independent jobs on disjoint GPUs at once (each job owns its GPUs through
# CUDA_VISIBLE_DEVICES; they share only the host's CPUs). Usage: bash benchmarks/probes/x4_session.sh PHASE
#   1: GRPO step 1.5B on 1 GPU with TRL in the same process (issues 5, 8) | 2 GPUs (8) | FlowGRPO variants (6)
#   2: GRPO step 1.5B on 4 GPUs, 7B on 2 GPUs | Ray GPU tests (its wheel arrives in two calls: .ray1 in phase 1,
#      .ray2 here; the machine must stay warm between them) | FlowGRPO data parallel on 2 GPUs (8)
#   3: GRPO step 7B on 4 GPUs (8)
#   4: FlowGRPO variants combining the phase-1 winners, one per GPU (6)
#   (Phases 1-4 as run in session 3, except that `--compile` then compiled the update only and the rollout needed
#   `--compile-rollout static`; `--compile` now compiles both, so the "update-only" rows are not reproduced.)
#   5: not yet run: FSDP2 CPU offload test, flow FSDP2 with the fast recipe, 4-GPU step with the cheaper
#      balance_batch (8)
#   6: phase 5's jobs one after another on a 2x H200 host (the 4-GPU step left out)
# Every job writes its log and rows under $OUT (then: python scripts/gen_benchmarks.py add rows.jsonl).
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl .whl/flow/*.whl
fi
export PYTHONPATH=/tmp/site:.
FAST="actor_rollout_ref.model.enable_gradient_checkpointing=False actor_rollout_ref.actor.use_torch_compile=True"
MED="actor_rollout_ref.model.enable_gradient_checkpointing=True actor_rollout_ref.actor.use_torch_compile=True"
launcher() {  # launcher <gpus> <port base>: plain python for one GPU (no process group), else torchrun
  local n; n=$(echo "$1" | tr ',' '\n' | wc -l)
  if [ "$n" = 1 ]; then echo python3; else
    echo "torchrun --standalone --master-port=$(($2 + ${1:0:1})) --nproc_per_node=$n"; fi
}
grpo() {  # grpo <gpus> <name> <args...>
  local gpus=$1 name=$2; shift 2
  CUDA_VISIBLE_DEVICES=$gpus timeout 540 $(launcher "$gpus" 29500) benchmarks/grpo_step.py --work "/tmp/gs_$name" --rows-out "$OUT/rows.jsonl" \
    --json-out "$OUT/grpo_$name.json" "$@" > "$OUT/grpo_$name.log" 2>&1 || echo "FAILED grpo $name" >> "$OUT/status"
  grep -E '^\[|Error|error' "$OUT/grpo_$name.log" | tail -5
}
flow() {  # flow <gpus> <name> <args...>
  local gpus=$1 name=$2; shift 2
  CUDA_VISIBLE_DEVICES=$gpus timeout 540 $(launcher "$gpus" 29600) benchmarks/flow_grpo.py --prompts 1 --record --rows-out "$OUT/rows.jsonl" "$@" \
    > "$OUT/flow_$name.log" 2>&1 || echo "FAILED flow $name" >> "$OUT/status"
  echo "== flow $name: $(grep -E '"img_per_gpu_s"|"timing_s/gen"|"timing_s/update_actor"|max_memory|ratio_mean|Error' \
    "$OUT/flow_$name.log" | tr -d '\n ')"
}
ray_tests() {  # ray_tests <gpus>: the wheel's second half arrives in .ray2; the first was stashed by phase 1
  cat /tmp/raypart/part_* .ray2/part_* > /tmp/ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
    /tmp/ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl .ray2/*.whl > "$OUT/ray_install.log" 2>&1
  python3 -c "import ray; print('ray', ray.__version__)" 2>&1 | tail -1
  CUDA_VISIBLE_DEVICES=$1 timeout 300 python3 -m pytest -q -x tests/test_ray_gpu.py -p no:cacheprovider \
    > "$OUT/ray_gpu.log" 2>&1
  tail -3 "$OUT/ray_gpu.log"
}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1
case "${1:-}" in
1)
  mkdir -p /tmp/raypart && cp .ray1/* /tmp/raypart/ && echo "ray part 1 stashed"
  grpo 0 1gpu --lengths 1024,256 --steps 3 --max-token-len 32768 --extra $FAST &
  (grpo 1,2 2gpu --lengths 1024 --steps 3 --skip-trl --max-token-len 32768 --extra $FAST
   flow 1 static_rollout --compile --note "rollout compiled too (static shapes)") &
  (flow 3 nockpt_m4 --compile --no-ckpt --micro 4 --rollout-micro 16 --note "no ckpt, micro 4, rollout micro 16"
   flow 3 baseline_mask --compile --note "unmasked attention when prompts have one length") &
  wait ;;
2)
  grpo 0,1,2,3 4gpu --lengths 1024 --steps 3 --skip-trl --max-token-len 32768 --extra $FAST
  grpo 0,1 7b_2gpu --shape 7b --lengths 1024 --steps 2 --skip-trl --max-token-len 16384 --extra $MED &
  (ray_tests 2,3; flow 2,3 dp2 --compile --note "FSDP2 data parallel, fp32 LoRA masters on the bf16 base") &
  wait ;;
3)
  grpo 0,1,2,3 7b_4gpu --shape 7b --lengths 1024 --steps 2 --skip-trl --max-token-len 16384 --extra $MED
  ;;
4)
  flow 0 combo_r16 --compile --no-ckpt --micro 4 --rollout-micro 16 \
    --note "rollout compiled (static), no ckpt, micro 4, rollout micro 16" &
  flow 1 combo_r8 --compile --no-ckpt --micro 4 --rollout-micro 8 \
    --note "rollout compiled (static), no ckpt, micro 4, rollout micro 8" &
  flow 2 combo_r4 --compile --no-ckpt --micro 4 \
    --note "rollout compiled (static), no ckpt, micro 4" &
  flow 3 static_m16 --compile --micro 16 --note "rollout compiled (static), micro 16" &
  wait ;;
5)  # not yet run: what session 3 left unverified on GPUs
  CUDA_VISIBLE_DEVICES=0,1 timeout 400 python3 -m pytest -q tests/test_offload_gpu.py -p no:cacheprovider \
    > "$OUT/offload_gpu.log" 2>&1 &
  flow 2,3 dp2_fast --compile --no-ckpt --micro 4 --rollout-micro 16 \
    --note "FSDP2 data parallel, compiled rollout + update, no ckpt" &
  wait
  tail -3 "$OUT/offload_gpu.log"
  grpo 0,1,2,3 4gpu_balanced --lengths 1024 --steps 3 --skip-trl --max-token-len 32768 --extra $FAST ;;
6)  # phase 5 on a 2x H200 host (no 4x host was lent in session 4): offload test, 2-GPU step, flow FSDP2 fast recipe
  CUDA_VISIBLE_DEVICES=0,1 timeout 300 python3 -m pytest -q tests/test_offload_gpu.py -p no:cacheprovider \
    > "$OUT/offload_gpu.log" 2>&1
  tail -3 "$OUT/offload_gpu.log"
  grpo 0,1 2gpu_balanced --lengths 1024 --steps 3 --skip-trl --max-token-len 32768 --extra $FAST
  flow 0,1 dp2_fast --compile --no-ckpt --micro 4 --rollout-micro 16 \
    --note "FSDP2 data parallel, compiled rollout + update, no ckpt" ;;
*) echo "usage: $0 1|2|3|4|5|6"; exit 2 ;;
esac
cat "$OUT/status" 2>/dev/null
true
