"""The checks behind `hf-zero check`, each a function that raises UserError (field + fix) or returns a one-line
verdict. `hf_zero.preflight.checks` runs all of them before a launch; hf_zero.preflight.at_start runs the cheap ones
inside the recipe, before the engine is built, and stops at the first failure."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from hf_zero.core import ops
from hf_zero.core.errors import UserError
from hf_zero.core.files import human_bytes
from hf_zero.core.ops import build_ops
from hf_zero.data.cache import hub_cache_dir
from hf_zero.data.model_names import get_model_config, shape_folder
from hf_zero.data.vlm import vlm_lora_targets
from hf_zero.estimate.memory import estimate
from hf_zero.estimate.model_count import count_model
from hf_zero.integrations.parsers import group_dests
from hf_zero.plan.hostfile import find_machine_rank, read_hostfile
from hf_zero.plan.profiles import precision_name
from hf_zero.plan.reconcile import profile_precision
from hf_zero.plan.world import world_from_env

__all__ = ["verify_profile_keys", "verify_devices", "verify_precision", "verify_launch", "verify_hostfile",
           "verify_offload", "verify_output", "strategy_of", "count_for", "checkpoint_plan", "output_needs",
           "verify_seq_length", "verify_weights_reachable"]


def _accelerate_deepspeed_keys(title: str = "DeepSpeed Arguments") -> set[str]:
    """The keys accelerate understands under `deepspeed_config:` (or, with "FSDP Arguments", `fsdp_config:`): its
    launcher's arguments. accelerate itself copies any key there without complaint, so a misspelled `zero_stge: 3`
    would silently mean stage 0."""
    from accelerate.commands.launch import launch_command_parser

    return group_dests(launch_command_parser(), title)  # hf_zero/integrations/parsers.py


def verify_profile_keys(profile, keys=None) -> str:
    """`keys`: the profile's deepspeed_config keys (default: from its YAML); an FSDP profile's fsdp_config keys are
    checked the same way. Top-level keys were already checked by accelerate's own loader in load_profile."""
    import difflib

    keys = list((profile.raw.get("deepspeed_config") or {}) if keys is None else keys)
    known = _accelerate_deepspeed_keys() | {"mixed_precision"}  # accelerate lists mixed_precision among DS fields
    sections = [("deepspeed_config", keys, known)]
    if profile.uses_fsdp:  # accelerate accepts fsdp_config keys with or without their fsdp_ prefix
        sections.append(("fsdp_config", [k if k.startswith("fsdp_") else f"fsdp_{k}" for k in
                                         profile.raw.get("fsdp_config") or {}],
                         _accelerate_deepspeed_keys("FSDP Arguments") | {"fsdp_ignored_modules"}))
    for section, names, allowed in sections:
        unknown = [k for k in names if k not in allowed]
        if unknown:
            hints = [f"{k} (did you mean {c[0]}?)" if (c := difflib.get_close_matches(k, allowed, n=1)) else k
                     for k in unknown]
            raise UserError(f"profile {profile.name}: {section}", f"unknown keys: {', '.join(hints)}",
                            "fix the spelling or remove them (accelerate would ignore them silently)")
    if "deepspeed_config_file" in keys:
        raise UserError(f"profile {profile.name}: deepspeed_config.deepspeed_config_file", "hf_zero builds the "
                        "DeepSpeed config from the profile's fields; a JSON file would be a second owner",
                        "move its settings into the profile's deepspeed_config fields")
    kind = profile.sharding if profile.uses_deepspeed or profile.uses_fsdp else profile.distributed_type
    return f"{profile.name} ({kind}, {profile.num_processes} processes on {profile.num_machines} machine(s), " \
           f"{profile.precision})" + (f" from {profile.path}" if profile.path else "")


