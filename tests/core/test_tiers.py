"""The test tiers: `make test-fast` runs every test not marked `multiproc`, and a test there that starts a launcher
or a rank fails (tests/conftest.py with tests/process_guard/)."""

import os
import subprocess
import sys

import pytest
from testing_utils import GROUP_MARKS_ENV, PROCESS_GUARD


def _start(tmp_path, argv, **env):
    marks = tmp_path / "marks"
    marks.mkdir(exist_ok=True)
    full = {**os.environ, "PYTHONPATH": str(PROCESS_GUARD), GROUP_MARKS_ENV: str(marks), **env}
    subprocess.run([sys.executable, *map(str, argv)], env=full, check=True, capture_output=True, timeout=60)
    return sorted(p.read_text() for p in marks.iterdir())


def test_a_plain_process_leaves_no_mark(tmp_path):
    assert _start(tmp_path, ["-c", "pass"]) == []
    # A stand-in that only records a launch command line (tests/launch/test_slurm.py's fake python) is no launcher.
    script = tmp_path / "python"
    script.write_text("pass\n")
    assert _start(tmp_path, [script, "-m", "accelerate.commands.launch", "--num_processes", "2"]) == []


@pytest.mark.parametrize("how", ["rank", "launcher"])
def test_a_rank_or_a_launcher_leaves_its_mark(tmp_path, how):
    if how == "rank":  # torch elastic sets this in every rank it starts
        marks = _start(tmp_path, ["-c", "pass"], TORCHELASTIC_RUN_ID="x")
    else:  # a script named like torch's launcher: the guard reads the command line, not what the script does
        script = tmp_path / "torchrun"
        script.write_text("pass\n")
        marks = _start(tmp_path, [script, "--nproc_per_node", "2"])
    assert len(marks) == 1 and sys.executable in marks[0]

