"""Leftovers and no-ops (issue 39, item 7): DeepSpeed's converter ends with the process that started it; a resume
that would change nothing, train nothing or skip part of a stage is one line; --max_steps is applied; `hf-zero
convert` refuses a negative rank count and an --out inside the checkpoint. In-process but for the converter, which
runs as the child process it is in a resume."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from testing_utils import REPO, TINY, with_meta

from hf_zero.checkpoint.compare import check_resume_settings
from hf_zero.checkpoint.convert import convert_checkpoint
from hf_zero.core.errors import UserError

# ---------------------------------------------------------------- ds_to_universal dies with its parent

# Stands in for `python -m ... ds_to_universal` (started as sys.executable): still writing its .partial folder.
FAKE_CONVERTER = """#!/bin/sh
echo $$ > "$HF_ZERO_TEST_PIDFILE"
exec sleep 300
"""

PARENT = """
import sys
from pathlib import Path
from hf_zero.checkpoint.convert import convert_to_universal
sys.executable = sys.argv[2]
convert_to_universal(Path(sys.argv[1]))
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")  # a killed child waits as a zombie for a reaper that may never come


def test_the_converter_dies_with_the_process_that_started_it(tmp_path):
    """Before: `ds_to_universal`, started by a rank resuming on another rank count (or by `hf-zero convert`),
    outlived a SIGKILLed parent and kept writing its `.partial`. After: the kernel ends it with its parent."""
    fake = tmp_path / "converter.sh"
    fake.write_text(FAKE_CONVERTER)
    fake.chmod(0o755)
    ck = tmp_path / "checkpoint-6"
    (ck / "global_step6").mkdir(parents=True)
    (ck / "latest").write_text("global_step6")
    pidfile = tmp_path / "converter.pid"
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_ZERO_TEST_PIDFILE": str(pidfile)}
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(ck), str(fake)], env=env, cwd=tmp_path)
    child = None
    try:
        deadline = time.time() + 240
        while not pidfile.is_file() or not pidfile.read_text():
            assert parent.poll() is None, "the parent ended before starting the converter"
            assert time.time() < deadline, "the converter never started"
            time.sleep(0.2)
        child = int(pidfile.read_text())
        assert _alive(child)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.time() + 60
        while _alive(child) and time.time() < deadline:
            time.sleep(0.2)
        assert not _alive(child), "the converter outlived its SIGKILLed parent"
    finally:
        if parent.poll() is None:
            parent.kill()
        if child is not None and _alive(child):
            os.kill(child, signal.SIGKILL)


# ---------------------------------------------------------------- a resume that changes or trains nothing

def _settings(lr: float, stage_lrs: list) -> dict:
    return {"learning_rate": lr, "seed": 1,
            "stages": [{"name": f"s{i}", "steps": 10, "learning_rate": v} for i, v in enumerate(stage_lrs)]}


def test_allow_changes_learning_rate_that_no_stage_uses_is_refused():
    """Before: `--allow_changes learning_rate` with every stage setting its own LR "applied" and changed nothing."""
    with pytest.raises(UserError) as err:
        check_resume_settings("checkpoint-6", _settings(1e-4, [3e-4, 1e-4]), _settings(5e-4, [3e-4, 1e-4]),
                              "learning_rate")
    assert err.value.field == "learning_rate" and "changes nothing" in err.value.problem
    assert "s0: 0.0003" in err.value.problem
    # A stage without its own LR takes the new one: applied.
    assert check_resume_settings("checkpoint-6", _settings(1e-4, [3e-4, None]), _settings(5e-4, [3e-4, None]),
                                 "learning_rate") == ["learning_rate"]


