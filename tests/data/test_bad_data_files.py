"""Bad data files found by issue 40's sweep, each refused in one line naming the file and the row, before any launch
where the launcher's light check reads the file: a row nested too deeply for the JSON parser (a RecursionError
before), a file mixing formats (caught after launch and blamed on its valid row 1), a CSV with an unterminated quote
or extra fields (rows silently merged or shifted), text that is not text (trained as its str()), datasets' own
log line before a read error, and `--data ''` (reported as "<folder> is a folder")."""

import json
import logging

import pytest

from hf_zero.core.config import Stage
from hf_zero.core.errors import UserError
from hf_zero.data.sources import load_source
from hf_zero.data.stages import check_stage_files, load_stage_data
from hf_zero.plan.one_stage import data_recipe_flags


def _stage(path) -> Stage:
    return Stage(name="s", data=[str(path)], steps=1)


def _refused(path, light=True) -> str:
    with pytest.raises(UserError) as err:
        check_stage_files(_stage(path), 0, light=light)
    line = err.value.line()
    assert "\n" not in line and str(path) in line
    return line


@pytest.fixture(scope="module")
def tokenizer():
    from hf_zero.data.model_names import get_tokenizer

    return get_tokenizer("tiny-llama")


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_a_row_nested_too_deeply_is_one_line(tmp_path, suffix):
    path = tmp_path / f"deep{suffix}"
    path.write_text('{"text": "fine"}\n{"text": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    assert "row 2: nested too deeply" in _refused(path)


def test_a_deep_row_through_init(tmp_path):
    path = tmp_path / "deep.jsonl"
    path.write_text('{"text": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    with pytest.raises(UserError) as err:
        data_recipe_flags("tiny-llama", [str(path)])
    assert err.value.field == "--data" and "row 1: nested too deeply" in err.value.line()


@pytest.mark.parametrize(("rows", "words"), [
    ([{"text": "a"}, {"text": "b"}, {"messages": [{"role": "user", "content": "hi"}]}],
     "row 3: chat messages, but row 1 is text"),
    ([{"prompt": "p", "completion": "c"}, {"messages": [{"role": "user", "content": "hi"}]}],
     "row 2: chat messages, but row 1 is prompt + completion"),
])
def test_a_file_mixing_formats_names_the_row_that_differs(tmp_path, rows, words):
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert words in _refused(path)  # the launcher's light check: before any rank starts


def test_a_json_array_mixing_formats(tmp_path):
    path = tmp_path / "mixed.json"
    path.write_text(json.dumps([{"text": "a"}, {"prompt": "p", "completion": "c"}]))
    assert "item 2: prompt + completion, but item 1 is text" in _refused(path)


@pytest.mark.parametrize(("text", "words"), [
    ('text\n"one\ntwo\nthree\n', "line 2: not valid CSV (unexpected end of data)"),
    # pandas read rows 1-3 as one text, `one\ntwo\nthree quoted" word`, and went on
    ('text\n"one\ntwo\nthree "quoted" word\nfour\nfive\n', "line 2: not valid CSV (',' expected after '\"')"),
    ("text\nhello, world\n", "line 2: 2 fields, the header has 1"),
])
def test_a_broken_csv_is_refused_not_merged(tmp_path, text, words):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    assert words in _refused(path, light=False)


def test_a_quoted_field_over_several_lines_is_still_fine(tmp_path):
    path = tmp_path / "good.csv"
    path.write_text('text\n"one\nand more"\ntwo\nthree\nfour\n')
    assert check_stage_files(_stage(path), 0) == [4]


@pytest.mark.parametrize("value", [3, ["a", "b"], {"k": "v"}])
def test_text_that_is_not_a_string_is_refused_before_launch(tmp_path, value):
    path = tmp_path / "odd.jsonl"
    path.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"text": value}) + "\n")
    assert "row 2: text is a JSON" in _refused(path)


@pytest.mark.parametrize("suffix", [".csv", ".parquet"])
def test_a_number_column_is_not_trained_as_text(tmp_path, suffix, tokenizer):
    import pandas as pd

    path = tmp_path / f"ints{suffix}"
    frame = pd.DataFrame({"text": list(range(1, 9))})
    frame.to_csv(path, index=False) if suffix == ".csv" else frame.to_parquet(path)
    with pytest.raises(UserError) as err:
        load_stage_data(_stage(path), tokenizer, 32, "text", 0, 0)
    assert "row 1: text is int64 (1), not text" in err.value.line()


def test_a_read_error_prints_no_stray_datasets_line(tmp_path, capsys, caplog):
    path = tmp_path / "fake.parquet"
    path.write_text("not parquet\n")
    with caplog.at_level(logging.DEBUG), pytest.raises(UserError) as err:
        load_source(str(path), "data")
    assert "cannot read" in err.value.line()
    out = capsys.readouterr()
    assert "Failed to read" not in out.err + out.out
    assert not [r for r in caplog.records if "Failed to read" in r.getMessage()]


@pytest.mark.parametrize("data", [[""], ["  "]])
def test_an_empty_data_argument_is_named_as_such(data):
    with pytest.raises(UserError) as err:
        data_recipe_flags("tiny-llama", data)
    assert err.value.line() == "--data: an empty file name; name your data file: --data FILE"
