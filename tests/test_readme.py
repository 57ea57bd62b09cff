"""Every command shown in the README runs, and the README documents every recipe field."""

import json
import os
import re
import shutil
import subprocess
from dataclasses import fields
from pathlib import Path

import pytest
from conftest import REPO
from scale_helpers import libaio_missing_reason

from hf_zero.core.config import CurriculumArguments, ModelArguments, Stage

README = (REPO / "README.md").read_text()
# `make test` is this suite itself (CI runs it through .ci/run); running it from inside would recurse. The suite never
# installs system packages: .ci/run runs scripts/system_deps.sh first, and tests/test_nvme.py runs it again where the
# packages are installed (test_system_deps_script_is_idempotent).
NOT_RUN_HERE = {"make test", "bash scripts/system_deps.sh"}


def readme_commands() -> list[str]:
    cmds = []
    for block in re.findall(r"```bash\n(.*?)```", README, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                cmds.append(line)
    return cmds


def test_first_screen_has_the_two_commands():
    first = "\n".join(README.splitlines()[:15])
    assert "make train" in first and "make test" in first


def _documented_types():
    from hf_zero.data.classification import ClassificationArguments

    return (ModelArguments, CurriculumArguments, Stage, ClassificationArguments)


def _own_fields(dc) -> set[str]:
    """A class's fields less TrainingArguments' (documented by transformers, and a flag like any other)."""
    from transformers import TrainingArguments

    return {f.name for f in fields(dc)} - {f.name for f in fields(TrainingArguments)}


@pytest.mark.parametrize("field", sorted({name for dc in _documented_types() for name in _own_fields(dc)}))
def test_every_recipe_field_is_documented(field):
    assert f"`{field}`" in README


COMMANDS = [c for c in readme_commands() if c not in NOT_RUN_HERE]
# Longer than the default suite allows (the chat demo and what reads its output, the full bench): run with -m slow
# (`make test-all`), in README order.
SLOW = {"make train CONFIG=recipes/configs/smollm2_chat.yaml"}
SLOW |= {c for c in COMMANDS if "runs/smollm2_chat/" in c}
# The full default bench (~12 min here), also run with its targets checked by tests/test_bench.py's slow
# test_make_bench_default; the default suite runs the quick bench through the same code (tests/test_bench.py).
SLOW |= {"make bench"}


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
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


@pytest.mark.parametrize("cmd", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW else c for c in COMMANDS])
def test_readme_command_runs(cmd, checkout):
    if "zero3_nvme" in cmd and "--dry-run" not in cmd and (reason := libaio_missing_reason()):
        pytest.skip(reason)
    # As a user types it: not inside `make test`'s make (a nested make prints "Leaving directory" after the run).
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}
    env["PATH"] = f"{checkout / '.venv' / 'bin'}:{os.environ['PATH']}"
    proc = subprocess.run(cmd, shell=True, cwd=checkout, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, f"{cmd}\n{(proc.stdout + proc.stderr)[-3000:]}"
    assert "Traceback" not in proc.stderr
    CHECKS.get(cmd, lambda p, where: None)(proc, checkout)


def _check_make_train(proc, where):
    s = json.loads((where / "runs" / "smollm2_shakespeare" / "summary.json").read_text())
    assert s["profile"] == "cpu" and s["world_size"] == 2 and s["use_peft"]
    assert s["eval_loss_after"] < s["eval_loss_before"]
    assert "[hf_zero] profile cpu: no GPU found" in proc.stdout
    assert (where / "runs" / "smollm2_shakespeare" / "final" / "adapter_model.safetensors").is_file()
    last = proc.stdout.strip().splitlines()[-1]  # the result, as the last line
    assert last.startswith(f"[hf_zero] done: eval loss {s['eval_loss_before']:.4f} -> {s['eval_loss_after']:.4f}")


def _check_dry_run(proc, where):
    line = proc.stdout.strip().splitlines()[-1]
    assert "h100x8.yaml" in line and "--mixed_precision bf16" in line and "HF_ZERO_PROFILE=" in line


def _check_estimate_recipe(proc, where):
    """The recipe's longest stage sets the length; the recommendation is a profile and a command that runs."""
    assert "micro-batch 2 x 192 tokens (stage sonnets" in proc.stdout
    assert "recommended: profile single_gpu" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1].strip() == \
        "hf-zero train --profile single_gpu --nproc 1 --config recipes/configs/smollm2_shakespeare.yaml"


