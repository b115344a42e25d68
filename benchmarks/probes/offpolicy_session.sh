#!/usr/bin/env bash
# Issue 17 in one device call on a 2-GPU host (nvidia-h200-x2 is the issue's machine; nvidia-h100-x2 serves):
#   1. offpolicy_step.py at the issue's shape: Qwen2.5-1.5B, 64x8, lognormal lengths mean 1000 max 4096, 6 steps
#      (2 left out): colocated, off-policy (the default: pi_old from the engine, no pass), off-policy with decoupled
#      rollout correction (TIS; the behaviour log-probs recomputed on the rollout GPU)
#   2. the learning check: `polyrl quickstart --scale gpu` on-policy (1 GPU) vs off-policy (2 processes), held-out
#      accuracy per validation (the issue: within 3 points, at no more than 1.1x as many steps)
#   3. (PHASE=7b) the Qwen2.5-7B shape, colocated vs off-policy. The off-policy trainer is one GPU, which must hold
#      7B's fp32 master weights + Adam (~122 GB): no chance on an 80 GB card, a try on a 141 GB one (it did not
#      fit with activations in the 2026-11-21 update runs); a trainer pool of several GPUs is not built yet
# Rows go to $OUT/rows.jsonl (then: python scripts/gen_benchmarks.py add rows.jsonl), logs to $OUT/*.log.
#   4. (PHASE=prefetch) issue 19's fsdp_config.forward_prefetch A/B: multi_gpu.py 1.5b over 2 GPUs, off then on
#   usage: bash benchmarks/probes/offpolicy_session.sh PHASE [PHASE ...]   PHASE: 1.5b (= colocated offpolicy), colocated,
#   offpolicy, fp8 (both, FP8 rollout), partial (= partial2k partial1k), partial2k, partial1k, recompute, learn,
#   prefetch, 7b, all
#   (a 2-GPU machine counts its whole held time: keep a call under 10 min; each benchmark run is capped at 5 min,
#   each quickstart at 7)
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false POLYRL_CACHE=/tmp/pcache  # both quickstarts share one SFT start
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PHASES=" ${*:-all} "
has() {  # has <phase> <group...>: the phase, one of its groups, or all was asked for
  local p; for p in "$@" all; do [[ "$PHASES" == *" $p "* ]] && return 0; done; return 1
}
step() {  # step <name> <shape> <mode> <args...>
  local name=$1 shape=$2 mode=$3; shift 3
  timeout 300 torchrun --standalone --nproc_per_node=2 benchmarks/offpolicy_step.py --mode "$mode" --shape "$shape" \
    --rows-out "$OUT/rows.jsonl" --json-out "$OUT/$name.json" "$@" >"$OUT/$name.log" 2>&1
  echo "$name rc=$?"; grep -E '^step |^SUMMARY' "$OUT/$name.log" | tail -7
}
has colocated 1.5b && step colocated 1.5b colocated
has offpolicy 1.5b && step offpolicy 1.5b offpolicy
# the FP8-rollout recipe on both sides (KV cache + weights): 1.43x on 2 H200s, 2026-11-26, against 1.30x in bf16
FP8=(actor_rollout_ref.rollout.kv_cache_dtype=fp8 actor_rollout_ref.rollout.quantization=fp8)
has fp8 && step colocated_fp8 1.5b colocated --extra "${FP8[@]}"
has fp8 && step offpolicy_fp8 1.5b offpolicy --extra "${FP8[@]}"
# rows past 2048 (1024) new tokens continue in the next call
has partial2k partial && step offpolicy_partial 1.5b offpolicy --extra async_training.partial_rollout=True
has partial1k partial && step offpolicy_partial1k 1.5b offpolicy --extra async_training.partial_rollout=True \
  async_training.partial_rollout_max_new_tokens=1024
if has prefetch; then
  for flag in "" --forward-prefetch; do
    timeout 240 torchrun --standalone --nproc_per_node=2 benchmarks/multi_gpu.py --shape 1.5b --micro 4 $flag \
      --out "$OUT/prefetch.jsonl" >"$OUT/prefetch${flag:+_on}.log" 2>&1
    echo "multi_gpu ${flag:-no prefetch} rc=$?"; tail -4 "$OUT/prefetch${flag:+_on}.log"
  done
fi
if has recompute; then
  step offpolicy_recompute 1.5b offpolicy --extra algorithm.rollout_correction.rollout_is=token
fi
if has learn; then
  for mode in onpolicy offpolicy; do
    extra=(); [ "$mode" = offpolicy ] && extra=(actor_rollout_ref.hybrid_engine=False)
    CUDA_VISIBLE_DEVICES=$([ "$mode" = onpolicy ] && echo 0 || echo 0,1) timeout 420 \
      python -m polyrl quickstart --scale gpu --run-dir "$OUT/qs_$mode" "${extra[@]}" >"$OUT/qs_$mode.log" 2>&1
    echo "quickstart $mode rc=$?"; tail -3 "$OUT/qs_$mode.log"
    python - "$OUT/qs_$mode/metrics.jsonl" <<'EOF'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    acc = [v for k, v in r.items() if k.startswith("val-core/") and k.endswith("/mean@1")]
    if acc:
        print(f"  step {r.get('step')}: held-out {100 * acc[0]:.1f}%")
EOF
  done
fi
if has 7b; then
  step colocated_7b 7b colocated --prompts 32
  step offpolicy_7b 7b offpolicy --prompts 32
fi
