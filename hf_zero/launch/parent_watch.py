"""A rank ends with its launcher: torch elastic starts each rank in a session of its own, so a launcher killed by
SIGKILL or the OOM killer would leave its ranks training and writing with no console."""

from __future__ import annotations

import os
import signal
import threading
import time

from hf_zero.core.child import set_death_signal

__all__ = ["LAUNCHER_PID_ENV", "die_with_launcher"]

LAUNCHER_PID_ENV = "HF_ZERO_LAUNCHER_PID"  # hf_zero's launcher, the ranks' parent (torch elastic runs in it)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGKILL)


def die_with_launcher() -> None:
    """A rank started by a launcher ends when the launcher ends, however it ends (SIGKILL and the OOM killer
    included). torch elastic starts each rank in a session of its own, so a killed launcher's process group leaves
    them training and writing with no console, in a folder the next run then finds in use.

    SIGKILL, not SIGTERM: SIGTERM asks for a clean stop agreed at a step end, and saves nothing, while a step may
    run for minutes and a checkpoint being written would be finished; nobody is left to coordinate or report it. A
    rank cut anywhere loses nothing that was complete: checkpoints are staged and renamed into place whole.
    Started by hand (`python recipe.py`) there is no launcher: a shell that ends (nohup) must not stop the run."""
    expected = os.environ.pop(LAUNCHER_PID_ENV, None)  # not for processes this rank starts in turn
    if not expected and not os.environ.get("TORCHELASTIC_RUN_ID"):
        return
    parent = os.getppid()
    # Set against the thread that started this process: torch elastic starts ranks from its main thread.
    set_death_signal(signal.SIGKILL)
    # The launcher died before prctl (this rank was re-parented already): nothing would signal it any more.
    if os.getppid() != parent or parent == 1 or (expected and int(expected) != parent and not _alive(int(expected))):
        os.kill(os.getpid(), signal.SIGKILL)
    # Where prctl does not exist (or the launcher's starting thread is not its lifetime): notice a new parent.
    threading.Thread(target=_watch_parent, args=(parent,), name="hf_zero-launcher-watch", daemon=True).start()
