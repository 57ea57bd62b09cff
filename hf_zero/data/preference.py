"""Preference rows (a `dpo` stage): TRL's preference formats, tokenized as TRL's `DPOTrainer` tokenizes them.

A row is `prompt` + `chosen` + `rejected`, either three strings (the answers get EOS appended, as TRL does) or three
message lists (`prompt` the conversation so far, `chosen` / `rejected` the assistant's reply), rendered with the chat
template. The answer's tokens are where prompt+answer's tokens leave the prompt's own (TRL's `common_prefix_length`),
so a template or tokenizer that merges across the boundary trains the same tokens as TRL does.

A sample keeps the three id lists and `row`, its index in the stage (every source of the stage in order): the
reference log-probabilities are cached per row (hf_zero.train.preference), and a batch carries its rows to find them.
The collator (`PreferenceCollator`) is TRL's `DataCollatorForPreference`: every batch is the B chosen sequences, then
the B rejected ones, with a completion mask. A stage's rows are checked when read, each mistake one line naming the
row: a missing or empty answer, a prompt with no room left for an answer within max_seq_length.
"""

from __future__ import annotations

from hf_zero.core.errors import UserError
from hf_zero.data.chat import Row, SourceReport, validate_messages

__all__ = ["is_preference", "encode_preference_rows", "check_objective",
           "number_rows", "PreferenceCollator", "PREFERENCE_KEYS", "sample_views",
           "TRAINS", "reference_cache_bytes"]

PREFERENCE_KEYS = ("prompt_ids", "chosen_ids", "rejected_ids")
TRAINS = "chosen vs rejected"  # SourceReport.trains of a preference source


def is_preference(columns) -> bool:
    """A source of preference rows: it has a `chosen` column (TRL's preference and implicit-prompt forms)."""
    return "chosen" in columns


def _common_prefix(a: list, b: list) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _answer(value, name: str, conversational: bool, row: Row):
    if value is None:
        row.fail(f"no {name} answer", f"give every row a `{name}`, or remove the row")
    if conversational:
        msgs = validate_messages(value, row, name)
        if not any(m["role"] == "assistant" for m in msgs):
            row.fail(f"{name} has no assistant message", f"give `{name}` the assistant's reply")
        return msgs
    if not isinstance(value, str):
        row.fail("prompt, chosen and rejected must all be strings or all message lists")
    if not value.strip():
        row.fail(f"empty {name} answer", f"give the {name} answer, or remove the row")
    return value


def _encode(tokenizer, prompt, chosen, rejected, row: Row) -> tuple[list, list, list]:
    """(prompt_ids, chosen_ids, rejected_ids) as TRL's DPOTrainer tokenizes the row."""
    if isinstance(prompt, list):
        def ids(messages, **kw):
            try:
                out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kw)
                return list(out["input_ids"])
            except Exception as err:  # jinja's TemplateError, or raise_exception() inside the template
                row.fail(f"the chat template fails to render it ({type(err).__name__}: "
                         f"{str(err).splitlines()[0][:100]})", "fix the row, or set chat_template")

        p, pc, pr = ids(prompt, add_generation_prompt=True), ids(prompt + chosen), ids(prompt + rejected)
    else:
        eos = tokenizer.eos_token or ""
        chosen = chosen if chosen.endswith(eos) else chosen + eos
        rejected = rejected if rejected.endswith(eos) else rejected + eos
        p, pc, pr = (list(tokenizer(text=t)["input_ids"]) for t in (prompt, prompt + chosen, prompt + rejected))
    cut = min(_common_prefix(p, pc), _common_prefix(p, pr))
    return p[:cut], pc[cut:], pr[cut:]


