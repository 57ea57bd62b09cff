"""`CurriculumTrainer`: a thin `transformers.Trainer` subclass, both recipes' Trainer. Public hooks only, except
the one crash-safe saving needs (checkpoint/staging.py says why): the scheduler follows the curriculum, logs carry
the stage index and eval perplexity, the causal-LM loss skips the full logits (train/fused_ce.py), the held-out
loss is the token-weighted mean over the whole set on any rank count (train/held_out.py), evaluation adds the mean
loss over the stages' held-out sets."""

from __future__ import annotations

import math

from transformers import TrainerCallback

from hf_zero.checkpoint.staging import StagedCheckpointMixin
from hf_zero.checkpoint.write import CheckpointCallback
from hf_zero.core import startup
from hf_zero.core.console import say
from hf_zero.core.distributed import waiting_for
from hf_zero.core.progress import MEAN_LOSS, console_callback
from hf_zero.data.curriculum import CurriculumSchedule, mean_row_tokens
from hf_zero.integrations.accelerate import enable_fsdp_on_cpu
from hf_zero.integrations.lean_import import import_trainer
from hf_zero.integrations.torch import last_lr, set_last_lr
from hf_zero.launch.interrupt import stop_on_signal
from hf_zero.plan.run_plan import RunPlan
from hf_zero.train.callbacks import CurriculumCallback, Zero3UniversalFix
from hf_zero.train.fsdp import announce_layers
from hf_zero.train.fused_ce import FusedCrossEntropyMixin
from hf_zero.train.held_out import HeldOutLossMixin
from hf_zero.train.preference import PreferenceMixin
from hf_zero.train.sequence_parallel import SequenceParallelMixin
from hf_zero.train.throughput import throughput_callback

Trainer = import_trainer()  # a full fine-tune never imports peft (a LoRA run does, as it builds its model)

__all__ = ["CurriculumTrainer", "stage_table", "step_losses", "eval_rounds", "eval_means"]


