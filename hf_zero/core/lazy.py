"""`TrainerCallback` as a base class, imported when a callback class is defined rather than at the top of modules
that commands like `hf-zero check` and `estimate` import for their pure logic (the stage schedule, resume rules):
they stay free of transformers' import time."""

from __future__ import annotations

__all__ = ["trainer_callback"]


def trainer_callback():
    from transformers import TrainerCallback

    return TrainerCallback
