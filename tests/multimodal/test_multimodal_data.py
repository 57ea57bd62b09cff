"""Multimodal chat rows (hf_zero.data.multimodal): placeholder runs of the encoder's token count, assistant-only
labels, the collator's stacked items, and one line naming the row and the file for a bad or missing file."""

import json

import numpy as np
import pytest

from hf_zero.core.errors import UserError
from hf_zero.data.chat import IGNORE
from hf_zero.data.multimodal import ModalitySpec, add_placeholders, encode_multimodal_rows, read_rows
from hf_zero.data.multimodal_collator import MultimodalCollator
from hf_zero.data.multimodal_demo import write_digits, write_shapes

SPECS = {"image": ModalitySpec("image", (1, 8, 8), 5), "points": ModalitySpec("points", (16, 3), 3)}


@pytest.fixture(scope="module")
def tokenizer():
    from hf_zero.data.model_names import get_tokenizer

    tok = get_tokenizer("tiny-llama")
    return tok, add_placeholders(tok, SPECS)


def _encode(tokenizer, path, specs=SPECS, max_len=128):
    tok, ids = tokenizer
    rows = read_rows(str(path), "stages[s].data[0]", "messages")
    return encode_multimodal_rows(rows, tok, specs, ids, max_len, "stages[s].data[0]", path.name, path.parent)


def _rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_placeholders_expand_to_the_encoders_token_count_and_only_answers_train(tmp_path, tokenizer):
    write_shapes(tmp_path, 2, points=40)
    write_digits(tmp_path, 1)
    mixed = {"messages": [{"role": "user", "content": [
        {"type": "image", "image": next((tmp_path / "digits").iterdir()).name.join(["digits/", ""])},
        {"type": "text", "text": "and"}, {"type": "points", "points": "shapes/00001_sphere.npy"},
        {"type": "points", "points": "shapes/00000_cube.npy"}]},
        {"role": "assistant", "content": "a digit, a sphere, a cube"}]}
    samples, report = _encode(tokenizer, _rows(tmp_path / "rows.jsonl", [mixed]))
    (tok, ids), s = tokenizer, samples[0]
    assert report.rows == 1 and s["media"] == [("image", str(tmp_path / p)) for p in [mixed["messages"][0][
        "content"][0]["image"]]] + [("points", str(tmp_path / f"shapes/{n}.npy")) for n in ("00001_sphere",
                                                                                              "00000_cube")]
    runs = [(t, len(list(g))) for t, g in __import__("itertools").groupby(s["input_ids"]) if t in ids.values()]
    assert runs == [(ids["image"], 5), (ids["points"], 6)]  # two point clouds: two runs of 3, adjacent
    trained = tok.decode([t for t, lab in zip(s["input_ids"], s["labels"]) if lab != IGNORE])
    assert trained.startswith("a digit, a sphere, a cube") and "and" not in trained
    assert all(lab == IGNORE for t, lab in zip(s["input_ids"], s["labels"]) if t in ids.values())

    batch = MultimodalCollator(tok, SPECS)([s, {**s, "input_ids": s["input_ids"][:3], "labels": s["labels"][:3],
                                                "media": []}])
    assert batch["input_ids"].shape == batch["labels"].shape == (2, len(s["input_ids"]))
    assert batch["attention_mask"][1].sum() == 3 and (batch["labels"][1, 3:] == IGNORE).all()
    assert tuple(batch["image_values"].shape) == (1, 1, 8, 8) and batch["image_rows"].tolist() == [0]
    assert tuple(batch["points_values"].shape) == (2, 16, 3) and batch["points_rows"].tolist() == [0, 0]
    cube = np.load(tmp_path / "shapes/00000_cube.npy")  # 40 points -> 16 evenly spaced, in order
    assert np.array_equal(batch["points_values"][1].numpy(), cube[np.linspace(0, 39, 16).round().astype(int)])
    empty = MultimodalCollator(tok, SPECS)([{**s, "media": []}])
    assert tuple(empty["image_values"].shape) == (0, 1, 8, 8) and empty["points_rows"].numel() == 0


@pytest.mark.parametrize("problem", ["missing", "not_an_image", "wrong_shape", "unknown_type"])
def test_a_bad_file_is_one_line_naming_the_row_and_the_file(tmp_path, tokenizer, problem):
    write_digits(tmp_path, 2)
    good = next((tmp_path / "digits").iterdir()).name
    (tmp_path / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    np.save(tmp_path / "flat.npy", np.zeros((10, 2), dtype=np.float32))
    item = {"missing": {"type": "image", "image": "nope.png"},
            "not_an_image": {"type": "image", "image": "broken.png"},
            "wrong_shape": {"type": "points", "points": "flat.npy"},
            "unknown_type": {"type": "audio", "audio": "x.wav"}}[problem]
    fine = {"type": "image", "image": f"digits/{good}"}
    rows = [{"messages": [{"role": "user", "content": [item if i == 1 else fine, {"type": "text", "text": "?"}]},
                          {"role": "assistant", "content": "3"}]} for i in range(3)]
    with pytest.raises(UserError) as err:
        _encode(tokenizer, _rows(tmp_path / "rows.jsonl", rows))
    line = err.value.line()
    assert "\n" not in line and line.startswith("stages[s].data[0]: rows.jsonl row 2:"), line
    named = {"missing": "nope.png", "not_an_image": "broken.png", "wrong_shape": "flat.npy", "unknown_type": "audio"}
    assert named[problem] in line
    if problem == "unknown_type":
        assert "text, image, points" in line
    if problem == "wrong_shape":
        assert "(10, 2)" in line


def test_an_answer_cut_by_max_seq_length_or_a_cut_placeholder_run_drops_the_row(tmp_path, tokenizer):
    write_shapes(tmp_path, 1, points=20)
    row = {"messages": [{"role": "user", "content": [{"type": "text", "text": "look"},
                                                     {"type": "points", "points": "shapes/00000_cube.npy"}]},
                        {"role": "assistant", "content": "cube"}]}
    path = _rows(tmp_path / "rows.jsonl", [row])
    full = _encode(tokenizer, path)[0][0]["input_ids"]
    start = full.index(tokenizer[1]["points"])
    samples, report = _encode(tokenizer, path, max_len=start + 2)  # inside the run of 3
    assert samples == [] and report.dropped == 1
