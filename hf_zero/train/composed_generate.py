"""Answers from a composed multimodal model (hf_zero.train.composed): what `hf-zero generate --image PATH` /
`--points PATH` runs on a multimodal run's final/ folder (or its output_dir, or final/llm_adapter).

The prompt is formed as the run's rows were: a user turn of the saved chat template whose content is each item's
placeholder, then the text; each placeholder becomes its encoder's token count of positions, filled with the
projected encoder output, and the LLM generates greedily from those embeddings. Every file is opened as the training
collator opens it (hf_zero.data.multimodal.load_media) before the weights are read, so a bad file or a modality the
model has no encoder for is one line, not a traceback after a load.

The same greedy loop (`greedy_answers`) answers a multimodal run's held-out prompts during training
(hf_zero.train.samples with `answer_composed_prompts`). It calls the composed model itself at every step, not its
LLM's `generate`: under FSDP2 the LLM's embeddings and head belong to the composed model's root shard group, which
only the composed model's own forward gathers. Under ZeRO-3 and FSDP (`synced_gpus`) every rank runs every encoder
on the first step (a dummy item where its batch has none) and keeps stepping until every rank has finished, so the
collectives of every forward line up (as `generate(synced_gpus=True)` does for a text model).
"""

from __future__ import annotations

import json
from pathlib import Path

from hf_zero.core.errors import UserError
from hf_zero.core.safetensors_header import verify_safetensors
from hf_zero.data.chat_template import end_of_turn_ids
from hf_zero.data.model_names import get_tokenizer
from hf_zero.data.multimodal import load_media
from hf_zero.data.multimodal_check import declared_specs
from hf_zero.train.composed import ADAPTER_DIR, CONFIG_NAME, ComposedModel

__all__ = ["composed_folder", "read_items", "composed_prompt_ids", "load_composed", "generate_composed",
           "greedy_answers", "answer_composed_prompts"]

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
    return greedy_answers(model, tokenizer, [(ids, list(items.items()))], max_new_tokens)[0]


def answer_composed_prompts(model, tokenizer, prompts: list[dict], max_new_tokens: int, synced_gpus: bool = False,
                            progress=None) -> list[str]:
    """hf_zero.train.samples' `generate` for a composed model: held-out prompts {ids, media: [(modality, path)]}
    (hf_zero.data.multimodal's), each item opened as the training collator opens it."""
    specs = model.specs
    rows = [(p["ids"], [(m, load_media(specs[m], Path(path))) for m, path in p["media"]]) for p in prompts]
    return greedy_answers(model, tokenizer, rows, max_new_tokens, synced_gpus=synced_gpus, progress=progress)


def greedy_answers(model, tokenizer, rows: list[tuple], max_new_tokens: int, synced_gpus: bool = False,
                   batch_size: int = 8, progress=None) -> list[str]:
    """Greedy answers of a composed model to rows (prompt ids with their placeholder runs, [(modality, array)] in
    reading order), left-padded in batches, each stopping at EOS or the template's end of turn. The model's
    train/eval mode is restored after; `progress(batches done, batches)` after each batch."""
    import numpy as np
    import torch

    stop, pad = set(end_of_turn_ids(tokenizer)), tokenizer.pad_token_id
    pad = tokenizer.eos_token_id if pad is None else pad
    device = next(model.parameters()).device
    was_training, answers = model.training, []
    model.eval()
    try:
        with torch.no_grad():
            for start in range(0, len(rows), batch_size):
                batch = rows[start:start + batch_size]
                longest = max(len(ids) for ids, _ in batch)
                input_ids = torch.full((len(batch), longest), pad, dtype=torch.long)
                mask = torch.zeros_like(input_ids)
                for i, (ids, _) in enumerate(batch):
                    input_ids[i, longest - len(ids):], mask[i, longest - len(ids):] = torch.tensor(ids), 1
                media = {}
                for m in model.specs:
                    items = [(i, v) for i, (_, its) in enumerate(batch) for kind, v in its if kind == m]
                    if items:
                        media[f"{m}_values"] = torch.from_numpy(np.stack([v for _, v in items])).to(device)
                        media[f"{m}_rows"] = torch.tensor([i for i, _ in items], device=device)
                new = _decode(model, input_ids.to(device), mask.to(device), media, max_new_tokens, stop, pad,
                              synced_gpus)
                answers += [tokenizer.decode(t, skip_special_tokens=True).strip() for t in new]
                if progress is not None:
                    progress(start // batch_size + 1, -(-len(rows) // batch_size))
    finally:
        model.train(was_training)
    return answers


def _decode(model, input_ids, mask, media: dict, max_new_tokens: int, stop: set, pad: int, synced: bool) -> list:
    """Each row's new tokens (without the one that stopped it), one forward of the composed model per token."""
    import torch
    import torch.distributed as dist

    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # left padding: each row's own positions from 0
    # The last position's logits only, where the LLM can (the whole prompt's would be vocabulary x tokens wide)
    last = {"logits_to_keep": 1} if _keeps_logits(model) else {}
    out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True,
                keep_ranks_in_step=synced, **media, **last)
    done = torch.zeros(len(input_ids), dtype=torch.bool)
    tokens = [[] for _ in range(len(input_ids))]
    for step in range(max_new_tokens):
        nxt = out.logits[:, -1].argmax(-1)
        for i, t in enumerate(nxt.tolist()):
            if not done[i]:
                done[i] = t in stop
                tokens[i] += [] if done[i] else [t]
        finished = bool(done.all())
        if synced:  # every rank steps until all have finished: each forward is a collective
            left = torch.tensor([0.0 if finished else 1.0], device=out.logits.device)
            dist.all_reduce(left)
            finished = left.item() == 0.0
        if finished or step == max_new_tokens - 1:
            break
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        positions = positions[:, -1:] + 1
        feed = torch.where(done.to(nxt.device), torch.full_like(nxt, pad), nxt)[:, None]
        out = model(input_ids=feed, attention_mask=mask, position_ids=positions, past_key_values=out.past_key_values,
                    use_cache=True, keep_ranks_in_step=False)
    return tokens


def _keeps_logits(model) -> bool:
    import inspect

    llm = model.llm.get_base_model() if model.uses_lora else model.llm
    return "logits_to_keep" in inspect.signature(llm.forward).parameters
