"""Building the model: under ZeRO-3 with zero.Init (no rank ever holds the whole model), LoRA through peft."""

from __future__ import annotations

from contextlib import contextmanager

from hf_zero.core import startup
from hf_zero.core.console import say
from hf_zero.core.distributed import waiting_for
from hf_zero.core.errors import UserError
from hf_zero.data.chat_template import added_template_tokens, grow_embeddings, train_embeddings
from hf_zero.data.model_names import BASE_PATH_ATTR, get_model_config, hub_model_id, resolve_model_path
from hf_zero.estimate.measure import count_parameters
from hf_zero.integrations.bitsandbytes import keep_4bit_layout_on_cpu
from hf_zero.plan.arguments import ModelArguments
from hf_zero.plan.profiles import TORCH_DTYPES
from hf_zero.plan.quantization import quantization_config

__all__ = ["build_causal_lm", "drawing_nothing", "causal_lm_load_kwargs", "pick_attention", "apply_lora",
           "lora_kwargs", "count_parameters", "is_zero3_partitioned", "base_precision", "base_dtype",
           "trainable_in_fp32", "describe_weights"]



def base_precision(use_peft: bool, profile) -> str:
    """The precision the weights are loaded and stored in: a LoRA run's frozen base in the run's 16-bit precision
    (as TRL, axolotl and peft's guides load it: half the bytes, and autocast has nothing to cast), except under
    DeepSpeed, whose engine casts the whole model itself and keeps fp32 masters of what trains; fp32 otherwise (a
    full fine-tune keeps fp32 weights, the optimizer's master copy under the Trainer and FSDP2)."""
    return profile.precision if use_peft and profile.precision != "fp32" and not profile.uses_deepspeed else "fp32"


def base_dtype(use_peft: bool, profile):
    """base_precision as the torch dtype `from_pretrained` takes."""
    import torch

    return getattr(torch, TORCH_DTYPES[base_precision(use_peft, profile)])




def causal_lm_load_kwargs(model_args: ModelArguments, packing: bool = False, half: bool = False,
                          base: str = "fp32") -> dict:
    """`from_pretrained` keyword arguments of every causal LM hf_zero trains (the bench's plain baseline loads its
    model with exactly these): weights in `base` (see base_precision), and the attention implementation from
    `pick_attention`."""
    import torch

    kwargs = {"dtype": getattr(torch, TORCH_DTYPES[base])}
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
    say("[hf_zero] attention: flash_attention_2 (found flash-attn; packed rows take its varlen path)")
    return "flash_attention_2"


def build_causal_lm(model_args: ModelArguments, tokenizer, profile, packing: bool = False):
    """A causal LM for the run's `profile` (the run plan's): fp32, or for LoRA a 16-bit frozen base with fp32 adapters
    (base_precision). DeepSpeed casts to the profile's precision itself, the Trainer autocasts to 16 bits.

    TrainingArguments must already exist: its DeepSpeed config is what makes transformers wrap construction in
    `deepspeed.zero.Init` under ZeRO-3 (so that no rank ever holds the whole model).
    """
    from transformers import AutoModelForCausalLM

    kwargs = causal_lm_load_kwargs(model_args, packing, profile.precision != "fp32",
                                   base_precision(model_args.use_peft, profile))
    quantized = quantization_config(model_args, profile)
    if quantized is not None:
        import torch

        kwargs.update(quantization_config=quantized, dtype=quantized.bnb_4bit_compute_dtype)
        if torch.cuda.is_available() and not profile.uses_deepspeed:  # quantized on its own GPU as it loads
            import os

            kwargs["device_map"] = {"": int(os.environ.get("LOCAL_RANK", "0"))}
    path = resolve_model_path(model_args.model_name_or_path)
    vocab = getattr(get_model_config(path), "vocab_size", None)
    # Tokens a chat template added (hf_zero.data.chat_template) get new embedding rows; any other surplus is a
    # mismatch.
    if vocab is not None and len(tokenizer) - len(added_template_tokens(tokenizer)) > vocab:
        raise UserError("tokenizer_name_or_path", f"the tokenizer has {len(tokenizer)} tokens but the model only "
                        f"{vocab} embeddings", "use the model's own tokenizer")
    with waiting_for("the other ranks to build the model (zero.Init under ZeRO-3)"):
        startup.phase(f"building the model{' under zero.Init' if profile.zero_stage == 3 else ''}")
        with drawing_nothing():
            model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    grown = grow_embeddings(model, tokenizer, vocab)
    if quantized is not None:
        from peft import prepare_model_for_kbit_training

        # The Trainer turns on gradient checkpointing itself from the recipe.
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
        embeddings_in_16bit(model, quantized.bnb_4bit_compute_dtype)
        keep_4bit_layout_on_cpu(model)
    if model_args.use_peft:
        model = apply_lora(model, model_args, task_type="CAUSAL_LM")
        if grown:
            train_embeddings(model)
        trainable_in_fp32(model)
    return model


