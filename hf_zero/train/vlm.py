"""A stock vision-language model (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Idefics3/SmolVLM, LLaVA) loaded by
`AutoModelForImageTextToText`, trained stage by stage in parts as the composed model is (hf_zero.train.parts):

- `vision_tower`: the vision encoder (Qwen2-VL's `visual` without its merger; Idefics3's `vision_model`);
- `projector`: what maps its output into the language model (Qwen2-VL's `merger`; Qwen3-VL's `merger` and its
  DeepStack mergers; Idefics3's `connector`);
- `language_model` (full fine-tune), or under LoRA `lora`: the adapters in the language model and the embedding rows
  grown for added tokens.

Under LoRA a part's trainable weights are the adapters inside it when `lora_target_modules` matched any of its
modules, else its full weights (kept by peft's `modules_to_save`, so they are saved with the adapter and merged by
`hf-zero export`). A stage without `train:` trains the language model's part alone (LLaMA-Factory's default too:
vision tower and projector frozen).

A batch without an image still runs the vision tower and projector on one blank image and adds 0 x their output to
the input embeddings, where an image batch scatters its image features: under ZeRO-3 and FSDP a rank that skipped
them while another ran them would wait forever in the parameter gathering, and a rank whose backward took another
path would reduce its gradients in another order. 0 x a finite value is 0: the loss is unchanged to the bit.
"""

from __future__ import annotations

import re

import torch

from hf_zero.core.console import say
from hf_zero.core.distributed import waiting_for
from hf_zero.data.chat_template import grow_embeddings, train_embeddings
from hf_zero.data.model_names import resolve_model_path
from hf_zero.data.vlm import Family, default_targets
from hf_zero.integrations.transformers import add_to_embeddings_without_images
from hf_zero.train.model import apply_lora, base_dtype, drawing_nothing, trainable_in_fp32
from hf_zero.train.parts import PartPlan

__all__ = ["part_names", "plan_vlm_parts", "part_of", "vlm_parts", "target_counts", "build_vlm", "adapt_vlm",
           "rope_index_of",
           "llava_feature_kwargs", "unread_vision",
           "describe_targets", "vision_warning"]

_WRAPPERS = re.compile(r"^(base_model\.model\.)|\.modules_to_save\.default|\.original_module")


def part_names(use_peft: bool) -> list[str]:
    return ["vision_tower", "projector", "lora" if use_peft else "language_model"]


def plan_vlm_parts(stages, family: Family, use_peft: bool, base_lr: float) -> PartPlan:
    """The stages' part plan over a VLM's parts (part_names, vlm_parts), as the run, its check and its estimate read
    it; a stage without `train:` trains the language model (or its LoRA)."""
    names = part_names(use_peft)
    return PartPlan(stages, names, base_lr, default=names[-1:], parts_of=lambda m: vlm_parts(m, family, use_peft))


def part_of(name: str, family: Family) -> str:
    """The part a parameter or module belongs to, by its name (peft's wrappers stripped)."""
    name = _WRAPPERS.sub("", name) + "."
    if name.startswith(family.projectors):
        return "projector"
    if name.startswith(family.vision_tower):
        return "vision_tower"
    return "language_model"


def unread_vision(config, family: Family) -> tuple[str, ...]:
    """Prefixes of the vision tower's parameters no forward reads: LLaVA's projector takes one layer's hidden states
    (`vision_feature_layer`, -2 in LLaVA-1.5), so the layers after it and CLIP's final norm never run. They stay
    frozen: they would get no gradient, which DDP refuses and which would make them "train" without changing."""
    if family.name != "llava":
        return ()
    layers = config.vision_config.num_hidden_layers
    chosen = config.vision_feature_layer
    read = max(i % (layers + 1) for i in (chosen if isinstance(chosen, (list, tuple)) else [chosen]))
    tower = family.vision_tower  # CLIPVisionTransformer: embeddings, pre_layrnorm, encoder, post_layernorm
    return (*(f"{tower}encoder.layers.{i}." for i in range(read, layers)), f"{tower}post_layernorm.")


def _is_unread(name: str, unread: tuple[str, ...]) -> bool:
    return bool(unread) and (_WRAPPERS.sub("", name) + ".").startswith(unread)


