"""Settings with one owner. The profile owns hardware, ZeRO stage, offload and precision; the recipe owns
hyperparameters and data. Where both could speak, this module decides once, before any engine starts, and a real
disagreement is an error that names both places."""

from __future__ import annotations

import os
from dataclasses import dataclass

from hf_zero.core.console import say
from hf_zero.core.errors import UserError
from hf_zero.data.model_names import get_model_config
from hf_zero.plan.deepspeed_config import build_deepspeed_config
from hf_zero.plan.liger import liger_installed, liger_runs
from hf_zero.plan.profiles import Profile
from hf_zero.plan.sequence_parallel import verify_sequence_parallel

__all__ = ["BatchPlan", "plan_batch", "resolve_batch", "check_profile_accumulation", "reconcile_training_kwargs",
           "profile_precision"]


@dataclass(frozen=True)
class BatchPlan:
    micro: int
    accumulation: int
    world: int
    sp: int = 1  # sequence-parallel ranks sharing each micro-batch: world = data-parallel ranks x sp

    @property
    def dp(self) -> int:
        return self.world // self.sp

    @property
    def global_batch(self) -> int:
        # The one place the effective batch is computed: micro batch per rank x accumulation x data-parallel ranks.
        return self.micro * self.accumulation * self.dp

    def line(self) -> str:
        ranks = f"{self.world} ranks" if self.sp == 1 else f"{self.dp} dp ({self.world} ranks = {self.dp} dp x " \
            f"{self.sp} sp)"
        return f"{self.micro} micro x {self.accumulation} accum x {ranks} = {self.global_batch} global"


