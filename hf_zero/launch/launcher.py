"""`python -m hf_zero.launch.launcher ARGS`: `accelerate launch ARGS`, told in lines a person reads.

accelerate's own launcher (torch elastic inside) answers a worker's one-line mistake with a `ChildFailedError`
traceback, a "Root Cause" block and exit code 1, and Ctrl-C with a `SignalException` traceback. This runs the same
`launch_command` in-process and translates how it ends, from what the ranks left in a status folder
(hf_zero.launch.worker):
- a user error on any rank: its line, once, exit 2;
- SIGINT / SIGTERM: rank 0's line (step reached, newest complete checkpoint, the command that resumes), 130 / 143;
- a bug: the failing rank's traceback (rank 0 prints its own; the others' consoles are silent), then one line
  naming the rank, and its exit code.
Unless HF_ZERO_VERBOSE=1, the launcher's own noise goes too: torch elastic's log lines, DeepSpeed's accelerator
probe in every process, progress bars of the libraries (the training bar stays).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from hf_zero.core import startup
from hf_zero.core.console import VERBOSE_ENV, quiet_environment
from hf_zero.core.errors import EXIT_USAGE, UserError
from hf_zero.core.report import STATUS_ENV, read_status
from hf_zero.core.run_lock import LOCK_ENV, RunLock
from hf_zero.integrations.lean_import import import_training_args
from hf_zero.launch.interrupt import RESUME_ENV, status_line, where_it_stands
from hf_zero.launch.parent_watch import LAUNCHER_PID_ENV
from hf_zero.plan.profiles import load_profile, with_precision
from hf_zero.plan.run_plan import PLAN_ENV, RunPlan, plan_for_launch
from hf_zero.plan.world import launch_shape

__all__ = ["main"]

def _quiet_launcher() -> None:
    import logging
    import warnings

    import torch.distributed.run  # noqa: F401  (creates torch elastic's loggers, each with its own level)

    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed"):
            logging.getLogger(name).setLevel(logging.CRITICAL)  # failures and signals are reported below
    warnings.filterwarnings("ignore", message=r"Port `\d+` is already in use")


def _children_signal(signum: int) -> None:
    import psutil

    for child in psutil.Process().children():
        try:
            child.send_signal(signum)
        except psutil.NoSuchProcess:
            pass


def _wait_children() -> None:
    import psutil

    psutil.wait_procs(psutil.Process().children(), timeout=60)


def _say(line: str) -> None:
    sys.stdout.flush()
    print(line, file=sys.stderr, flush=True)


def _reports(status: Path) -> dict[int, dict]:
    return {r["rank"]: r for r in (read_status(status, p.name) for p in sorted(status.glob("error-rank*.json"))) if r}


def _user_errors(status: Path) -> list[str]:
    # "lost a rank" is what the others see when a rank dies: not the mistake, and not worth exit code 2
    reports = [r for r in _reports(status).values() if r.get("kind") == "user" and not r.get("lost_rank")]
    return list(dict.fromkeys(r["line"] for r in reports))


def _killed(status: Path, rank: int, signum: int, others: bool) -> int:
    """A rank ended by a signal nobody in the run sent (the kernel's OOM killer, a person's kill -9): it could not
    say anything itself."""
    name = signal.Signals(signum).name
    why = " (out of memory? `dmesg` lists what the kernel's OOM killer ended)" if signum == signal.SIGKILL else ""
    after = "; the other ranks' errors above follow from it" if others else ""
    output_dir = (read_status(status, "run.json") or {}).get("output_dir")
    command = os.environ.get(RESUME_ENV) or "the same command"
    _say(f"hf-zero: rank {rank} was killed by {name}{why}{after}; {where_it_stands(output_dir, command)}")
    return 128 + signum


def _failed(status: Path, exitcodes: dict[int, int], first: int) -> int:
    """How a launch whose ranks failed ends. `exitcodes`: each failed rank's (negative: the signal that ended it);
    `first`: the root cause by torch elastic's timestamps."""
    lines = _user_errors(status)
    if lines:
        for line in lines:
            _say(line)
        return EXIT_USAGE
    reports = _reports(status)
    killed = [r for r, code in sorted(exitcodes.items()) if code < 0 and r not in reports
              and -code not in (signal.SIGINT, signal.SIGTERM)]  # SIGINT/SIGTERM: the launcher stopping the rest
    if killed:
        return _killed(status, killed[0], -exitcodes[killed[0]], others=bool(reports))
    if first in reports and reports[first].get("lost_rank"):  # the rank that was lost is the story
        first = next((r for r in sorted(exitcodes) if not reports.get(r, {}).get("lost_rank")), first)
    rank, exitcode = first, exitcodes[first]
    if exitcode in (128 + signal.SIGINT, 128 + signal.SIGTERM) and read_status(status, "interrupted.json"):
        return _interrupted(status, exitcode - 128)
    bug = reports.get(rank) or {}
    if bug.get("traceback") and rank != 0:  # rank 0 printed its own; the other ranks' consoles are silent
        _say(bug["traceback"].rstrip())
    how = f"signal {signal.Signals(-exitcode).name}" if exitcode < 0 else f"exit code {exitcode}"
    _say(f"hf-zero: rank {rank} failed ({how})" + ("; its traceback is above" if bug.get("traceback") else ""))
    return exitcode if 0 < exitcode < 256 else 1


