"""A `dpo` stage in the curriculum's one Trainer: the reference log-probabilities once, on disk, and TRL's losses.

At the stage's start the model as it stands then (the SFT stages' result; for LoRA the adapter as it is) is the
reference: the log-probabilities of every row's chosen and rejected answer (summed over the answer's tokens) are
computed once, without gradients, between two steps, and cached on disk with fingerprints of the rows and of the
weights (train/reference_cache.py). The stage then needs no second model. A run that finds the cache reuses it: at
the stage's start only when the weights are the ones it was made from, mid-stage (a resume: the weights have moved
on since) when its rows are this stage's; a cache from other rows or another model is refused in one line.

The loss is TRL's own (pinned trl==1.16.0): in 1.16 the DPO losses (sigmoid, ipo) are written inside
`DPOTrainer._compute_loss`, and SimPO inside `CPOTrainer.cpo_loss`, methods with no free-standing function to call.
They are called unbound on a small view holding the attributes they read (`_DPOView`, `_CPOView`), and the
"model" DPOTrainer's method calls is `_TRLModel`: our model (wrapped by the engine) whose per-token log-probabilities
are returned in TRL's `FusedCausalLMOutput`. Copying the losses instead would let them drift from TRL's silently;
tests/train/test_preference.py runs TRL's DPOTrainer itself on the same rows and compares.

Tested on one process (and by hand on 2 DDP ranks): every rank computes the reference of every row (no split and
gather yet). docs/preference.md lists what is built.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass

import torch
from transformers import TrainerCallback

from hf_zero.core.config import Stage
from hf_zero.core.console import say
from hf_zero.core.errors import UserError
from hf_zero.data.packing import IGNORE
from hf_zero.data.preference import PREFERENCE_KEYS
from hf_zero.integrations.trl import dpo_loss
from hf_zero.train.reference_cache import ReferenceCache

__all__ = ["PreferenceStage", "preference_stages", "sequence_outputs", "reference_logps", "PreferenceMixin",
           "preference_summary", "METRICS"]

# What a preference step logs, TRL's names: TensorBoard's train/rewards/accuracies, ..., the console's step line.
METRICS = ("rewards/accuracies", "rewards/margins", "rewards/chosen", "rewards/rejected", "logps/chosen",
           "logps/rejected")


@dataclass
class PreferenceStage:
    index: int  # in the curriculum
    stage: Stage
    samples: list[dict]  # every row of the stage, by `row`

    @property
    def reference_free(self) -> bool:
        return self.stage.loss_type == "simpo"


def preference_stages(stages: list[Stage], stage_data: list) -> dict[int, PreferenceStage]:
    """The curriculum's dpo stages by index, each with its rows in `row` order."""
    out = {}
    for i, (stage, data) in enumerate(zip(stages, stage_data)):
        if stage.objective == "dpo":
            rows = sorted((s for src in data.sources for s in src), key=lambda s: s["row"])
            out[i] = PreferenceStage(i, stage, rows)
    return out


def sequence_outputs(model, input_ids, attention_mask, labels):
    """Per-token log-probabilities of `labels` (shifted; 0 where -100) and what DPOTrainer logs beside them, in TRL's
    `FusedCausalLMOutput` (what `add_fused_lm_head` gives it). Full logits: a preference batch is not fused yet."""
    from trl.trainer.utils import FusedCausalLMOutput

    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits[:, :-1].float()
    targets = labels[:, 1:].to(logits.device)
    mask = targets != IGNORE
    logsm = logits.log_softmax(-1)
    log_probs = logsm.gather(-1, targets.masked_fill(~mask, 0)[..., None])[..., 0].masked_fill(~mask, 0.0)
    with torch.no_grad():
        entropy = -(logsm.exp() * logsm).sum(-1).masked_fill(~mask, 0.0)
        mean_logits = logits.mean(-1).masked_fill(~mask, 0.0)
        is_top1 = (logits.argmax(-1) == targets) & mask
    return FusedCausalLMOutput(log_probs=log_probs, entropy=entropy, mean_logits=mean_logits, is_top1=is_top1,
                               label_mask=mask)


