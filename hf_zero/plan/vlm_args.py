"""The vision-language recipe's arguments (recipes/vlm.py): the curriculum's, plus the bound on image size. Each stage
may also say which parts train (`train: [projector, lora]`) and at what rate (`learning_rates:`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from hf_zero.core.errors import UserError
from hf_zero.plan.arguments import CurriculumArguments, check_items_per_row, items_per_row_field

__all__ = ["VlmArguments"]


@dataclass
class VlmArguments(CurriculumArguments):
    """The curriculum recipe's arguments and the image sizing of a stock vision-language model (docs/vlm.md)."""

    image_max_pixels: int | None = field(
        default=None,
        metadata={"help": "Largest image area, in pixels, the processor resizes an image to (Qwen2-VL's max_pixels; "
                          "Idefics3/SmolVLM: the longest edge, in whole tiles, whose square fits): fewer pixels, "
                          "fewer visual tokens per image and less memory. Default: the processor's own bound."},
    )

    items_per_row: int = items_per_row_field()

    @staticmethod
    def clean_values(values: dict) -> None:
        CurriculumArguments.clean_values(values)
        check_items_per_row(values)
        bound = values.get("image_max_pixels")
        if bound is not None and (isinstance(bound, bool) or not isinstance(bound, int) or bound <= 0):
            raise UserError("image_max_pixels", f"{bound!r} is not a positive number of pixels",
                            "e.g. image_max_pixels: 262144 (512 x 512)")
