"""Instruction and chat data in TRL's dataset formats, with labels that train only what the model should learn.

Formats, detected from the columns (or named by `dataset_format`, with the columns renamed by the `*_field` options):
- `text`: language modelling, every token trained (hf_zero.data.stages tokenizes it, as before);
- `prompt_completion`: `prompt` + `completion` strings; the sample is prompt + completion + EOS and, with
  `completion_only_loss`, only completion + EOS are trained;
- `conversational`: `messages` = [{role, content}, ...] (ShareGPT's `conversations` = [{from, value}] too), rendered
  with the chat template; with `assistant_only_loss`, only the assistant replies and the template's end-of-turn token
  are trained;
- `conversational_prompt_completion`: `prompt` and `completion` as message lists; the completion's part is trained.

Which tokens are trained: with `{% generation %}` markers in the template, the spans they mark (transformers'
`return_assistant_tokens_mask`, as TRL uses it). Otherwise a reply is what the template adds between the conversation
rendered up to it with the generation prompt and the conversation rendered through it, trailing whitespace aside;
every template used for inference renders prefixes that way, and one that does not is refused with the row. A token
is trained when its characters overlap a trained span. Labels are the token ids there and -100 elsewhere; the model
shifts them, so the first reply token is predicted from the prompt.

A sample longer than the stage's length is cut at its end; if no trained token is left it is dropped and counted.
Before tokenization, every text of a row is cut to CHARS_PER_TOKEN characters per token of the stage's length: no
tokenizer's tokens average that many characters, so the cut lies past the tokens the sample keeps and changes none
of them, while a single huge row (20 MB of JSON once took tokenization past 6 GB) costs no more than a long one.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from hf_zero.core.errors import UserError
from hf_zero.data.chat_template import has_generation_markers

__all__ = ["FORMATS", "FormatOptions", "SourceReport", "Encoded", "detect_format", "encode_rows", "ROLES",
           "CHARS_PER_TOKEN", "bounded", "Row", "validate_messages", "encode_conversation"]

FORMATS = ("auto", "text", "prompt_completion", "conversational")
ROLES = ("system", "user", "assistant", "tool", "developer")
IGNORE = -100
CHARS_PER_TOKEN = 64  # a row's texts are cut to this many characters per token of max_seq_length
_SHAREGPT = {"human": "user", "gpt": "assistant", "system": "system", "user": "user", "assistant": "assistant",
             "tool": "tool"}


@dataclass(frozen=True)
class FormatOptions:
    dataset_format: str = "auto"
    text_field: str = "text"
    prompt_field: str = "prompt"
    completion_field: str = "completion"
    messages_field: str = "messages"
    assistant_only_loss: bool = True
    completion_only_loss: bool = True
    chat_template: str | None = None

    @classmethod
    def from_args(cls, data_args) -> "FormatOptions":
        return cls(**{f.name: getattr(data_args, f.name) for f in fields(cls) if hasattr(data_args, f.name)})


@dataclass
class SourceReport:
    """What tokenization made of one data source (for `hf-zero preview`, `check` and the mixing rule)."""

    spec: str
    format: str
    trains: str  # "all tokens" or "answers only"
    rows: int = 0
    empty: int = 0  # rows without text, skipped
    truncated: int = 0  # cut to the stage's length and kept
    dropped: int = 0  # cut before any trained token: not trained at all
    lengths: list = field(default_factory=list)
    loss_tokens: int = 0

    @property
    def tokens(self) -> int:
        return sum(self.lengths)


@dataclass
class Encoded:
    ids: list
    mask: list  # True where the token is trained
    prompt: str | None = None  # the rendered prompt a generation starts from
    question: str | None = None  # the same, as a person would read it
    reference: str | None = None  # the expected answer


def detect_format(columns: list[str], first_row: dict | None, opts: FormatOptions, where: str, spec: str) -> str:
    """One of text / prompt_completion / conversational_prompt_completion / conversational."""
    cols = set(columns)
    has = {
        "conversational": (opts.messages_field in cols
                           or (opts.messages_field == "messages" and "conversations" in cols)),
        "prompt_completion": {opts.prompt_field, opts.completion_field} <= cols,
        "text": opts.text_field in cols,
    }
    if opts.dataset_format not in FORMATS:
        raise UserError("dataset_format", f"unknown format {opts.dataset_format!r}",
                        f"use one of {', '.join(FORMATS)}")
    if opts.dataset_format != "auto":
        fmt = opts.dataset_format
        if not has[fmt]:
            need = {"text": opts.text_field, "conversational": opts.messages_field,
                    "prompt_completion": f"{opts.prompt_field} and {opts.completion_field}"}[fmt]
            raise UserError(where, f"{spec} has no column {need!r} for dataset_format {fmt} (columns: "
                            f"{', '.join(columns)})", "set the *_field option that names it, or dataset_format: auto")
    else:
        fmt = next((f for f in ("conversational", "prompt_completion", "text") if has[f]), None)
        if fmt is None:
            hint = " (a prompt without a completion is not training data)" if opts.prompt_field in cols else ""
            raise UserError(where, f"{spec} has no column {opts.text_field!r}, no {opts.prompt_field}+"
                            f"{opts.completion_field} and no {opts.messages_field}{hint} "
                            f"(columns: {', '.join(columns)})",
                            "set text_field / prompt_field / completion_field / messages_field to its columns")
    if fmt == "prompt_completion" and first_row is not None and isinstance(first_row.get(opts.prompt_field), list):
        fmt = "conversational_prompt_completion"
    return fmt


def trains_what(fmt: str, opts: FormatOptions) -> str:
    answers = (fmt.startswith("conversational") and fmt != "conversational_prompt_completion"
               and opts.assistant_only_loss
               or fmt.endswith("prompt_completion") and opts.completion_only_loss)
    return "answers only" if answers else "all tokens"


def bounded(value, max_len: int):
    """`value` (a text, or a list of messages) with every text cut to CHARS_PER_TOKEN * max_len characters; other
    values as they are (the row checks refuse them)."""
    limit = CHARS_PER_TOKEN * max_len
    if isinstance(value, str):
        return value[:limit]
    if isinstance(value, list):
        return [{k: bounded(v, max_len) if isinstance(v, str) else v for k, v in m.items()} if isinstance(m, dict)
                else m for m in value]
    return value


class Row:
    """Raises the one-line error for a row of a source: the file and the row (1-based) are named."""

    def __init__(self, where: str, spec: str):
        self.where, self.spec, self.n = where, spec, 0

    def fail(self, problem: str, fix: str = "fix or remove the row"):
        raise UserError(self.where, f"{self.spec} row {self.n}: {problem}", fix)


def validate_messages(value, row: Row, name: str, sharegpt: bool = False) -> list[dict]:
    if not isinstance(value, list) or not value:
        row.fail(f"{name} must be a non-empty list of {{role, content}} messages")
    out = []
    for j, msg in enumerate(value):
        if not isinstance(msg, dict):
            row.fail(f"{name}[{j}] is not a {{role, content}} mapping")
        if sharegpt:
            msg = {"role": _SHAREGPT.get(msg.get("from"), msg.get("from")), "content": msg.get("value")}
        role, content = msg.get("role"), msg.get("content")
        if not role:
            row.fail(f"{name}[{j}] has no 'role'", "give every message a role (system, user, assistant)")
        if role not in ROLES:
            row.fail(f"{name}[{j}] has unknown role {role!r}", f"use one of {', '.join(ROLES)}")
        if not isinstance(content, str):
            row.fail(f"{name}[{j}] has no text 'content'", "give every message a string content")
        if role == "assistant" and not content.strip():
            row.fail(f"{name}[{j}] is an empty assistant reply", "remove the row or give the reply")
        out.append({k: v for k, v in msg.items() if v is not None})
    return out


def _render(tokenizer, messages: list[dict], row: Row, add_generation_prompt: bool = False) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as err:  # jinja's TemplateError, or raise_exception() inside the template
        row.fail(f"the chat template fails to render it ({type(err).__name__}: {str(err).splitlines()[0][:100]})",
                 "fix the row, or set chat_template to a template that accepts it")


def _overlap_mask(tokenizer, text: str, spans: list[tuple[int, int]]) -> tuple[list, list]:
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [any(a < e and s < b for s, e in spans) for a, b in enc["offset_mapping"]]
    return list(enc["input_ids"]), mask


def _last_user(messages: list[dict]) -> str:
    return next((m["content"] for m in reversed(messages) if m["role"] == "user"), messages[-1]["content"])


def encode_conversation(tokenizer, msgs: list[dict], opts: FormatOptions, row: Row) -> Encoded:
    replies = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    if not replies:
        row.fail("has no assistant message: nothing to learn", "add the assistant's reply")
    if replies[0] == 0:
        row.fail("starts with an assistant message", "put the user (or system) message first")
    text = _render(tokenizer, msgs, row)
    last = replies[-1]
    prompt = _render(tokenizer, msgs[:last], row, add_generation_prompt=True)
    result = Encoded([], [], prompt, _last_user(msgs[:last]), msgs[last]["content"])
    if not opts.assistant_only_loss:
        result.ids, result.mask = _overlap_mask(tokenizer, text, [(0, len(text))])
        return result
    if has_generation_markers(tokenizer.chat_template):
        out = tokenizer.apply_chat_template(msgs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        result.ids, result.mask = list(out["input_ids"]), [bool(m) for m in out["assistant_masks"]]
        if not any(result.mask):
            row.fail("the template's {% generation %} markers leave no assistant token", "check chat_template")
        return result
    spans = []
    for i in replies:
        before = prompt if i == last else _render(tokenizer, msgs[:i], row, add_generation_prompt=True)
        through = text if i == len(msgs) - 1 else _render(tokenizer, msgs[:i + 1], row)
        if not (through.startswith(before) and text.startswith(through)):
            row.fail("the chat template does not render this conversation turn by turn, so its replies cannot be "
                     "located", "use a chat_template with {% generation %} markers, or assistant_only_loss: false")
        spans.append((len(before), len(through.rstrip())))
    result.ids, result.mask = _overlap_mask(tokenizer, text, spans)
    return result


def _encode_prompt_completion(tokenizer, prompt, completion, opts: FormatOptions, row: Row, fmt: str) -> Encoded:
    if fmt == "conversational_prompt_completion":
        p = validate_messages(prompt, row, opts.prompt_field)
        c = validate_messages(completion, row, opts.completion_field)
        text, before = _render(tokenizer, p + c, row), _render(tokenizer, p, row, add_generation_prompt=True)
        if not text.startswith(before):
            row.fail("the chat template renders the prompt differently alone than before its completion",
                     "use a chat_template that renders prefixes consistently")
        start = len(before) if opts.completion_only_loss else 0
        ids, mask = _overlap_mask(tokenizer, text, [(start, len(text.rstrip()))])
        return Encoded(ids, mask, before, _last_user(p), c[-1]["content"])
    if not isinstance(prompt, str) or not isinstance(completion, str):
        row.fail(f"{opts.prompt_field} and {opts.completion_field} must both be strings or both message lists")
    if not completion.strip():
        row.fail(f"empty {opts.completion_field}", "give the completion, or remove the row")
    text = prompt + completion
    ids, mask = _overlap_mask(tokenizer, text, [(len(prompt) if opts.completion_only_loss else 0, len(text))])
    if tokenizer.eos_token_id is not None:  # TRL appends EOS to the completion: the model learns to stop
        ids, mask = ids + [tokenizer.eos_token_id], mask + [True]
    return Encoded(ids, mask, prompt, prompt, completion.strip())


def encode_rows(ds, tokenizer, fmt: str, opts: FormatOptions, max_len: int, where: str, spec: str):
    """Tokenized samples ({input_ids, labels} + `_gen` for generation) of a non-text source, and its report."""
    row = Row(where, spec)
    report = SourceReport(spec, fmt, trains_what(fmt, opts))
    if fmt == "conversational":
        sharegpt = opts.messages_field not in ds.column_names
        column = ds["conversations" if sharegpt else opts.messages_field]

        def encode(i: int) -> Encoded:
            messages = validate_messages(bounded(column[i], max_len), row, opts.messages_field, sharegpt)
            return encode_conversation(tokenizer, messages, opts, row)
    else:
        prompts, completions = ds[opts.prompt_field], ds[opts.completion_field]

        def encode(i: int) -> Encoded:
            return _encode_prompt_completion(tokenizer, bounded(prompts[i], max_len), bounded(completions[i], max_len),
                                             opts, row, fmt)
    samples = []
    for i in range(len(ds)):
        row.n = i + 1
        report.rows += 1
        enc = encode(i)
        ids, mask = enc.ids, enc.mask
        if len(ids) > max_len:
            report.truncated += 1
            ids, mask = ids[:max_len], mask[:max_len]
            if not any(mask):  # cut before its answer: training it would teach the prompt alone
                report.dropped += 1
                continue
        labels = [t if m else IGNORE for t, m in zip(ids, mask)]
        report.lengths.append(len(ids))
        report.loss_tokens += sum(mask)
        samples.append({"input_ids": ids, "labels": labels,
                        "_gen": {"prompt": enc.prompt, "question": enc.question, "reference": enc.reference}})
    return samples, report
