"""A training run's time left, worked out stage by stage (the console's step lines end with it, hf_zero.core.progress):
each started stage at its own mean step time, each stage not started by its rows' tokens (a fixed cost per step plus
a cost per token, from the stages run or, while one has run, from the held-out batches before training), then the
stage ends still to come."""

from __future__ import annotations

__all__ = ["duration", "eta_text", "stage_time_left", "step_passes"]


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
    training) is in neither the mean nor the steps left; on this fallback the evaluations and checkpoints between
    steps are in the mean (stage_time_left counts the stage ends apart)."""
    if left is None and steps_done > 0:
        left = (elapsed if stepping is None else stepping) / steps_done * steps_left
    return f"elapsed {duration(elapsed)} | left {duration(left) if left is not None else '?'}"


def stage_time_left(measured: dict[int, tuple[float, int]], remaining: dict[int, int],
                    tokens: tuple[float, ...] | None, stage_ends: int = 0, per_stage_end: float = 0.0,
                    passes=None) -> float | None:
    """Seconds left, stage by stage: `measured` {stage: (seconds, steps)} of the steps this process has run,
    `remaining` {stage: steps} still to run, then `stage_ends` stage ends still to come at `per_stage_end` seconds
    each (the held-out evaluation and answers that run between one stage's last step and the next one's first).

    A stage's steps take its own mean step time once it has one. A stage not started yet takes a + b x its rows'
    mean tokens (`tokens`, per stage), fitted over the stages that ran: a step has a fixed cost besides its tokens,
    so seconds per token alone over-counted a stage of longer rows (1.5-2x, `make train`). With one stage run (or a
    fit that comes out negative) the steps cannot part the two: `passes`, a step's forward and backward seconds at
    t tokens a row (step_passes: from the held-out sets' batches before training, whose rows are each stage's),
    else the seconds per token so far, which errs high for a stage of longer rows (`make train` said 5m12s at its
    first stage's end where 2m40s were left). The mean over all steps said 47 s where 4 minutes were left, at the
    end of `make train`'s short-line stage. Without token counts: the mean step time so far."""
    runs = {i: (s, n) for i, (s, n) in measured.items() if n > 0}
    if not runs:
        return None
    seconds, steps = sum(s for s, _ in runs.values()), sum(n for _, n in runs.values())
    step_time = _step_time_by_tokens(runs, tokens, passes) if tokens else None
    left = stage_ends * per_stage_end
    for stage, count in remaining.items():
        if stage in runs:
            left += count * runs[stage][0] / runs[stage][1]
        elif step_time is not None:
            left += count * step_time(tokens[stage])
        else:
            left += count * seconds / steps
    return left


def _step_time_by_tokens(runs: dict[int, tuple[float, int]], tokens: tuple[float, ...], passes=None):
    """Seconds a step of rows of t tokens, from the stages run: least squares a + b t over each stage's mean step
    time where two or more stages with different token counts ran and both terms come out non-negative; else
    `passes(t)`, the seconds its forward and backward passes take (step_passes), plus the rest of a step (the
    optimizer, the gradients' exchange) as the steps run left it, or `passes` scaled to the steps run where that
    rest comes out negative; else the seconds per token so far."""
    fitted = _affine([(tokens[i], s / n) for i, (s, n) in runs.items()])
    if fitted is not None:
        return fitted
    seconds, steps = sum(s for s, _ in runs.values()), sum(n for _, n in runs.values())
    if passes is not None:
        rest = (seconds - sum(passes(tokens[i]) * n for i, (_, n) in runs.items())) / steps
        if rest >= 0:
            return lambda t: rest + passes(t)
    shape = passes or (lambda t: t)
    scale = seconds / sum(shape(tokens[i]) * n for i, (_, n) in runs.items())
    return lambda t: scale * shape(t)


def _affine(points: list[tuple[float, float]]):
    """a + b x by least squares over (x, y) points, or None: fewer than two distinct x, or a or b negative."""
    if len({x for x, _ in points}) < 2:
        return None
    mean_x, mean_y = sum(x for x, _ in points) / len(points), sum(y for _, y in points) / len(points)
    b = sum((x - mean_x) * (y - mean_y) for x, y in points) / sum((x - mean_x) ** 2 for x, _ in points)
    a = mean_y - b * mean_x
    return (lambda x: a + b * x) if a >= 0 and b >= 0 else None


def step_passes(batch_seconds: dict[int, list[float]], set_tokens: tuple[float, ...], eval_rows: int,
                train_rows: int, micro_batches: int, checkpointing: bool = False):
    """Seconds a training step's forward and backward passes take at t tokens a row, from the held-out sets'
    batches before training: `batch_seconds` {set: seconds of each batch timed}, `set_tokens` each set's tokens
    a row; a forward batch of `eval_rows` rows costs a + b x its tokens, fitted over the sets. A step runs
    `micro_batches` micro-batches of `train_rows` rows, each forward and backward taken as 3.5 forwards (the
    backward computes two products per forward product, and autograd keeps what the no-grad evaluation does not;
    one more with gradient checkpointing, which runs the forward again). None where the sets do not part a and b
    (one set timed, or the fit negative). Measured on two runs of `make train` (2 CPU ranks, ZeRO-2, LoRA): its
    three stages' steps took 1.0-1.2, 3.6-3.9 and 5.0 s, 2.8-3.8 forwards besides a rest of about 0.6 s; seconds
    per token alone, as the first stage left them, made the later steps 2-3x too slow."""
    points = [(eval_rows * set_tokens[k], sum(times) / len(times))
              for k, times in batch_seconds.items() if times and k < len(set_tokens)]
    forward = _affine(points)
    if forward is None:
        return None
    per_forward = micro_batches * (4.5 if checkpointing else 3.5)
    return lambda t: per_forward * forward(train_rows * t)
