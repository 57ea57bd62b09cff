"""The preflight reads what the run reads, and a failed write is one line.

Each bad input is refused by the function that both `hf-zero check` (run_checks) and the ranks call, tested here
in-process; one `hf-zero train` and one plain `accelerate launch` with a bad file prove the end-to-end path. Write
failures are injected in a subprocess: a real full event-file write in TensorBoard's thread, and a real kernel
refusal (RLIMIT_FSIZE) of summary.json."""

import json
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest
import yaml
from testing_utils import PROFILES, RECIPE, REPO, TINY, run_cmd

from hf_zero.core.config import Stage
from hf_zero.core.errors import UserError
from hf_zero.data.sources import load_source
from hf_zero.data.stages import check_held_out
from hf_zero.plan.parse import build_stage, parse_stages

ERROR = "hf-zero: error:"


def _write(path: Path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


def _refused(func, *args) -> str:
    with pytest.raises(UserError) as caught:
        func(*args)
    return caught.value.line()


@pytest.fixture
def bad_files(tmp_path):
    rows = b'{"text": "hello"}\n' * 5
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder.jsonl").mkdir()
    return {
        "non-UTF-8": (_write(tmp_path / "latin.jsonl", rows + b'{"text": "caf\xe9"}\n'),
                      "latin.jsonl row 6: byte 0xe9 is not UTF-8"),
        "non-UTF-8 text": (_write(tmp_path / "latin.txt", b"ok\n\xff\n"), "latin.txt row 2: byte 0xff is not UTF-8"),
        "empty": (_write(tmp_path / "empty.jsonl", b""), "empty.jsonl is empty"),
        "blank lines": (_write(tmp_path / "blank.jsonl", b"\n \n"), "blank.jsonl has only blank lines"),
        "malformed JSON": (_write(tmp_path / "broken.jsonl", rows + b'{"text": "cut\n'),
                           "broken.jsonl row 6: not valid JSON"),
        "not an object": (_write(tmp_path / "list.jsonl", b'["a"]\n'), "list.jsonl row 1: a JSON list"),
        "JSON document": (_write(tmp_path / "doc.json", b'[{"text": "a"},\n {"text": }]'), "doc.json line 2"),
        "folder": (str(tmp_path / "folder"), "folder is a folder, not a data file"),
        "folder with a data suffix": (str(tmp_path / "folder.jsonl"), "folder.jsonl is a folder"),
    }


CASES = ["non-UTF-8", "non-UTF-8 text", "empty", "blank lines", "malformed JSON", "not an object", "JSON document",
         "folder", "folder with a data suffix"]


@pytest.mark.parametrize("case", CASES)
def test_each_bad_data_file_is_refused_with_its_row(bad_files, case):
    """load_source is what the preflight (check_io.data_check) and the ranks (stages.load_stage_data) read with."""
    spec, words = bad_files[case]
    line = _refused(load_source, spec, "stages[s].data[0]")
    assert line.startswith("stages[s].data[0]: ") and words in line, line


def test_good_files_still_load(tmp_path):
    jsonl = _write(tmp_path / "ok.jsonl", b'{"text": "a"}\n\n{"text": "b"}\n')
    doc = _write(tmp_path / "ok.json", b'[{"text": "a"}, {"text": "b"}]')
    assert len(load_source(jsonl, "w")) == 2 and len(load_source(doc, "w")) == 2


def test_a_stage_too_small_to_hold_out_any_sample_is_refused():
    stage = Stage(name="tiny", data=["one.jsonl"], steps=2)
    line = _refused(check_held_out, stage, [1], 8)
    assert line.startswith("stages[tiny].data: 1 row(s): too few to hold any out") and "eval_samples: 0" in line
    check_held_out(stage, [4], 8)  # a quarter of 4 is one sample
    check_held_out(stage, [1], 0)  # no evaluation asked for
    check_held_out(Stage(name="own", data=["one.jsonl"], steps=2, eval_data=["held.jsonl"]), [1], 8)


def test_stage_without_name_or_data_and_warmup_longer_than_the_stage():
    assert _refused(build_stage, {"data": ["x.jsonl"], "steps": 2}, 1, None).startswith(
        "stages[1].name: missing") and "give each stage a name" in _refused(build_stage, {"steps": 2}, 1, None)
    assert _refused(parse_stages, [{"name": "a", "steps": 2}], "r.yaml").startswith("stages[0].data: missing")
    line = _refused(build_stage, {"name": "s", "data": ["x"], "steps": 3, "warmup_steps": 3}, 0, None)
    assert line.startswith("stages[s].warmup_steps: must be shorter than the stage's 3 steps"), line
    from hf_zero.data.curriculum import build_schedule

    epochs = Stage(name="e", data=["x"], epochs=1, warmup_steps=5)  # its length is known after tokenization
    assert _refused(build_schedule, [epochs], [16], 4, 1e-3).startswith("stages[e].warmup_steps: must be shorter "
                                                                        "than the stage's 4 steps")


def test_max_seq_length_above_the_models_positions():
    from hf_zero.data.model_names import get_model_config
    from hf_zero.preflight.check_rules import verify_seq_length

    config = get_model_config("tiny-llama")  # 512 positions
    assert _refused(verify_seq_length, config, 10_000_000, []) == (
        "max_seq_length: 10000000 is more than the model's 512 positions (max_position_embeddings); use at most 512")
    stage = Stage(name="long", data=["x"], steps=1, max_seq_length=513)
    assert _refused(verify_seq_length, config, 64, [stage]).startswith("stages[long].max_seq_length: 513")
    verify_seq_length(config, 512, [Stage(name="ok", data=["x"], steps=1, max_seq_length=512)])


def test_classification_labels_checked_as_the_run_checks_them(tmp_path):
    from hf_zero.data.classification import check_classification_data
    from hf_zero.plan.arguments import ClassificationArguments

    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"text": f"t{i}", "label": ["a", "b"][i % 2]}) + "\n" for i in range(8)))
    held = tmp_path / "held.jsonl"
    held.write_text(json.dumps({"text": "x", "label": "c"}) + "\n")  # not a training class
    args = ClassificationArguments(output_dir=str(tmp_path / "o"), eval_data=str(held))
    stages = [Stage(name="s", data=[str(train)], steps=1)]
    assert "label 'c' is not one of the 2 classes" in _refused(check_classification_data, stages, args)
    held.write_text(json.dumps({"text": "x", "label": "b"}) + "\n")
    assert check_classification_data(stages, args).endswith("held out: 1")