def verify_devices(profile, nproc: int, gpus: int) -> str:
    """Processes per machine against the devices present: a GPU each, or DeepSpeed's CPU accelerator."""
    if gpus == 0:
        cores = os.cpu_count() or 1
        how = "DeepSpeed's CPU accelerator" if profile.uses_deepspeed else "the CPU"
        slow = f" (more processes than the {cores} CPU cores: slow)" if nproc > cores else ""
        return f"no GPU: {nproc} process(es) per machine on {how}, gloo{slow}"
    if nproc > gpus:
        raise UserError("devices", f"profile {profile.name} starts {nproc} processes per machine but this machine has "
                        f"{gpus} GPU(s) (\"invalid device ordinal\" at step 0)",
                        f"use --nproc {gpus} (make train NPROC={gpus}) or a machine with {nproc} GPUs")
    return f"{nproc} process(es) per machine on {gpus} GPU(s)"


def verify_precision(profile, precision: str, recipe_kwargs: dict, gpus: int, real_gpus: bool) -> str:
    """The profile owns precision; the recipe may not contradict it; the hardware must support it."""
    if recipe_kwargs:
        profile_precision(profile, recipe_kwargs)  # a recipe saying bf16/fp16 against the profile: both named
    name = precision_name(precision)
    if gpus == 0:
        if name == "fp16":
            raise UserError("precision", f"profile {profile.name} asks for fp16, which needs a GPU",
                            "use --precision bf16 (PRECISION=bf16) or an fp32 profile on this machine")
        return f"{name} on the CPU"
    if name == "bf16":
        if not real_gpus:
            return "bf16 (not verified without the GPUs: needs compute capability 8.0+, e.g. A100, L40, H100)"
        import torch

        if not torch.cuda.is_bf16_supported():
            raise UserError("precision", f"profile {profile.name} asks for bf16, which these GPUs do not support "
                            "(needs compute capability 8.0+)", "use --precision fp16 or an fp32 profile")
    return f"{name} on {gpus} GPU(s)"


def verify_launch(profile, env: dict, config: str | None = None, in_recipe: bool = True, hosts=None,
                  world: int | None = None, flags: str = "") -> str:
    """Inside a recipe: a multi-process profile needs a launcher (plain `python` would be one process, and
    DeepSpeed would go looking for MPI). Before a launch: say what starts it. `hosts`: from a hostfile, which
    names machine 0 the way main_process_ip would."""
    world = world or profile.num_processes
    command = f"hf-zero train --profile {profile.name}" + (f" --config {config}" if config else "") + flags
    if profile.num_machines > 1 and not (hosts or profile.raw.get("main_process_ip") or env.get("MASTER_ADDR")):
        raise UserError("launch", f"profile {profile.name} spans {profile.num_machines} machines but names no "
                        "main_process_ip", "add main_process_ip to the profile, pass --main-ip HOST0 or --hostfile")
    if in_recipe and world > 1 and world_from_env(env, None) is None:
        raise UserError("launch", f"profile {profile.name} runs {world} processes but this recipe was started as one "
                        "process (plain `python`)", f"run: {command} (or accelerate launch --config_file "
                        f"{profile.path or profile.name} <recipe> ...)")
    if in_recipe:
        return f"launched as rank {env.get('RANK', '0')} of {world_from_env(env)}"
    return f"start it with `{command}` ({world} process(es) in all); plain `python` would run one"


def verify_hostfile(path: str | None, nproc: int) -> str:
    """A DeepSpeed hostfile, read as `hf-zero train --hostfile` reads it: it sets the machines and, unless --nproc
    is given, the processes per machine (its slots)."""
    if not path:
        return "none given (each machine is launched with the profile's machine_rank)"
    hosts = read_hostfile(path)
    slots = hosts[0][1]
    if nproc > slots:
        raise UserError("--nproc", f"{nproc} processes per machine but {path} gives each host slots={slots}",
                        f"pass --nproc {slots} or raise the slots")
    rank = find_machine_rank([h for h, _ in hosts])
    here = f"this machine is line {rank}" if rank is not None else "this machine is not listed (pass --machine-rank)"
    return f"{len(hosts)} machine(s) x {nproc} process(es): {', '.join(h for h, _ in hosts)}; {here}"


