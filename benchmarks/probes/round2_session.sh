#!/usr/bin/env bash
# GPU driver for the MoE / TP / reward-model round (issues 47, 48, 50): one part per device call, logs in one tarball
# (the device returns at most 8 files). Usage on a 4-GPU machine: bash benchmarks/probes/round2_session.sh PART
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 POLYRL_COMMIT=${POLYRL_COMMIT:-$(cat .commit 2>/dev/null || echo -)}
L=/tmp/logs; mkdir -p $L
run() { local name=$1 t=$2; shift 2; echo "== $name"; timeout $t "$@" > $L/$name.log 2>&1; echo "$name rc=$?"; }
case "$1" in
tests)  # 4 GPUs in parallel: TP on 0,1; MoE / RM tests on 2; engine / FP8 tests on 3; then MoE-vs-dense quickstarts
  (CUDA_VISIBLE_DEVICES=2 run moe_tests 240 python -m pytest -q -x tests/test_moe_engine_gpu.py tests/test_moe_gpu.py tests/test_reward_model_gpu.py
   CUDA_VISIBLE_DEVICES=2 run qs_moe 150 polyrl quickstart --scale gpu --arch qwen3_moe) &
  (CUDA_VISIBLE_DEVICES=3 run engine_tests 240 python -m pytest -q tests/test_fp8_rollout_gpu.py tests/test_native_rollout_gpu.py
   CUDA_VISIBLE_DEVICES=3 run qs_dense 150 polyrl quickstart --scale gpu) &
  CUDA_VISIBLE_DEVICES=0,1 run tp_tests 240 python -m pytest -q -x -s tests/test_tensor_parallel_gpu.py
  CUDA_VISIBLE_DEVICES=0,1 run tp_moe 140 torchrun --standalone --nproc_per_node=2 benchmarks/tp_decode.py \
      --shape qwen3-30b-a3b --layers 24 --tp 2 --batch 256 --prompt 512 --new 512 --rows-out $L/rows.jsonl
  wait ;;
step)  # the whole MoE GRPO step on 4 GPUs (24-layer cut: see moe_step.py), then the 7B reward-model scoring
  run moe_step 330 torchrun --standalone --nproc_per_node=4 benchmarks/moe_step.py --layers 24 --prompts 16 --n 16 \
      --mini-prompts 8 --steps 2 --warmup 1 --rows-out $L/rows.jsonl --json-out $L/moe_step.json
  CUDA_VISIBLE_DEVICES=0 run rm_bench 200 python benchmarks/reward_model.py --rows-out $L/rows.jsonl --json-out $L/rm.json ;;
esac
for f in $L/*.log; do echo "--- $f"; grep -v "Warning\|warn(" $f | tail -6; done
tar czf $OUT/logs.tgz -C /tmp logs
