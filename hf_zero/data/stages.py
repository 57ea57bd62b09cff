"""Stage data: local files (jsonl/json/csv/parquet/txt), hf_zero's built-in data, or hub datasets when online;
tokenized per stage with the stage's own sequence length, a held-out slice per stage for evaluation."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from hf_zero.core import startup
from hf_zero.core.config import Stage
from hf_zero.core.errors import UserError
from hf_zero.data.builtin import resolve_data_path
from hf_zero.data.chat import CHARS_PER_TOKEN, FormatOptions, SourceReport, detect_format, encode_rows
from hf_zero.data.chat_template import prepare_chat_template
from hf_zero.data.packing import PackedCollator, pack_stage_sources
from hf_zero.data.preference import (
    PreferenceCollator,
    check_objective,
    encode_preference_rows,
    is_preference,
    number_rows,
)
from hf_zero.data.sources import load_source, verify_data_file

__all__ = ["StageData", "held_out_sizes", "check_held_out", "hold_out",
           "check_stage_files", "load_stage_data", "build_collator"]

@dataclass
class StageData:
    sources: list[list[dict]]  # per source: tokenized training samples
    eval_samples: list[dict]  # held-out samples of the stage (may be empty)
    reports: list = field(default_factory=list)  # per source: hf_zero.data.chat.SourceReport
    eval_prompts: list[dict] = field(default_factory=list)  # held-out {prompt, question, reference} to generate from

    @property
    def pool_size(self) -> int:
        return sum(len(s) for s in self.sources)


def _tokenize(ds, tokenizer, max_len: int, text_field: str, where: str, spec: str = ""):
    if text_field not in ds.column_names:
        raise UserError(where, f"has no column {text_field!r} (columns: {', '.join(ds.column_names)})",
                        "set text_field in the recipe")
    _check_text_column(ds, text_field, where, spec)
    report = SourceReport(spec, "text", "all tokens")
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    out = []
    for ids in _token_ids(ds[text_field], tokenizer, report, CHARS_PER_TOKEN * max_len):
        report.truncated += len(ids) > max_len - len(eos)
        ids = ids[: max_len - len(eos)] + eos
        if len(ids) > 1:
            # Labels are the inputs: the causal LM shifts them itself; padding gets -100 in the collator.
            out.append({"input_ids": ids, "labels": list(ids)})
            report.lengths.append(len(ids))
            report.loss_tokens += len(ids) - 1
    return out, report


def _check_text_column(ds, text_field: str, where: str, spec: str) -> None:
    """A text column of numbers or lists (an int parquet column, `"text": 3` in every row) is refused with its first
    row: its str() is not what anyone meant to train on. The column's type says it for every row at once."""
    feature = ds.features.get(text_field)
    if getattr(feature, "dtype", None) in ("string", "large_string", "null"):
        return
    row, value = next(((i, v) for i, v in enumerate(ds[text_field]) if v is not None), (0, None))
    kind = getattr(feature, "dtype", None) or type(value).__name__
    raise UserError(where, f"{spec} row {row + 1}: {text_field} is {kind} ({str(value)[:40]}), not text",
                    f"give {text_field} as a string in every row")


def _token_ids(column, tokenizer, report, limit: int, batch: int = 1024):
    """The non-empty texts' token ids, a batch of rows at a time: one tokenizer call per batch gives the same ids as
    one call per row without its per-call overhead, and a slice of the column is decoded at once (iterating it
    decodes one row per call). Each text is cut to `limit` characters first (hf_zero.data.chat.CHARS_PER_TOKEN)."""
    for start in range(0, len(column), batch):
        texts = column[start:start + batch]
        kept = [str(t)[:limit] for t in texts if t and str(t).strip()]
        report.rows, report.empty = report.rows + len(texts), report.empty + len(texts) - len(kept)
        if kept:
            yield from tokenizer(kept, add_special_tokens=False, return_attention_mask=False)["input_ids"]


