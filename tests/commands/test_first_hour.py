"""What a newcomer meets in the first hour (issue 41): the lines `hf-zero train`, `preview`, `estimate` and `--help`
print for the README's commands say what is true and take the flags the other commands take."""

import json

import pytest
from testing_utils import write_chat_rows

from hf_zero.cli import main


@pytest.fixture
def chat_file(tmp_path):
    return write_chat_rows(tmp_path / "chat.jsonl")


def test_train_with_data_names_what_it_checks(capsys, tmp_path):
    """(4) The first line of a `--data` run named `checking None` (and so did summary.json's startup_s)."""
    missing = tmp_path / "nope.jsonl"
    assert main(["train", "--model", "tiny-llama", "--data", str(missing)]) == 2
    out = capsys.readouterr()
    assert out.out.splitlines()[0] == f"[hf_zero] checking --data {missing}: recipe, data, model, launch (0 s)"
    assert out.err.startswith(f"hf-zero: error: --data: {missing} does not exist")
    from hf_zero.core import startup

    assert f"checking --data {missing}: recipe, data, model, launch" in dict(startup.phases())


def test_preview_takes_model_and_data_as_train_does(capsys, chat_file):
    """(6) `hf-zero preview --model M --data F` previews the one-stage recipe `train --data` runs (it answered
    "ambiguous option: --model could match --model_name_or_path")."""
    assert main(["preview", "--model", "tiny-llama", "--data", str(chat_file), "-n", "1"]) == 0
    out = capsys.readouterr().out
    plan, stage = out.splitlines()[:2]
    assert plan.startswith("plan: profile cpu, ") and stage.startswith("stage 'chat': 1 source(s), max_seq_length ")
    assert "conversational, loss on answers only" in out and "9 training samples, 3 held out" in out


def test_estimate_on_the_cpu_profile_speaks_of_cpu_ranks(capsys):
    """(8) `--profile cpu` has no GPUs: its ranks are CPU processes, and the peak column says per rank."""
    assert main(["estimate", "--profile", "cpu", "--model", "tiny-llama"]) == 0
    out = capsys.readouterr().out
    assert " x 2 CPU rank(s), " in out and "GPU" not in out
    assert out.splitlines()[2].split()[8] == "peak/rank"
    assert main(["estimate", "--profile", "zero2", "--model", "tiny-llama"]) == 0
    assert " x 2 GPU(s), " in capsys.readouterr().out


def test_help_is_for_the_person_running_it(capsys):
    """(8) `hf-zero --help` opened with a note for developers; bench's line left out FSDP2."""
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "imported only when called" not in out and "without loading torch" not in out
    assert out.split("\n\n")[1].startswith("Fine-tune a causal LM")
    bench = next(ln for ln in out.splitlines() if ln.strip().startswith("bench "))
    assert "FSDP2" in bench


def test_a_run_without_checkpoints_says_how_to_make_one_resumable_and_its_rerun_starts_clean(tmp_path):
    """(10) Ctrl-C with no checkpoint: the line says which flags make a run resumable; the re-run (from step 0)
    moves the earlier life's TensorBoard events and answers aside instead of adding to them."""
    from types import SimpleNamespace

    from hf_zero.checkpoint.resume import _choose
    from hf_zero.launch.interrupt import where_it_stands

    out = tmp_path / "run"
    (out / "runs" / "Nov27_14-00-00_host").mkdir(parents=True)
    (out / "samples.jsonl").write_text('{"step": 0, "when": "start"}\n')
    line = where_it_stands(out, "hf-zero train --config my.yaml")
    assert line.endswith("starts from step 0: hf-zero train --config my.yaml; to make a run resumable, save "
                         "checkpoints as it goes: --save_strategy steps --save_steps N")
    ctx = SimpleNamespace(training_args=SimpleNamespace(output_dir=str(out), resume_from_checkpoint=None))
    assert _choose(ctx, fresh_start=False) == {"resume": None, "universal": False}
    assert sorted(p.name for p in out.iterdir()) == ["previous-run"]
    assert sorted(p.name for p in (out / "previous-run").iterdir()) == ["runs", "samples.jsonl"]


@pytest.mark.multiproc  # extended (tests/conftest.py): a 2-rank launch
def test_gradient_accumulation_leaves_the_console_to_hf_zero(tmp_path):
    """(5) With 2 accumulation steps under DeepSpeed, accelerate's plugin said 1 and DeepSpeed 2 ("Gradient
    accumulation steps mismatch" on the console); they agree now, and the console holds hf_zero's lines only."""
    import sys

    from testing_utils import REPO, foreign_lines, read_summary, run_cmd

    config = tmp_path / "accum.yaml"
    config.write_text(json.dumps({
        "model_name_or_path": "tiny-llama", "max_seq_length": 64, "eval_samples": 4,
        "stages": [{"name": "short", "data": str(REPO / "recipes" / "data" / "tiny" / "short.jsonl"), "steps": 2}],
        "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2, "output_dir": str(tmp_path / "run")}))
    proc = run_cmd([sys.executable, "-m", "hf_zero.cli", "train", "--profile", "zero2", "--config", config])
    text = proc.stdout + proc.stderr
    assert "batch: 2 micro x 2 accum x 2 ranks = 8 global" in text
    assert "mismatch" not in text and "OMP_NUM_THREADS" not in text and foreign_lines(text) == []
    assert read_summary(tmp_path / "run")["total_steps"] == 2
