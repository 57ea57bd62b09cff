"""A stock VLM's recipe counted without its weights, for `hf-zero estimate`: the model on the meta device as
recipes/vlm.py adapts it (LoRA, the parts a stage trains without an adapter kept whole by peft's modules_to_save,
what trains per stage), the visual tokens of the largest image the processor lets through (`image_max_pixels`, else
the processor's own bound), and what the vision tower and projector keep for backward on such an image.

The vision tower's saved bytes are counted by autograd's saved-tensor hooks on a real forward on the CPU (a meta
forward cannot run it: Qwen2-VL's patch positions and Idefics3's image mask are computed from the input's values),
of the tower built at its real widths with 1 and then 2 layers (beside a 1-layer language model with a 64-row token
table, which is not run), on the real image's pixels: every layer of a tower is the same module, so the count for
all its layers is the first count plus (layers - 1) x the difference. Qwen3-VL's DeepStack mergers (one after each
layer its config lists) are counted apart, each the same module on the same shape: the 1- and 2-layer towers are
built without them, and each adds what one adds to the 1-layer tower. The towers get the run's LoRA adapters and
trainable parts (adapt_vlm with the recipe's plan): a frozen layer whose input needs no gradient saves nothing, so a
frozen tower before a trained projector saves only the projector's tensors. Counted on two images and halved (one
image alone can share a storage that a batch copies). Against a run's measured saved bytes: tests/vlm/
test_vlm_activations.py (each tiny family's vision term equals what its run saved, per image).
"""

from __future__ import annotations

import copy
import math
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from hf_zero.core.errors import UserError
from hf_zero.core.files import human_bytes
from hf_zero.data.chat_template import prepare_chat_template
from hf_zero.data.model_names import get_tokenizer, resolve_model_path, shape_folder
from hf_zero.data.tiny_vlm import qwen_tokenizer
from hf_zero.data.vlm import Family, VlmProcessing
from hf_zero.integrations.torch import saved_bytes
from hf_zero.integrations.transformers import model_mapping, without_zero3_init
from hf_zero.plan.parse import parse_recipe_args, recipe_fields
from hf_zero.plan.shipped import load_recipe, recipe_argument_types, recipe_script
from hf_zero.plan.vlm_args import VlmArguments
from hf_zero.train.parts import PartPlan
from hf_zero.train.vlm import adapt_vlm, llava_feature_kwargs, plan_vlm_parts
from hf_zero.train.vlm_check import vlm_on_meta

__all__ = ["VlmCount", "count_vlm", "largest_image_side", "vision_saved_bytes", "saved_at_layers"]

_LAYER_FIELDS = ("depth", "num_hidden_layers")  # Qwen2-VL's vision config; Idefics3's (SigLIP-shaped)


@dataclass(frozen=True)
class VlmCount:
    model: object  # on the meta device, LoRA and trainable parts as the run has them
    family: Family
    plan: PartPlan
    sizes: dict  # {part: parameters that can train}
    image_side: int  # pixels of the square image counted (the largest the processor lets through)
    image_tokens: int  # the language model's positions one such image takes
    image_bytes: int  # fp32 bytes the vision tower and projector save for backward on it, as the run trains them
    images_per_row: int = 1  # the recipe's items_per_row: images a row holds at most

    @property
    def label(self) -> str:  # what the estimate adds to the model's name: nothing (the model is the VLM)
        return ""

    def activation_bytes_per_row(self, precision: str = "fp32") -> int:
        """images_per_row images per row; 16-bit under mixed precision, as the vision tower's matmuls then run."""
        return int((1 if precision == "fp32" else 0.5) * self.images_per_row * self.image_bytes)

    def summary(self, precision: str, micro_batch: int) -> dict:
        """The VLM terms of `hf-zero estimate` (its --json `multimodal`)."""
        return {"family": self.family.name, "image_side": self.image_side, "images_per_row": self.images_per_row,
                "image_tokens_per_image": self.image_tokens,
                "activation_bytes_per_row": self.activation_bytes_per_row(precision),
                "activation_bytes": micro_batch * self.activation_bytes_per_row(precision),
                "trainable_params": sum(self.sizes.get(p, 0) for p in self.plan.ever_trained),
                "parts": dict(self.sizes),
                "stages": [{"stage": name, "trains": [p for p, f in factors.items() if f > 0],
                            "frozen": [p for p, f in factors.items() if f == 0]}
                           for name, factors in zip(self.plan.names, self.plan.factors)]}

    def lines(self, precision: str, micro_batch: int) -> list[str]:
        s = self.summary(precision, micro_batch)
        ever = s["trainable_params"]
        stages = "; ".join(f"stage {st['stage']} trains {', '.join(st['trains'])}" for st in s["stages"])
        return [f"vlm ({self.family.name}): an image of {self.image_side}x{self.image_side} pixels (the largest the "
                f"processor lets through) is {self.image_tokens} tokens of the language model's (inside "
                f"max_seq_length); the vision tower and projector keep "
                f"{human_bytes(s['activation_bytes_per_row'] // self.images_per_row, digits=2)} for backward on it, "
                f"{self.images_per_row} image{'s' if self.images_per_row > 1 else ''} per row (items_per_row) "
                f"({human_bytes(s['activation_bytes'], digits=2)} per micro-batch, in the activations below)",
                f"  {stages}; gradients and optimizer state for {', '.join(self.plan.ever_trained)} ({ever:,} "
                "parameters, every part that trains in some stage, kept in every stage)"]


