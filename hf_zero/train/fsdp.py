"""FSDP2 (torch's `fully_shard`) under accelerate and the Trainer: the one correction accelerate needs on a machine
without GPUs, and the layer classes each shard group is built around, handed to accelerate before the model is
prepared. Its checkpoints: hf_zero/checkpoint/fsdp.py; its rules, checked before a launch: hf_zero/plan/fsdp.py.
"""

from __future__ import annotations

import os

from hf_zero.plan.fsdp import shard_layers

__all__ = ["enable_fsdp_on_cpu", "announce_layers"]


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
