"""FSDP2 (torch's `fully_shard`) under accelerate and the Trainer: the layer classes each shard group is built
around, handed to accelerate before the model is prepared (the one correction accelerate needs on a machine without
GPUs is hf_zero/integrations/accelerate.py's enable_fsdp_on_cpu). Its checkpoints: hf_zero/checkpoint/fsdp.py;
its rules, checked before a launch: hf_zero/plan/fsdp.py.
"""

from __future__ import annotations

from hf_zero.plan.fsdp import shard_layers

__all__ = ["announce_layers"]


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
