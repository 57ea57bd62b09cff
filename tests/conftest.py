"""Shared test set-up: no network, quiet libraries, a fresh offline cache per session, the fast tier's guard, and the
session's shared runs (2-rank runs and README commands made once, read by every test that asserts about them)."""

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from testing_utils import (
    GROUP_MARKS_ENV,
    LORA_FLAGS,
    ONE_STEP,
    PROCESS_GUARD,
    REPO,
    STRATEGIES,
    STRATEGY_FLAGS,
    TINY,
    TINY24_FLAGS,
    Lazy,
    Run,
    hf_zero_train,
    launch_recipe,
    run_as_user,
    write_short_config,
)

# Tests never touch a hub; every model and data set is built or shipped locally.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

_FRESH_CACHE = None


def pytest_configure(config):
    """Every session starts from an empty offline cache, as on a fresh machine: no test may rely on another having
    built a model first. HF_ZERO_TEST_CACHE=<dir> reuses a folder instead (a developer's quicker reruns).
    Under pytest-xdist (`-n`) the workers share the controller's cache: its builds are safe to race (one lock per
    entry), and each model is built once per session, not once per worker."""
    global _FRESH_CACHE
    if os.environ.get("PYTEST_XDIST_WORKER") and os.environ.get("HF_ZERO_CACHE"):
        return  # a worker: the controller made the cache and removes it
    if config.getoption("dist", "no") == "loadgroup":  # the workers write their groups there (below), once collected
        os.environ[_GROUPS_ENV] = os.path.join(tempfile.mkdtemp(prefix="hf_zero_xdist_"), "groups.json")
    reuse = os.environ.get("HF_ZERO_TEST_CACHE")
    if not reuse:
        _FRESH_CACHE = tempfile.mkdtemp(prefix="hf_zero_test_cache_")
    os.environ["HF_ZERO_CACHE"] = reuse or _FRESH_CACHE  # subprocesses (launched ranks, xdist workers) inherit it
    # The offline models live in the hub cache under their hub ids (hf_zero/data/model_names.py): fresh as well, and
    # never the user's own ~/.cache/huggingface.
    os.environ["HF_HUB_CACHE"] = os.path.join(reuse or _FRESH_CACHE, "hub")
    if os.environ.get("HF_ZERO_TEST_LAUNCH_LOG"):  # every launch appends a line there (process_guard/sitecustomize.py)
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROCESS_GUARD), os.environ.get("PYTHONPATH")]))


# ---------------------------------------------------------------- tiers and workers

