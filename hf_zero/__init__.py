"""hf_zero: one fine-tuning recipe from a laptop CPU to a SLURM cluster.

A thin layer over Accelerate, the transformers Trainer, DeepSpeed ZeRO and PEFT. Heavy libraries are imported
inside functions so that `hf-zero --help` answers at once.
"""

import os as _os
import sys as _sys

__version__ = "0.1.0"
__all__ = ["__version__", "UserError"]

# torch JIT-builds DeepSpeed's ops with the first `ninja` on PATH. The venv has ninja 1.13 (a DeepSpeed dependency),
# Debian's ninja-build is 1.11; each discards the other's build log (v7 vs v5), so a process that finds the other
# one rebuilds every op from scratch (async_io ~280 s, cpu_adam ~75 s). Every hf_zero process uses the venv's.
_BIN = _os.path.dirname(_sys.executable)
if _os.path.isfile(_os.path.join(_BIN, "ninja")) and _os.environ.get("PATH", "").split(_os.pathsep)[0] != _BIN:
    _os.environ["PATH"] = _BIN + _os.pathsep + _os.environ.get("PATH", "")
# ... and keeps the ops it builds in the venv. torch's default folder (~/.cache/torch_extensions) is shared by every
# environment of the user: an op is built against one venv's headers, so two checkouts (or a clean clone beside a
# working one) rebuild each other's ops at every switch (measured: a `make test-fast` of 386 s instead of 160 s,
# async_io, pin_memory and shm comm built again). An explicit TORCH_EXTENSIONS_DIR is kept.
if _sys.prefix != _sys.base_prefix and "TORCH_EXTENSIONS_DIR" not in _os.environ:
    _os.environ["TORCH_EXTENSIONS_DIR"] = _os.path.join(_sys.prefix, "torch_extensions")

from hf_zero.core.console import VERBOSE_ENV as _VERBOSE_ENV  # noqa: E402
from hf_zero.core.console import quiet_loggers as _quiet_loggers  # noqa: E402
from hf_zero.core.errors import UserError  # noqa: E402

_quiet_loggers(_os.environ.get(_VERBOSE_ENV) != "1")