def _nearest_existing(path: Path) -> Path:
    path = path.expanduser().absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _writable_room(path: Path, field: str, fix: str) -> int:
    """Free bytes where `path` is or would be created; UserError when nothing can be written there. A probe file
    (deleted at once) is the only thing written: nothing already there is touched."""
    base = _nearest_existing(path)
    if not base.is_dir():
        raise UserError(field, f"{path} cannot be created: {base} is a file", f"point {field} at a folder, not a file")
    try:
        with tempfile.NamedTemporaryFile(dir=base, prefix=".hf_zero_probe_"):
            pass
    except OSError as err:
        raise UserError(field, f"{base} is not writable ({err.strerror})", fix) from None
    return shutil.disk_usage(base).free


def verify_offload(profile, nvme_bytes: int | None, build_cpu_adam: bool = True) -> str:
    devices = {profile.offload_optimizer, profile.offload_param} - {"none"}
    if profile.uses_fsdp and devices:
        return "cpu: FSDP2's CPUOffloadPolicy (parameter shards, gradients and Adam on the CPU; nothing to build)"
    if not profile.uses_deepspeed or not devices:
        return f"none in profile {profile.name}"
    done = []
    if "nvme" in devices:  # the cheap checks first (the path, then a compile for libaio): cpu_adam takes minutes
        path = Path(profile.nvme_path or "/local_nvme")
        fix = "export HF_ZERO_NVME_PATH=<a writable local NVMe folder>"
        free = _writable_room(path, "HF_ZERO_NVME_PATH", fix)
        if nvme_bytes is not None and free < nvme_bytes:
            raise UserError("HF_ZERO_NVME_PATH", f"{path} has {human_bytes(free)} free, the swap files need "
                            f"{human_bytes(nvme_bytes)}", fix)
        if not ops.libaio_available():  # through the module: a test stands in the answer there
            raise UserError("offload", "NVMe offload needs libaio, and no program links against it here",
                            "apt-get install libaio-dev (and a C compiler)")
        need = f", needs {human_bytes(nvme_bytes)}" if nvme_bytes is not None else ""
        done.append(f"libaio ok, {path} writable ({human_bytes(free)} free{need})")
    if build_cpu_adam:  # the optimizer steps on the CPU for both cpu and nvme offload
        res = build_ops(("CPUAdamBuilder",))["CPUAdamBuilder"]
        if res != "ok":
            raise UserError("offload", f"DeepSpeed's cpu_adam cannot be built ({res[:160]})",
                            "install a C++ compiler (apt-get install g++) and run `python -m hf_zero.core.ops`")
        done.append("cpu_adam ok")
    return f"{'/'.join(sorted(devices))}: " + "; ".join(done or ["cpu_adam is built by `make install`"])


def strategy_of(profile) -> str:
    """The memory.estimate strategy a profile runs."""
    if profile.uses_fsdp:
        return "fsdp2_offload" if profile.offload_param == "cpu" else "fsdp2"
    if not profile.uses_deepspeed or not profile.zero_stage:
        return "ddp"
    devices = (profile.offload_optimizer, profile.offload_param)
    if profile.zero_stage < 3:
        return f"zero{profile.zero_stage}" + ("_offload" if profile.zero_stage == 2 and "cpu" in devices else "")
    if "nvme" in devices:
        return "zero3_nvme"
    return {"cpu": "zero3_offload"}.get(profile.offload_param) or (
        "zero3_offload_optimizer" if profile.offload_optimizer == "cpu" else "zero3")


def count_for(model_args):
    """Parameter counts of the recipe's model (LoRA included), from its config on the meta device."""
    lora = None
    if model_args.use_peft:
        lora = {"r": model_args.lora_r, "target_modules": model_args.lora_target_modules}
    config = get_model_config(model_args.model_name_or_path)
    if lora is not None:  # a VLM's default targets are hf_zero's (peft has none for them)
        lora["target_modules"] = vlm_lora_targets(config, lora["target_modules"])
    try:
        return count_model(config, lora=lora)
    except ValueError as err:  # peft: target modules not in the model
        raise UserError("lora_target_modules", str(err).splitlines()[0], "name modules the model has") from None