# The launches `make test` keeps, within its 15 minutes on 2 cores beside the in-process tests: the shared strategy
# runs and every test that reads them, and the promises users lose most to: one line from inside the ranks, SIGINT,
# SIGKILL and resume to the same weights, a full disk, a second run on one folder, a crafted checkpoint refused in the
# ranks, a ZeRO-3 LoRA checkpoint holding the trained adapter, a resume under another engine and number of ranks
# (ZeRO-3 on 2 <-> FSDP2 on 1), the default `make train` (tests/commands/test_readme.py keeps its own: resume on
# another number of ranks and sequence parallelism). Every other test that starts a process group is `extended`:
# `make test-extended` (CI runs it after `make test`) and `make test-all` run it.
DEFAULT_LAUNCHES = (
    "tests/train/test_distributed.py", "tests/train/test_fsdp.py", "tests/estimate/test_estimate_measured.py",
    "tests/checkpoint/test_safe_load.py", "tests/plan/test_one_batch_line.py", "tests/launch/test_errors.py",
    "tests/launch/test_run_lock.py", "tests/core/test_tiers.py", "tests/commands/test_readme.py",
    "tests/checkpoint/test_checkpoints.py::test_lora_zero3_checkpoints_hold_the_gathered_adapter_only",
    "tests/checkpoint/test_checkpoints.py::test_sigkill_and_resume_gives_the_uninterrupted_weights_zero2",
    "tests/checkpoint/test_checkpoints.py::test_rotation_keeps_last_two_and_the_best",
    "tests/checkpoint/test_checkpoints.py::test_disk_full_stops_cleanly_and_earlier_checkpoints_resume",
    "tests/checkpoint/test_cross_engine.py::test_zero3_on_2_ranks_resumes_under_fsdp2_on_1",
    "tests/checkpoint/test_cross_engine.py::test_fsdp2_on_1_rank_resumes_under_zero3_on_2",
    "tests/train/test_held_out.py::test_eval_numbers_are_the_same_on_1_and_2_ranks[zero2]",
    "tests/checkpoint/test_lora_contents.py::test_lora_checkpoint_holds_no_frozen_base_tensor[zero2-tied]",
)
# A test reading one of these runs where the run was made (under xdist: on the launches' worker). Not readme_runs: a
# README command that launches, or reads what one wrote, is `multiproc` itself (tests/commands/test_readme.py); the
# others are quick and may run in a second checkout on the other worker.
SHARED_RUNS = {"strategy_runs", "lora_zero3_run", "small_llama_zero3_first_run", "tiny24_references"}


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    """Marks `extended` every launching test not in DEFAULT_LAUNCHES. Then, for `make test`'s two workers
    (pytest-xdist, `--dist loadgroup`): every test that launches or reads a shared run goes to one worker, in order
    and first (one launch at a time fills both cores, the session's runs are built once, the README's commands run
    in order in one checkout); every other module goes whole to whichever worker is free (module fixtures once)."""
    for item in items:
        if item.get_closest_marker("multiproc") and not item.nodeid.startswith(DEFAULT_LAUNCHES):
            item.add_marker(pytest.mark.extended)
    # before `-m` deselects them: the files `make test-gpu` has to collect (tests/commands/test_cli.py compares)
    config.stash[GPU_TEST_FILES] = {item.nodeid.split("::")[0] for item in items if item.get_closest_marker("gpu")}

    def launches(item):
        return item.get_closest_marker("multiproc") or SHARED_RUNS & set(getattr(item, "fixturenames", ()))

    groups = {item.nodeid: "launches" if launches(item) else item.nodeid.split("::")[0] for item in items}
    items.sort(key=lambda item: not launches(item))  # stable: each group keeps its order
    if os.environ.get("PYTEST_XDIST_WORKER") and os.environ.get(_GROUPS_ENV):  # for the controller's scheduler
        tmp = f"{os.environ[_GROUPS_ENV]}.{os.environ['PYTEST_XDIST_WORKER']}"
        Path(tmp).write_text(json.dumps(groups))
        os.replace(tmp, os.environ[_GROUPS_ENV])  # every worker writes the same groups


GPU_TEST_FILES = pytest.StashKey[set]()


# pytest-xdist 3.8's own `xdist_group` marker does not group under pytest 9 (it renames a node through an attribute
# pytest 9 no longer reads), so the groups reach its scheduler through a file the workers write while collecting.
_GROUPS_ENV = "HF_ZERO_TEST_XDIST_GROUPS"


def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class ByGroup(LoadGroupScheduling):
        """Whole groups to a worker, in collection order (the launches first, not the largest group first)."""

        def __init__(self, config, log):
            super().__init__(config, log)
            config.option.loadscopereorder = False
            self.groups = None

        def _split_scope(self, nodeid):
            if self.groups is None:  # every worker has collected (and written the file) before the first call
                self.groups = json.loads(Path(os.environ[_GROUPS_ENV]).read_text())
            return self.groups.get(nodeid, nodeid)

    return ByGroup(config, log)


