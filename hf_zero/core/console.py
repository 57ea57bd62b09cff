"""A console a person reads: rank 0 only, the libraries' noise off unless HF_ZERO_VERBOSE=1 (`--verbose`), one line
per logging step and one per evaluation, hf_zero's own lines written through the progress bar so they never glue
to it, and no progress bar (so no cursor codes) when stdout is not a terminal, e.g. a Slurm log: there each step
line ends with the time spent and left, which the bar would show.

    step 7/15 | stage 2/3 medium | loss 6.0500 | lr 1.83e-03 | 2,114 tok/s | elapsed 14s | left 16s
    eval at step 10 (end of stage 'medium'): short 5.8400 | medium 5.8870 | long 5.8850 | mean 5.8707
"""

from __future__ import annotations

import contextlib
import os
import sys
import time

from hf_zero.core import startup
from hf_zero.core.files import human_bytes

__all__ = ["VERBOSE_ENV", "QUIET_ENV", "QUIET_WARNINGS", "QUIET_LOGGERS", "rank", "quiet_environment", "quiet_loggers",
           "setup_console", "verbose", "say", "progress_prints", "console_callback", "step_line", "eval_line",
           "eta_text", "stage_time_left", "duration", "MEAN_LOSS", "EXACT_MATCH"]

VERBOSE_ENV = "HF_ZERO_VERBOSE"


def rank() -> int:
    """This process's rank in the run (0 when not launched by torchrun / accelerate)."""
    return int(os.environ.get("RANK", "0"))


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV) == "1"


# Library warnings nobody running hf_zero can act on, by category and the module that raises them (a regex matched at
# the start of the module's name): the stack's deprecations, meant for its maintainers (a run would print hundreds),
# and PEFT's two notes after every LoRA save (it looks the base model up on the hub to learn whether its vocabulary
# changed; offline, or with a model built from a config, it cannot, and says so); and accelerate's note, per rank,
# that it set the CPU threads itself where OMP_NUM_THREADS was unset (its default stays; only the note goes).
QUIET_WARNINGS = ((FutureWarning, ""), (UserWarning, r"peft\."), (UserWarning, r"accelerate\.state"))
# Libraries with no switch but their logger: bitsandbytes, on a CPU with AVX512-BF16, warns as it loads (peft loads it)
# that it cannot fetch an optional fused kernel from the hub (kernels-community) and goes on with its own.
QUIET_LOGGERS = ("bitsandbytes",)
# The libraries' own switches, as environment variables: read when each library loads, in this process and in every
# process started from it (the ranks).
QUIET_ENV = {
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",  # weight loading / shard writing bars, one per rank
    "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
    "TQDM_DISABLE": "1",  # bars made with tqdm directly (DeepSpeed's zero_to_fp32, GGUF conversion)
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    "TRANSFORMERS_VERBOSITY": "error",  # notices such as the embedding resize and the LOAD REPORT table
    "DATASETS_VERBOSITY": "error",
    "HF_HUB_VERBOSITY": "error",
}


def quiet_environment(env=os.environ) -> None:
    """The one rule for the console, applied at every entry (the `hf-zero` command, the recipes' ranks): the
    libraries' warnings and progress bars are off unless HF_ZERO_VERBOSE=1 (`--verbose`). Through the libraries'
    own switches only, so their errors still show: the environment variables above (set before torch, DeepSpeed
    or the hub libraries load), the same switches called on a library this process has loaded already, and the
    warnings filters above."""
    quiet_loggers(env.get(VERBOSE_ENV) != "1")
    if env.get(VERBOSE_ENV) == "1":
        return
    import warnings

    for category, module in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", category=category, module=module)
    for key, value in QUIET_ENV.items():
        env.setdefault(key, value)
    _quiet_loaded_libraries()
    if "DS_ACCELERATOR" not in env:
        import torch  # only here: `hf-zero --help` never reaches it; every command loads torch anyway

        if not torch.cuda.is_available():
            # Named up front, DeepSpeed skips its probe and the "Setting accelerator to CPU" warning per process.
            env["DS_ACCELERATOR"] = "cpu"


