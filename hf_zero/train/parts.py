"""What trains, stage by stage, in a composed model: parts, their parameter groups, and the per-part LR schedule.

Parts: `encoder.<modality>`, `projector.<modality>`, and the LLM's trainable weights: `lora` (adapters, and the
embedding rows grown for added tokens) under LoRA, else `llm` (all of it). A stage's `train:` lists parts, or
`encoder` / `projector` for all of them; without `train:` every part trains. `learning_rates:` keys the same way
(an exact part wins over its kind); a part without one takes the stage's learning rate.

How a change of trainable set is handled inside one `trainer.train()` (docs/architecture.md says why): every part
that trains in any stage is in the optimizer from the start, one parameter group per part (and decay / no-decay),
and the scheduler gives each group its own factor per step: the stage's LR shape x (part LR / stage LR), or 0 while
the part is frozen. AdamW at LR 0 changes no bit of a parameter (its decay is lr x weight_decay = 0 and its step is
0 x m / (sqrt(v) + eps) = 0). A part that trains in no stage is frozen outright (requires_grad False): no gradient,
no optimizer state.
"""

from __future__ import annotations

from hf_zero.core.errors import UserError
from hf_zero.train.trainer import CurriculumTrainer

__all__ = ["model_parts", "part_sizes", "PartPlan", "plan_parts", "PartsTrainer", "param_groups",
           "group_sizes"]

KINDS = ("encoder", "projector")


def model_parts(model) -> dict[str, list[tuple[str, object]]]:
    """{part: [(name, parameter), ...]} of a ComposedModel, for the parameters that can train at all."""
    llm_part = "lora" if model.uses_lora else "llm"
    parts: dict = {}
    for name, param in model.named_parameters():
        head, _, rest = name.partition(".")
        if head in ("encoders", "projectors"):
            part = f"{head[:-1]}.{rest.split('.')[0]}"
        elif param.requires_grad:  # under LoRA the base LLM's weights never train: in no part
            part = llm_part
        else:
            continue
        parts.setdefault(part, []).append((name, param))
    return parts


def part_sizes(model) -> dict[str, int]:
    """Parameters per part; under ZeRO-3 the full count (`ds_numel`), not this rank's shard."""
    return {part: sum(getattr(p, "ds_numel", p.numel()) for _, p in params)
            for part, params in model_parts(model).items()}


def param_groups(model, plan: PartPlan, decayed) -> list[tuple[str, bool, list]]:
    """The optimizer's parameter groups: (part, weight decay or not, its parameters that train) for every part that
    trains in some stage, the empty groups left out. `decayed(name, parameter)`: whether the weight decays."""
    groups = []
    for part, params in plan.parts_of(model).items():
        if part in plan.ever_trained:
            for wd in (True, False):
                chosen = [p for n, p in params if p.requires_grad and decayed(n, p) == wd]
                if chosen:
                    groups.append((part, wd, chosen))
    return groups


def group_sizes(model, plan: PartPlan) -> tuple[tuple[int, ...], ...]:
    """Each parameter group's trainable sizes as the run's optimizer will hold them (param_groups), in order, for the
    estimate (hf_zero.estimate.model_count.ModelCount.trainable_groups). The transformers' decay rule (no decay on
    biases and norms) is taken as no decay on 1-D weights, which is the same rule for the encoders, projectors and
    adapters hf_zero builds."""
    groups = param_groups(model, plan, lambda _, p: p.dim() >= 2)
    return tuple(tuple(p.numel() for p in params) for _, _, params in groups)


