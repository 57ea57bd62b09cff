"""scripts/vlm_packing.py, the measurement of docs/vlm.md's Packing section: its rows (every one kept whole at its
length, of varied lengths) and, briefly, the script itself (2 launches of 2 steps on 2 ranks); the full command the
docs show runs in tests/commands/test_readme.py (slow)."""

import importlib.util
import json
import re
import sys

import pytest
from testing_utils import REPO, run_cmd

from hf_zero.cli import main


def _script():
    spec = importlib.util.spec_from_file_location("vlm_packing", REPO / "scripts" / "vlm_packing.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_rows_vary_in_length_and_none_is_cut(tmp_path, capsys):
    script = _script()
    data = script.write_rows(tmp_path / "data", 120)
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    assert len(rows) == 120 and all((tmp_path / "data" / r["messages"][0]["content"][0]["image"]).is_file()
                                     for r in rows)
    assert {len(r["messages"]) for r in rows} == {2, 4}  # every fourth row a second question
    config = script.write_config(tmp_path / "p.yaml", "hf-zero/tiny-qwen2-vl", data, 2, 8, 256, True)
    capsys.readouterr()
    assert main(["preview", "--config", str(config), "-n", "0"]) == 0
    out = capsys.readouterr().out
    assert "120 rows -> 120 samples; 0 truncated, 0 dropped" in out, out
    low, median, high = map(int, re.search(r"tokens per sample: min (\d+) / median (\d+) / p95 \d+ / max (\d+)",
                                           out).groups())
    assert low < 60 < median < 150 < high <= 256, (low, median, high)  # short rows and long ones, none cut


@pytest.mark.multiproc
def test_the_script_measures_packed_against_unpacked(tmp_path):
    out = tmp_path / "m"
    proc = run_cmd([sys.executable, REPO / "scripts" / "vlm_packing.py", "--out", out, "--rows", 64, "--steps", 2,
                    "--batch", 4, "--repeats", 1], timeout=900)
    result = json.loads((out / "vlm_packing.json").read_text())
    assert "non-padding tokens per step: unpacked" in proc.stdout
    assert result["same_tokens_every_repeat"] and result["nproc"] == 2 and result["steps"] == 2
    tokens = result["tokens_per_step"]
    assert tokens["packed"] > 1.5 * tokens["unpacked"] > 0, result  # 4 packed rows of 256 tokens vs 4 conversations
    assert len(result["tokens_per_second_ratios"]) == 1 and result["tokens_per_second"]["packed"][0] > 0
