"""DeepSpeed's private names hf_zero reads (entries in registry.py): the Ulysses group DeepSpeed set up for the
Trainer, around which train/sequence_parallel.py rebuilds the batch adapter (deepspeed 0.19.8, accelerate 1.15.0).
They can go when accelerate's Ulysses adapter pads group batches to one length and skips what a resumed run
trained, or DeepSpeed offers a public handle on the group.

And the engine's module_state_dict, replaced while a LoRA checkpoint is saved (frozen_weights_left_out, an entry
in registry.py's PATCHES), so that a LoRA checkpoint under DeepSpeed holds no frozen weight, tied ones included.
The Trainer saves a PEFT model's DeepSpeed checkpoint with `exclude_frozen_parameters=True`, and DeepSpeed 0.19's
`module_state_dict` then deletes the frozen parameters it finds through `module.named_parameters()`. That lists a
tied weight once, under its first name (`embed_tokens.weight`), while the state dict holds it under both: the tied
`lm_head.weight` stayed in `mp_rank_00_model_states.pt`, the frozen base's output embedding in every ZeRO-1/2 LoRA
checkpoint (115 MiB of SmolLM2-135M's 129 MiB in fp32; under ZeRO-3 an empty placeholder). Resuming does not need it:
the Trainer loads a PEFT model's module states non-strictly, and the weights come from the base model as built.
Can go when DeepSpeed's module_state_dict drops every name of an excluded parameter.
"""

from __future__ import annotations

from contextlib import contextmanager

__all__ = ["ulysses_world_size", "ulysses_rank", "ulysses_group", "frozen_state_names", "frozen_weights_left_out",
           "before_gradients_freed", "gradients_freed_as_before"]


def ulysses_world_size() -> int:
    from deepspeed.utils import groups

    return groups._get_sequence_parallel_world_size()


def ulysses_rank() -> int:
    from deepspeed.utils import groups

    return groups._get_sequence_parallel_rank()


def ulysses_group():
    from deepspeed.utils import groups

    return groups._get_sequence_parallel_group()


def frozen_state_names(module) -> set[str]:
    """Every state-dict name of a frozen parameter, each tied alias included."""
    return {name for name, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad}


@contextmanager
def frozen_weights_left_out(engine):
    """While saving through a DeepSpeed engine: `exclude_frozen_parameters=True` leaves out every name of a frozen
    parameter, not only the first. Anything other than an engine with a `module_state_dict` is left alone."""
    original = getattr(engine, "module_state_dict", None)
    if original is None or not hasattr(engine, "module"):
        yield
        return

    def module_state_dict(*args, exclude_frozen_parameters=False, **kwargs):
        state = original(*args, exclude_frozen_parameters=exclude_frozen_parameters, **kwargs)
        if exclude_frozen_parameters and state is not None:
            prefix = kwargs.get("prefix", args[1] if len(args) > 1 else "")
            for name in frozen_state_names(engine.module):
                state.pop(prefix + name, None)
        return state

    engine.module_state_dict = module_state_dict
    try:
        yield
    finally:
        del engine.module_state_dict  # the class's method again


def before_gradients_freed(opt, callback) -> bool:
    """Until gradients_freed_as_before(opt): `callback()` runs each time the ZeRO-1/2 optimizer `opt` is about to
    free the source gradients (once its flat copy exists: the bench's memory snapshot point). False, and nothing
    changed, for an optimizer without that step.

    Shadows DeepSpeedZeroOptimizer.free_grad_in_param_list on the instance (deepspeed 0.19.8). Can go when
    DeepSpeed offers a hook before it frees the gradients."""
    free = getattr(opt, "free_grad_in_param_list", None)
    if not callable(free):
        return False

    def snapshot_then_free(params, _free=free):
        callback()
        return _free(params)

    opt.free_grad_in_param_list = snapshot_then_free
    return True


def gradients_freed_as_before(opt) -> None:
    del opt.free_grad_in_param_list  # back to the class's method