def _lay_out(tmp_path, steps: list[int], max_steps: int = -1, resumed: dict | None = None):
    from hf_zero.core.config import Stage
    from hf_zero.plan.arguments import CurriculumArguments, ModelArguments
    from hf_zero.plan.parse import parse_recipe_args
    from hf_zero.train.recipe_steps import lay_out

    _, _, training, _ = parse_recipe_args((ModelArguments, CurriculumArguments),
                                          ["--config", str(TINY), "--output_dir", str(tmp_path), "--use_cpu", "true",
                                           "--max_steps", str(max_steps)])
    stages = [Stage(name=f"s{i}", data=["x.jsonl"], steps=n) for i, n in enumerate(steps)]
    ctx = SimpleNamespace(training_args=CurriculumArguments(**training), stages=stages, resumed=resumed,
                          plan=SimpleNamespace(batch=SimpleNamespace(global_batch=4)))
    lay_out(ctx, [400] * len(steps), [[400]] * len(steps), has_eval=False)
    return ctx.training_args.max_steps


def _at(step: int, index: int, done: int) -> dict:
    return {"name": f"checkpoint-{step}", "step": step, "stage": {"index": index, "name": f"s{index}",
                                                                  "steps_done": done, "steps": 20}}


def test_max_steps_is_applied_or_refused_in_one_line(tmp_path):
    """Before: --max_steps was replaced by the stages' length without a word, on a resume too."""
    assert _lay_out(tmp_path, [20, 10]) == 30
    assert _lay_out(tmp_path, [20, 10], max_steps=13) == 13
    assert _lay_out(tmp_path, [20, 10], max_steps=13, resumed=_at(12, 0, 12)) == 13
    assert _lay_out(tmp_path, [20, 10], max_steps=99) == 30
    with pytest.raises(UserError) as err:
        _lay_out(tmp_path, [20, 10], max_steps=10, resumed=_at(12, 0, 12))
    assert err.value.field == "max_steps" and "nothing would train" in err.value.problem


def test_a_stage_shortened_below_the_checkpoint_is_refused(tmp_path):
    """Before: accepted, and the summary recorded steps 11-11 (nothing trained)."""
    with pytest.raises(UserError) as err:  # the stage the checkpoint is 11 steps into now has 5
        _lay_out(tmp_path, [5, 10], resumed=_at(11, 0, 11))
    assert err.value.field == "stages[s0].steps" and "11 steps into stage 's0'" in err.value.problem
    with pytest.raises(UserError) as err:  # the curriculum now ends where the checkpoint is
        _lay_out(tmp_path, [11], resumed=_at(11, 0, 11))
    assert err.value.field == "stages" and "nothing would train" in err.value.problem
    assert _lay_out(tmp_path, [20, 10], resumed=_at(11, 0, 11)) == 30


# ---------------------------------------------------------------- hf-zero convert's arguments

def test_convert_refuses_a_negative_rank_count_and_an_out_inside_the_checkpoint(tmp_path):
    """Before: `--nproc -3` wrote `world_size: -3`; an --out inside the checkpoint was written into it."""
    ck = with_meta(tmp_path / "run")
    before = sorted(p.name for p in ck.rglob("*"))
    for nproc in (-3, 0):
        with pytest.raises(UserError) as err:
            convert_checkpoint(str(ck), "zero3", str(tmp_path / "out"), nproc=nproc)
        assert err.value.field == "--nproc" and f"{nproc} is not a number of ranks" in err.value.problem
    for inside in (ck / "converted", ck, ck / "global_step" / "x"):
        with pytest.raises(UserError) as err:
            convert_checkpoint(str(ck), "zero3", str(inside))
        assert err.value.field == "--out" and "inside the checkpoint" in err.value.problem
    assert sorted(p.name for p in ck.rglob("*")) == before and not (tmp_path / "out").exists()


def test_convert_nproc_from_the_command_line_is_one_line(tmp_path, capsys):
    from hf_zero.cli import main

    ck = with_meta(tmp_path / "run")
    assert main(["convert", str(ck), "--to", "zero3", "--nproc", "-3", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hf-zero: error: --nproc: -3 is not a number of ranks") and "\n" not in err


