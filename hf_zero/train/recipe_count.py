"""The model a recipe trains, counted on the meta device for sizing: a multimodal recipe's composed model
(composed_count) or a stock VLM (vlm_count), with one optimizer group per part and what its encoders or vision tower
keep for backward per row. `hf-zero estimate`'s table and recommendation, `hf-zero train`'s automatic profile and
`hf-zero check`'s model line all size this one count; a text recipe has none (hf_zero.estimate counts its model from
its config alone).
"""

from __future__ import annotations

from dataclasses import replace

from hf_zero.estimate.recipe import CountedParts, RecipeMemory
from hf_zero.train.composed_count import count_composed, model_count_of
from hf_zero.train.vlm_count import count_vlm

__all__ = ["count_recipe_model", "count_parts", "with_parts"]


def count_recipe_model(path: str, overrides=(), activations: bool = True):
    """(the composed model's or VLM's count, with the summary and lines `hf-zero estimate` prints; its
    CountedParts), or None for a recipe without encoders or a vision tower. `overrides`: flags after the recipe;
    `activations=False`: a VLM's parameters alone, without the CPU forward of its vision tower that sizes an image's
    activations (the composed model's are counted on the meta device, at no cost)."""
    counted = count_composed(path, overrides) or count_vlm(path, overrides, activations)
    if counted is None:
        return None
    return counted, CountedParts(model_count_of(counted), counted.activation_bytes_per_row, counted.label,
                                 tuple(counted.plan.ever_trained), getattr(counted, "final_params", None))


def count_parts(path: str, overrides=(), activations: bool = True) -> CountedParts | None:
    """The recipe's model counted part by part (recipes/multimodal.py's and recipes/vlm.py's COUNT_PARTS, which
    `hf-zero check` and each rank's start-up room check read, the latter without activations); None for a text
    recipe."""
    found = count_recipe_model(path, overrides, activations)
    return found[1] if found else None


def with_parts(recipe: RecipeMemory | None, overrides=()) -> RecipeMemory | None:
    """The recipe with its model's parts counted (unchanged for a text recipe, or None)."""
    if recipe is None or not recipe.path:
        return recipe
    parts = count_parts(recipe.path, overrides)
    return replace(recipe, parts=parts) if parts else recipe
