"""A run's offline assets, built before any rank needs them (`python -m hf_zero.data.assets --model NAME --data
SPEC`, which `hf-zero train` runs for you): its model (SmolLM2-135M-Instruct in smollm2.py, the offline Llamas in
model_names.py, the tiny VLMs in tiny_vlm.py) and its built-in data (builtin.py), each built once into the cache
(cache.py)."""

from __future__ import annotations

import os
import sys

from hf_zero.core.distributed import stall_if_asked, waiting_for
from hf_zero.core.errors import EXIT_USAGE, UserError
from hf_zero.data.builtin import builtin_folders
from hf_zero.data.cache import entry_problem, model_folder_problem
from hf_zero.data.model_names import get_tiny_llama_path, is_tiny, tiny_llama_folder
from hf_zero.data.smollm2 import SMOLLM2_HUB_ID, get_smollm2_path, smollm2_folder
from hf_zero.data.tiny_vlm import get_tiny_vlm_path, is_tiny_vlm, tiny_vlm_folder

__all__ = ["missing_run_assets", "prepare_run_assets", "prepare_assets_in_worker"]

_DIST_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR",
             "MASTER_PORT", "CROSS_RANK", "CROSS_SIZE")


def _run_assets(model: str | None, data=()) -> dict:
    """name -> (cache folder, getter that builds it on first use, verify) for each asset of the run hf_zero builds."""
    found = {}
    if model and is_tiny(model):
        found[model] = (tiny_llama_folder(model), lambda: get_tiny_llama_path(model), model_folder_problem)
    elif model and is_tiny_vlm(model):
        found[model] = (tiny_vlm_folder(model), lambda: get_tiny_vlm_path(model), model_folder_problem)
    elif model in ("smollm2-135m-instruct", SMOLLM2_HUB_ID):
        found[model] = (smollm2_folder(), get_smollm2_path, model_folder_problem)
    found.update(builtin_folders(data))
    return found


def missing_run_assets(model: str | None, data=()) -> list[str]:
    return [name for name, (final, _, verify) in _run_assets(model, data).items() if entry_problem(final, verify)]


def prepare_run_assets(model: str | None, data=()) -> None:
    """Build (or verify) the run's offline model and data in this process, which must be a plain one: the launcher,
    before any rank starts. Cheap (files checked, torch not imported) when the cache already holds them."""
    for _, get, _ in _run_assets(model, data).values():
        get()


def prepare_assets_in_worker(training_args, model: str | None, data) -> None:
    """Inside a launched rank: what `hf-zero train` has not built already, local rank 0 builds in a clean child
    process (outside this process group and zero.Init) while the other ranks wait at a barrier, then only check."""
    builder = training_args.local_process_index == 0
    stall_if_asked()
    what = "the other ranks at the offline-asset barrier" if builder else "local rank 0 to build the offline assets"
    with waiting_for(what), training_args.main_process_first(local=True, desc="offline assets"):
        _build_missing_in_child(model, data, builder)


def _build_missing_in_child(model: str | None, data, builder: bool) -> None:
    missing = missing_run_assets(model, data)
    if not missing:
        return
    if not builder:
        raise UserError("cache", f"{', '.join(missing)} still not usable after local rank 0 built them",
                        "see rank 0's error above")
    import subprocess

    cmd = [sys.executable, "-m", "hf_zero.data.assets", *(["--model", model] if model else []),
           *[a for d in data for a in ("--data", d)]]
    env = {k: v for k, v in os.environ.items()
           if k not in _DIST_ENV and not k.startswith(("ACCELERATE_", "TORCHELASTIC"))}
    proc = subprocess.run(cmd, env=env, stderr=subprocess.PIPE, text=True)
    code = proc.returncode
    prefix = "hf-zero: error: "
    lines = proc.stderr.splitlines()
    sys.stderr.write("".join(f"{ln}\n" for ln in lines if not ln.startswith(prefix)))
    mistake = next((ln[len(prefix):] for ln in reversed(lines) if ln.startswith(prefix)), None)
    if code == 2 and mistake:  # the child's one line, raised here so this rank reports it like any other
        field, _, problem = mistake.partition(": ")
        raise UserError(field, problem)
    if code:
        raise UserError("cache", f"building {', '.join(missing)} failed (exit code {code})", "see the error above")


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m hf_zero.data.assets",
                                     description="Build a run's offline model and data into the cache "
                                     "(HF_ZERO_CACHE), once, in this one process.")
    parser.add_argument("--model", help="an offline model name, e.g. tiny-llama or smollm2-135m-instruct")
    parser.add_argument("--data", action="append", default=[], help="a data source, e.g. builtin:shakespeare/lines")
    args = parser.parse_args(argv)
    try:
        prepare_run_assets(args.model, args.data)
    except UserError as err:
        print(f"hf-zero: error: {err.line()}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    return 0


if __name__ == "__main__":
    sys.exit(main())
