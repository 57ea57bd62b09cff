"""What a model is, counted for the memory estimate: parameters (all, trainable, per layer, as DeepSpeed and FSDP2
shard them), the linears a 4-bit base quantizes and their packed bytes, and the shapes the activation terms need, from
a config built on the meta device (no weights read)."""

from __future__ import annotations

from dataclasses import dataclass

from hf_zero.data.model_names import get_model_config
from hf_zero.estimate.activations import describe_layers
from hf_zero.estimate.fsdp import describe_shards
from hf_zero.integrations.transformers import model_mapping, without_zero3_init
from hf_zero.plan.fused_loss import config_problem
from hf_zero.plan.liger import liger_model_types

__all__ = ["ModelCount", "count_model", "nf4_bytes"]


@dataclass(frozen=True)
class ModelCount:
    total_params: int
    largest_layer_params: int
    trainable_params: int
    largest_trainable_layer_params: int = 0
    num_layers: int = 0
    hidden_size: int = 0
    num_heads: int = 0
    vocab_size: int = 0
    param_numels: tuple = ()
    name: str = ""
    layer: object = None  # hf_zero.estimate.activations.LayerShape: what the activation count needs
    param_shapes: tuple = ()  # (dim0, numel, trainable) per parameter: FSDP2's padded dim-0 shards
    shard_groups: tuple = ()  # FSDP2's largest group and tail group (elements, trainable): hf_zero.estimate.fsdp
    quantizable: tuple = ()  # elements of each linear weight a 4-bit base (QLoRA) quantizes: nf4_bytes
    embeddings: tuple = ()  # elements of the input and output embedding weights (one if tied)
    fused_loss: tuple = ()  # the fused_cross_entropy modes ("auto", True) under which the run uses the fused loss
    liger: bool = False  # a model type Liger's kernels patch (plan.liger)
    # Each optimizer parameter group's trainable parameter sizes, in the order ZeRO flattens them (empty: unknown, all
    # in one group). ZeRO makes its flat fp32 copy of the gradients one group at a time, and ZeRO-2 partitions each
    # group's gradients apart (model_states.zero2_gradient_moments). The Trainer's groups are decay / no decay (biases
    # and norms); a composed model or a VLM has one pair per part (hf_zero.train.parts.group_sizes).
    trainable_groups: tuple = ()
    # Trainable elements of the linears and convolutions: autocast casts them to 16 bits and keeps each copy through
    # the step (its cache, then the matmul's saved input), where the weights that train are held in fp32 beside a
    # 16-bit frozen base (hf_zero.estimate.memory._peak).
    autocast_params: int = 0

    def persistent_params(self, threshold: int) -> int:  # ZeRO-3 keeps params with numel <= threshold whole
        return sum(n for n in self.param_numels if n <= threshold)

    @property
    def largest_group_params(self) -> int:
        """Trainable elements of the optimizer's largest parameter group (0: unknown)."""
        return max((sum(group) for group in self.trainable_groups), default=0)


def _attr(config, *names) -> int:
    return next((int(getattr(config, n)) for n in names if getattr(config, n, None)), 0)


def _embeddings(model, getter: str):
    """The model's input or output embedding module, None where it has none: transformers raises NotImplementedError
    for models without one (an image classifier's ResNet) instead of returning None."""
    try:
        return getattr(model, getter)() if hasattr(model, getter) else None
    except NotImplementedError:
        return None


