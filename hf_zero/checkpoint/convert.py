"""Carry a checkpoint to another engine: any ZeRO stage <-> FSDP2, through the two formats that already reshard.

DeepSpeed's universal checkpoint (`ds_to_universal`: one folder per parameter, `zero/<name>/{fp32,exp_avg,
exp_avg_sq,step}.pt`, plus `zero/optimizer_state.pt` and the engine's `*model_states.pt`) is what every ZeRO stage
loads on any rank count; torch's distributed checkpoint (`pytorch_model_fsdp_0/`, `optimizer_0/`: the model's and
the optimizer's state dicts keyed by parameter name) is what FSDP2 reshards. Both hold, per parameter, the fp32
weight and both Adam moments, and per group the hyper-parameters; conversion maps one onto the other a parameter at
a time (a distributed checkpoint is written by a planner that reads each tensor from its universal file only when
it is written, and read back one key at a time), so no step holds the model. Everything else in a checkpoint
(scheduler.pt, trainer_state.json, rng_state*.pth, hf_zero_checkpoint.json) is the Trainer's and engine-free, but
for one list: the scheduler keeps a base LR per optimizer group, and DeepSpeed drops an empty group FSDP2 keeps
(train/trainer.py sizes it to the optimizer on resume).

Measured on DeepSpeed 0.19.8 / torch 2.13: a universal checkpoint written from ZeRO-1/2 does not load under ZeRO-3
as it is (ZeRO-3 looks for `zero_pp_rank_0_mp_rank_00_model_states.pt` and takes the Adam step from
`optimizer_state.pt`'s `optimizer_state_dict`), and one written from ZeRO-3 lacks the per-parameter `step.pt` that
ZeRO-1/2 read (without it Adam restarts its bias correction). `complete_universal` adds what each stage reads, so
one universal folder serves every stage.

The conversion is kept inside the checkpoint, where each engine looks (`global_stepN_universal/` + `latest_universal`
for DeepSpeed, `pytorch_model_fsdp_0/` + `optimizer_0/` for FSDP2), written under temporary names first and
recorded in the checkpoint's manifest when complete (checkpoint/converted.py): a second resume finds it and does not
convert again; an interrupted, altered or damaged one is redone. Every folder name read from a file (`latest`,
`latest_universal`, the metadata's step) must stay inside the checkpoint (checkpoint/paths.py).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

from hf_zero.checkpoint.converted import conversion_problem, record_conversion
from hf_zero.checkpoint.dcp import FSDP_OPTIM_DIR, dcp_to_universal, universal_to_dcp
from hf_zero.checkpoint.fsdp import FSDP_MODEL_DIR
from hf_zero.checkpoint.paths import read_tag
from hf_zero.checkpoint.safe_load import check_checkpoint, safe_checkpoint_loading
from hf_zero.checkpoint.store import (
    METADATA_NAME,
    checkpoint_step,
    clear_partial_mark,
    crc32_of,
    file_sizes,
    mark_partial,
    read_metadata,
    remove_marked_partial,
    validate_checkpoint,
    write_json_atomic,
    write_manifest,
)
from hf_zero.checkpoint.universal import complete_universal
from hf_zero.core.child import dies_with_parent
from hf_zero.core.disk import disk_error
from hf_zero.core.errors import UserError
from hf_zero.plan.profiles import load_profile

__all__ = ["UNIVERSAL_SUFFIX", "convert_to_universal", "engine_of", "needs_conversion", "converted_for",
           "convert_in_place", "convert_checkpoint"]

UNIVERSAL_SUFFIX = "_universal"
_REFUSED = "hf-zero: error: checkpoint: "
# In --out while `hf-zero convert` writes there: names its partial folder, which the next convert removes.

# The files of a checkpoint no engine owns: carried as they are by `hf-zero convert`.
_ENGINE_FREE = ("trainer_state.json", "scheduler.pt", "rng_state*.pth", "training_args.bin", "config.json",
                "generation_config.json", "tokenizer*", "special_tokens_map.json", "chat_template*",
                "adapter_config.json", "*.safetensors", "README.md")


def engine_of(meta: dict) -> str:
    """"deepspeed" or "fsdp2" (the two formats that convert), or what else wrote the checkpoint."""
    engine = meta.get("engine") or ("deepspeed" if meta.get("zero_stage") else "")
    return "fsdp2" if engine.startswith("fsdp") else engine


def needs_conversion(meta: dict, target_engine: str) -> str | None:
    """The engine format the checkpoint must be converted to before `target` can load it, or None. A ZeRO stage
    change within DeepSpeed goes through the universal checkpoint like a rank change does (resume.py)."""
    source = engine_of(meta)
    target = "fsdp2" if target_engine.startswith("fsdp") else target_engine
    if source == target or source not in ("deepspeed", "fsdp2") or target not in ("deepspeed", "fsdp2"):
        return None
    return target


def converted_for(checkpoint: Path, target: str, checksums: bool = True) -> bool:
    """Whether a complete conversion for `target` ("deepspeed" or "fsdp2") is kept inside the checkpoint, each of
    its files as recorded in the manifest (`checksums` False: by size only, for a message)."""
    return conversion_problem(checkpoint, target, checksums) is None


def _say_redo(checkpoint: Path, target: str) -> None:
    problem = conversion_problem(checkpoint, target)
    if problem not in (None, "not converted"):
        print(f"[hf_zero] {checkpoint.name}: its conversion for {target} is not the one recorded ({problem}); "
              "converting again", flush=True)


def convert_in_place(checkpoint: Path, target: str, to_universal) -> None:
    """Convert the checkpoint for `target` inside itself (a no-op when done before). `to_universal` is resume.py's
    convert_to_universal (DeepSpeed's own converter), passed in: resume.py imports this module. A full or read-only
    disk is the one `disk:` line (the half-written conversion is redone next time)."""
    checkpoint = Path(checkpoint)
    if converted_for(checkpoint, target):
        return
    _say_redo(checkpoint, target)
    meta = read_metadata(checkpoint)
    try:
        with safe_checkpoint_loading():
            if target == "fsdp2":
                _replace_dcp(checkpoint, to_universal(checkpoint))
            else:
                _write_universal(checkpoint, checkpoint, meta)
        record_conversion(checkpoint, target)
    except BaseException as err:  # torch's distributed checkpoint raises a BaseException holding the cause
        failed = None if isinstance(err, (UserError, KeyboardInterrupt, SystemExit, GeneratorExit)) else disk_error(
            err, checkpoint, where=f"the conversion for {target} into {checkpoint}",
            after=", then run the same command again")
        if failed is not None:
            raise failed from None
        raise


def _replace_dcp(checkpoint: Path, universal: Path) -> None:
    tmp = checkpoint / ".converting_fsdp2"
    shutil.rmtree(tmp, ignore_errors=True)
    universal_to_dcp(universal, tmp, checkpoint)
    for name in (FSDP_OPTIM_DIR, FSDP_MODEL_DIR):  # the model folder last: its .complete marks the conversion done
        shutil.rmtree(checkpoint / name, ignore_errors=True)
        os.rename(tmp / name, checkpoint / name)
    tmp.rmdir()


def _write_universal(source: Path, dest: Path, meta: dict) -> Path:
    """dest/global_stepN_universal from source's distributed checkpoint, `latest_universal` naming it."""
    step = meta.get("global_step", checkpoint_step(source) or 0)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:  # a folder name is built from it
        raise UserError("checkpoint", f"{source / METADATA_NAME} gives global_step {step!r}, not a step number",
                        "use a checkpoint from a run you trust")
    final = dest / f"global_step{step}_universal"
    tmp = dest / f"global_step{step}_universal.partial"
    for stale in (tmp, final):
        shutil.rmtree(stale, ignore_errors=True)
    dcp_to_universal(source, tmp, step=step, world=meta.get("world_size", 1),
                     global_batch=meta.get("global_batch", 0))
    (tmp / ".complete").write_text("ok\n")
    os.rename(tmp, final)
    (dest / "latest_universal").write_text(final.name)
    return final


def _universal_outside(source: Path, work: Path) -> Path:
    """DeepSpeed's universal conversion of `source`, written under `work`: the source checkpoint is only read (a
    view of it, its `latest` and tag folder linked, is what resume.py's converter writes into)."""
    if not (source / "latest").is_file() and converted_for(source, "deepspeed"):  # `hf-zero convert` wrote it
        tag = read_tag(source, "latest_universal")
        shutil.copytree(source / tag, work / ".source" / tag)
        return work / ".source" / tag
    view = work / ".source"
    view.mkdir()
    tag = _tag(source)
    for name in ("latest", tag):
        (view / name).symlink_to((source / name).resolve())
    return convert_to_universal(view)


def convert_checkpoint(checkpoint, profile_name: str, out, nproc: int | None = None) -> Path:
    """out/checkpoint-N: the checkpoint in the layout `profile_name` loads on `nproc` ranks without converting
    again (a universal checkpoint for ZeRO, distributed checkpoints for FSDP2), the engine-free files copied."""
    source = Path(checkpoint)
    if not source.is_dir() or not (source / METADATA_NAME).is_file():
        raise UserError("CHECKPOINT", f"{checkpoint} is not an hf_zero checkpoint-N folder",
                        "give a checkpoint-N folder of a run")
    if (problem := validate_checkpoint(source)) is not None:
        raise UserError("CHECKPOINT", f"{source.name} is damaged: {problem}", "convert an earlier checkpoint")
    profile = load_profile(profile_name)
    meta = read_metadata(source)
    written = engine_of(meta)
    if written not in ("deepspeed", "fsdp2"):
        raise UserError("CHECKPOINT", f"{source.name} was written by {meta.get('profile') or written or 'an unknown'} "
                        "profile; only zero and fsdp2 checkpoints convert", "resume it with the profile that wrote it")
    target = "fsdp2" if profile.uses_fsdp else "deepspeed" if profile.uses_deepspeed else None
    if target is None:
        raise UserError("--to", f"{profile.name} keeps no sharded optimizer state to convert to",
                        "pick a zero or fsdp2 profile")
    if nproc is not None and (isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1):
        raise UserError("--nproc", f"{nproc} is not a number of ranks", "give 1 or more (default: the number "
                        f"that wrote it, {meta.get('world_size') or 1})")
    root = Path(out)
    if root.absolute() == source.absolute() or source.resolve() in (root.resolve(), *root.resolve().parents):
        raise UserError("--out", f"{out} is inside the checkpoint being converted ({source})",
                        "give a folder outside it")
    remove_marked_partial(root)
    if root.exists() and any(root.iterdir()):
        raise UserError("--out", f"{out} is not empty", "give a new folder")
    check_checkpoint(source)
    dest = root / source.name
    tmp = root / f".{source.name}.partial"
    made_root = not root.exists()
    root.mkdir(parents=True, exist_ok=True)
    # The mark first, removed last: a convert killed at any point leaves a partial folder the next one removes.
    mark_partial(root, tmp)
    try:
        tmp.mkdir()
        _write_converted(source, tmp, target, written, meta, profile, nproc or meta.get("world_size") or 1)
        os.rename(tmp, dest)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)  # this command's own (the mark names it)
        clear_partial_mark(root)
        if made_root:
            with contextlib.suppress(OSError):
                root.rmdir()
        failed = disk_error(err, tmp, where=str(out))
        if failed is not None:
            raise failed from None
        raise
    clear_partial_mark(root)
    return dest


