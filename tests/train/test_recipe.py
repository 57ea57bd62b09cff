"""The curriculum recipe in one process on the tiny model, and its handling of bad input."""

import json
import sys
from pathlib import Path

import pytest
from testing_utils import RECIPE, REPO, TINY, read_summary, run_cmd

SUMMARY_KEYS = {"profile", "zero_stage", "offload_optimizer", "offload_param", "precision", "world_size",
                "micro_batch", "grad_accum", "global_batch", "runtime_s", "eval_loss_before", "eval_loss_after",
                "stages"}


@pytest.fixture(scope="module")
def single_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("single") / "run"
    proc = run_cmd([sys.executable, RECIPE, "--config", TINY, "--output_dir", out, "--disable_tqdm", "true"])
    return out, proc


@pytest.mark.recipe_run  # the recipe end to end in one process: make test, not make test-fast
def test_summary_and_stages(single_run):
    out, proc = single_run
    s = read_summary(out)
    assert SUMMARY_KEYS <= set(s)
    assert (s["profile"], s["zero_stage"], s["world_size"], s["precision"]) == ("single", 0, 1, "fp32")
    assert s["micro_batch"] * s["grad_accum"] * s["world_size"] == s["global_batch"] == 2
    assert [(st["name"], st["first_step"], st["steps"]) for st in s["stages"]] == [
        ("short", 1, 5), ("medium", 6, 5), ("long", 11, 5)]
    assert all(st["first_loss"] and st["last_loss"] and st["eval_loss"] for st in s["stages"])
    assert len(s["losses"]) == s["total_steps"] == 15
    assert s["eval_loss_after"] < s["eval_loss_before"]
    for line in ("stage 2/3 'medium' starts at step 6", "stage 3/3 'long' starts at step 11",
                 "2 micro x 1 accum x 1 ranks = 2 global", "profile single"):
        assert line in proc.stdout


@pytest.mark.recipe_run  # the recipe end to end in one process: make test, not make test-fast
def test_final_model_loads_without_hf_zero(single_run):
    out, _ = single_run
    code = (
        "import sys, torch; from transformers import AutoModelForCausalLM, AutoTokenizer;"
        f"m = AutoModelForCausalLM.from_pretrained({str(out / 'final')!r});"
        f"t = AutoTokenizer.from_pretrained({str(out / 'final')!r});"
        "ids = t('one two three', return_tensors='pt').input_ids; print(float(m(ids, labels=ids).loss))"
    )
    proc = run_cmd([sys.executable, "-c", code], cwd="/")  # outside the repo: hf_zero not needed
    assert 0 < float(proc.stdout.strip().splitlines()[-1]) < 20
    assert (out / "final" / "model.safetensors").stat().st_size > 100_000


@pytest.mark.recipe_run  # the recipe end to end in one process: make test, not make test-fast
def test_final_model_files_are_shareable(single_run):
    """Written like any file under the umask (safetensors' temporary files are private), with the model path."""
    import os

    out, _ = single_run
    umask = os.umask(0)
    os.umask(umask)
    assert all(p.stat().st_mode & 0o044 == 0o044 & ~umask for p in (out / "final").iterdir())
    s = read_summary(out)
    assert s["model"] == "tiny-llama" and Path(s["model_path"]).is_dir()