def _interrupted(status: Path, signum: int) -> int:
    _say(status_line(status, signum, os.environ.get(RESUME_ENV) or "the same command"))
    return 128 + signum


class _Terminated(Exception):
    def __init__(self, signum):
        self.signum = signum


def _on_sigterm(signum, frame):
    # Only reached outside torch elastic (one process, accelerate's simple launcher): pass it on, then report.
    _children_signal(signum)
    raise _Terminated(signum)


def _resolve_plan(args, folder: Path) -> Path | None:
    """The run plan, resolved here once before any rank starts, from the launch this process was given (the
    profile, and the process count, machines and precision hf_zero put on accelerate's command line); its path goes
    to every rank in the environment (hf_zero.plan.run_plan)."""
    if not args.config_file or not args.training_script.endswith(".py"):
        return None  # not a recipe under a profile: the ranks resolve it themselves, as under `accelerate launch`
    profile = with_precision(load_profile(args.config_file), args.mixed_precision)
    shape = launch_shape(profile, world=args.num_processes, nodes=args.num_machines)
    path = plan_for_launch(profile, args.training_script, args.training_script_args, shape.world, shape.nodes, folder)
    os.environ[PLAN_ENV] = str(path)
    return path


def _lock_output(args, plan: Path | None) -> RunLock | None:
    """Hold the run's output folder for the life of the launch, before any rank writes or moves a file in it (a
    refused run changes nothing). Machine 0 holds it for the job: on a shared filesystem the other machines' lock
    would be refused by machine 0's."""
    if plan is None or (args.machine_rank or 0) != 0:
        return None
    lock = RunLock(RunPlan.from_json(plan.read_text()).output_dir)
    line = lock.acquire()
    if line:
        _say(line)
    os.environ[LOCK_ENV] = str(lock.path)  # rank 0 need not (and must not) take it again
    return lock


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    startup.start_clock()
    startup.phase("loading the launcher (torch, accelerate)")
    quiet_environment()
    import_training_args()  # the run plan parses the recipe; no model is built here: no peft
    status = Path(tempfile.mkdtemp(prefix="hf_zero-run-"))
    os.environ[STATUS_ENV] = str(status)
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())  # each rank ends when this process ends (parent_watch.py)
    if os.environ.get(VERBOSE_ENV) != "1":
        _quiet_launcher()
    from accelerate.commands.launch import launch_command, launch_command_parser
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    args = launch_command_parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _on_sigterm)
    lock = None
    startup.hand_over_at(status)
    startup.start_heartbeat()
    try:
        startup.phase("resolving the run plan")
        lock = _lock_output(args, _resolve_plan(args, status))
        startup.phase("starting the ranks (Python, torch, transformers, the recipe)")
        startup.hand_on()
        launch_command(args)
        return 0
    except ChildFailedError as err:
        first, _ = err.get_first_failure()
        return _failed(status, {r: f.exitcode for r, f in err.failures.items()}, first)
    except SignalException as err:  # torch elastic has passed the signal on to every rank and waited for them
        return _interrupted(status, int(err.sigval))
    except (KeyboardInterrupt, _Terminated) as err:
        signum = getattr(err, "signum", signal.SIGINT)
        _children_signal(signum)
        _wait_children()
        return _interrupted(status, signum)
    except subprocess.CalledProcessError as err:  # one process (simple launcher), or a multi-node pdsh/MPI launcher
        return _failed(status, {0: err.returncode}, 0)
    except UserError as err:  # the plan could not be resolved: no rank was started
        _say(f"hf-zero: error: {err.line()}")
        return EXIT_USAGE
    finally:
        startup.end_command()
        for name in (PLAN_ENV, LOCK_ENV, LAUNCHER_PID_ENV, STATUS_ENV):  # an in-process caller (tests) must
            os.environ.pop(name, None)  # not pass them to a later launch
        if lock is not None:
            lock.release()
        shutil.rmtree(status, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
