"""Multimodal chat rows in TRL's form, tokenized with one placeholder token per encoder output position.

A row is a conversation whose message `content` is a string or a list of items: `{"type": "text", "text": ...}`, or
`{"type": <modality>, <modality>: "file"}` for any modality an encoder declares (`image`: a PNG/JPEG... file,
any other: a `.npy` array, e.g. `{"type": "points", "points": "shape.npy"}`). Paths are relative to the data file.

The conversation is rendered by the tokenizer's chat template exactly as hf_zero's text chat path does
(hf_zero.data.chat: assistant-only loss), each modality item standing as its placeholder token (`<image>`); that one
token then becomes `tokens` copies of itself, the positions the composed model fills with the projected encoder
output, never trained. Every referenced file is opened as the collator will open it before anything trains, so a bad
file is one line naming the row and the file, not a crash at some step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from hf_zero.core.errors import UserError
from hf_zero.data.builtin import resolve_data_path
from hf_zero.data.chat import IGNORE, FormatOptions, Row, SourceReport, encode_conversation, validate_messages
from hf_zero.data.chat_template import prepare_chat_template
from hf_zero.data.packing import pack_stage_sources, pad_id
from hf_zero.data.sources import load_source, verify_data_file
from hf_zero.data.stages import StageData, hold_out

__all__ = ["ModalitySpec", "add_placeholders", "load_media", "encode_multimodal_rows", "load_multimodal_stage",
           "read_rows", "message_text", "items_folder"]

_ADDED = "_hf_zero_template_tokens"  # hf_zero.data.chat_template's list of tokens the embeddings grow for


@dataclass(frozen=True)
class ModalitySpec:
    """What the data needs to know of an encoder: its input's shape and how many tokens its output takes."""

    name: str  # the item type in the rows: image, points, ...
    input_shape: tuple  # one item as the encoder takes it: (C, H, W) for an image, (N, D) for an array
    tokens: int  # positions the projected output fills in the text
    width: int = 0  # the encoder's output width (what its projector takes)
    token: str = ""  # the placeholder as written in the text: a stock VLM's own image token; default <name>
    # A stock VLM's item: its file -> the ids it becomes (its processor's own run, wrappers and image tokens, their
    # count from the image's size: hf_zero.data.vlm); None: `tokens` copies of the placeholder.
    expand: object = field(default=None, compare=False)

    @property
    def placeholder(self) -> str:
        return self.token or f"<{self.name}>"

    @property
    def is_image(self) -> bool:
        return self.name == "image"


def add_placeholders(tokenizer, specs: dict) -> dict:
    """Each modality's placeholder as one special token (never split, never parsed out of user text); listed with
    the chat template's added markers, so the LLM's embeddings grow for them as for those (train/model.py).
    Returns {modality: token id}."""
    prepare_chat_template(tokenizer)  # first: its markers' ids come before the placeholders', in every process
    names = [s.placeholder for s in specs.values()]
    new = [n for n in names if n not in tokenizer.get_vocab()]
    if new:
        tokenizer.add_tokens(new, special_tokens=True)
        setattr(tokenizer, _ADDED, list(getattr(tokenizer, _ADDED, [])) + new)
    return {m: tokenizer.convert_tokens_to_ids(s.placeholder) for m, s in specs.items()}


def load_media(spec: ModalitySpec, path: Path):
    """One item as the encoder takes it (float32 numpy array of spec.input_shape). Raises ValueError/OSError with
    the reason when the file is not what the modality needs."""
    import numpy as np

    if spec.is_image:
        from PIL import Image

        channels, height, width = spec.input_shape
        with Image.open(path) as img:
            img = img.convert("L" if channels == 1 else "RGB").resize((width, height), Image.Resampling.BILINEAR)
            pixels = np.asarray(img, dtype=np.float32) / 255.0
        return pixels[None] if channels == 1 else pixels.transpose(2, 0, 1).copy()
    array = np.load(path, allow_pickle=False)
    if array.ndim != len(spec.input_shape) or tuple(array.shape[1:]) != tuple(spec.input_shape[1:]):
        takes = ", ".join(map(str, spec.input_shape[1:]))
        raise ValueError(f"shape {tuple(array.shape)}, the encoder takes (any, {takes})")
    if not np.issubdtype(array.dtype, np.number) or not np.isfinite(array).all() or len(array) == 0:
        raise ValueError("not a finite, non-empty numeric array")
    # A fixed count per item, so items stack: evenly spaced rows, or the rows repeated in order.
    take = np.linspace(0, len(array) - 1, spec.input_shape[0]).round().astype(int) if len(array) >= \
        spec.input_shape[0] else np.arange(spec.input_shape[0]) % len(array)
    return array[take].astype(np.float32)