def _check_estimate_lora_8b(proc, where):
    """Issue 24: Llama-3.1-8B LoRA on one 24 GiB GPU fits single_gpu once its frozen base is held in bf16."""
    ddp = next(line for line in proc.stdout.splitlines() if line.startswith("ddp "))
    assert ddp.split()[-7:-4] == ["18.50", "GiB", "backward"], ddp  # peak/GPU, as the README's table says
    assert "recommended: profile single_gpu" in proc.stdout


def _check_test_gpu(proc, where):
    from hf_zero.core.profiles import gpu_count

    if gpu_count() == 0:  # every GPU test skipped, with the reason, and nothing counted as passed
        assert "no CUDA GPU on this machine" in proc.stdout and " passed" not in proc.stdout, proc.stdout[-2000:]


def _check_chat_demo(proc, where):
    s = json.loads((where / "runs" / "smollm2_chat" / "summary.json").read_text())
    assert (s["profile"], s["world_size"], s["use_peft"]) == ("cpu", 2, True)
    assert s["exact_match_after"] >= s["exact_match_before"] + 0.3 and s["eval_loss_after"] < s["eval_loss_before"]
    assert (where / "runs" / "smollm2_chat" / "final" / "chat_template.jinja").is_file()


def _answer(proc) -> str:
    return proc.stdout.strip().splitlines()[-1]


def _check_generate(proc, where):
    from hf_zero.data.assets import WHICH_PLAY_TITLES

    if "--adapter runs/smollm2_chat/final" in proc.args:  # trained: a title, as asked
        assert _answer(proc) in WHICH_PLAY_TITLES.values(), _answer(proc)
    else:  # as shipped: a sentence about the passage
        assert len(_answer(proc).split()) > 5, _answer(proc)


def _check_export_run(proc, where):
    assert "[hf_zero] exporting runs/tiny_ckpt/final: the finished run's model" in proc.stdout
    assert (where / "runs" / "tiny_final_hf" / "model.safetensors").is_file()


def _check_profile_switch(proc, where):
    assert "checkpoint-10: zero3 on 2 ranks -> fsdp2 on 1 rank; converting once (kept inside the checkpoint)" \
        in proc.stdout
    assert json.loads((where / "runs" / "tiny_switch" / "summary.json").read_text())["world_size"] == 1


def _check_help_recipe(proc, where):
    assert "  --max_seq_length (default: 128)" in proc.stdout and "TrainingArguments field" in proc.stdout


CHECKS = {
    "make train": _check_make_train,
    "make test-gpu": _check_test_gpu,
    "make train CONFIG=recipes/configs/smollm2_chat.yaml": _check_chat_demo,
    **{c: _check_generate for c in readme_commands() if c.startswith("hf-zero generate")},
    "hf-zero train --profile h100x8 --precision bf16 --config recipes/configs/smollm2_shakespeare.yaml --dry-run":
        _check_dry_run,
    "hf-zero estimate --config recipes/configs/smollm2_shakespeare.yaml --gpus-per-node 1 --gpu-memory 24GiB":
        _check_estimate_recipe,
    "hf-zero estimate --model benchmarks/models/llama-3.1-8b --use-peft --gradient-checkpointing --seq-len 2048 "
    "--gpus-per-node 1 --gpu-memory 24GiB": _check_estimate_lora_8b,
    "hf-zero export runs/tiny_ckpt --out runs/tiny_final_hf --overwrite": _check_export_run,
    "hf-zero train --help-recipe": _check_help_recipe,
    "accelerate launch --config_file accelerate_configs/fsdp2.yaml --num_processes 1 recipes/curriculum.py --config "
    "recipes/configs/tiny_curriculum.yaml --output_dir runs/tiny_switch --global_batch_size 4 --save_strategy steps "
    "--save_steps 5 --resume_from_checkpoint runs/tiny_switch/checkpoint-10": _check_profile_switch,
}


def test_readme_commands_are_all_known():
    """Guard against a README edit that silently drops the main job from the tested commands."""
    assert "make train" in COMMANDS and any(c.startswith("accelerate launch") for c in COMMANDS)