@contextmanager
def drawing_nothing():
    """Loading a pretrained base leaves the run's random state as it found it, under every engine: a plain load
    builds the model on the meta device (nothing drawn), zero.Init builds it on the device, where an `__init__` that
    calls torch.randn draws (CLIP's class_embedding, in LLaVA's vision tower). LoRA's initial weights, drawn next,
    then started elsewhere under ZeRO-3 than under DDP (lora_A 0.33 apart) and the two runs' losses parted at the
    first step that trained LoRA (issue 44)."""
    import torch

    # this rank's own GPU only: reading another device's random state would open a CUDA context on it
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if torch.cuda.is_available() else []):
        yield


def embeddings_in_16bit(model, dtype) -> None:
    """prepare_model_for_kbit_training upcasts every weight bitsandbytes left unquantized to fp32: right for the
    norms' statistics, but the frozen input and output embeddings are the largest of them (2 GiB more in fp32 for
    Llama-3.1-8B), and autocast casts the output head back to 16 bits for its matmul anyway. They stay in the compute
    dtype, as a 16-bit LoRA base holds them."""
    for layer in (model.get_input_embeddings(), model.get_output_embeddings()):
        weight = getattr(layer, "weight", None)
        if weight is not None and not weight.requires_grad and weight.is_floating_point():
            weight.data = weight.data.to(dtype)


def trainable_in_fp32(model) -> list[str]:
    """Keep what trains in fp32 next to a 16-bit frozen base: peft already does so for the adapters
    (get_peft_model's autocast_adapter_dtype), not for rows a LoRA run trains besides them (grown embeddings,
    modules_to_save). Adam on 16-bit weights would lose updates smaller than their rounding; accelerate's FSDP2
    preparation would upcast them anyway. Returns the names it cast."""
    import torch

    cast = []
    for name, param in model.named_parameters():
        if param.requires_grad and param.is_floating_point() and param.dtype != torch.float32:
            param.data = param.data.float()
            cast.append(name)
    return cast


def describe_weights(model, profile) -> str:
    """How the weights are held during the run, for the banner: "fp32", or "frozen base bf16, trainable fp32"."""
    names = {v: k for k, v in TORCH_DTYPES.items()}
    if any(hasattr(p, "quant_state") for p in model.parameters()):  # bitsandbytes' Params4bit: QLoRA
        rest = sorted({names.get(str(p.dtype).removeprefix("torch."), str(p.dtype)) for p in model.parameters()
                       if not p.requires_grad and p.is_floating_point() and not hasattr(p, "quant_state")})
        return f"frozen base NF4 (4-bit; the rest {', '.join(rest) or '-'}), trainable fp32"
    if profile.uses_deepspeed and profile.precision != "fp32":  # the engine casts the module when it wraps it
        return f"{profile.precision} (DeepSpeed casts them; fp32 master copy of what trains)"
    held = {train: {names.get(str(p.dtype).removeprefix("torch."), str(p.dtype)) for p in ps}
            for train in (False, True)
            if (ps := [p for p in model.parameters() if p.requires_grad == train and p.is_floating_point()])}
    frozen, trainable = (", ".join(sorted(held.get(k, ()))) for k in (False, True))
    if frozen and frozen != trainable:
        return f"frozen base {frozen}, trainable {trainable or '-'}"
    return trainable or frozen or "-"


def lora_kwargs(model_args: ModelArguments, task_type: str | None,
                modules_to_save: list[str] | None = None) -> dict:
    """peft `LoraConfig` arguments from the recipe (JSON-serialisable: the bench's plain baseline reads them)."""
    return {"r": model_args.lora_r, "lora_alpha": model_args.lora_alpha, "lora_dropout": model_args.lora_dropout,
            "target_modules": model_args.lora_target_modules, "task_type": task_type,
            "modules_to_save": modules_to_save}


def apply_lora(model, model_args: ModelArguments, task_type: str, modules_to_save: list[str] | None = None):
    from peft import LoraConfig, get_peft_model

    # peft records the base model's name_or_path (adapter_config's base_model_name_or_path) and config._name_or_path
    # (the model card's base_model), for offline models a folder in this machine's cache; both name its hub id
    # instead (the name as given for any other model), which a plain AutoPeftModel call resolves through the hub
    # cache offline, and on the hub elsewhere. Where it resolved here stays in summary.json and, from
    # BASE_PATH_ATTR, in each checkpoint's hf_zero_checkpoint.json.
    resolved = model.config.name_or_path
    model.name_or_path = model.config.name_or_path = hub_model_id(model_args.model_name_or_path)
    peft_model = get_peft_model(model, LoraConfig(**lora_kwargs(model_args, task_type, modules_to_save)))
    setattr(peft_model, BASE_PATH_ATTR, resolved)
    return peft_model


def is_zero3_partitioned(model) -> bool:
    """True when every base-model parameter is a ZeRO-3 partition: this rank holds only its shard, and the full
    tensor was never materialised here. (LoRA weights are created after zero.Init; the engine partitions them.)"""
    params = [p for n, p in model.named_parameters() if "lora_" not in n and "modules_to_save" not in n]
    return bool(params) and all(hasattr(p, "ds_id") and p.numel() == 0 for p in params)
