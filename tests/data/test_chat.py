"""Instruction and chat data (hf_zero.data.chat): TRL's formats, the chat template, and labels that train only the
answer.

Each format, packed and unpacked, against masks computed by hand from the pieces of the sample; packed rows give every
answer token the same loss as its sample alone (nothing crosses a document boundary); a sample cut before its answer
is dropped and counted; bad rows are one line naming the file and the row.
"""

import json

import pytest
import torch

from hf_zero.core.config import Stage
from hf_zero.core.errors import UserError
from hf_zero.data.chat import FormatOptions
from hf_zero.data.chat_template import CHATML_TEMPLATE, end_of_turn_ids, prepare_chat_template
from hf_zero.data.packing import IGNORE, PackedCollator
from hf_zero.data.stages import load_stage_data

Q1, A1 = "What is the capital of France?", "Paris is."
Q2, A2 = "And of Spain?", "Madrid, I think."


def _tok():
    from hf_zero.data.model_names import get_tokenizer

    return get_tokenizer("tiny-llama")


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def load(path, tok=None, max_len=128, packing=False, **opts):
    tok = tok or _tok()
    stage = Stage(name="s", data=[str(path)], steps=1)
    return load_stage_data(stage, tok, max_len, "text", 0, 0, packing=packing, formats=FormatOptions(**opts)), tok


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def _chatml_by_hand(tok, turns):
    """ChatML token by token: role headers and user turns untrained; assistant content + <|im_end|> trained; the
    newline after each turn untrained. Pieces between special tokens are tokenized alone (special tokens split)."""
    start, end = tok.convert_tokens_to_ids("<|im_start|>"), tok.convert_tokens_to_ids("<|im_end|>")
    ids, labels = [], []
    for role, content in turns:
        head = [start] + _ids(tok, f"{role}\n")
        body = _ids(tok, content) + [end]
        newline = _ids(tok, "\n")
        ids += head + body + newline
        labels += ([IGNORE] * len(head) + (body if role == "assistant" else [IGNORE] * len(body))
                   + [IGNORE] * len(newline))
    return ids, labels


ROWS = {
    "text": {"text": "The big hen is red."},
    "prompt_completion": {"prompt": "Q: two and two? A:", "completion": " four."},
    "conversational": {"messages": [{"role": "user", "content": Q1}, {"role": "assistant", "content": A1},
                                    {"role": "user", "content": Q2}, {"role": "assistant", "content": A2}]},
    "conversational_prompt_completion": {"prompt": [{"role": "user", "content": Q1}],
                                         "completion": [{"role": "assistant", "content": A1}]},
}


def expected(fmt, tok):
    row = ROWS[fmt]
    if fmt == "text":
        ids = _ids(tok, row["text"]) + [tok.eos_token_id]
        return ids, list(ids)
    if fmt == "prompt_completion":
        p, c = _ids(tok, row["prompt"]), _ids(tok, row["completion"]) + [tok.eos_token_id]
        return p + c, [IGNORE] * len(p) + c
    if fmt == "conversational":
        return _chatml_by_hand(tok, [("user", Q1), ("assistant", A1), ("user", Q2), ("assistant", A2)])
    return _chatml_by_hand(tok, [("user", Q1), ("assistant", A1)])


@pytest.mark.parametrize("packing", [False, True], ids=["unpacked", "packed"])
@pytest.mark.parametrize("fmt", list(ROWS))
def test_labels_equal_hand_computed_masks(tmp_path, fmt, packing):
    path = write_jsonl(tmp_path / "d.jsonl", [ROWS[fmt]] * 3)
    data, tok = load(path, packing=packing, max_len=96)
    assert data.reports[0].format == fmt
    ids, labels = expected(fmt, tok)
    assert tok.decode(ids) != "" and any(x != IGNORE for x in labels)
    if not packing:
        assert all(s["input_ids"] == ids and s["labels"] == labels for s in data.sources[0])
        return
    rows = data.sources[0]
    docs = 0
    for row in rows:
        pos, used = row["position_ids"], row["real_tokens"]
        starts = [i for i in range(used) if pos[i] == 0] + [used]
        for a, b in zip(starts, starts[1:]):
            assert row["input_ids"][a:b] == ids
            # a document's first label is never a target; after that, exactly the hand-computed mask
            assert row["labels"][a:b] == [IGNORE] + labels[1:]
            docs += 1
        assert row["labels"][used:] == [IGNORE] * (len(row["labels"]) - used)
    assert docs == 3


