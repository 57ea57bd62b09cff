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

from hf_zero.core.errors import EXIT_USAGE, UserError
from hf_zero.launch.worker import RESUME_ENV, STATUS_ENV, read_status

__all__ = ["main", "VERBOSE_ENV", "quiet_environment"]

VERBOSE_ENV = "HF_ZERO_VERBOSE"


def quiet_environment(env=os.environ) -> None:
    """Settings every process of the run inherits: set before torch, DeepSpeed or the hub libraries load. In this
    process also the stack's FutureWarnings (deprecations for its maintainers; a run would print hundreds)."""
    if env.get(VERBOSE_ENV) == "1":
        return
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    env.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # weight loading / shard writing bars, one per rank
    env.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    env.setdefault("TQDM_DISABLE", "1")  # bars made with tqdm directly (GGUF conversion); hf_zero's own passes disable=False
    env.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    if "DS_ACCELERATOR" not in env:
        import torch

        if not torch.cuda.is_available():
            # Named up front, DeepSpeed skips its probe and the "Setting accelerator to CPU" warning per process.
            env["DS_ACCELERATOR"] = "cpu"


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


def _user_errors(status: Path) -> list[str]:
    reports = [read_status(status, p.name) for p in sorted(status.glob("error-rank*.json"))]
    return list(dict.fromkeys(r["line"] for r in reports if r and r.get("kind") == "user"))


def _failed(status: Path, rank: int, exitcode: int) -> int:
    lines = _user_errors(status)
    if lines:
        for line in lines:
            _say(line)
        return 2
    if exitcode in (128 + signal.SIGINT, 128 + signal.SIGTERM) and read_status(status, "interrupted.json"):
        return _interrupted(status, exitcode - 128)
    bug = read_status(status, f"error-rank{rank}.json") or {}
    if bug.get("traceback") and rank != 0:  # rank 0 printed its own; the other ranks' consoles are silent
        _say(bug["traceback"].rstrip())
    how = f"signal {signal.Signals(-exitcode).name}" if exitcode < 0 else f"exit code {exitcode}"
    _say(f"hf-zero: rank {rank} failed ({how})" + ("; its traceback is above" if bug.get("traceback") else ""))
    return exitcode if 0 < exitcode < 256 else 1


def _interrupted(status: Path, signum: int) -> int:
    from hf_zero.launch.interrupt import status_line

    _say(status_line(status, signum, os.environ.get(RESUME_ENV) or "the same command"))
    return 128 + signum


class _Terminated(Exception):
    def __init__(self, signum):
        self.signum = signum


def _on_sigterm(signum, frame):
    # Only reached outside torch elastic (one process, accelerate's simple launcher): pass it on, then report.
    _children_signal(signum)
    raise _Terminated(signum)


def _resolve_plan(args, folder: Path) -> None:
    """The run plan, resolved here once before any rank starts, from the launch this process was given (the
    profile, and the process count, machines and precision hf_zero put on accelerate's command line); its path goes
    to every rank in the environment (hf_zero.core.plan)."""
    from dataclasses import replace

    from hf_zero.core.plan import PLAN_ENV, plan_for_launch
    from hf_zero.core.profiles import load_profile

    if not args.config_file or not args.training_script.endswith(".py"):
        return  # not a recipe under a profile: the ranks resolve it themselves, as under plain `accelerate launch`
    profile = load_profile(args.config_file)
    if args.mixed_precision:
        profile = replace(profile, mixed_precision=args.mixed_precision)
    nodes = args.num_machines or profile.num_machines
    world = args.num_processes or profile.num_processes
    os.environ[PLAN_ENV] = str(plan_for_launch(profile, args.training_script, args.training_script_args, world, nodes,
                                               folder))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    quiet_environment()
    status = Path(tempfile.mkdtemp(prefix="hf_zero-run-"))
    os.environ[STATUS_ENV] = str(status)
    if os.environ.get(VERBOSE_ENV) != "1":
        _quiet_launcher()
    from accelerate.commands.launch import launch_command, launch_command_parser
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    args = launch_command_parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        _resolve_plan(args, status)
        launch_command(args)
        return 0
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        return _failed(status, rank, failure.exitcode)
    except SignalException as err:  # torch elastic has passed the signal on to every rank and waited for them
        return _interrupted(status, int(err.sigval))
    except (KeyboardInterrupt, _Terminated) as err:
        signum = getattr(err, "signum", signal.SIGINT)
        _children_signal(signum)
        _wait_children()
        return _interrupted(status, signum)
    except subprocess.CalledProcessError as err:  # one process (simple launcher), or a multi-node pdsh/MPI launcher
        return _failed(status, 0, err.returncode)
    except UserError as err:  # the plan could not be resolved: no rank was started
        _say(f"hf-zero: error: {err.line()}")
        return EXIT_USAGE
    finally:
        from hf_zero.core.plan import PLAN_ENV

        os.environ.pop(PLAN_ENV, None)  # an in-process caller (hf-zero train, tests) must not pass it to a later launch
        shutil.rmtree(status, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