def quiet_loggers(quiet: bool) -> None:
    """QUIET_LOGGERS at ERROR (their errors still show), or back to the default for `--verbose`. Also called as
    hf_zero is first imported (hf_zero/__init__.py): these libraries log as they load, and a recipe imports them
    before its entry sets up the console."""
    import logging

    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR if quiet else logging.NOTSET)


def _quiet_loaded_libraries() -> None:
    """A library loaded before the console was set up (a recipe imports transformers at its top, before its entry
    runs) has read its environment already: its own switch, called here. A library not loaded yet is not loaded
    for this; it reads the environment when it is. tqdm itself has no switch after import: the libraries' bars
    go through their own wrappers, switched off here."""
    if "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    if "transformers" in sys.modules:
        from transformers.utils import logging as transformers_logging

        transformers_logging.set_verbosity_error()
        transformers_logging.disable_progress_bar()
    if "datasets" in sys.modules:
        from datasets.utils import logging as datasets_logging

        datasets_logging.set_verbosity_error()
        datasets_logging.disable_progress_bar()


def setup_console() -> None:
    """At the recipe's entry, before torch, DeepSpeed or transformers load."""
    quiet_environment()
    if verbose():
        return
    if rank() != 0:
        # Every rank prints the same lines; one copy is enough. A failing rank's traceback still reaches the
        # launcher through its error file (hf_zero.launch.worker).
        sys.stdout.flush()
        sys.stderr.flush()
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        os.close(devnull)


@contextlib.contextmanager
def progress_prints():
    """Around a library call that reports its progress with print() and has no switch for it (DeepSpeed's
    zero_to_fp32 reader): its stdout goes nowhere unless verbose. Only stdout: its warnings (stderr) and its
    errors (exceptions) still show."""
    if verbose():
        yield
        return
    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
        yield


def say(*parts) -> None:
    """Print a line on rank 0 without breaking a progress bar that is on screen."""
    if rank() != 0:
        return
    from tqdm.auto import tqdm

    tqdm.write(" ".join(str(p) for p in parts), file=sys.stdout)
    sys.stdout.flush()


def step_line(logs: dict, step: int, max_steps: int, stage: str | None, timing: tuple | None = None) -> str:
    """One logging step. `timing`: (seconds since this process started training, steps it has done[, seconds since
    its first step began]), for a log file (no progress bar to show them): the line then ends with the time spent
    and the time left."""
    parts = [f"step {step}/{max_steps}"]
    if stage:
        parts.append(f"stage {stage}")
    parts.append(f"loss {logs['loss']:.4f}")
    if "learning_rate" in logs:
        parts.append(f"lr {logs['learning_rate']:.2e}")
    if logs.get("rewards/accuracies") is not None:  # a dpo stage's step (hf_zero.train.preference)
        parts.append(f"reward acc {logs['rewards/accuracies']:.2f} margin {logs['rewards/margins']:.3f}")
    if logs.get("tokens_per_second") is not None:
        parts.append(f"{logs['tokens_per_second']:,.0f} tok/s")
    if logs.get("peak_memory_bytes") is not None:
        parts.append(f"peak mem {human_bytes(logs['peak_memory_bytes'])}")
    if logs.get("mfu") is not None:
        parts.append(f"MFU {logs['mfu']:.2f}")
    if timing is not None:
        parts.append(eta_text(*timing[:2], max_steps - step, *timing[2:]))  # (elapsed, done, stepping[, left])
    return " | ".join(parts)


