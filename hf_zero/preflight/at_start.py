"""The cheap checks inside the recipe, before any engine exists: the launch, the profile's keys and the devices
before the process group; the room on disk and in NVMe, the sequence length and the sharding's own rules once the
model's offline assets are in the cache (the model's config is read then). Each raises the first failure as
UserError. They are hf_zero.preflight.check_rules' rules that `hf-zero check` runs before a launch, run again in the
ranks for a run started without it (plain `accelerate launch`); the data, model and batch errors come from the
recipe's own steps, and cpu_adam is built by `make install`, not here."""

from __future__ import annotations

import os

from hf_zero.data.model_names import get_model_config
from hf_zero.plan.fsdp import verify_fsdp
from hf_zero.plan.profiles import gpu_count
from hf_zero.plan.quantization import verify_quantization
from hf_zero.plan.sequence_parallel import verify_recipe_sp
from hf_zero.plan.world import per_machine_from_env
from hf_zero.preflight.check_rules import (
    count_for,
    output_needs,
    verify_devices,
    verify_launch,
    verify_offload,
    verify_output,
    verify_precision,
    verify_profile_keys,
    verify_seq_length,
    verify_weights_reachable,
)

__all__ = ["check_launch_at_start", "check_room_at_start"]


def _nproc(profile, world: int, env: dict) -> int:
    return per_machine_from_env(env, world, profile.num_machines)


def check_launch_at_start(profile, parsed: tuple, world: int, config: str | None = None, env: dict | None = None):
    """Launch, profile keys and devices: before any process group exists."""
    env = dict(os.environ if env is None else env)
    verify_launch(profile, env, config)
    ds_fields = env.get("ACCELERATE_CONFIG_DS_FIELDS")  # the profile's deepspeed_config keys, as accelerate read them
    if (profile.uses_deepspeed or profile.uses_fsdp) and (ds_fields or profile.raw):
        verify_profile_keys(profile, [k for k in ds_fields.split(",") if k] if ds_fields else None)
    gpus = gpu_count()
    verify_devices(profile, _nproc(profile, world, env), gpus)
    verify_precision(profile, profile.mixed_precision, {}, gpus, real_gpus=gpus > 0)
    model = next((a for a in parsed if hasattr(a, "load_in_4bit")), None)
    if model is not None:
        verify_quantization(model, profile, gpus)
    if not any(hasattr(a, "model_name_or_path") for a in parsed):
        verify_offload(profile, None, build_cpu_adam=False)


def check_room_at_start(profile, training_kwargs: dict, parsed: tuple, stages: list, world: int,
                        env: dict | None = None, parts=None) -> None:
    """NVMe and output room for the model's size: after its offline assets are in the cache (it reads its config).
    `parts`: a model with encoders or a vision tower counted whole (hf_zero.estimate.recipe.CountedParts)."""
    model = next((a for a in parsed if hasattr(a, "model_name_or_path")), None)
    config = None
    if profile.uses_fsdp and model is not None:
        config = get_model_config(model.model_name_or_path)
    verify_fsdp(profile, training_kwargs, gpu_count(), config)
    if model is None:
        return
    verify_weights_reachable(model.model_name_or_path)  # a shape-only hub id (plain `accelerate launch`): one line
    verify_seq_length(get_model_config(model.model_name_or_path), training_kwargs.get("max_seq_length"), stages)
    verify_recipe_sp(profile.sp_size, world, model, training_kwargs, stages)
    nproc = _nproc(profile, world, dict(os.environ if env is None else env))
    steps = sum(s.steps or 0 for s in stages)  # epoch-based stages are sized after tokenization: not counted here
    needed, what, est = output_needs(parts.count if parts else count_for(model), profile, nproc, training_kwargs,
                                     steps, parts.final_params if parts else None)
    verify_offload(profile, est["nvme_bytes"], build_cpu_adam=False)
    verify_output(str(training_kwargs.get("output_dir")), needed, what)