def message_text(msg: dict, j: int, row: Row, specs: dict, folder: Path, media: list) -> str:
    """A message's content as text, each modality item as its placeholder; its files appended to `media`."""
    content = msg.get("content")
    if not isinstance(content, list):
        if isinstance(content, str) and any(s.placeholder in content for s in specs.values()):
            row.fail(f"messages[{j}] writes a placeholder as text", 'give the item as {"type": "image", ...}')
        return content
    parts = []
    for k, item in enumerate(content):
        kind = item.get("type") if isinstance(item, dict) else None
        if kind == "text":
            text = item.get("text")
            if not isinstance(text, str) or any(s.placeholder in text for s in specs.values()):
                row.fail(f"messages[{j}].content[{k}] needs a string 'text' without a placeholder")
            parts.append(text)
        elif kind in specs:
            if msg.get("role") == "assistant":
                row.fail(f"messages[{j}].content[{k}]: an assistant reply cannot hold a {kind}",
                         "put modality items in user or system messages")
            name = item.get(kind)
            if not isinstance(name, str) or not name:
                row.fail(f"messages[{j}].content[{k}] has no file under {kind!r}", f'e.g. {{"type": "{kind}", '
                         f'"{kind}": "file"}}')
            path = Path(name) if Path(name).is_absolute() else folder / name
            try:
                load_media(specs[kind], path)
            except Exception as err:  # PIL and numpy raise many kinds for a bad file: each is this file's fault
                row.fail(f"{kind} file {name}: {str(err).splitlines()[0][:160]}", "fix or remove the file or row")
            media.append((kind, str(path)))
            parts.append(specs[kind].placeholder)
        else:
            known = ", ".join(["text", *specs]) or "text"
            row.fail(f"messages[{j}].content[{k}] has type {kind!r} with no encoder",
                     f"use one of {known}, or declare an encoder for it")
    return "".join(parts)


def read_rows(spec: str, where: str, field: str) -> list:
    """The conversations of a source. JSON lines are read as written: datasets unifies the rows' types, and a reply
    "3" beside contents that are lists of items came back as the number 3 (or as None)."""
    import json

    path = Path(resolve_data_path(spec))  # a built-in source: its prepared file, read as any file is
    if path.suffix not in (".jsonl", ".json"):
        ds = load_source(spec, where)
        if field not in ds.column_names:
            raise UserError(where, f"{spec} has no column {field!r} (columns: {', '.join(ds.column_names)})",
                            "give each row a messages list, as TRL's multimodal form")
        return list(ds[field])
    if not path.is_file():
        raise UserError(where, f"data file {spec} does not exist",
                        "fix the path (a relative path is read from the recipe YAML's folder)")
    verify_data_file(path, spec, where)  # one line for a bad byte or a bad JSON line, with its row
    text = path.read_text(encoding="utf-8")
    rows = [json.loads(line) for line in text.splitlines() if line.strip()] if path.suffix == ".jsonl" or \
        not text.lstrip().startswith("[") else json.loads(text)
    for n, row in enumerate(rows, 1):
        if not isinstance(row, dict) or field not in row:
            raise UserError(where, f"{spec} row {n}: has no {field!r}", "give each row a messages list, as TRL's "
                            "multimodal form")
    return [row[field] for row in rows]