def encode_preference_rows(ds, tokenizer, max_len: int, where: str, spec: str) -> tuple[list, SourceReport]:
    """The samples ({prompt_ids, chosen_ids, rejected_ids}) of a preference source and its report. An answer that
    runs past max_seq_length is cut at its end (TRL's `keep_start`), and counted."""
    columns = ds.column_names
    for need in ("prompt", "rejected"):
        if need not in columns:
            what = ("implicit prompts (the prompt inside chosen/rejected) are not read yet" if need == "prompt"
                    else "every row needs the answer to prefer less")
            raise UserError(where, f"{spec} has `chosen` but no column `{need}` ({what}; columns: "
                            f"{', '.join(columns)})", f"give each row a `{need}`")
    row = Row(where, spec)
    prompts, chosen, rejected = ds["prompt"], ds["chosen"], ds["rejected"]
    conversational = isinstance(prompts[0], list)
    report = SourceReport(spec, "conversational_preference" if conversational else "preference", TRAINS)
    samples = []
    for i in range(len(ds)):
        row.n = i + 1
        report.rows += 1
        if prompts[i] is None or (isinstance(prompts[i], str) and not prompts[i].strip()):
            row.fail("no prompt", "give every row a `prompt`")
        if conversational:
            prompt = validate_messages(prompts[i], row, "prompt")
        elif isinstance(prompts[i], str):
            prompt = prompts[i]
        else:
            row.fail("prompt, chosen and rejected must all be strings or all message lists")
        good = _answer(chosen[i], "chosen", conversational, row)
        bad = _answer(rejected[i], "rejected", conversational, row)
        p, c, r = _encode(tokenizer, prompt, good, bad, row)
        if len(p) >= max_len:
            row.fail(f"the prompt is {len(p)} tokens, max_seq_length is {max_len}: no room for the answers",
                     "shorten the prompt, or raise the stage's max_seq_length")
        if not c or not r:
            row.fail(f"the {'chosen' if not c else 'rejected'} answer adds no token to the prompt",
                     "give the answer text, or remove the row")
        room = max_len - len(p)
        report.truncated += len(c) > room or len(r) > room
        c, r = c[:room], r[:room]
        report.lengths.append(len(p) + max(len(c), len(r)))
        report.loss_tokens += len(c) + len(r)
        samples.append({"prompt_ids": p, "chosen_ids": c, "rejected_ids": r})
    return samples, report


def check_objective(stage, reports: list) -> None:
    """A `dpo` stage reads preference rows only, an `sft` stage none: said before any token is trained."""
    where = f"stages[{stage.name}].data"
    for r in reports:
        pref = r.trains == TRAINS
        if stage.objective == "dpo" and not pref:
            raise UserError(where, f"{r.spec} ({r.format}) has no prompt/chosen/rejected rows, and the stage's "
                            "objective is dpo", "give the stage preference rows, or objective: sft")
        if stage.objective != "dpo" and pref:
            raise UserError(where, f"{r.spec} holds preference rows (prompt/chosen/rejected)",
                            "set `objective: dpo` on the stage, or give it SFT data")


def number_rows(sources: list[list[dict]]) -> None:
    """Each sample's `row`: its index in the stage, source after source (what the reference cache is indexed by)."""
    n = 0
    for samples in sources:
        for s in samples:
            s["row"] = n
            n += 1


class PreferenceCollator:
    """Batches of preference samples through TRL's `DataCollatorForPreference` (input_ids, attention_mask,
    completion_mask: B chosen rows, then B rejected), plus `pref_row` (the rows' indices); any other batch goes to
    `fallback` (the SFT collator): a step's batches all come from one stage."""

    def __init__(self, fallback, pad_token_id: int):
        self.fallback, self.pad_token_id, self._trl = fallback, pad_token_id, None

    def __call__(self, features: list[dict]):
        if "chosen_ids" not in features[0]:
            return self.fallback(features)
        import torch

        if self._trl is None:
            from trl.trainer.dpo_trainer import DataCollatorForPreference

            self._trl = DataCollatorForPreference(pad_token_id=self.pad_token_id)
        batch = self._trl([{k: f[k] for k in PREFERENCE_KEYS} for f in features])
        batch["pref_row"] = torch.tensor([f["row"] for f in features], dtype=torch.long)
        return batch


def sample_views(sample: dict) -> list[tuple[str, dict]]:
    """(name, {input_ids, labels}) to show a sample as `hf-zero preview` shows one: an SFT sample as it is, a
    preference sample as its chosen and its rejected sequence, the answer carrying the loss."""
    if "chosen_ids" not in sample:
        return [("", sample)]
    p = sample["prompt_ids"]
    return [(f" {name}", {"input_ids": p + sample[f"{name}_ids"], "labels": [-100] * len(p) + sample[f"{name}_ids"]})
            for name in ("chosen", "rejected")]


def reference_cache_bytes(rows: int) -> int:
    """The size on disk of a dpo stage's reference cache (hf_zero.train.reference_cache) for `rows` rows: an fp32
    chosen and rejected log-probability each, plus the safetensors header and the fingerprints' JSON (about 256
    bytes together; tests/train/test_preference.py compares a written cache)."""
    return 8 * rows + 256
