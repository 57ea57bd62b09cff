"""Shared test set-up: no network, quiet libraries, and a helper that runs a recipe through the real launcher."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# Every Python process a fast-tier test starts imports this folder's sitecustomize.py: a launcher or a rank marks it.
PROCESS_GUARD = Path(__file__).resolve().parent / "process_guard"
GROUP_MARKS_ENV = "HF_ZERO_TEST_GROUP_MARKS"
PROFILES = REPO / "accelerate_configs"
TINY = REPO / "recipes" / "configs" / "tiny_curriculum.yaml"
RECIPE = REPO / "recipes" / "curriculum.py"

# Tests never touch a hub; every model and data set is built or shipped locally.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

_FRESH_CACHE = None
# Session-scoped 2-rank runs shared by every test that reads them.
pytest_plugins = ["shared_runs"]


def pytest_configure(config):
    """Every session starts from an empty offline cache, as on a fresh machine: no test may rely on another having
    built a model first. HF_ZERO_TEST_CACHE=<dir> reuses a folder instead (a developer's quicker reruns)."""
    global _FRESH_CACHE
    reuse = os.environ.get("HF_ZERO_TEST_CACHE")
    if not reuse:
        _FRESH_CACHE = tempfile.mkdtemp(prefix="hf_zero_test_cache_")
    os.environ["HF_ZERO_CACHE"] = reuse or _FRESH_CACHE  # subprocesses (launched ranks) inherit it


def pytest_unconfigure(config):
    if _FRESH_CACHE:
        shutil.rmtree(_FRESH_CACHE, ignore_errors=True)


def run_cmd(cmd, timeout=900, cwd=REPO, env=None, check=True):
    proc = subprocess.run(
        [str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=timeout,
        env={**os.environ, **(env or {})},
    )
    if check and proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-60:])
        raise AssertionError(f"command failed ({proc.returncode}): {' '.join(map(str, cmd))}\n{tail}")
    return proc


def launch_recipe(profile, out_dir, *extra, config=TINY, recipe=RECIPE, nproc=None, timeout=900, check=True, env=None):
    """`accelerate launch --config_file PROFILE recipe --config C --output_dir OUT ...` in a subprocess."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", PROFILES / f"{profile}.yaml"]
    if nproc:
        cmd += ["--num_processes", nproc]
    cmd += [recipe, "--config", config, "--output_dir", out_dir, "--disable_tqdm", "true", *extra]
    return run_cmd(cmd, timeout=timeout, check=check, env=env)


def read_summary(out_dir) -> dict:
    return json.loads((Path(out_dir) / "summary.json").read_text())


@pytest.fixture
def quiet_env(monkeypatch):
    """A single-process, non-distributed environment for in-process recipe runs."""
    for key in [k for k in os.environ if k.startswith(("ACCELERATE_", "HF_ZERO_PROFILE")) or k in
                ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")]:
        monkeypatch.delenv(key, raising=False)
    yield


@pytest.fixture(autouse=True)
def fast_tier_starts_no_process_group(request, monkeypatch):
    """`make test-fast` runs every test not marked `multiproc`, and promises that none of them starts a process group
    (a launcher and its ranks). Such a test's child processes report any launcher or rank they are (process_guard/),
    and the test fails naming it: a new test that launches must carry the marker."""
    if request.node.get_closest_marker("multiproc"):
        yield
        return
    marks = tempfile.mkdtemp(prefix="hf_zero_group_marks_")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(PROCESS_GUARD), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv(GROUP_MARKS_ENV, marks)
    try:
        yield
        started = sorted(p.read_text() for p in Path(marks).iterdir())
    finally:
        shutil.rmtree(marks, ignore_errors=True)
    if started:
        pytest.fail("this test started a process group but is not marked multiproc (make test-fast runs it):\n  "
                    + "\n  ".join(started), pytrace=False)
