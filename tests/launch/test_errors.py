"""One line or nothing: mistakes found before or inside a launch, Ctrl-C, re-runs of finished runs, the
eval means in the summary, and the console of a 2-rank run as a log file sees it.

Runs go through the real launchers: `hf-zero train` (hf_zero's launcher around accelerate's) and plain
`accelerate launch`, with 2 CPU ranks on the tiny curriculum."""

import hashlib
import json
import math
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from testing_utils import PROFILES, RECIPE, REPO, TINY, foreign_lines, read_summary, run_cmd

ERROR = "hf-zero: error:"


def hf_zero(*args, cwd=REPO, timeout=900):
    return run_cmd([sys.executable, "-m", "hf_zero.cli", *args], cwd=cwd, timeout=timeout, check=False)


def accelerate(*args, launcher_flags=(), timeout=900):
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", PROFILES / "zero2.yaml",
           *launcher_flags, RECIPE]
    return subprocess.run([str(c) for c in cmd + list(args)], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def tiny(tmp_path, name="recipe.yaml", text=None, **changes) -> Path:
    """The tiny recipe (data paths made absolute) with top-level keys changed, written to tmp_path."""
    data = yaml.safe_load(TINY.read_text())
    for stage in data["stages"]:
        stage["data"] = [str((TINY.parent / d).resolve()) for d in
                         (stage["data"] if isinstance(stage["data"], list) else [stage["data"]])]
    data.update(changes)
    path = tmp_path / name
    path.write_text(text if text is not None else yaml.safe_dump(data, sort_keys=False))
    return path


def bad_inputs(tmp_path):
    """(name, recipe YAML, extra flags, words the line must hold) for each kind of mistake."""
    (tmp_path / "a_file").write_text("not a folder")
    return {
        "unknown key": (tiny(tmp_path, "key.yaml", lerning_rate=0.1), [], "lerning_rate"),
        "wrong type": (tiny(tmp_path, "type.yaml", learning_rate="fast"), [], "learning_rate: 'fast' is not a number"),
        "fp16 on CPU": (tiny(tmp_path), ["--precision", "fp16"], "fp16, which needs a GPU"),
        "output_dir a file": (tiny(tmp_path), ["--output_dir", tmp_path / "a_file"], "is a file"),
        "invalid YAML": (tiny(tmp_path, "yaml.yaml", text="learning_rate: 1\n  seed: [\n"), [], "line 2, column"),
    }


def one_error_line(proc, words):
    out = proc.stdout + proc.stderr
    lines = [ln for ln in out.splitlines() if ERROR in ln]
    assert len(lines) == 1 and words in lines[0], out[-3000:]
    return lines[0]


@pytest.mark.parametrize("case", ["unknown key", "wrong type", "fp16 on CPU", "output_dir a file", "invalid YAML"])
def test_bad_input_through_hf_zero_train_is_one_line_exit_2(tmp_path, case):
    config, extra, words = bad_inputs(tmp_path)[case]
    proc = hf_zero("train", "--profile", "zero2", "--config", config, "--output_dir", tmp_path / "o", *extra)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert one_error_line(proc, words).startswith(ERROR)
    assert "Traceback" not in proc.stdout + proc.stderr
    assert not (tmp_path / "o").exists()  # caught before any process started


@pytest.mark.parametrize("flags,words", [(["--nproc", "0"], "--nproc: must be at least 1, got 0"),
                                         (["--nproc", "-2"], "--nproc: must be at least 1"),
                                         (["--nodes", "2", "--machine-rank", "2"], "--machine-rank: 2 with")])
def test_bad_hf_zero_flags_are_one_line(capsys, flags, words):
    from hf_zero.cli import main

    for dry in ([], ["--dry-run"]):  # a dry run prints no command with 0 processes either
        assert main(["train", "--profile", "zero2", "--config", str(TINY), *flags, *dry]) == 2
        captured = capsys.readouterr()
        assert captured.err.strip() == captured.err.strip().splitlines()[0] and words in captured.err
        assert captured.err.startswith(ERROR) and not captured.out


@pytest.mark.multiproc
def test_mistake_found_inside_the_ranks_crosses_the_launcher_once(tmp_path):
    """A stage whose texts are all blank passes the preflight (which does not tokenize) and stops both ranks."""
    empty = tmp_path / "blank.jsonl"
    empty.write_text('{"text": "  "}\n{"text": ""}\n' * 2)  # 4 rows: enough for the preflight's held-out slice
    config = tiny(tmp_path, stages=[{"name": "blank", "data": str(empty), "steps": 2}])
    proc = hf_zero("train", "--profile", "zero2", "--config", config, "--output_dir", tmp_path / "o")
    assert proc.returncode == 2, (proc.stdout + proc.stderr)[-3000:]
    line = one_error_line(proc, "stages[blank].data[0]")
    assert (proc.stdout + proc.stderr).strip().splitlines()[-1] == line  # the last thing the user reads
    assert "Traceback" not in proc.stdout + proc.stderr and "ChildFailedError" not in proc.stderr


@pytest.mark.multiproc
def test_a_bug_on_one_rank_keeps_its_traceback_once(tmp_path):
    """Not a user error: the failing rank's traceback (its own console is silent) and one line naming the rank."""
    script = tmp_path / "buggy.py"
    script.write_text("import os, time\nfrom hf_zero.launch.worker import recipe_entry\n\n\n"
                      "@recipe_entry\ndef main():\n"
                      "    if os.environ['RANK'] == '1':\n        raise RuntimeError('boom on rank 1')\n"
                      "    time.sleep(120)\n\n\nif __name__ == '__main__':\n    main()\n")
    proc = hf_zero("train", "--profile", "zero2", "--recipe", script, "--config", TINY, "--output_dir", tmp_path / "o")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    assert out.count("Traceback (most recent call last)") == 1 and "RuntimeError: boom on rank 1" in out
    assert out.strip().splitlines()[-1] == "hf-zero: rank 1 failed (exit code 1); its traceback is above"
    assert ERROR not in out and "ChildFailedError" not in out


# CI sees the same path (a user error inside the ranks under plain accelerate launch) in `make test-extended`:
# tests/plan/test_preflight_io.py's bad file, found deeper in the ranks (data loading); each case here is a launch.
ACCELERATE_CASES = [pytest.param(c, marks=pytest.mark.slow) for c in
                    ("unknown key", "wrong type", "fp16 on CPU", "output_dir a file", "invalid YAML")]


@pytest.mark.multiproc
@pytest.mark.parametrize("case", ACCELERATE_CASES)
def test_bad_input_through_plain_accelerate_launch_ends_with_the_line(tmp_path, case):
    """Under accelerate's own launcher the ranks exit 2 and name the line in torch elastic's error file: its
    failure report ends with the line, once. (Its traceback and exit code 1 are accelerate's; `hf-zero train`
    is the launcher that prints only the line.)"""
    config, extra, words = bad_inputs(tmp_path)[case]
    launcher_flags = ["--mixed_precision", "fp16"] if extra[:1] == ["--precision"] else []  # accelerate's flag
    recipe_flags = [] if launcher_flags else extra
    proc = accelerate("--config", config, "--output_dir", tmp_path / "o", *recipe_flags,
                      launcher_flags=launcher_flags)
    assert proc.returncode != 0
    line = one_error_line(proc, words)
    tail = [ln for ln in proc.stderr.strip().splitlines() if not set(ln) <= set("=- ")]
    assert tail[-1] == line and "exitcode  : 2" in proc.stderr, proc.stderr[-3000:]


# ---------------------------------------------------------------- a finished 2-rank run, its console and re-run

@pytest.fixture(scope="module")
def finished(strategy_runs):
    """The session's zero2 run (tests/conftest.py): `hf-zero train` on 2 ranks, checkpoints every 5 steps, stdout
    and stderr captured to one file as a Slurm log would."""
    run = strategy_runs["zero2"]
    return run.out, run.log, run.args


@pytest.mark.multiproc
def test_console_in_a_log_file(finished):
    out, log, _ = finished
    text = log.read_text()
    assert "\x1b[" not in text and "\r" not in text  # no cursor codes, no progress bar redraws
    assert "Setting accelerator to CPU" not in text and "OMP_NUM_THREADS" not in text
    assert "built successfully" not in text and "{'loss'" not in text
    assert foreign_lines(text) == []  # no library's warning, bar or notice: hf_zero's lines only
    lines = text.strip().splitlines()
    steps = [ln for ln in lines if ln.startswith("step ")]
    assert len(steps) == 15 and all(" | loss " in s and " | lr " in s and " tok/s" in s for s in steps)
    assert steps[5].startswith("step 6/15 | stage 2/3 medium | loss ")
    # a log file has no progress bar: each step line says how long the run has taken and how long it will take
    assert all(re.search(r" tok/s \| elapsed \w+ \| left \w+$", s) for s in steps)
    assert steps[-1].endswith(" | left 0s")
    evals = [ln for ln in lines if ln.startswith("eval ")]
    assert len(evals) == 4 and evals[0].startswith("eval before training: short ")
    assert "(end of stage 'medium')" in evals[2] and " | mean " in evals[2]
    s = read_summary(out)
    result = [ln for ln in lines if ln.startswith("[hf_zero] done:")]
    assert result == [lines[-4]]  # one result line, then where the curves are and what to run next
    assert f"eval loss {s['eval_loss_before']:.4f} -> {s['eval_loss_after']:.4f}" in result[0]
    assert evals[-1].endswith(f" | mean {s['eval_loss_after']:.4f}")
    assert str(out / "final") in result[0]
    assert lines[-3:] == [f"  curves: {out}/loss.png, or tensorboard --logdir {out}/runs",
                          f'  try it: hf-zero generate --model {out}/final --prompt "..."',
                          f"  export: hf-zero export {out} --out {out}_hf"]
    assert sum("hf_zero | profile zero2" in ln for ln in lines) == 1  # rank 0's console only


@pytest.mark.multiproc
def test_loss_plot_and_tensorboard_mean_loss(finished):
    out, _, _ = finished
    s = read_summary(out)
    assert (out / "loss.png").read_bytes()[:4] == b"\x89PNG" and (out / "loss.png").stat().st_size > 20_000
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(next((out / "runs").rglob("events.out.tfevents.*")).parent))
    acc.Reload()
    means = [(e.step, e.value) for e in acc.Scalars("eval/mean_loss")]
    assert [step for step, _ in means] == [0, 5, 10, 15]
    assert means[0][1] == pytest.approx(s["eval_loss_before"]) and means[-1][1] == pytest.approx(s["eval_loss_after"])


