"""FSDP2 (torch's `fully_shard`) under accelerate and the Trainer: the one correction accelerate needs on a machine
without GPUs, the layer class each shard group is built around, and a Hugging Face folder written from a sharded
model (full weights, or only the adapter for LoRA) without any rank holding more than it must.

Checkpoints are the Trainer's own FSDP2 ones: torch distributed checkpoints (`pytorch_model_fsdp_0/`,
`optimizer_0/`) that reshard on load, so a run may resume on another number of ranks without conversion.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["FSDP_MODEL_DIR", "enable_fsdp_on_cpu", "shard_layers", "announce_layers", "is_fsdp_checkpoint",
           "layer_classes", "full_tensor", "gathered_state_dict", "tied_copies", "save_pretrained_gathered",
           "lazy_dcp_state", "verify_fsdp"]

FSDP_MODEL_DIR = "pytorch_model_fsdp_0"  # where accelerate's save_fsdp_model puts the model's distributed checkpoint


def enable_fsdp_on_cpu(trainer) -> bool:
    """Turn the Trainer's accelerator into the FSDP one the launcher asked for, on a machine without GPUs.

    accelerate 1.15 only honours ACCELERATE_USE_FSDP for GPU-like backends: on CPU it builds a MULTI_CPU state and
    trains plain DDP without a word (measured here: the "FSDP" run's losses equal DDP's because it *is* DDP).
    FSDP2 itself runs on CPU over gloo, so the state gets the FSDP plugin accelerate would have given it, before
    the model is prepared. Returns True when it changed something.
    """
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    state = trainer.accelerator.state
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() != "true" or \
            state.distributed_type != DistributedType.MULTI_CPU:
        return False
    from torch.distributed.fsdp import CPUOffloadPolicy

    plugin = FullyShardedDataParallelPlugin()  # from the launcher's FSDP_* variables, as accelerate does
    if isinstance(plugin.cpu_offload, CPUOffloadPolicy):
        # Pinned host memory needs an accelerator ("Cannot access accelerator device"); with none, the shards
        # already live in ordinary CPU memory.
        plugin.cpu_offload = CPUOffloadPolicy(pin_memory=False)
    if state.mixed_precision != "no":
        plugin.set_mixed_precision(state.mixed_precision)
    state.distributed_type = DistributedType.FSDP
    state.fsdp_plugin = plugin
    trainer.is_fsdp_enabled = True
    return True


def shard_layers(model, named: str | None, transformer_wrap: bool, where: str = "profile") -> list[str]:
    """The layer classes FSDP2 gives a shard group each, checked against what accelerate 1.15's preparation can do:
    it shards the input embeddings in a group of their own (so a layer class holding them, like BERT's
    BertEmbeddings, is left out: sharding it twice crashes in fully_shard) and fails outright for a model without
    input embeddings; a transformer-based wrap that matches no layer would gather the whole model every forward."""
    from hf_zero.core.errors import UserError

    kind = type(model).__name__
    try:
        embed = model.get_input_embeddings()
    except NotImplementedError:
        raise UserError(where, f"{kind} has no input embeddings, and accelerate 1.15's FSDP2 preparation fails "
                        "without them (get_input_embeddings)", "train this model with ddp or a zero profile") from None
    holders = {type(m).__name__ for m in model.modules() if m is not embed and any(x is embed for x in m.modules())}
    found = [c for c in layer_classes(model, named) if c not in holders]
    if transformer_wrap and not found:
        said = f"names {named!r}, which" if named else "names no layer class and the model's _no_split_modules"
        raise UserError(f"{where}: fsdp_transformer_layer_cls_to_wrap", f"the profile {said} matches no layer of "
                        f"{kind}, so FSDP2 would gather the whole model for every forward",
                        "name the model's decoder layer class there, e.g. LlamaDecoderLayer")
    return found


def announce_layers(trainer) -> list[str]:
    """Resolve, check and print the layer classes FSDP2 will shard around, before the model is prepared, and hand
    accelerate exactly that list."""
    plugin = trainer.accelerator.state.fsdp_plugin
    transformer_wrap = getattr(plugin.auto_wrap_policy, "__name__", "") == "transformer_auto_wrap_policy"
    named = plugin.transformer_cls_names_to_wrap
    named = ",".join(named) if isinstance(named, (list, tuple)) else named
    model = trainer.accelerator.unwrap_model(trainer.model)
    found = shard_layers(model, named, transformer_wrap)
    if not transformer_wrap:
        return []  # size-based groups (verify_fsdp has refused no wrapping at all)
    plugin.transformer_cls_names_to_wrap = found
    count = sum(type(m).__name__ in found for m in model.modules())
    if trainer.args.should_save:
        print(f"[hf_zero] FSDP2: one shard group per {', '.join(found)} ({count} in all), plus the input embeddings "
              f"and the output layers; {plugin.cpu_offload.__class__.__name__}", flush=True)
    return found


def is_fsdp_checkpoint(folder) -> bool:
    return (Path(folder) / FSDP_MODEL_DIR).is_dir()


def layer_classes(model, named: str | None = None) -> list[str]:
    """The module classes FSDP2 gives a shard group of their own: the profile's `fsdp_transformer_layer_cls_to_wrap`
    if it names one, else the model's `_no_split_modules` (what accelerate reads), keeping only classes present."""
    wanted = [c.strip() for c in named.split(",")] if named else list(getattr(model, "_no_split_modules", None) or [])
    present = {type(m).__name__ for m in model.modules()}
    return [c for c in wanted if c in present]


