"""A write that failed for the disk's sake, and the one line that says so, for every command and path: a checkpoint
save under any engine, a run's summary and logs, `hf-zero export`, `hf-zero convert` and the conversion a resume
does inside a checkpoint.

The libraries report it in their own words: Python and DeepSpeed raise OSError with an errno; safetensors raises
`SafetensorError("... Os { code: 28, kind: StorageFull ...")`; torch's zip writer raises a RuntimeError that only
says "unexpected pos" or "file write failed"; torch's distributed checkpoint (FSDP2) collects every rank's error in
a `CheckpointException`, a BaseException that holds them in `.failures`, not as a cause. A full disk is told to free
space; a read-only or unwritable folder is told to write elsewhere (freeing space would not help).
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from pathlib import Path

from hf_zero.core.errors import UserError
from hf_zero.core.files import human_bytes

__all__ = ["FULL_ERRNOS", "READ_ONLY_ERRNOS", "write_errno", "disk_error", "free_bytes"]

FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
READ_ONLY_ERRNOS = {errno.EROFS}
_NOT_WRITABLE = {errno.EACCES, errno.EPERM}  # a write refused; only counted where the caller knows it was writing
_ALWAYS = FULL_ERRNOS | READ_ONLY_ERRNOS | {errno.EIO}
_WORDS = {"No space left on device": errno.ENOSPC, "Disk quota exceeded": errno.EDQUOT,
          "File too large": errno.EFBIG, "Read-only file system": errno.EROFS}
_OS_CODE = re.compile(r"Os \{ code: (\d+)")  # safetensors (Rust) spells the errno this way
# torch's zip writer (torch.save) on a failed write: no errno, no reason
_TORCH_WRITE = ("unexpected pos", "file write failed", "PytorchStreamWriter failed writing")
_LOW_SPACE = 16 << 20


def _chain(exc: BaseException):
    """exc, its causes and contexts, and the per-rank errors a distributed checkpoint collected."""
    todo, seen = [exc], set()
    while todo and len(seen) < 64:
        item = todo.pop(0)
        if item is None or id(item) in seen:
            continue
        seen.add(id(item))
        yield item
        todo += [item.__cause__, item.__context__]
        failures = getattr(item, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]


def _existing(path) -> Path | None:
    if path is None:
        return None
    path = Path(os.fsdecode(path) if isinstance(path, bytes) else path)
    for candidate in (path, *path.parents):
        if candidate.exists():
            return candidate
    return None


def free_bytes(path) -> int | None:
    where = _existing(path)
    try:
        return shutil.disk_usage(where).free if where is not None else None
    except OSError:
        return None


def _read_only(path) -> bool:
    where = _existing(path)
    if where is None:
        return False
    folder = where if where.is_dir() else where.parent
    try:
        return bool(os.statvfs(folder).f_flag & os.ST_RDONLY) or not os.access(folder, os.W_OK)
    except OSError:
        return False


def write_errno(exc: BaseException, path=None, writing: bool = False) -> tuple[int, BaseException] | None:
    """(errno, the error that says so) when `exc` is a write the disk refused, else None. `path`: where the caller
    was writing (used when the library's error names no errno); `writing`: the caller knows the failed operation
    was a write, so a refused permission counts too, and so does any error while the disk at `path` is full."""
    torch_write = None
    for item in _chain(exc):
        code = getattr(item, "errno", None) if isinstance(item, OSError) else None
        if code in _ALWAYS or (writing and code in _NOT_WRITABLE):
            return code, item
        text = str(item)
        for words, number in _WORDS.items():
            if words in text:
                return number, item
        match = _OS_CODE.search(text)
        if match and (int(match.group(1)) in _ALWAYS or writing and int(match.group(1)) in _NOT_WRITABLE):
            return int(match.group(1)), item
        if torch_write is None and any(words in text for words in _TORCH_WRITE):
            torch_write = item
    if torch_write is not None or writing:
        # No errno given: ask the disk itself.
        free = free_bytes(path)
        if free is not None and free < _LOW_SPACE:
            return errno.ENOSPC, torch_write or exc
        if path is not None and _read_only(path):
            return errno.EROFS, torch_write or exc
        if torch_write is not None:
            return errno.EIO, torch_write
    return None


def disk_error(exc: BaseException, path=None, *, writing: bool = False, after: str = ", then run it again",
               where: str | None = None) -> UserError | None:
    """The one line for a failed write (None when `exc` is not one): `disk: could not write WHERE: WHY; FIX`. A
    full disk is told to free space, a read-only or unwritable folder to write elsewhere; `after` ends either fix
    (e.g. "; the newest complete checkpoint is ..."). `where`: what the line names when the error names no file
    (default: `path`)."""
    found = write_errno(exc, path, writing)
    if found is None:
        return None
    code, item = found
    where = getattr(item, "filename", None) or where or path or "a file"
    where = os.fsdecode(where) if isinstance(where, bytes) else str(where)
    why = getattr(item, "strerror", None) or os.strerror(code)
    free = free_bytes(getattr(item, "filename", None) or path)  # (`where` may be words, not a path)
    if code in FULL_ERRNOS:
        room = f" ({human_bytes(free)} free)" if free is not None and code == errno.ENOSPC else ""
        return UserError("disk", f"could not write {where}: {why}{room}", f"free space{after}")
    folder = _existing(getattr(item, "filename", None) or path)
    folder = folder if folder is None or folder.is_dir() else folder.parent
    if code in READ_ONLY_ERRNOS or code in _NOT_WRITABLE:
        return UserError("disk", f"could not write {where}: {why}",
                         f"{folder or 'the folder'} is not writable (freeing space would not help): use a writable "
                         f"folder{after}")
    return UserError("disk", f"could not write {where}: {why}", f"check the disk (space, quota, errors){after}")
