"""A curriculum of stages inside ONE `Trainer.train()` call with one DeepSpeed engine.

Rebuilding the engine per stage leaks memory and breaks resume, so the stages are laid out in
advance as one flat, deterministic sample order: optimizer step k uses samples [k*G, (k+1)*G) (G = global batch),
all from the stage that owns step k. With a sequential sampler, accelerate's per-rank batch sharding hands every rank
its part of exactly those samples, and a resumed run skips to the same place. The LR follows each stage's own
warmup and decay; a callback logs the switches and asks for per-stage evaluation at each stage end.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from hf_zero.core.config import Stage
from hf_zero.core.errors import UserError

__all__ = ["StageSpan", "CurriculumSchedule", "build_schedule", "build_sample_order", "CurriculumDataset",
           "mean_row_tokens"]


@dataclass(frozen=True)
class StageSpan:
    index: int
    name: str
    start_step: int  # first optimizer step (0-based) of the stage
    steps: int
    peak_lr: float
    warmup_steps: int
    lr_schedule: str
    min_lr_ratio: float

    @property
    def end_step(self) -> int:
        return self.start_step + self.steps


@dataclass(frozen=True)
class CurriculumSchedule:
    spans: tuple[StageSpan, ...]
    global_batch: int

    @property
    def total_steps(self) -> int:
        return self.spans[-1].end_step

    def stage_at(self, step: int) -> StageSpan:
        """The stage that owns 0-based optimizer step `step` (the last stage for steps past the end)."""
        for span in self.spans:
            if step < span.end_step:
                return span
        return self.spans[-1]

    def lr_at(self, step: int) -> float:
        span = self.stage_at(step)
        local = step - span.start_step
        if local < span.warmup_steps:
            return span.peak_lr * (local + 1) / (span.warmup_steps + 1)
        if span.lr_schedule == "constant":
            return span.peak_lr
        decay_steps = max(1, span.steps - span.warmup_steps)
        progress = min(1.0, (local - span.warmup_steps) / decay_steps)
        shape = 0.5 * (1 + math.cos(math.pi * progress)) if span.lr_schedule == "cosine" else 1 - progress
        return span.peak_lr * (span.min_lr_ratio + (1 - span.min_lr_ratio) * shape)

    def table(self) -> list[dict]:
        return [{"stage": s.name, "first_step": s.start_step + 1, "last_step": s.end_step, "lr": s.peak_lr}
                for s in self.spans]


def build_schedule(stages: list[Stage], pool_sizes: list[int], global_batch: int,
                   base_lr: float) -> CurriculumSchedule:
    """Steps per stage: `steps` as given, or `epochs` over the stage's training pool, rounded up to whole steps."""
    spans, start = [], 0
    for i, (stage, size) in enumerate(zip(stages, pool_sizes)):
        steps = stage.steps if stage.steps is not None else max(1, math.ceil(stage.epochs * size / global_batch))
        if stage.warmup_steps >= steps:  # a `steps:` stage was refused when parsed; an epoch's length shows here
            raise UserError(f"stages[{stage.name}].warmup_steps", f"must be shorter than the stage's {steps} steps "
                            f"({stage.epochs} epoch(s) of {size} samples; its peak learning rate is reached after the "
                            f"warmup), got {stage.warmup_steps}", f"e.g. warmup_steps: {steps // 10}")
        spans.append(StageSpan(i, stage.name, start, steps, stage.learning_rate or base_lr, stage.warmup_steps,
                               stage.lr_schedule, stage.min_lr_ratio))
        start += steps
    return CurriculumSchedule(tuple(spans), global_batch)