@pytest.mark.multiproc
def test_start_up_talks_from_its_first_seconds_to_the_first_step(strategy_runs):
    """The session's zero2 `hf-zero train`, its console as it arrived: the first line before the first heartbeat
    would come (printed before torch loads: ~1 s on a quiet box, 2-3 s with `make test`'s other worker beside it),
    then a line at least every 10 s until the first step (the heartbeat names the phase and the seconds since the
    command began); summary.json says where the start-up went."""
    run = strategy_runs["zero2"]
    first_at, first = run.times[0]
    assert first.startswith("[hf_zero] checking ") and first_at < 10, run.times[:3]
    step1 = next(i for i, (_, ln) in enumerate(run.times) if ln.startswith("step 1/"))
    at = [t for t, _ in run.times[:step1 + 1]]
    # a 10 s beat, polled each second; `make test`'s other worker shares the 2 cores (12.4 s seen once, 15.9 s once
    # on 2026-11-27 between the first line and rank 0's banner, where a quiet box has 8 s and no beat is due: not the
    # GIL, a thread beats every 0.4 s through the torch/DeepSpeed imports; the cause is still open, issue 40)
    assert max(b - a for a, b in zip(at, at[1:])) < 20, run.times[:step1 + 1]
    beats = [ln for _, ln in run.times[:step1] if ln.startswith("[hf_zero] ") and ln.endswith(" s)")]
    assert all(re.fullmatch(r"\[hf_zero\] [a-z].* \(\d+ s\)", ln) for ln in beats) and beats[0] == first
    phases = read_summary(run.out)["startup_s"]
    for words in ("checking ", "resolving the run plan", "starting the ranks", "setting up the process group",
                  "building the model", "building the Trainer", "initializing the engine"):
        assert any(p.startswith(words) for p in phases), (words, phases)
    assert all(s > 0 for s in phases.values()) and sum(phases.values()) < at[step1] + 1


