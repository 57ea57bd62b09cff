"""transformers' TrainingArguments for a process that only parses a recipe (`hf-zero train`'s launcher: the checks
and the run plan), without the peft it drags in.

`transformers.training_args` imports `transformers.trainer_utils`, which imports peft whenever peft is installed, and
peft imports every one of its tuners, transformers' modeling code, bitsandbytes, scipy and torch's compiler stack:
about 4 s of CPU for two `isinstance` checks the launcher never makes (it builds no model). The ranks import all of
it anyway; in the launcher it was pure duplicate work before every launch. Here transformers is told peft is absent
while those two modules load; the two names trainer_utils would have taken from peft stand in until peft itself is
imported by whoever builds a model in this process (then they are peft's own classes, checked as such).
"""

from __future__ import annotations

import sys

__all__ = ["HIDDEN", "import_training_args"]

HIDDEN = ("peft",)  # what transformers is told is absent while TrainingArguments loads (bitsandbytes comes with peft)
_PEFT_NAMES = ("PeftModel", "PeftMixedModel")  # what transformers.trainer_utils imports from peft


class _PeftClass(type):
    """Stands in for a peft class in transformers.trainer_utils: no object is an instance of a peft class before
    peft is imported; after, the check is peft's own."""

    def __instancecheck__(cls, obj) -> bool:
        peft = sys.modules.get("peft")
        return peft is not None and isinstance(obj, getattr(peft, cls.__name__))


def import_training_args() -> None:
    """Import transformers.training_args (and with it TrainingArguments and HfArgumentParser's needs) without peft,
    unless it is already imported (then there is nothing to save)."""
    if "transformers.trainer_utils" in sys.modules or "peft" in sys.modules:
        return
    from transformers.utils import import_utils

    real = import_utils._is_package_available

    def hide(pkg_name: str, return_version: bool = False) -> tuple[bool, str]:
        return (False, "N/A") if pkg_name in HIDDEN else real(pkg_name, return_version)

    setattr(import_utils, "_is_package_available", hide)  # noqa: B010  (restored below; listed in core/internals.py)
    try:
        import transformers.trainer_utils as trainer_utils
        import transformers.training_args  # noqa: F401
    finally:
        setattr(import_utils, "_is_package_available", real)  # noqa: B010
        import_utils.is_peft_available.cache_clear()  # it remembered "absent": whoever asks later gets the truth
    for name in _PEFT_NAMES:
        if not hasattr(trainer_utils, name):
            setattr(trainer_utils, name, _PeftClass(name, (), {}))
