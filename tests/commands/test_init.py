"""First contact: `hf-zero train --model M --data FILE` (a one-stage recipe, no YAML), `hf-zero init` (the same recipe
as a YAML), their one-line refusals, and what a run writes loading with plain transformers / peft calls, offline, in
a process that never imports hf_zero."""

import json
import os
import subprocess
import sys
import time

import pytest
import yaml
from testing_utils import REPO, TINY, check, failed, read_summary, readme_command, run_cmd, write_chat_rows

from hf_zero.cli import main


@pytest.fixture
def chat_file(tmp_path):
    return write_chat_rows(tmp_path / "chat.jsonl")


def _init(capsys, *args) -> tuple[int, str, str]:
    rc = main(["init", *map(str, args)])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_init_writes_a_commented_yaml_that_check_passes(capsys, tmp_path, chat_file):
    rc, text, _ = _init(capsys, "--model", "tiny-llama", "--data", chat_file)
    assert rc == 0
    recipe = yaml.safe_load(text)
    assert recipe["model_name_or_path"] == "tiny-llama" and recipe["use_peft"] is True
    assert recipe["stages"] == [{"name": "chat", "data": str(chat_file), "epochs": 1}]
    assert recipe["eval_samples"] == 3  # a quarter of 12 rows held out for the eval loss
    assert f"# {chat_file}: 12 rows, conversational (loss on answers only)" in text
    assert "# Profile on this machine: cpu (no GPU found" in text
    (tmp_path / "elsewhere").mkdir()
    config = tmp_path / "elsewhere" / "my.yaml"  # the data path holds wherever the YAML is saved
    config.write_text(text)
    for args in (["--config", str(config)], ["--model", "tiny-llama", "--data", str(chat_file)]):
        rc, results = check(capsys, *args, output_dir=tmp_path / "run")
        assert rc == 0 and not failed(results)
        assert results["data"][1] == "1 stage(s), training samples after tokenization: chat 9 (conversational)"


@pytest.mark.parametrize("newline", ["\n", "\u2028"], ids=["LF", "LS"])
def test_a_data_file_name_cannot_inject_a_key(capsys, tmp_path, chat_file, newline):
    """A name holding a line break and `learning_rate: 50.0` once became the stage's learning rate (in the comment
    that names the file, the break ended the comment). The generated YAML holds the name as it is, and nothing else."""
    name = tmp_path / f"c{newline}    learning_rate: 50.0{newline}    #.jsonl"
    name.write_text(chat_file.read_text())
    rc, text, _ = _init(capsys, "--model", "tiny-llama", "--data", name)
    assert rc == 0
    recipe = yaml.safe_load(text)
    assert recipe["stages"] == [{"name": "c_learning_rate_50_0", "data": str(name), "epochs": 1}]
    assert recipe["learning_rate"] == 1e-3 and text.count("50.0") == 2  # in the quoted data path and its comment


def test_init_one_stage_per_file_with_stages(capsys, tmp_path, chat_file):
    text_file = tmp_path / "notes.txt"
    text_file.write_text("".join(f"line {i} of my notes\n" for i in range(40)))
    from hf_zero.data.model_names import resolve_model_path

    folder = resolve_model_path("tiny-llama")  # a model folder, named relative to where the command runs
    rc, text, _ = _init(capsys, "--model", os.path.relpath(folder), "--stages", text_file, chat_file)
    assert rc == 0
    recipe = yaml.safe_load(text)
    assert recipe["model_name_or_path"] == folder  # absolute, as the data: the YAML may be saved anywhere
    assert [(s["name"], s["data"]) for s in recipe["stages"]] == [("notes", str(text_file)), ("chat", str(chat_file))]


def test_init_writes_data_paths_that_move_with_the_yaml(capsys, tmp_path, chat_file, monkeypatch):
    """Issue 41 (7): a data file named relative to the current folder is written relative to the YAML's folder
    (the current folder on stdout, --out's folder), the run has an output_dir of its own, and the YAML shows how a
    second stage looks."""
    project = tmp_path / "project"
    (project / "data").mkdir(parents=True)
    chat_file.rename(project / "data" / "chat.jsonl")
    monkeypatch.chdir(project)
    rc, text, _ = _init(capsys, "--model", "tiny-llama", "--data", "data/chat.jsonl")
    recipe = yaml.safe_load(text)
    assert rc == 0 and recipe["stages"][0]["data"] == "data/chat.jsonl" and recipe["output_dir"] == "runs/chat_yaml"
    assert "  # - name: harder\n  #   data: harder.jsonl " in text  # a second stage, commented
    rc, said, _ = _init(capsys, "--model", "tiny-llama", "--data", "data/chat.jsonl", "--out", "configs/qa.yaml")
    recipe = yaml.safe_load((project / "configs" / "qa.yaml").read_text())
    assert rc == 0 and said == "[hf_zero] wrote configs/qa.yaml; train it: hf-zero train --config configs/qa.yaml\n"
    assert recipe["stages"][0]["data"] == "../data/chat.jsonl" and recipe["output_dir"] == "runs/qa"
    moved = tmp_path / "moved"
    project.rename(moved)  # the project folder moves: the YAML still finds its data
    monkeypatch.chdir(tmp_path)
    rc, results = check(capsys, "--config", str(moved / "configs" / "qa.yaml"), output_dir=tmp_path / "run")
    assert rc == 0 and not failed(results), results


