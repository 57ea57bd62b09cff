"""Resuming: pick the newest complete checkpoint, check it against this run BEFORE any engine exists, and make a
checkpoint written with another number of ranks, another ZeRO stage or the other engine loadable (DeepSpeed's
universal checkpoint; FSDP2's distributed checkpoints reshard on load by themselves; between the two,
checkpoint/convert.py), or stop with one line that says what to do.

Same command again -> resume from the latest complete checkpoint, or, when the run already finished (summary.json
is written last), say so and touch nothing; `--fresh_start true` -> start from step 0 (everything the previous run
wrote moves to a new archive: previous-run/, then previous-run-2/, ...; none is ever deleted);
`--resume_from_checkpoint DIR` -> that checkpoint (on a finished run, what it wrote moves to a new archive first: it
is never overwritten, and the checkpoint is followed there). A move a killed run left half done is finished first.
Before any of this, what this run trains is compared with what the checkpoint (or the finished run) trained:
checkpoint/compare.py.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

from hf_zero.checkpoint.archive import archive_checkpoints, next_archive, recover_archive
from hf_zero.checkpoint.compare import (
    check_finished_settings,
    check_resume_reaches,
    check_resume_settings,
    differences,
)
from hf_zero.checkpoint.convert import convert_in_place, convert_to_universal, converted_for, needs_conversion
from hf_zero.checkpoint.fsdp import is_fsdp_checkpoint
from hf_zero.checkpoint.safe_load import check_checkpoint
from hf_zero.checkpoint.store import (
    _TRASH_DIR,
    STAGING_DIR,
    find_resume_checkpoint,
    read_metadata,
    validate_checkpoint,
)
from hf_zero.core.console import rank
from hf_zero.core.errors import RunComplete, UserError, flag_hint

__all__ = ["prepare_resume", "complete_message", "resume_note",
           "profile_switch", "check_profile_switch"]



def resume_note(message: str) -> None:
    """A line every rank prints: what a resume did or could not do."""
    print(f"[hf_zero] {message}", flush=True)


def _ranks(n) -> str:
    return f"{n} rank" if n == 1 else f"{n} ranks"


def _broadcast(value):
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _check_compatible(checkpoint: Path, meta: dict, ctx) -> tuple[bool, str | None]:
    """Raise UserError when this run cannot continue the checkpoint; else (universal, convert): whether DeepSpeed
    loads it as a universal checkpoint (another rank count or ZeRO stage), and the engine format it is converted
    to first ("fsdp2", "deepspeed"; checkpoint/convert.py), if another engine wrote it."""
    prof, plan = ctx.profile, ctx.plan
    name = checkpoint.name
    if not meta:
        resume_note(f"warning: {name} has no hf_zero metadata; resuming without compatibility checks")
        return False, None
    written = _format_of(meta.get("engine")
                         or ("deepspeed" if meta.get("zero_stage") else _engine_on_disk(checkpoint)))
    now = _format_of(prof.engine)
    convert = needs_conversion(meta, prof.engine) if written != now else None
    if written != now and convert is None:
        raise UserError("profile", f"{name} was written with profile {meta.get('profile')} ({written} checkpoint) but "
                        f"this run uses {prof.name} ({now}), which cannot read it",
                        f"resume with profile {meta.get('profile')}, or `hf-zero export {checkpoint} --out DIR` and "
                        f"start a new run from DIR with {flag_hint('--fresh_start true')}")
    before, precision = meta.get("precision"), getattr(plan, "precision", None)
    if before and precision and before != precision and "fp16" in (before, precision) \
            and (convert or prof.uses_deepspeed):
        raise UserError("precision", f"{name} was trained in {before} and this run uses {precision}: fp16 keeps "
                        "a loss scale (and, under ZeRO, fp16 weights beside the fp32 masters) the others do not",
                        f"resume with {flag_hint('--' + meta['precision'] + ' true')} (PRECISION="
                        f"{meta['precision']}), or start a new run with {flag_hint('--fresh_start true')}")
    if meta.get("global_batch") != plan.batch.global_batch:
        raise UserError("global_batch_size", f"{name} was trained with a global batch of {meta.get('global_batch')} "
                        f"({meta.get('micro_batch')} micro x {meta.get('grad_accum')} accum x "
                        f"{meta.get('world_size')} ranks) but this run has {plan.batch.line()}, which changes the "
                        "data order and the LR schedule",
                        f"pass {flag_hint('--global_batch_size ' + str(meta.get('global_batch')))} "
                        f"(accumulation adapts to the rank count) or {flag_hint('--fresh_start true')}")
    if not prof.uses_deepspeed:
        # The Trainer's own checkpoints do not depend on the rank count; FSDP2's distributed checkpoints record
        # each tensor's global shape and reshard on load.
        return False, convert
    stage_now = int(prof.zero_stage or 0)
    # Another ZeRO stage lays the optimizer state out differently: its universal checkpoint is what every stage
    # loads, like another rank count; so is a checkpoint `hf-zero convert` wrote.
    universal = (convert is not None or int(meta.get("zero_stage", 0)) != stage_now
                 or meta.get("world_size") != plan.world or (meta.get("converted") or {}).get("layout") == "universal")
    return universal, convert


def profile_switch(checkpoint: Path, meta: dict, profile, world: int, convert: str | None) -> str | None:
    """What changes when the checkpoint resumes under another engine or ZeRO stage (None: neither changes), e.g.
    `checkpoint-40: zero3 on 2 ranks -> fsdp2 on 1 rank; converting once (kept inside the checkpoint)`."""
    stage_change = profile.uses_deepspeed and int(meta.get("zero_stage", 0)) != int(profile.zero_stage or 0)
    if not meta or not (convert or stage_change):
        return None
    done = converted_for(checkpoint, convert or "deepspeed", checksums=False)  # the resume checks them all
    return (f"{checkpoint.name}: {meta.get('profile')} on {_ranks(meta.get('world_size'))} -> {profile.name} on "
            f"{_ranks(world)}; " + ("converted before (kept inside the checkpoint)" if done else
                                    "converting once (kept inside the checkpoint)"))


def check_profile_switch(checkpoint: Path, profile, world: int, batch, precision: str | None) -> str | None:
    """`hf-zero check`: the resume's own checks and its profile-switch line, before any process starts."""
    from types import SimpleNamespace

    meta = read_metadata(checkpoint)
    if not meta:  # nothing to compare (the ranks say so in a warning)
        return None
    plan = SimpleNamespace(batch=batch, world=world, precision=precision)
    _, convert = _check_compatible(checkpoint, meta, SimpleNamespace(profile=profile, plan=plan))
    return profile_switch(checkpoint, meta, profile, world, convert)


