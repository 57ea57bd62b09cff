"""hf_zero's Trainer subclass uses public hooks, except the one private method crash-safe checkpoints need
(hf_zero/checkpoint/staging.py says why). This fails loudly when transformers renames or reshapes what it relies on."""

import inspect
from types import SimpleNamespace

from transformers import Trainer

ALLOWED_PRIVATE = {"_save_checkpoint"}


def test_only_the_checkpoint_hook_overrides_a_private_trainer_method():
    from hf_zero.train.trainer import CurriculumTrainer  # both recipes' Trainer

    overridden = set()
    for klass in CurriculumTrainer.__mro__:
        if klass.__module__.startswith("hf_zero"):
            overridden |= {name for name in vars(klass) if name.startswith("_") and not name.startswith("__")
                           and hasattr(Trainer, name)}
    assert overridden == ALLOWED_PRIVATE


def test_the_private_checkpoint_hook_is_still_what_staging_assumes():
    assert list(inspect.signature(Trainer._save_checkpoint).parameters) == ["self", "model", "trial"]
    # Staging works only because the Trainer places checkpoint-N under the folder _get_output_dir names, and that
    # folder is args.output_dir outside a hyperparameter search.
    assert "self._get_output_dir(trial=trial)" in inspect.getsource(Trainer._save_checkpoint)
    trainer = SimpleNamespace(hp_search_backend=None, args=SimpleNamespace(output_dir="/staged/root"))
    assert Trainer._get_output_dir(trainer, trial=None) == "/staged/root"
