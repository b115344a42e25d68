#!/usr/bin/env bash
# Issue 16 on one H100, the FP8 GEMM inputs quantised by their producers (POLYRL_FP8_FUSED_INPUT; on by default
# since s1 measured +0.6% on 2026-11-26). Two device calls, each under ~9 min; rows to $OUT/rows.jsonl, logs beside them:
#   bash benchmarks/probes/fp8_fused_session.sh check   # the FP8 GPU tests (incl. the fused producers and the one-launch
#                                                # weight quantiser), then every decode GEMM bf16 / W8A8 / W8A8 fed
#   bash benchmarks/probes/fp8_fused_session.sh s1      # s1 at 64 sequences, fp8kv_w8 without and with fused inputs
#   bash benchmarks/probes/fp8_fused_session.sh s1_all  # the same with every decode GEMM in FP8 (fp8kv_w8all), fused inputs
#   bash benchmarks/probes/fp8_fused_session.sh rows256 # split-K in row blocks to 256 rows: GPU tests, GEMMs with a sweep
#   bash benchmarks/probes/fp8_fused_session.sh line    # the 2^23 FP8 line: (a) both lines, bf16 kernel table, s1, 8B GEMMs
#   bash benchmarks/probes/fp8_fused_session.sh probe   # the FP8 GPU tests, the 1.5B GEMMs with cold weights (as the engine
#                                                # reads them), then s1 fp8kv_w8all against fp8kv_w8 in one call
#   bash benchmarks/probes/fp8_fused_session.sh rope    # v2 doing rope_kv's work: GPU tests, (a) and s1 without / with it
#   bash benchmarks/probes/fp8_fused_session.sh rope_qwen3  # the shared rope_heads: GPU tests, s1 and (a) at the defaults
#   bash benchmarks/probes/fp8_fused_session.sh probe_a # v2's bf16 launches by regime (s1's bf16 tail), then (a)'s kernel
#                                                # tables on this GPU, fp8kv_w8 and bf16
#   bash benchmarks/probes/fp8_fused_session.sh bf16_v2 # v2 for a bf16 cache: GPU tests, (a)'s e4m3 launches with more warps
#                                                # an SM, the 1.5B FP8 GEMMs past 64 rows, (a) bf16 on v1 and v2
#   bash benchmarks/probes/fp8_fused_session.sh s1_bf16 # s1 at 64 sequences in bf16 on v2 (the default) and v1, one process each
#                                                # (SEQS=128: at 128 sequences)
#   bash benchmarks/probes/fp8_fused_session.sh bf16_check # s2 in bf16 on v1 and v2 (the default now), the GPU tests of the
#                                                # engine and v2, learning in bf16 (3 seeds)
#   bash benchmarks/probes/fp8_fused_session.sh rope_cost # (a)'s kernel tables with and without v2's fused RoPE + K/V write,
#                                                # FP8 KV + W8 and bf16 (where v2's engine time goes past its
#                                                # isolated layer time)
#   bash benchmarks/probes/fp8_fused_session.sh gpu_tests # the one-GPU test files that run the engine (training, async PPO,
#                                                # offload, OOM, FP8 rollout), after a change to its defaults
#   bash benchmarks/probes/fp8_fused_session.sh clocks  # SM clock and power every 200 ms while (a) runs in FP8 KV + W8 and
#                                                # while the decode kernel runs alone (v2's engine-vs-isolated gap)
#   bash benchmarks/probes/fp8_fused_session.sh sliced  # the bf16 down projection as 4 K slices (model.SLICED_DOWN): engine
#                                                # GPU tests, then (a) and s1 in bf16 with it on and off
#   bash benchmarks/probes/fp8_fused_session.sh partials # the split-K FP8 GEMM handing its partials to the consumer: GPU
#                                                # tests, the 1.5B down / gate_up at 64-256 rows over tile shapes,
#                                                # then (a)'s e4m3 decode regime with cold caches (4 layers cycled)
#   bash benchmarks/probes/fp8_fused_session.sh partials_a # FP8 down partials (fp8_linear.PARTIALS) in the engine: GPU
#                                                # tests, the down probe at 16-32 rows and at 8B, (a) on and off
#   bash benchmarks/probes/fp8_fused_session.sh partials_s1 # s1 at 64 sequences in FP8 KV + W8, partials on and off; at 128
#   bash benchmarks/probes/fp8_fused_session.sh partials_s2 # s2 on and off, learning (3 seeds)
#   bash benchmarks/probes/fp8_fused_session.sh layout  # (a)'s decode layer alone: 1 or 28 layer caches, pages in random /
#                                                # engine (interleaved) / contiguous order (the engine-vs-isolated gap)
#   bash benchmarks/probes/fp8_fused_session.sh fast_accum # `_scaled_mm` with fast accumulation: GPU tests, the 1.5B GEMMs
#                                                # at 128-8192 rows both ways, (a) on and off
#   bash benchmarks/probes/fp8_fused_session.sh fast_check # learning (3 seeds) and s2 with fast accumulation on and off
#   bash benchmarks/probes/fp8_fused_session.sh masked  # (a)'s decode layer at 768 context tokens (whole steps) and 784 (a
#                                                # masked last step, as the engine's steps mostly end), bf16 and e4m3
#   bash benchmarks/probes/fp8_fused_session.sh slices  # silu_mul's FP8 scales per K split of the down GEMM: GPU tests,
#                                                # (a) on and off
#   bash benchmarks/probes/fp8_fused_session.sh slices_s1 # s1 at 64 sequences with silu_mul's per-split FP8 scales on and off
#   bash benchmarks/probes/fp8_fused_session.sh slices_learn # learning (3 seeds) with them, then (a) in FP8 KV + W8 and bf16
#   bash benchmarks/probes/fp8_fused_session.sh prefill # (a) in FP8 KV + W8 and bf16, each with a kernel table of its prefill
#   bash benchmarks/probes/fp8_fused_session.sh pinned  # step inputs through pinned memory: engine GPU tests, (a) both dtypes
#   bash benchmarks/probes/fp8_fused_session.sh prefill_kernel # prefill attention from the paged cache in one launch: GPU
#                                                # tests, then (a) both dtypes and s2, on and off
#   bash benchmarks/probes/fp8_fused_session.sh one_wave # gate_up at 129-256 rows in one wave of programs (wave_fp8.py): GPU
#                                                # tests, the GEMM probe, (a) in FP8 KV + W8 on and off (twice)
#   bash benchmarks/probes/fp8_fused_session.sh sampler # the sampler's pass with one exp a logit: GPU tests, the sampler
#                                                # against the earlier one by chunk count, (a) at 64 and 16 chunks
#   bash benchmarks/probes/fp8_fused_session.sh final   # learning (3 seeds), s1 at 64 sequences, the engine + FP8 GPU tests
#   bash benchmarks/probes/fp8_fused_session.sh final_a # (a): FP8 KV + W8 twice, bf16, the FP8 LM head recipe
#   bash benchmarks/probes/fp8_fused_session.sh bound   # (a) at best with a kernel per op (a_bound.py)
#   OLD=dir bash benchmarks/probes/fp8_fused_session.sh ab    # A/B against an earlier tree: GPU tests, decode kernels, (a)
#   OLD=dir bash benchmarks/probes/fp8_fused_session.sh ab_s1 # ... s1 at 64 sequences. OLD is a copy of the earlier tree's
#                                                # polyrl/ and benchmarks/ (untracked, `git archive REV polyrl
#                                                # benchmarks | tar -x -C _ab_old`); each runs beside this tree
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=. HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
decode_gpu_tests() {  # the GPU tests that touch the decode path, within $1 seconds
  timeout "$1" python3 -m pytest -q -p no:cacheprovider tests/test_paged_decode_v2_gpu.py tests/test_fp8_rollout_gpu.py \
    tests/test_native_rollout_gpu.py 2>&1 | tail -3 | tee "$OUT/tests.txt"
}
case "${1:?part}" in
  check)
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_fp8_rollout_gpu.py 2>&1 | tail -5 | tee "$OUT/tests.txt"
    timeout 330 python3 benchmarks/seed_workloads.py --gemms 2>&1 | grep "^gemm r1-distill" | tee "$OUT/gemms.txt" ;;
  s1)
    S1="benchmarks/seed_workloads.py --shapes s1 --seqs 64 --rows-out $OUT/rows.jsonl"
    POLYRL_FP8_FUSED_INPUT=0 timeout 270 python3 $S1 --configs fp8kv_w8 2>&1 | grep "^{" | tee "$OUT/s1_plain.txt"
    POLYRL_FP8_FUSED_INPUT=1 timeout 270 python3 $S1 --configs fp8kv_w8 2>&1 | grep "^{" | tee "$OUT/s1_fused.txt" ;;
  s1_all)
    POLYRL_FP8_FUSED_INPUT=1 timeout 540 python3 benchmarks/seed_workloads.py --shapes s1 --seqs 64 \
      --rows-out "$OUT/rows.jsonl" --configs fp8kv_w8all 2>&1 | grep "^{" | tee "$OUT/s1_all.txt" ;;
  probe)
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_fp8_rollout_gpu.py 2>&1 | tail -5 | tee "$OUT/tests.txt"
    timeout 120 python3 benchmarks/seed_workloads.py --gemms --gemm-archs r1-distill-1.5b --gemm-rows 1,8,16,32,64,128 \
      --gemm-sweep-rows 32 2>&1 | grep "^gemm\|^device\|Error" | tee "$OUT/gemms.txt"
    S1="benchmarks/seed_workloads.py --shapes s1 --seqs 64 --rows-out $OUT/rows.jsonl"
    timeout 240 python3 $S1 --configs fp8kv_w8all 2>&1 | grep "^{\|Error" | tee "$OUT/s1_all.txt"
    timeout 200 python3 $S1 --configs fp8kv_w8 2>&1 | grep "^{\|Error" | tee "$OUT/s1.txt" ;;
  splitk)  # the split-K FP8 GEMM: its GPU tests, the 1.5B GEMMs with a launch sweep (the table s1 then loads), s1
    timeout 70 python3 -m pytest -q -p no:cacheprovider tests/test_fp8_rollout_gpu.py -k "splitk or linear" 2>&1 \
      | tail -4 | tee "$OUT/tests.txt"
    timeout 170 python3 benchmarks/seed_workloads.py --gemms --gemm-archs r1-distill-1.5b --gemm-rows 1,16,32,64,128 \
      --splitk-table-out "$OUT/splitk_table.json" 2>&1 | grep "^gemm\|^device\|Error" | tee "$OUT/gemms.txt"
    T=$([ -s "$OUT/splitk_table.json" ] && echo "--splitk-table $OUT/splitk_table.json")
    S1="benchmarks/seed_workloads.py --shapes s1 --seqs 64 --rows-out $OUT/rows.jsonl $T"
    timeout 165 python3 $S1 --configs fp8kv_w8all 2>&1 | grep "^{\|Error" | tee "$OUT/s1_all.txt"
    timeout 165 python3 $S1 --configs fp8kv_w8 2>&1 | grep "^{\|Error" | tee "$OUT/s1.txt" ;;
  rows256)  # the split-K kernel in row blocks up to 256 rows: its GPU tests, then the 1.5B GEMMs at 96-256 rows with
            # a launch sweep (BM 64 or 128) written to $OUT/splitk_table.json (6baf986 also timed (a) with every FP8
            # GEMM on split-K; the routing the GEMMs led to is timed by the `line` part)
    timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_fp8_rollout_gpu.py -k splitk 2>&1 | tail -3 \
      | tee "$OUT/tests.txt"
    timeout 150 python3 benchmarks/seed_workloads.py --gemms --gemm-archs r1-distill-1.5b --gemm-rows 96,128,256 \
      --gemm-sweep-rows 128,256 --splitk-table-out "$OUT/splitk_table.json" 2>&1 | grep "^gemm\|^device\|Error" \
      | tee "$OUT/gemms.txt" ;;
  line)  # the FP8 line at 2^23 with split-K past 64 rows where _scaled_mm starves: (a) both lines + bf16 with a
         # kernel table, s1 at the new line, the 8B GEMMs at 96-256 rows (the routing's other shapes)
    timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_fp8_rollout_gpu.py -k "splitk or linear or engine" \
      2>&1 | tail -3 | tee "$OUT/tests.txt"
    A="benchmarks/seed_workloads.py --shapes a --rows-out $OUT/rows.jsonl"
    timeout 120 python3 $A --configs fp8kv_w8,fp8kv_w8gu 2>&1 | grep "^{\\|Error" | tee "$OUT/a.txt"
    timeout 70 python3 $A --configs bf16 --kernels 2>&1 | tail -40 | tee "$OUT/a_bf16_kernels.txt"
    timeout 150 python3 benchmarks/seed_workloads.py --shapes s1 --seqs 64 --configs fp8kv_w8 --rows-out $OUT/rows.jsonl \
      2>&1 | grep "^{\\|Error" | tee "$OUT/s1.txt"
    timeout 90 python3 benchmarks/seed_workloads.py --gemms --gemm-archs llama3.1-8b --gemm-rows 64,96,128,256 \
      --gemm-sweep-rows "" 2>&1 | grep "^gemm\|Error" | tee "$OUT/gemms_8b.txt" ;;
  ab)  # the GPU tests that touch the decode path, the decode kernels at 16k context and (a) in FP8 KV + W8 and in
        # bf16, this tree then $OLD's (page-transposed e4m3 V, 165ae83, was measured this way and reverted)
    decode_gpu_tests 150
    for tree in . "${OLD:-}"; do
      [ -n "$tree" ] || continue
      tag=$([ "$tree" = . ] && echo new || echo old)
      PYTHONPATH=$tree timeout 100 python3 $tree/benchmarks/probes/decode_kernel.py --budget-s 0 2>&1 | grep "^|" \
        | sed "s/^/$tag /" | tee -a "$OUT/decode_kernel.txt"
      PYTHONPATH=$tree timeout 150 python3 $tree/benchmarks/seed_workloads.py --shapes a --configs fp8kv_w8,bf16 \
        --rows-out "$OUT/rows_$tag.md" 2>&1 | grep "^{\|Error" | tee -a "$OUT/a.txt"
    done ;;
  ab_s1)
    for tree in . "${OLD:-}"; do
      [ -n "$tree" ] || continue
      tag=$([ "$tree" = . ] && echo new || echo old)
      PYTHONPATH=$tree timeout 240 python3 $tree/benchmarks/seed_workloads.py --shapes s1 --seqs 64 --configs fp8kv_w8 \
        --rows-out "$OUT/rows_$tag.md" 2>&1 | grep "^{\|Error" | tee -a "$OUT/s1.txt"
    done ;;
  rope)  # v2 doing rope_kv's work in its own launch (POLYRL_DECODE_FUSED_ROPE): GPU tests, then (a) and s1 in FP8 KV
         # + W8 without and with it, in one call
    decode_gpu_tests 200
    for rope in 0 1; do
      POLYRL_DECODE_FUSED_ROPE=$rope timeout 90 python3 benchmarks/seed_workloads.py --shapes a --configs fp8kv_w8 \
        --rows-out "$OUT/rows.jsonl" 2>&1 | grep "^{\|Error" | sed "s/^/rope=$rope /" | tee -a "$OUT/a.txt"
    done
    for rope in 0 1; do
      POLYRL_DECODE_FUSED_ROPE=$rope timeout 200 python3 benchmarks/seed_workloads.py --shapes s1 --seqs 64 \
        --configs fp8kv_w8 --rows-out "$OUT/rows.jsonl" 2>&1 | grep "^{\|Error" | sed "s/^/rope=$rope /" \
        | tee -a "$OUT/s1.txt"
    done ;;
  rope_qwen3)  # rope_heads shared by rope_kv and v2 (Qwen3 norms too): decode-path GPU tests, then s1 and (a) at the
               # defaults (bf16 (a) runs rope_kv on v1), one process each
    decode_gpu_tests 200
    timeout 200 python3 benchmarks/seed_workloads.py --shapes s1 --seqs 64 --configs fp8kv_w8 --rows-out "$OUT/rows.jsonl" \
      2>&1 | grep "^{\|rror" | tee -a "$OUT/s1.txt"
    timeout 200 python3 benchmarks/seed_workloads.py --shapes a --configs bf16,fp8kv_w8 --rows-out "$OUT/rows.jsonl" \
      2>&1 | grep "^{\|rror" | tee -a "$OUT/a.txt" ;;
  probe_a)
    timeout 200 python3 benchmarks/probes/decode_kernel.py --regimes bf16 --budget-s 170 2>&1 | tee "$OUT/regimes_bf16.txt"
    for c in fp8kv_w8 bf16; do
      timeout 110 python3 benchmarks/seed_workloads.py --shapes a --configs $c --kernels --rows-out "$OUT/rows.jsonl" \
        2>&1 | tail -45 | tee "$OUT/a_kernels_$c.txt"
    done ;;
  bf16_v2)
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_paged_decode_v2_gpu.py 2>&1 | tail -3 \
      | tee "$OUT/tests.txt"
    timeout 80 python3 benchmarks/probes/decode_kernel.py --regimes e4m3 --regime-batches 256 --budget-s 70 2>&1 \
      | tee "$OUT/regimes_a.txt"
    timeout 80 python3 benchmarks/seed_workloads.py --gemms --gemm-archs r1-distill-1.5b --gemm-rows 64,128,256 \
      --gemm-sweep-rows "" 2>&1 | grep "^gemm\|^device\|rror" | tee "$OUT/gemms.txt"
    for c in bf16 bf16_v2; do
      timeout 90 python3 benchmarks/seed_workloads.py --shapes a --configs $c --rows-out "$OUT/rows.jsonl" 2>&1 \
        | grep "^{\|rror" | tee -a "$OUT/a.txt"
    done ;;
  s1_bf16)
    for c in ${CONFIGS:-bf16 bf16_v1}; do
      timeout 285 python3 benchmarks/seed_workloads.py --shapes s1 --seqs ${SEQS:-64} --configs $c --rows-out "$OUT/rows.jsonl" \
        2>&1 | grep "^{\|rror" | tee -a "$OUT/s1.txt"
    done ;;
  bf16_check)
    for c in bf16 bf16_v1; do
      timeout 100 python3 benchmarks/seed_workloads.py --shapes s2 --configs $c --rows-out "$OUT/rows.jsonl" 2>&1 \
        | grep "^{\|rror" | tee -a "$OUT/s2.txt"
    done
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_native_rollout_gpu.py tests/test_paged_decode_v2_gpu.py \
      2>&1 | tail -3 | tee "$OUT/tests.txt"
    timeout 220 python3 benchmarks/fp8_quickstart.py --seeds 1,2,3 --configs bf16 --rows-out "$OUT/rows.jsonl" 2>&1 \
      | tail -8 | tee "$OUT/learn.txt" ;;
  rope_cost)
    for c in fp8kv_w8 bf16; do
      for rope in 1 0; do
        POLYRL_DECODE_FUSED_ROPE=$rope timeout 110 python3 benchmarks/seed_workloads.py --shapes a --configs $c \
          --kernels --rows-out "$OUT/rows.jsonl" 2>&1 | grep "_kernel \|nvjet\|^\[a\|^|" \
          | tee "$OUT/a_kernels_${c}_rope$rope.txt"
      done
    done ;;
  gpu_tests)
    timeout 540 python3 -m pytest -q -p no:cacheprovider tests/test_fp8_rollout_gpu.py tests/test_training_gpu.py \
      tests/test_async_ppo_gpu.py tests/test_offload_gpu.py tests/test_oom_gpu.py 2>&1 | tail -15 | tee "$OUT/tests.txt" ;;
  clocks)
    sample() { nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw --format=csv,noheader,nounits -lms 200 > "$1" & }
    sample "$OUT/clocks_a.csv"; pid=$!
    timeout 100 python3 benchmarks/seed_workloads.py --shapes a --configs fp8kv_w8 2>&1 | grep "^{\|rror" \
      | tee "$OUT/a.txt"
    kill $pid
    sample "$OUT/clocks_kernel.csv"; pid=$!
    timeout 80 python3 benchmarks/probes/decode_kernel.py --regimes e4m3 --regime-batches 256 --budget-s 60 2>&1 \
      | tee "$OUT/regimes_a.txt"
    kill $pid
    for f in "$OUT"/clocks_*.csv; do  # the busy samples (power past 300 W): median SM clock and power
      echo "$f: $(awk -F', ' '$3 > 300 {print $1, $3}' "$f" | sort -n | awk '{c[NR]=$1; p[NR]=$2} END {
        print NR " busy samples, median SM clock " c[int((NR+1)/2)] " MHz, max " c[NR]}')"
      awk -F', ' '$3 > 300 {print $3}' "$f" | sort -n | awk '{p[NR]=$1} END {print "  median power " p[int((NR+1)/2)] " W"}'
    done | tee "$OUT/clocks.txt" ;;
  sliced)
    timeout 110 python3 -m pytest -q -p no:cacheprovider tests/test_native_rollout_gpu.py 2>&1 | tail -3 \
      | tee "$OUT/tests.txt"
    for on in 1 0; do
      POLYRL_SLICED_DOWN=$on timeout 80 python3 benchmarks/seed_workloads.py --shapes a --configs bf16 \
        --rows-out "$OUT/rows.jsonl" 2>&1 | grep "^{\|rror" | sed "s/^/sliced=$on /" | tee -a "$OUT/a.txt"
    done
    for on in 1 0; do
      POLYRL_SLICED_DOWN=$on timeout 185 python3 benchmarks/seed_workloads.py --shapes s1 --seqs 64 --configs bf16 \
        --rows-out "$OUT/rows.jsonl" 2>&1 | grep "^{\|rror" | sed "s/^/sliced=$on /" | tee -a "$OUT/s1.txt"
    done ;;
  partials)
    timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_fp8_rollout_gpu.py -k splitk 2>&1 | tail -3 \
      | tee "$OUT/tests.txt"
    timeout 330 python3 benchmarks/seed_workloads.py --gemms --gemm-partials --gemm-rows 64,128,256 2>&1 \
      | grep "partials\|add_rmsnorm\|^device\|rror" | tee "$OUT/partials.txt"
    timeout 100 python3 benchmarks/probes/decode_kernel.py --regimes e4m3 --regime-batches 256 --regime-layers 4 \
      --budget-s 80 2>&1 | tee "$OUT/regimes_a_cold.txt" ;;
  partials_a)
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_fp8_rollout_gpu.py 2>&1 | tail -3 \
      | tee "$OUT/tests.txt"
    timeout 110 python3 benchmarks/seed_workloads.py --gemms --gemm-partials --gemm-rows 16,32 --gemm-names down \
      2>&1 | grep "partials\|add_rmsnorm\|^device\|rror" | tee "$OUT/partials.txt"
    timeout 110 python3 benchmarks/seed_workloads.py --gemms --gemm-partials --gemm-rows 64,128 --gemm-names down \
      --gemm-archs llama3.1-8b 2>&1 | grep "partials\|add_rmsnorm\|rror" | tee -a "$OUT/partials.txt"
    for on in 1 0; do
      POLYRL_FP8_PARTIALS=$on timeout 90 python3 benchmarks/seed_workloads.py --shapes a --configs fp8kv_w8 \
        --rows-out "$OUT/rows.jsonl" 2>&1 | grep "^{\|rror" | sed "s/^/partials=$on /" | tee -a "$OUT/a.txt"
    done ;;
  partials_s1)
    for on in 1 0; do
      POLYRL_FP8_PARTIALS=$on timeout 270 python3 benchmarks/seed_workloads.py --shapes s1 --seqs 64 --configs fp8kv_w8 \
        --rows-out "$OUT/rows.jsonl" 2>&1 | grep "^{\|rror" | sed "s/^/partials=$on /" | tee -a "$OUT/s1.txt"
    done
    timeout 200 python3 benchmarks/seed_workloads.py --shapes s1 --seqs 128 --configs fp8kv_w8 --rows-out "$OUT/rows.jsonl" \
      2>&1 | grep "^{\|rror" | tee -a "$OUT/s1_128.txt" ;;
  partials_s2)
    for on in 1 0; do
      POLYRL_FP8_PARTIALS=$on timeout 110 python3 benchmarks/seed_workloads.py --shapes s2 --configs fp8kv_w8 \
        --rows-out "$OUT/rows.jsonl" 2>&1 | grep "^{\|rror" | sed "s/^/partials=$on /" | tee -a "$OUT/s2.txt"
    done
    timeout 240 python3 benchmarks/fp8_quickstart.py --seeds 1,2,3 --rows-out "$OUT/rows.jsonl" 2>&1 | tail -8 \
      | tee "$OUT/learn.txt" ;;
  layout)
    for lay in "1 random" "1 interleaved" "28 random" "28 interleaved" "28 contiguous"; do
      set -- $lay
      timeout 60 python3 benchmarks/probes/decode_kernel.py --regimes e4m3 --regime-batches 256 --regime-layers $1 \
        --regime-layout $2 --regime-default-only 2>&1 | grep "==\|B=256\|committed" | tee -a "$OUT/layout.txt"
    done
    timeout 100 python3 benchmarks/seed_workloads.py --shapes a --configs fp8kv_w8 --rows-out "$OUT/rows.jsonl" 2>&1 \
      | grep "^{\|rror" | tee -a "$OUT/a.txt" ;;
  fast_accum)
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_fp8_rollout_gpu.py 2>&1 | tail -3 \
      | tee "$OUT/tests.txt"
    timeout 100 python3 benchmarks/seed_workloads.py --gemms --gemm-partials --gemm-fast-accum --gemm-rows \
      128,256,2048,8192 --gemm-archs r1-distill-1.5b,llama3.1-8b 2>&1 | grep "partials\|^device\|rror" \
      | tee "$OUT/fast.txt"
    for on in 1 0; do
      POLYRL_FP8_FAST_ACCUM=$on timeout 90 python3 benchmarks/seed_workloads.py --shapes a --configs fp8kv_w8 \
        --rows-out "$OUT/rows.jsonl" 2>&1 | grep "^{\|rror" | sed "s/^/fast=$on /" | tee -a "$OUT/a.txt"
    done ;;
  fast_check)
    timeout 240 python3 benchmarks/fp8_quickstart.py --seeds 1,2,3 --rows-out "$OUT/rows.jsonl" 2>&1 | tail -8 \
      | tee "$OUT/learn.txt"
    for on in 1 0; do
      POLYRL_FP8_FAST_ACCUM=$on timeout 110 python3 benchmarks/seed_workloads.py --shapes s2 --configs fp8kv_w8 \
        --rows-out "$OUT/rows.jsonl" 2>&1 | grep "^{\|rror" | sed "s/^/fast=$on /" | cut -c1-300 | tee -a "$OUT/s2.txt"
    done ;;
  masked)
    for kv in e4m3 bf16; do
      timeout 90 python3 benchmarks/probes/decode_kernel.py --regimes $kv --regime-batches 256 --regime-default-only \
        --regime-layers 4 2>&1 | tee -a "$OUT/masked.txt"
    done ;;
  slices)
    timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_fp8_rollout_gpu.py -k "splitk or partials or \
      producers or engine" 2>&1 | tail -3 | tee "$OUT/tests.txt"
    for on in 1 0; do
      POLYRL_FP8_SLICE_SCALES=$on timeout 70 python3 benchmarks/seed_workloads.py --shapes a --configs fp8kv_w8 \
        --rows-out "$OUT/rows.jsonl" 2>&1 | grep "^{\|rror" | sed "s/^/slices=$on /" | cut -c1-300 | tee -a "$OUT/a.txt"
    done ;;
  slices_s1)
    for on in 1 0; do
      POLYRL_FP8_SLICE_SCALES=$on timeout 280 python3 benchmarks/seed_workloads.py --shapes s1 --seqs 64 \
        --configs fp8kv_w8 --rows-out "$OUT/rows.jsonl" 2>&1 | grep "^{\|rror" | sed "s/^/slices=$on /" | cut -c1-200 \
        | tee -a "$OUT/s1.txt"
    done ;;
  slices_learn)
    timeout 240 python3 benchmarks/fp8_quickstart.py --seeds 1,2,3 --rows-out "$OUT/rows.jsonl" 2>&1 | tail -8 \
      | tee "$OUT/learn.txt"
    for cfg in fp8kv_w8 bf16; do
      timeout 80 python3 benchmarks/seed_workloads.py --shapes a --configs $cfg --rows-out "$OUT/rows.jsonl" 2>&1 \
        | grep "^{\|rror" | cut -c1-200 | tee -a "$OUT/a.txt"
    done ;;
  prefill)
    for cfg in fp8kv_w8 bf16; do
      timeout 120 python3 benchmarks/seed_workloads.py --shapes a --configs $cfg --prefill-kernels \
        --rows-out "$OUT/rows.jsonl" 2>&1 | grep -v "^{" | tee -a "$OUT/prefill.txt"
    done ;;
  pinned)
    timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_native_rollout_gpu.py tests/test_fp8_rollout_gpu.py \
      -k "engine or prefix or fork or graph or native" 2>&1 | tail -3 | tee "$OUT/tests.txt"
    for cfg in fp8kv_w8 bf16 fp8kv_w8; do
      timeout 80 python3 benchmarks/seed_workloads.py --shapes a --configs $cfg --rows-out "$OUT/rows.jsonl" 2>&1 \
        | grep "^{\|rror" | cut -c1-200 | tee -a "$OUT/a.txt"
    done ;;
  prefill_kernel)
    timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_paged_prefill_gpu.py tests/test_native_rollout_gpu.py \
      tests/test_fp8_rollout_gpu.py -k "prefill or engine or native or prefix or fork" -s 2>&1 \
      | grep "prefill kernel\|passed\|failed\|Error" | tee "$OUT/tests.txt"
    for run in "a fp8kv_w8 1" "a fp8kv_w8 0" "a bf16 1" "a bf16 0" "s2 fp8kv_w8 1" "s2 fp8kv_w8 0"; do
      set -- $run
      POLYRL_PREFILL_KERNEL=$3 timeout 150 python3 benchmarks/seed_workloads.py --shapes $1 --configs $2 \
        --rows-out "$OUT/rows.jsonl" 2>&1 | grep "^{\|rror" | sed "s/^/prefill_kernel=$3 /" | cut -c1-200 \
        | tee -a "$OUT/runs.txt"
    done ;;
  one_wave)
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_fp8_rollout_gpu.py -k "one_wave or splitk_kernel" \
      2>&1 | tail -3 | tee "$OUT/tests.txt"
    timeout 120 python3 benchmarks/probes/gemm_waves.py --rows 129,192,256 --ns 17920,16896 2>&1 | tee "$OUT/waves.txt"
    timeout 110 python3 benchmarks/seed_workloads.py --shapes a --configs fp8kv_w8 --kernels 2>&1 | tail -45 \
      | tee "$OUT/a_kernels.txt"
    for w in 1 0 1 0; do
      POLYRL_FP8_ONE_WAVE=$w timeout 150 python3 benchmarks/seed_workloads.py --shapes a --configs fp8kv_w8 \
        --rows-out "$OUT/rows.jsonl" 2>&1 | grep "^{\|rror" | sed "s/^/one_wave=$w /" | cut -c1-260 | tee -a "$OUT/runs.txt"
    done ;;
  sampler)  # needs benchmarks/_old_fused.py (the earlier fused.py, carried)
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_native_rollout_gpu.py -k "sampler" 2>&1 | tail -2 \
      | tee "$OUT/tests.txt"
    timeout 120 python3 benchmarks/probes/sampler_bench.py --old benchmarks/_old_fused.py 2>&1 | tee "$OUT/sampler.txt"
    for run in "fp8kv_w8 64" "fp8kv_w8 16" "bf16 64" "bf16 16"; do
      set -- $run
      POLYRL_SAMPLE_CHUNKS=$2 timeout 150 python3 benchmarks/seed_workloads.py --shapes a --configs $1 \
        --rows-out "$OUT/rows.jsonl" 2>&1 | grep "^{\|rror" | sed "s/^/chunks=$2 /" | cut -c1-200 | tee -a "$OUT/runs.txt"
    done ;;
  final)  # session 28's code: learning (3 seeds), s1 at 64 sequences, the engine and FP8 GPU test files
    timeout 240 python3 benchmarks/fp8_quickstart.py --seeds 1,2,3 --rows-out "$OUT/rows.jsonl" 2>&1 | tail -8 \
      | tee "$OUT/learn.txt"
    timeout 200 python3 benchmarks/seed_workloads.py --shapes s1 --seqs 64 --configs fp8kv_w8 --rows-out "$OUT/rows.jsonl" \
      2>&1 | grep "^{\|rror" | cut -c1-200 | tee -a "$OUT/s1.txt"
    timeout 140 python3 -m pytest -q -p no:cacheprovider tests/test_native_rollout_gpu.py tests/test_fp8_rollout_gpu.py \
      2>&1 | tail -4 | tee "$OUT/tests.txt" ;;
  final_a)  # (a) at session 28's final code: FP8 KV + W8 twice, bf16, and the FP8 LM head recipe
    for cfg in fp8kv_w8 bf16 fp8kv_w8head fp8kv_w8; do
      timeout 100 python3 benchmarks/seed_workloads.py --shapes a --configs $cfg --rows-out "$OUT/rows.jsonl" 2>&1 \
        | grep "^{\|rror" | cut -c1-200 | tee -a "$OUT/a.txt"
    done ;;
  bound)  # (a) at best with a kernel per op: each op alone, summed (a_bound.py)
    timeout 300 python3 benchmarks/probes/a_bound.py --rows-out "$OUT/rows.jsonl" 2>&1 | tee "$OUT/bound.txt" ;;
  *) echo "unknown part $1"; exit 2 ;;
esac