def _engine_on_disk(checkpoint: Path) -> str:
    if is_fsdp_checkpoint(checkpoint):
        return "fsdp2"
    return "deepspeed" if (checkpoint / "latest").is_file() else "ddp"


def _format_of(engine: str) -> str:
    """Which checkpoint layout an engine writes: DeepSpeed shards, FSDP distributed checkpoints, or plain files
    (DDP and one process write the same)."""
    if engine == "deepspeed":
        return "DeepSpeed ZeRO"
    return engine.upper() if engine.startswith("fsdp") else "plain Trainer"



def _choose(ctx, fresh_start: bool) -> dict:
    """Rank 0's decision: {"resume": path or None, "universal": bool}, or {"complete": what to say}."""
    out = Path(ctx.training_args.output_dir)
    # A move to an archive that a killed run left half done is finished before anything here is read.
    recovered = recover_archive(out)
    if recovered is not None:
        resume_note(f"finished moving what the previous run wrote to {recovered} (the move was interrupted)")
    if fresh_start:
        archive = archive_checkpoints(out)
        if archive is not None:
            resume_note(f"fresh start: what the previous run wrote moved to {archive}")
        return {"resume": None, "universal": False}
    settings = getattr(ctx, "settings", None)  # what this run trains (checkpoint/compare.py)
    finished = (out / "summary.json").is_file()
    if finished and not ctx.training_args.resume_from_checkpoint:
        if settings is not None:
            check_finished_settings(out, _read_json(out / "summary.json").get("settings"), settings)
        return {"complete": complete_message(out)}
    for leftover in (out / STAGING_DIR, out / _TRASH_DIR):
        if leftover.is_symlink():  # hf_zero writes checkpoints through these names: never into a folder elsewhere
            leftover.unlink()
        elif leftover.is_dir():
            if any(leftover.iterdir()):
                resume_note(f"removing {leftover.name}/ left by an interrupted save")
            shutil.rmtree(leftover, ignore_errors=True)
    asked = ctx.training_args.resume_from_checkpoint
    if asked:
        checkpoint = Path(asked)
        if recovered is not None:  # asked by the command the interrupted move belonged to: it is there now
            checkpoint = _follow(checkpoint, out, recovered)
        if not checkpoint.is_dir():
            raise UserError("resume_from_checkpoint", f"{asked} is not a folder", "give a checkpoint-N folder")
        problem = validate_checkpoint(checkpoint) if (checkpoint / "hf_zero_manifest.json").is_file() else None
        if problem:
            raise UserError("resume_from_checkpoint", f"{checkpoint.name} is damaged: {problem}",
                            "pick an earlier checkpoint, or remove the flag to take the newest complete one")
    else:
        found = find_resume_checkpoint(out)
        if found is None:
            # An earlier life that saved no checkpoint (Ctrl-C, a crash): its TensorBoard events, answers and logs
            # are of a run that does not go on; moved aside as --fresh_start moves them, so that this run's are
            # its own (not two TensorBoard runs and two "start" rows in samples.jsonl). Issue 41, item 10.
            archive = archive_checkpoints(out, checkpoints=False)
            if archive is not None:
                resume_note(f"no checkpoint to resume from: the earlier run's logs moved to {archive}")
            return {"resume": None, "universal": False}
        checkpoint = Path(found)
    # A manifest proves the files are the ones written, not who wrote them: every pickle is loaded under the safe
    # loader here, on rank 0, before any rank's engine reads one.
    check_checkpoint(checkpoint)
    meta = read_metadata(checkpoint)
    universal, convert = _check_compatible(checkpoint, meta, ctx)
    changed = []
    if settings is not None:
        changed = check_resume_settings(checkpoint.name, meta.get("settings"), settings,
                                        getattr(ctx.training_args, "allow_changes", None))
        # (before the finished run moves aside: a refused resume changes nothing)
        check_resume_reaches(checkpoint.name, meta, settings, getattr(ctx.training_args, "max_steps", None))
    if finished:
        # A finished run is never overwritten: its results move aside first, as for --fresh_start.
        archive = archive_checkpoints(out)
        if archive is not None:  # the checkpoint moved with the run it belongs to (an older archive stays put)
            checkpoint = _follow(checkpoint, out, archive)
        resume_note(f"{out} held a finished run: what it wrote moved to {archive}; continuing from its "
                    f"{checkpoint.name}")
    stage = meta.get("stage") or {}
    where = f" (stage '{stage['name']}', {stage['steps_done']}/{stage['steps']} steps done)" if stage else ""
    ranks = (f"; written by {_ranks(meta.get('world_size'))}, converting for {_ranks(ctx.plan.world)}"
             if universal else "")
    if universal and meta.get("converted"):  # `hf-zero convert` wrote the universal checkpoint: loaded as it is
        ranks = f"; converted by `hf-zero convert`, loaded as a universal checkpoint on {_ranks(ctx.plan.world)}"
    if ctx.profile.uses_fsdp and meta.get("world_size") not in (None, ctx.plan.world):
        ranks = f"; written by {_ranks(meta.get('world_size'))}, resharded on load for {_ranks(ctx.plan.world)}"
    switch = profile_switch(checkpoint, meta, ctx.profile, ctx.plan.world, convert)
    if switch:
        ranks = ""
        resume_note(f"{switch}; weights, fp32 masters, Adam moments and steps, LR schedule, data position and RNG "
                    "carry over")
    resume_note(f"resuming from {checkpoint} at step {meta.get('global_step', '?')}{where}{ranks}")
    if changed:
        diff = differences(meta["settings"], settings)
        resume_note(f"applying from step {meta.get('global_step', '?')}: " + "; ".join(diff[k] for k in changed))
    return {"resume": str(checkpoint), "universal": universal, **({"convert": convert} if convert else {})}


