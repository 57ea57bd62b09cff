"""The suite's prewarmed commands (tests/testing_utils.py: run_cmd and run_as_user fork `hf-zero` commands and
recipe scripts from a Python that has imported the libraries): each answers as its own interpreter would (exit code,
stdout, stderr, working folder, environment, files written), a timeout kills it, and what must keep its own
interpreter gets one."""

import os
import re
import shutil
import subprocess
import sys
import time

import pytest
from testing_utils import (
    GROUP_MARKS_ENV,
    PREWARM_ENV,
    RECIPE,
    REPO,
    TINY,
    _prewarmed_shell,
    run_cmd,
    run_prewarmed,
    write_short_config,
)

CHECK = [sys.executable, "-m", "hf_zero.cli", "check", "--config", TINY]


def _both(cmd, monkeypatch, **kw):
    """(prewarmed, own interpreter) for the same command."""
    warm = run_prewarmed([str(c) for c in cmd], kw.get("cwd", REPO), {**os.environ, **kw.get("env", {})}, 300)
    assert warm is not None, "this command should have been prewarmed"
    monkeypatch.setenv(PREWARM_ENV, "0")
    cold = run_cmd(cmd, check=False, **kw)
    monkeypatch.delenv(PREWARM_ENV)
    return warm, cold


@pytest.mark.recipe_run
def test_a_command_answers_as_its_own_interpreter(monkeypatch):
    warm, cold = _both(CHECK, monkeypatch)
    assert warm.returncode == cold.returncode == 0
    # the free disk space it reports moves while the other pytest worker writes files
    free = re.compile(r"[\d.]+ [KMGT]?i?B free")
    assert free.sub("_ free", warm.stdout) == free.sub("_ free", cold.stdout) and warm.stderr == cold.stderr
    # bad input: exit code 2 and the one line on stderr
    bad = run_cmd([sys.executable, "-m", "hf_zero.cli", "profiles", "--no-such-flag"], check=False)
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr == "hf-zero: error: hf-zero profiles: unrecognized arguments: --no-such-flag; see `hf-zero " \
                         "profiles --help`\n"


def test_working_folder_and_environment_are_the_commands(tmp_path, monkeypatch):
    shutil.copy(TINY, tmp_path / "tiny.yaml")  # its data paths are relative to the YAML's folder: copy them along
    shutil.copytree(TINY.parent.parent / "data", tmp_path.parent / "data", dirs_exist_ok=True)
    ok = run_cmd([sys.executable, "-m", "hf_zero.cli", "check", "--config", "tiny.yaml"], cwd=tmp_path, check=False)
    assert ok.returncode == 0 and "ok recipe" in ok.stdout, ok.stdout
    (tmp_path / "a_file").write_text("")
    nvme = run_cmd([sys.executable, "-m", "hf_zero.cli", "check", "--profile", "zero3_nvme", "--config", TINY],
                   env={"HF_ZERO_NVME_PATH": str(tmp_path / "a_file" / "swap")}, check=False)
    assert nvme.returncode == 2 and "cannot be created" in nvme.stdout, nvme.stdout


def test_a_timeout_kills_the_command_and_raises(tmp_path):
    long = write_short_config(TINY, tmp_path / "long.yaml", [100000, 1, 1])
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        run_cmd([sys.executable, RECIPE, "--config", long, "--output_dir", tmp_path / "o"], timeout=1, check=False)
    assert time.monotonic() - start < 60
    # the next command runs normally on the same server
    assert run_cmd(CHECK, check=False).returncode == 0


def test_what_keeps_its_own_interpreter():
    # as a test marked multiproc runs them (conftest sets GROUP_MARKS_ENV only for the others)
    env = {k: v for k, v in os.environ.items() if k != GROUP_MARKS_ENV}
    for argv in (["hf_zero.cli", "train", "--help"], ["hf_zero.cli", "bench", "--help"]):
        assert run_prewarmed([sys.executable, "-m", *argv], REPO, env, 60) is None
    # a test that starts no process group: its `hf-zero train` stops before any launch, and is forked
    assert GROUP_MARKS_ENV in os.environ
    forked = run_prewarmed([sys.executable, "-m", "hf_zero.cli", "train", "--help"], REPO, dict(os.environ), 60)
    assert forked is not None and forked.returncode == 0 and "--profile" in forked.stdout
    assert run_prewarmed([sys.executable, "-m", "hf_zero.cli", "check", "--verbose"], REPO, env, 60) is None
    assert run_prewarmed([sys.executable, "-c", "pass"], REPO, env, 60) is None


def test_a_shell_line_of_hf_zero_commands_runs_as_the_shell_runs_it(tmp_path):
    (tmp_path / ".venv").symlink_to(REPO / ".venv")
    env = {**os.environ, "PATH": f"{tmp_path / '.venv' / 'bin'}:{os.environ['PATH']}"}
    line = "hf-zero profiles > table.txt && hf-zero profiles --help"
    warm = _prewarmed_shell(line, tmp_path, env, 300)
    written = (tmp_path / "table.txt").read_text()
    (tmp_path / "table.txt").unlink()
    cold = subprocess.run(line, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert warm.returncode == cold.returncode == 0, cold.stderr
    assert warm.stdout == cold.stdout and written == (tmp_path / "table.txt").read_text() and "zero3" in written
    # the first part failing stops the line, as `&&` does
    bad = _prewarmed_shell("hf-zero check --config missing.yaml && hf-zero profiles", tmp_path, env, 300)
    assert bad.returncode == 2 and "FAIL recipe" in bad.stdout and "h100x8" not in bad.stdout
    # anything else is left to the shell
    for other in ("hf-zero profiles | head -1", "make train", "echo $HOME"):
        assert _prewarmed_shell(other, tmp_path, env, 60) is None
    launching = {k: v for k, v in env.items() if k != GROUP_MARKS_ENV}
    assert _prewarmed_shell("hf-zero train --config x", tmp_path, launching, 60) is None