def full_tensor(tensor):
    """The whole tensor of an FSDP2 shard (a DTensor; a collective: every rank must call it), or the tensor itself."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def gathered_state_dict(model, trainable_only: bool) -> dict:
    """The whole state dict on rank 0 (CPU), {} elsewhere; collective. `trainable_only` (LoRA) gathers only the
    adapter, so no rank ever assembles the frozen base model."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=trainable_only)
    return get_model_state_dict(model, options=options)


def tied_copies(model) -> set[str]:
    """Names under which a parameter appears a second time (tied input and output embeddings): the gathered state
    dict holds them as separate tensors, so they are dropped, as save_pretrained does; from_pretrained ties again."""
    first, out = {}, set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if first.setdefault(id(param), name) != name:
            out.add(name)
    return out


def save_pretrained_gathered(trainer, folder, weights: bool = True) -> None:
    """A from_pretrained-loadable folder from the sharded model: config and tokenizer always; with `weights`, the
    gathered full model (LoRA: the adapter only). Collective: every rank calls it, rank 0 writes."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    peft = hasattr(model, "peft_config")
    state = gathered_state_dict(model, trainable_only=peft) if (weights or peft) else {}
    for name in tied_copies(model):
        state.pop(name, None)
    if trainer.args.should_save:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        if weights or peft:
            # PeftModel.save_pretrained keeps only the adapter's keys of the state dict it is given.
            model.save_pretrained(str(folder), state_dict=state, safe_serialization=True)
        if not peft:
            model.config.save_pretrained(str(folder))
        if trainer.processing_class is not None:
            trainer.processing_class.save_pretrained(str(folder))
    trainer.accelerator.wait_for_everyone()


class _DcpTensor:
    """One tensor of a distributed checkpoint, read from disk only when asked for (`contiguous()`), so an export
    holds at most the shard it is writing."""

    def __init__(self, folder: str, key: str, meta):
        self.folder, self.key = folder, key
        self.shape, self.dtype = meta.size, meta.properties.dtype

    def contiguous(self):
        import warnings

        import torch
        import torch.distributed.checkpoint as dcp

        box = {self.key: torch.empty(self.shape, dtype=self.dtype)}
        with warnings.catch_warnings():  # "torch.distributed is disabled ... assuming ... a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(box, storage_reader=dcp.FileSystemReader(self.folder), no_dist=True)
        return box[self.key]


def lazy_dcp_state(checkpoint) -> dict:
    """name -> lazily read tensor of the model in an FSDP2 checkpoint, named as in the model's own state dict
    (accelerate saves it under a top-level "model" key)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    folder = str(Path(checkpoint) / FSDP_MODEL_DIR)
    entries = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
    tied = tied_copies(_meta_model(_config_of(checkpoint), head=True))
    return {name: _DcpTensor(folder, key, meta) for key, meta in entries.items()
            if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)
            and (name := key.split(".", 1)[1]) not in tied}