def count_model(config_or_name, lora=None) -> ModelCount:
    """Counts from a config (or name/path, or an nn.Module) built on the meta device: no weights read. `lora`: a rank,
    a dict of LoraConfig fields (r, target_modules, lora_dropout, ...) or a LoraConfig; the real peft model is built
    on meta."""
    import torch
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if isinstance(config_or_name, torch.nn.Module):
        model, config, name = config_or_name, getattr(config_or_name, "config", None), type(config_or_name).__name__
    else:
        config, name = config_or_name, getattr(config_or_name, "name_or_path", "") or ""
        if isinstance(config, str) or hasattr(config, "__fspath__"):
            name, config = str(config), get_model_config(str(config))
        # The model class itself, not from_config: inside a ZeRO-3 run from_config would partition it (zero.Init).
        auto = AutoModelForCausalLM if type(config) in model_mapping(AutoModelForCausalLM) else \
            AutoModelForImageTextToText if type(config) in model_mapping(AutoModelForImageTextToText) else \
            AutoModel  # encoders; a vision-language model with its LM head
        with torch.device("meta"), without_zero3_init():  # a VLM's __init__ builds its parts with from_config
            known = type(config) in model_mapping(auto)
            model = model_mapping(auto)[type(config)](config) if known else auto.from_config(config)  # its ValueError
    causal = type(model).__name__ in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()
    if lora is not None:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=lora) if isinstance(lora, int) else LoraConfig(**lora) if isinstance(lora, dict) else lora
        with torch.device("meta"):
            model = get_peft_model(model, lora)
    params = list(model.parameters())  # deduplicated by identity: tied weights count once
    own = [list(m.parameters(recurse=False)) for m in model.modules()]  # a "layer": one module's own params
    layer, tlayer = (max((sum(p.numel() for p in ps if keep(p)) for ps in own), default=0)
                     for keep in (lambda p: True, lambda p: p.requires_grad))
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    shapes, groups = describe_shards(model)
    # transformers' bitsandbytes integration quantizes every linear but the output embeddings (get_keys_to_not_convert)
    head = _embeddings(model, "get_output_embeddings")
    quantizable = tuple(m.weight.numel() for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)
                        and m is not head and "lora_" not in name)
    embed = _embeddings(model, "get_input_embeddings")
    matmuls = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)
    cast = {id(p): p.numel() for m in model.modules() if isinstance(m, matmuls)
            for p in m.parameters(recurse=False) if p.requires_grad}
    tables = {id(w): w.numel() for w in (getattr(embed, "weight", None), getattr(head, "weight", None))
              if w is not None}
    # as the run decides (train.fused_ce.plan_fused_head): a causal LM whose lm_head is a plain Linear, then its config
    fused = tuple(m for m in ("auto", True) if causal and type(head) is torch.nn.Linear
                  and config_problem(text, m) is None)
    return ModelCount(
        fused_loss=fused, liger=getattr(text, "model_type", None) in liger_model_types(),
        total_params=sum(p.numel() for p in params), largest_layer_params=layer,
        trainable_params=sum(p.numel() for p in params if p.requires_grad), largest_trainable_layer_params=tlayer,
        num_layers=_attr(text, "num_hidden_layers", "n_layer", "num_layers"),
        hidden_size=_attr(text, "hidden_size", "d_model", "n_embd"),
        num_heads=_attr(text, "num_attention_heads", "n_head"), vocab_size=_attr(text, "vocab_size"),
        trainable_groups=tuple(group for group in (tuple(p.numel() for p in params if p.requires_grad
                                                         and (p.dim() >= 2) == decayed) for decayed in (True, False))
                               if group),
        param_numels=tuple(p.numel() for p in params), name=name, param_shapes=shapes, shard_groups=groups,
        quantizable=quantizable, embeddings=tuple(tables.values()), autocast_params=sum(cast.values()),
        layer=describe_layers(model, getattr(model, "config", config), text) if text is not None else None)


def nf4_bytes(count: ModelCount) -> tuple[int, int]:
    """(packed weights, quantization constants) of a 4-bit base as bitsandbytes holds it (NF4 in blocks of 64, double
    quantization): two weights a byte; per tensor an 8-bit absmax per block, an fp32 absmax per 256 blocks, an fp32
    offset and two fp32 code tables (16 NF4 levels, 256 for the 8-bit absmax). The constants are attributes of each
    weight (its quant_state), not parameters: no engine shards them."""
    blocks = [-(-n // 64) for n in count.quantizable]
    return sum(-(-n // 2) for n in count.quantizable), sum(b + 4 * -(-b // 256) + 4 + 4 * (16 + 256) for b in blocks)