def _write_converted(source: Path, tmp: Path, target: str, written: str, meta: dict, profile, world: int) -> None:
    for pattern in _ENGINE_FREE:
        for path in source.glob(pattern):
            if path.is_file():
                shutil.copy2(path, tmp / path.name)
    with safe_checkpoint_loading():
        if target == "fsdp2":
            if written == "fsdp2":
                for name in (FSDP_MODEL_DIR, FSDP_OPTIM_DIR):
                    shutil.copytree(source / name, tmp / name)
                (tmp / FSDP_MODEL_DIR / ".complete").write_text("ok\n")
            else:
                universal_to_dcp(_universal_outside(source, tmp), tmp, source)
        elif written == "fsdp2":
            _write_universal(source, tmp, meta)
        else:
            universal = _universal_outside(source, tmp)
            os.rename(universal, tmp / universal.name)
            (tmp / "latest_universal").write_text(universal.name)
        shutil.rmtree(tmp / ".source", ignore_errors=True)
    new_meta = {**meta, "profile": profile.name, "engine": profile.engine,
                "zero_stage": int(profile.zero_stage or 0) if profile.uses_deepspeed else 0, "world_size": world,
                "converted": {"from": meta.get("profile"), "layout": "universal" if target == "deepspeed" else "dcp"}}
    write_json_atomic(tmp / METADATA_NAME, new_meta)
    write_manifest(tmp, {rel: crc32_of(tmp / rel) for rel in file_sizes(tmp)})