@pytest.mark.parametrize("case", ["missing file", "unknown model", "uncached hub id", "no known column",
                                  "unknown suffix", "no model", "data and config"])
def test_refusals_are_one_line(capsys, tmp_path, chat_file, case):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "a", "answer": "b"}\n')
    sheet = tmp_path / "sheet.xlsx"
    sheet.write_text("a,b\n")
    args, want = {
        "missing file": (["--model", "tiny-llama", "--data", tmp_path / "nope.jsonl"],
                         f"--data: {tmp_path / 'nope.jsonl'} does not exist; give a .jsonl/.json/.csv/.parquet/.txt"),
        "unknown model": (["--model", "no-such-model", "--data", chat_file], "--model: "),
        "uncached hub id": (["--model", "someone/not-cached", "--data", chat_file],
                            "--model: someone/not-cached is not in the Hugging Face cache"),
        "no known column": (["--model", "tiny-llama", "--data", bad],
                            f"--data: {bad} has no column 'text', no prompt+completion and no messages (columns: "
                            "question, answer)"),
        "unknown suffix": (["--model", "tiny-llama", "--data", sheet],
                           f"--data: {sheet}: .xlsx is not a format hf_zero reads"),
        "no model": (["--data", chat_file], "--model: missing with --data; name the model: --model"),
        "data and config": (["--model", "tiny-llama", "--data", chat_file, "--config", TINY],
                            "--data: given with --config"),
    }[case]
    for command in (["init"], ["train", "--dry-run"], ["check"]):
        if case == "data and config" and command == ["init"]:
            continue  # init takes no --config
        rc = main([*command, *map(str, args)])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1 and err[0].startswith(f"hf-zero: error: {want}"), (command, err)
        assert "Traceback" not in err[0]


def test_an_uncached_hub_id_offline_fails_at_once(monkeypatch):
    """No HF_HUB_OFFLINE, a hub that does not answer: hf_zero finds it offline and fails on the hub cache alone, with
    the fix, instead of huggingface_hub's retries."""
    from huggingface_hub import constants

    from hf_zero.core.errors import UserError
    from hf_zero.data.model_names import get_model_config

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens on the discard port
    start = time.monotonic()
    with pytest.raises(UserError) as err:
        get_model_config("someone/not-cached")
    assert time.monotonic() - start < 5
    assert err.value.field == "model_name_or_path"
    assert err.value.problem.startswith("someone/not-cached is not in the Hugging Face cache (")
    # issue 41 (8): a config.json is enough for `hf-zero estimate`, not the model's weights
    assert err.value.fix.startswith("where the hub is reachable, `hf download someone/not-cached config.json` is "
                                    "enough for hf-zero estimate (training needs the weights")
    with pytest.raises(UserError) as err:  # a typo of an offline model's name: named
        get_model_config("SmolLM2-135M")
    assert err.value.fix.startswith("did you mean smollm2-135m-instruct? Or use a local model folder")


