"""A console a person reads: rank 0 only, the libraries' noise off unless HF_ZERO_VERBOSE=1 (`--verbose`), and
hf_zero's own lines written through the progress bar so they never glue to it. What a training run prints per step
and per evaluation, and its time left, are in hf_zero.core.progress."""

from __future__ import annotations

import contextlib
import os
import sys

__all__ = ["VERBOSE_ENV", "QUIET_ENV", "QUIET_WARNINGS", "QUIET_LOGGERS", "rank", "quiet_environment", "quiet_loggers",
           "setup_console", "verbose", "say", "progress_prints"]

VERBOSE_ENV = "HF_ZERO_VERBOSE"


def rank() -> int:
    """This process's rank in the run (0 when not launched by torchrun / accelerate)."""
    return int(os.environ.get("RANK", "0"))


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV) == "1"


# Library warnings nobody running hf_zero can act on, by category and the module that raises them (a regex matched at
# the start of the module's name): the stack's deprecations, meant for its maintainers (a run would print hundreds),
# and PEFT's two notes after every LoRA save (it looks the base model up on the hub to learn whether its vocabulary
# changed; offline, or with a model built from a config, it cannot, and says so); and accelerate's note, per rank,
# that it set the CPU threads itself where OMP_NUM_THREADS was unset (its default stays; only the note goes).
QUIET_WARNINGS = ((FutureWarning, ""), (UserWarning, r"peft\."), (UserWarning, r"accelerate\.state"))
# Libraries with no switch but their logger: bitsandbytes, on a CPU with AVX512-BF16, warns as it loads (peft loads it)
# that it cannot fetch an optional fused kernel from the hub (kernels-community) and goes on with its own.
QUIET_LOGGERS = ("bitsandbytes",)
# The libraries' own switches, as environment variables: read when each library loads, in this process and in every
# process started from it (the ranks).
QUIET_ENV = {
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",  # weight loading / shard writing bars, one per rank
    "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
    "TQDM_DISABLE": "1",  # bars made with tqdm directly (DeepSpeed's zero_to_fp32, GGUF conversion)
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    "TRANSFORMERS_VERBOSITY": "error",  # notices such as the embedding resize and the LOAD REPORT table
    "DATASETS_VERBOSITY": "error",
    "HF_HUB_VERBOSITY": "error",
}


def quiet_environment(env=os.environ) -> None:
    """The one rule for the console, applied at every entry (the `hf-zero` command, the recipes' ranks): the
    libraries' warnings and progress bars are off unless HF_ZERO_VERBOSE=1 (`--verbose`). Through the libraries'
    own switches only, so their errors still show: the environment variables above (set before torch, DeepSpeed
    or the hub libraries load), the same switches called on a library this process has loaded already, and the
    warnings filters above."""
    quiet_loggers(env.get(VERBOSE_ENV) != "1")
    if env.get(VERBOSE_ENV) == "1":
        return
    import warnings

    for category, module in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", category=category, module=module)
    for key, value in QUIET_ENV.items():
        env.setdefault(key, value)
    _quiet_loaded_libraries()
    if "DS_ACCELERATOR" not in env:
        import torch  # only here: `hf-zero --help` never reaches it; every command loads torch anyway

        if not torch.cuda.is_available():
            # Named up front, DeepSpeed skips its probe and the "Setting accelerator to CPU" warning per process.
            env["DS_ACCELERATOR"] = "cpu"


def quiet_loggers(quiet: bool) -> None:
    """QUIET_LOGGERS at ERROR (their errors still show), or back to the default for `--verbose`. Also called as
    hf_zero is first imported (hf_zero/__init__.py): these libraries log as they load, and a recipe imports them
    before its entry sets up the console."""
    import logging

    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR if quiet else logging.NOTSET)


def _quiet_loaded_libraries() -> None:
    """A library loaded before the console was set up (a recipe imports transformers at its top, before its entry
    runs) has read its environment already: its own switch, called here. A library not loaded yet is not loaded
    for this; it reads the environment when it is. tqdm itself has no switch after import: the libraries' bars
    go through their own wrappers, switched off here."""
    if "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    if "transformers" in sys.modules:
        from transformers.utils import logging as transformers_logging

        transformers_logging.set_verbosity_error()
        transformers_logging.disable_progress_bar()
    if "datasets" in sys.modules:
        from datasets.utils import logging as datasets_logging

        datasets_logging.set_verbosity_error()
        datasets_logging.disable_progress_bar()


def setup_console() -> None:
    """At the recipe's entry, before torch, DeepSpeed or transformers load."""
    quiet_environment()
    if verbose():
        return
    if rank() != 0:
        # Every rank prints the same lines; one copy is enough. A failing rank's traceback still reaches the
        # launcher through its error file (hf_zero.launch.worker).
        sys.stdout.flush()
        sys.stderr.flush()
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        os.close(devnull)


@contextlib.contextmanager
def progress_prints():
    """Around a library call that reports its progress with print() and has no switch for it (DeepSpeed's
    zero_to_fp32 reader): its stdout goes nowhere unless verbose. Only stdout: its warnings (stderr) and its
    errors (exceptions) still show."""
    if verbose():
        yield
        return
    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
        yield


def say(*parts) -> None:
    """Print a line on rank 0 without breaking a progress bar that is on screen."""
    if rank() != 0:
        return
    from tqdm.auto import tqdm

    tqdm.write(" ".join(str(p) for p in parts), file=sys.stdout)
    sys.stdout.flush()