def _load_tokenized(spec: str, where: str, tokenizer, max_len: int, opts):
    """One source as training samples, whatever its format (hf_zero.data.chat), and its report."""
    ds = load_source(spec, where)
    if is_preference(ds.column_names):  # prompt/chosen/rejected: hf_zero.data.preference
        if len(ds) and isinstance(ds[0].get("prompt"), list):
            prepare_chat_template(tokenizer, opts.chat_template)
        return encode_preference_rows(ds, tokenizer, max_len, where, spec)
    fmt = detect_format(ds.column_names, ds[0] if len(ds) else None, opts, where, spec)
    if fmt != "text" or opts.chat_template:
        prepare_chat_template(tokenizer, opts.chat_template)
    if fmt == "text":
        samples, report = _tokenize(ds, tokenizer, max_len, opts.text_field, where, spec)
    else:
        samples, report = encode_rows(ds, tokenizer, fmt, opts, max_len, where, spec)
    if not samples:
        what = "answer left within max_seq_length" if report.dropped else "non-empty text after tokenization"
        raise UserError(where, f"{spec} has no {what}", "check the file, its columns and max_seq_length")
    return samples, report


def _check_mix(stage: Stage, reports: list) -> None:
    """Sources of one stage are drawn into the same batches: they must agree on which tokens carry the loss."""
    kinds = {r.trains for r in reports}
    if len(kinds) > 1:
        a = next(r for r in reports if r.trains == "all tokens")
        b = next(r for r in reports if r.trains != "all tokens")
        raise UserError(f"stages[{stage.name}].data", f"mixes {a.spec} ({a.format}: loss on all tokens) with {b.spec} "
                        f"({b.format}: loss on answers only)", "put them in separate stages, or set "
                        "assistant_only_loss / completion_only_loss: false to train every token")


def _split_gen(samples: list[dict]) -> list[dict]:
    """Generation prompts of samples, which lose that key (the collator takes token lists only)."""
    prompts = [s.pop("_gen") for s in samples if "_gen" in s]
    return [p for p in prompts if p.get("prompt") is not None]


