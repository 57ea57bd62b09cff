"""Where a checkpoint's files really are: nothing hf_zero reads, writes or deletes for a checkpoint lies outside it.

- `checkpoint_files(folder)`: every file of a checkpoint, symbolic links followed to where they really are (Python
  3.11's Path.rglob does not enter a linked folder, so a payload behind one went unchecked); a link that leads
  outside the checkpoint, or nowhere, and anything but files and folders (a FIFO would block the reader) are
  refused in one line.
- `read_tag(folder, name)`: the folder a `latest` / `latest_universal` file names, which must be one plain name
  inside the checkpoint: hf_zero builds paths to read, convert into and delete from it (`/abs/victim` or
  `../../victim` made a resume delete `/abs/victim_universal`).
- `inside(folder, rel)`: a path read from a file (a manifest entry, a distributed checkpoint's file name) joined to
  its folder, refused when it would leave it.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from hf_zero.core.errors import UserError

__all__ = ["checkpoint_files", "read_tag", "inside", "is_inside"]

_FIX = "hf_zero reads only files inside the checkpoint: copy the files in place of the link (cp -rL), or use a " \
       "checkpoint from a run you trust"


def is_inside(path: Path, root: Path) -> bool:
    """Whether `path` (resolved) is `root` (resolved) or under it."""
    return path == root or root in path.parents


def inside(folder, rel: str, what: str = "checkpoint") -> Path:
    """folder/rel, when `rel` is a relative path that stays inside `folder` (links resolved); else UserError."""
    folder = Path(folder)
    if not isinstance(rel, str) or not rel or "\0" in rel or Path(rel).is_absolute() or ".." in Path(rel).parts:
        raise UserError(what, f"{folder} names the file {rel!r}, outside it", _FIX)
    path = folder / rel
    if not is_inside(path.resolve(), folder.resolve()):
        raise UserError(what, f"{path} leads to {path.resolve()}, outside {folder}", _FIX)
    return path


def read_tag(folder, name: str) -> str | None:
    """The content of folder/name (DeepSpeed's `latest`, hf_zero's `latest_universal`): a folder name inside the
    checkpoint, or None when the file is absent."""
    path = Path(folder) / name
    if not path.is_file():
        return None
    tag = path.read_text(errors="replace").strip()
    if not tag or "/" in tag or "\\" in tag or tag in (".", "..") or not tag.isprintable():
        raise UserError("checkpoint", f"{path} names {tag!r}, which is not a folder name inside {folder}",
                        "restore the file (it names the step's folder, e.g. global_step10), or use a checkpoint from "
                        "a run you trust")
    return tag  # one plain name: a folder directly inside (where a link there leads, checkpoint_files checks)


def checkpoint_files(folder) -> list[Path]:
    """Every file under `folder` (as reached from it, each real file once), links followed; UserError for a link
    that leaves the folder or leads nowhere, and for anything but files and folders."""
    folder = Path(folder)
    root = folder.resolve()
    files, seen = [], {root}
    pending = [folder]
    while pending:
        current = pending.pop()
        for entry in sorted(os.scandir(current), key=lambda e: e.name):
            path = Path(entry.path)
            try:
                real = path.resolve()
            except (OSError, RuntimeError):  # a loop of links
                real = None
            if entry.is_symlink() and (real is None or not os.path.exists(real) or not is_inside(real, root)):
                raise UserError("checkpoint", f"{path} is a symbolic link to {os.readlink(path)}, outside {folder}",
                                _FIX)
            mode = os.stat(real).st_mode
            if stat.S_ISDIR(mode):
                if real not in seen:
                    seen.add(real)
                    pending.append(path)
            elif stat.S_ISREG(mode):
                if real not in seen:
                    seen.add(real)
                    files.append(path)
            else:
                raise UserError("checkpoint", f"{path} is not a file or a folder", "remove it from the checkpoint")
    return sorted(files)