@pytest.mark.multiproc
def test_eval_means_and_stage_ends_match_log_history(finished):
    out, _, _ = finished
    s = read_summary(out)
    history = json.loads((out / "log_history.json").read_text())
    at = {}
    for h in history:
        for k, v in h.items():
            if re.fullmatch(r"eval_(\w+)_loss", k):
                at.setdefault(h["step"], {})[k[5:-5]] = v
    names = ["short", "medium", "long"]
    assert sorted(at) == [0, 5, 10, 15]
    assert s["eval_loss_before"] == pytest.approx(sum(at[0][n] for n in names) / 3, abs=1e-12)
    assert s["eval_loss_after"] == pytest.approx(sum(at[15][n] for n in names) / 3, abs=1e-12)
    assert s["eval_perplexity_after"] == pytest.approx(math.exp(s["eval_loss_after"]))
    for row, end in zip(s["stages"], (5, 10, 15)):
        assert row["eval_loss_before"] == at[0][row["name"]]
        assert row["eval_loss"] == at[end][row["name"]]  # at the end of its own stage
        assert row["eval_loss_after"] == at[15][row["name"]]
        assert row["tokens_per_second"] > 0
    assert all(h.get("tokens_per_second", 1) > 0 for h in history if "loss" in h)


def _snapshot(out: Path) -> dict:
    return {str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(out.rglob("*")) if p.is_file()}


