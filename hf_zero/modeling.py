"""Building the model: under ZeRO-3 with zero.Init (no rank ever holds the whole model), LoRA through peft."""

from __future__ import annotations

from .config import ModelArguments
from .models import get_model_config, resolve_model_path

__all__ = ["build_causal_lm", "apply_lora", "count_parameters", "is_zero3_partitioned"]


def build_causal_lm(model_args: ModelArguments, tokenizer):
    """A causal LM in fp32 (DeepSpeed casts to the profile's precision itself).

    TrainingArguments must already exist: its DeepSpeed config is what makes transformers wrap construction in
    `deepspeed.zero.Init` under ZeRO-3 (pain-points #8).
    """
    import torch
    from transformers import AutoModelForCausalLM

    kwargs = {"dtype": torch.float32}
    if model_args.attn_implementation:
        kwargs["attn_implementation"] = model_args.attn_implementation
    path = resolve_model_path(model_args.model_name_or_path)
    vocab = getattr(get_model_config(path), "vocab_size", None)
    if vocab is not None and len(tokenizer) > vocab:
        from .errors import UserError

        raise UserError("tokenizer_name_or_path", f"the tokenizer has {len(tokenizer)} tokens but the model only "
                        f"{vocab} embeddings", "use the model's own tokenizer")
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    if model_args.use_peft:
        model = apply_lora(model, model_args, task_type="CAUSAL_LM")
    return model


def apply_lora(model, model_args: ModelArguments, task_type: str, modules_to_save: list[str] | None = None):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=model_args.lora_r,
        lora_alpha=model_args.lora_alpha,
        lora_dropout=model_args.lora_dropout,
        target_modules=model_args.lora_target_modules,
        task_type=task_type,
        modules_to_save=modules_to_save,
    )
    # peft records the base model's name_or_path, for offline models a folder in this machine's cache; the adapter
    # names the model as the user did instead, so it loads wherever that name resolves (the resolved path stays in
    # config._name_or_path, summary.json and each checkpoint's hf_zero_checkpoint.json).
    model.name_or_path = model_args.model_name_or_path
    return get_peft_model(model, config)


def _numel(p) -> int:
    # Under ZeRO-3 a parameter's local tensor is empty; ds_numel is its full size.
    return getattr(p, "ds_numel", p.numel())


def count_parameters(model) -> tuple[int, int]:
    """(trainable, total) parameters, counted at full size even when partitioned."""
    trainable = total = 0
    for p in model.parameters():
        n = _numel(p)
        total += n
        trainable += n if p.requires_grad else 0
    return trainable, total


def is_zero3_partitioned(model) -> bool:
    """True when every base-model parameter is a ZeRO-3 partition: this rank holds only its shard, and the full
    tensor was never materialised here. (LoRA weights are created after zero.Init; the engine partitions them.)"""
    params = [p for n, p in model.named_parameters() if "lora_" not in n and "modules_to_save" not in n]
    return bool(params) and all(hasattr(p, "ds_id") and p.numel() == 0 for p in params)
