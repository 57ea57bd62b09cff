"""Checkpoints: which one to resume from."""

from __future__ import annotations

from pathlib import Path

__all__ = ["find_resume_checkpoint"]


def find_resume_checkpoint(output_dir: str) -> str | None:
    """The latest checkpoint-N folder in output_dir, or None to start fresh."""
    from transformers.trainer_utils import get_last_checkpoint

    if not Path(output_dir).is_dir():
        return None
    return get_last_checkpoint(output_dir)
