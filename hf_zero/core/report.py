"""How a rank's one-line error reaches the person at the launcher, printed once (see hf_zero.launch.worker for the
three ways a run is started): a status folder read by hf_zero's launcher (STATUS_ENV), torch elastic's error file
under a plain torchrun / `accelerate launch`, or stderr on rank 0 when alone."""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

from hf_zero.core.console import rank
from hf_zero.core.errors import RunInterrupted, UserError
from hf_zero.core.files import write_json_atomic

__all__ = ["STATUS_ENV", "write_status", "read_status", "report_user_error"]

STATUS_ENV = "HF_ZERO_STATUS_DIR"


def write_status(name: str, data: dict) -> None:
    folder = os.environ.get(STATUS_ENV)
    if not folder:
        return
    write_json_atomic(Path(folder) / name, data)


def read_status(folder, name: str) -> dict | None:
    try:
        return json.loads((Path(folder) / name).read_text())
    except (OSError, ValueError):
        return None


def _elastic_error_file(message) -> None:
    """torch elastic's error file: its launcher reads the root cause from here (a str message is its short form)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        with open(path, "w") as f:
            json.dump(message, f)


def _gist(line) -> str:
    """A report without its figures: two ranks out of disk space see different free bytes, but it is one report."""
    return re.sub(r"\d+(\.\d+)?( ?[KMGT]i?B\b| B\b)?", "#", str(line))


def _reported_by_another_rank(line: str) -> bool:
    """Whether a rank on this machine already wrote `line` to its torch elastic error file (they sit side by side
    in one folder per local rank); the first rank's report is the root cause, a second copy would repeat it."""
    mine = Path(os.environ["TORCHELASTIC_ERROR_FILE"])
    for other in mine.parent.parent.glob(f"*/{mine.name}"):
        try:
            if other != mine and _gist(json.loads(other.read_text()).get("message")) == _gist(line):
                return True
        except (OSError, ValueError, AttributeError):
            continue
    return False


def report_user_error(err: UserError) -> None:
    """The one line, printed once: by hf_zero's launcher, torchrun's failure report, or rank 0 when alone."""
    line = f"hf-zero: error: {err.line()}"
    write_status(f"error-rank{rank()}.json", {"kind": "user", "rank": rank(), "line": line,
                                              "lost_rank": getattr(err, "lost_rank", False)})
    if os.environ.get("TORCHELASTIC_ERROR_FILE") and not os.environ.get(STATUS_ENV):
        if rank() != 0:
            # Every rank usually finds the same mistake: wait for torchrun to stop this rank once rank 0 has failed
            # (a loaded machine can take seconds to notice), so the line is listed once, as rank 0's root cause.
            # A mistake only this rank sees (a file missing on one node) is reported after the wait.
            try:
                time.sleep(30)
            except RunInterrupted as stop:  # stopped by torchrun: rank 0's report stands
                sys.stdout.flush()
                sys.stderr.flush()
                sys.exit(128 + stop.signum)
        if not _reported_by_another_rank(line):
            _elastic_error_file({"message": line, "timestamp": int(time.time())})
    elif not os.environ.get(STATUS_ENV) and (rank() == 0 or getattr(err, "every_rank", False)):
        print(line, file=sys.stderr, flush=True)
