"""Profiles: the accelerate YAMLs in `accelerate_configs/` that own hardware, the sharding engine (DeepSpeed ZeRO
stage or FSDP2), offload and precision.

A profile is found by name (`zero3`, `fsdp2`) or path, validated with accelerate's own config loader, and (for
DeepSpeed) turned into the DeepSpeed config hf_zero hands to the Trainer; FSDP2 is configured by accelerate itself
from the profile's `fsdp_config`. Inside a launched worker the profile is read back from the
environment accelerate sets, so a run started with plain `accelerate launch --config_file X` is understood too.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from .errors import UserError

__all__ = [
    "PROFILES_DIR",
    "Profile",
    "list_profiles",
    "resolve_profile_path",
    "load_profile",
    "profile_from_env",
    "pick_profile",
    "build_deepspeed_config",
    "gpu_count",
]

PROFILES_DIR = Path(__file__).resolve().parent.parent / "accelerate_configs"
# Set by hf_zero's launcher so workers can read fields accelerate does not pass on (NVMe paths, the name).
PROFILE_ENV = "HF_ZERO_PROFILE"
NVME_ENV = "HF_ZERO_NVME_PATH"


@dataclass
class Profile:
    name: str
    distributed_type: str = "NO"
    num_processes: int = 1
    num_machines: int = 1
    mixed_precision: str = "no"
    zero_stage: int | None = None
    offload_optimizer: str = "none"
    offload_param: str = "none"
    nvme_path: str | None = None
    zero3_init: bool = False
    zero3_save_16bit_model: bool = False
    fsdp_version: int | None = None
    reshard_after_forward: bool = True
    fsdp_layer_cls: str | None = None  # None: the model's own `_no_split_modules` (read by accelerate)
    fsdp_wrap: str | None = None  # accelerate's fsdp_auto_wrap_policy
    fsdp_state_dict_type: str | None = None
    fsdp_activation_checkpointing: bool = False
    path: str | None = None
    raw: dict = field(default_factory=dict, repr=False)

    @property
    def uses_deepspeed(self) -> bool:
        return self.distributed_type == "DEEPSPEED"

    @property
    def uses_fsdp(self) -> bool:
        return self.distributed_type == "FSDP"

    @property
    def engine(self) -> str:
        """deepspeed, fsdp2 (fsdp1 for an FSDP1 profile), ddp or single: what checkpoints and summaries record."""
        if self.uses_deepspeed:
            return "deepspeed"
        if self.uses_fsdp:
            return f"fsdp{self.fsdp_version or 1}"
        return "ddp" if self.num_processes > 1 or self.distributed_type.startswith("MULTI") else "single"

    @property
    def sharding(self) -> str:
        """One phrase for the banner and summary.json: what each rank holds."""
        if self.uses_deepspeed:
            return f"DeepSpeed ZeRO-{self.zero_stage}"
        if self.uses_fsdp:
            when = "reshard after forward" if self.reshard_after_forward else "kept gathered until backward"
            layers = f" per {self.fsdp_layer_cls}" if self.fsdp_layer_cls else ""
            return f"FSDP{self.fsdp_version or 1} full shard{layers}, {when}"
        return "none (every rank holds the whole model)" if self.engine == "ddp" else "none"

    @property
    def precision(self) -> str:
        return {"no": "fp32"}.get(self.mixed_precision, self.mixed_precision)


def list_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILES_DIR.glob("*.yaml"))


def resolve_profile_path(name_or_path: str) -> Path:
    """A profile by name (`zero3`) or by path to any accelerate YAML."""
    candidate = Path(name_or_path)
    if candidate.suffix in (".yaml", ".yml") and candidate.is_file():
        return candidate.resolve()
    by_name = PROFILES_DIR / f"{candidate.stem if candidate.suffix else name_or_path}.yaml"
    if by_name.is_file() and (not candidate.suffix or not candidate.parent.parts):
        return by_name
    raise UserError(
        "profile",
        f"no profile named {name_or_path!r}",
        f"use one of: {', '.join(list_profiles())}, or a path to an accelerate YAML",
    )


def load_profile(name_or_path: str) -> Profile:
    path = resolve_profile_path(name_or_path)
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise UserError(f"profile {path.name}", f"is not valid YAML ({str(err).splitlines()[0]})") from None
    _validate_with_accelerate(path)
    ds = raw.get("deepspeed_config") or {}
    fsdp = raw.get("fsdp_config") or {}
    dist = str(raw.get("distributed_type", "NO"))
    nvme = os.environ.get(NVME_ENV) or ds.get("offload_param_nvme_path") or ds.get("offload_optimizer_nvme_path")
    if dist == "FSDP":
        return Profile(name=path.stem, path=str(path), raw=raw, **_fsdp_fields(
            {k if k.startswith("fsdp_") else f"fsdp_{k}": v for k, v in fsdp.items()}, dist,
            int(raw.get("num_processes", 1)), str(raw.get("mixed_precision", "no")).lower()),
            num_machines=int(raw.get("num_machines", 1)))
    return Profile(
        name=path.stem,
        distributed_type=dist,
        num_processes=int(raw.get("num_processes", 1)),
        num_machines=int(raw.get("num_machines", 1)),
        mixed_precision=str(raw.get("mixed_precision", "no")).lower(),
        zero_stage=int(ds.get("zero_stage", 0)) if dist == "DEEPSPEED" else None,
        offload_optimizer=str(ds.get("offload_optimizer_device", "none")).lower(),
        offload_param=str(ds.get("offload_param_device", "none")).lower(),
        nvme_path=str(nvme) if nvme else None,
        zero3_init=bool(ds.get("zero3_init_flag", False)),
        zero3_save_16bit_model=bool(ds.get("zero3_save_16bit_model", False)),
        path=str(path),
        raw=raw,
    )


def _fsdp_fields(cfg: dict, dist: str, world: int, precision: str) -> dict:
    """Profile fields from accelerate's fsdp_* settings (a YAML's fsdp_config or the launcher's FSDP_* variables).
    FSDP2's CPUOffloadPolicy moves the parameter shards, their gradients and the optimizer step to the CPU at once."""
    def flag(key, default):
        return str(cfg.get(key, default)).lower() in ("true", "1")

    offload = "cpu" if flag("fsdp_offload_params", False) else "none"
    layer = cfg.get("fsdp_transformer_layer_cls_to_wrap")
    return dict(distributed_type=dist, num_processes=world, mixed_precision=precision,
                fsdp_version=int(cfg.get("fsdp_version", 1)), offload_optimizer=offload, offload_param=offload,
                reshard_after_forward=flag("fsdp_reshard_after_forward", True),
                fsdp_layer_cls=str(layer) if layer else None,
                fsdp_wrap=str(cfg.get("fsdp_auto_wrap_policy", "NO_WRAP")).upper(),
                fsdp_state_dict_type=str(cfg.get("fsdp_state_dict_type", "SHARDED_STATE_DICT")),
                fsdp_activation_checkpointing=flag("fsdp_activation_checkpointing", False))