def encode_multimodal_rows(conversations: list, tokenizer, specs: dict, placeholder_ids: dict, max_len: int,
                           where: str, spec: str, folder: Path, opts: FormatOptions | None = None):
    """Samples {input_ids, labels, media: [(modality, path), ...]} of a source's conversations, and its report."""
    opts = opts or FormatOptions()
    row = Row(where, spec)
    report = SourceReport(spec, "conversational", "answers only" if opts.assistant_only_loss else "all tokens")
    runs = {placeholder_ids[m]: specs[m] for m in specs}
    in_runs = set(runs)  # every id a run holds (a VLM's wrappers too): a cut through one would not match its encoder
    samples = []
    for i, raw in enumerate(conversations):
        row.n, media = i + 1, []
        report.rows += 1
        if not isinstance(raw, list):
            row.fail(f"{opts.messages_field} must be a list of messages")
        msgs = [{**m, "content": message_text(m, j, row, specs, folder, media)} if isinstance(m, dict) else m
                for j, m in enumerate(raw)]
        enc = encode_conversation(tokenizer, validate_messages(msgs, row, opts.messages_field), opts, row)
        if sum(t in runs for t in enc.ids) != len(media):
            row.fail("the chat template dropped a modality item's placeholder", "put the items in user messages")
        ids, mask, items = [], [], iter(media)
        for t, m in zip(enc.ids, enc.mask):
            spec = runs.get(t)
            if spec is None:
                ids.append(t)
                mask.append(bool(m))
                continue
            path = Path(next(items)[1])
            run = [t] * spec.tokens if spec.expand is None else list(spec.expand(path))
            in_runs.update(run)
            ids += run
            mask += [False] * len(run)  # an item's positions never carry the loss
        if len(ids) > max_len:
            report.truncated += 1
            cut_media = any(t in in_runs for t in ids[max_len - 1:])  # a run cut short would not match its encoder
            ids, mask = ids[:max_len], mask[:max_len]
            if cut_media or not any(mask):
                report.dropped += 1
                continue
        report.lengths.append(len(ids))
        report.loss_tokens += sum(mask)
        samples.append({"input_ids": ids, "labels": [t if m else IGNORE for t, m in zip(ids, mask)], "media": media,
                        "_gen": {"prompt": enc.prompt, "question": enc.question, "reference": enc.reference}})
    return samples, report


def _prompts(samples: list[dict], tokenizer, specs: dict, placeholder_ids: dict) -> list[dict]:
    """The held-out samples' generation prompts {prompt, question, reference, media, ids}: `ids` the rendered prompt
    (up to the last reply) tokenized and each placeholder run expanded as the training rows' are; every sample loses
    its `_gen` (the collator takes token lists and media only)."""
    runs = {placeholder_ids[m]: specs[m] for m in specs}
    prompts = []
    for s in samples:
        gen = s.pop("_gen", None)
        if gen is None or gen["prompt"] is None or not isinstance(gen["reference"], str):
            continue
        items, ids = iter(s["media"]), []
        for t in tokenizer(gen["prompt"], add_special_tokens=False)["input_ids"]:
            spec = runs.get(t)
            ids += [t] if spec is None else [t] * spec.tokens if spec.expand is None else \
                list(spec.expand(Path(next(items)[1])))
        prompts.append({**gen, "media": list(s["media"]), "ids": ids})
    return prompts


def load_multimodal_stage(stage, tokenizer, specs: dict, placeholder_ids: dict, default_max_len: int,
                          eval_samples: int, seed: int, opts: FormatOptions | None = None,
                          packing: bool = False) -> StageData:
    """A stage's multimodal sources tokenized, a held-out slice drawn as hf_zero.data.stages draws it; with
    `packing`, the training conversations go whole into rows of the stage's length, each with its items
    (hf_zero.data.packing), the held-out ones stay one per row."""
    max_len = stage.max_seq_length or default_max_len
    opts = opts or FormatOptions()

    def encoded(spec: str, where: str) -> tuple[list, object]:
        samples, report = encode_multimodal_rows(read_rows(spec, where, opts.messages_field), tokenizer, specs,
                                                 placeholder_ids, max_len, where, spec, items_folder(spec), opts)
        if not samples:
            raise UserError(where, f"{spec} has no row left within max_seq_length", "raise max_seq_length")
        return samples, report

    sources, reports = [], []
    for j, spec in enumerate(stage.data):
        samples, report = encoded(spec, f"stages[{stage.name}].data[{j}]")
        sources.append(samples)
        reports.append(report)
    if stage.eval_data:  # the stage's own held-out rows, as hf_zero.data.stages takes them
        held_out = [s for j, spec in enumerate(stage.eval_data)
                    for s in encoded(spec, f"stages[{stage.name}].eval_data[{j}]")[0]]
        held_out = held_out[:eval_samples] if eval_samples else []
    else:
        held_out = hold_out(stage, sources, eval_samples, seed) if eval_samples else []
    prompts = _prompts(held_out, tokenizer, specs, placeholder_ids)
    for samples in sources:
        for s in samples:
            s.pop("_gen", None)
    if packing:
        sources = pack_stage_sources(sources, stage.weights is not None, max_len, pad_id(tokenizer))
    return StageData(sources, held_out, reports, prompts)


def items_folder(spec: str) -> Path:
    """The folder a source's item paths are relative to: its file's (a built-in source's prepared file's)."""
    return Path(resolve_data_path(spec)).resolve().parent
