"""Processes hf_zero starts that must not outlive the one that started them: DeepSpeed's `ds_to_universal`, run
as a child of a rank (a resume on another rank count) or of `hf-zero convert`, keeps writing its `.partial` folder
after a SIGKILL of its parent unless the kernel is told to end it too (hf_zero/launch/parent_watch.py does the same
for the ranks under their launcher)."""

from __future__ import annotations

import os
import signal
import sys

__all__ = ["PR_SET_PDEATHSIG", "set_death_signal", "dies_with_parent"]

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _prctl():
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    return ctypes.CDLL(None, use_errno=True).prctl


def set_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send `sig` to this process when the thread that started it ends (Linux only; False
    elsewhere)."""
    prctl = _prctl()
    return prctl is not None and prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0


def dies_with_parent():
    """A `preexec_fn` for subprocess: the child is SIGKILLed when this process ends, however it ends (SIGKILL and
    the OOM killer included). Start the child from the thread that lives as long as the process (the kernel ties
    the signal to the starting thread)."""
    parent, kill = os.getpid(), int(signal.SIGKILL)
    # Resolved here: the forked child runs no import (another thread may have held the import lock at the fork).
    prctl = _prctl()

    def _in_child() -> None:
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, kill, 0, 0, 0)
        if os.getppid() != parent:  # the parent died between fork and prctl: nobody would signal this child
            os._exit(128 + kill)

    return _in_child