def _validate_with_accelerate(path: Path) -> None:
    """accelerate's own loader rejects unknown keys; repeat its verdict as one line before any launch."""
    from accelerate.commands.config.config_args import load_config_from_file

    try:
        load_config_from_file(str(path))
    except (ValueError, TypeError) as err:
        raise UserError(f"profile {path.name}", str(err).splitlines()[0], "fix or remove those keys") from None


def profile_from_env(env: dict | None = None) -> Profile:
    """The profile of the current worker, from what accelerate (and hf_zero's launcher) put in the environment."""
    env = dict(os.environ if env is None else env)
    if env.get(PROFILE_ENV):
        prof = load_profile(env[PROFILE_ENV])
        prof.num_processes = int(env.get("WORLD_SIZE", prof.num_processes))
        prof.mixed_precision = env.get("ACCELERATE_MIXED_PRECISION", prof.mixed_precision).lower()
        return prof
    world = int(env.get("WORLD_SIZE", 1))
    precision = env.get("ACCELERATE_MIXED_PRECISION", "no").lower()
    if env.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        stage = int(env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", 2))
        opt = env.get("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "none").lower()
        par = env.get("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "none").lower()
        name = f"zero{stage}" + ("_offload" if "cpu" in (opt, par) else "_nvme" if "nvme" in (opt, par) else "")
        return Profile(
            name=name, distributed_type="DEEPSPEED", num_processes=world, mixed_precision=precision,
            zero_stage=stage, offload_optimizer=opt, offload_param=par, nvme_path=env.get(NVME_ENV),
            zero3_init=env.get("ACCELERATE_DEEPSPEED_ZERO3_INIT", "true").lower() == "true",
            zero3_save_16bit_model=env.get("ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL", "true").lower() == "true",
        )
    if env.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        fields = _fsdp_fields({f"fsdp_{k[5:].lower()}": v for k, v in env.items() if k.startswith("FSDP_")},
                              "FSDP", world, precision)
        fields["fsdp_layer_cls"] = env.get("FSDP_TRANSFORMER_CLS_TO_WRAP") or None
        name = f"fsdp{fields['fsdp_version']}" + ("_offload" if fields["offload_param"] == "cpu" else "")
        return Profile(name=name, **fields)
    if world > 1:
        return Profile(name="ddp", distributed_type="MULTI_GPU", num_processes=world, mixed_precision=precision)
    return Profile(name="single", mixed_precision=precision)


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pick_profile(gpus: int | None = None, model: str | None = None, gpu_memory_bytes: int | None = None,
                 lora_r: int | None = None) -> tuple[str, str]:
    """The profile for this machine and the reason, as `make train` prints it.

    With several GPUs and a known model, hf_zero's estimator picks the fastest ZeRO stage whose per-rank memory
    fits the device; without one, ZeRO-2 (whole parameters on every rank, no per-layer gathers).
    """
    gpus = gpu_count() if gpus is None else gpus
    if gpus == 0:
        return "cpu", "no GPU found: DeepSpeed on the CPU accelerator, 2 ranks, ZeRO-2 (the fastest stage on CPU)"
    if gpus == 1:
        return "single_gpu", "1 GPU found: no sharding needed for one device"
    if model is None:
        return "zero2", f"{gpus} GPUs found: ZeRO-2 on {gpus} ranks (run `hf-zero estimate` to check it fits)"
    from .memory import count_model, estimate_all, recommend

    if gpu_memory_bytes is None:
        import torch

        gpu_memory_bytes = torch.cuda.get_device_properties(0).total_memory
    stages = {"zero2": "zero2", "zero3": "zero3", "zero3_offload": "zero3_offload"}  # strategy -> profile
    estimates = estimate_all(count_model(model, lora=lora_r), strategies=tuple(stages), world_size=gpus,
                             gpus_per_node=gpus, precision="bf16", micro_batch=1, seq_len=1024)
    best, why = recommend(estimates, gpu_memory_bytes)
    if best is None:
        return "zero3_offload", f"{gpus} GPUs found; {why}"
    return stages[best], f"{gpus} GPUs found: {best} on {gpus} ranks is the {why}"


def build_deepspeed_config(profile: Profile, on_cpu: bool) -> dict:
    """The DeepSpeed config handed to TrainingArguments(deepspeed=...).

    Batch sizes, accumulation, clipping and precision stay "auto": the Trainer fills them from TrainingArguments,
    which hf_zero has already reconciled with the profile, so the two can never disagree.
    """
    stage = profile.zero_stage or 0
    zero: dict = {"stage": stage}
    if stage == 1:
        # Measured by `hf-zero bench`: with DeepSpeed's default (5e8 elements) ZeRO-1 allocates a 2 GB fp32 reduce
        # bucket every step whatever the model's size; "auto" is hidden_size^2, as for ZeRO-2/3.
        zero["reduce_bucket_size"] = "auto"
    if stage >= 2:
        zero.update(overlap_comm=False, contiguous_gradients=True, reduce_bucket_size="auto")
    if stage == 3:
        zero.update(
            stage3_prefetch_bucket_size="auto",
            stage3_param_persistence_threshold="auto",
            stage3_gather_16bit_weights_on_model_save=profile.zero3_save_16bit_model,
        )
        if on_cpu:
            # Measured here: the default reuse distance (1e9) makes DeepSpeed walk the whole recorded module order
            # at step 2 (a 17-45 s stall on SmolLM2-135M); 0 removes it without changing losses.
            zero["stage3_max_reuse_distance"] = 0
    for kind, device in (("optimizer", profile.offload_optimizer), ("param", profile.offload_param)):
        if device in ("cpu", "nvme") and (kind == "optimizer" or stage == 3):
            section = {"device": device}
            if device == "nvme":
                section["nvme_path"] = profile.nvme_path or "/local_nvme"
            if device == "cpu" and not on_cpu:
                section["pin_memory"] = True
            zero[f"offload_{kind}"] = section
    return {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
        "fp16": {"enabled": "auto"},
        "zero_optimization": zero,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
