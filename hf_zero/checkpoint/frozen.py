"""No frozen weight in a LoRA checkpoint under DeepSpeed, tied ones included.

The Trainer saves a PEFT model's DeepSpeed checkpoint with `exclude_frozen_parameters=True`, and DeepSpeed 0.19's
`module_state_dict` then deletes the frozen parameters it finds through `module.named_parameters()`. That lists a
tied weight once, under its first name (`embed_tokens.weight`), while the state dict holds it under both: the tied
`lm_head.weight` stayed in `mp_rank_00_model_states.pt`, the frozen base's output embedding in every ZeRO-1/2 LoRA
checkpoint (115 MiB of SmolLM2-135M's 129 MiB in fp32; under ZeRO-3 an empty placeholder). Resuming does not need it:
the Trainer loads a PEFT model's module states non-strictly, and the weights come from the base model as built.
"""

from __future__ import annotations

from contextlib import contextmanager

__all__ = ["frozen_state_names", "frozen_weights_left_out"]


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
