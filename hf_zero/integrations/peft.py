"""peft's behaviour hf_zero changes (an entry in registry.py's PATCHES)."""

from __future__ import annotations

import functools

__all__ = ["always_save_embedding_layers"]


def always_save_embedding_layers(model) -> None:
    """Every `model.save_pretrained(...)` of this PEFT model saves the embedding layers (new token rows).

    Replaces the instance's save_pretrained with a partial of PeftModel.save_pretrained (peft 0.21.2) with
    save_embedding_layers=True: with "auto", peft saves them only if it sees the vocabulary differ from the base
    model's config, which it does not read for a base named by a hub id it may not reach. Can go when peft's
    save_embedding_layers="auto" compares vocabulary sizes from the model it holds."""
    model.save_pretrained = functools.partial(type(model).save_pretrained, model, save_embedding_layers=True)
