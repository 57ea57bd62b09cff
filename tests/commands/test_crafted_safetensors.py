"""Crafted .safetensors headers under `hf-zero export` and `hf-zero generate` (issue 40: 14 tracebacks across the
two): each is one line naming the file and what is wrong, exit 2, and `--out` is never created. The check reads the
header only (hf_zero/core/safetensors_header.py); files safetensors itself writes pass it."""

import json
import struct

import pytest

from hf_zero.cli import main
from hf_zero.core.safetensors_header import safetensors_problem

F32 = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}


def _file(path, header, data: bytes = b"\0" * 16, length: int | None = None):
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)
    return path


CRAFTED = {  # name -> (header, data, declared header length, words of the one line)
    "length past the end": ({"w": F32}, b"\0" * 16, 2**40, "runs past the end of the file"),
    "not json": (b"{not json", b"", None, "its header is not JSON"),
    "not utf-8": (b"\xff\xfe{}", b"", None, "its header is not JSON"),
    "a list": ([1, 2], b"", None, "a JSON list, not a mapping"),
    "deeply nested": (b"[" * 100_000 + b"]" * 100_000, b"", None, "its header is not JSON"),
    "unknown dtype": ({"w": {**F32, "dtype": "F128"}}, b"\0" * 16, None, "unknown dtype 'F128'"),
    "negative shape": ({"w": {**F32, "shape": [-2, -8]}}, b"\0" * 16, None, "not a list of sizes"),
    "bool shape": ({"w": {**F32, "shape": [True, 4]}}, b"\0" * 16, None, "not a list of sizes"),
    "offsets outside": ({"w": {**F32, "data_offsets": [0, 1 << 40]}}, b"\0" * 16, None, "outside the file's 16"),
    "offsets reversed": ({"w": {**F32, "data_offsets": [16, 0]}}, b"\0" * 16, None, "data_offsets [16, 0]"),
    "shape larger than bytes": ({"w": {**F32, "shape": [1000, 1000]}}, b"\0" * 16, None, "does not fill"),
    "overlap": ({"a": F32, "b": F32}, b"\0" * 16, None, "overlap or leave gaps"),
    "trailing bytes": ({"w": F32}, b"\0" * 32, None, "end at byte 16 of 32"),
    "metadata not strings": ({"__metadata__": {"format": 3}, "w": F32}, b"\0" * 16, None, "__metadata__"),
    "tensor not a mapping": ({"w": [1, 2]}, b"", None, "not a mapping"),
    "short file": (b"", b"", 0, "shorter than a safetensors header"),
}


@pytest.mark.parametrize("name", sorted(CRAFTED))
def test_each_crafted_header_is_named(tmp_path, name):
    header, data, length, words = CRAFTED[name]
    path = tmp_path / "model.safetensors"
    if name == "short file":
        path.write_bytes(b"\1\2\3")
    else:
        _file(path, header, data, length)
    assert words in (safetensors_problem(path) or "")


def test_files_safetensors_writes_pass(tmp_path):
    import torch
    from safetensors.torch import save_file

    path = tmp_path / "ok.safetensors"
    save_file({"a": torch.zeros(3, 5), "b": torch.ones(2, dtype=torch.bfloat16), "c": torch.zeros(0),
               "d": torch.arange(7, dtype=torch.int64), "e": torch.tensor(True)}, str(path), metadata={"format": "pt"})
    assert safetensors_problem(path) is None


@pytest.fixture
def model_folder(tmp_path):
    """A model folder whose config is fine and whose weights file is crafted (the header under test)."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 8, "hidden_size": 4}))
    return folder


@pytest.mark.parametrize("name", ["length past the end", "offsets outside", "shape larger than bytes", "overlap",
                                  "deeply nested", "unknown dtype"])
def test_export_and_generate_refuse_in_one_line(model_folder, tmp_path, capsys, name):
    header, data, length, words = CRAFTED[name]
    _file(model_folder / "model.safetensors", header, data, length)
    out = tmp_path / "out"
    for argv, field in ((["export", str(model_folder), "--out", str(out)], "CHECKPOINT"),
                        (["generate", "--model", str(model_folder), "--prompt", "hi"], "--model")):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"hf-zero: error: {field}: ") and words in err[0], err
        assert "model.safetensors is not a usable safetensors file" in err[0]
    assert not out.exists() and not (tmp_path / "out.partial").exists()


def test_a_crafted_adapter_is_refused_for_generate(tmp_path, capsys):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "tiny-llama"}))
    _file(adapter / "adapter_model.safetensors", *CRAFTED["offsets outside"][:3])
    assert main(["generate", "--adapter", str(adapter), "--prompt", "hi"]) == 2
    # another test process may be building the tiny Llama into the shared cache: its wait is said, not an error
    err = [ln for ln in capsys.readouterr().err.strip().splitlines() if not ln.startswith("hf-zero: waiting up to ")]
    assert len(err) == 1 and err[0].startswith("hf-zero: error: --adapter: ") and "adapter_model.safetensors" in err[0]