def convert_to_universal(checkpoint: Path) -> Path:
    """DeepSpeed's ds_to_universal into checkpoint/<tag>_universal (where DeepSpeed looks for it), written under a
    temporary name first so an interrupted conversion is redone, never half-used."""
    tag = _tag(checkpoint)
    final = checkpoint / f"{tag}{UNIVERSAL_SUFFIX}"
    if read_tag(checkpoint, "latest_universal") == final.name and converted_for(checkpoint, "deepspeed"):
        complete_universal(final)  # one converted before this could load it under another stage
        return final
    if (checkpoint / "latest_universal").is_file():
        _say_redo(checkpoint, "deepspeed")
    tmp = checkpoint / f"{tag}{UNIVERSAL_SUFFIX}.partial"
    for stale in (tmp, final):
        shutil.rmtree(stale, ignore_errors=True)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                            "MASTER_PORT", "LOCAL_WORLD_SIZE")}
    # --inject_missing_state: ZeRO-1/2 checkpoints lack state the converter wants; harmless for ZeRO-3. The
    # converter loads every shard with weights_only=False: it runs under hf_zero's safe loader.
    cmd = [sys.executable, "-m", "hf_zero.checkpoint.safe_load", "deepspeed.checkpoint.ds_to_universal",
           "--input_folder", str(checkpoint / tag), "--output_folder", str(tmp), "--inject_missing_state",
           "--num_extract_workers", "1", "--num_merge_workers", "1"]
    # The converter dies with this process (a rank or `hf-zero convert`), however it ends: never left writing.
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, preexec_fn=dies_with_parent())
    if proc.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        last = ([ln for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()] or ["no output"])[-1]
        if last.startswith(_REFUSED):  # the safe loader's one line: passed on as it is
            field, rest = last[len("hf-zero: error: "):].split(": ", 1)
            raise UserError(field, *rest.split("; ", 1))
        # A full or read-only disk, in the converter's words or by the disk's own state: not a rank-count problem.
        failed = disk_error(RuntimeError((proc.stderr or "") + (proc.stdout or "")), tmp, writing=True,
                            where=f"{tmp.name} into {checkpoint}")
        if failed is not None:
            raise failed
        raise UserError("resume", f"DeepSpeed could not convert {checkpoint.name} for another number of ranks "
                        f"({last.strip()[:160]})", "resume with the number of processes that wrote it, or "
                        f"`hf-zero export {checkpoint} --out DIR` and start a new run from DIR")
    complete_universal(tmp)
    (tmp / ".complete").write_text("ok\n")
    os.rename(tmp, final)
    (checkpoint / "latest_universal").write_text(final.name)
    record_conversion(checkpoint, "deepspeed")
    return final


def _tag(checkpoint: Path) -> str:
    tag = read_tag(checkpoint, "latest")
    if tag is None:
        raise UserError("checkpoint", f"{checkpoint} has no `latest` file naming its DeepSpeed step folder",
                        "give a checkpoint-N folder a DeepSpeed run wrote")
    return tag
