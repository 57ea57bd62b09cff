"""Sequence packing (`packing: true`): whole documents in fixed-length rows, with boundaries kept. Proven on the real
model: the per-token losses of a packed row equal those of its documents run one by one, and the rows of the
bundled text are at least 95% text."""

import json
import math
import sys

import pytest
import torch
from testing_utils import RECIPE, REPO, TINY, read_summary, run_cmd

from hf_zero.data.packing import IGNORE, PackedCollator, pack_documents, padding_stats, real_tokens

PAD = 1


def _doc(first: int, n: int) -> dict:
    ids = list(range(first, first + n))
    return {"input_ids": ids, "labels": list(ids)}


def _segments(row: dict) -> list[list[int]]:
    """The documents of a packed row, split where position_ids restart, padding dropped."""
    ids, pos, used = row["input_ids"], row["position_ids"], real_tokens(row)
    starts = [i for i in range(used) if pos[i] == 0] + [used]
    return [ids[a:b] for a, b in zip(starts, starts[1:])]


def test_rows_hold_every_document_whole_and_once():
    docs = [_doc(100 * i + 2, n) for i, n in enumerate([9, 7, 12, 4, 5, 11])]  # 48 tokens: 3 rows of 16 exactly
    rows = pack_documents(docs, 16, PAD)
    assert len(rows) == 3 and all(len(r[k]) == 16 for r in rows for k in ("input_ids", "labels", "position_ids"))
    assert padding_stats(rows, 2)["non_padding_fraction"] == 1.0  # best-fit decreasing found the perfect fit
    assert sorted(map(tuple, (s for r in rows for s in _segments(r)))) == sorted(tuple(d["input_ids"]) for d in docs)
    for row in rows:
        for i, (tok, lab, pos) in enumerate(zip(row["input_ids"], row["labels"], row["position_ids"])):
            # a document's first token is never a target (it would be predicted from the previous document)
            assert lab == (IGNORE if pos == 0 else tok)
    assert pack_documents(docs, 16, PAD) == rows  # deterministic


def test_padding_is_its_own_segment_without_labels():
    rows = pack_documents([_doc(2, 5), _doc(20, 4)], 12, PAD)
    assert len(rows) == 1 and real_tokens(rows[0]) == 9
    row = rows[0]
    assert row["input_ids"][9:] == [PAD] * 3 and row["labels"][9:] == [IGNORE] * 3
    assert row["position_ids"] == [0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 2]


def test_a_document_longer_than_a_row_is_refused():
    with pytest.raises(ValueError, match="does not fit"):
        pack_documents([_doc(2, 17)], 16, PAD)


def test_collator_sends_unpacked_samples_to_the_fallback():
    from hf_zero.data.model_names import get_tokenizer
    from hf_zero.data.stages import build_collator

    collate = build_collator(get_tokenizer("tiny-llama"), packing=True)
    packed = collate(pack_documents([_doc(2, 5), _doc(20, 4)], 12, PAD))
    # no attention_mask, no cache: either would hide the packing from transformers' mask code
    assert set(packed) == {"input_ids", "labels", "position_ids", "use_cache"} and packed["use_cache"] is False
    plain = collate([_doc(2, 5), _doc(20, 3)])  # held-out eval samples are not packed
    assert plain["attention_mask"].tolist() == [[1] * 5, [1, 1, 1, 0, 0]]


@pytest.fixture(scope="module")
def tiny_docs():
    from hf_zero.data.model_names import get_tokenizer

    tok = get_tokenizer("tiny-llama")
    docs = []
    for name, take in (("short", 6), ("medium", 4), ("long", 2)):
        lines = (REPO / "recipes" / "data" / "tiny" / f"{name}.jsonl").read_text().splitlines()[:take]
        for line in lines:
            ids = tok(json.loads(line)["text"], add_special_tokens=False)["input_ids"][:95] + [tok.eos_token_id]
            docs.append({"input_ids": ids, "labels": list(ids)})
    return docs, tok.pad_token_id


def _model(attn: str):
    """In train mode, as the Trainer runs it (tiny-llama has no dropout, so outputs are deterministic)."""
    from transformers import AutoModelForCausalLM

    from hf_zero.data.model_names import get_tiny_llama_path

    model = AutoModelForCausalLM.from_pretrained(get_tiny_llama_path(), attn_implementation=attn)
    return model.train()


