"""What every rank does around a recipe's `main()`, so that a mistake, a Ctrl-C or a bug reaches the person at the
launcher once: a one-line error (exit 2), a one-line account of an interruption (exit 130/143), or one traceback.

How the line crosses the launcher:
- hf_zero's own launcher (`hf-zero train`, `make train`, a recipe relaunching itself; see hf_zero.launch.launcher) sets
  STATUS_ENV to a folder; ranks leave their error line, a bug's traceback or the interruption report there, print
  nothing, and the launcher prints it once after every rank has stopped.
- Under a plain torchrun / `accelerate launch`, each failing rank writes the line into torch elastic's error file
  (TORCHELASTIC_ERROR_FILE), which is how torchrun lets a worker name the root cause: the launcher's failure report
  ends with it. Its own traceback and exit code 1 are the launcher's, outside any recipe's reach.
- Started as one process (`python recipe.py`): rank 0 prints the line.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from hf_zero.core.errors import EXIT_USAGE, RunComplete, RunInterrupted, UserError
from hf_zero.core.run_lock import release_held
from hf_zero.launch.parent_watch import die_with_launcher

__all__ = ["STATUS_ENV", "RESUME_ENV", "recipe_entry", "report_user_error", "write_status", "read_status", "rank",
           "interrupt_requested", "set_training", "resume_command", "write_failure", "stop_on_write_failure"]

STATUS_ENV = "HF_ZERO_STATUS_DIR"
RESUME_ENV = "HF_ZERO_RESUME_CMD"  # the command that started the run, as the user typed it (for "resume with: ...")
_STATE = {"signum": None, "training": False}


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def write_status(name: str, data: dict) -> None:
    folder = os.environ.get(STATUS_ENV)
    if not folder:
        return
    from hf_zero.core.files import write_json_atomic

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
    import re

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
                _exit(128 + stop.signum)
        if not _reported_by_another_rank(line):
            _elastic_error_file({"message": line, "timestamp": int(time.time())})
    elif not os.environ.get(STATUS_ENV) and (rank() == 0 or getattr(err, "every_rank", False)):
        print(line, file=sys.stderr, flush=True)


# A write that failed for the disk's sake (full, over quota, too large, read-only, failing), not the program's.
_WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EIO}


def write_failure(exc: BaseException, filename: str | None = None) -> UserError | None:
    """The one line for a failed write anywhere in a run (summary, log history, samples, final model, TensorBoard),
    naming the file and the newest complete checkpoint; None when `exc` is not one. `filename`: where the caller
    knows it was writing (an OSError from write() names no file)."""
    seen, depth = exc, 0
    while seen is not None and depth < 32:
        if isinstance(seen, OSError) and seen.errno in _WRITE_ERRNOS or "No space left on device" in str(seen):
            break
        seen, depth = seen.__cause__ or seen.__context__, depth + 1
    else:
        return None
    if seen is None:
        return None
    from hf_zero.launch.interrupt import newest_complete_checkpoint, noted_output_dir

    output_dir = noted_output_dir()
    where = getattr(seen, "filename", None) or filename or (f"into {output_dir}" if output_dir else "a file")
    where = os.fsdecode(where) if isinstance(where, bytes) else str(where)
    why = getattr(seen, "strerror", None) or str(seen).splitlines()[0][:120]
    if output_dir is None:  # not a training run (e.g. `hf-zero export`)
        return UserError("disk", f"could not write {where}: {why}", "free space, then run it again")
    newest = newest_complete_checkpoint(output_dir)
    kept = f"the newest complete checkpoint is {newest}" if newest else "no complete checkpoint was written yet"
    return UserError("disk", f"could not write {where}: {why}", f"free space; {kept}")


def stop_on_write_failure(err: UserError) -> None:
    """Report it once and stop hard: the other ranks may wait in a collective for this one, and the launcher stops
    them once this process is gone (a normal exit could wait for them forever)."""
    if not _STATE.get("write_failed"):  # the TensorBoard thread and the main thread can both meet the same disk
        _STATE["write_failed"] = True
        report_user_error(err)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_USAGE)


def _thread_failed(args) -> None:
    """threading.excepthook: TensorBoard's SummaryWriter writes in its own thread, whose OSError would print a
    thread traceback (and resurface later in the main thread as a second one)."""
    writer = getattr(getattr(getattr(args.thread, "_record_writer", None), "_writer", None), "filename", None)
    err = write_failure(args.exc_value, writer) if isinstance(args.exc_value, Exception) else None
    if err is None:
        _DEFAULT_THREAD_HOOK(args)
        return
    stop_on_write_failure(err)


_DEFAULT_THREAD_HOOK = threading.excepthook


def _report_bug(exc: BaseException) -> None:
    import traceback

    text = "".join(traceback.format_exception(exc))
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    ErrorHandler().record_exception(exc)  # torchrun's report shows the root cause's traceback
    write_status(f"error-rank{rank()}.json", {"kind": "bug", "rank": rank(), "traceback": text})


def _on_signal(signum, frame):
    _STATE["signum"] = _STATE["signum"] or signum
    if not _STATE["training"]:  # nothing to finish cleanly before the first step: stop where we are
        raise RunInterrupted(signum)


def interrupt_requested() -> int | None:
    """The signal that asked this rank to stop, if any."""
    return _STATE["signum"]


def set_training(active: bool) -> None:
    """While training, a signal only asks to stop: hf_zero.launch.interrupt.StopOnSignal stops every rank at the same
    step end."""
    _STATE["training"] = active


def resume_command() -> str:
    """The command that restarts this run, as the user typed it when hf_zero's launcher knows it; else the
    launcher's command line read from /proc; else words."""
    if os.environ.get(RESUME_ENV):
        return os.environ[RESUME_ENV]
    import shlex

    try:
        argv = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode().split("\0")[:-1]
    except OSError:
        return "the same command"
    if "accelerate.commands.launch" in argv:  # python -m accelerate.commands.launch ...
        argv = ["accelerate", "launch", *argv[argv.index("accelerate.commands.launch") + 1:]]
    elif len(argv) > 2 and Path(argv[1]).name in ("accelerate", "torchrun"):
        argv = [Path(argv[1]).name, *argv[2:]]
    elif not any(Path(a).name == "torchrun" or a == "torch.distributed.run" for a in argv):
        return "the same command"
    return shlex.join(argv)


