"""Building the model: under ZeRO-3 with zero.Init (no rank ever holds the whole model), LoRA through peft."""

from __future__ import annotations

from hf_zero.core.config import ModelArguments
from hf_zero.data.model_names import get_model_config, resolve_model_path

__all__ = ["build_causal_lm", "causal_lm_load_kwargs", "pick_attention", "apply_lora", "lora_kwargs",
           "count_parameters", "is_zero3_partitioned"]


def causal_lm_load_kwargs(model_args: ModelArguments, packing: bool = False, half: bool = False) -> dict:
    """`from_pretrained` keyword arguments of every causal LM hf_zero trains (the bench's plain baseline loads its
    model with exactly these): fp32 weights, and the attention implementation from `pick_attention`."""
    import torch

    kwargs = {"dtype": torch.float32}
    attention = pick_attention(model_args, packing, half)
    if attention:
        kwargs["attn_implementation"] = attention
    return kwargs


def pick_attention(model_args: ModelArguments, packing: bool, half: bool) -> str | None:
    """The recipe's attention implementation; if it names none, flash_attention_2 for packed rows on a GPU in bf16
    or fp16 with flash-attn installed (packed rows then take its varlen path instead of a materialised block mask,
    which keeps sdpa off its flash kernel); else the model's default. Flash attention has no fp32 kernel."""
    if model_args.attn_implementation or not (packing and half):
        return model_args.attn_implementation
    import torch
    from transformers.utils import is_flash_attn_2_available

    if not (torch.cuda.is_available() and is_flash_attn_2_available()):
        return None
    from hf_zero.train.run import main_process_print

    main_process_print("[hf_zero] attention: flash_attention_2 (found flash-attn; packed rows take its varlen path)")
    return "flash_attention_2"


def build_causal_lm(model_args: ModelArguments, tokenizer, packing: bool = False, half: bool = False):
    """A causal LM in fp32 (DeepSpeed casts to the profile's precision itself, the Trainer autocasts to `half`).

    TrainingArguments must already exist: its DeepSpeed config is what makes transformers wrap construction in
    `deepspeed.zero.Init` under ZeRO-3 (pain-points #8).
    """
    from transformers import AutoModelForCausalLM

    kwargs = causal_lm_load_kwargs(model_args, packing, half)
    path = resolve_model_path(model_args.model_name_or_path)
    vocab = getattr(get_model_config(path), "vocab_size", None)
    from hf_zero.data.chat_template import added_template_tokens, grow_embeddings, train_embeddings

    # Tokens a chat template added (hf_zero.data.chat_template) get new embedding rows; any other surplus is a
    # mismatch.
    if vocab is not None and len(tokenizer) - len(added_template_tokens(tokenizer)) > vocab:
        from hf_zero.core.errors import UserError

        raise UserError("tokenizer_name_or_path", f"the tokenizer has {len(tokenizer)} tokens but the model only "
                        f"{vocab} embeddings", "use the model's own tokenizer")
    from hf_zero.core.distributed import waiting_for

    with waiting_for("the other ranks to build the model (zero.Init under ZeRO-3)"):
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    grown = grow_embeddings(model, tokenizer, vocab)
    if model_args.use_peft:
        model = apply_lora(model, model_args, task_type="CAUSAL_LM")
        if grown:
            train_embeddings(model)
    return model


def lora_kwargs(model_args: ModelArguments, task_type: str | None,
                modules_to_save: list[str] | None = None) -> dict:
    """peft `LoraConfig` arguments from the recipe (JSON-serialisable: the bench's plain baseline reads them)."""
    return {"r": model_args.lora_r, "lora_alpha": model_args.lora_alpha, "lora_dropout": model_args.lora_dropout,
            "target_modules": model_args.lora_target_modules, "task_type": task_type,
            "modules_to_save": modules_to_save}


def apply_lora(model, model_args: ModelArguments, task_type: str, modules_to_save: list[str] | None = None):
    from peft import LoraConfig, get_peft_model

    # peft records the base model's name_or_path, for offline models a folder in this machine's cache; the adapter
    # names the model as the user did instead, so it loads wherever that name resolves (the resolved path stays in
    # config._name_or_path, summary.json and each checkpoint's hf_zero_checkpoint.json).
    model.name_or_path = model_args.model_name_or_path
    return get_peft_model(model, LoraConfig(**lora_kwargs(model_args, task_type, modules_to_save)))


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
