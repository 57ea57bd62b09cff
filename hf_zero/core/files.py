"""Small shared pieces: atomic file writes and byte counts for people."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

__all__ = ["write_text_atomic", "write_json_atomic", "human_bytes"]


def write_text_atomic(path, text: str, durable: bool = False) -> None:
    """A reader (another rank, a resume, the launcher) sees the old file or the whole new one, never half of it.
    `durable` also flushes it to disk first (checkpoint manifests and metadata must survive a power cut)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")  # per process: two writers never share a temp file
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as err:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        if err.filename is None:  # write() does not say which file: a full disk is reported with it
            err.filename = str(path)
        raise


def write_json_atomic(path, data, durable: bool = False) -> None:
    write_text_atomic(path, json.dumps(data, indent=2, default=str), durable)


_UNITS = {"TiB": 2**40, "GiB": 2**30, "MiB": 2**20, "KiB": 2**10}


def human_bytes(b: float, digits: int = 1, unit: str | None = None, grouped: bool = False) -> str:
    """Bytes for a person: in the largest unit that keeps the figure >= 1, or in `unit` (KiB to TiB) for columns that
    compare; `grouped`: thousands separated by commas."""
    sep = "," if grouped else ""
    if unit is not None:
        return f"{b / _UNITS[unit]:{sep}.{digits}f} {unit}"
    for name, size in _UNITS.items():
        if b >= size:
            return f"{b / size:{sep}.{digits}f} {name}"
    return f"{int(b)} B"
