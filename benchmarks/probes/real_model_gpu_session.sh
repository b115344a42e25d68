#!/usr/bin/env bash
# The lead's GPU checks for the real model (issue 21): SmolLM2-135M-Instruct, the recipe's curve and wall time, and
# polyrl vs TRL 1.16 side by side. The device machine has no gguf/trl/datasets and its carry limit (64 MiB) is below
# the GGUF file (98 MB), so the file travels in two halves over two calls (the machine keeps /tmp while warm):
#
#   here:  split -n 2 -d "$(python -c 'from polyrl.models.gguf import smollm2_gguf; print(smollm2_gguf())')" \
#              .gl/smollm2.gguf.part-
#          pip download --no-deps -d .whl gguf==0.19.0 trl==1.16.0 datasets==5.2.0 dill==0.4.1 \
#              multiprocess==0.70.19 xxhash      # (the device's Python version for xxhash's binary wheel)
#   run 1: bash benchmarks/probes/real_model_gpu_session.sh stage    carry [".gl/smollm2.gguf.part-00"]
#   run 2: bash benchmarks/probes/real_model_gpu_session.sh recipe   carry [".gl/smollm2.gguf.part-01", ".whl"]
#   run 3: bash benchmarks/probes/real_model_gpu_session.sh trl      (30 steps each side; STEPS=20 if it nears 10 min)
#   or:    bash benchmarks/probes/real_model_gpu_session.sh gap      (real_model_gap.py on the CUDA kernels, issue 16)
# Results land in $OUT (recipe.txt, real_model_trl.txt, benchmarks_rows.diff: the rows to append here).
set -uo pipefail
MODE=${1:-recipe}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STAGE=/tmp/smollm2_stage; mkdir -p "$STAGE"
GGUF=$STAGE/SmolLM2-135M-Instruct.Q4_1.gguf
SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
MODEL=/tmp/smollm2_hf
mkdir -p /tmp/bin  # `polyrl` runs this tree
printf '#!/bin/bash\nexec python3 -m polyrl.cli "$@"\n' > /tmp/bin/polyrl && chmod +x /tmp/bin/polyrl
export PATH=/tmp/bin:$PATH
cp .gl/smollm2.gguf.part-* "$STAGE/" 2>/dev/null
ls -la "$STAGE"
[ "$MODE" = stage ] && exit 0

if [ ! -f "$MODEL/config.json" ]; then
    ls .whl/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --upgrade --target /tmp/site .whl/*.whl  # the image's pip would not put them on this python's path
    cat "$STAGE"/smollm2.gguf.part-* > "$GGUF"
    echo "$SHA  $GGUF" | sha256sum -c || exit 1
    polyrl models convert "$GGUF" --out "$MODEL" 2>&1 | grep -v "it/s" | tail -2
fi
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"

curve() {  # step, cumulative step seconds, held-out accuracy, from a run's metrics.jsonl
    python3 - "$1" <<'PY'
import json, sys
total = 0.0
for line in open(sys.argv[1]):
    r = json.loads(line)
    total += r.get("timing_s/step", 0.0) + r.get("timing_s/testing", 0.0)
    acc = r.get("val-core/polyrl/word_addition/acc/mean@1")
    if acc is not None:
        print(f"step {r['step']:3d}  {total:6.1f} s (steps + validation)  held-out {100 * acc:5.1f}%")
PY
}

if [ "$MODE" = recipe ]; then
    for lr in 2e-5 4e-5; do
        echo "== recipe: examples/grpo_smollm2_addition.sh on cuda, 32 prompts x 8, lr $lr" | tee -a "$OUT/recipe.txt"
        rm -rf /tmp/smol_gpu_$lr
        start=$SECONDS
        OUT=/tmp/smol_gpu_$lr MODEL=$MODEL DEVICE=cuda BATCH=32 MICRO=256 STEPS=30 TEST_FREQ=5 VAL=256 LR=$lr \
            timeout 240 bash examples/grpo_smollm2_addition.sh actor_rollout_ref.rollout.free_cache_engine=False 2>&1 \
            | tr '\r' '\n' | grep -v "Loading\|it/s" | tail -3
        echo "wall (data + load + train + validation + export): $((SECONDS - start)) s" \
            | tee -a "$OUT/recipe.txt"
        curve /tmp/smol_gpu_$lr/run/metrics.jsonl | tee -a "$OUT/recipe.txt"
        cp /tmp/smol_gpu_$lr/run/metrics.jsonl "$OUT/recipe_metrics_$lr.jsonl"
    done
fi

if [ "$MODE" = trl ]; then
    echo "== polyrl vs TRL 1.16, same recipe, one GPU"
    # one micro-batch of 256 on both sides; polyrl's memory keys on auto: for this model that keeps the engine's KV
    # cache between steps and skips torch.compile (~0.1 s of update per step cannot repay a ~20 s cold compile)
    timeout 570 python3 benchmarks/real_model_trl.py --device cuda --model "$MODEL" --batch 32 --micro 256 \
        --note "micro-batch 256 both sides; polyrl memory keys auto (cache kept, compile off by the size rule)" \
        --steps ${STEPS:-30} --eval-every 5 --val 256 --out "$OUT/real_model_trl.json" 2>&1 \
        | grep -v "Loading\|it/s\|Warning\|warn" | tee "$OUT/real_model_trl.txt" | tail -20
    git diff benchmarks/history.jsonl > "$OUT/benchmarks_rows.diff"
fi

if [ "$MODE" = gap ]; then  # issue 16: the engine-vs-trainer log-prob gap per rollout dtype, on the real kernels
    # (every decode GEMM in FP8 where the config asks for it: at 135M none passes the CUDA default's 2^23 line)
    timeout 400 python3 benchmarks/real_model_gap.py --model "$MODEL" --device cuda --fp8-min-elements 0 \
        --rows-out "$OUT/rows.jsonl" 2>&1 | grep -v "Loading\|it/s\|Warn\|warn" | tail -12 | tee "$OUT/gap.txt"
fi
