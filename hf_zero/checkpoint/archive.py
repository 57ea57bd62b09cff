"""A finished run asked to train again (`--fresh_start true`, `--resume_from_checkpoint` on it, or a start that finds
no checkpoint) moves what the earlier run wrote to an archive folder in output_dir, so the new run overwrites none of
it: previous-run/, then previous-run-2/, -3/, ... Every generation is kept; an archive is never deleted or reused.

The move is a journal and one rename per entry, so a process killed at any point loses nothing: the journal
(ARCHIVE_JOURNAL: the archive's name and every entry) is written first, atomically, and removed last; the next start
(recover_archive, before anything else in checkpoint/resume.py) finishes the move. An entry is always at exactly one
of its two places.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from hf_zero.checkpoint.store import LATEST_NAME, STAGING_DIR, fsync_dir, list_checkpoints, write_json_atomic
from hf_zero.core.errors import UserError

__all__ = ["ARCHIVE_DIR", "ARCHIVE_JOURNAL", "next_archive", "archive_checkpoints", "recover_archive"]

ARCHIVE_DIR = "previous-run"
ARCHIVE_JOURNAL = ".hf_zero_archive.json"  # in output_dir while a move to an archive is under way
# What a run writes in output_dir besides its checkpoints (train/run.py, train/loss_plot.py, plan/run_plan.py,
# train/samples.py, the memory and bench probes): all of it moves, so the next run overwrites none of it.
_RUN_FILES = (STAGING_DIR, LATEST_NAME, "final", "summary.json", "log_history.json", "runs", "loss.png",
              "run_plan.json", "samples.jsonl")
_PROBE_FILES = ("memory_rank*.json", "activations_rank*.json", "bench_rank*.json")
_ARCHIVE_NAME = re.compile(r"^previous-run(-[1-9]\d*)?$")


def next_archive(output_dir) -> Path:
    """Where the next archive goes: previous-run/, else previous-run-2/, -3/, ... (every generation is kept)."""
    output_dir = Path(output_dir)
    n = 1
    while True:
        candidate = output_dir / (ARCHIVE_DIR if n == 1 else f"{ARCHIVE_DIR}-{n}")
        if not candidate.exists() and not candidate.is_symlink():
            return candidate
        n += 1


def _run_outputs(output_dir: Path, checkpoints: bool = True) -> list[Path]:
    named = [output_dir / n for n in _RUN_FILES if (output_dir / n).exists() or (output_dir / n).is_symlink()]
    probes = sorted(p for pattern in _PROBE_FILES for p in output_dir.glob(pattern))
    return (list_checkpoints(output_dir) if checkpoints else []) + named + probes


def archive_checkpoints(output_dir, checkpoints: bool = True) -> Path | None:
    """For a fresh start in a folder that holds a run, or a resume of a finished run: move what it wrote
    (checkpoints, staging area, final model, summary, logs, loss plot, run plan, TensorBoard events) to a new
    archive folder (next_archive), so the new run never mixes with it and nothing of it is overwritten or deleted;
    earlier archives stay as they are, other files (a launcher's log) stay where they are. `checkpoints=False`:
    the run files only (an earlier life that saved no complete checkpoint: its logs and events, not folders that a
    user or an interrupted save left).

    The move is a journal and one rename per entry: the journal (ARCHIVE_JOURNAL: the archive's name and every
    entry) is written first, atomically, and removed last, so a process killed at any point leaves a move that
    recover_archive finishes; nothing is ever at both places or at neither."""
    output_dir = Path(output_dir)
    recover_archive(output_dir)
    old = _run_outputs(output_dir, checkpoints)
    if not old:
        return None
    archive = next_archive(output_dir)
    write_json_atomic(output_dir / ARCHIVE_JOURNAL, {"format": 1, "archive": archive.name,
                                                       "entries": [p.name for p in old]})
    _move_entries(output_dir, archive, [p.name for p in old])
    return archive


def _move_entries(output_dir: Path, archive: Path, names: list[str]) -> None:
    archive.mkdir(exist_ok=True)
    for name in names:
        src, dst = output_dir / name, archive / name
        if not (src.exists() or src.is_symlink()):
            continue  # moved before the previous process was killed
        if dst.exists() or dst.is_symlink():
            raise UserError("output_dir", f"{src} and {dst} both exist (an interrupted move to {archive.name}/ "
                            "met a file written since); nothing was overwritten",
                            f"move one of them out of {output_dir}, then run the same command again")
        os.rename(src, dst)
    fsync_dir(archive)
    fsync_dir(output_dir)
    (output_dir / ARCHIVE_JOURNAL).unlink()
    fsync_dir(output_dir)


def recover_archive(output_dir) -> Path | None:
    """Finish a move to an archive that a killed process left half done (its journal is still there); returns the
    archive, or None when there was none. Called before a run reads or writes anything in output_dir."""
    output_dir = Path(output_dir)
    journal = output_dir / ARCHIVE_JOURNAL
    if not journal.is_file():
        return None
    try:
        record = json.loads(journal.read_text())
        name, names = record["archive"], list(record["entries"])
    except (OSError, ValueError, KeyError, TypeError):
        name, names = None, []
    # The journal is a file anyone can write: only plain names inside output_dir are moved.
    if not (isinstance(name, str) and _ARCHIVE_NAME.match(name)) or not all(
            isinstance(n, str) and n not in ("", ".", "..") and "/" not in n and "\\" not in n and n != name
            for n in names):
        raise UserError("output_dir", f"{journal} is not a move hf_zero recorded (unreadable, or names outside "
                        f"{output_dir}); nothing was moved", "look at it, remove it, then run the same command again")
    archive = output_dir / name
    _move_entries(output_dir, archive, names)
    return archive