def largest_image_side(processing: VlmProcessing) -> int:
    """The side of the largest square image the processor passes unshrunk: Qwen2-VL's bound is an area in pixels,
    Idefics3's a longest edge."""
    if processing.family.name == "llava":  # every image resized and cropped to one size
        return int(processing.images.crop_size["height"])
    size = processing.kwargs.get("size") or processing.images.size
    edge = int(size["longest_edge"])
    return edge if processing.family.name == "idefics3" else math.isqrt(edge)


def _with_vision_layers(config, layers: int, deepstack: tuple | None = None):
    config = copy.deepcopy(config)
    vision = config.vision_config
    field = next(f for f in _LAYER_FIELDS if hasattr(vision, f))
    setattr(vision, field, layers)
    if deepstack is not None:
        vision.deepstack_visual_indexes = list(deepstack)
    return config


def _deepstack_layers(config) -> int:
    """How many vision layers feed a DeepStack merger (Qwen3-VL's `deepstack_visual_indexes`; none elsewhere)."""
    return len(getattr(config.vision_config, "deepstack_visual_indexes", None) or ())


def _vision_layers(config) -> int:
    return next(int(getattr(config.vision_config, f)) for f in _LAYER_FIELDS if hasattr(config.vision_config, f))


def vision_saved_bytes(config, family: Family, pixels: dict, layers: int | None = None, adapt=None) -> int:
    """fp32 bytes the vision tower and projector save for backward on `pixels` (the image processor's output for
    the batch) with `layers` vision layers (default: the config's): counted at 1 and 2 layers and extended layer by
    layer, then each DeepStack merger added. `adapt` (model -> model): the run's LoRA and trainable parts put on the
    model built (count_vlm's); None: every vision tower and projector weight trains, the most they can save."""
    deepstack = _deepstack_layers(config)
    plain = () if deepstack else None
    one, two = (saved_at_layers(config, family, pixels, n, plain, adapt) for n in (1, 2))
    total = one + ((layers or _vision_layers(config)) - 1) * (two - one)
    if deepstack:
        total += deepstack * (saved_at_layers(config, family, pixels, 1, (0,), adapt) - one)
    return total


def saved_at_layers(config, family: Family, pixels: dict, layers: int, deepstack: tuple | None = None,
                    adapt=None) -> int:
    """vision_saved_bytes counted directly, the vision tower built with `layers` layers (and DeepStack mergers after
    the layers `deepstack` lists; None: the config's), adapted by `adapt` (vision_saved_bytes)."""
    import torch
    from transformers import AutoModelForImageTextToText

    cfg = _with_vision_layers(config, layers, deepstack)
    text = cfg.get_text_config()  # the language model is not run: one layer and a token table of 64 rows
    text.num_hidden_layers, text.vocab_size, text.pad_token_id = 1, 64, None
    with torch.device("cpu"), without_zero3_init():
        model = model_mapping(AutoModelForImageTextToText)[type(cfg)](cfg)
    names = {"idefics3": ("vision_model", "connector"), "llava": ("vision_tower", "multi_modal_projector")}
    parts = [getattr(model.model, n) for n in names.get(family.name, ("visual",))]
    for part in parts:
        part.float().requires_grad_(adapt is None)
    if adapt is not None:  # LoRA's adapters and modules_to_save copies go into the modules in place
        adapt(model)
    weights = list(model.parameters())  # frozen ones too: a frozen linear saves its weight, a model state
    if family.name == "idefics3":
        return saved_bytes(lambda: model.model.get_image_features(pixels["pixel_values"],
                                                                  pixels["pixel_attention_mask"]), weights)
    if family.name == "llava":
        return saved_bytes(lambda: model.model.get_image_features(pixels["pixel_values"],
                                                                  **llava_feature_kwargs(cfg)), weights)
    return saved_bytes(lambda: model.model.get_image_features(pixels["pixel_values"], pixels["image_grid_thw"]),
                       weights)