class CurriculumTrainer(PreferenceMixin, HeldOutLossMixin, SequenceParallelMixin, FusedCrossEntropyMixin,
                        StagedCheckpointMixin, Trainer):
    # PreferenceMixin: the batches of dpo stages, TRL's losses against a cached reference (preference.py).
    # HeldOutLossMixin: the held-out loss as the token-weighted mean over the whole set, on any rank count.
    # SequenceParallelMixin: under Ulysses (sp_size > 1) the batches and the loss (sequence_parallel.py).
    # FusedCrossEntropyMixin: compute_loss without full logits, `fused_cross_entropy=` auto|True|False (fused_ce.py).
    # StagedCheckpointMixin: staged, verified checkpoints with a manifest, rotation keeping the best (staging.py).
    def __init__(self, *args, schedule: CurriculumSchedule, plan: RunPlan, settings: dict, **kwargs):
        from transformers import PrinterCallback, ProgressCallback

        startup.phase("building the Trainer")
        self.schedule, self.plan = schedule, plan  # the plan: what the checkpoints and throughput logs record
        self.settings = settings  # what the run trains (checkpoint/compare.py): every checkpoint records it
        super().__init__(*args, **kwargs)
        self.add_callback(CheckpointCallback(has_eval=self.eval_dataset is not None))
        for noisy in (ProgressCallback, PrinterCallback):  # raw dicts per step; hf_zero.core.progress prints lines
            self.remove_callback(noisy)
        # Each held-out set logs its own losses, then evaluate() logs their mean.
        sets = len(self.eval_dataset) + 1 if isinstance(self.eval_dataset, dict) else 1
        # the time left by rows' length: tokens a row takes through a micro-batch, padding included
        by_stage = getattr(self.train_dataset, "mean_tokens_per_stage", None)  # a curriculum's rows, not SP's
        tokens = by_stage(len(schedule.spans), batch=self.args.per_device_train_batch_size) if by_stage else None
        held_out = self.eval_dataset.values() if isinstance(self.eval_dataset, dict) else ()
        eval_tokens = tuple(mean_row_tokens(rows, batch=self.args.per_device_eval_batch_size) for rows in held_out)
        # before the stage-switch line: eval lines first
        self.add_callback(console_callback(schedule, sets, tokens, eval_tokens if all(eval_tokens) else None))
        self.add_callback(CurriculumCallback(schedule, has_eval=self.eval_dataset is not None, log=say))
        self.throughput = throughput_callback(self.model, plan.precision)
        self.add_callback(self.throughput)
        self.add_callback(stop_on_signal())  # last: at a stop it overrides what the others asked for

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        if self.is_deepspeed_enabled:
            # transformers hands accelerate 1 accumulation step (it accumulates itself); DeepSpeed's config holds
            # the run's count, which accelerate's prepare() adopts with a "mismatch" warning. The same value now:
            # nothing changes but the warning (issue 41, item 5).
            self.accelerator.gradient_accumulation_steps = self.args.gradient_accumulation_steps
        enable_fsdp_on_cpu(self)  # an FSDP profile on a machine without GPUs: FSDP2, not a silent DDP
        if self.is_fsdp_enabled:
            announce_layers(self)

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval"):
        """Adds `eval_loss`, the mean over the named eval sets, so metric_for_best_model has one loss to track."""
        metrics = super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)
        if eval_dataset is None and isinstance(self.eval_dataset, dict) and f"{metric_key_prefix}_loss" not in metrics:
            losses = [metrics[k] for n in self.eval_dataset if (k := f"{metric_key_prefix}_{n}_loss") in metrics]
            if losses:
                metrics[f"{metric_key_prefix}_loss"] = sum(losses) / len(losses)
                if metric_key_prefix == "eval":  # the run's one number: TensorBoard's eval/mean_loss, the console's
                    self.log({MEAN_LOSS: metrics["eval_loss"]})
        return metrics

    def create_optimizer(self, model=None):
        optimizer = super().create_optimizer(model)
        # This run's hyper-parameters per group, before a checkpoint's optimizer state replaces them on resume.
        self.fresh_groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        return optimizer

    def continue_with_this_runs_settings(self) -> None:
        """After a checkpoint was loaded (optimizer state and scheduler.pt): the optimizer's hyper-parameters are
        this run's, and the LR follows this run's schedule from the checkpoint's step. The loaded scheduler kept
        the old run's base LR, which LambdaLR multiplies by this run's lambda (new stage LR / new base LR): another
        base LR scaled every step after the resume (checkpoint/compare.py refuses that unless allowed). When nothing
        changed this sets the values that were loaded."""
        scheduler = getattr(self.lr_scheduler, "scheduler", self.lr_scheduler)  # accelerate's wrapper
        fresh = getattr(self, "fresh_groups", None)
        groups = scheduler.optimizer.param_groups
        if hasattr(scheduler, "lr_lambdas") and len(scheduler.base_lrs) != len(groups):
            # A checkpoint of another engine (checkpoint/convert.py): DeepSpeed drops an empty param group (LoRA's
            # no-decay one), FSDP2 keeps it. Every group shares the one base LR the schedule scales.
            scheduler.base_lrs = [scheduler.base_lrs[0]] * len(groups)
            set_last_lr(scheduler, [last_lr(scheduler)[0]] * len(groups))
        if not fresh or len(fresh) != len(groups) or not hasattr(scheduler, "lr_lambdas"):
            return
        for group, new in zip(groups, fresh):
            group.update({k: v for k, v in new.items() if k not in ("lr", "initial_lr")})
            group["initial_lr"] = new["lr"]
        scheduler.base_lrs = [new["lr"] for new in fresh]
        step = scheduler.last_epoch  # the scheduler's position: the checkpoint's step
        set_last_lr(scheduler, [base * f(step) for base, f in zip(scheduler.base_lrs, scheduler.lr_lambdas)])
        for group, lr in zip(groups, last_lr(scheduler)):
            group["lr"] = lr

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        """Each stage's own peak LR, warmup and decay, as one LambdaLR over the optimizer's base LR."""
        import torch

        if self.lr_scheduler is None:
            # The Trainer's own call does its bookkeeping (it then owns, saves and restores the scheduler); its
            # scheduler is replaced before any step. LambdaLR keeps the optimizer's `initial_lr`, so the base LR
            # below is the optimizer's, whatever the first one did to the current LR.
            super().create_scheduler(num_training_steps, optimizer)
            optimizer = optimizer or self.optimizer
            base = self.args.learning_rate
            self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
                optimizer, lambda step: self.schedule.lr_at(step) / base
            )
        return self.lr_scheduler

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        ds = getattr(self.args, "hf_deepspeed_config", None)
        if resume_from_checkpoint and ds is not None and ds.config.get("checkpoint", {}).get("load_universal"):
            self.add_callback(Zero3UniversalFix(resume_from_checkpoint))
        if resume_from_checkpoint:
            self.add_callback(_ThisRunsSettings(self))  # after the fix above, which restores the saved groups
        with waiting_for("the other ranks during training (a step's collectives, an evaluation or a checkpoint)",
                         start_up_phase=False):
            return super().train(resume_from_checkpoint, *args, **kwargs)

    def log(self, logs: dict, start_time=None) -> None:
        if "loss" in logs:
            logs["stage"] = self.schedule.stage_at(max(0, self.state.global_step - 1)).index
            logs.update(self.throughput.metrics(self.state, self.args))
        for key in [k for k in logs if k.startswith("eval_") and k.endswith("_loss")]:
            logs[key[: -len("_loss")] + "_perplexity"] = math.exp(min(logs[key], 50.0))
        super().log(logs, start_time)


