"""What the tools say of a stock VLM's recipe (recipes/vlm.py) without training it: `hf-zero check`'s data line (every
image opened; per stage, what trains; per part, what each LoRA target matched, and a warning when a stage trains the
vision tower but no target is in it), and the final folder a run writes."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from hf_zero.checkpoint.final import save_final_model
from hf_zero.core.files import human_bytes
from hf_zero.data.chat import FormatOptions
from hf_zero.data.chat_template import prepare_chat_template
from hf_zero.data.model_names import get_model_config, get_tokenizer, resolve_model_path
from hf_zero.data.multimodal import ModalitySpec, add_placeholders, load_multimodal_stage
from hf_zero.data.multimodal_check import check_multimodal_data
from hf_zero.data.vlm import VlmProcessing, family_of
from hf_zero.plan.parse import recipe_fields
from hf_zero.plan.vlm_args import VlmArguments
from hf_zero.train.vlm import describe_targets, part_of, plan_vlm_parts, target_counts, vision_warning

__all__ = ["check_vlm", "vlm_on_meta", "vlm_data", "save_vlm"]


def vlm_on_meta(model_args):
    """(model on the meta device, family): the architecture the run builds, without its weights."""
    import torch
    from transformers import AutoModelForImageTextToText

    config = get_model_config(model_args.model_name_or_path)  # a hub id whose shape hf_zero ships: that shape
    family = family_of(config, model_args.model_name_or_path)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    return model, family


def vlm_data(model_args, training: dict, stages):
    """(tokenizer, specs, placeholder ids, [StageData]) of a VLM recipe's stages, tokenized as the run tokenizes
    them (`hf-zero preview`): no model built."""
    args = recipe_fields(VlmArguments, training)
    tokenizer = get_tokenizer(model_args.model_name_or_path, model_args.tokenizer_name_or_path)
    prepare_chat_template(tokenizer, getattr(args, "chat_template", None))
    processing = VlmProcessing(resolve_model_path(model_args.model_name_or_path), tokenizer, args.image_max_pixels)
    specs = processing.spec()
    placeholders = add_placeholders(tokenizer, specs)
    data = [load_multimodal_stage(s, tokenizer, specs, placeholders, args.max_seq_length, args.eval_samples,
                                  training.get("seed", 42), FormatOptions.from_args(args)) for s in stages]
    return tokenizer, specs, placeholders, data


def check_vlm(stages, args, model_args=None) -> str:
    """recipes/vlm.py's CHECK_DATA: every image opened (hf_zero.data.multimodal's check, the multimodal recipe's),
    then, given the model's arguments (not in the light check `hf-zero train` runs before a launch), what trains per
    stage and, under LoRA with a list of targets, how many modules each target matched in each part."""
    line = check_multimodal_data(stages, args, {"image": ModalitySpec("image", (3, 16, 16), 1)})
    if model_args is None:
        return line
    model, family = vlm_on_meta(model_args)
    use_peft = model_args.use_peft
    plan = plan_vlm_parts(stages, family, use_peft, 5e-5)
    sizes: dict = {}
    for name, param in model.named_parameters():
        part = part_of(name, family)
        sizes[part] = sizes.get(part, 0) + param.numel()
    lines = [f"stage {n} trains {', '.join(p for p, f in factors.items() if f > 0)}"
             for n, factors in zip(plan.names, plan.factors)]
    targets = model_args.lora_target_modules
    if use_peft and isinstance(targets, (list, tuple)) and targets:
        counts = target_counts(model, family, targets)
        lines.append(f"LoRA targets matched per part: {describe_targets(counts)}")
        vision = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if part_of(n, family) ==
                         "vision_tower" and any(True for _ in m.parameters(recurse=False)) and
                         not n.rsplit(".", 1)[-1].isdigit()})
        warning = vision_warning(counts, "vision_tower" in plan.ever_trained, vision)
        if warning:
            print(f"[hf_zero] warning: {warning}", file=sys.stderr, flush=True)
    full = ", ".join(f"{p} {n:,} ({human_bytes(4 * n, digits=2)} in fp32)" for p, n in sizes.items())
    return f"{line}; {family.name} weights per part: {full}; {'; '.join(lines)}"


def save_vlm(trainer, folder, processing) -> Path:
    """The final folder: the adapter (with the parts trained in full, peft's modules_to_save) or the whole model
    (hf_zero.checkpoint.final), the tokenizer, and the image processor, so the folder is the model's processor too."""
    folder = save_final_model(trainer, Path(folder))
    if trainer.is_world_process_zero():
        processing.images.save_pretrained(folder)
        processing.tokenizer.save_pretrained(folder)
        for name in ("processor_config.json", "video_preprocessor_config.json"):  # the processor's own settings
            if (Path(processing.folder) / name).is_file():
                shutil.copy2(Path(processing.folder) / name, folder / name)
    trainer.accelerator.wait_for_everyone()
    return folder
