"""A console a person reads: rank 0 only, the libraries' noise off unless HF_ZERO_VERBOSE=1 (`--verbose`), one line
per logging step and one per evaluation, hf_zero's own lines written through the progress bar so they never glue
to it, and no progress bar (so no cursor codes) when stdout is not a terminal, e.g. a Slurm log.

    step 7/15 | stage 2/3 medium | loss 6.0500 | lr 1.83e-03 | 2,114 tok/s
    eval at step 10 (end of stage 'medium'): short 5.8400 | medium 5.8870 | long 5.8850 | mean 5.8707
"""

from __future__ import annotations

import os
import sys

from hf_zero.core.files import human_bytes

__all__ = ["VERBOSE_ENV", "rank", "quiet_environment", "setup_console", "verbose", "say", "console_callback",
           "step_line", "eval_line"]

VERBOSE_ENV = "HF_ZERO_VERBOSE"


def rank() -> int:
    """This process's rank in the run (0 when not launched by torchrun / accelerate)."""
    return int(os.environ.get("RANK", "0"))


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV) == "1"


def quiet_environment(env=os.environ) -> None:
    """Settings every process of the run inherits: set before torch, DeepSpeed or the hub libraries load. In this
    process also the stack's FutureWarnings (deprecations for its maintainers; a run would print hundreds)."""
    if env.get(VERBOSE_ENV) == "1":
        return
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    env.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # weight loading / shard writing bars, one per rank
    env.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    # bars made with tqdm directly (GGUF conversion); hf_zero's own passes disable=False
    env.setdefault("TQDM_DISABLE", "1")
    env.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    if "DS_ACCELERATOR" not in env:
        import torch  # only here: `hf-zero --help` and the light commands never reach it

        if not torch.cuda.is_available():
            # Named up front, DeepSpeed skips its probe and the "Setting accelerator to CPU" warning per process.
            env["DS_ACCELERATOR"] = "cpu"


def setup_console() -> None:
    """At the recipe's entry, before torch, DeepSpeed or transformers load."""
    quiet_environment()
    if verbose():
        return
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    if rank() != 0:
        # Every rank prints the same lines; one copy is enough. A failing rank's traceback still reaches the
        # launcher through its error file (hf_zero.launch.worker).
        sys.stdout.flush()
        sys.stderr.flush()
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        os.close(devnull)


def say(*parts) -> None:
    """Print a line on rank 0 without breaking a progress bar that is on screen."""
    if rank() != 0:
        return
    from tqdm.auto import tqdm

    tqdm.write(" ".join(str(p) for p in parts), file=sys.stdout)
    sys.stdout.flush()


def step_line(logs: dict, step: int, max_steps: int, stage: str | None) -> str:
    parts = [f"step {step}/{max_steps}"]
    if stage:
        parts.append(f"stage {stage}")
    parts.append(f"loss {logs['loss']:.4f}")
    if "learning_rate" in logs:
        parts.append(f"lr {logs['learning_rate']:.2e}")
    if logs.get("tokens_per_second") is not None:
        parts.append(f"{logs['tokens_per_second']:,.0f} tok/s")
    if logs.get("peak_memory_bytes") is not None:
        parts.append(f"peak mem {human_bytes(logs['peak_memory_bytes'])}")
    if logs.get("mfu") is not None:
        parts.append(f"MFU {logs['mfu']:.2f}")
    return " | ".join(parts)


_NOT_SHOWN = ("_runtime", "_samples_per_second", "_steps_per_second", "_perplexity")


def eval_line(metrics: dict, when: str) -> str:
    """One evaluation (all held-out sets at one step) as one line; with several per-stage losses, their mean."""
    shown, losses = [], []
    for key, value in metrics.items():
        if not key.startswith("eval_") or key.endswith(_NOT_SHOWN) or not isinstance(value, (int, float)):
            continue
        name = key[len("eval_"):]
        if name.endswith("_loss"):
            name = name[: -len("_loss")]
            losses.append(value)
        shown.append(f"{name} {value:.4f}")
    if len(losses) > 1:
        shown.append(f"mean {sum(losses) / len(losses):.4f}")
    return f"eval {when}: " + " | ".join(shown)


def console_callback(schedule=None, eval_sets: int = 1):
    """The Trainer's progress callback, replaced: see the module docstring. `eval_sets`: how many held-out sets
    one evaluation logs separately (their line is printed when the last one is in)."""
    from transformers import TrainerCallback

    class ConsoleCallback(TrainerCallback):
        def __init__(self):
            self.bar, self.done, self.pending, self.pending_step, self.received = None, 0, {}, None, 0

        def on_train_begin(self, args, state, control, **kwargs):
            if state.is_world_process_zero and sys.stdout.isatty() and not args.disable_tqdm:
                from tqdm.auto import tqdm

                self.bar = tqdm(total=state.max_steps, initial=state.global_step, dynamic_ncols=True,
                                file=sys.stdout, leave=False, disable=False)  # TQDM_DISABLE is for the others
            self.done = state.global_step

        def on_step_begin(self, args, state, control, **kwargs):
            self._flush(state)

        def on_step_end(self, args, state, control, **kwargs):
            if self.bar is not None:
                self.bar.update(state.global_step - self.done)
            self.done = state.global_step

        def on_log(self, args, state, control, logs=None, **kwargs):
            if not state.is_world_process_zero or not logs:
                return
            if any(k.startswith("eval_") for k in logs):
                if self.pending_step not in (None, state.global_step):
                    self._flush(state)
                self.pending.update(logs)
                self.pending_step = state.global_step
                self.received += 1
                if self.received >= eval_sets:
                    self._flush(state)
                return
            self._flush(state)
            if "loss" in logs:
                say(step_line(logs, state.global_step, state.max_steps, self._stage(logs.get("stage"))))

        def on_train_end(self, args, state, control, **kwargs):
            self._flush(state)
            if self.bar is not None:
                self.bar.close()
                self.bar = None

        def _stage(self, index):
            if schedule is None or index is None:
                return None
            return f"{index + 1}/{len(schedule.spans)} {schedule.spans[index].name}"

        def _flush(self, state):
            if not self.pending:
                return
            step = self.pending_step
            when = "before training" if step == 0 else f"at step {step}"
            if schedule is not None and step:
                span = schedule.stage_at(step - 1)
                if step == span.end_step:
                    when += f" (end of stage '{span.name}')"
            say(eval_line(self.pending, when))
            self.pending, self.pending_step, self.received = {}, None, 0

    return ConsoleCallback()
