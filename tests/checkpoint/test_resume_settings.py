"""A resume never trains something else in silence (issues 21 and 25): a checkpoint or a finished run is compared
with what this run asks (hf_zero/checkpoint/compare.py), in the ranks and in `hf-zero train`'s preflight;
`--allow_changes` applies the new values exactly from the resumed step; `--resume_from_checkpoint` on a finished
run keeps the old results in previous-run/.

One trained single-process run (tiny curriculum, checkpoints at steps 6, 12, 15) is shared: each scenario works on
a copy."""

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import yaml
from testing_utils import RECIPE, TINY, run_cmd

from hf_zero.checkpoint.compare import (
    NOT_COMPARED,
    allowed_changes,
    check_finished_settings,
    check_resume_settings,
    differences,
)
from hf_zero.core.errors import UserError

ERROR = "hf-zero: error:"


def recipe_yaml(folder: Path, name: str = "recipe.yaml", short_steps: int = 5) -> Path:
    """The tiny curriculum without per-stage learning rates (so --learning_rate sets every stage's peak), data paths
    made absolute."""
    data = yaml.safe_load(TINY.read_text())
    for stage in data["stages"]:
        stage.pop("learning_rate", None)
        stage["data"] = [str((TINY.parent / d).resolve()) for d in
                         (stage["data"] if isinstance(stage["data"], list) else [stage["data"]])]
    data["stages"][0]["steps"] = short_steps
    path = folder / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def recipe(config, out, *flags, timeout=600):
    """The recipe in one plain process (no launcher): the ranks' own comparison."""
    cmd = [sys.executable, RECIPE, "--config", config, "--output_dir", out, "--save_strategy", "steps",
           "--save_steps", "6", "--sample_prompts", "0", "--disable_tqdm", "true", *flags]
    return run_cmd(cmd, timeout=timeout, check=False)


def snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def one_error_line(proc, *words):
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2, text[-3000:]
    assert "Traceback" not in text and "KeyError" not in text, text[-3000:]
    lines = [ln for ln in text.splitlines() if ln.startswith(ERROR)]
    assert len(lines) == 1, text[-3000:]
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def lrs(out: Path) -> dict[int, float]:
    return {h["step"]: h["learning_rate"] for h in json.loads((out / "log_history.json").read_text())
            if "learning_rate" in h}