def _exit(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)


def _tear_down() -> None:
    """End the process group before the interpreter does: left to exit-time destructors, gloo's threads can abort a
    finished rank ("terminate called without an active exception", seen once in 2-rank ZeRO-3 runs)."""
    import torch.distributed as dist

    sys.stdout.flush()
    sys.stderr.flush()
    if dist.is_available() and dist.is_initialized():
        try:
            dist.barrier()
            dist.destroy_process_group()
        except Exception:  # a teardown problem after a finished run is not the run's failure
            pass


def recipe_entry(func):
    """Decorate a recipe's `main`: console set-up (hf_zero.core.console), signal handling, and the reports above."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        die_with_launcher()
        from hf_zero.core.console import setup_console

        setup_console()
        threading.excepthook = _thread_failed
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, _on_signal)
        try:
            result = func(*args, **kwargs)
            _tear_down()
            return result
        except UserError as err:
            report_user_error(err)
            _exit(EXIT_USAGE)
        except RunComplete as done:
            if rank() == 0:
                print(f"[hf_zero] {done}", flush=True)
            write_status("complete.json", {"line": str(done)})
            return 0
        except RunInterrupted as stop:
            from hf_zero.launch.interrupt import report_interrupt

            report_interrupt(stop.signum)
            _exit(128 + stop.signum)
        except BaseException as exc:
            if interrupt_requested():  # a collective broken by a rank that already stopped: not a second story
                from hf_zero.launch.interrupt import report_interrupt

                report_interrupt(interrupt_requested())
                _exit(128 + interrupt_requested())
            failed = write_failure(exc) if isinstance(exc, Exception) else None
            if failed is not None:
                stop_on_write_failure(failed)
            if not isinstance(exc, SystemExit):
                _report_bug(exc)
            raise
        finally:
            release_held()

    return wrapper
