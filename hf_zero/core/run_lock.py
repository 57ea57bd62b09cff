"""One run per output folder: `<output_dir>/.hf_zero.lock`, an OS lock (flock) held for the run's life.

Two runs on one folder would rotate each other's checkpoints and archive each other's files; the second is refused
with one line naming the holder, before it writes or moves anything. The lock is taken by the process every rank
depends on: hf_zero's launcher (`hf-zero train`, `make train`, a recipe relaunching itself), which tells its ranks in
LOCK_ENV; under a plain `accelerate launch` / torchrun, rank 0. The kernel releases a flock when its holder dies, even
by SIGKILL, so a dead run never blocks the next; its record (pid, host, start) is left behind, and the next run says
it took over. A run that ends normally removes the file.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import stat
import sys
import time
from pathlib import Path

from hf_zero.core.console import rank
from hf_zero.core.errors import UserError

__all__ = ["LOCK_NAME", "LOCK_ENV", "RunLock", "hold_in_worker", "release_held"]

LOCK_NAME = ".hf_zero.lock"
LOCK_ENV = "HF_ZERO_RUN_LOCK"  # the lock file hf_zero's launcher holds for its ranks

_HELD: dict[str, RunLock] = {}  # taken by this process as rank 0 (in-process re-runs of a recipe reuse it)


def _since(started: float) -> str:
    fmt = "%H:%M:%S" if time.strftime("%Y%m%d", time.localtime(started)) == time.strftime("%Y%m%d") else \
        "%Y-%m-%d %H:%M:%S"
    return time.strftime(fmt, time.localtime(started))


def describe(holder: dict | None) -> str:
    """`pid 1234 on host h since 18:02:11`, from a lock file's record."""
    try:
        return f"pid {int(holder['pid'])} on host {holder['host']} since {_since(float(holder['started']))}"
    except (TypeError, KeyError, ValueError):
        return "another process (it has not written its record yet)"


def _read(fd: int) -> dict | None:
    try:
        return json.loads(os.pread(fd, 4096, 0).decode() or "null")
    except (OSError, ValueError):
        return None


class RunLock:
    def __init__(self, output_dir):
        self.output_dir = Path(output_dir)
        self.path = self.output_dir.resolve() / LOCK_NAME
        self._fd: int | None = None
        self._created_dir = False

    @property
    def held(self) -> bool:
        return self._fd is not None

    def _open(self) -> int:
        """The lock file, never through a symbolic link: anyone who can write to a shared runs folder could point
        one at a file of the user's, which the lock record would overwrite. Anything but a plain file is refused."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
        except OSError as err:
            if err.errno == errno.ELOOP:
                raise UserError("output_dir", f"{self.path} is a symbolic link (to {os.readlink(self.path)}); "
                                "hf_zero never writes its lock record through one",
                                f"remove the link: rm {self.path}") from None
            if err.errno == errno.EISDIR:
                raise UserError("output_dir", f"{self.path} is a folder, where hf_zero keeps its lock file",
                                "move or remove that folder") from None
            raise UserError("output_dir", f"cannot open {self.path}: {err.strerror}",
                            "pass another --output_dir") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise UserError("output_dir", f"{self.path} is not a plain file, where hf_zero keeps its lock file",
                            "move or remove it")
        return fd

    def acquire(self) -> str | None:
        """Take the lock, or raise UserError naming the process that holds it. Returns a line to print when the
        file names an earlier holder that died without removing it (SIGKILL, a crash of the machine)."""
        folder = self.path.parent
        self._created_dir = not folder.exists()
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise UserError("output_dir", f"cannot create {self.output_dir}: {err.strerror}",
                            "pass another --output_dir") from None
        while True:
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                holder = _read(fd)
                os.close(fd)
                if err.errno in (errno.EAGAIN, errno.EACCES):
                    raise UserError("output_dir", f"{self.output_dir} is in use by {describe(holder)}",
                                    "wait for it, or pass another --output_dir") from None
                print(f"[hf_zero] warning: output_dir: cannot lock {self.path} ({err.strerror}); a second run on "
                      "this folder is not prevented", file=sys.stderr, flush=True)
                return None
            try:  # the holder may have ended (and removed the file) between our open and flock: lock the new one
                if os.lstat(self.path).st_ino == os.fstat(fd).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        previous = _read(fd)
        record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(), "argv": sys.argv}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        self._fd = fd
        if previous:
            return (f"[hf_zero] output_dir: {self.output_dir} was left locked by {describe(previous)}, which ended "
                    "without releasing it; taking it over")
        return None

    def release(self) -> None:
        """Remove the file while still holding it (a process that opened it meanwhile retries on a new one)."""
        if self._fd is None:
            return
        try:
            if os.lstat(self.path).st_ino == os.fstat(self._fd).st_ino:
                os.unlink(self.path)
            if self._created_dir:
                self.path.parent.rmdir()  # only when the run left nothing in the folder it created
        except OSError:
            pass
        os.close(self._fd)
        self._fd = None


def hold_in_worker(output_dir) -> None:
    """Rank 0's part, before it writes anything in `output_dir`: take the lock unless hf_zero's launcher holds it
    (or this process already does). The other ranks rely on rank 0: a refused rank 0 ends their launch."""
    if rank() != 0:
        return
    lock = RunLock(output_dir)
    if os.environ.get(LOCK_ENV) == str(lock.path) or str(lock.path) in _HELD:
        return
    line = lock.acquire()
    if line:
        print(line, file=sys.stderr, flush=True)
    _HELD[str(lock.path)] = lock


def release_held() -> None:
    """Release what hold_in_worker took (a recipe's end; the kernel does it anyway when the process dies)."""
    while _HELD:
        _HELD.popitem()[1].release()