@pytest.mark.recipe_run  # the recipe end to end in one process: make test, not make test-fast
def test_export_a_run_dir_picks_final_or_the_newest_checkpoint(single_run, tmp_path, capsys):
    """`hf-zero export RUN_DIR`: a finished run's final/, else its newest complete checkpoint-N, said in one line;
    neither: one line naming both."""
    import shutil

    from safetensors.torch import load_file

    from hf_zero.checkpoint.store import crc32_of, file_sizes, write_manifest
    from hf_zero.cli import main

    out, _ = single_run
    assert not list(out.glob("checkpoint-*"))  # a default run saves no checkpoint
    assert main(["export", str(out), "--out", str(tmp_path / "from_final")]) == 0
    assert f"[hf_zero] exporting {out / 'final'}: the finished run's model" in capsys.readouterr().out
    final = load_file(str(out / "final" / "model.safetensors"))
    assert load_file(str(tmp_path / "from_final" / "model.safetensors")).keys() == final.keys()

    run = tmp_path / "run"  # a run stopped before its end: checkpoints, no final/, the newest one half written
    for step in (2, 4, 6):
        folder = run / f"checkpoint-{step}"
        shutil.copytree(out / "final", folder)
        (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
        if step < 6:
            write_manifest(folder, {rel: crc32_of(folder / rel) for rel in file_sizes(folder)})
    assert main(["export", str(run), "--out", str(tmp_path / "from_checkpoint")]) == 0
    captured = capsys.readouterr()
    assert f"exporting {run / 'checkpoint-4'}: the newest complete checkpoint in {run}" in captured.out
    assert "skipping checkpoint-6" in captured.err and (tmp_path / "from_checkpoint" / "config.json").is_file()

    shutil.rmtree(run / "checkpoint-2")
    shutil.rmtree(run / "checkpoint-4")
    assert main(["export", str(run), "--out", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"hf-zero: error: export: {run} holds no complete checkpoint-N (1 incomplete) and "
                              "no final/; ") and not (tmp_path / "nothing").exists()


@pytest.mark.recipe_run  # the recipe end to end in one process: make test, not make test-fast
def test_finished_run_under_make_suggests_args(single_run):
    """`make train` on a finished run: the way to train again is given in make's form."""
    out, _ = single_run
    proc = run_cmd([sys.executable, "-m", "hf_zero.cli", "train", "--profile", "cpu", "--config", TINY,
                    "--output_dir", out, "--disable_tqdm", "true"], env={"HF_ZERO_VIA_MAKE": "1"})
    assert f"{out} holds a finished run" in proc.stdout and 'To train again: ARGS="--fresh_start true"' in proc.stdout


@pytest.mark.recipe_run  # the recipe end to end in one process: make test, not make test-fast
def test_tensorboard_logs_stage_and_eval(single_run):
    out, _ = single_run
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = list(out.rglob("events.out.tfevents.*"))
    assert events, "TensorBoard event file under the output dir"
    acc = EventAccumulator(str(events[0].parent))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/learning_rate", "train/stage", "eval/short_loss", "eval/short_perplexity",
            "train/tokens_per_second"} <= tags
    stages = [e.value for e in acc.Scalars("train/stage")]
    assert stages == [0] * 5 + [1] * 5 + [2] * 5


@pytest.mark.recipe_run  # the recipe end to end in one process: make test, not make test-fast
def test_lr_follows_stage_schedule(single_run):
    out, _ = single_run
    hist = json.loads((out / "log_history.json").read_text())
    lrs = {h["step"]: h["learning_rate"] for h in hist if "learning_rate" in h}
    assert lrs[1] == pytest.approx(3e-3 / 2)  # stage short: warmup 1 step to 3e-3
    assert lrs[6] == pytest.approx(2e-3)  # stage medium restarts at its own peak
    assert lrs[11] == pytest.approx(1e-3)


def run_bad(*args, cwd=REPO):
    return run_cmd([sys.executable, RECIPE, *args], cwd=cwd, timeout=300, check=False)


@pytest.mark.parametrize("args,field", [
    (["--config", TINY, "--lora_rank", "4"], "--lora_rank"),
    (["--config", "missing.yaml"], "--config"),
    (["--config", TINY, "--global_batch_size", "3"], "global_batch_size"),
    (["--config", TINY, "--bf16", "true", "--fp16", "true"], "precision"),
    (["--config", TINY, "--model_name_or_path", "./no/such/model"], "model_name_or_path"),
])
def test_bad_input_is_one_line_exit_2(tmp_path, args, field):
    proc = run_bad(*args, "--output_dir", tmp_path / "o")
    assert proc.returncode == 2, proc.stderr[-2000:]
    err = [ln for ln in proc.stderr.splitlines() if ln.startswith("hf-zero: error:")]
    assert len(err) == 1 and field in err[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_bad_stage_data_keeps_existing_output(tmp_path):
    out = tmp_path / "o"
    (out / "checkpoint-4").mkdir(parents=True)
    (out / "checkpoint-4" / "keep.txt").write_text("earlier work")
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(TINY.read_text().replace("../data/tiny/short.jsonl", str(REPO / "recipes/data/tiny/nope.jsonl")))
    proc = run_bad("--config", cfg, "--output_dir", out)
    assert proc.returncode == 2 and "stages[short].data[0]" in proc.stderr and "Traceback" not in proc.stderr
    assert (out / "checkpoint-4" / "keep.txt").read_text() == "earlier work"
