"""hf_zero's Trainer subclasses use public hooks, except the two private methods crash-safe checkpoints need
(hf_zero/checkpoint/write.py says why). This fails loudly when transformers renames or reshapes them."""

import inspect

from transformers import Trainer

ALLOWED_PRIVATE = {"_save_checkpoint", "_get_output_dir"}


def test_only_the_two_checkpoint_hooks_override_private_trainer_methods():
    from hf_zero.train.trainer import CurriculumTrainer  # both recipes' Trainer

    overridden = set()
    for cls in [CurriculumTrainer]:
        for klass in cls.__mro__:
            if klass.__module__.startswith("hf_zero"):
                overridden |= {name for name in vars(klass) if name.startswith("_") and not name.startswith("__")
                               and hasattr(Trainer, name)}
    assert overridden <= ALLOWED_PRIVATE, overridden - ALLOWED_PRIVATE


def test_the_private_checkpoint_hooks_are_still_what_checkpoint_write_assumes():
    assert list(inspect.signature(Trainer._save_checkpoint).parameters) == ["self", "model", "trial"]
    assert list(inspect.signature(Trainer._get_output_dir).parameters) == ["self", "trial"]
    # The staging area works only because the Trainer asks _get_output_dir where checkpoint-N goes.
    assert "self._get_output_dir(trial=trial)" in inspect.getsource(Trainer._save_checkpoint)
