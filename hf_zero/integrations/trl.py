"""TRL's private method hf_zero calls (an entry in registry.py)."""

from __future__ import annotations

__all__ = ["dpo_loss"]


def dpo_loss(view, model, batch):
    """The DPO loss (sigmoid, ipo) of `batch` and its reward metrics, as DPOTrainer computes them, on `view` (an
    object with the attributes the method reads: train/preference.py's _DPOView).

    Calls DPOTrainer._compute_loss (trl 1.16.0), which holds the losses with no function of its own, so that the
    loss is TRL's, not a copy. Can go when TRL exposes its DPO losses as functions."""
    from trl.trainer.dpo_trainer import DPOTrainer

    return DPOTrainer._compute_loss(view, model, batch, False)
