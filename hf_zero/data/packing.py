"""Sequence packing: a stage's tokenized documents placed whole into fixed-length rows (`packing: true`).

Whole documents, placed best-fit-decreasing, rather than concatenate-and-chunk: a document cut in two would lose its
context in the second row, which changes what the model is trained on. Boundaries are kept by three things:
- `position_ids` restart at 0 for every document, so each one sees the positions it would see alone;
- no `attention_mask` and no KV cache (`use_cache=False`): only then does transformers read the restarts
  (`masking_utils.find_packed_sequence_indices`) and build a block-diagonal causal mask for sdpa and eager attention,
  so that no token attends across a boundary. Llama's config says use_cache=True, and its forward creates a cache
  even in training, which silently turns the detection off: the collator passes use_cache=False with every batch;
- the label of every document's first token is -100: in a row it would be predicted from the previous document.
tests/data/test_packing.py proves it: per-token losses of a packed row equal those of its documents run one by one.

With flash attention (`attn_implementation: flash_attention_2`, or hub flash kernels) there is no mask at all: the
rows of a micro-batch become one row of their documents, padding dropped, and the documents' cumulative lengths
(`cu_seq_lens_*`, as transformers' DataCollatorWithFlattening writes them) send attention down flash's varlen path.
It must be one row: transformers reads packing from position_ids only for a batch of one, so rows stacked as they
are would let flash attend across documents.

Multimodal rows pack the same way: a document's items (`media`, in reading order) go with it, so a packed row's items
are its documents' in row order, the order the model fills its placeholder runs in (hf_zero.data.multimodal).
"""

from __future__ import annotations

import bisect

__all__ = ["pack_documents", "pack_stage_sources", "PackedCollator", "padding_stats", "real_tokens", "documents_of",
           "pad_id"]

IGNORE = -100


def pack_documents(samples: list[dict], row_len: int, pad_id: int) -> list[dict]:
    """Rows of `row_len` tokens, each holding whole documents (samples with input_ids/labels), padded at the end.

    Best-fit decreasing: longest documents first, each into the row it fills most tightly. Deterministic: ties keep
    the input order, and documents sit in a row in their input order.
    """
    lengths = [len(s["input_ids"]) for s in samples]
    too_long = [n for n in lengths if n > row_len]
    if too_long:
        raise ValueError(f"a document of {too_long[0]} tokens does not fit a packed row of {row_len}")
    free: list[tuple[int, int]] = []  # (free tokens, row index), kept sorted
    rows: list[list[int]] = []
    for i in sorted(range(len(samples)), key=lambda i: -lengths[i]):
        at = bisect.bisect_left(free, (lengths[i], -1))
        if at == len(free):
            rows.append([])
            space, row = row_len, len(rows) - 1
        else:
            space, row = free.pop(at)
        rows[row].append(i)
        bisect.insort(free, (space - lengths[i], row))
    return [_build_row([samples[i] for i in sorted(members)], row_len, pad_id) for members in rows]


def pack_stage_sources(sources: list[list[dict]], weighted: bool, row_len: int, pad_id: int) -> list[list[dict]]:
    """A stage's sources as packed rows. Without weights, samples are drawn in proportion to source sizes: the same
    as one pooled source, which packs far tighter (short documents fill the rows of long ones); with weights, each
    source is packed apart, so the weights still apply."""
    pools = sources if weighted else [[s for src in sources for s in src]]
    return [pack_documents(s, row_len, pad_id) for s in pools]


def _build_row(docs: list[dict], row_len: int, pad_id: int) -> dict:
    ids, labels, positions, media = [], [], [], []
    for doc in docs:
        n = len(doc["input_ids"])
        ids += list(doc["input_ids"])
        labels += [IGNORE] + list(doc["labels"][1:])
        positions += list(range(n))
        media += list(doc.get("media", ()))
    used = len(ids)
    pad = row_len - used
    # The padding is a segment of its own (positions restart): it has no labels, and no document attends to it.
    row = {"input_ids": ids + [pad_id] * pad, "labels": labels + [IGNORE] * pad,
           "position_ids": positions + list(range(pad)), "real_tokens": used}
    return {**row, "media": media} if any("media" in d for d in docs) else row


def pad_id(tokenizer) -> int:
    """The id rows are padded with: the pad token, else end-of-sequence (masked out of attention and loss)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def real_tokens(sample: dict) -> int:
    """Tokens of text in a sample (a packed row's padding excluded; an unpacked sample is all text)."""
    return int(sample.get("real_tokens", len(sample["input_ids"])))


def documents_of(row: dict) -> list[dict]:
    """The documents of a packed row (input_ids, labels), where its position_ids restart; padding dropped."""
    used, pos = real_tokens(row), row["position_ids"]
    starts = [i for i in range(used) if pos[i] == 0] + [used]
    return [{"input_ids": row["input_ids"][a:b], "labels": row["labels"][a:b]} for a, b in zip(starts, starts[1:])]


class PackedCollator:
    """Packed rows are stacked as they are, with use_cache=False and without an attention_mask (either would switch
    off transformers' packed-sequence detection); with `varlen` (flash attention) they are flattened into one row
    with its documents' boundaries instead. Unpacked samples (e.g. held-out eval samples) go to `fallback`."""

    def __init__(self, fallback, pad_id: int, varlen: bool = False):
        self.fallback, self.pad_id = fallback, pad_id
        self.flatten = None
        if varlen:
            from transformers import DataCollatorWithFlattening

            self.flatten = DataCollatorWithFlattening(return_flash_attn_kwargs=True, separator_id=IGNORE)

    def __call__(self, features: list[dict]) -> dict:
        import torch

        if "position_ids" not in features[0]:
            return self.fallback(features)
        if self.flatten is not None:
            return {**self.flatten([doc for f in features for doc in documents_of(f)]), "use_cache": False}
        width = max(len(f["input_ids"]) for f in features)  # rows of one stage share a length; be safe anyway

        def padded(key, value):
            return [f[key] + [value] * (width - len(f[key])) for f in features]

        positions = [f["position_ids"] + list(range(width - len(f["position_ids"]))) for f in features]
        return {"input_ids": torch.tensor(padded("input_ids", self.pad_id)),
                "labels": torch.tensor(padded("labels", IGNORE)),
                "position_ids": torch.tensor(positions), "use_cache": False}


def padding_stats(samples_in_order: list[dict], micro_batch: int) -> dict:
    """Text tokens vs token slots computed, for micro-batches of consecutive samples each padded to its longest
    (as the collators do; with a sequential sampler every rank's micro-batch is such a slice)."""
    text = slots = 0
    for start in range(0, len(samples_in_order), micro_batch):
        batch = samples_in_order[start:start + micro_batch]
        text += sum(real_tokens(s) for s in batch)
        slots += len(batch) * max(len(s["input_ids"]) for s in batch)
    return {"text_tokens": text, "token_slots": slots, "non_padding_fraction": text / slots if slots else 0.0}
