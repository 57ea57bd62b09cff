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

import functools
import os
import signal
import sys
import threading
from pathlib import Path

from hf_zero.core import startup
from hf_zero.core.console import rank, setup_console
from hf_zero.core.disk import disk_error, write_errno
from hf_zero.core.errors import EXIT_USAGE, RunComplete, RunInterrupted, UserError
from hf_zero.core.report import STATUS_ENV, report_user_error, write_status
from hf_zero.core.run_lock import release_held
from hf_zero.integrations.torch import tensorboard_thread_file
from hf_zero.launch.interrupt import (
    interrupt_requested,
    newest_complete_checkpoint,
    noted_output_dir,
    on_signal,
    report_interrupt,
)
from hf_zero.launch.parent_watch import die_with_launcher

__all__ = ["recipe_entry", "write_failure", "stop_on_write_failure"]

_STATE = {"write_failed": False}


def write_failure(exc: BaseException, filename: str | None = None) -> UserError | None:
    """The one line for a failed write anywhere in a run (summary, log history, samples, final model, TensorBoard),
    naming the file and the newest complete checkpoint; None when `exc` is not one (hf_zero.core.disk).
    `filename`: where the caller knows it was writing (an OSError from write() names no file)."""
    output_dir = noted_output_dir()
    if output_dir is None:  # not a training run (e.g. `hf-zero export`)
        return disk_error(exc, filename)
    if write_errno(exc, filename or output_dir) is None:
        return None
    newest = newest_complete_checkpoint(output_dir)
    kept = f"the newest complete checkpoint is {newest}" if newest else "no complete checkpoint was written yet"
    return disk_error(exc, filename or output_dir, after=f"; {kept}", where=filename or f"into {output_dir}")


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
    writer = tensorboard_thread_file(args.thread)
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
        setup_console()
        _start_talking()
        threading.excepthook = _thread_failed
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, on_signal)
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
            report_interrupt(stop.signum)
            _exit(128 + stop.signum)
        except BaseException as exc:
            if interrupt_requested():  # a collective broken by a rank that already stopped: not a second story
                report_interrupt(interrupt_requested())
                _exit(128 + interrupt_requested())
            # (torch's distributed checkpoint raises a BaseException holding every rank's error)
            failed = write_failure(exc) if not isinstance(exc, (SystemExit, KeyboardInterrupt)) else None
            if failed is not None:
                stop_on_write_failure(failed)
            if not isinstance(exc, SystemExit):
                _report_bug(exc)
            raise
        finally:
            startup.stop_heartbeat()
            release_held()

    return wrapper


def _start_talking() -> None:
    """Rank 0 takes the start-up heartbeat over from the launcher (hf_zero.core.startup)."""
    startup.phase("importing the recipe's modules (the Trainer, DeepSpeed)")
    # each machine's first rank ends its launcher's heartbeat; rank 0, the one console, goes on with it
    if rank() == 0 or os.environ.get("LOCAL_RANK", "0") == "0":
        startup.take_over(Path(os.environ[STATUS_ENV]) if os.environ.get(STATUS_ENV) else None, beat=rank() == 0)
