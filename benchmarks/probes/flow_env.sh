# Sourced by the flow session scripts on the GPU machine: the wheels its image lacks (carried in `.whl_flow`:
# diffusers, rapidocr and their small deps; docs/engineering/NOTES_flow.md says how to download them), the environment,
# the GPUs, and `run NAME CMD...` (the log in $OUT/NAME.log, its last $TAIL lines on screen).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# the device returns at most 8 files from $OUT: pip's log goes there only when the install fails
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl_flow/*.whl \
  > /tmp/pip.log 2>&1 || cp /tmp/pip.log "$OUT/pip.log"
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:. HF_HUB_OFFLINE=1 POLYRL_CACHE=/tmp/pcache
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | sort | uniq -c | tee -a "$OUT/gpu.txt"
run() {
  local name=$1; shift
  "$@" > "$OUT/$name.log" 2>&1
  echo "== $name (exit $?)"; grep -v "Warn\|warn(\|_register_pre_backward_hook" "$OUT/$name.log" | tail -"${TAIL:-25}"
}