def held_out_sizes(sizes: list[int], eval_samples: int) -> list[int]:
    """Samples held out of each source: eval_samples shared across them, never more than a quarter of one."""
    per_source = max(1, eval_samples // len(sizes))
    return [min(per_source, n // 4) for n in sizes]



def hold_out(stage, sources: list[list], eval_samples: int, seed: int) -> list:
    """`eval_samples` rows drawn at random (seeded) from a stage's sources, spread over them as held_out_sizes says,
    and taken out of `sources` (in place): the held-out slice of a stage with no eval_data."""
    import numpy as np

    check_held_out(stage, [len(s) for s in sources], eval_samples, "sample")
    rng = np.random.default_rng([seed, 7919])
    held_out = []
    for j, (samples, take) in enumerate(zip(sources, held_out_sizes([len(s) for s in sources], eval_samples))):
        idx = set(rng.permutation(len(samples))[:take].tolist())
        held_out += [s for i, s in enumerate(samples) if i in idx]
        sources[j] = [s for i, s in enumerate(samples) if i not in idx]
    return held_out

def check_held_out(stage: Stage, sizes: list[int], eval_samples: int, unit: str = "row") -> None:
    """A stage without eval_data whose sources are too small to hold any sample out has no eval loss, and would
    silently leave the runs' before/after eval mean: refused (the preflight counts rows, the run samples)."""
    if eval_samples and not stage.eval_data and not any(held_out_sizes(sizes, eval_samples)):
        raise UserError(f"stages[{stage.name}].data", f"{'+'.join(map(str, sizes))} {unit}(s): too few to hold any "
                        "out for evaluation (at most a quarter of a source is held out)",
                        "give the stage 4 or more rows, or its own eval_data, or set eval_samples: 0")


def check_stage_files(stage: Stage, eval_samples: int, light: bool = False) -> list[int]:
    """Every file of a stage read and parsed as load_stage_data reads it (not tokenized), and its held-out slice sized
    by rows: `hf-zero check`'s data check, and each rank's before anything is written. Rows per source. `light` (the
    launcher, before the ranks): JSON-lines files parsed and counted without datasets, which the ranks load anyway."""
    rows = [_source_rows(spec, f"stages[{stage.name}].data[{j}]", light) for j, spec in enumerate(stage.data)]
    for j, spec in enumerate(stage.eval_data or []):
        _source_rows(spec, f"stages[{stage.name}].eval_data[{j}]", light)
    check_held_out(stage, rows, eval_samples)
    return rows


def _source_rows(spec: str, where: str, light: bool) -> int:
    local = Path(resolve_data_path(spec) if spec.startswith("builtin:") else spec)
    if light and local.suffix == ".jsonl" and local.is_file():
        verify_data_file(local, spec, where)  # every line an object: a row each, as datasets' JSON reader reads it
        return sum(1 for line in local.read_text(encoding="utf-8").splitlines() if line.strip())
    return len(load_source(spec, where))


def load_stage_data(stage: Stage, tokenizer, default_max_len: int, text_field: str, eval_samples: int,
                    seed: int, packing: bool = False, formats=None) -> StageData:
    """Tokenize every source of a stage; hold out `eval_samples` drawn across its sources (fixed by the seed), or
    take them from the stage's `eval_data`; with `packing`, the training documents of each source go whole into rows
    of the stage's length. `formats` (hf_zero.data.chat.FormatOptions) says how to read chat and prompt data."""
    startup.phase(f"reading and tokenizing stage {stage.name}")
    opts = formats or FormatOptions(text_field=text_field)
    max_len = stage.max_seq_length or default_max_len
    sources, reports = [], []
    for j, spec in enumerate(stage.data):
        samples, report = _load_tokenized(spec, f"stages[{stage.name}].data[{j}]", tokenizer, max_len, opts)
        sources.append(samples)
        reports.append(report)
    check_objective(stage, reports)
    if stage.objective == "dpo":  # held-out pairs as any stage's held-out slice; no packing (docs/preference.md)
        return _preference_data(stage, sources, reports, tokenizer, max_len, opts, eval_samples, seed)
    _check_mix(stage, reports)
    held_out = []
    if stage.eval_data:
        for j, spec in enumerate(stage.eval_data):
            held_out += _load_tokenized(spec, f"stages[{stage.name}].eval_data[{j}]", tokenizer, max_len, opts)[0]
        held_out = held_out[:eval_samples] if eval_samples else []
    elif eval_samples:
        held_out = hold_out(stage, sources, eval_samples, seed)
    eval_prompts = _split_gen(held_out)
    for samples in sources:
        _split_gen(samples)
    if packing:  # held-out eval samples stay one per row
        sources = pack_stage_sources(sources, stage.weights is not None, max_len, tokenizer.pad_token_id)
    return StageData(sources, held_out, reports, eval_prompts)


def _preference_data(stage: Stage, sources: list, reports: list, tokenizer, max_len: int, opts, eval_samples: int,
                     seed: int) -> StageData:
    """A dpo stage's rows: its held-out pairs from its eval_data (preference rows) or drawn from its sources as any
    stage's, numbered after the training rows (hf_zero.train.preference measures their reward accuracy)."""
    held_out = []
    if stage.eval_data:
        for j, spec in enumerate(stage.eval_data):
            samples, report = _load_tokenized(spec, f"stages[{stage.name}].eval_data[{j}]", tokenizer, max_len, opts)
            check_objective(stage, [report])
            held_out += samples
        held_out = held_out[:eval_samples] if eval_samples else []
    elif eval_samples:
        held_out = hold_out(stage, sources, eval_samples, seed)
    number_rows([*sources, held_out])
    return StageData(sources, held_out, reports, [])


def build_collator(tokenizer, packing: bool = False, model=None, preference: bool = False):
    """Pads input_ids with the pad token and labels with -100, so padding never counts in the loss; packed rows
    keep their position_ids and get no attention_mask, and for a model using flash attention they are flattened
    into one row of documents for its varlen path (see hf_zero.data.packing). `preference` (a curriculum with a dpo
    stage): batches of preference rows go through hf_zero.data.preference.PreferenceCollator."""
    from transformers import DataCollatorForSeq2Seq

    collator = DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100, padding=True, return_tensors="pt")
    if packing:
        from transformers.utils.generic import is_flash_attention_requested

        varlen = model is not None and is_flash_attention_requested(config=model.config)
        collator = PackedCollator(collator, tokenizer.pad_token_id, varlen=varlen)
    return PreferenceCollator(collator, tokenizer.pad_token_id) if preference else collator
