"""Answers from a composed multimodal model (hf_zero.train.composed): what `hf-zero generate --image PATH` /
`--points PATH` runs on a multimodal run's final/ folder (or its output_dir, or final/llm_adapter).

The prompt is formed as the run's rows were: a user turn of the saved chat template whose content is each item's
placeholder, then the text; each placeholder becomes its encoder's token count of positions, filled with the
projected encoder output, and the LLM generates greedily from those embeddings. Every file is opened as the training
collator opens it (hf_zero.data.multimodal.load_media) before the weights are read, so a bad file or a modality the
model has no encoder for is one line, not a traceback after a load.
"""

from __future__ import annotations

import json
from pathlib import Path

from hf_zero.core.errors import UserError
from hf_zero.core.safetensors_header import verify_safetensors
from hf_zero.data.chat_template import end_of_turn_ids
from hf_zero.data.model_names import get_tokenizer
from hf_zero.data.multimodal import declared_specs, load_media
from hf_zero.train.composed import ADAPTER_DIR, CONFIG_NAME, ComposedModel

__all__ = ["composed_folder", "read_items", "composed_prompt_ids", "load_composed", "generate_composed"]

_WHAT = {"image": "an image file (PNG, JPEG, ...)"}  # any other modality: a .npy array


def composed_folder(path: str | None) -> Path | None:
    """The composed model's folder that `path` names: the folder itself, a run's output_dir (its final/), or the
    LLM's adapter inside it (final/llm_adapter); None for anything else (a plain model or adapter, a model's name)."""
    if not path:
        return None
    p = Path(path).expanduser()
    for folder in (p, p / "final", p.parent if p.name == ADAPTER_DIR else None):
        if folder is not None and (folder / CONFIG_NAME).is_file():
            return folder
    return None


def _config(folder: Path) -> dict:
    try:
        config = json.loads((folder / CONFIG_NAME).read_text())
        return {"encoders": dict(config["encoders"]), "placeholder_ids": dict(config["placeholder_ids"])}
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise UserError("--model", f"{folder / CONFIG_NAME} is not a composed model's config ({err})",
                        "give the final/ folder a multimodal run wrote") from None


def read_items(folder: Path, items: dict) -> dict:
    """{modality: one item as its encoder takes it} from {modality: file}, each checked against the model's
    encoders and opened as the training collator opens it; one line for a modality the model lacks or a bad file."""
    encoders = _config(folder)["encoders"]
    specs = declared_specs(encoders)
    out = {}
    for modality, path in items.items():
        flag = f"--{modality}"
        if modality not in specs:
            raise UserError(flag, f"this model has no {modality} encoder (it reads: {', '.join(specs)})",
                            f"drop {flag}, or use a model trained with a {modality} encoder")
        what = _WHAT.get(modality, "a .npy array")
        file = Path(path).expanduser()
        if not file.is_file():
            raise UserError(flag, f"{path} is not a file", f"give the path of {what}")
        try:
            out[modality] = load_media(specs[modality], file)
        except Exception as err:  # PIL and numpy raise many kinds for a bad file: each is this file's fault
            raise UserError(flag, f"cannot read {path} ({str(err).splitlines()[0][:160]})",
                            f"give {what} the model's {modality} encoder takes") from None
    return out


def composed_prompt_ids(tokenizer, specs: dict, placeholder_ids: dict, prompt: str, modalities: list[str],
                        chat: bool = True, system: str | None = None) -> list[int]:
    """The prompt's token ids as the run's rows were tokenized: each item's placeholder (in `modalities`' order)
    before the text, in a user turn of the chat template (or as it is without `chat`), each placeholder then
    repeated to its encoder's token count."""
    content = "".join(specs[m].placeholder for m in modalities) + prompt
    if chat:
        turns = [{"role": "system", "content": system}] if system else []
        text = tokenizer.apply_chat_template(turns + [{"role": "user", "content": content}], tokenize=False,
                                             add_generation_prompt=True)
    else:
        text = content
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    runs = {placeholder_ids[m]: specs[m].tokens for m in specs}
    if sum(t in runs for t in ids) != len(modalities):
        raise UserError("--prompt", "the prompt's text holds a modality placeholder (<image>, <points>, ...)",
                        "pass the item with --image / --points and leave its placeholder out of the text")
    return [t for t in ids for _ in range(runs.get(t, 1))]


def load_composed(folder: Path):
    """(model in eval mode, tokenizer) of a composed model's folder."""
    verify_safetensors(folder, "--model")  # a crafted header: one line, not a library's traceback
    return ComposedModel.from_pretrained(folder).eval(), get_tokenizer(str(folder), str(folder))


def generate_composed(model, tokenizer, ids: list[int], items: dict, max_new_tokens: int) -> str:
    """The greedy answer to a prompt's ids (composed_prompt_ids) with its items ({modality: array})."""
    import torch

    input_ids = torch.tensor([ids])
    media = {m: (torch.from_numpy(v[None]), torch.tensor([0])) for m, v in items.items()}
    with torch.no_grad():
        embeds, _ = model.embed(input_ids, media)
        out = model.llm.generate(inputs_embeds=embeds, attention_mask=torch.ones_like(input_ids),
                                 max_new_tokens=max_new_tokens, do_sample=False, temperature=None, top_p=None,
                                 top_k=None, eos_token_id=end_of_turn_ids(tokenizer),
                                 pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0], skip_special_tokens=True).strip()  # from embeddings: only the new tokens
