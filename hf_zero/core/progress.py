"""What a training run prints per step and per evaluation, and its time left (the console's rules are in
hf_zero.core.console): one line per logging step and one per evaluation, and no progress bar (so no cursor codes)
when stdout is not a terminal, e.g. a Slurm log: there each step line ends with the time spent and left, which the
bar would show.

    step 7/15 | stage 2/3 medium | loss 6.0500 | lr 1.83e-03 | 2,114 tok/s | elapsed 14s | left 16s
    eval at step 10 (end of stage 'medium'): short 5.8400 | medium 5.8870 | long 5.8850 | mean 5.8707
"""

from __future__ import annotations

import sys
import time

from hf_zero.core import startup
from hf_zero.core.console import say
from hf_zero.core.files import human_bytes
from hf_zero.core.time_left import duration, eta_text, stage_time_left, step_passes

__all__ = ["console_callback", "step_line", "eval_line", "MEAN_LOSS", "EXACT_MATCH"]


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


def console_callback(schedule=None, eval_sets: int = 1, stage_tokens: tuple[float, ...] | None = None,
                     eval_tokens: tuple[float, ...] | None = None):
    """The Trainer's progress callback, replaced: see the module docstring. `eval_sets`: how many logs one
    evaluation makes (each held-out set's, and the mean's; its line is printed when the last one is in).
    `stage_tokens`: each stage's mean tokens per row, for the time left (stage_time_left); `eval_tokens`: each
    held-out set's, in the order they are evaluated, for a step's cost by its rows' length (step_passes)."""
    from transformers import TrainerCallback

    class ConsoleCallback(TrainerCallback):
        def __init__(self):
            self.bar, self.done, self.pending, self.pending_step, self.received = None, 0, {}, None, 0
            # started: train() began; stepping: the first step began (what ran before it is no step's time)
            self.started, self.stepping, self.first_step, self.exact = None, None, 0, {}
            self.batches, self.batches_since, self.sets_done = 0, None, 0  # an evaluation before the first step
            # For the time left: {stage: (seconds, steps)} this process ran, its first step apart (it carries
            # one-time costs: the engine's first allocations), the seconds between a stage's last step and the
            # next one's first (its evaluation and answers), and those before the first step (the same work).
            self.stage_seconds, self.warm_up, self.stage_ends, self.before_first = {}, None, [], None
            self.step_began, self.step_ended, self.between = None, None, 0.0
            # The held-out batches before the first step, timed per set (step_passes), from the previous batch's
            # or set's end; the first batch of all is left out (the engine's first forward, the answers before it).
            self.batch_seconds, self.batch_mark, self.rows = {}, None, (1, 1, 1, False)

        def on_train_begin(self, args, state, control, **kwargs):
            self.done = self.first_step = state.global_step
            self.started = time.monotonic()
            self.rows = (args.per_device_eval_batch_size, args.per_device_train_batch_size,
                         args.gradient_accumulation_steps, bool(args.gradient_checkpointing))

        def on_step_begin(self, args, state, control, **kwargs):
            now = time.monotonic()
            if self.step_ended is not None:  # what ran since the previous step: an evaluation, answers, a save
                if self._stage_index(state.global_step) != self._stage_index(state.global_step - 1):
                    self.stage_ends.append(now - self.step_ended)
                else:
                    self.between = now - self.step_ended  # an evaluation every N steps: in the steps' mean
            self.step_began = now
            if self.stepping is None:
                self.stepping = now
                self.before_first = now - (self.started if self.started is not None else now)
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
            if self.batch_mark is not None:
                self.batch_seconds.setdefault(self.sets_done, []).append(now - self.batch_mark)
            self.batch_mark = now
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
            now, stage = time.monotonic(), self._stage_index(state.global_step - 1)
            began = self.step_began if self.step_began is not None else self.step_ended
            if began is not None:
                took = now - began + self.between
                if self.warm_up is None:
                    self.warm_up = (stage, took)
                else:
                    seconds, steps = self.stage_seconds.get(stage, (0.0, 0))
                    self.stage_seconds[stage] = (seconds + took, steps + 1)
            self.step_began, self.step_ended, self.between = None, now, 0.0

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
                if self.batch_mark is not None:
                    self.batch_mark = time.monotonic()  # the next set's first batch counts from here
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
            measured = dict(self.stage_seconds)
            if self.warm_up is not None and self.warm_up[0] not in measured:  # its stage's one step so far
                measured[self.warm_up[0]] = (self.warm_up[1], 1)
            # Each stage end still to come, the last one's included (the run's final evaluation and answers), as
            # long as those measured, or, before one was, as the evaluation and answers before the first step,
            # which do the same work (for every stage's prompts at once: it errs high in the meantime).
            ends = [s for s in spans if state.global_step <= s.end_step <= state.max_steps]
            each = (sum(self.stage_ends) / len(self.stage_ends) if self.stage_ends else self.before_first or 0.0)
            passes = step_passes(self.batch_seconds, eval_tokens, *self.rows) if eval_tokens else None
            return stage_time_left(measured, {i: n for i, n in remaining.items() if n > 0},
                                   stage_tokens if spans else None, len(ends), each, passes)

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