def test_check_runs_the_same_functions(tmp_path, bad_files):
    """run_checks (`hf-zero check`, and `hf-zero train` before a launch) reports them, one problem per stage."""
    from hf_zero.preflight.checks import run_checks

    recipe = yaml.safe_load(TINY.read_text())
    recipe.update(max_seq_length=100_000, stages=[
        {"name": "latin", "data": bad_files["non-UTF-8"][0], "steps": 2},
        {"data": str((TINY.parent / "../data/tiny/short.jsonl").resolve()), "steps": 2},
        {"name": "one", "data": _write(tmp_path / "one.jsonl", b'{"text": "a b"}\n'), "steps": 2},
        {"name": "warm", "data": str((TINY.parent / "../data/tiny/short.jsonl").resolve()), "steps": 2,
         "warmup_steps": 2}])
    config = tmp_path / "bad.yaml"
    config.write_text(yaml.safe_dump(recipe))
    args = Namespace(profile="cpu", config=str(config), nproc=None, hostfile=None, output_dir=str(tmp_path / "o"),
                     gpus=None, precision=None, recipe=str(RECIPE), extra=[])
    for light in (True, False):
        results = {r.name: r for r in run_checks(args, light=light)}
        assert not results["model"].ok and "max_seq_length: 100000 is more than the model's 512" in \
            results["model"].message
        data = results["data"].message
        for words in ("latin.jsonl row 6: byte 0xe9 is not UTF-8", "stages[1].name: missing",
                      "stages[one].data: 1 ", "stages[warm].warmup_steps: must be shorter"):
            assert words in data, data
    assert not (tmp_path / "o").exists()


def test_launch_path_model_check_reads_files_as_the_full_check_loads_them(tmp_path):
    """`hf-zero train`'s model check (light: config.json, tokenizer.json and the weights' names read as files) gives
    the full check's verdict on LoRA targets: refused when peft would find none of them, passed when it would."""
    from hf_zero.preflight.checks import run_checks

    for targets, ok in ((["qq_proj", "vv"], False), (["q_proj", "nope"], True), (["self_attn.v_proj"], True)):
        args = Namespace(profile="cpu", config=str(TINY), nproc=None, hostfile=None, output_dir=str(tmp_path / "o"),
                         gpus=None, precision=None, recipe=str(RECIPE),
                         extra=["--use_peft", "true", "--lora_target_modules", *targets])
        verdicts = [{r.name: r for r in run_checks(args, light=light)}["model"] for light in (True, False)]
        assert [v.ok for v in verdicts] == [ok, ok], (targets, [v.message for v in verdicts])
        assert ok or all(v.error.field == "lora_target_modules" for v in verdicts)
    assert "parameters counted by `hf-zero check`" in verdicts[0].message


