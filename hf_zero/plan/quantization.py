"""QLoRA's preconditions (a 4-bit base from bitsandbytes, adapters trained on it), checked before any process
starts (`hf-zero check`) and at the recipe's start. The BitsAndBytesConfig a QLoRA base
is loaded with (by the recipe, and again by `hf-zero export --merge-lora`)."""

from __future__ import annotations

import importlib.util

from hf_zero.core.errors import UserError
from hf_zero.plan.profiles import TORCH_DTYPES

__all__ = ["verify_quantization", "quantization_config"]


def verify_quantization(model_args, profile, gpus: int) -> str | None:
    """QLoRA's preconditions, for `hf-zero check` and the recipe's start: LoRA (a 4-bit base cannot train), and an
    engine that carries bitsandbytes' 4-bit weights: the Trainer alone (single_gpu, ddp), DeepSpeed ZeRO and FSDP2
    with or without CPU offload (both shard the packed weights stored as 16-bit elements), each run on 2 CPU ranks
    here; not NVMe offload (not tried: it swaps parameter partitions through files). None without load_in_4bit,
    else a one-line verdict."""
    if not model_args.load_in_4bit:
        return None
    if not model_args.use_peft:
        raise UserError("load_in_4bit", "a 4-bit base cannot be trained, only adapters on it",
                        "add use_peft: true (QLoRA) or drop load_in_4bit")
    if "nvme" in (profile.offload_param, profile.offload_optimizer):
        raise UserError("load_in_4bit", f"profile {profile.name} offloads to NVMe, which hf_zero does not run with a "
                        "4-bit base", "use a profile without NVMe, e.g. zero3_offload")
    if importlib.util.find_spec("bitsandbytes") is None:
        raise UserError("load_in_4bit", "bitsandbytes is not installed", "run `make install`")
    where = f"{gpus} GPU(s)" if gpus else "the CPU (bitsandbytes' CPU backend)"
    return f"QLoRA: NF4 base, double quantization, computing in {profile.precision}, on {where}"

def quantization_config(model_args, profile):
    """transformers' BitsAndBytesConfig for a QLoRA base (None without load_in_4bit): NF4 with double quantization
    (QLoRA's settings), computing in the profile's precision. Sharded (ZeRO, FSDP2) the packed weights are stored in
    that dtype too: the engine partitions and gathers them as ordinary floating-point tensors (accelerate leaves
    integer-stored ones out of FSDP2's sharding, whole on every rank)."""
    if not model_args.load_in_4bit:
        return None
    import torch
    from transformers import BitsAndBytesConfig

    compute = getattr(torch, TORCH_DTYPES[profile.precision])
    storage = compute if profile.uses_deepspeed or profile.uses_fsdp else torch.uint8
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=compute, bnb_4bit_quant_storage=storage)