def vlm_parts(model, family: Family, use_peft: bool) -> dict[str, list]:
    """{part: [(name, parameter)]} of what can train: every weight by its part, or under LoRA the adapters, the full
    copies peft keeps for modules_to_save, and what else trains in the language model (grown embedding rows); never
    the vision weights no forward reads (unread_vision)."""
    parts: dict = {}
    unread = unread_vision(model.config, family)
    for name, param in model.named_parameters():
        if _is_unread(name, unread):
            continue
        part = part_of(name, family)
        if use_peft:
            copy = "lora_" in name or ".modules_to_save." in name
            if not copy and not (part == "language_model" and param.requires_grad):
                continue
            part = "lora" if part == "language_model" else part
        parts.setdefault(part, []).append((name, param))
    return parts


def target_counts(model, family: Family, targets) -> dict[str, dict[str, int]]:
    """{part: {target: modules it matches}} for a list of LoRA targets, matched as peft matches a list (the module's
    name, or its last dotted parts), over the modules that hold weights."""
    counts = {p: {t: 0 for t in targets} for p in ("vision_tower", "projector", "language_model")}
    for name, module in model.named_modules():
        if not any(True for _ in module.parameters(recurse=False)):
            continue
        for t in targets:
            if name == t or name.endswith(f".{t}"):
                counts[part_of(name, family)][t] += 1
    return counts


def describe_targets(counts: dict) -> str:
    """`vision_tower: q_proj 0, v_proj 0; projector: ...; language_model: q_proj 2, v_proj 2`."""
    return "; ".join(f"{part}: " + ", ".join(f"{t} {n}" for t, n in per.items()) for part, per in counts.items())


def vision_warning(counts: dict, trains_vision: bool, linear: list[str]) -> str | None:
    """One line when a stage trains the vision tower under LoRA but no target matched a module in it."""
    if not trains_vision or any(counts["vision_tower"].values()):
        return None
    return (f"lora_target_modules: no entry matched a vision tower module (its weights: {', '.join(linear[:8])}): the "
            "stages that train vision_tower train its full weights; add its names to adapt it with LoRA")


def _full_parts(model, family: Family, plan, counts: dict | None) -> list[str]:
    """modules_to_save: the module of each part a stage trains that holds no adapter (an outer one covers an inner).
    A module list (Qwen3-VL's DeepStack mergers) by its members: the forward indexes it, which peft's wrapper of a
    module cannot take."""
    names = []
    modules = dict(model.named_modules())
    for part, prefixes in (("vision_tower", (family.vision_tower,)), ("projector", family.projectors)):
        if part in plan.ever_trained and (counts is None or not any(counts[part].values())):
            for prefix in prefixes:
                module = modules.get(prefix.rstrip("."))
                names += ([f"{prefix}{i}" for i in range(len(module))] if isinstance(module, torch.nn.ModuleList)
                          else [prefix.rstrip(".")])
    return [n for n in names if not any(n != o and n.startswith(o + ".") for o in names)]


def _total(out) -> torch.Tensor:
    """The sum of the image features a vision forward gives the language model: its `pooler_output` (the projector's
    output, what an image batch scatters into the text), a tensor or a list of them, and Qwen3-VL's
    `deepstack_features` (its DeepStack mergers' outputs, which an image batch adds into the first layers). Not the
    vision tower's own last hidden state beside them: a gradient reaching the tower by another path than an image
    batch's would reach its modules in another order, and ZeRO-3 gathers them again for backward in that order."""
    deepstack = getattr(out, "deepstack_features", None) or ()
    out = getattr(out, "pooler_output", out)
    total = out.float().sum() if isinstance(out, torch.Tensor) else sum((_total(v) for v in out), torch.zeros(()))
    return total + sum((_total(v) for v in deepstack), torch.zeros(())) if deepstack else total


def llava_feature_kwargs(config) -> dict:
    """Which vision layer LLaVA's projector reads and whether CLS is dropped: its config's, passed explicitly."""
    return {"vision_feature_layer": config.vision_feature_layer,
            "vision_feature_select_strategy": config.vision_feature_select_strategy}


