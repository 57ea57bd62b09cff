"""huggingface_hub's state hf_zero changes (an entry in registry.py's PATCHES)."""

from __future__ import annotations

import os

__all__ = ["go_offline"]


def go_offline() -> None:
    """The hub is offline for this process and the processes it starts: a hub id fails at once with the one line
    instead of after huggingface_hub's retries.

    Sets huggingface_hub.constants.HF_HUB_OFFLINE (read at each call by huggingface_hub and transformers 5.23.0;
    the environment variable is read only at import). Can go when huggingface_hub fails fast when offline."""
    from huggingface_hub import constants

    os.environ["HF_HUB_OFFLINE"] = "1"  # for the processes this one starts
    constants.HF_HUB_OFFLINE = True