def _bad_recipe(tmp_path) -> Path:
    data = tmp_path / "latin.jsonl"
    data.write_bytes(b'{"text": "hello world"}\n' * 5 + b'{"text": "caf\xe9"}\n')
    recipe = yaml.safe_load(TINY.read_text())
    recipe["stages"] = [{"name": "latin", "data": str(data), "steps": 2}]
    config = tmp_path / "bad.yaml"
    config.write_text(yaml.safe_dump(recipe))
    return config


def _one_line(proc, words: str) -> str:
    out = proc.stdout + proc.stderr
    lines = [ln for ln in out.splitlines() if ERROR in ln]
    assert len(lines) == 1 and words in lines[0], out[-3000:]
    return lines[0]


WORDS = "stages[latin].data[0]: "


def test_hf_zero_train_refuses_a_bad_file_before_launch(tmp_path):
    proc = run_cmd([sys.executable, "-m", "hf_zero.cli", "train", "--profile", "zero2", "--config",
                    _bad_recipe(tmp_path), "--output_dir", tmp_path / "o"], timeout=600, check=False)
    assert proc.returncode == 2, (proc.stdout + proc.stderr)[-3000:]
    assert "latin.jsonl row 6: byte 0xe9 is not UTF-8" in _one_line(proc, WORDS)
    assert "Traceback" not in proc.stdout + proc.stderr
    assert not (tmp_path / "o").exists()


@pytest.mark.multiproc
def test_plain_accelerate_launch_refuses_a_bad_file_in_the_ranks(tmp_path):
    """No preflight before the ranks here: their data loading (before any model or engine) gives the line."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(PROFILES / "zero2.yaml"),
           str(RECIPE), "--config", str(_bad_recipe(tmp_path)), "--output_dir", str(tmp_path / "o")]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0 and "exitcode  : 2" in proc.stderr, proc.stderr[-3000:]
    line = _one_line(proc, WORDS)
    assert "row 6: byte 0xe9 is not UTF-8" in line
    tail = [ln for ln in proc.stderr.strip().splitlines() if not set(ln) <= set("=- ")]
    assert tail[-1] == line
    assert "UnicodeDecodeError" not in proc.stdout + proc.stderr
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())


WRITER = '''
import errno, sys, time
from hf_zero.launch.worker import recipe_entry


@recipe_entry
def main(out, where):
    from hf_zero.launch.interrupt import note_run

    note_run(out)
    if where == "tensorboard":  # the disk fills while TensorBoard's thread writes the event file
        from tensorboard.summary.writer.record_writer import RecordWriter
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(out + "/runs")
        writer.flush()

        def full(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

        RecordWriter.write = full
        for i in range(100):
            writer.add_scalar("loss", 1.0, i)
            time.sleep(0.05)
        writer.flush()
    else:  # the kernel refuses summary.json's bytes (a file size limit: a real failed write, no root needed)
        import resource
        import signal

        from hf_zero.core.files import write_json_atomic

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64, 64))
        write_json_atomic(out + "/summary.json", {"loss": "x" * 1000})
    print("not reached")


main(*sys.argv[1:])
'''


@pytest.mark.parametrize("where,words", [
    ("tensorboard", "runs/events.out.tfevents."), ("summary", "summary.json: File too large")])
def test_a_failed_write_outside_a_checkpoint_is_one_line(tmp_path, where, words):
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    out = tmp_path / "run"
    out.mkdir()
    proc = subprocess.run([sys.executable, str(script), str(out), where], capture_output=True, text=True,
                          timeout=300, cwd=REPO, env={**__import__("os").environ, "RANK": "0"})
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2, text[-3000:]
    assert "Traceback" not in text and "not reached" not in text and "Exception in thread" not in text, text
    assert text.strip().count("\n") == 0, text  # the one line, nothing else
    line = text.strip()
    assert line.startswith(f"{ERROR} disk: could not write {out}/") and words in line, line
    assert line.endswith("free space; no complete checkpoint was written yet"), line
    assert not list(out.glob(".summary.json.tmp-*"))  # no half-written temp file left behind