def test_template_text_and_default(tmp_path):
    tok = _tok()
    assert tok.chat_template is None  # the tiny tokenizer has none: hf_zero's ChatML applies
    assert prepare_chat_template(tok) == ["<|im_start|>", "<|im_end|>"]
    assert tok.chat_template == CHATML_TEMPLATE and len(tok) == 514
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert end_of_turn_ids(tok) == [tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")]


def test_packed_answers_see_only_their_own_document(tmp_path):
    """The per-token losses of the answers in a packed row equal those of each conversation run alone."""
    from transformers import AutoModelForCausalLM

    from hf_zero.data.model_names import get_tiny_llama_path

    rows = [{"messages": [{"role": "user", "content": f"Question number {i} is {'long ' * i}?"},
                          {"role": "assistant", "content": f"Answer {i}."}]} for i in range(6)]
    data, tok = load(write_jsonl(tmp_path / "c.jsonl", rows), packing=True, max_len=128)
    unpacked, _ = load(write_jsonl(tmp_path / "c.jsonl", rows), max_len=128)
    model = AutoModelForCausalLM.from_pretrained(get_tiny_llama_path())
    model.resize_token_embeddings(len(tok))
    model.eval()
    batch = PackedCollator(None, tok.pad_token_id)(data.sources[0])
    assert len(data.sources[0]) < len(rows)

    def per_token(logits, labels):
        return torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), labels[:, 1:], ignore_index=IGNORE,
                                                 reduction="none")

    with torch.no_grad():
        packed = per_token(model(**batch).logits, batch["labels"])
        got = sorted(packed[batch["labels"][:, 1:] != IGNORE].tolist())
        want = []
        for s in unpacked.sources[0]:
            labels = torch.tensor([s["labels"]])
            alone = per_token(model(input_ids=torch.tensor([s["input_ids"]])).logits, labels)
            want += alone[labels[:, 1:] != IGNORE].tolist()
    assert len(got) == len(want) == sum(sum(x != IGNORE for x in s["labels"]) for s in unpacked.sources[0])
    torch.testing.assert_close(torch.tensor(got), torch.tensor(sorted(want)), atol=1e-5, rtol=0)


def test_truncated_before_the_answer_is_dropped_and_counted(tmp_path):
    long_q = "word " * 60
    rows = [{"prompt": long_q, "completion": " yes."},  # cut inside the prompt: dropped
            {"prompt": "Short?", "completion": " " + "no " * 40},  # cut inside the answer: kept, counted
            {"prompt": "Short?", "completion": " yes."}]
    data, tok = load(write_jsonl(tmp_path / "t.jsonl", rows), max_len=32)
    r = data.reports[0]
    assert (r.rows, r.truncated, r.dropped, len(data.sources[0])) == (3, 2, 1, 2)
    kept = data.sources[0][0]
    assert len(kept["input_ids"]) == 32 and kept["labels"][-1] != IGNORE
    assert all(len(s["input_ids"]) <= 32 for s in data.sources[0])


class _Spy:
    """The tokenizer, recording the longest text it is given (20 MB in one row took tokenization past 6 GB)."""

    def __init__(self, tok):
        self.tok, self.longest = tok, 0

    def __call__(self, text, *args, **kwargs):
        self.longest = max([self.longest] + [len(t) for t in ([text] if isinstance(text, str) else text)])
        return self.tok(text, *args, **kwargs)

    def apply_chat_template(self, messages, *args, **kwargs):
        self.longest = max([self.longest] + [len(m["content"]) for m in messages])
        return self.tok.apply_chat_template(messages, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tok, name)


@pytest.mark.parametrize("fmt", ["text", "prompt_completion", "conversational"])
def test_a_huge_row_is_cut_before_the_tokenizer_and_keeps_the_same_tokens(tmp_path, fmt):
    from hf_zero.data.chat import CHARS_PER_TOKEN

    max_len, huge = 32, "lorem ipsum dolor sit amet " * 2_000  # 54,000 characters in one row
    row = {"text": {"text": huge}, "prompt_completion": {"prompt": "Q?", "completion": " " + huge},
           "conversational": {"messages": [{"role": "user", "content": "Q?"},
                                           {"role": "assistant", "content": huge}]}}[fmt]
    tok = _tok()
    if fmt == "conversational":
        prepare_chat_template(tok)  # before the spy: the stage finds it done
    spy = _Spy(tok)
    data, _ = load(write_jsonl(tmp_path / "big.jsonl", [row, row]), tok=spy, max_len=max_len)
    assert 0 < spy.longest <= CHARS_PER_TOKEN * max_len + 200  # the cut text and the template around it
    assert data.reports[0].truncated == 2
    # the tokens kept are those of the whole row, cut at max_seq_length
    if fmt == "text":
        whole = tok(huge, add_special_tokens=False)["input_ids"][:max_len - 1] + [tok.eos_token_id]
    elif fmt == "prompt_completion":
        whole = tok("Q? " + huge, add_special_tokens=False)["input_ids"][:max_len]
    else:
        whole = tok(tok.apply_chat_template(row["messages"], tokenize=False), add_special_tokens=False)["input_ids"]
        whole = whole[:max_len]
    assert data.sources[0][0]["input_ids"] == whole