def test_the_default_config_is_said(capsys):
    assert main(["train", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == ("[hf_zero] config: "
                                   f"{REPO / 'recipes' / 'configs' / 'smollm2_shakespeare.yaml'} (the default; pass "
                                   "--config or --data)")
    assert main(["train", "--dry-run", "--config", str(TINY)]) == 0
    assert "[hf_zero] config:" not in capsys.readouterr().out


def test_make_train_passes_no_config_with_data():
    """`make train ARGS="--model M --data F"`: the Makefile adds --config only when CONFIG is given."""
    dry = subprocess.run(["make", "-n", "train", "ARGS=--model tiny-llama --data my.jsonl"], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout.replace("\\\n", " ")
    line = next(ln for ln in dry.splitlines() if "hf-zero train" in ln)
    assert "--config" not in line and line.split()[-4:] == ["--model", "tiny-llama", "--data", "my.jsonl"]
    dry = subprocess.run(["make", "-n", "train", f"CONFIG={TINY}"], cwd=REPO, capture_output=True, text=True,
                         check=True).stdout
    assert f"--config {TINY}" in dry


# A fresh process with no hf_zero import: what the run wrote loads through the hub cache by plain calls, offline.
_LOAD_ANYWHERE = """
import json, sys
from pathlib import Path
from peft import AutoPeftModelForCausalLM
from transformers import AutoModelForCausalLM
final, exported = sys.argv[1], sys.argv[2]
adapter = AutoPeftModelForCausalLM.from_pretrained(final)
merged = AutoModelForCausalLM.from_pretrained(exported)
assert not any(m == "hf_zero" or m.startswith("hf_zero.") for m in sys.modules)
print(json.dumps({"adapter_vocab": adapter.get_input_embeddings().weight.shape[0],
                  "merged_vocab": merged.get_input_embeddings().weight.shape[0]}))
"""


def load_anywhere(final, exported, cwd) -> dict:
    proc = run_cmd([sys.executable, "-c", _LOAD_ANYWHERE, final, exported], cwd=cwd,
                   env={"HF_HUB_OFFLINE": "1", "PYTHONPATH": ""})
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.multiproc
def test_train_on_a_file_in_one_command_and_load_the_adapter_anywhere(capsys, readme_checkout, readme_runs,
                                                                      tmp_path):
    """The README's `hf-zero train --model tiny-llama --data ...chat.jsonl` (its launch, shared with
    test_readme.py) trained; `hf-zero init`'s YAML is the recipe it ran (the same run settings: `--config` on it finds
    the run finished); the adapter and its merged export load with plain peft / transformers calls, offline, in a
    process without hf_zero."""
    proc = readme_runs[readme_command("hf-zero train --model tiny-llama", "--data")]
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    run = readme_checkout / "runs" / "my_chat"
    summary = read_summary(run)
    # 12 conversations, 3 held out, 4 a step on the cpu profile's 2 ranks: 1 epoch in 3 steps
    assert summary["profile"] == "cpu" and summary["total_steps"] == 3 and summary["use_peft"]
    assert [s["name"] for s in summary["stages"]] == ["chat"]
    assert summary["eval_loss_before"] > 0 and summary["eval_loss_after"] > 0  # held-out answers, not memorised in 3
    built = summary["config"]
    assert f"[hf_zero] config: {built} (built from --model and --data" in proc.stdout

    data = readme_checkout / "recipes" / "data" / "tiny" / "chat.jsonl"
    rc, text, _ = _init(capsys, "--model", "tiny-llama", "--data", data)
    ours, theirs = yaml.safe_load(text), yaml.safe_load(open(built))
    # the same recipe, in a run folder of its own (runs/chat_yaml): training it trains, not "holds a finished run"
    assert rc == 0 and {**ours, "output_dir": None} == {**theirs, "output_dir": None}
    assert (ours["output_dir"], theirs["output_dir"]) == ("runs/chat_yaml", "runs/chat")
    mine = tmp_path / "my.yaml"
    mine.write_text(text)
    assert main(["train", "--config", str(mine), "--output_dir", str(run)]) == 0
    assert f"[hf_zero] {run} holds a finished run" in capsys.readouterr().out

    final = run / "final"
    assert json.loads((final / "adapter_config.json").read_text())["base_model_name_or_path"] == "hf-zero/tiny-llama"
    card = (final / "README.md").read_text()
    assert "base_model: hf-zero/tiny-llama" in card and os.environ["HF_HUB_CACHE"] not in card
    assert main(["export", str(run), "--out", str(tmp_path / "merged"), "--merge-lora"]) == 0
    # the tiny tokenizer's 512 tokens and the 2 its chat template added
    assert load_anywhere(final, tmp_path / "merged", tmp_path) == {"adapter_vocab": 514, "merged_vocab": 514}


@pytest.mark.multiproc
def test_the_default_tiny_lora_run_loads_anywhere(lora_zero3_run, tmp_path):
    """The shared LoRA run (text data, no tokens added) names its base by hub id, and loads without hf_zero."""
    final = lora_zero3_run.out / "final"
    assert json.loads((final / "adapter_config.json").read_text())["base_model_name_or_path"] == "hf-zero/tiny-llama"
    assert main(["export", str(lora_zero3_run.out), "--out", str(tmp_path / "merged"), "--merge-lora"]) == 0
    # the tiny tokenizer's 512 tokens: text data adds none
    assert load_anywhere(final, tmp_path / "merged", tmp_path) == {"adapter_vocab": 512, "merged_vocab": 512}