def plan_batch(micro: int, accumulation: int, world: int, global_batch: int | None, sp: int = 1) -> BatchPlan:
    """Check micro x accumulation x data-parallel ranks = global; with a fixed global batch, derive accumulation
    from them. `sp`: sequence-parallel ranks per micro-batch (they count once)."""
    if micro < 1:
        raise UserError("per_device_train_batch_size", f"must be >= 1, got {micro}")
    if accumulation < 1:
        raise UserError("gradient_accumulation_steps", f"must be >= 1, got {accumulation}")
    if world % sp:
        verify_sequence_parallel(sp, world)  # the one-line refusal
    if global_batch is None:
        return BatchPlan(micro, accumulation, world, sp)
    world = world // sp  # below: data-parallel ranks
    per_step = micro * world
    if global_batch % per_step:
        fits = [m for m in range(1, micro + 1) if global_batch % (m * world) == 0]
        hint = (f"use per_device_train_batch_size {fits[-1]}" if fits
                else f"make it a multiple of {world} (the world size)")
        raise UserError(
            "global_batch_size",
            f"{global_batch} is not divisible by micro batch {micro} x {world} ranks",
            hint,
        )
    return BatchPlan(micro, global_batch // per_step, world * sp, sp)


def resolve_batch(values, world: int, profile: Profile | None = None, *, sp: int | None = None,
                  env=None) -> BatchPlan:
    """The batch every command shows and every rank runs: the recipe's `values` (per_device_train_batch_size,
    gradient_accumulation_steps, global_batch_size; unsaid: 1, 1, none) on `world` ranks under `profile` (its
    sequence-parallel size unless `sp` is given, and its say on accumulation, read from `env` too)."""
    micro, accum = values.get("per_device_train_batch_size"), values.get("gradient_accumulation_steps")
    micro, accum = int(1 if micro is None else micro), int(1 if accum is None else accum)
    if profile is not None:
        check_profile_accumulation(profile, accum, os.environ if env is None else env)
    sp = (profile.sp_size if profile is not None else 1) if sp is None else sp
    return plan_batch(micro, accum, world, values.get("global_batch_size"), sp=sp)


def check_profile_accumulation(profile: Profile, accum: int, env=os.environ) -> None:
    """The recipe owns gradient accumulation; a DeepSpeed profile that sets another value is a disagreement. The
    profile's YAML says it, or (in a plain `accelerate launch`) the environment accelerate built from it."""
    said = (profile.raw.get("deepspeed_config") or {}).get("gradient_accumulation_steps")
    said = env.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS") if said is None else said
    if profile.uses_deepspeed and said not in (None, "", 1, "1") and int(said) != accum:
        raise UserError("gradient_accumulation_steps", f"profile {profile.name} says {said} but the recipe says "
                        f"{accum}", "remove gradient_accumulation_steps from the profile (the recipe owns it)")


def profile_precision(profile: Profile, kwargs: dict) -> dict:
    """The TrainingArguments precision flags of `profile`; a recipe saying bf16/fp16 against it is an error."""
    recipe_bf16, recipe_fp16 = bool(kwargs.get("bf16")), bool(kwargs.get("fp16"))
    wants = profile.mixed_precision
    if (recipe_bf16 and wants != "bf16") or (recipe_fp16 and wants != "fp16"):
        said = "bf16" if recipe_bf16 else "fp16"
        raise UserError(
            "precision",
            f"the recipe says {said}: true but profile {profile.name} says mixed_precision: {wants}",
            "remove bf16/fp16 from the recipe (the profile owns precision) or pick a profile in that precision",
        )
    return {"bf16": wants == "bf16", "fp16": wants == "fp16"}


def reconcile_training_kwargs(
    kwargs: dict, profile: Profile, world: int, has_gpu: bool, global_batch: int | None, model_args=None, env=None
) -> tuple[dict, BatchPlan]:
    """Return TrainingArguments kwargs that agree with the profile, and the checked batch plan. `model_args` (the
    recipe's model and LoRA fields) sizes ZeRO-3's gather settings; `env`: where a plain `accelerate launch` says
    the profile's accumulation (default: this process's environment)."""
    out = dict(kwargs)
    out.update(profile_precision(profile, kwargs))
    if not has_gpu:
        if out["fp16"]:
            raise UserError("precision", f"profile {profile.name} asks for fp16, which needs a GPU",
                            "use PRECISION=bf16 or an fp32 profile on this machine")
        # On CPU the Trainer must be told use_cpu, else bf16 is refused and a non-accelerate launch sees one
        # process; DeepSpeed stays on either way.
        out["use_cpu"] = True
    plan = resolve_batch({**out, "global_batch_size": global_batch}, world, profile, env=env)
    out["gradient_accumulation_steps"] = plan.accumulation
    # The curriculum lays samples out in step order itself: a random sampler would mix stages.
    out["train_sampling_strategy"] = "sequential"
    if profile.uses_deepspeed:
        if out.get("deepspeed"):
            raise UserError("deepspeed", "the recipe sets a DeepSpeed config but the profile already owns it",
                            "remove `deepspeed` from the recipe and pick the profile instead")
        shape = _model_shape(model_args) if profile.zero_stage == 3 else {}
        out["deepspeed"] = build_deepspeed_config(profile, on_cpu=not has_gpu, world=world, **shape)
    _liger_kernels(out, has_gpu, model_args)
    if out.get("gradient_checkpointing"):
        # Reentrant checkpointing breaks with LoRA under ZeRO-3 (recomputed gathered shapes differ,
        # transformers#47254) and needs input grads with frozen embeddings; non-reentrant works everywhere.
        out["gradient_checkpointing_kwargs"] = {"use_reentrant": False,
                                                **(out.get("gradient_checkpointing_kwargs") or {})}
    return out, plan


def _model_shape(model_args) -> dict:
    """The model's config and the modules LoRA will adapt (peft's defaults for the model type when not named;
    unknown: any linear), for `zero3_speed_settings`."""
    if model_args is None or not getattr(model_args, "model_name_or_path", None):
        return {}
    config = get_model_config(model_args.model_name_or_path)
    targets = None
    if getattr(model_args, "use_peft", False):
        from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULTS

        targets = model_args.lora_target_modules or DEFAULTS.get(config.model_type) or ["all-linear"]
    return {"model_config": config, "lora_targets": targets}


def _liger_kernels(out: dict, has_gpu: bool, model_args=None) -> None:
    """`use_liger_kernel` (Liger's Triton RMSNorm, SwiGLU and RoPE) runs where it can: `auto` (the default) where
    plan.liger says it runs, silently off elsewhere; `true` on CPU runs without it (one line), on a GPU without
    liger-kernel it is an error. The loss stays hf_zero's (`fused_cross_entropy`, Liger's kernel on CUDA too, but
    called inside the lm_head's own forward where ZeRO-3 has gathered the weight); Liger's own fused loss reads the
    weight outside it and would see an empty partition."""
    if out.get("use_liger_kernel") == "auto":
        name = getattr(model_args, "model_name_or_path", None)
        out["use_liger_kernel"] = bool(has_gpu and name and liger_installed()
                                       and liger_runs("auto", get_model_config(name).model_type))
    if not out.get("use_liger_kernel"):
        out["use_liger_kernel"] = False
        return
    config = dict(out.get("liger_kernel_config") or {})
    for key in ("fused_linear_cross_entropy", "cross_entropy"):
        if config.get(key):
            raise UserError(f"liger_kernel_config.{key}", "hf_zero computes the loss itself (fused_cross_entropy, "
                            "with Liger's kernel on CUDA)", f"remove {key} from liger_kernel_config")
    if not has_gpu:
        out["use_liger_kernel"] = False
        say("[hf_zero] use_liger_kernel: Liger's kernels need a CUDA GPU; running without them here")
        return
    if not liger_installed():
        raise UserError("use_liger_kernel", "liger-kernel is not installed",
                        "pip install liger-kernel (or hf_zero[gpu]), or set use_liger_kernel: false")
    out["liger_kernel_config"] = {**config, "fused_linear_cross_entropy": False, "cross_entropy": False}
