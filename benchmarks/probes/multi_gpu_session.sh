#!/usr/bin/env bash
# One device call on a 4-GPU host: update_actor scaling 1 -> 2 -> 4 processes (benchmarks/multi_gpu.py), JSON lines
# appended to $OUT/multi_gpu.jsonl. Same host for every process count, so the efficiencies compare like with like.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
run() {  # run <nproc> <args...>
  local n=$1; shift
  timeout 240 torchrun --standalone --nproc_per_node="$n" benchmarks/multi_gpu.py --shape 1.5b --seqs-per-gpu 16 \
    --steps 3 --out "$OUT/multi_gpu.jsonl" "$@" 2>&1 | grep -E '^\{' || echo "FAILED: $n $*"
}
for n in 1 2 4; do run "$n" --micro 4; done                       # the previous session's setting, now balanced
run 4 --micro 4 --no-balance                                      # what balancing buys
for n in 1 4; do run "$n" --micro 16 --compile --no-ckpt; done    # the fast single-GPU setting
