"""The multimodal recipe's arguments (recipes/multimodal.py): the curriculum's, plus the encoders that feed the LLM.
Each stage may also say what trains in it (`train`, `learning_rates`: hf_zero.core.config.Stage)."""

from __future__ import annotations

from dataclasses import dataclass, field

from hf_zero.core.config import CurriculumArguments

__all__ = ["MultimodalArguments"]


@dataclass
class MultimodalArguments(CurriculumArguments):
    """The curriculum recipe's arguments and `encoders:`, one entry per modality (docs/multimodal.md)."""

    encoders: dict | None = field(
        default=None,
        metadata={"help": "One encoder per modality, keyed by the item type the rows use (image, points, ...): "
                          "{class: package.module:Class, kwargs: {...}, input_shape: [...]} or {hf_config: "
                          "{model_type: vit, ...}}, each with an optional projector: {type: mlp|linear, hidden: N}."},
    )