def _answer_labels(batch: dict) -> torch.Tensor:
    return batch["input_ids"].masked_fill(batch["completion_mask"] == 0, IGNORE)


def reference_logps(model, samples: list[dict], batch_size: int, device, pad_token_id: int) -> torch.Tensor:
    """(rows, 2): each row's chosen and rejected log-probability (summed over the answer), in eval mode, no grad."""
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    collate = DataCollatorForPreference(pad_token_id=pad_token_id)
    out = torch.empty(len(samples), 2, dtype=torch.float32)
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for start in range(0, len(samples), batch_size):
                chunk = samples[start:start + batch_size]
                batch = {k: v.to(device) for k, v in collate([{k: s[k] for k in PREFERENCE_KEYS}
                                                              for s in chunk]).items()}
                logps = sequence_outputs(model, batch["input_ids"], batch["attention_mask"],
                                         _answer_labels(batch)).log_probs.sum(1)
                out[[s["row"] for s in chunk]] = torch.stack(logps.float().cpu().chunk(2), dim=1)
    finally:
        model.train(training)
    return out


class _TRLModel:
    """What DPOTrainer._compute_loss calls as its model: `model(**kw, labels=..., fused_lm_head=True)`."""

    def __init__(self, model):
        self.model = model

    def __call__(self, input_ids, attention_mask, labels, fused_lm_head=True, **_):
        return sequence_outputs(self.model, input_ids, attention_mask, labels)


class _DPOView:
    """The attributes DPOTrainer._compute_loss (trl 1.16) reads, for one stage's settings."""

    def __init__(self, trainer, stage: Stage, model):
        self.model, self.accelerator, self.args = model, trainer.accelerator, trainer.args  # model.training: mode
        self.beta, self.loss_types, self.loss_weights = stage.beta, [stage.loss_type], [1.0]
        self.precompute_ref_logps, self.ref_model, self.ld_alpha = True, None, None
        self.f_divergence_type, self.f_alpha_divergence_coef = "reverse_kl", 1.0
        self.label_smoothing, self.use_weighting = 0.0, False
        self.aux_loss_enabled, self.router_aux_loss_coef = False, 0.0
        self._metrics = defaultdict(lambda: defaultdict(list))
        self._total_train_tokens, self._tp_size = 0, 1


class _CPOView:
    """The attributes CPOTrainer.cpo_loss (trl 1.16) reads: SimPO is CPO's loss_type simpo with alpha 0."""

    def __init__(self, trainer, stage: Stage):
        self.accelerator, self.beta, self.loss_type = trainer.accelerator, stage.beta, "simpo"
        self.simpo_gamma, self.alpha, self.label_smoothing = stage.simpo_gamma, 0.0, 0.0


class _ReferenceAtStart(TrainerCallback):
    """A dpo stage's reference computed (or its cache checked against the weights) between steps, before the
    stage's first batch: there every engine's parameters are at rest (inside a step, ZeRO-3's gather of a parameter
    meets the engine's prefetched ones). A resume past the start loads the cache at its first batch instead."""

    def __init__(self, trainer):
        self.trainer = trainer

    def _at(self, step: int) -> None:
        t = self.trainer
        for pstage in t.preference.values():
            if not pstage.reference_free and t.schedule.spans[pstage.index].start_step == step:
                t._stage_reference(pstage, t.model_wrapped)

    def on_train_begin(self, args, state, control, **kwargs):
        self._at(state.global_step)

    def on_step_end(self, args, state, control, **kwargs):
        self._at(state.global_step)  # the step just done: global_step is the next step's index


