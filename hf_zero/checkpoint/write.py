"""Saving checkpoints that survive crashes: the Trainer writes each checkpoint into a staging folder
(checkpoint/staging.py); once every rank has finished, the LoRA adapter / model file is verified, the metadata and
manifest are written, and the folder is renamed to checkpoint-N (atomic), then older ones are rotated out (the best
one never is). A full disk stops the run with one line and leaves every earlier checkpoint intact."""

from __future__ import annotations

import errno
import os
import shutil
import time
from pathlib import Path

from transformers import TrainerCallback

from hf_zero.checkpoint.final import SavedModelMismatch, make_shareable, verify_saved_weights
from hf_zero.checkpoint.fsdp import save_pretrained_gathered
from hf_zero.checkpoint.store import (
    LATEST_NAME,
    METADATA_NAME,
    crc32_of,
    file_sizes,
    publish_checkpoint,
    rotate_checkpoints,
    size_breakdown,
    write_json_atomic,
    write_manifest,
)
from hf_zero.core.console import say
from hf_zero.core.disk import disk_error
from hf_zero.core.files import human_bytes
from hf_zero.core.progress import MEAN_LOSS
from hf_zero.core.report import report_user_error
from hf_zero.data.model_names import BASE_PATH_ATTR
from hf_zero.estimate.measure import count_parameters
from hf_zero.integrations.transformers import config_name_or_path

__all__ = ["CheckpointCallback", "best_metric_default", "build_checkpoint_metadata", "complete_checkpoint",
           "verify_saved_model", "is_disk_full", "stop_on_full_disk"]


def best_metric_default(args, has_eval: bool) -> dict:
    """The metric that picks the best checkpoint, when the recipe names none: the mean eval loss over the eval sets,
    when the run saves checkpoints and has eval data (lower is better: TrainingArguments derives greater_is_better
    from the name's "loss"). The fields to build the final TrainingArguments with (train/recipe_steps.py)."""
    if args.save_strategy != "no" and has_eval and args.metric_for_best_model is None:
        return {"metric_for_best_model": "eval_loss"}
    return {}


