"""Profiles: the accelerate YAMLs in `accelerate_configs/` that own hardware, the sharding engine (DeepSpeed ZeRO
stage or FSDP2), offload and precision.

A profile is found by name (`zero3`, `fsdp2`) or path and validated with accelerate's own config loader; for
DeepSpeed, plan/deepspeed_config.py turns it into the DeepSpeed config hf_zero hands the Trainer, and FSDP2 is
configured by accelerate itself from the profile's `fsdp_config`. The run plan (plan/run_plan.py) carries the profile
to the ranks; a run started with plain `accelerate launch --config_file X` has none, and its ranks read the profile
back from the environment accelerate sets (`profile_from_env`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path

import yaml

from hf_zero.core.errors import UserError
from hf_zero.core.once import once, read_text
from hf_zero.core.validate import at_line, yaml_lines
from hf_zero.core.yaml_safe import load_yaml
from hf_zero.plan.sequence_parallel import sp_size_of, verify_profile_sp
from hf_zero.plan.shipped import shipped_dir
from hf_zero.plan.world import world_from_env

__all__ = [
    "PROFILES_DIR",
    "Profile",
    "list_profiles",
    "resolve_profile_path",
    "load_profile",
    "profile_from_env",
    "one_rank_note",
    "gpu_count",
    "precision_name",
    "accelerate_precision",
    "with_precision",
]

PROFILES_DIR = shipped_dir("accelerate_configs")
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
    sp_size: int = 1  # Ulysses sequence parallelism: ranks sharing one sequence (plan/sequence_parallel.py)
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
        return precision_name(self.mixed_precision)


PRECISIONS = ("fp32", "bf16", "fp16")
# torch dtype names by precision (getattr(torch, name): torch loads only where a dtype is built)
TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def precision_name(mixed_precision: str) -> str:
    """hf_zero's word for a precision (fp32, bf16, fp16) from accelerate's `mixed_precision` (no, bf16, fp16)."""
    return {"no": "fp32"}.get(mixed_precision, mixed_precision)


def accelerate_precision(precision: str) -> str:
    """accelerate's `mixed_precision` for a user's `--precision` (fp32 -> no); a word it does not know is one line."""
    if precision not in (*PRECISIONS, "no"):
        raise UserError("--precision", f"unknown precision {precision!r}", "use fp32, bf16 or fp16")
    return "no" if precision == "fp32" else precision


def with_precision(profile: Profile, precision: str | None) -> Profile:
    """The profile as it runs under a command's `--precision` (fp32, bf16, fp16; None: the profile's own): the one
    place `hf-zero check`, `estimate` and `bench` turn that flag into the profile's precision."""
    return replace(profile, mixed_precision=accelerate_precision(precision)) if precision else profile


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
    return once("profile", (str(path), os.environ.get(NVME_ENV)), lambda: _read_profile(path))


def _read_profile(path: Path) -> Profile:
    try:
        raw = load_yaml(read_text(path), f"profile {path.name}") or {}
    except yaml.YAMLError as err:
        raise UserError(f"profile {path.name}", f"is not valid YAML ({str(err).splitlines()[0]})") from None
    _validate_with_accelerate(path)
    _validate_values(raw, path)
    verify_profile_sp(raw, path.name)
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
        sp_size=sp_size_of(raw),
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


def _validate_values(raw: dict, path: Path) -> None:
    """accelerate's loader checks the keys, not their values: `zero_stage: 7` or `num_processes: 0` would only
    fail inside DeepSpeed or torchrun, after the launch."""
    lines = yaml_lines(str(path))
    ds = raw.get("deepspeed_config") or {}
    rules = [
        ("num_processes", raw.get("num_processes", 1), lambda v: isinstance(v, int) and v >= 1, "e.g. 2"),
        ("num_machines", raw.get("num_machines", 1), lambda v: isinstance(v, int) and v >= 1, "e.g. 1"),
        ("deepspeed_config.zero_stage", ds.get("zero_stage", 0), lambda v: v in (0, 1, 2, 3), "use 0, 1, 2 or 3"),
        ("deepspeed_config.offload_optimizer_device", str(ds.get("offload_optimizer_device", "none")).lower(),
         lambda v: v in ("none", "cpu", "nvme"), "use none, cpu or nvme"),
        ("deepspeed_config.offload_param_device", str(ds.get("offload_param_device", "none")).lower(),
         lambda v: v in ("none", "cpu", "nvme"), "use none, cpu or nvme"),
        ("mixed_precision", str(raw.get("mixed_precision", "no")).lower(),
         lambda v: v in ("no", "fp16", "bf16", "fp8"), "use no, bf16 or fp16"),
    ]
    for key, value, ok, fix in rules:
        if not ok(value):
            top = key.split(".")[0]
            raise UserError(f"profile {path.name}: {key}",
                            f"{value!r} is not valid {at_line(str(path), lines, key, top)}", fix)
    machines, procs = raw.get("num_machines", 1), raw.get("num_processes", 1)
    if procs % machines:
        raise UserError(f"profile {path.name}: num_processes", f"{procs} processes do not divide over {machines} "
                        "machines (num_processes counts all machines)", f"use a multiple of {machines}")
    if ds.get("offload_param_device", "none") not in ("none", None) and ds.get("zero_stage") != 3:
        raise UserError(f"profile {path.name}: deepspeed_config.offload_param_device", "parameter offload needs "
                        f"ZeRO stage 3, the profile has {ds.get('zero_stage')}", "set zero_stage: 3 or remove it")


def profile_from_env(env: dict | None = None) -> Profile:
    """The profile of the current worker, from what accelerate (and hf_zero's launcher) put in the environment."""
    env = dict(os.environ if env is None else env)
    if env.get(PROFILE_ENV):
        prof = load_profile(env[PROFILE_ENV])
        prof.num_processes = world_from_env(env, prof.num_processes)
        prof.mixed_precision = env.get("ACCELERATE_MIXED_PRECISION", prof.mixed_precision).lower()
        return prof
    world = world_from_env(env)
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
            sp_size=int(env.get("PARALLELISM_CONFIG_SP_SIZE", 1))
            if env.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() == "true" else 1,
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


def one_rank_note(profile: Profile, world: int) -> list[str]:
    """The banner's line for a ZeRO run on one rank: legal, but there is nobody to shard with."""
    if not profile.uses_deepspeed or world != 1:
        return []
    offload = sorted({d for d in (profile.offload_optimizer, profile.offload_param) if d in ("cpu", "nvme")})
    if offload:
        return [f"  note: 1 rank: ZeRO shards nothing; only the offload to {'/'.join(offload)} saves device memory "
                "over single_gpu"]
    return ["  note: 1 rank: ZeRO shards nothing, so it saves no memory over single_gpu and costs time; "
            "use single_gpu, or an offload profile to use CPU memory"]