def _blank_image_features(model, family: Family, processing) -> torch.Tensor:
    """The vision tower and projector run on one blank image (the smallest the family takes)."""
    device = next(model.parameters()).device
    dtype = next((p.dtype for p in model.model.parameters() if p.is_floating_point()), torch.float32)
    if family.name == "idefics3":
        side = model.config.vision_config.image_size
        pixels = torch.ones(1, 1, 3, side, side, device=device, dtype=dtype)
        return _total(model.model.get_image_features(pixels, torch.ones(1, 1, side, side, dtype=torch.bool,
                                                                        device=device)))
    if family.name == "llava":
        side = model.config.vision_config.image_size
        pixels = torch.ones(1, model.config.vision_config.num_channels, side, side, device=device, dtype=dtype)
        return _total(model.model.get_image_features(pixels, **llava_feature_kwargs(model.config)))
    merge = processing.images.merge_size
    vision = model.config.vision_config
    width = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
    pixels = torch.ones(merge * merge, width, device=device, dtype=dtype)
    return _total(model.model.get_image_features(pixels, torch.tensor([[1, merge, merge]], device=device)))


def keep_vision_in_step(model, family: Family, processing) -> None:
    """Every forward with a loss runs the vision tower (evaluation too: under ZeRO-3 its forward gathers as well): a
    text-only batch adds 0 x its output on a blank image to the input embeddings."""
    add_to_embeddings_without_images(model, lambda m: _blank_image_features(m, family, processing) * 0)


def rope_index_of(model):
    """The model's own multimodal RoPE numbering (Qwen2-VL's and Qwen3-VL's `get_rope_index`), which packed rows
    need per conversation (hf_zero.data.vlm.VlmCollator); None for a family with 1-D positions."""
    return next((m.get_rope_index for m in model.modules() if hasattr(m, "get_rope_index")), None)


def build_vlm(model_args, processing, profile, plan):
    """The VLM for the run (under ZeRO-3 built partitioned by zero.Init, as a causal LM is), LoRA on it if asked,
    each part's weights trainable as `plan` (a PartPlan over part_names) says. Returns (model, target counts or
    None)."""
    from transformers import AutoModelForImageTextToText

    family, path = processing.family, resolve_model_path(model_args.model_name_or_path)
    with waiting_for("the other ranks to build the model (zero.Init under ZeRO-3)"):
        with drawing_nothing():
            model = AutoModelForImageTextToText.from_pretrained(path, dtype=base_dtype(model_args.use_peft, profile))
    text = model.config.get_text_config()
    grown = grow_embeddings(model, processing.tokenizer, getattr(text, "vocab_size", None))
    keep_vision_in_step(model, family, processing)
    return adapt_vlm(model, model_args, family, plan, grown)


def adapt_vlm(model, model_args, family: Family, plan, grown: bool = False, announce: bool = True):
    """LoRA on a VLM as the run puts it (its targets' matches per part said, or the family's default targets; the
    parts a stage trains without an adapter in them kept whole by modules_to_save), then each part trainable as
    `plan` says; on loaded weights or, for the estimate, on the meta device. Returns (model, target counts or None)."""
    counts = None
    if model_args.use_peft:
        targets = model_args.lora_target_modules
        if isinstance(targets, (list, tuple)):
            counts = target_counts(model, family, targets)
            linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                             if isinstance(m, torch.nn.Linear) and part_of(n, family) == "vision_tower"})
            warning = vision_warning(counts, "vision_tower" in plan.ever_trained, linear)
            if announce:
                say(f"[hf_zero] LoRA targets matched per part: {describe_targets(counts)}")
                if warning:
                    say(f"[hf_zero] warning: {warning}")
        else:
            model_args.lora_target_modules = targets or default_targets(family)
        model = apply_lora(model, model_args, task_type="CAUSAL_LM",
                           modules_to_save=_full_parts(model, family, plan, counts) or None)
        if grown:
            train_embeddings(model)
    unread = unread_vision(model.config, family)
    for name, param in model.named_parameters():
        if _is_unread(name, unread):
            param.requires_grad_(False)
    for part, params in vlm_parts(model, family, model_args.use_peft).items():
        for _, param in params:
            param.requires_grad_(part in plan.ever_trained)
    if model_args.use_peft:
        trainable_in_fp32(model)
    return model, counts