class PartPlan:
    """Per stage, the factor on the stage's LR that each part's parameter groups take (0: frozen)."""

    def __init__(self, stages, valid: list[str], base_lr: float, default: list[str] | None = None,
                 parts_of=None):
        """`default`: what a stage without `train:` trains (every part unless given); `parts_of`: the model's
        {part: [(name, parameter)]} (model_parts of a ComposedModel unless given: hf_zero.train.vlm's for a VLM)."""
        self.valid, self.names, self.base_lr = valid, [s.name for s in stages], base_lr
        self.default, self.parts_of = default or valid, parts_of or model_parts
        self.factors = [self._stage(s) for s in stages]  # [{part: factor}] per stage

    def _expand(self, key, where: str) -> list[str]:
        if key in self.valid:
            return [key]
        if key in KINDS and any(v.startswith(f"{key}.") for v in self.valid):
            return [v for v in self.valid if v.startswith(f"{key}.")]
        raise UserError(where, f"unknown part {key!r}", f"use one of {', '.join(self.valid)}, or "
                        f"{' / '.join(KINDS)} for all of a kind")

    def _stage(self, stage) -> dict:
        where = f"stages[{stage.name}]"
        train = stage.train if stage.train is not None else list(self.default)
        train = [train] if isinstance(train, str) else train
        if not isinstance(train, list) or not train:
            raise UserError(f"{where}.train", f"{train!r} is not a non-empty list of parts",
                            f"e.g. train: [{self.valid[-1]}]")
        trains = {p for key in train for p in self._expand(key, f"{where}.train")}
        rates = stage.learning_rates or {}
        if not isinstance(rates, dict):
            raise UserError(f"{where}.learning_rates", f"{rates!r} is not a mapping of part to LR",
                            "e.g. learning_rates: {projector: 1.0e-3}")
        per_part: dict = {}
        for key, lr in sorted(rates.items(), key=lambda kv: kv[0] in self.valid):  # kinds first, exact parts win
            if isinstance(lr, bool) or not isinstance(lr, (int, float)) or lr <= 0:
                raise UserError(f"{where}.learning_rates.{key}", f"{lr!r} is not a positive number",
                                "e.g. 1.0e-3")
            for part in self._expand(key, f"{where}.learning_rates"):
                per_part[part] = float(lr)
        peak = stage.learning_rate or self.base_lr  # the stage's LR shape peaks there (data/curriculum.py)
        return {p: per_part.get(p, peak) / peak if p in trains else 0.0 for p in self.valid}

    @property
    def ever_trained(self) -> list[str]:
        return [p for p in self.valid if any(f[p] > 0 for f in self.factors)]

    def describe(self, sizes: dict | None = None) -> list[str]:
        """A line per stage for the banner: what trains (with its parameter count, from `sizes`) and what not."""
        sizes = sizes or {}

        def named(parts):
            return ", ".join(f"{p} ({sizes[p]:,})" if p in sizes else p for p in parts)

        return [f"stage {name}: trains {named(p for p in self.valid if f[p] > 0)}"
                + (f"; frozen {named(frozen)}" if (frozen := [p for p in self.valid if f[p] == 0]) else "")
                for name, f in zip(self.names, self.factors)]


def plan_parts(model, stages, base_lr: float) -> PartPlan:
    """The stages' part plan for `model`; parts that train in no stage are frozen here (requires_grad False)."""
    parts = model_parts(model)
    plan = PartPlan(stages, list(parts), base_lr)
    for part in set(parts) - set(plan.ever_trained):
        for _, param in parts[part]:
            param.requires_grad_(False)
    return plan


class PartsTrainer(CurriculumTrainer):
    """The curriculum trainer with one parameter group per part and a per-part factor in the LR schedule."""

    def __init__(self, *args, parts: PartPlan, **kwargs):
        self.parts = parts
        super().__init__(*args, **kwargs)

    def create_optimizer(self, model=None):
        if self.optimizer is None:
            from transformers import Trainer

            decay = set(self.get_decay_parameter_names(self.model))
            groups = [{"params": params, "part": part, "weight_decay": self.args.weight_decay if wd else 0.0}
                      for part, wd, params in param_groups(self.model, self.parts, lambda name, _: name in decay)]
            cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(self.args, self.model)
            self.optimizer = cls(groups, **kwargs)
        self.fresh_groups = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        import torch

        if self.lr_scheduler is None:
            super().create_scheduler(num_training_steps, optimizer)  # the Trainer's bookkeeping; replaced below
            optimizer = optimizer or self.optimizer
            base, schedule, factors = self.args.learning_rate, self.schedule, self.parts.factors

            def factor(part):
                return lambda step: schedule.lr_at(step) / base * factors[schedule.stage_at(step).index][part]

            self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
                optimizer, [factor(g["part"]) for g in optimizer.param_groups])
        return self.lr_scheduler

    def _get_learning_rate(self) -> float:
        # The Trainer logs its first group's LR, here a part that may be frozen (0) in this stage: log the stage's
        # LR instead, of which every part's LR is a multiple (exactly what the curriculum recipe logs).
        scheduler = getattr(self.lr_scheduler, "scheduler", self.lr_scheduler)
        return self.schedule.lr_at(scheduler.last_epoch)