@pytest.fixture(autouse=True)
def environment_restored():
    """Each test starts from the session's environment: a test that runs a command in-process (hf-zero train with the
    launch stood in) sets the run's variables (profile, run folder) in os.environ, and a later test's recipe,
    started as a plain process, would inherit them."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


def pytest_unconfigure(config):
    if _FRESH_CACHE:
        shutil.rmtree(_FRESH_CACHE, ignore_errors=True)


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
    # `gpu` tests never run in make test-fast either; on the first GPU they launched every profile and failed here
    if request.node.get_closest_marker("multiproc") or request.node.get_closest_marker("gpu"):
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


# ---------------------------------------------------------------- the session's shared runs

@pytest.fixture(scope="session")
def strategy_runs(tmp_path_factory):
    """runs[name] for name in STRATEGIES: the tiny curriculum (15 steps, 3 stages) on 2 ranks with STRATEGY_FLAGS.
    zero2 goes through `hf-zero train` (its console is checked as a log file sees it), the others through plain
    `accelerate launch`."""
    root = tmp_path_factory.mktemp("shared")

    def make(name):
        assert name in STRATEGIES, name
        if name == "zero2":
            return hf_zero_train(name, root / name, *STRATEGY_FLAGS)
        proc = launch_recipe(name, root / name, *STRATEGY_FLAGS)
        return Run(root / name, proc.stdout, proc.stderr)

    return Lazy(make)


@pytest.fixture(scope="session")
def lora_zero3_run(tmp_path_factory):
    """LoRA (rank 64, all 7 projections) under ZeRO-3 on 2 ranks, checkpoints at 5, 10, 15; the memory probe switched
    on by its environment variable (the strategy runs use the recipe field)."""
    out = tmp_path_factory.mktemp("shared_lora") / "zero3"
    proc = launch_recipe("zero3", out, *LORA_FLAGS, env={"HF_ZERO_MEASURE_MEMORY": "1"})
    return Run(out, proc.stdout, proc.stderr)


@pytest.fixture(scope="session")
def small_llama_zero3_first_run(tmp_path_factory):
    """recipes/configs/nvme_swap.yaml (small-llama, 4 steps) under zero3 on 2 ranks through plain `accelerate
    launch`, from an empty cache of its own: the first run that once deadlocked (the model built under zero.Init
    while rank 1 sat on the cache lock: test_fresh_cache.py). The config is test_nvme.py's, whose plain ZeRO-3
    baseline is the same run. .out (the run), .cache (the cache it built its model in)."""
    root = tmp_path_factory.mktemp("small_llama_zero3")
    config = write_short_config(REPO / "recipes" / "configs" / "nvme_swap.yaml", root / "nvme_swap.yaml", [4])
    empty, out = root / "cache", root / "run"
    launch_recipe("zero3", out, config=config,
                  env={"HF_ZERO_CACHE": str(empty), "HF_HUB_CACHE": str(empty / "hub"), "PYTHONPATH": str(REPO)})
    return SimpleNamespace(out=out, cache=empty)


@pytest.fixture(scope="session")
def tiny24_config(tmp_path_factory):
    """The tiny curriculum with 8 steps per stage: enough steps after the first checkpoint to kill a run in."""
    data = yaml.safe_load(TINY.read_text())
    for stage in data["stages"]:
        stage["steps"] = 8
        # paths in a YAML are relative to its folder: the copy lives elsewhere
        stage["data"] = [str((TINY.parent / d).resolve()) for d in
                         (stage["data"] if isinstance(stage["data"], list) else [stage["data"]])]
    path = tmp_path_factory.mktemp("config") / "tiny24.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture(scope="session")
def tiny24_references(tmp_path_factory, tiny24_config):
    """refs[profile]: an uninterrupted 2-rank run of tiny24_config with TINY24_FLAGS (checkpoints every 3 steps), the
    reference its resumed and killed runs are compared with; one per profile, shared by all of them."""
    root = tmp_path_factory.mktemp("tiny24_references")

    def make(profile):
        launch_recipe(profile, root / profile, *TINY24_FLAGS, config=tiny24_config)
        return root / profile

    return Lazy(make)


@pytest.fixture(scope="session")
def readme_checkout(tmp_path_factory) -> Path:
    """The commands run in a copy of the repository's files sharing its .venv (and `make`'s install stamp): what
    they write (runs/, bench_out/) never lands in the repository, and an earlier session's finished run cannot make
    a training command a no-op."""
    copy = tmp_path_factory.mktemp("checkout")
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    for rel in filter(None, listed.split("\0")):
        if (REPO / rel).is_file():
            (copy / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, copy / rel)
    (copy / ".venv").symlink_to(REPO / ".venv")
    stamp = REPO / ".venv" / ".hf_zero-installed"  # the Makefile's install stamp
    if stamp.is_file():  # `make` must find the shared install current, never reinstall (editable) from the copy
        for name in ("setup.cfg", "pyproject.toml"):
            os.utime(copy / name, (stamp.stat().st_mtime - 1, stamp.stat().st_mtime - 1))
    return copy


@pytest.fixture(scope="session")
def readme_runs(readme_checkout, tmp_path_factory):
    """runs[cmd]: the finished process of a README command, run once in the checkout (tests/commands/test_readme.py
    runs each; tests that assert more about the same run read it here instead of launching it again). An empty
    HF_HOME, as on a fresh machine: the classification recipes' metric modules are copied into it by the ranks' first
    load."""
    hf_home = tmp_path_factory.mktemp("hf_home")
    return Lazy(lambda cmd: run_as_user(cmd, readme_checkout, hf_home))


@pytest.fixture(scope="session")
def one_step_config(tmp_path_factory):
    """ONE_STEP (one optimizer step of the tiny model) with its data paths made absolute: the copy lives elsewhere."""
    path = tmp_path_factory.mktemp("cfg") / "one_step.yaml"
    path.write_text(ONE_STEP.replace("recipes/data/tiny/", f"{REPO}/recipes/data/tiny/"))
    return path