class PreferenceMixin:
    """compute_loss for the batches of dpo stages (they carry `pref_row`); every other batch goes on down the MRO.
    Each logging step adds the preference metrics of its batches (METRICS, TRL's names)."""

    def __init__(self, *args, preference: dict | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.preference = preference or {}
        self._reference: dict[int, torch.Tensor] = {}
        self.reference_status: dict[str, str] = {}  # stage name -> computed / reused
        self._pref_metrics: dict[str, list] = defaultdict(list)
        for pstage in self.preference.values():  # a cache of other rows stops the run before its first step
            ReferenceCache(self.args.output_dir, pstage).check_rows()
        if any(not p.reference_free for p in self.preference.values()):
            self.add_callback(_ReferenceAtStart(self))

    def _stage_reference(self, pstage: PreferenceStage, model) -> torch.Tensor:
        if pstage.index not in self._reference:
            span = self.schedule.spans[pstage.index]
            start = time.perf_counter()
            cache = ReferenceCache(self.args.output_dir, pstage)
            pad, batch, device = (self.processing_class.pad_token_id, self.args.per_device_eval_batch_size,
                                  self.args.device)
            logps, how = cache.get(model, self.accelerator.unwrap_model(model),
                                   at_start=self.state.global_step == span.start_step,
                                   compute=lambda: reference_logps(model, pstage.samples, batch, device, pad))
            self._reference[pstage.index] = logps
            self.reference_status[pstage.stage.name] = how
            say(f"[hf_zero] stage {pstage.stage.name}: reference log-probs of {len(pstage.samples)} rows {how} "
                f"({time.perf_counter() - start:.1f}s), {cache.tensors}")
        return self._reference[pstage.index]

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if "pref_row" not in inputs:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if not model.training or return_outputs:
            raise UserError("eval", "a dpo stage's batches are not evaluated yet", "docs/preference.md")
        pstage = self.preference[self.schedule.stage_at(self.state.global_step).index]
        rows = inputs["pref_row"].cpu()
        batch = {k: v for k, v in inputs.items() if k != "pref_row"}
        if pstage.reference_free:
            return self._simpo_loss(model, batch, pstage)
        ref = self._stage_reference(pstage, model)[rows].to(inputs["input_ids"].device)
        batch["ref_chosen_logps"], batch["ref_rejected_logps"] = ref[:, 0], ref[:, 1]
        view = _DPOView(self, pstage.stage, model)
        loss = dpo_loss(view, _TRLModel(model), batch)  # hf_zero/integrations/trl.py
        for key in METRICS:
            self._pref_metrics[key] += view._metrics["train"][key]
        return loss

    def _simpo_loss(self, model, batch, pstage: PreferenceStage):
        from trl.experimental.cpo import CPOTrainer

        out = sequence_outputs(model, batch["input_ids"], batch["attention_mask"], _answer_labels(batch))
        mask = out.label_mask
        # CPOTrainer's SimPO uses the answer's mean log-probability (its get_batch_logps, average_log_prob=True)
        avg = (out.log_probs.sum(1) / mask.sum(1).clamp(min=1)).chunk(2)
        losses, chosen, rejected = CPOTrainer.cpo_loss(_CPOView(self, pstage.stage), *avg)
        gather = self.accelerator.gather_for_metrics
        for key, value in (("rewards/accuracies", (chosen > rejected).float()), ("rewards/margins", chosen - rejected),
                           ("rewards/chosen", chosen), ("rewards/rejected", rejected),
                           ("logps/chosen", avg[0].detach()), ("logps/rejected", avg[1].detach())):
            self._pref_metrics[key].append(gather(value).mean().item())
        return losses.mean()

    def log(self, logs: dict, start_time=None) -> None:
        if "loss" in logs and self._pref_metrics:
            logs.update({k: sum(v) / len(v) for k, v in self._pref_metrics.items() if v})
            self._pref_metrics.clear()
        super().log(logs, start_time)


def preference_summary(log_history: list[dict], schedule, preference: dict, status: dict) -> dict:
    """summary.json's `preference`: per dpo stage, its settings, the reference's fate and the reward accuracy and
    margin at its first and last logging step."""
    if not preference:
        return {}
    rows = []
    for index, pstage in preference.items():
        span = schedule.spans[index]
        logs = [h for h in log_history if "rewards/accuracies" in h and span.start_step < h["step"] <= span.end_step]
        rows.append({
            "stage": pstage.stage.name, "loss_type": pstage.stage.loss_type, "beta": pstage.stage.beta,
            "rows": len(pstage.samples), "reference": status.get(pstage.stage.name, "none (reference-free)"),
            **{f"{name}_{at}": (logs[i][key] if logs else None) for name, key in
               (("reward_accuracy", "rewards/accuracies"), ("reward_margin", "rewards/margins"))
               for at, i in (("first", 0), ("last", -1))},
        })
    return {"preference": rows}
