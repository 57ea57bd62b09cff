"""One kind of error for bad input: a single line naming the field and the fix, exit code 2, no traceback."""

from __future__ import annotations

import functools
import sys

__all__ = ["UserError", "exit_on_user_error", "EXIT_USAGE"]

EXIT_USAGE = 2


class UserError(Exception):
    """Bad input the user can fix. `field` names what is wrong, `fix` says what to do instead."""

    def __init__(self, field: str, problem: str, fix: str = ""):
        self.field, self.problem, self.fix = field, problem, fix
        super().__init__(self.line())

    def line(self) -> str:
        msg = f"{self.field}: {self.problem}"
        return f"{msg}; {self.fix}" if self.fix else msg


def exit_on_user_error(func):
    """Turn a UserError raised by `func` into one line on stderr and exit code 2.

    Only rank 0 of a multi-process launch prints, so a 2-rank run shows the message once.
    """

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        try:
            return func(*args, **kwargs)
        except UserError as err:
            import os

            if os.environ.get("RANK", "0") == "0" or getattr(err, "every_rank", False):
                print(f"hf-zero: error: {err.line()}", file=sys.stderr, flush=True)
            sys.exit(EXIT_USAGE)

    return wrapper
