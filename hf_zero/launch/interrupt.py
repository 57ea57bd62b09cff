"""Ctrl-C and SIGTERM: every rank stops at the same step end, nothing half-written, one line saying where the run
stands (the step reached, the newest complete checkpoint, the command that resumes), exit 130 / 143.

A signal only sets a flag while training (`on_signal`, installed by hf_zero.launch.worker); `StopOnSignal` turns
it into `should_training_stop` at the next optimizer step end, agreed by all ranks through one small all-reduce,
so no rank is left waiting in a collective the others never join. Before the first step there is nothing to
finish: the rank stops at once.
"""

from __future__ import annotations

import os
import shlex
import signal
import sys
from pathlib import Path

from hf_zero.checkpoint.store import LATEST_NAME, checkpoint_step, list_checkpoints, validate_checkpoint
from hf_zero.core.console import rank
from hf_zero.core.errors import RunInterrupted
from hf_zero.core.report import STATUS_ENV, read_status, write_status

__all__ = ["RESUME_ENV", "on_signal", "interrupt_requested", "set_training", "resume_command", "stop_on_signal",
           "note_run", "report_interrupt", "raise_if_interrupted", "interrupt_line", "newest_complete_checkpoint",
           "noted_output_dir", "where_it_stands"]

RESUME_ENV = "HF_ZERO_RESUME_CMD"  # the command that started the run, as the user typed it (for "resume with: ...")
_RUN: dict = {"output_dir": None, "step": None, "max_steps": None}
_STATE = {"signum": None, "training": False}


def on_signal(signum, frame):
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


def note_run(output_dir) -> None:
    """Where this run writes; hf_zero's launcher reads it too, in case the ranks cannot report themselves."""
    _RUN["output_dir"] = str(output_dir)
    if rank() == 0:
        write_status("run.json", {"output_dir": str(output_dir)})


def noted_output_dir() -> str | None:
    return _RUN["output_dir"]


def newest_complete_checkpoint(output_dir) -> Path | None:
    """The checkpoint a re-run resumes from, by sizes only (a resume checks the checksums itself)."""
    if not output_dir or not Path(output_dir).is_dir():
        return None
    latest = Path(output_dir) / LATEST_NAME
    named = [Path(output_dir) / latest.read_text().strip()] if latest.is_file() else []
    for folder in named + list(reversed(list_checkpoints(output_dir))):
        if folder.is_dir() and validate_checkpoint(folder, checksums=False) is None:
            return folder
    return None


def interrupt_line(signum: int, output_dir, step: int | None, max_steps: int | None, command: str) -> str:
    name = signal.Signals(signum).name
    where = f"at step {step} of {max_steps}" if step is not None else "before training started"
    return f"hf-zero: interrupted by {name} {where}; {where_it_stands(output_dir, command)}"


def where_it_stands(output_dir, command: str) -> str:
    """The newest complete checkpoint and the command that resumes from it."""
    checkpoint = newest_complete_checkpoint(output_dir)
    if checkpoint is not None:
        return f"newest complete checkpoint: {checkpoint} (step {checkpoint_step(checkpoint)}); resume with: {command}"
    if output_dir:
        # where the loss comes from: no step saved; the flags that make the next run resumable
        return (f"no complete checkpoint in {output_dir}, so running it again starts from step 0: {command}; to make "
                "a run resumable, save checkpoints as it goes: --save_strategy steps --save_steps N")
    return f"run it again with: {command}"


def report_interrupt(signum: int) -> None:
    """Rank 0 says where the run stands: to hf_zero's launcher, or on the console when there is none."""
    if rank() != 0:
        return
    line = interrupt_line(signum, _RUN["output_dir"], _RUN["step"], _RUN["max_steps"], resume_command())
    write_status("interrupted.json", {"line": line})
    if not os.environ.get(STATUS_ENV):
        print(line, file=sys.stderr, flush=True)


def raise_if_interrupted(trainer) -> None:
    """After `trainer.train()`: stop here (no final model, no summary) when a signal ended training early."""
    signum = interrupt_requested()
    if signum and trainer.state.global_step < trainer.state.max_steps:
        raise RunInterrupted(signum)


def stop_on_signal():
    """The callback that stops every rank at the same step end; add it last: it overrides what earlier callbacks
    asked for at that step."""
    from transformers import TrainerCallback

    class StopOnSignal(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            _RUN["max_steps"] = state.max_steps
            set_training(True)

        def on_step_end(self, args, state, control, **kwargs):
            import torch.distributed as dist

            flag = 1 if interrupt_requested() else 0
            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                import torch

                box = torch.tensor([flag], device=args.device)
                dist.all_reduce(box, op=dist.ReduceOp.MAX)
                flag = int(box.item())
            if flag:
                _RUN["step"] = state.global_step
                control.should_training_stop = True
                # Stop now: an evaluation or a checkpoint started here would only delay the exit (a save cut off
                # by the launcher's kill timeout is wasted work; checkpoints are complete or invisible anyway).
                control.should_save = control.should_evaluate = False
            return control

    return StopOnSignal()


def status_line(folder, signum: int, command: str) -> str:
    """What hf_zero's launcher prints: rank 0's report, or one built from what the run left behind."""
    report = read_status(folder, "interrupted.json")
    if report:
        return report["line"]
    run = read_status(folder, "run.json") or {}
    return interrupt_line(signum, run.get("output_dir"), None, None, command).replace(
        "before training started", "before the ranks reported their step")
