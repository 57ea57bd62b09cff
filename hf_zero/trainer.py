"""`CurriculumTrainer`: a thin `transformers.Trainer` subclass. Public hooks only: the scheduler follows the
curriculum, logs carry the stage index and eval perplexity, the causal-LM loss skips the full logits (fused_ce.py)."""

from __future__ import annotations

import math

from transformers import Trainer

from .checkpoint_saving import SafeCheckpointMixin
from .curriculum import CurriculumCallback, CurriculumSchedule
from .fused_ce import FusedCrossEntropyMixin

__all__ = ["CurriculumTrainer", "stage_table", "step_losses"]


class CurriculumTrainer(FusedCrossEntropyMixin, SafeCheckpointMixin, Trainer):
    # FusedCrossEntropyMixin: compute_loss without full logits, `fused_cross_entropy=` auto|True|False (fused_ce.py).
    # SafeCheckpointMixin: staged, verified checkpoints with a manifest, rotation keeping the best (checkpoints.py).
    def __init__(self, *args, schedule: CurriculumSchedule, **kwargs):
        self.schedule = schedule
        super().__init__(*args, **kwargs)
        self.add_callback(CurriculumCallback(schedule, has_eval=self.eval_dataset is not None))

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        """Each stage's own peak LR, warmup and decay, as one LambdaLR over the optimizer's base LR."""
        import torch

        if self.lr_scheduler is None:
            optimizer = optimizer or self.optimizer
            base = self.args.learning_rate
            self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
                optimizer, lambda step: self.schedule.lr_at(step) / base
            )
            self._created_lr_scheduler = True
        return self.lr_scheduler

    def log(self, logs: dict, start_time=None) -> None:
        if "loss" in logs:
            logs["stage"] = self.schedule.stage_at(max(0, self.state.global_step - 1)).index
        for key in [k for k in logs if k.startswith("eval_") and k.endswith("_loss")]:
            logs[key[: -len("_loss")] + "_perplexity"] = math.exp(min(logs[key], 50.0))
        super().log(logs, start_time)


def stage_table(schedule: CurriculumSchedule, log_history: list[dict]) -> list[dict]:
    """Per stage: steps, first and last training loss, last eval loss (from the Trainer's log history)."""
    rows = []
    for span in schedule.spans:
        losses = [h["loss"] for h in log_history
                  if "loss" in h and span.start_step < h["step"] <= span.end_step]
        evals = [h[f"eval_{span.name}_loss"] for h in log_history if f"eval_{span.name}_loss" in h]
        rows.append({
            "name": span.name,
            "steps": span.steps,
            "first_step": span.start_step + 1,
            "last_step": span.end_step,
            "first_loss": losses[0] if losses else None,
            "last_loss": losses[-1] if losses else None,
            "eval_loss": evals[-1] if evals else None,
        })
    return rows


def step_losses(log_history: list[dict]) -> list[float]:
    """The training loss of every logged step, in order (one per step with hf_zero's logging_steps=1)."""
    return [h["loss"] for h in log_history if "loss" in h and "step" in h]
