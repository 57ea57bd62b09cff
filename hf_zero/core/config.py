"""The curriculum's stages: `Stage`, one entry of a recipe YAML's `stages:` list, documented field by field and read
by plan/parse.py with the same strictness as the top-level keys. The recipes' argument classes (TrainingArguments
subclasses, which load transformers) live above core, in hf_zero/plan/arguments.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hf_zero.core.errors import UserError
from hf_zero.core.validate import positive

__all__ = ["Stage"]


OBJECTIVES = ("sft", "dpo")
LOSS_TYPES = ("sigmoid", "ipo", "simpo")  # of TRL's: DPOTrainer's sigmoid and ipo, CPOTrainer's simpo
_DPO_DEFAULTS = {"beta": 0.1, "loss_type": "sigmoid", "simpo_gamma": 0.5}
_PREFERENCE_KEYS = (*_DPO_DEFAULTS, "sft_weight")  # sft_weight: unset is no SFT term


def check_objective_keys(stage: "Stage", where: str) -> None:
    """`objective` and the preference keys: refused on an sft stage (they would do nothing), defaulted on a dpo one."""
    if stage.objective not in (None, *OBJECTIVES):
        raise UserError(f"{where}.objective", f"unknown objective {stage.objective!r}", "use sft or dpo")
    if stage.objective != "dpo":
        for key in _PREFERENCE_KEYS:
            if getattr(stage, key) is not None:
                raise UserError(f"{where}.{key}", "is a preference key, and the stage's objective is "
                                f"{stage.objective or 'sft'}", "set `objective: dpo` on the stage, or remove the key")
        return
    for key in ("beta", "simpo_gamma", "sft_weight"):
        value = getattr(stage, key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise UserError(f"{where}.{key}", f"{value!r} is not a number",
                            f"e.g. {key}: {_DPO_DEFAULTS.get(key, 0.2)}")
    if stage.loss_type is not None and stage.loss_type not in LOSS_TYPES:
        raise UserError(f"{where}.loss_type", f"unknown loss type {stage.loss_type!r}", f"use one of "
                        f"{', '.join(LOSS_TYPES)}")
    if stage.simpo_gamma is not None and stage.loss_type != "simpo":
        raise UserError(f"{where}.simpo_gamma", "only applies with loss_type: simpo", "remove it, or loss_type: simpo")
    if stage.sft_weight is not None and (stage.loss_type == "simpo" or stage.sft_weight < 0):
        raise UserError(f"{where}.sft_weight", f"{stage.sft_weight!r}: a weight of 0 or more, with loss_type sigmoid "
                        "or ipo", "e.g. sft_weight: 0.2, or remove it")
    for key, value in _DPO_DEFAULTS.items():
        if getattr(stage, key) is None and (key != "simpo_gamma" or stage.loss_type == "simpo"):
            setattr(stage, key, value)
    if not positive(stage.beta):
        raise UserError(f"{where}.beta", f"must be a positive number, got {stage.beta!r}", "e.g. beta: 0.1")


@dataclass
class Stage:
    """One curriculum stage. Exactly one of `epochs` / `steps` sets its length."""

    name: str = field(metadata={"help": "Unique stage name; used in logs, TensorBoard tags and summary.json."})
    data: list[str] = field(
        metadata={"help": "One source or a list: local .jsonl/.json/.csv/.parquet/.txt (relative to the YAML's "
                          "folder), builtin:shakespeare/{lines,passages,sonnets,which_play,which_play_test}, "
                          "builtin:bbc/train, builtin:digits/train, or a hub dataset id (online)."}
    )
    weights: list[float] | None = field(
        default=None, metadata={"help": "Mixture weights, one per data source (normalised); default: equal."}
    )
    epochs: float | None = field(
        default=None, metadata={"help": "Passes over the stage's data, rounded up to whole steps (or give steps)."}
    )
    steps: int | None = field(default=None, metadata={"help": "Optimizer steps in this stage (or give epochs)."})
    learning_rate: float | None = field(default=None,
                                        metadata={"help": "Peak LR of the stage (default: --learning_rate)."})
    warmup_steps: int = field(
        default=0, metadata={"help": "Linear warmup at the start of the stage; shorter than the stage."}
    )
    lr_schedule: str = field(default="cosine",
                             metadata={"help": "Decay within the stage: cosine, linear or constant."})
    min_lr_ratio: float = field(default=0.1,
                                metadata={"help": "LR at the end of the stage, as a fraction of its peak."})
    max_seq_length: int | None = field(
        default=None, metadata={"help": "Tokens per sample in this stage (default: the recipe's max_seq_length)."}
    )
    eval_data: list[str] | None = field(
        default=None, metadata={"help": "Held-out data of the stage (its first eval_samples rows), e.g. a validation "
                                        "file, instead of a slice of `data`."}
    )
    objective: str | None = field(
        default=None,  # unset, not "sft": a checkpoint recorded before the key existed resumes (checkpoint/compare.py)
        metadata={"help": "sft (default): next-token loss on the stage's data; dpo: preference tuning on "
                          "prompt/chosen/rejected rows (TRL's preference formats) against the model as it stands at "
                          "the stage's start, its log-probabilities computed once and cached in "
                          "output_dir/reference_logps (docs/preference.md)."}
    )
    beta: float | None = field(
        default=None,
        metadata={"help": "dpo stages: how far the policy may move from the reference (TRL's beta; for ipo its tau, "
                          "for simpo the reward scale); default 0.1."}
    )
    loss_type: str | None = field(
        default=None,
        metadata={"help": "dpo stages: sigmoid (DPO), ipo, or simpo (reference-free, length-normalized), computed by "
                          "TRL's own implementation; default sigmoid."}
    )
    simpo_gamma: float | None = field(
        default=None, metadata={"help": "dpo stages with loss_type simpo: the target reward margin; default 0.5."}
    )
    sft_weight: float | None = field(
        default=None,
        metadata={"help": "dpo stages with loss_type sigmoid or ipo: the weight of TRL's sft loss (the chosen "
                          "answers' mean token NLL) added to the preference loss, as RPO does, so the chosen answers "
                          "keep their likelihood; unset: no such term."}
    )
    train: list[str] | None = field(
        default=None,
        metadata={"help": "Multimodal recipe: the parts that train in this stage (an encoder or projector per "
                          "modality, e.g. encoder.image, projector.points; `encoder` / `projector` for all of them; "
                          "lora, or llm without LoRA); default: every part. Frozen parts do not change by one bit "
                          "(docs/multimodal.md). The vlm recipe's parts: vision_tower, projector, lora (or "
                          "language_model); default: lora (docs/vlm.md)."}
    )
    learning_rates: dict | None = field(
        default=None,
        metadata={"help": "Multimodal recipe: peak learning rate per part in this stage, keyed as in `train` (e.g. "
                          "{projector: 1.0e-3, lora: 2.0e-4}); other parts take the stage's learning_rate."}
    )

    def __post_init__(self):
        if isinstance(self.data, str):
            self.data = [self.data]
        if isinstance(self.eval_data, str):
            self.eval_data = [self.eval_data]
        where = f"stages[{self.name}]"
        # Numbers first, each named: a word where a number belongs would otherwise fail a comparison below.
        for key, whole in (("steps", True), ("epochs", False), ("learning_rate", False), ("warmup_steps", True),
                           ("min_lr_ratio", False), ("max_seq_length", True)):
            value = getattr(self, key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or whole and not float(value).is_integer()):
                raise UserError(f"{where}.{key}", f"{value!r} is not {'a whole number' if whole else 'a number'}",
                                f"e.g. {key}: {1 if whole else 0.5}")
        for key in ("weights",):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, list)
                                      or any(isinstance(w, bool) or not isinstance(w, (int, float)) for w in value)):
                raise UserError(f"{where}.{key}", f"{value!r} is not a list of numbers", "e.g. weights: [3, 1]")
        check_objective_keys(self, where)
        if (self.epochs is None) == (self.steps is None):
            raise UserError(f"{where}.steps", "give exactly one of `steps` or `epochs`", "e.g. steps: 10")
        if self.steps is not None and self.steps <= 0 or self.epochs is not None and self.epochs <= 0:
            raise UserError(f"{where}.steps", "must be positive", "e.g. steps: 10 or epochs: 1")
        if self.weights is not None and len(self.weights) != len(self.data):
            raise UserError(f"{where}.weights", f"{len(self.weights)} weights for {len(self.data)} data sources",
                            "give one weight per entry of `data`")
        if self.lr_schedule not in ("cosine", "linear", "constant"):
            raise UserError(f"{where}.lr_schedule", f"unknown schedule {self.lr_schedule!r}",
                            "use cosine, linear or constant")
        rules = (("learning_rate", self.learning_rate is None or positive(self.learning_rate), "must be a positive "
                  "number", "e.g. learning_rate: 1.0e-4"),
                 ("warmup_steps", self.warmup_steps >= 0, "cannot be negative", "e.g. warmup_steps: 0"),
                 ("warmup_steps", self.steps is None or self.warmup_steps < self.steps, f"must be shorter than the "
                  f"stage's {self.steps} steps (its peak learning rate is reached after the warmup)",
                  f"e.g. warmup_steps: {(self.steps or 0) // 10}"),
                 ("min_lr_ratio", 0 <= self.min_lr_ratio <= 1, "must be between 0 and 1", "e.g. min_lr_ratio: 0.1"),
                 ("max_seq_length", self.max_seq_length is None or self.max_seq_length >= 2, "must be at least 2",
                  "e.g. max_seq_length: 128"),
                 ("weights", self.weights is None or (min(self.weights) >= 0 and sum(self.weights) > 0),
                  "must be non-negative with a positive sum", "e.g. weights: [1, 1]"))
        for key, ok, problem, fix in rules:
            if not ok:
                raise UserError(f"{where}.{key}", f"{problem}, got {getattr(self, key)!r}", fix)