class _ThisRunsSettings(TrainerCallback):
    """On resume, once the checkpoint is loaded and before the first step: CurriculumTrainer's
    continue_with_this_runs_settings."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        self.trainer.continue_with_this_runs_settings()


def eval_rounds(log_history: list[dict]) -> dict[int, dict[str, float]]:
    """step -> {eval set: loss} for every evaluation; the Trainer logs each held-out set separately."""
    rounds: dict[int, dict[str, float]] = {}
    for h in log_history:
        for key, value in h.items():
            if key.startswith("eval_") and key.endswith("_loss") and key not in ("eval_loss", MEAN_LOSS):
                rounds.setdefault(h["step"], {})[key[len("eval_"):-len("_loss")]] = value
    return rounds


def eval_means(log_history: list[dict], names: list[str]) -> tuple[float | None, float | None]:
    """Mean held-out loss over all `names` before training (step 0) and at the last evaluation."""
    complete = {step: r for step, r in eval_rounds(log_history).items() if all(n in r for n in names)}
    if not names or not complete:
        return None, None

    def mean(r):
        return sum(r[n] for n in names) / len(names)

    last = max(complete)
    return (mean(complete[0]) if 0 in complete else None), (mean(complete[last]) if last > 0 else None)


def stage_table(schedule: CurriculumSchedule, log_history: list[dict]) -> list[dict]:
    """Per stage: steps, first and last training loss, its held-out loss before training, at the stage's end and
    at the end of training, and its throughput (mean tokens/s; on GPUs mean MFU and peak memory)."""
    rounds = eval_rounds(log_history)
    last = max(rounds) if rounds else None
    rows = []
    for span in schedule.spans:
        logs = [h for h in log_history if "loss" in h and span.start_step < h["step"] <= span.end_step]
        row = {
            "name": span.name,
            "steps": span.steps,
            "first_step": span.start_step + 1,
            "last_step": span.end_step,
            "first_loss": logs[0]["loss"] if logs else None,
            "last_loss": logs[-1]["loss"] if logs else None,
            "eval_loss_before": rounds.get(0, {}).get(span.name),
            "eval_loss": rounds.get(span.end_step, {}).get(span.name),
            "eval_loss_after": rounds.get(last, {}).get(span.name) if last else None,
        }
        for key, pick in (("tokens_per_second", "mean"), ("mfu", "mean"), ("peak_memory_bytes", "max")):
            values = [h[key] for h in logs if h.get(key) is not None]
            if values:
                row[key] = max(values) if pick == "max" else sum(values) / len(values)
        rows.append(row)
    return rows


def step_losses(log_history: list[dict]) -> list[float]:
    """The training loss of every logged step, in order (one per step with hf_zero's logging_steps=1)."""
    return [h["loss"] for h in log_history if "loss" in h and "step" in h]