@pytest.mark.multiproc
def test_rerunning_a_finished_run_touches_nothing(finished):
    out, _, args = finished
    before = _snapshot(out)
    assert "summary.json" in before and any(k.startswith("checkpoint-15/") for k in before)
    proc = hf_zero(*args)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert f"{out} holds a finished run" in proc.stdout and "--fresh_start true" in proc.stdout
    assert _snapshot(out) == before


@pytest.mark.recipe_run
def test_fresh_start_keeps_the_finished_run_aside(tmp_path, quiet_env):
    """One process, in-process-fast: a finished run, a re-run (nothing to do), then a fresh start."""
    out = tmp_path / "run"
    cmd = [sys.executable, RECIPE, "--config", TINY, "--output_dir", out]
    first = run_cmd(cmd, timeout=600, check=False)
    assert first.returncode == 0, first.stderr[-2000:]
    old = (out / "summary.json").read_text()
    again = run_cmd(cmd, timeout=600, check=False)
    assert again.returncode == 0 and "holds a finished run" in again.stdout
    fresh = run_cmd(cmd + ["--fresh_start", "true"], timeout=600, check=False)
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    assert (out / "previous-run" / "summary.json").read_text() == old
    assert (out / "previous-run" / "final" / "model.safetensors").is_file() and (out / "summary.json").is_file()


# ---------------------------------------------------------------- Ctrl-C

def interrupt_after_first_checkpoint(out: Path, args: list, signum=signal.SIGINT):
    log = open(f"{out}.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "hf_zero.cli", *map(str, args)], cwd=REPO, stdout=log,
                            stderr=subprocess.STDOUT)
    deadline = time.time() + 900
    while not (out / "latest_checkpoint").is_file():
        assert proc.poll() is None, Path(f"{out}.log").read_text()[-3000:]
        assert time.time() < deadline
        time.sleep(0.05)
    proc.send_signal(signum)
    rc = proc.wait(300)
    log.close()
    return rc, Path(f"{out}.log").read_text()


@pytest.mark.multiproc
def test_sigint_stops_every_rank_with_one_line(tmp_path):
    out = tmp_path / "run"
    args = ["train", "--profile", "zero2", "--config", TINY, "--output_dir", out, "--save_strategy", "steps",
            "--save_steps", "3"]
    rc, text = interrupt_after_first_checkpoint(out, args)
    assert rc == 130, text[-3000:]
    assert "Traceback" not in text and "KeyboardInterrupt" not in text and "SignalException" not in text
    lines = [ln for ln in text.splitlines() if ln.startswith("hf-zero: interrupted")]
    assert len(lines) == 1 and lines[0] == text.strip().splitlines()[-1], text[-3000:]
    step = int(re.search(r"at step (\d+) of 15", lines[0]).group(1))
    newest = max(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*"))
    assert step >= newest >= 3 and f"newest complete checkpoint: {out / f'checkpoint-{newest}'}" in lines[0]
    assert f"resume with: hf-zero train --profile zero2 --config {TINY}" in lines[0]
    assert not (out / "final").exists() and not (out / "summary.json").exists()


@pytest.mark.slow
@pytest.mark.multiproc
def test_sigterm_then_the_same_command_ends_with_the_uninterrupted_weights(tmp_path):
    from safetensors.torch import load_file

    flags = ["--profile", "zero2", "--config", TINY, "--save_strategy", "steps", "--save_steps", "3"]
    rc, text = interrupt_after_first_checkpoint(tmp_path / "run", ["train", *flags, "--output_dir",
                                                                    tmp_path / "run"], signal.SIGTERM)
    assert rc == 143 and "hf-zero: interrupted by SIGTERM at step" in text and "Traceback" not in text
    resumed = hf_zero("train", *flags, "--output_dir", tmp_path / "run")
    assert resumed.returncode == 0 and "resuming from" in resumed.stdout, resumed.stderr[-3000:]
    whole = hf_zero("train", *flags, "--output_dir", tmp_path / "whole")
    assert whole.returncode == 0
    a, b = (load_file(str(tmp_path / r / "final" / "model.safetensors")) for r in ("run", "whole"))
    assert a.keys() == b.keys() and max((a[k] - b[k]).abs().max().item() for k in a) == 0.0