class CheckpointCallback(TrainerCallback):
    """Makes every checkpoint carry the metric that picks the best one (best_metric_default): evaluates at each save
    step."""

    def __init__(self, has_eval: bool):
        self.has_eval = has_eval

    def on_step_end(self, args, state, control, **kwargs):
        if control.should_save and self.has_eval and args.metric_for_best_model:
            control.should_evaluate = True
        return control


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("torch", "transformers", "accelerate", "deepspeed", "peft"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            pass
    return out


def build_checkpoint_metadata(trainer) -> dict:
    """What a resume (or a person) needs to know about the checkpoint being written at trainer.state.global_step.
    How the run is laid out (profile, precision, ranks, batch) is copied from its run plan, what it trains from the
    settings the Trainer was built with (train/run.py's RunContext.settings)."""
    state, args = trainer.state, trainer.args
    step = state.global_step
    metrics = {}
    for entry in state.log_history:
        if entry.get("step") == step:
            metrics.update({k: v for k, v in entry.items() if isinstance(v, (int, float)) and k != "step"})
    stage_losses = [v for k, v in metrics.items()
                    if k.startswith("eval_") and k.endswith("_loss") and k not in ("eval_loss", MEAN_LOSS)]
    if stage_losses and "eval_loss" not in metrics:
        metrics["eval_loss"] = sum(stage_losses) / len(stage_losses)  # same mean as CurriculumTrainer.evaluate
    plan = trainer.plan  # the run plan the Trainer was built with
    meta = {
        "format": 1,
        "global_step": step,
        "max_steps": state.max_steps,
        "epoch": state.epoch,
        "metrics": metrics,
        **plan.record(),
        "nodes": plan.nodes,
        "peft": hasattr(trainer.model, "peft_config"),
        # The adapter names its base model by hub id (hf_zero.train.model.apply_lora); this is where it resolved here.
        "base_model_path": getattr(trainer.model, BASE_PATH_ATTR, None) or config_name_or_path(
            getattr(trainer.model, "config", None)),
        "trainable_params": count_parameters(trainer.model)[0],
        "seed": args.seed,
        "settings": trainer.settings,  # what a resume is compared with (checkpoint/compare.py)
        "versions": _versions(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    schedule = getattr(trainer, "schedule", None)
    if schedule is not None and step > 0:
        span = schedule.stage_at(step - 1)  # the stage of the last step taken
        meta["stage"] = {"index": span.index, "name": span.name, "steps_done": step - span.start_step,
                         "steps": span.steps}
    return meta


def is_disk_full(err: BaseException, path) -> bool:
    """A checkpoint save that failed for the disk's sake (full, read-only, failing), as any engine reports it
    (hf_zero.core.disk: torch's zip writer only says "unexpected pos ...", FSDP2's distributed checkpoint wraps
    every rank's error in a BaseException)."""
    return disk_error(err, path, writing=True) is not None


def stop_on_full_disk(run_dir: Path, staged: Path, err: BaseException | None = None) -> None:
    """The one `disk:` line, naming the checkpoint being written and the newest complete one, then a hard exit."""
    latest = (run_dir / LATEST_NAME).read_text().strip() if (run_dir / LATEST_NAME).is_file() else None
    kept = (f"{latest} and the checkpoints before it are complete; run the same command to resume" if latest
            else "no earlier checkpoint was written")
    line = disk_error(err if err is not None else OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), staged,
                      writing=True, after=f"; {kept}", where=f"{staged.name} into {run_dir}")
    shutil.rmtree(staged, ignore_errors=True)
    report_user_error(line)
    # A hard exit: the other ranks may be blocked in a collective of the same save; the launcher stops them
    # when this process is gone, while a normal interpreter exit could wait for them forever.
    os._exit(2)


def complete_checkpoint(trainer, staged: Path, run_dir: Path, started: float) -> None:
    """After the Trainer wrote `staged` (checkpoint/staging.py): what FSDP2 leaves out, the saved weights read back,
    then metadata, manifest, the rename into place and rotation."""
    if trainer.is_fsdp_enabled:
        # The Trainer writes only the distributed checkpoint; config and tokenizer make it exportable, and
        # a LoRA adapter (small) is gathered so the checkpoint loads with peft as under ZeRO.
        save_pretrained_gathered(trainer, staged, weights=False)
    verify_saved_model(trainer, staged)
    trainer.accelerator.wait_for_everyone()  # every rank has written its shards
    _publish(trainer, staged, run_dir, started)


def verify_saved_model(trainer, staged: Path) -> None:
    """A LoRA adapter is read back and compared with the gathered weights (collective under ZeRO-3/FSDP2); any
    saved safetensors file must hold no empty placeholder tensor (what ZeRO-3 leaves when weights are not gathered)."""
    wrapped = trainer.model_wrapped
    model = trainer.accelerator.unwrap_model(wrapped) if wrapped is not None else trainer.model
    if hasattr(model, "peft_config"):
        verify_saved_weights(model, staged)
    elif trainer.is_world_process_zero():
        from safetensors import safe_open

        for path in staged.glob("*.safetensors"):
            with safe_open(str(path), "pt") as f:
                empty = [k for k in f.keys() if 0 in f.get_slice(k).get_shape()]
            if empty:
                raise SavedModelMismatch(f"{path}: empty tensors (e.g. {empty[0]}): weights were not gathered")


def _publish(trainer, staged: Path, run_dir: Path, started: float) -> None:
    import torch.distributed as dist

    if trainer.is_world_process_zero():
        if str(trainer.state.best_model_checkpoint or "").startswith(str(staged.parent)):
            # The Trainer recorded the staging path as best: point it where the folder is about to live.
            trainer.state.best_model_checkpoint = str(run_dir / staged.name)
            trainer.state.save_to_json(str(staged / "trainer_state.json"))
        make_shareable(staged)  # before the manifest: permissions change no size or checksum anyway
        meta = build_checkpoint_metadata(trainer)
        meta["bytes"] = size_breakdown(file_sizes(staged))
        meta["save_seconds"] = round(time.time() - started, 3)
        write_json_atomic(staged / METADATA_NAME, meta)
    trainer.accelerator.wait_for_everyone()
    # Checksums are shared out over the ranks (each also fsyncs its files), then gathered on rank 0.
    rels = sorted(file_sizes(staged))
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    mine = {rel: crc32_of(staged / rel, fsync=True) for rel in rels[rank::world] if (staged / rel).is_file()}
    parts = [None] * world
    if world > 1:
        dist.all_gather_object(parts, mine)
    else:
        parts = [mine]
    best = [None]
    if trainer.is_world_process_zero():
        checksums = {k: v for part in parts for k, v in part.items()}
        for rel in rels:  # a file another node could not see (no shared filesystem) is checked here
            checksums.setdefault(rel, crc32_of(staged / rel, fsync=True))
        manifest = write_manifest(staged, checksums)
        final = publish_checkpoint(staged, run_dir)
        kept_best = rotate_checkpoints(run_dir, trainer.args.save_total_limit, trainer.args.metric_for_best_model,
                                       bool(trainer.args.greater_is_better), log=say)
        best = [str(kept_best) if kept_best is not None else None]
        kinds = size_breakdown({k: v["bytes"] for k, v in manifest["files"].items()})
        say(f"[hf_zero] {final.name}: {human_bytes(manifest['total_bytes'])} (weights "
            f"{human_bytes(kinds['weights'])}, optimizer {human_bytes(kinds['optimizer'])}, other "
            f"{human_bytes(kinds['other'])}), complete in {time.time() - started:.1f} s")
    if world > 1:
        dist.broadcast_object_list(best, src=0)  # every rank agrees on the best (load_best_model_at_end)
    if best[0] is not None:
        trainer.state.best_model_checkpoint = best[0]