def test_columns_named_differently(tmp_path):
    path = write_jsonl(tmp_path / "alpaca.jsonl", [{"instruction": "Say hi.", "output": " hi"}] * 2)
    data, tok = load(path, prompt_field="instruction", completion_field="output")
    assert data.reports[0].format == "prompt_completion"
    assert data.sources[0][0]["labels"][: len(_ids(tok, "Say hi."))] == [IGNORE] * len(_ids(tok, "Say hi."))
    sharegpt = write_jsonl(tmp_path / "sg.jsonl", [{"conversations": [{"from": "human", "value": Q1},
                                                                      {"from": "gpt", "value": A1}]}])
    data, tok = load(sharegpt)
    assert data.sources[0][0]["input_ids"] == expected("conversational_prompt_completion", tok)[0]


def test_loss_on_every_token_when_switched_off(tmp_path):
    data, _ = load(write_jsonl(tmp_path / "c.jsonl", [ROWS["conversational"]]), assistant_only_loss=False)
    s = data.sources[0][0]
    assert s["labels"] == s["input_ids"] and data.reports[0].trains == "all tokens"


def test_a_template_without_generation_markers_masks_the_same(tmp_path):
    """SmolLM2-style templates have no {% generation %}: the replies are found turn by turn, with the same result."""
    plain = tmp_path / "plain.jinja"
    plain.write_text(CHATML_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", ""))
    path = write_jsonl(tmp_path / "c.jsonl", [ROWS["conversational"]])
    marked, tok = load(path)
    unmarked, _ = load(path, chat_template=str(plain))
    assert unmarked.sources[0] == marked.sources[0]


def test_mixed_sources_must_train_the_same_tokens(tmp_path):
    text = write_jsonl(tmp_path / "plain.jsonl", [ROWS["text"]])
    chat = write_jsonl(tmp_path / "chat.jsonl", [ROWS["conversational"]])
    stage = Stage(name="mix", data=[text, chat], steps=1)
    with pytest.raises(UserError, match=r"stages\[mix\]\.data: mixes .*plain.jsonl \(text: loss on all tokens\) "
                                        r"with .*chat.jsonl \(conversational: loss on answers only\)"):
        load_stage_data(stage, _tok(), 64, "text", 0, 0, formats=FormatOptions())
    both = load_stage_data(stage, _tok(), 64, "text", 0, 0, formats=FormatOptions(assistant_only_loss=False))
    assert [r.trains for r in both.reports] == ["all tokens"] * 2


BAD_ROWS = [
    ({"messages": [{"content": "hi"}, {"role": "assistant", "content": "yo"}]}, "messages[0] has no 'role'"),
    ({"messages": [{"role": "wizard", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
     "messages[0] has unknown role 'wizard'"),
    ({"prompt": "Say hi.", "completion": "  "}, "empty completion"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "has no assistant message"),
    ({"messages": [{"role": "system", "content": "x"}, {"role": "user", "content": "hi"},
                   {"role": "assistant", "content": "yo"}]}, "the chat template fails to render it"),
]


@pytest.mark.parametrize("bad,words", BAD_ROWS, ids=[w.split()[-1] for _, w in BAD_ROWS])
def test_bad_row_names_file_and_row(tmp_path, bad, words):
    good = ROWS["prompt_completion"] if "prompt" in bad else ROWS["conversational"]
    path = write_jsonl(tmp_path / "bad.jsonl", [good, good, bad])
    template = tmp_path / "no_system.jinja"
    template.write_text("{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
                        + CHATML_TEMPLATE)
    with pytest.raises(UserError) as err:
        load(path, chat_template=str(template))
    line = err.value.line()
    assert line.startswith(f"stages[s].data[0]: {path} row 3: ") and words in line, line
    assert "\n" not in line


@pytest.mark.parametrize("answer,reference,exact,contained", [
    ("Hamlet", "Hamlet", True, True),
    ("hamlet.", "Hamlet", True, True),
    ('"The Tempest"', "The Tempest", True, True),
    ('This is from "The Merchant of Venice" by', "The Merchant of Venice", False, True),
    ("Hamletish", "Hamlet", False, False),
    ("Macbeth", "Hamlet", False, False),
])
def test_exact_match_and_contains(answer, reference, exact, contained):
    from hf_zero.train.generate import contains, exact_match

    assert (exact_match(answer, reference), contains(answer, reference)) == (exact, contained)
