"""accelerate's state hf_zero changes (entries in registry.py's PATCHES)."""

from __future__ import annotations

import os

__all__ = ["enable_fsdp_on_cpu", "set_ulysses_attention"]


def enable_fsdp_on_cpu(trainer) -> bool:
    """Turn the Trainer's accelerator into the FSDP one the launcher asked for, on a machine without GPUs.

    accelerate 1.15 only honours ACCELERATE_USE_FSDP for GPU-like backends: on CPU it builds a MULTI_CPU state and
    trains plain DDP without a word (measured here: the "FSDP" run's losses equal DDP's because it *is* DDP).
    FSDP2 itself runs on CPU over gloo, so the state gets the FSDP plugin accelerate would have given it, before
    the model is prepared. Returns True when it changed something.

    Sets AcceleratorState.distributed_type / fsdp_plugin (accelerate 1.15.0) and the Trainer's is_fsdp_enabled
    (transformers 5.23.0). Can go the day accelerate honours ACCELERATE_USE_FSDP on a MULTI_CPU state
    (tests/test_library_internals.py checks that it still does not).
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


def set_ulysses_attention(parallelism_config, attn_implementation: str | None) -> None:
    """Ulysses wraps the attention the model really uses: DeepSpeed compares the name accelerate gives it with the
    model's. Sets ParallelismConfig.sp_handler.sp_attn_implementation (accelerate 1.15.0, deepspeed 0.19.8), which
    accelerate fills from its own default; can go when accelerate reads the model's attention itself."""
    parallelism_config.sp_handler.sp_attn_implementation = attn_implementation
