"""One kind of error for bad input: a single line naming the field and the fix, exit code 2, no traceback.

Two more ways a run ends early without being a failure: `RunComplete` (the output folder already holds a finished
run: nothing to do, exit 0) and `RunInterrupted` (SIGINT/SIGTERM: every rank stopped cleanly, exit 128 + signal).
"""

from __future__ import annotations

import os

__all__ = ["UserError", "RunComplete", "RunInterrupted", "EXIT_USAGE", "VIA_MAKE_ENV", "flag_hint"]

EXIT_USAGE = 2
VIA_MAKE_ENV = "HF_ZERO_VIA_MAKE"  # set by `make train`: its recipe flags go in ARGS="..."


def flag_hint(flags: str) -> str:
    """Recipe flags suggested in a message, as the user passes them: `ARGS="--fresh_start true"` under make."""
    return f'ARGS="{flags}"' if os.environ.get(VIA_MAKE_ENV) == "1" else flags


class UserError(Exception):
    """Bad input the user can fix. `field` names what is wrong, `fix` says what to do instead."""

    def __init__(self, field: str, problem: str, fix: str = ""):
        self.field, self.problem, self.fix = field, problem, fix
        super().__init__(self.line())

    def line(self) -> str:
        msg = f"{self.field}: {self.problem}"
        return f"{msg}; {self.fix}" if self.fix else msg


class RunComplete(Exception):
    """The output folder holds a finished run; `message` says where its results are."""


class RunInterrupted(BaseException):
    """SIGINT/SIGTERM reached this rank. A BaseException, like KeyboardInterrupt, so no `except Exception` in a
    library swallows it."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(signum)