def _per_token(logits, targets):
    return torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, ignore_index=IGNORE, reduction="none")


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_row_losses_equal_documents_alone(tiny_docs, attn):
    docs, pad = tiny_docs
    model = _model(attn)
    rows = pack_documents(docs, 128, pad)
    assert len(rows) < len(docs) // 2  # several documents per row, so boundaries are really exercised
    batch = PackedCollator(None, pad)(rows)
    with torch.no_grad():
        out = model(**batch)  # exactly what the Trainer passes
        packed = _per_token(out.logits[:, :-1], batch["labels"][:, 1:])
        checked = 0
        for r, row in enumerate(rows):
            offset = 0
            for seg in _segments(row):
                alone = model(input_ids=torch.tensor([seg])).logits
                want = _per_token(alone[:, :-1], torch.tensor([seg[1:]]))[0]
                got = packed[r, offset:offset + len(seg) - 1]
                torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
                offset += len(seg)
                checked += 1
    assert checked == len(docs)
    # The model's own loss (what the Trainer trains on) is the mean over exactly the documents' own targets.
    targets = sum(len(d["input_ids"]) - 1 for d in docs)
    assert int((batch["labels"] != IGNORE).sum()) == targets
    torch.testing.assert_close(out.loss, packed.sum() / targets, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("trap", ["positions straight through", "model's default cache"])
def test_the_boundaries_are_what_keeps_documents_apart(tiny_docs, trap):
    """The check above can fail. Positions numbered straight through a row, or the cache Llama's forward creates
    by default (transformers then skips packed-sequence detection), make one causal sequence of the row."""
    docs, pad = tiny_docs
    model = _model("sdpa")
    row = next(r for r in pack_documents(docs, 128, pad) if len(_segments(r)) >= 2)
    batch = PackedCollator(None, pad)([row])
    with torch.no_grad():
        kept = _per_token(model(**batch).logits[:, :-1], batch["labels"][:, 1:])
        if trap == "positions straight through":
            batch["position_ids"] = torch.arange(batch["input_ids"].shape[1])[None]
        else:
            del batch["use_cache"]
        leaked = _per_token(model(**batch).logits[:, :-1], batch["labels"][:, 1:])
    second = len(_segments(row)[0])  # the second document's targets start here
    assert (kept[0, second:] - leaked[0, second:]).abs().max() > 1e-3
    torch.testing.assert_close(kept[0, :second - 1], leaked[0, :second - 1], atol=1e-5, rtol=0)


def test_rows_of_the_bundled_text_are_at_least_95_percent_text(tmp_path):
    """The bench recipe's data (all of recipes/data/tiny, 7-96 tokens a document) as its run draws it."""
    from hf_zero.bench.plan import build_plan

    plan = build_plan(str(REPO / "recipes" / "configs" / "bench.yaml"), None, None, 2, [], tmp_path)
    unpacked, packed = plan.padding["unpacked"], plan.padding["packed"]
    assert packed["non_padding_fraction"] >= 0.95 > unpacked["non_padding_fraction"]
    assert sum(plan.packed_text_tokens_per_step) > 2 * sum(plan.text_tokens_per_step)  # same steps, more text


@pytest.mark.recipe_run
def test_recipe_trains_with_packing(tmp_path):
    """One process, the tiny curriculum: packed rows for training (stage 3 packs per source: it has weights),
    unpacked held-out samples for evaluation, through the same collator."""
    out = tmp_path / "run"
    run_cmd([sys.executable, RECIPE, "--config", TINY, "--output_dir", out, "--disable_tqdm", "true",
             "--packing", "true"])
    s = read_summary(out)
    assert len(s["losses"]) == s["total_steps"] == 15 and all(math.isfinite(x) for x in s["losses"])
    assert s["eval_loss_after"] < s["eval_loss_before"]


# --- flash attention: one flattened row, no mask, the varlen path ----------------------------------------------------

def test_varlen_collator_flattens_the_documents_of_every_row(tiny_docs):
    """For flash attention the micro-batch's rows become one row of their documents: no padding, no attention mask,
    positions restarting per document and the documents' cumulative lengths for flash's varlen kernel."""
    docs, pad = tiny_docs
    rows = pack_documents(docs, 128, pad)[:3]
    batch = PackedCollator(None, pad, varlen=True)(rows)
    assert set(batch) == {"input_ids", "labels", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q",
                          "max_length_k", "use_cache"} and batch["use_cache"] is False
    segments = [seg for row in rows for seg in _segments(row)]
    lengths = [len(s) for s in segments]
    total = sum(real_tokens(r) for r in rows)
    assert batch["input_ids"].shape == batch["labels"].shape == batch["position_ids"].shape == (1, total)
    assert batch["input_ids"][0].tolist() == [t for s in segments for t in s]
    assert batch["position_ids"][0].tolist() == [i for n in lengths for i in range(n)]
    assert batch["cu_seq_lens_q"].tolist() == batch["cu_seq_lens_k"].tolist() == [sum(lengths[:i]) for i in
                                                                                   range(len(lengths) + 1)]
    assert batch["cu_seq_lens_q"].dtype == torch.int32 and batch["max_length_q"] == max(lengths)
    # the first token of every document is no target; every other token is
    assert batch["labels"][0].tolist() == [IGNORE if i == 0 else t for s in segments for i, t in enumerate(s)]
    # the same targets as the stacked rows: the loss is normalised over the same tokens
    stacked = PackedCollator(None, pad)(rows)
    assert int((batch["labels"] != IGNORE).sum()) == int((stacked["labels"] != IGNORE).sum())


def test_the_collator_flattens_for_flash_attention_only():
    from types import SimpleNamespace

    from hf_zero.data.model_names import get_tokenizer
    from hf_zero.data.stages import build_collator

    tok = get_tokenizer("tiny-llama")
    for attn, flat in (("sdpa", False), ("eager", False), ("flash_attention_2", True),
                       ("kernels-community/flash-attn2", True)):
        model = SimpleNamespace(config=SimpleNamespace(_attn_implementation=attn))
        assert (build_collator(tok, packing=True, model=model).flatten is not None) == flat, attn


def _flat_losses_equal_documents_alone(model, docs, pad, atol):
    rows = pack_documents(docs, 128, pad)
    batch = PackedCollator(None, pad, varlen=True)(rows)
    device = next(model.parameters()).device
    batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
    with torch.no_grad():
        flat = _per_token(model(**batch).logits[:, :-1].float(), batch["labels"][:, 1:])[0]
        offset = 0
        for seg in [s for row in rows for s in _segments(row)]:
            alone = model(input_ids=torch.tensor([seg], device=device)).logits.float()
            want = _per_token(alone[:, :-1], torch.tensor([seg[1:]], device=device))[0]
            torch.testing.assert_close(flat[offset:offset + len(seg) - 1], want, atol=atol, rtol=0)
            offset += len(seg)
    assert offset == batch["input_ids"].shape[1]


def test_flattened_row_losses_equal_documents_alone_on_cpu(tiny_docs):
    """The flattened layout itself, on CPU: sdpa reads the restarting positions of a one-row batch (and ignores the
    flash kwargs), so every token's loss equals its document's run alone."""
    docs, pad = tiny_docs
    _flat_losses_equal_documents_alone(_model("sdpa"), docs, pad, atol=1e-5)


def _flash_available() -> bool:
    from transformers.utils import is_flash_attn_2_available

    return torch.cuda.is_available() and is_flash_attn_2_available()


@pytest.mark.skipif(not _flash_available(), reason="flash varlen path: needs a CUDA GPU with flash-attn installed")
def test_flash_varlen_losses_equal_documents_alone(tiny_docs):
    from transformers import AutoModelForCausalLM

    from hf_zero.data.model_names import get_tiny_llama_path

    docs, pad = tiny_docs
    model = AutoModelForCausalLM.from_pretrained(get_tiny_llama_path(), attn_implementation="flash_attention_2",
                                                 dtype=torch.bfloat16).cuda().train()
    _flat_losses_equal_documents_alone(model, docs, pad, atol=2e-2)  # bf16: flash has no fp32 kernel
