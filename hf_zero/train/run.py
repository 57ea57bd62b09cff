"""What every recipe does around its model and data: parse and reconcile arguments once, print the banner, find
the checkpoint to resume from, save and verify the final model, write summary.json."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from hf_zero.checkpoint.compare import run_settings
from hf_zero.core import startup
from hf_zero.core.console import rank, say, verbose
from hf_zero.core.distributed import set_dist_timeout, waiting_for
from hf_zero.core.errors import UserError
from hf_zero.core.files import write_json_atomic
from hf_zero.core.run_lock import hold_in_worker
from hf_zero.data.assets import prepare_assets_in_worker
from hf_zero.integrations.transformers import without_zero3_init
from hf_zero.launch.interrupt import note_run
from hf_zero.launch.launch_command import ensure_launched
from hf_zero.plan.parse import pop_flag
from hf_zero.plan.profiles import Profile, one_rank_note, profile_from_env
from hf_zero.plan.run_plan import PLAN_ENV, RunPlan, plan_in_worker
from hf_zero.plan.sequence_parallel import parallelism_config, verify_recipe_kind
from hf_zero.plan.shipped import check_recipe_matches, load_recipe
from hf_zero.preflight.at_start import check_launch_at_start, check_room_at_start
from hf_zero.train.loss_plot import LOSS_PLOT, plot_losses

__all__ = ["RunContext", "setup_run", "print_banner", "write_summary"]


@dataclass
class RunContext:
    args: tuple  # the parsed dataclasses before the recipe's TrainingArguments subclass (ModelArguments)
    stages: list
    training_args: object  # the recipe's TrainingArguments subclass, built once from its values and the plan
    plan: RunPlan  # profile, precision, ranks, batch: read from here, never re-derived
    started: float = field(default_factory=time.time)
    # What it trains (checkpoint/compare.py): summary.json and, through the Trainer, every checkpoint record it.
    settings: dict = field(default_factory=dict)
    # The checkpoint this run resumes from (recipe_steps.start): its name, step and stage record, which the laid-out
    # schedule must still reach past (checkpoint/compare.py check_resume_fits).
    resumed: dict | None = None

    @property
    def output_dir(self) -> Path:
        return Path(self.training_args.output_dir)

    @property
    def profile(self) -> Profile:
        return self.plan.profile

    @property
    def config_path(self) -> str | None:
        return self.plan.config


def setup_run(dataclass_types: tuple, argv: list[str] | None = None, script: str | None = None) -> RunContext:
    """Parse `--config` + flags, relaunch under a profile given after the script, take the run plan (from the
    launcher, or resolved here), and build TrainingArguments exactly once from the recipe's values and the plan's
    decisions (which also arms zero.Init for ZeRO-3 model construction)."""
    import warnings

    # torch 2.13 warns on every collective DeepSpeed issues through the old names; thousands of identical lines
    # would bury the banner and the stage logs.
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    startup.phase("reading the recipe and the run plan" if os.environ.get(PLAN_ENV) else
                  "reading the recipe and resolving the run plan")
    argv = ensure_launched(list(sys.argv[1:] if argv is None else argv), script or sys.argv[0])
    check_recipe_matches(pop_flag(list(argv), "--config")[0], script or sys.argv[0])
    # The run plan (the launcher's run_plan.json, or resolved here under a plain `accelerate launch`): profile,
    # precision, ranks, batch and DeepSpeed dict come from it, never from re-reading the environment.
    parsed, stages, kwargs, plan = plan_in_worker(tuple(dataclass_types), argv, script or sys.argv[0])
    startup.phase("checking the output folder and the launch")
    # One run per output folder, before anything is written or moved in it (a refused run changes nothing).
    hold_in_worker(kwargs["output_dir"])
    profile, world, config_path = plan.profile, plan.world, plan.config
    # `hf-zero check`'s cheap checks (launch, devices, profile keys) before any process group exists. The launch is
    # checked against the profile as declared (plain `python` on a 2-process profile is one line), which a plan
    # resolved here no longer shows: it holds the launch that happened.
    declared = profile if os.environ.get(PLAN_ENV) else profile_from_env()
    check_launch_at_start(declared, tuple(parsed), world, config_path)
    note_run(kwargs["output_dir"])  # for the line an interruption prints
    if kwargs.get("disable_tqdm") is None:  # a progress bar only where it can redraw itself: not in a log file
        kwargs["disable_tqdm"] = not sys.stdout.isatty()
    # accelerate refuses a DeepSpeed config next to DeepSpeed fields from its YAML, to stop them being silently
    # dropped. Here nothing is dropped: the config hf_zero built *is* those fields (the run plan's DeepSpeed dict).
    os.environ.pop("ACCELERATE_CONFIG_DS_FIELDS", None)
    if profile.sp_size > 1:  # Ulysses: accelerate's ParallelismConfig, which the Trainer hands its Accelerator
        verify_recipe_kind(profile.sp_size, dataclass_types[-1])
        kwargs["parallelism_config"] = parallelism_config(
            profile.sp_size, next((a.attn_implementation for a in parsed if hasattr(a, "attn_implementation")), None))
    try:
        training_args = dataclass_types[-1](**kwargs)  # the recipe's TrainingArguments subclass
    except ValueError as err:  # TrainingArguments' own checks of combinations: still a mistake in the recipe
        raise UserError("TrainingArguments", str(err).strip().splitlines()[0],
                        "change the recipe YAML or flags it names") from None
    startup.phase("setting up the process group")
    # Touching .device sets up the process group now; zero.Init (model construction under ZeRO-3) reads the
    # world size from it, and would otherwise assume 1 and fail DeepSpeed's batch assertion.
    _ = training_args.device
    set_dist_timeout(training_args.ddp_timeout)  # a stuck rank fails the run in minutes (HF_ZERO_DIST_TIMEOUT)
    if profile.uses_deepspeed:
        import contextlib
        from datetime import timedelta

        import deepspeed

        startup.phase("starting DeepSpeed's communication")
        # With use_cpu the process group comes from accelerate's MULTI_CPU path; DeepSpeed's comm layer must be
        # attached to it too, or zero.Init sees a world of 1. (It prints "... built successfully" per rank.)
        with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sys.stdout if verbose() else sink):
            deepspeed.init_distributed(dist_backend="gloo" if plan.gpus == 0 else None,
                                       timeout=timedelta(seconds=training_args.ddp_timeout))
    model = next((a.model_name_or_path for a in parsed if hasattr(a, "model_name_or_path")), None)
    startup.phase("checking the offline model and data")
    prepare_assets_in_worker(training_args, model, [d for s in stages for d in s.data])
    # NVMe and output room for the model's size, now that its config is in the cache; still before any engine.
    # a model with encoders or a vision tower, counted whole by the recipe's own counter (its COUNT_PARTS): its LLM
    # alone would understate the final folder. Parameters only (no vision tower run on the CPU in every rank), on
    # the meta device, so never under ZeRO-3's zero.Init (armed by now).
    counter = getattr(load_recipe(script or sys.argv[0]), "COUNT_PARTS", None)
    with without_zero3_init():
        parts = counter(config_path, pop_flag(list(argv), "--config")[1], activations=False) \
            if counter and config_path else None
    check_room_at_start(profile, kwargs, tuple(parsed), stages, world, parts=parts)
    startup.phase("loading the tokenizer and the data")
    settings = run_settings(tuple(parsed), stages, kwargs)  # the Trainer's checkpoints record them too
    return RunContext(tuple(parsed), stages, training_args, plan, settings=settings)


def print_banner(ctx: RunContext, trainable: int, total: int, weights: str = "") -> None:
    """Rank 0 prints what will run; every rank contributes its device to the rank -> device map. `weights`: the
    dtypes the weights are held in (hf_zero.train.model.describe_weights)."""
    import torch.distributed as dist

    device = str(ctx.training_args.device)
    devices = [device]
    if dist.is_available() and dist.is_initialized():
        devices = [None] * dist.get_world_size()
        with waiting_for("the other ranks' devices for the banner (they are still building the model or data)"):
            dist.all_gather_object(devices, device)
    p = ctx.profile
    lines = [
        "=" * 72,
        f"hf_zero | profile {p.name} | {p.sharding if p.uses_deepspeed or p.uses_fsdp else p.distributed_type}",
        f"  offload: optimizer={p.offload_optimizer} params={p.offload_param} | precision: {p.precision}",
        *one_rank_note(p, ctx.plan.world),
        f"  world size {ctx.plan.world} | ranks -> devices: {', '.join(f'{i}:{d}' for i, d in enumerate(devices))}",
        f"  batch: {ctx.plan.batch.line()}",
        f"  parameters: {trainable:,} trainable / {total:,} total ({100 * trainable / max(total, 1):.2f}%)"
        + (f" | weights: {weights}" if weights else ""),
        f"  output: {ctx.output_dir}",
        "=" * 72,
    ]
    say("\n".join(lines))


def _write_json(path: Path, data) -> None:
    """Atomically, on rank 0 only: a reader never sees half a file."""
    if rank() != 0:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, data)


def write_summary(ctx: RunContext, extra: dict, log_history: list | None = None) -> Path:
    """summary.json (and log_history.json, every logged step, and loss.png, its curves) on rank 0: what ran, where,
    and how it went."""
    summary = {
        **ctx.plan.record(),
        "nodes": ctx.plan.nodes,
        "run_plan": str(ctx.plan.path),
        "runtime_s": round(time.time() - ctx.started, 2),
        "startup_s": startup.breakdown(),  # seconds per phase, from the command to the first step
        "config": ctx.config_path,
        "settings": ctx.settings,  # what a re-run is compared with (checkpoint/compare.py)
        **extra,
    }
    if log_history is not None:
        _write_json(ctx.output_dir / "log_history.json", log_history)
        if rank() == 0:
            names = [s.get("name") for s in extra.get("stages") or [] if isinstance(s, dict)]
            plot_losses(log_history, ctx.output_dir / LOSS_PLOT, names)
    path = ctx.output_dir / "summary.json"
    _write_json(path, summary)
    return path