def _config_of(folder):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(folder))


def _meta_model(config, head: bool = False):
    """The model's module tree on the meta device (no memory, no weights): enough to see its layer classes, and
    (`head`: the class its config names, e.g. LlamaForCausalLM) which parameters it ties."""
    import torch
    import transformers

    arch = getattr(transformers, (config.architectures or [""])[0], None) if head else None
    with torch.device("meta"):
        return arch(config) if arch is not None else transformers.AutoModel.from_config(config)


def verify_fsdp(profile, recipe_kwargs: dict, gpus: int, model_config=None) -> str:
    """FSDP2's constraints as one-line errors, before any process starts (`hf-zero check`) and again in the recipe
    before the engine is built. `recipe_kwargs`: the TrainingArguments the recipe asks for."""
    from hf_zero.core.errors import UserError

    if recipe_kwargs.get("fsdp") or recipe_kwargs.get("fsdp_config"):
        raise UserError("fsdp", "the recipe sets FSDP options but the profile owns the sharding engine",
                        "remove fsdp/fsdp_config from the recipe and pick profile fsdp2 or fsdp2_offload")
    if not profile.uses_fsdp:
        return f"not used by profile {profile.name}"
    where = f"profile {profile.name}"
    if profile.raw.get("deepspeed_config"):
        raise UserError(f"{where}: deepspeed_config", "an FSDP profile ignores DeepSpeed settings",
                        "remove the deepspeed_config section, or use distributed_type: DEEPSPEED")
    if profile.fsdp_version != 2:
        raise UserError(f"{where}: fsdp_version", f"is {profile.fsdp_version}; hf_zero runs FSDP2 only (FSDP1 is "
                        "deprecated in PyTorch, and hf_zero's checkpoints, resume and export are built for FSDP2)",
                        "set fsdp_version: 2")
    if profile.fsdp_state_dict_type != "SHARDED_STATE_DICT":
        raise UserError(f"{where}: fsdp_state_dict_type", f"{profile.fsdp_state_dict_type} gathers the whole model "
                        "and optimizer on rank 0 at every checkpoint", "use SHARDED_STATE_DICT (the final model is "
                        "gathered into safetensors either way, and `hf-zero export` reads sharded checkpoints)")
    if str(profile.raw.get("use_cpu", False)).lower() == "true" and gpus > 0:
        raise UserError(f"{where}: use_cpu", f"true makes accelerate drop FSDP and train on the CPU although this "
                        f"machine has {gpus} GPU(s)", "set use_cpu: false (without GPUs hf_zero uses the CPU itself)")
    if profile.fsdp_wrap not in ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP"):
        raise UserError(f"{where}: fsdp_auto_wrap_policy", f"is {profile.fsdp_wrap}: every decoder layer would share "
                        "the model's one shard group, gathered whole for every forward",
                        "set fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP (one group per decoder layer)")
    checkpointing = recipe_kwargs.get("gradient_checkpointing") or recipe_kwargs.get("activation_checkpointing")
    if checkpointing and profile.fsdp_activation_checkpointing:
        raise UserError("gradient_checkpointing", f"the recipe turns it on and {where} sets "
                        "fsdp_activation_checkpointing: true (the Trainer refuses both)",
                        "keep one: remove gradient_checkpointing from the recipe or set the profile's to false")
    if recipe_kwargs.get("save_only_model"):
        raise UserError("save_only_model", "FSDP2 checkpoints are sharded: the Trainer cannot save the model "
                        "alone into them", "remove save_only_model (final/ holds the whole model either way)")
    transformer_wrap = profile.fsdp_wrap == "TRANSFORMER_BASED_WRAP"
    layers = "the model's layer class" if transformer_wrap else "size-based group"
    if model_config is not None:
        found = shard_layers(_meta_model(model_config), profile.fsdp_layer_cls, transformer_wrap, where)
        layers = ", ".join(found) if transformer_wrap else layers
    offload = "parameters, gradients and Adam on the CPU" if profile.offload_param == "cpu" else "no offload"
    reshard = "resharded after forward" if profile.reshard_after_forward else "kept gathered until backward"
    return f"FSDP2: one shard group per {layers}, {reshard}, {offload}"
