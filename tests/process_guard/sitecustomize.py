"""Imported at start-up by every Python process that a fast-tier test starts (tests/conftest.py puts this folder first
on their PYTHONPATH): a launcher, or a rank started by one, leaves a mark in $HF_ZERO_TEST_GROUP_MARKS, and the test
that started it fails. A test that starts a process group belongs to the `multiproc` tier, not to `make test-fast`."""

import os
import sys

_MARKS = os.environ.get("HF_ZERO_TEST_GROUP_MARKS")
if _MARKS:
    _argv = [os.path.basename(a) for a in getattr(sys, "orig_argv", sys.argv)]
    _LAUNCHERS = ("accelerate.commands.launch", "hf_zero.launch.launcher", "torch.distributed.run", "torchrun")
    _launcher = any(a in _LAUNCHERS for a in _argv) or ("accelerate" in _argv and "launch" in _argv)
    if _launcher or os.environ.get("TORCHELASTIC_RUN_ID"):  # torch elastic sets it in every rank it starts
        try:
            with open(os.path.join(_MARKS, str(os.getpid())), "w") as _f:
                _f.write(" ".join(getattr(sys, "orig_argv", sys.argv)))
        except OSError:  # the test already ended and removed its folder: nothing left to fail
            pass