def _follow(checkpoint: Path, out: Path, archive: Path) -> Path:
    """Where `checkpoint` is once what it was part of (a checkpoint-N, final/ ...) moved from `out` to `archive`."""
    if checkpoint.exists():
        return checkpoint
    try:
        rel = checkpoint.absolute().relative_to(out.absolute())
    except ValueError:
        try:
            rel = checkpoint.resolve().relative_to(out.resolve())
        except ValueError:
            return checkpoint
    moved = archive / rel
    return moved if moved.exists() else checkpoint


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def complete_message(out: Path) -> str:
    summary = _read_json(out / "summary.json")
    before, after = summary.get("eval_loss_before"), summary.get("eval_loss_after")
    result = (f"eval loss {before:.4f} -> {after:.4f}; "
              if isinstance(before, float) and isinstance(after, float) else "")
    model = summary.get("final_dir") or out / "final"
    return (f"{out} holds a finished run ({result}model in {model}, summary in {out / 'summary.json'}); nothing was "
            f"changed. To train again: {flag_hint('--fresh_start true')} (this run moves to "
            f"{next_archive(out)}) or another --output_dir")


def prepare_resume(ctx, fresh_start: bool = False) -> str | None:
    """The checkpoint this run resumes from (None: start fresh), decided on rank 0 and shared with every rank.
    Call after setup_run and before the Trainer is built: a rank-count or ZeRO-stage change converts the checkpoint
    and tells DeepSpeed to load it as universal (for this first resume only; later checkpoints are normal ones); an
    engine change converts it first (checkpoint/convert.py)."""
    import torch.distributed as dist

    decision = None
    if rank() == 0:
        try:
            decision = _choose(ctx, fresh_start)
            if decision.get("convert"):
                convert_in_place(Path(decision["resume"]), decision["convert"], convert_to_universal)
            elif decision.get("universal") and (Path(decision["resume"]) / "latest").is_file():
                # (`hf-zero convert` writes the universal checkpoint alone: nothing to convert)
                convert_to_universal(Path(decision["resume"]))
        except UserError as err:
            decision = {"error": (err.field, err.problem, err.fix)}
    decision = _broadcast(decision)
    if "error" in decision:
        raise UserError(*decision["error"])
    if "complete" in decision:
        raise RunComplete(decision["complete"])
    if decision["universal"]:
        # Part of the DeepSpeed config the TrainingArguments are built from (not set on the config they derived):
        # the final build (train/recipe_steps.py) starts from these values.
        args = ctx.training_args
        ctx.training_args = dataclasses.replace(
            args, deepspeed={**args.deepspeed, "checkpoint": {"load_universal": True}})
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    return decision["resume"]
