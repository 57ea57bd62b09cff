"""transformers' TrainingArguments and Trainer without the peft they drag in, for every process that trains no
adapters: `hf-zero train`'s launcher (the checks and the run plan: no model at all) and a full fine-tune's ranks.

`transformers.training_args` imports `transformers.trainer_utils`, and `transformers.trainer` imports peft itself,
whenever peft is installed; peft imports every one of its tuners, bitsandbytes (with its CPU backend), scipy and
torch's compiler stack. That is about 4 s of CPU in the launcher (which builds no model) and about 1 s more in each
rank of a full fine-tune (whose transformers code is loaded anyway) for `isinstance` checks whose answer is no.
Here transformers is told peft is absent while those modules load; the names they would have taken from peft stand
in until peft itself is imported by whoever builds a LoRA model in this process (then they are peft's own classes,
checked as such). A LoRA run imports peft when it builds its model, as before.

Three assumptions about transformers 5.23.0's import code (registry.py: _is_package_available, PeftModel /
PeftMixedModel): it asks `import_utils._is_package_available("peft")`, its is_peft_available caches the answer
(cleared here after), and these two modules take those names from peft at their top. Can go when transformers
imports peft lazily. Weighed (docs/bench.md, 2026-11-28): importing TrainingArguments takes 1.8-2.7 s with it and
5.2-6.5 s without in a process that builds no model (`hf-zero train`'s launcher, check, estimate, preview), 3-4 s
of a start-up of about 10 s; in the ranks the bench sees no difference (start-up ratio 1.126 with, 1.119 without).
"""

from __future__ import annotations

import importlib
import sys

__all__ = ["HIDDEN", "import_training_args", "import_trainer"]

HIDDEN = ("peft",)  # what transformers is told is absent while its modules load (bitsandbytes comes with peft)
# What each module imports from peft at its top when peft is installed.
_PEFT_NAMES = {"transformers.trainer_utils": ("PeftModel", "PeftMixedModel"), "transformers.trainer": ("PeftModel",)}


class _PeftClass(type):
    """Stands in for a peft class in transformers' modules: no object is an instance of a peft class before
    peft is imported; after, the check is peft's own."""

    def __instancecheck__(cls, obj) -> bool:
        peft = sys.modules.get("peft")
        return peft is not None and isinstance(obj, getattr(peft, cls.__name__))


def import_training_args() -> None:
    """transformers.training_args (TrainingArguments and HfArgumentParser's needs) without peft."""
    _import_without_peft(("transformers.trainer_utils", "transformers.training_args"))


def import_trainer() -> type:
    """transformers' Trainer, imported without peft, for a rank: a LoRA run imports peft as it builds its model."""
    _import_without_peft(("transformers.trainer_utils", "transformers.training_args", "transformers.trainer"))
    from transformers.trainer import Trainer

    return Trainer


def _import_without_peft(modules: tuple[str, ...]) -> None:
    """Import `modules` with peft hidden, unless peft is imported already (then there is nothing to save) or they
    all are."""
    if "peft" in sys.modules or all(m in sys.modules for m in modules):
        return
    from transformers.utils import import_utils

    real = import_utils._is_package_available

    def hide(pkg_name: str, return_version: bool = False) -> tuple[bool, str]:
        return (False, "N/A") if pkg_name in HIDDEN else real(pkg_name, return_version)

    setattr(import_utils, "_is_package_available", hide)  # noqa: B010  (restored below; listed in integrations/registry.py)
    try:
        for name in modules:
            importlib.import_module(name)
    finally:
        setattr(import_utils, "_is_package_available", real)  # noqa: B010
        import_utils.is_peft_available.cache_clear()  # it remembered "absent": whoever asks later gets the truth
    for module, names in _PEFT_NAMES.items():
        loaded = sys.modules.get(module)
        for name in names if loaded is not None else ():
            if not hasattr(loaded, name):
                setattr(loaded, name, _PeftClass(name, (), {}))