def verify_weights_reachable(name: str) -> None:
    """A hub id of which hf_zero ships only the shape (config.json: what `hf-zero estimate` counts) and that neither
    the cache nor the hub gives: nothing to train. Said before any launch, whatever tokenizer the recipe names (with
    one that loads, the ranks once launched and failed on the missing weights with a traceback)."""
    if shape_folder(name) is not None:
        raise UserError("model_name_or_path", f"{name}: hf_zero ships only its shape (config.json, for `hf-zero "
                        f"estimate`); its weights are not in the Hugging Face cache ({hub_cache_dir()}) and the hub "
                        "cannot give them", f"download it where the hub is reachable (huggingface-cli download "
                        f"{name}) into that cache, or point model_name_or_path at a local folder with the weights")


def verify_seq_length(config, max_seq_length, stages) -> None:
    """No sample longer than the model has positions: past max_position_embeddings a model fails at step 0 or reads
    garbage positions, and a huge length with packing allocates gigabytes before the first line."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    limit = getattr(text, "max_position_embeddings", None)
    if not isinstance(limit, int) or isinstance(limit, bool) or limit <= 0:
        return
    for field, value in [("max_seq_length", max_seq_length),
                         *((f"stages[{s.name}].max_seq_length", s.max_seq_length) for s in stages or [])]:
        if isinstance(value, int) and value > limit:
            raise UserError(field, f"{value} is more than the model's {limit} positions (max_position_embeddings)",
                            f"use at most {limit}")


def checkpoint_plan(training_kwargs: dict, total_steps: int) -> int:
    """How many checkpoints exist at once at most: the Trainer writes the new one before rotating old ones out."""
    strategy = str(training_kwargs.get("save_strategy") or "no").split(".")[-1].lower()
    if strategy == "no" or total_steps <= 0:
        return 0
    if strategy == "steps":
        every = float(training_kwargs.get("save_steps") or 500)
        every = max(1, int(every * total_steps if every < 1 else every))
        saves = -(-total_steps // every)
    else:  # epoch / best: the curriculum is one epoch
        saves = 1
    limit = training_kwargs.get("save_total_limit")
    return min(saves, int(limit) + 1) if limit else saves


def output_needs(count, profile, nproc: int, training_kwargs: dict, total_steps: int,
                 final_params: int | None = None) -> tuple[int, str, dict]:
    """(bytes, what they are, the memory estimate) the run writes into output_dir: checkpoints + final model;
    `final_params`: what the final folder holds where it is not the adapter (LoRA) or the whole model."""
    est = estimate(count, strategy_of(profile), gpus_per_node=nproc, nodes=profile.num_machines,
                   precision=profile.precision)
    ckpts = checkpoint_plan(training_kwargs, total_steps)
    lora = count.trainable_params < count.total_params
    final = (2 if profile.precision != "fp32" else 4) * (
        final_params or (count.trainable_params if lora else count.total_params))
    what = f"final model {human_bytes(final)}" + (
        f" + {ckpts} checkpoint(s) x {human_bytes(est['checkpoint_bytes'])}" if ckpts else ", no checkpoints")
    return ckpts * est["checkpoint_bytes"] + final, what, est


def verify_output(output_dir: str, needed: int, what: str) -> str:
    fix = "pass --output_dir on a disk with room"
    free = _writable_room(Path(output_dir), "output_dir", fix)
    if free < needed:
        raise UserError("output_dir", f"{output_dir} has {human_bytes(free)} free but {what} need "
                        f"{human_bytes(needed)}", fix + " or set save_total_limit")
    return f"{output_dir} writable, {human_bytes(free)} free for ~{human_bytes(needed)} ({what})"
