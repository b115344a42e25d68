#!/usr/bin/env bash
# Issue 23 on the GPU machine, one part per device call (each under ~9 min). Carry `.whl_flow` (the wheels the GPU
# image lacks: diffusers, rapidocr and their small deps; docs/engineering/NOTES_flow.md says how to download them):
#   bash benchmarks/probes/flow_session.sh stage      # any 1 GPU: the FP8 rollout stage alone, compiled: bf16, FP8 with the
#                                              # inductor-fused or Triton quantiser, FP8 on the ODE steps only
#   bash benchmarks/probes/flow_session.sh bf16       # 1 H200: same work as VeRL-Omni, async OCR, bf16 sampling
#   bash benchmarks/probes/flow_session.sh fp8        # 1 H200: the same with FP8 on the ODE steps (the default FP8 mode)
#   bash benchmarks/probes/flow_session.sh pair       # 1 H200: bf16 then fp8 in one call (one machine for both)
#   bash benchmarks/probes/flow_session.sh chunks     # 1 H200: FP8 on the ODE steps, 4 OCR workers, the rollout in one chunk
#                                              # of 16 images, then in two of 8 (the first one's OCR hides behind the
#                                              # second one's sampling)
#   bash benchmarks/probes/flow_session.sh chunk8     # 1 H200: the second of those alone
#   bash benchmarks/probes/flow_session.sh workers    # 1 H200: chunk8 with 4 OCR workers, then 8, in one call
#   bash benchmarks/probes/flow_session.sh fp8_all    # 1 H200: the same with every step in FP8 (+ recompute, TIS)
#   bash benchmarks/probes/flow_session.sh reward_gpu # 2 H200s: sync vs async reward with a VLM-judge-sized model, on the
#                                              # actor GPU (sync) or a reward GPU of its own (async), bf16 sampling
# (The overlap and update_static modes, A/B runs of two switches removed in issue 51, are in git log.)
# Rows go to $OUT/rows.jsonl (then: python scripts/gen_benchmarks.py add rows.jsonl); logs beside them. POLYRL_COMMIT names the commit in rows.
source "$(dirname "$0")/flow_env.sh"  # wheels, environment, GPUs, run()
# REWARD_WORKERS: OCR worker processes (reward.num_workers; the async scorer splits a chunk across them); STEPS: timed
# steps after the warm-up (3); RUN_S: reward_gpu's limit per run (280 s)
FAST="--prompts 1 --compile --no-ckpt --micro 4 --rollout-micro 16 --steps ${STEPS:-3} --record --rows-out $OUT/rows.jsonl \
  --reward-workers ${REWARD_WORKERS:-1}"
case "${1:?part}" in
  stage)
    run stage timeout 560 python3 benchmarks/probes/flow_fp8_rollout.py --compile --batch 16 --repeats 2 --rows-out $OUT/rows.jsonl \
      --compiled-quantisers inductor,triton --trained-steps-bf16 ;;
  bf16)
    run same_work_bf16 timeout 560 python3 benchmarks/flow_grpo.py $FAST --async-reward \
      --note "same work, OCR in a CPU worker process (async)" ;;
  fp8)
    run same_work_fp8 timeout 560 python3 benchmarks/flow_grpo.py $FAST --async-reward --fp8 \
      --note "same work, async OCR, FP8 on the ODE steps (LoRA merged), copies released for the update" ;;
  pair)  # bf16 then FP8 in one call: the same machine for both
    run same_work_bf16 timeout 285 python3 benchmarks/flow_grpo.py $FAST --async-reward \
      --note "same work, OCR in a CPU worker process (async); same call as the FP8 row"
    run same_work_fp8 timeout 285 python3 benchmarks/flow_grpo.py $FAST --async-reward --fp8 \
      --note "same work, async OCR, FP8 on the ODE steps (LoRA merged), copies released for the update" ;;
  chunks)  # REWARD_WORKERS defaults to 4 here
    W4="--reward-workers ${REWARD_WORKERS:-4}"
    run fp8_chunk16 timeout 285 python3 benchmarks/flow_grpo.py $FAST $W4 --async-reward --fp8 \
      --note "same work, async OCR (4 workers), FP8 on the ODE steps (LoRA merged), one rollout chunk of 16"
    run fp8_chunk8 timeout 285 python3 benchmarks/flow_grpo.py $FAST $W4 --async-reward --fp8 --rollout-micro 8 \
      --note "same work, async OCR (4 workers), FP8 on the ODE steps (LoRA merged), two rollout chunks of 8" ;;
  chunk8)  # the faster of the two alone, with 8 OCR workers (the `workers` part); STEPS timed steps
    run fp8_chunk8 timeout 540 python3 benchmarks/flow_grpo.py $FAST --reward-workers ${REWARD_WORKERS:-8} \
      --async-reward --fp8 --rollout-micro 8 \
      --note "same work, async OCR (${REWARD_WORKERS:-8} workers), FP8 on the ODE steps (LoRA merged), two rollout \
chunks of 8" ;;
  encode5)  # chunk8 (8 workers), 5 timed steps, the fifth step's prompt encoding torch-profiled (it stalled 0.7-2.3 s
            # in most 5-step runs before 2026-11-26: cuDNN attention building a plan for a new text length)
    run encode5 timeout 300 python3 benchmarks/flow_grpo.py ${FAST/--steps ${STEPS:-3}/--steps 5} --reward-workers 8 \
      --async-reward --fp8 --rollout-micro 8 --profile-encode 5 --note "same work, async OCR (8 workers), FP8 on the \
ODE steps (LoRA merged), two rollout chunks of 8; the fifth step's encode profiled" ;;
  workers)  # chunk8 with 4 OCR workers (4 threads each), then 8 (2 threads each): the same machine for both
    for W in 4 8; do
      run fp8_chunk8_w$W timeout 285 python3 benchmarks/flow_grpo.py $FAST --reward-workers $W --async-reward --fp8 \
        --rollout-micro 8 --note "same work, async OCR ($W workers), FP8 on the ODE steps (LoRA merged), two rollout \
chunks of 8; same call as the $((12 - W))-worker row"
    done ;;
  fp8_all)
    run fp8_all timeout 560 python3 benchmarks/flow_grpo.py $FAST --async-reward --fp8 --fp8-trained-steps \
      --offload-text-encoder --note "same work, async OCR, every step FP8, text encoder offloaded" ;;
  reward_gpu)  # seed 000's second row: 1 actor GPU + 1 reward GPU against sync on the actor GPU (NOTES_flow.md)
    TAIL=3 run judge_async env CUDA_VISIBLE_DEVICES=0,1 timeout ${RUN_S:-280} python3 benchmarks/flow_grpo.py $FAST \
      --async-reward --judge-gpu cuda:1 --note "async judge on a reward GPU of its own"
    TAIL=3 run judge_sync env CUDA_VISIBLE_DEVICES=0 timeout ${RUN_S:-280} python3 benchmarks/flow_grpo.py $FAST \
      --judge-gpu cuda:0 --offload-text-encoder \
      --note "sync judge on the actor GPU (text encoder offloaded to pinned host memory: the judge's 15.5 GiB)" ;;
  *) echo "unknown part $1"; exit 2 ;;
esac
