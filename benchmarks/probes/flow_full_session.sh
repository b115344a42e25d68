#!/usr/bin/env bash
# Issue 24 on a 4x H200 host (`nvidia-h200-x4`, needs_h200: fp32 weights, gradients and AdamW state of the 20.4B DiT
# are 82 GB per GPU over 4). Carry `.whl_flow` (diffusers, rapidocr; docs/engineering/NOTES_flow.md). Two device calls on
# one warm machine (the checkpoint lives on it between them):
#   bash benchmarks/probes/flow_full_session.sh run               # the 4-GPU full-FT run: warm-up, timed steps, checkpoint,
#                                                          # one more step
#   bash benchmarks/probes/flow_full_session.sh resume_and_check  # a new job resumes the checkpoint and runs that step again;
#                                                          # then the GPU tests (2 GPUs: fp32 state + bf16 compute; 1
#                                                          # GPU: the compiled FP8 sampling test; GPU_TESTS=0 skips them)
# Or both parts in one call (2026-11-26: ~325 s with STEPS=1 GPU_TESTS=0; the warm-up step takes ~40 s, the save ~56 s,
# the resumed job's load ~55 s). Eager blocks unless COMPILE=--compile: the compiled run had not finished its warm-up
# after 575 s. Rows go to $OUT/rows.jsonl, logs beside them; the resume verdict to $OUT/resumed.json. POLYRL_COMMIT names
# the commit.
source "$(dirname "$0")/flow_env.sh"  # wheels, environment, GPUs, run()
# the checkpoint (fp32 weights + both AdamW moments: 245 GB) goes to host memory (the x4 disk holds 235 GB)
# cuBLAS repeats its results bit for bit only with a fixed workspace, read when it starts: both jobs of the resume
# check set it (the compared steps also switch to deterministic attention: flow_resume_check.deterministic_kernels)
export CUBLAS_WORKSPACE_CONFIG=:4096:8
CK=/dev/shm/flow_full_ck
[ "$(df --output=avail -B1G /dev/shm | tail -1)" -ge 260 ] || CK=/tmp/flow_full_ck
df -h /dev/shm /tmp | tee -a "$OUT/disk.txt"
# micro 16 with gradient checkpointing, rollout chunks of 32: FSDP2 gathers the weights (and reduce-scatters fp32
# gradients) once per forward/backward, so fewer, larger passes move fewer bytes; the 2026-11-26 run with micro 2, no
# checkpointing and rollout 16 spent 80 s of a 109 s step in the update (32 passes; NOTES_flow.md)
ARGS="--full --no-cfg --prompts 2 --micro ${MICRO:-16} --rollout-micro ${ROLLOUT_MICRO:-32} ${COMPILE:-} --async-reward \
  --reward-workers ${REWARD_WORKERS:-8} --brightness-term 0.01 --steps ${STEPS:-2}"
case "${1:?part}" in
  speed)  # the timed run alone, no checkpoint; the interconnect first
    nvidia-smi topo -m | head -6 | tee "$OUT/topo.txt"
    timeout 60 torchrun --standalone --nproc_per_node=4 benchmarks/probes/nccl_bw.py 2>&1 | grep GPUs | tee "$OUT/nccl_bw.txt"
    TAIL=40 run full4_speed timeout 560 torchrun --standalone --nproc_per_node=4 benchmarks/flow_grpo.py $ARGS \
      --record --rows-out "$OUT/rows.jsonl" --note "issue 24: fp32 sharded state, bf16 compute" ;;
  run)
    rm -rf "$CK"; mkdir -p "$CK"
    # no prefault of the host memory: a background 240 GiB prefault (2026-11-26) was still running when the save began
    # 105 s into the run, and the two together ran the 512 GiB host out of memory
    date +"run starts %T" >> "$OUT/disk.txt"
    TAIL=40 run full4 timeout 575 torchrun --standalone --nproc_per_node=4 benchmarks/flow_grpo.py $ARGS \
      --save-check "$CK" --record --rows-out "$OUT/rows.jsonl" \
      --note "issue 24: fp32 sharded state, bf16 compute; checkpoint to $CK after the timed steps"
    date +"run ends %T" >> "$OUT/disk.txt"
    cp "$CK/uninterrupted.json" "$OUT/" 2>/dev/null; du -sh "$CK" | tee -a "$OUT/disk.txt"; free -g | head -2 ;;
  resume_and_check)
    TAIL=12 run resume4 timeout 400 torchrun --standalone --nproc_per_node=4 benchmarks/flow_grpo.py $ARGS \
      --resume-check "$CK"
    cp "$CK/resumed.json" "$OUT/" 2>/dev/null
    rm -rf "$CK"
    [ "${GPU_TESTS:-1}" = 1 ] || exit 0
    TAIL=6 run gpu_test_fsdp env CUDA_VISIBLE_DEVICES=0,1 timeout 150 python3 -m pytest -q -p no:cacheprovider \
      tests/test_flow_fsdp_gpu.py &
    TAIL=6 run gpu_test_flow env CUDA_VISIBLE_DEVICES=2 timeout 150 python3 -m pytest -q -p no:cacheprovider \
      tests/test_flow_gpu.py &
    wait ;;
  *) echo "unknown part $1"; exit 2 ;;
esac
