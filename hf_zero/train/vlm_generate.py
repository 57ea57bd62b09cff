"""`hf-zero generate --image` for a stock VLM: a run's final/ adapter (recipes/vlm.py with use_peft), a merged
`hf-zero export`, or any VLM folder or hub id. The prompt is built as the run built its rows: the chat template with
the image item first in the user turn, the image token expanded to the run the family's processor writes, the image
tensors from the same processor (hf_zero.data.vlm)."""

from __future__ import annotations

import json
from pathlib import Path

from hf_zero.core.errors import UserError
from hf_zero.data.model_names import get_tokenizer, hub_model_id, resolve_model_path
from hf_zero.data.vlm import VlmProcessing, is_vlm_config

__all__ = ["vlm_source", "generate_vlm"]


def _config_json(folder) -> dict:
    path = Path(folder) / "config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def vlm_source(model: str | None, adapter: str | None) -> tuple[str, str | None] | None:
    """(the base model's folder, the adapter folder or None) when the model or adapter is a VLM's; None otherwise."""
    try:
        if adapter:
            config = Path(adapter) / "adapter_config.json"
            if not config.is_file():
                return None
            base = model or json.loads(config.read_text()).get("base_model_name_or_path")
            path = resolve_model_path(base)
            return (path, adapter) if is_vlm_config(_config_json(path)) else None
        if model:
            path = resolve_model_path(model)
            return (path, None) if is_vlm_config(_config_json(path)) else None
    except UserError:
        return None
    return None


def generate_vlm(base: str, adapter: str | None, image: str, prompt: str, system: str | None,
                 max_new_tokens: int) -> str:
    """The greedy answer of the model (with its adapter) to an image and a prompt, in its chat template."""
    import torch
    from transformers import AutoModelForImageTextToText

    if not Path(image).is_file():
        raise UserError("--image", f"{image} is not a file", "give an image file (PNG, JPEG, ...)")
    tokenizer = get_tokenizer(base, adapter)  # the run's: its chat template as trained
    processing = VlmProcessing(base, tokenizer)
    if adapter and (Path(adapter) / "preprocessor_config.json").is_file():
        from transformers import AutoImageProcessor

        processing.images = AutoImageProcessor.from_pretrained(adapter)  # the run's sizing
    model = AutoModelForImageTextToText.from_pretrained(base, dtype=torch.float32)
    if adapter:
        from peft import PeftModel

        model.name_or_path = model.config.name_or_path = hub_model_id(base)
        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    turns = [{"role": "system", "content": system}] if system else []
    text = tokenizer.apply_chat_template(turns + [{"role": "user", "content": processing.family.image_token + prompt}],
                                         tokenize=False, add_generation_prompt=True)
    ids = []
    try:
        for t in tokenizer(text, add_special_tokens=False)["input_ids"]:
            ids += processing.expand(Path(image)) if t == processing.image_token_id else [t]
        input_ids = torch.tensor([ids])
        pixels = processing.pixels([[Path(image)]], input_ids)
    except OSError as err:  # PIL: not an image it can read
        raise UserError("--image", f"{image}: {str(err).splitlines()[0][:160]}", "give a readable image file") \
            from None
    with torch.no_grad():
        out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), **pixels,
                             max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, input_ids.shape[1]:], skip_special_tokens=True).strip()
