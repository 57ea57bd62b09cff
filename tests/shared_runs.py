"""2-rank runs made once per session and shared by every test that asserts about them.

A launch costs 30-90 s on a 2-core machine, mostly start-up (imports, DeepSpeed init, model build), so a run is made
once, with every flag its readers need (tokens seen, checkpoints every 5 steps, the memory probe), and each test reads
its outputs: parity, bytes per rank, checkpoint contents, export, summary, console. Runs start on first use: a test
module run alone pays only for the runs it reads. Tests must not change a shared run's folder (copy what they alter).
"""

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from conftest import REPO, TINY, launch_recipe

# Every strategy run: tokens seen (the stage switches show in them), a checkpoint every 5 steps (= the stage ends, so
# the evaluations come at 0, 5, 10, 15), the memory probe at the first step.
STRATEGY_FLAGS = ["--include_num_input_tokens_seen", "non_padding", "--save_strategy", "steps", "--save_steps", "5",
                  "--global_batch_size", "4", "--measure_memory", "true"]
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# LoRA under ZeRO-3, with reentrant gradient checkpointing (the combination that once failed). Rank 8 keeps the
# adapter under a fifth of the tiny model's parameters and the checkpoint's fixed files small beside its states.
LORA_R = 8
LORA_FLAGS = ["--use_peft", "true", "--lora_r", str(LORA_R), "--lora_dropout", "0", "--lora_target_modules",
              *LORA_TARGETS, "--gradient_checkpointing", "true", "--save_strategy", "steps", "--save_steps", "5"]
STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "zero3_offload", "fsdp2")


@dataclass
class Run:
    out: Path
    stdout: str  # for the run through `hf-zero train`: its whole console (stdout and stderr), as a log file holds it
    stderr: str = ""
    args: list = field(default_factory=list)  # the hf-zero arguments that made it (`hf-zero train` runs only)
    log: Path | None = None


def _hf_zero_train(profile: str, out: Path, *extra) -> Run:
    """`hf-zero train` on 2 ranks, stdout and stderr captured to one file as a Slurm log would (no --disable_tqdm:
    the console must hold no progress-bar redraws on its own)."""
    args = ["train", "--profile", profile, "--config", TINY, "--output_dir", out, *extra]
    log = out.parent / f"{out.name}.log"
    with open(log, "w") as f:
        proc = subprocess.run([sys.executable, "-m", "hf_zero.cli", *map(str, args)], cwd=REPO, stdout=f,
                              stderr=subprocess.STDOUT, timeout=900)
    text = log.read_text()
    assert proc.returncode == 0, text[-3000:]
    return Run(out, text, "", args, log)


class _Lazy(dict):
    def __init__(self, make):
        super().__init__()
        self._make = make

    def __missing__(self, key):
        self[key] = self._make(key)
        return self[key]


class OutAndRun:
    """view[name] = (output folder, run) of a lazy set of runs: launched when a test first reads it."""

    def __init__(self, runs):
        self._runs = runs

    def __getitem__(self, name):
        return self._runs[name].out, self._runs[name]


@pytest.fixture(scope="session")
def strategy_runs(tmp_path_factory):
    """runs[name] for name in STRATEGIES: the tiny curriculum (15 steps, 3 stages) on 2 ranks with STRATEGY_FLAGS.
    zero2 goes through `hf-zero train` (its console is checked as a log file sees it), the others through plain
    `accelerate launch`."""
    root = tmp_path_factory.mktemp("shared")

    def make(name):
        assert name in STRATEGIES, name
        if name == "zero2":
            return _hf_zero_train(name, root / name, *STRATEGY_FLAGS)
        proc = launch_recipe(name, root / name, *STRATEGY_FLAGS)
        return Run(root / name, proc.stdout, proc.stderr)

    return _Lazy(make)


@pytest.fixture(scope="session")
def lora_zero3_run(tmp_path_factory):
    """LoRA (rank 8, all 7 projections) under ZeRO-3 on 2 ranks, checkpoints at 5, 10, 15; the memory probe switched
    on by its environment variable (the strategy runs use the recipe field)."""
    out = tmp_path_factory.mktemp("shared_lora") / "zero3"
    proc = launch_recipe("zero3", out, *LORA_FLAGS, env={"HF_ZERO_MEASURE_MEMORY": "1"})
    return Run(out, proc.stdout, proc.stderr)


# ---------------------------------------------------------------- a 24-step curriculum for checkpoints and resumes

TINY24_FLAGS = ["--save_strategy", "steps", "--save_steps", "3", "--global_batch_size", "4"]


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

    return _Lazy(make)


# ---------------------------------------------------------------- the README's commands, as a user types them

README = REPO / "README.md"


def readme_commands() -> list[str]:
    """Every command line of the README's ```bash blocks, in order (continuation lines joined)."""
    cmds = []
    for block in re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                cmds.append(line)
    return cmds


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
    """runs[cmd]: the finished process of a README command, run once in the checkout (tests/test_readme.py runs
    each; tests that assert more about the same run read it here instead of launching it again). An empty HF_HOME,
    as on a fresh machine: the classification recipes' metric modules are copied into it by the ranks' first load."""
    hf_home = tmp_path_factory.mktemp("hf_home")
    return _Lazy(lambda cmd: run_as_user(cmd, readme_checkout, hf_home))


def run_as_user(cmd: str, checkout: Path, hf_home: Path) -> subprocess.CompletedProcess:
    """A shell command as a user types it in the checkout: its .venv's bin first on PATH, and not inside `make
    test`'s make (a nested make prints "Leaving directory" after the run)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}
    env["PATH"] = f"{checkout / '.venv' / 'bin'}:{os.environ['PATH']}"
    env["HF_HOME"] = str(hf_home)
    return subprocess.run(cmd, shell=True, cwd=checkout, env=env, capture_output=True, text=True, timeout=1200)


def readme_command(*words) -> str:
    """The one README command holding all these words."""
    (cmd,) = [c for c in readme_commands() if all(w in c for w in words)]
    return cmd