def duration(seconds: float) -> str:
    """45s, 3m07s, 2h05m: short enough for every step line."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def eta_text(elapsed: float, steps_done: int, steps_left: int, stepping: float | None = None,
             left: float | None = None) -> str:
    """Time spent and time left: `left` where the caller knows it by stage (stage_time_left), else at the mean step
    time so far: over `stepping`, the seconds since this process's first step began (a resumed run counts from its
    own first step), else over `elapsed`. What ran before the first step (the evaluation and the answers before
    training) is in neither the mean nor the steps left; the stage-end evaluations and checkpoints are in the mean,
    as they will be in the steps left."""
    if left is None and steps_done > 0:
        left = (elapsed if stepping is None else stepping) / steps_done * steps_left
    return f"elapsed {duration(elapsed)} | left {duration(left) if left is not None else '?'}"


def stage_time_left(measured: dict[int, tuple[float, int]], remaining: dict[int, int],
                    tokens: tuple[float, ...] | None) -> float | None:
    """Seconds left, stage by stage: `measured` {stage: (seconds, steps)} of the steps this process has run,
    `remaining` {stage: steps} still to run. A stage's steps take its own mean step time once it has one; a stage
    not started yet, the seconds per token of those that ran times its rows' mean tokens (`tokens`, per stage), as
    a stage of longer rows takes longer a step (the mean over all steps would say 47 s where 4 minutes were left,
    at the end of `make train`'s short-line stage); without token counts, the mean step time so far."""
    runs = {i: (s, n) for i, (s, n) in measured.items() if n > 0}
    if not runs:
        return None
    seconds, steps = sum(s for s, _ in runs.values()), sum(n for _, n in runs.values())
    per_token = seconds / sum(tokens[i] * n for i, (_, n) in runs.items()) if tokens else None
    left = 0.0
    for stage, count in remaining.items():
        if stage in runs:
            left += count * runs[stage][0] / runs[stage][1]
        elif per_token is not None:
            left += count * tokens[stage] * per_token
        else:
            left += count * seconds / steps
    return left


_NOT_SHOWN = ("_runtime", "_samples_per_second", "_steps_per_second", "_perplexity")
MEAN_LOSS = "eval_mean_loss"  # logged by the curriculum's evaluation after its per-stage losses (train/trainer.py)
EXACT_MATCH = "eval_exact_match"  # the held-out prompts answered, before that step's evaluation (train/samples.py)


def eval_line(metrics: dict, when: str, exact_match: tuple | None = None) -> str:
    """One evaluation (all held-out sets at one step) as one line; with several per-stage losses, their mean.
    `exact_match`: (now, before training[, prompts]) of the answered held-out prompts (train/samples.py), either
    None; `prompts`: how many were answered now."""
    shown, losses = [], []
    for key, value in metrics.items():
        if (not key.startswith("eval_") or key.endswith(_NOT_SHOWN) or key in (MEAN_LOSS, EXACT_MATCH)
                or not isinstance(value, (int, float))):
            continue
        name = key[len("eval_"):]
        if name.endswith("_loss"):
            name = name[: -len("_loss")]
            losses.append(value)
        shown.append(f"{name} {value:.4f}")
    mean = metrics.get(MEAN_LOSS, sum(losses) / len(losses) if len(losses) > 1 else None)
    if mean is not None and len(losses) > 1:
        shown.append(f"mean {mean:.4f}")
    now, before, prompts = (*(exact_match or (None, None)), None)[:3]
    if now is not None:
        shown.append(f"exact match {now:.2f}" + (f" of {prompts:,} prompts" if prompts else "")
                     + (f" (before training {before:.2f})" if before is not None else ""))
    return f"eval {when}: " + " | ".join(shown)


def console_callback(schedule=None, eval_sets: int = 1, stage_tokens: tuple[float, ...] | None = None):
    """The Trainer's progress callback, replaced: see the module docstring. `eval_sets`: how many logs one
    evaluation makes (each held-out set's, and the mean's; its line is printed when the last one is in).
    `stage_tokens`: each stage's mean tokens per row, for the time left (stage_time_left)."""
    from transformers import TrainerCallback

    class ConsoleCallback(TrainerCallback):
        def __init__(self):
            self.bar, self.done, self.pending, self.pending_step, self.received = None, 0, {}, None, 0
            # started: train() began; stepping: the first step began (what ran before it is no step's time)
            self.started, self.stepping, self.first_step, self.exact = None, None, 0, {}
            self.batches, self.batches_since, self.sets_done = 0, None, 0  # an evaluation before the first step
            self.stage_seconds, self.step_ended = {}, None  # {stage: (seconds, steps)} this process ran

        def on_train_begin(self, args, state, control, **kwargs):
            self.done = self.first_step = state.global_step
            self.started = time.monotonic()

        def on_step_begin(self, args, state, control, **kwargs):
            if self.stepping is None:
                self.stepping = self.step_ended = time.monotonic()
                if state.is_world_process_zero and sys.stdout.isatty() and not args.disable_tqdm:
                    # from the first step on: its rate (and so its time left) counts no evaluation before it
                    from tqdm.auto import tqdm

                    self.bar = tqdm(total=state.max_steps, initial=state.global_step, dynamic_ncols=True,
                                    file=sys.stdout, leave=False, disable=False)  # TQDM_DISABLE is for the others
            self._flush(state)

        def on_prediction_step(self, args, state, control, eval_dataloader=None, **kwargs):
            """Before the first step (start-up, which the heartbeat tells): how far the evaluation before training
            has come and how long it has left, on the heartbeat's lines."""
            if startup.current() is None or eval_dataloader is None:
                return
            now = time.monotonic()
            if self.batches_since is None:
                self.batches_since = now
            self.batches += 1
            sets = max(1, eval_sets - 1) if eval_sets > 1 else 1  # the held-out sets (then their mean's log)
            total = len(eval_dataloader)
            # the clock starts at the first batch's end: the batches after it give the time a batch takes
            left = ((now - self.batches_since) / (self.batches - 1) * (total - self.batches)
                    if self.batches > 1 else None)
            startup.progress(f"held-out set {min(self.sets_done + 1, sets)}/{sets}, batch {self.batches}/{total}"
                             + (f", about {duration(left)} left for this set" if left is not None else ""))

        def on_step_end(self, args, state, control, **kwargs):
            if self.bar is not None:
                self.bar.update(state.global_step - self.done)
            self.done = state.global_step
            if self.step_ended is not None:  # what ran after the previous step (a stage's evaluation) counts too
                now, stage = time.monotonic(), self._stage_index(state.global_step - 1)
                seconds, steps = self.stage_seconds.get(stage, (0.0, 0))
                self.stage_seconds[stage] = (seconds + now - self.step_ended, steps + 1)
                self.step_ended = now

        def on_log(self, args, state, control, logs=None, **kwargs):
            if not state.is_world_process_zero or not logs:
                return
            if EXACT_MATCH in logs:  # before the evaluation of the same step: shown on its line
                stages = self.exact.setdefault(state.global_step, {})
                for key, value in logs.items():  # each stage answered: samples_<stage>_exact_match / _prompts
                    for suffix, what in (("_exact_match", "match"), ("_prompts", "prompts")):
                        if key.startswith("samples_") and key.endswith(suffix):
                            stages.setdefault(key[len("samples_"):-len(suffix)], {})[what] = value
                if not stages:  # logged without per-stage keys: one set
                    stages[""] = {"match": logs[EXACT_MATCH]}
                return
            if any(k.startswith("eval_") for k in logs):
                self.batches, self.batches_since, self.sets_done = 0, None, self.sets_done + 1  # a set is done
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
                timing = None
                if self.bar is None and self.started is not None:  # a log file: no bar shows the time
                    now = time.monotonic()
                    timing = (now - self.started, state.global_step - self.first_step,
                              now - (self.stepping or self.started), self._left(state))
                say(step_line(logs, state.global_step, state.max_steps, self._stage(logs.get("stage")), timing))

        def on_train_end(self, args, state, control, **kwargs):
            self._flush(state)
            if self.bar is not None:
                self.bar.close()
                self.bar = None

        def _exact_match(self, step):
            """(now, before training, prompts): the mean over the stages answered at `step`, and over the same
            stages before training (None unless each was answered then)."""
            now = {n: v for n, v in self.exact.get(step, {}).items() if "match" in v}
            if not now:
                return None
            mean = lambda d, names: sum(d[n]["match"] for n in names) / len(names)  # noqa: E731
            start = self.exact.get(0, {}) if step else {}
            before = mean(start, list(now)) if now and all(n in start for n in now) else None
            prompts = sum(v.get("prompts", 0) for v in now.values()) or None
            return mean(now, list(now)), before, prompts

        def _stage_index(self, step: int) -> int:
            return schedule.stage_at(step).index if schedule is not None else 0

        def _left(self, state) -> float | None:
            spans = schedule.spans if schedule is not None else ()
            remaining = {span.index: min(span.end_step, state.max_steps) - max(span.start_step, state.global_step)
                         for span in spans} if spans else {0: state.max_steps - state.global_step}
            return stage_time_left(self.stage_seconds, {i: n for i, n in remaining.items() if n > 0},
                                   stage_tokens if spans else None)

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
            say(eval_line(self.pending, when, self._exact_match(step)))
            self.pending, self.pending_step, self.received = {}, None, 0

    return ConsoleCallback()
