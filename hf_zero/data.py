"""Stage data: local files (jsonl/json/csv/parquet/txt), hf_zero's built-in data, or hub datasets when online;
tokenized per stage with the stage's own sequence length, a held-out slice per stage for evaluation."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .config import Stage
from .errors import UserError

__all__ = ["StageData", "load_source", "load_stage_data", "build_collator"]

_FORMATS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}


def load_source(spec: str, where: str):
    """One data source as a `datasets.Dataset`."""
    import datasets

    if spec.startswith("builtin:"):
        from .assets import resolve_data_path

        spec = resolve_data_path(spec)
    path = spec
    local = Path(path)
    if local.suffix in _FORMATS:
        if not local.is_file():
            raise UserError(where, f"data file {path} does not exist", "fix the path (in a YAML, relative to the YAML's folder)")
        try:
            return datasets.load_dataset(_FORMATS[local.suffix], data_files=str(local), split="train")
        except Exception as err:  # datasets raises many types for unreadable files
            raise UserError(where, f"cannot read {path} ({type(err).__name__}: {str(err).splitlines()[0][:120]})",
                            "check the file's format") from None
    try:
        return datasets.load_dataset(path, split="train")
    except Exception as err:
        raise UserError(where, f"{spec!r} is neither a local data file nor a reachable hub dataset "
                        f"({type(err).__name__})", "use a .jsonl/.json/.csv/.parquet/.txt path") from None


@dataclass
class StageData:
    sources: list[list[dict]]  # per source: tokenized training samples
    eval_samples: list[dict]  # held-out samples of the stage (may be empty)

    @property
    def pool_size(self) -> int:
        return sum(len(s) for s in self.sources)


def _tokenize(ds, tokenizer, max_len: int, text_field: str, where: str) -> list[dict]:
    if text_field not in ds.column_names:
        raise UserError(where, f"has no column {text_field!r} (columns: {', '.join(ds.column_names)})",
                        "set text_field in the recipe")
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    out = []
    for text in ds[text_field]:
        if not text or not str(text).strip():
            continue
        ids = tokenizer(str(text), add_special_tokens=False)["input_ids"][: max_len - len(eos)] + eos
        if len(ids) > 1:
            # Labels are the inputs: the causal LM shifts them itself; padding gets -100 in the collator.
            out.append({"input_ids": ids, "labels": list(ids)})
    return out


def load_stage_data(stage: Stage, tokenizer, default_max_len: int, text_field: str, eval_samples: int,
                    seed: int, packing: bool = False) -> StageData:
    """Tokenize every source of a stage; hold out `eval_samples` drawn across its sources (fixed by the seed);
    with `packing`, the training documents of each source go whole into rows of the stage's length."""
    import numpy as np

    max_len = stage.max_seq_length or default_max_len
    sources = []
    for j, spec in enumerate(stage.data):
        where = f"stages[{stage.name}].data[{j}]"
        samples = _tokenize(load_source(spec, where), tokenizer, max_len, text_field, where)
        if not samples:
            raise UserError(where, f"{spec} has no non-empty text after tokenization", "check the file and text_field")
        sources.append(samples)
    held_out = []
    if eval_samples:
        rng = np.random.default_rng([seed, 7919])
        per_source = max(1, eval_samples // len(sources))
        for j, samples in enumerate(sources):
            take = min(per_source, len(samples) // 4)  # never hold out more than a quarter of a source
            idx = set(rng.permutation(len(samples))[:take].tolist())
            held_out += [s for i, s in enumerate(samples) if i in idx]
            sources[j] = [s for i, s in enumerate(samples) if i not in idx]
    if packing:  # held-out eval samples stay one per row
        from .packing import pack_documents

        # Without weights, samples are drawn in proportion to source sizes: the same as one pooled source, which packs
        # far tighter (short documents fill the rows of long ones). With weights, per source, so they still apply.
        pools = [[s for src in sources for s in src]] if stage.weights is None else sources
        sources = [pack_documents(s, max_len, tokenizer.pad_token_id) for s in pools]
    return StageData(sources, held_out)


def build_collator(tokenizer, packing: bool = False):
    """Pads input_ids with the pad token and labels with -100, so padding never counts in the loss; packed rows
    keep their position_ids and get no attention_mask (see hf_zero.packing)."""
    from transformers import DataCollatorForSeq2Seq

    collator = DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100, padding=True, return_tensors="pt")
    if packing:
        from .packing import PackedCollator

        return PackedCollator(collator, tokenizer.pad_token_id)
    return collator