def _tokenizer(model_args, family: Family, shape):
    """The model's tokenizer; for a model hf_zero ships only the shape of (no tokenizer offline), the tiny Qwen VLMs'
    with Qwen's image tokens, which changes no number: the count only finds the image token's id in it, and counts
    that id in the run the image processor's arithmetic sizes (the vision start and end ids are the config's), and
    the model is counted from its config, its token table at the config's vocab_size, as the run keeps it (a tokenizer
    no longer than that table grows nothing; Qwen2.5-VL's, 151,665 tokens, is shorter than its 151,936 rows)."""
    if shape is None or model_args.tokenizer_name_or_path:
        return get_tokenizer(model_args.model_name_or_path, model_args.tokenizer_name_or_path)
    if family.image_token != "<|image_pad|>":
        raise UserError("tokenizer_name_or_path", f"hf_zero ships the shape of {model_args.model_name_or_path} but "
                        "no tokenizer stands in for a " + family.name + " model's", "point tokenizer_name_or_path at "
                        "its tokenizer files, or use a machine that reaches the hub")
    return qwen_tokenizer()


def count_vlm(path: str, overrides=(), activations: bool = True) -> VlmCount | None:
    """A recipe YAML's VLM, counted; None when its recipe is not recipes/vlm.py's. `activations=False`: the
    parameters alone (no image sized, no vision tower run on the CPU: what the ranks' start-up room check needs)."""
    import torch
    from PIL import Image

    types = recipe_argument_types(load_recipe(str(recipe_script(None, path))))
    if not any("image_max_pixels" in getattr(t, "__dataclass_fields__", {}) for t in types):
        return None
    model_args, *_, stages, training, _ = parse_recipe_args(types, ["--config", path, *overrides])
    args = recipe_fields(VlmArguments, training)
    model, family = vlm_on_meta(model_args)
    shape = shape_folder(model_args.model_name_or_path)  # a hub id the hub cannot give, whose shape hf_zero ships
    tokenizer = _tokenizer(model_args, family, shape)
    prepare_chat_template(tokenizer, getattr(args, "chat_template", None))
    folder = str(shape) if shape else resolve_model_path(model_args.model_name_or_path)
    processing = VlmProcessing(folder, tokenizer, args.image_max_pixels)
    plan = plan_vlm_parts(stages, family, model_args.use_peft, training.get("learning_rate", 5e-5))
    model, _ = adapt_vlm(model, replace(model_args), family, plan, announce=False)
    sizes = {p: sum(t.numel() for _, t in ps) for p, ps in plan.parts_of(model).items()}
    if not activations:
        return VlmCount(model, family, plan, sizes, 0, 0, 0)
    side = largest_image_side(processing)
    with tempfile.TemporaryDirectory() as tmp:
        image = Path(tmp) / "largest.png"
        Image.new("RGB", (side, side), (127, 127, 127)).save(image)
        ids = processing.expand(image)
        # two rows of one image each, halved: one image alone can save less per image than a batch (the tiny
        # LLaVA's projector reads a view of the tower's output at one image, a copy at two or more: 8,472 bytes alone,
        # 8,984 per image at 2, 3 and 4, as its runs save)
        pixels = processing.pixels([[image], [image]], torch.tensor([ids, ids]))
    # what the run's vision tower and projector save: its LoRA adapters and the parts some stage trains trainable, the
    # rest frozen (a frozen tower before a trained projector saves nothing)
    saved = vision_saved_bytes(processing.config, family, pixels,
                               adapt=lambda m: adapt_vlm(m, replace(model_args), family, plan, announce=False)[0]) // 2
    return VlmCount(model, family, plan, sizes, side, ids.count(processing.image_token_id), saved, args.items_per_row)
