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

Each rank computes the reference of its own contiguous share of the rows (every rank the same number of batches:
under ZeRO-3 and FSDP2 a forward is a collective), and the shares are gathered, so every rank holds the whole table
and the cache is indexed by row, not by rank: a resume on another rank count reads it as it is. The held-out pairs
(`eval_samples` of the stage, or its `eval_data`) are rows too, numbered after the training rows: their reference is
in the same cache, and their reward accuracy is measured at the stage's start and end the same way (one share per
rank, gathered), so it is over the whole held-out set whatever the rank count. docs/preference.md lists what is built.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from transformers import TrainerCallback

from hf_zero.core.config import Stage
from hf_zero.core.console import say
from hf_zero.core.errors import UserError
from hf_zero.integrations.trl import dpo_loss
from hf_zero.train.preference_logps import answer_labels, answer_logps, reference_logps, sequence_outputs, share
from hf_zero.train.preference_report import HELD_OUT, pair_rewards
from hf_zero.train.reference_cache import ReferenceCache

__all__ = ["PreferenceStage", "preference_stages", "PreferenceMixin", "METRICS"]

# What a preference step logs, TRL's names: TensorBoard's train/rewards/accuracies, ..., the console's step line.
METRICS = ("rewards/accuracies", "rewards/margins", "rewards/chosen", "rewards/rejected", "logps/chosen",
           "logps/rejected")


@dataclass
class PreferenceStage:
    index: int  # in the curriculum
    stage: Stage
    samples: list[dict]  # every training row of the stage, by `row` (0 .. n-1)
    held_out: list[dict] = field(default_factory=list)  # the held-out pairs, by `row` (n .. n+m-1)

    @property
    def reference_free(self) -> bool:
        return self.stage.loss_type == "simpo"

    @property
    def rows(self) -> list[dict]:
        """Every row with a reference: the training rows, then the held-out pairs (position == `row`)."""
        return self.samples + self.held_out


def preference_stages(stages: list[Stage], stage_data: list) -> dict[int, PreferenceStage]:
    """The curriculum's dpo stages by index, each with its rows and held-out pairs in `row` order."""
    out = {}
    for i, (stage, data) in enumerate(zip(stages, stage_data)):
        if stage.objective == "dpo":
            rows = sorted((s for src in data.sources for s in src), key=lambda s: s["row"])
            out[i] = PreferenceStage(i, stage, rows, sorted(data.eval_samples, key=lambda s: s["row"]))
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
        if stage.sft_weight:  # TRL's multi-loss form: the preference loss plus its sft term, weighted
            self.loss_types, self.loss_weights = [stage.loss_type, "sft"], [1.0, float(stage.sft_weight)]
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


class _StageEdges(TrainerCallback):
    """At a dpo stage's start, its reference computed (or its cache checked against the weights) and its held-out
    pairs' reward accuracy measured; at its end, that accuracy again. Between steps: there every engine's
    parameters are at rest (inside a step, ZeRO-3's gather of a parameter meets the engine's prefetched ones). A
    resume past the start loads the cache at its first batch instead."""

    def __init__(self, trainer):
        self.trainer = trainer

    def _at(self, step: int) -> None:
        t = self.trainer
        for pstage in t.preference.values():
            span = t.schedule.spans[pstage.index]
            if span.start_step == step:
                if not pstage.reference_free:
                    t._stage_reference(pstage, t.model_wrapped)
                t._held_out_rewards(pstage, t.model_wrapped, "before")
            elif span.end_step == step:
                t._held_out_rewards(pstage, t.model_wrapped, "after")

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
        if any(not p.reference_free or p.held_out for p in self.preference.values()):
            self.add_callback(_StageEdges(self))

    def _logps(self, model, samples: list[dict], reference: bool = False) -> torch.Tensor:
        compute = reference_logps if reference else answer_logps
        return compute(model, samples, self.args.per_device_eval_batch_size, self.args.device,
                       self.processing_class.pad_token_id, self.accelerator)

    def _stage_reference(self, pstage: PreferenceStage, model) -> torch.Tensor:
        """(training rows + held-out pairs, 2): the stage's reference; the held-out pairs in batches of their
        own, as their rewards are measured."""
        if pstage.index not in self._reference:
            span = self.schedule.spans[pstage.index]
            start = time.perf_counter()
            cache = ReferenceCache(self.args.output_dir, pstage)
            logps, how = cache.get(model, self.accelerator.unwrap_model(model),
                                   at_start=self.state.global_step == span.start_step,
                                   compute=lambda: torch.cat([self._logps(model, pstage.samples, True),
                                                              self._logps(model, pstage.held_out, True)]))
            self._reference[pstage.index] = logps
            self.reference_status[pstage.stage.name] = how
            world = self.accelerator.num_processes
            held = f" ({len(pstage.held_out)} of them held out)" if pstage.held_out else ""
            most = sum(share(len(rows), 0, world)[2] for rows in (pstage.samples, pstage.held_out))
            split = f" on {world} ranks, at most {most} rows each" if how == "computed" and world > 1 else ""
            say(f"[hf_zero] stage {pstage.stage.name}: reference log-probs of {len(pstage.rows)} rows{held} {how}"
                f"{split} ({time.perf_counter() - start:.1f}s), {cache.tensors}")
        return self._reference[pstage.index]

    def _held_out_rewards(self, pstage: PreferenceStage, model, when: str) -> None:
        """The held-out pairs' reward accuracy and mean margin (pair_rewards) over the whole held-out set, logged
        (HELD_OUT keys, at the stage's first and last step) and said; once per step, also on resume."""
        name = pstage.stage.name
        keys = tuple(f"{k}/{name}" for k in HELD_OUT)
        if not pstage.held_out or any(h.get("step") == self.state.global_step and keys[0] in h
                                      for h in self.state.log_history):
            return
        reference = None if pstage.reference_free else self._stage_reference(pstage, model)[len(pstage.samples):]
        if when == "before" and reference is not None:
            logps = reference  # the policy is the reference: every reward is 0, no pair is won yet
        else:
            logps = self._logps(model, pstage.held_out)
        accuracy, margin = pair_rewards(pstage.stage, logps, reference)
        keep = self.control.should_log  # Trainer.log clears it: this step's own loss log would be dropped
        self.log(dict(zip(keys, (accuracy, margin))))
        self.control.should_log = keep
        say(f"[hf_zero] stage {name}: held-out reward accuracy {accuracy:.2f}, margin {margin:.3f} over "
            f"{len(pstage.held_out)} pairs ({when} the stage)")

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

        out = sequence_outputs(model, batch["input_ids"], batch["attention_mask"], answer_labels(batch))
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