def build_sample_order(schedule: CurriculumSchedule, source_sizes: list[list[int]],
                       weights: list[list[float] | None], seed: int) -> np.ndarray:
    """Rows of (stage, source, index) for every sample of every step, reproducible from the seed.

    Within a source, samples come in reshuffled passes (epochs); across sources of one stage, each sample's source
    is drawn by the mixture weights.
    """
    rows = []
    for span, sizes, w in zip(schedule.spans, source_sizes, weights):
        rng = np.random.default_rng([seed, span.index])
        n = span.steps * schedule.global_batch
        probs = np.asarray(w if w else [float(s) for s in sizes], dtype=float)
        probs = probs / probs.sum()
        picks = rng.choice(len(sizes), size=n, p=probs) if len(sizes) > 1 else np.zeros(n, dtype=int)
        for src, size in enumerate(sizes):
            where = np.flatnonzero(picks == src)
            passes = math.ceil(len(where) / size) if len(where) else 0
            stream = np.concatenate([rng.permutation(size) for _ in range(passes)]) if passes else np.empty(0, int)
            block = np.empty((len(where), 3), dtype=np.int64)
            block[:, 0], block[:, 1], block[:, 2] = span.index, src, stream[: len(where)]
            rows.append((where + span.start_step * schedule.global_batch, block))
    order = np.empty((schedule.total_steps * schedule.global_batch, 3), dtype=np.int64)
    for positions, block in rows:
        order[positions] = block
    return order


class CurriculumDataset:
    """The flat training set: item i is sample `order[i]` of its stage's source (a torch map-style dataset)."""

    def __init__(self, sources: list[list], order: np.ndarray):
        self.sources, self.order = sources, order

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, i: int) -> dict:
        stage, src, idx = self.order[i]
        return self.sources[stage][src][int(idx)]

    def mean_tokens_per_stage(self, stages: int, sample: int = 256, batch: int = 1) -> tuple[float, ...] | None:
        """Mean tokens a row of each stage's scheduled samples takes through the model, in micro-batches of `batch`
        consecutive rows padded to their longest (mean_row_tokens; up to `sample` rows spread over the stage): the
        console's time left weighs a stage not trained yet by them. None when a stage's rows carry no ids."""
        means = []
        for stage in range(stages):
            where = np.flatnonzero(self.order[:, 0] == stage)
            mean = mean_row_tokens(_Picked(self, where), sample, batch)
            if mean is None:
                return None
            means.append(mean)
        return tuple(means)


class _Picked:
    """Rows `where` of a dataset, as a list (no copy)."""

    def __init__(self, data, where: np.ndarray):
        self.data, self.where = data, where

    def __len__(self) -> int:
        return len(self.where)

    def __getitem__(self, i: int) -> dict:
        return self.data[int(self.where[i])]


def mean_row_tokens(rows, sample: int = 256, batch: int = 1) -> float | None:
    """Mean tokens a row takes through the model in micro-batches of `batch` consecutive rows, each padded to the
    batch's longest, over up to `sample` rows in batches spread over `rows` (a list or a dataset of tokenized
    rows); None when a row carries no token ids (rows tokenized later, images alone). The padding counts: the
    stage of `make train` whose passages vary in length cost more a step than its mean tokens said, against the
    sonnets of one length (its time left 30% high)."""
    if not len(rows):
        return None
    starts = _spread(np.arange(0, len(rows), batch), max(1, sample // batch))
    longest = []
    for start in starts:
        sizes = [_row_tokens(rows[int(i)]) for i in range(start, min(start + batch, len(rows)))]
        if not all(sizes):
            return None
        longest.append(max(sizes))
    return float(np.mean(longest))


def _spread(indices: np.ndarray, sample: int) -> np.ndarray:
    return indices[np.linspace(0, len(indices) - 1, min(sample, len(indices))).astype(int)]


def _row_tokens(row: dict) -> int:
    """The token ids a row puts through the model: its input_ids, or a preference pair's prompt twice (before each
    answer) and both answers (hf_zero.data.preference)."""
    if "chosen_ids" in row:
        return 2 * len(row.get("prompt_ids") or ()) + len(row["chosen_ids"]) + len(row.get("rejected_ids") or ())
    return len(row.get("input_ids") or ())
