"""Imported at start-up by every Python process that a fast-tier test starts (tests/conftest.py puts this folder first
on their PYTHONPATH): a launcher, or a rank started by one, leaves a mark in $HF_ZERO_TEST_GROUP_MARKS, and the test
that started it fails. A test that starts a process group belongs to the `multiproc` tier, not to `make test-fast`."""

import os
import sys

_MARKS = os.environ.get("HF_ZERO_TEST_GROUP_MARKS")


def _is_launcher(argv: list) -> bool:
    """What this interpreter runs (`-m MODULE` or a script; not the arguments after it) is a launcher."""
    rest = argv[1:]
    for i, arg in enumerate(rest):
        if arg == "-m":
            return rest[i + 1:i + 2] in (["accelerate.commands.launch"], ["torch.distributed.run"],
                                         ["hf_zero.launch.launcher"])
        if arg == "-c":
            return False
        if not arg.startswith("-"):
            name = os.path.basename(arg)
            return name == "torchrun" or (name == "accelerate" and rest[i + 1:i + 2] == ["launch"])
    return False


if _MARKS:
    _argv = list(getattr(sys, "orig_argv", sys.argv))
    if _is_launcher(_argv) or os.environ.get("TORCHELASTIC_RUN_ID"):  # torch elastic sets it in every rank it starts
        try:
            with open(os.path.join(_MARKS, str(os.getpid())), "w") as _f:
                _f.write(" ".join(getattr(sys, "orig_argv", sys.argv)))
        except OSError:  # the test already ended and removed its folder: nothing left to fail
            pass

# Counting launches (a suite's cost): HF_ZERO_TEST_LAUNCH_LOG=<file> with this folder on PYTHONPATH appends one line
# per process group: its launcher, or rank 0 of ranks started in-process; its descendants inherit the mark below.
_LOG = os.environ.get("HF_ZERO_TEST_LAUNCH_LOG")
if _LOG and not os.environ.get("HF_ZERO_TEST_LAUNCH_LOGGED"):
    _argv = list(getattr(sys, "orig_argv", sys.argv))
    if _is_launcher(_argv) or (os.environ.get("TORCHELASTIC_RUN_ID") and os.environ.get("RANK", "0") == "0"):
        os.environ["HF_ZERO_TEST_LAUNCH_LOGGED"] = "1"
        with open(_LOG, "a") as _f:
            _f.write(f"{os.environ.get('PYTEST_CURRENT_TEST', '?')}\t{' '.join(_argv[1:6])}\n")
