"""FSDP2's rules for a run, checked before any engine exists (`hf-zero check`, `hf-zero train`'s preflight, and the
recipe again before the model is prepared): which layer classes get a shard group each, and the profile and recipe
settings FSDP2 cannot honour, each as one line."""

from __future__ import annotations

from hf_zero.core.errors import UserError
from hf_zero.integrations.transformers import no_split_modules

__all__ = ["layer_classes", "shard_layers", "meta_model", "verify_fsdp"]


def layer_classes(model, named: str | None = None) -> list[str]:
    """The module classes FSDP2 gives a shard group of their own: the profile's `fsdp_transformer_layer_cls_to_wrap`
    if it names one, else the model's `_no_split_modules` (what accelerate reads), keeping only classes present."""
    wanted = [c.strip() for c in named.split(",")] if named else list(no_split_modules(model) or [])
    present = {type(m).__name__ for m in model.modules()}
    return [c for c in wanted if c in present]


def shard_layers(model, named: str | None, transformer_wrap: bool, where: str = "profile") -> list[str]:
    """The layer classes FSDP2 gives a shard group each, checked against what accelerate 1.15's preparation can do:
    it shards the input embeddings in a group of their own (so a layer class holding them, like BERT's
    BertEmbeddings, is left out: sharding it twice crashes in fully_shard) and fails outright for a model without
    input embeddings; a transformer-based wrap that matches no layer would gather the whole model every forward."""
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


def meta_model(config, head: bool = False):
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
        found = shard_layers(meta_model(model_config), profile.fsdp_layer_cls, transformer_wrap, where)
        layers = ", ".join(found) if transformer_wrap else layers
    offload = "parameters, gradients and Adam on the CPU" if profile.offload_param == "cpu" else "no offload"
    reshard = "resharded after forward" if profile.reshard_after_forward else "kept gathered until backward"
    return f"FSDP2: one shard group per {layers}, {reshard}, {offload}"