@pytest.fixture(scope="module")
def trained(tmp_path_factory, quiet_env_module):
    root = tmp_path_factory.mktemp("resume_settings")
    config = recipe_yaml(root)
    out = root / "finished"
    proc = recipe(config, out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return config, out


@pytest.fixture(scope="module")
def quiet_env_module():
    """As conftest's quiet_env, for a module-scoped fixture: one plain process, not a rank of some launch."""
    mp = pytest.MonkeyPatch()
    for key in [k for k in os.environ if k.startswith(("ACCELERATE_", "HF_ZERO_PROFILE")) or k in
                ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")]:
        mp.delenv(key, raising=False)
    yield
    mp.undo()


def interrupted(trained, tmp_path) -> Path:
    """A copy of the run as if it had stopped after checkpoint-12."""
    out = tmp_path / "run"
    shutil.copytree(trained[1], out)
    for name in ("summary.json", "final", "checkpoint-15", "log_history.json"):
        shutil.rmtree(out / name, ignore_errors=True) if (out / name).is_dir() else (out / name).unlink()
    (out / "latest_checkpoint").write_text("checkpoint-12\n")
    return out


# ---------------------------------------------------------------- the comparison itself (no launch)

def test_differences_name_each_setting_and_ignore_what_does_not_train():
    old = {"learning_rate": 0.003, "seed": 42, "use_peft": False,
           "stages": [{"name": "a", "steps": 5, "data": ["x"]}, {"name": "b", "steps": 5, "data": ["y"]}]}
    new = {**old, "learning_rate": 0.01, "lora_r": 8,  # LoRA values do nothing without use_peft
           "stages": [{"name": "a", "steps": 6, "data": ["x"]}, {"name": "b", "steps": 5, "data": ["z"]}]}
    diff = differences(old, new)
    assert diff == {"learning_rate": "learning_rate 0.003 -> 0.01",
                    "stages": 'stages[a].steps 5 -> 6; stages[b].data ["y"] -> ["z"]'}
    assert {"logging_steps", "save_steps", "output_dir", "eval_steps", "report_to"} <= NOT_COMPARED
    assert differences({**old, "save_steps": 5}, {**old, "save_steps": 50}) == {}
    assert allowed_changes("learning_rate,seed") == allowed_changes(["learning_rate", "seed"]) == \
        allowed_changes(["learning_rate, seed"]) == {"learning_rate", "seed"}


def test_resume_check_refuses_allows_and_fixes():
    old = {"learning_rate": 0.003, "seed": 42, "use_peft": False, "model_name_or_path": "tiny-llama", "stages": []}
    with pytest.raises(UserError) as err:
        check_resume_settings("checkpoint-12", old, {**old, "learning_rate": 0.01, "seed": 7}, None)
    assert err.value.field == "resume" and "learning_rate 0.003 -> 0.01; seed 42 -> 7" in err.value.problem
    assert "--allow_changes learning_rate,seed" in err.value.fix and "--fresh_start true" in err.value.fix
    assert check_resume_settings("checkpoint-12", old, {**old, "learning_rate": 0.01, "seed": 7},
                                 ["learning_rate", "seed"]) == ["learning_rate", "seed"]
    assert check_resume_settings("checkpoint-12", old, old, ["logging_steps"]) == []  # free to change anyway
    with pytest.raises(UserError, match="unknown setting.*lerning_rate"):
        check_resume_settings("checkpoint-12", old, old, "lerning_rate")
    with pytest.raises(UserError, match="use_peft False -> True .LoRA adapters change the set of trained"):
        check_resume_settings("checkpoint-12", old, {**old, "use_peft": True, "lora_r": 16}, "use_peft,lora_r")
    with pytest.raises(UserError, match="learning_rate: finished with 0.003, asked 0.01"):
        check_finished_settings("runs/x", old, {**old, "learning_rate": 0.01})
    check_finished_settings("runs/x", old, dict(old))


# ---------------------------------------------------------------- the recipe's ranks

def test_resume_with_other_settings_is_refused_in_one_line(trained, tmp_path):
    config, _ = trained
    out = interrupted(trained, tmp_path)
    before = snapshot(out)
    other_stages = recipe_yaml(tmp_path, "other.yaml", short_steps=6)
    proc = recipe(other_stages, out, "--learning_rate", "0.01", "--seed", "7")
    line = one_error_line(proc, "checkpoint-12 was trained with other settings", "learning_rate 0.003 -> 0.01",
                          "seed 42 -> 7", "stages[short].steps 5 -> 6",
                          "--allow_changes learning_rate,seed,stages", "--fresh_start true", "--output_dir")
    assert line.startswith(f"{ERROR} resume:")
    # Adding LoRA changes the set of parameters: refused even when allowed, in one line (no KeyError).
    peft = recipe(config, out, "--use_peft", "true", "--allow_changes", "use_peft")
    one_error_line(peft, "use_peft False -> True", "LoRA adapters change the set of trained parameters")
    # `hf-zero check` (the preflight of `hf-zero train`) makes the same comparison before anything starts.
    check = run_cmd([sys.executable, "-m", "hf_zero.cli", "check", "--profile", "cpu", "--nproc", "1", "--config",
                     config, "--output-dir", out, "--learning_rate", "0.01"], timeout=600, check=False)
    assert check.returncode == 2, (check.stdout + check.stderr)[-3000:]
    assert "FAIL output: resume: checkpoint-12 was trained with other settings: learning_rate 0.003 -> 0.01" in \
        check.stdout
    assert snapshot(out) == before


def test_resume_of_a_finished_run_with_allowed_changes(trained, tmp_path):
    """--resume_from_checkpoint on a finished run: its results move to previous-run/ first; --allow_changes
    learning_rate: from step 12 on, the LR is the new schedule's (the old run's base LR once scaled it)."""
    from hf_zero.core.config import Stage
    from hf_zero.data.curriculum import build_schedule

    config, finished = trained
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    old = snapshot(out)
    proc = recipe(config, out, "--resume_from_checkpoint", out / "checkpoint-12", "--learning_rate", "0.01",
                  "--allow_changes", "learning_rate")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "applying from step 12: learning_rate 0.003 -> 0.01" in proc.stdout
    kept = snapshot(out / "previous-run")
    assert {k: v for k, v in old.items() if k in kept} == kept
    assert {"summary.json", "log_history.json", "final/model.safetensors", "checkpoint-15/hf_zero_manifest.json",
            "checkpoint-12/hf_zero_manifest.json"} <= set(kept)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed_from"] == str(out / "previous-run" / "checkpoint-12")
    assert summary["settings"]["learning_rate"] == 0.01

    stages = [Stage(**s) for s in yaml.safe_load(Path(config).read_text())["stages"]]
    schedule = {lr: build_schedule(stages, [1] * len(stages), 2, lr) for lr in (0.003, 0.01)}
    before, after = lrs(out / "previous-run"), lrs(out)
    # The step logged as s ran at lr_at(s - 1): the old run followed its schedule, the resumed one the new one.
    assert before and all(before[s] == pytest.approx(schedule[0.003].lr_at(s - 1), rel=1e-9) for s in before)
    assert sorted(s for s in after if s > 12) == [13, 14, 15]
    for s in (13, 14, 15):
        assert after[s] == pytest.approx(schedule[0.01].lr_at(s - 1), rel=1e-9), (s, after[s])


# ---------------------------------------------------------------- hf-zero train's preflight

def test_finished_run_asked_with_other_settings_is_refused_before_any_launch(trained, tmp_path):
    config, finished = trained
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    before = snapshot(out)

    def train(*flags):
        cmd = [sys.executable, "-m", "hf_zero.cli", "train", "--profile", "cpu", "--nproc", "1", "--config", config,
               "--output_dir", out, "--save_strategy", "steps", "--save_steps", "6", "--sample_prompts", "0", *flags]
        return run_cmd(cmd, timeout=600, check=False)

    proc = train("--learning_rate", "1e-2")
    one_error_line(proc, "output_dir:", "learning_rate: finished with 0.003, asked 0.01", "--fresh_start true",
                   "--output_dir")
    same = train()
    assert same.returncode == 0 and "nothing was changed" in same.stdout, (same.stdout + same.stderr)[-3000:]
    assert snapshot(out) == before
