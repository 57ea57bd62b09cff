"""One run per output folder, ranks that die with their launcher, and a killed rank told as such.

Unit tests of the lock and of a rank's parent-death signal run in a few processes; three 2-rank launches through
`hf-zero train` prove them end to end: a second run refused while the first finishes untouched, a SIGKILLed
launcher taking its ranks with it, and a SIGKILLed rank reported by name and signal."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from testing_utils import REPO, TINY

from hf_zero.core.errors import UserError
from hf_zero.core.run_lock import LOCK_NAME, RunLock


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _gone(procs, timeout: float) -> list:
    """The processes still running after `timeout` seconds (a zombie nobody reaps has stopped running)."""
    deadline = time.time() + timeout
    while True:
        alive = []
        for p in procs:
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.time() > deadline:
            return alive
        time.sleep(0.1)


# ---------------------------------------------------------------- the lock

def test_lock_held_refuses_a_second_holder_and_release_frees_it(tmp_path):
    out = tmp_path / "run"
    first = RunLock(out)
    assert first.acquire() is None and first.held
    record = json.loads((out / LOCK_NAME).read_text())
    assert record["pid"] == os.getpid() and record["host"]
    with pytest.raises(UserError) as err:
        RunLock(out).acquire()  # another open file: flock refuses it even in the same process
    assert err.value.field == "output_dir"
    assert f"{out} is in use by pid {os.getpid()} on host {record['host']} since " in err.value.problem
    assert "pass another --output_dir" in err.value.fix
    assert json.loads((out / LOCK_NAME).read_text()) == record  # the refused one changed nothing
    first.release()
    assert not out.exists()  # it created the folder and nothing else was written there
    second = RunLock(out)
    assert second.acquire() is None
    second.release()


def test_lock_of_a_killed_holder_is_taken_over_with_a_line(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "checkpoint-3").mkdir()
    code = ("import os, signal, sys; from hf_zero.core.run_lock import RunLock; RunLock(sys.argv[1]).acquire(); "
            "os.kill(os.getpid(), signal.SIGKILL)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(out)], cwd=REPO)
    assert holder.wait() == -signal.SIGKILL and (out / LOCK_NAME).is_file()
    lock = RunLock(out)
    line = lock.acquire()
    assert line is not None and f"left locked by pid {holder.pid} on host " in line
    assert "ended without releasing it; taking it over" in line
    lock.release()
    assert not (out / LOCK_NAME).exists() and (out / "checkpoint-3").is_dir()  # the folder it found stays


def test_a_symlinked_or_odd_lock_path_is_refused_and_its_target_untouched(tmp_path, capsys):
    """Anyone who can write to a shared runs folder could plant `.hf_zero.lock` -> a file of the user's, which the
    lock record used to overwrite."""
    out = tmp_path / "run"
    out.mkdir()
    victim = tmp_path / "thesis.tex"
    victim.write_text("years of work")
    (out / LOCK_NAME).symlink_to(victim)
    with pytest.raises(UserError) as err:
        RunLock(out).acquire()
    assert err.value.line() == (f"output_dir: {out / LOCK_NAME} is a symbolic link (to {victim}); hf_zero never "
                                f"writes its lock record through one; remove the link: rm {out / LOCK_NAME}")
    assert victim.read_text() == "years of work"
    (out / LOCK_NAME).unlink()
    (out / LOCK_NAME).symlink_to(tmp_path / "absent")  # a dangling link: not created through either
    with pytest.raises(UserError, match="is a symbolic link"):
        RunLock(out).acquire()
    assert not (tmp_path / "absent").exists()
    (out / LOCK_NAME).unlink()
    (out / LOCK_NAME).mkdir()
    with pytest.raises(UserError) as err:
        RunLock(out).acquire()
    assert err.value.line() == (f"output_dir: {out / LOCK_NAME} is a folder, where hf_zero keeps its lock file; "
                                "move or remove that folder")
    (out / LOCK_NAME).rmdir()
    os.mkfifo(out / LOCK_NAME)
    with pytest.raises(UserError, match="is not a plain file"):
        RunLock(out).acquire()


def test_rank_0_takes_the_lock_unless_its_launcher_holds_it(tmp_path, monkeypatch):
    from hf_zero.core import run_lock

    out = tmp_path / "run"
    monkeypatch.setenv("RANK", "1")
    run_lock.hold_in_worker(out)  # not rank 0: rank 0 holds it for the run
    assert not (out / LOCK_NAME).exists()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv(run_lock.LOCK_ENV, str(RunLock(out).path))
    run_lock.hold_in_worker(out)  # hf_zero's launcher holds it
    assert not (out / LOCK_NAME).exists()
    monkeypatch.delenv(run_lock.LOCK_ENV)
    try:
        run_lock.hold_in_worker(out)  # plain `accelerate launch`: rank 0 itself
        run_lock.hold_in_worker(out)  # a recipe run again in the same process keeps it
        with pytest.raises(UserError, match=f"is in use by pid {os.getpid()} "):
            RunLock(out).acquire()
    finally:
        run_lock.release_held()
    assert not (out / LOCK_NAME).exists()


# ---------------------------------------------------------------- ranks die with their launcher

LAUNCHER = """
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], start_new_session=True,
                         env={**os.environ, "HF_ZERO_LAUNCHER_PID": str(os.getpid())})
time.sleep(600)
"""
RANK = """
import sys, time
from pathlib import Path
from hf_zero.launch.parent_watch import die_with_launcher
die_with_launcher()
Path(sys.argv[1]).write_text("armed")
time.sleep(600)
"""


def test_a_rank_dies_with_its_launcher_even_in_another_session(tmp_path):
    armed = tmp_path / "armed"
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, RANK, str(armed)], cwd=REPO)
    deadline = time.time() + 120
    while not armed.is_file():
        assert time.time() < deadline and launcher.poll() is None
        time.sleep(0.05)
    (rank,) = psutil.Process(launcher.pid).children()
    launcher.kill()
    launcher.wait()
    try:
        assert not _gone([rank], timeout=5)
    finally:
        if rank.is_running():
            rank.kill()


def test_a_rank_whose_launcher_died_before_it_armed_stops_at_once():
    env = {**os.environ, "HF_ZERO_LAUNCHER_PID": str(_dead_pid())}
    code = "from hf_zero.launch.parent_watch import die_with_launcher; die_with_launcher(); print('still running')"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL and "still running" not in proc.stdout
    env.pop("HF_ZERO_LAUNCHER_PID")  # started by hand: its shell may end first (nohup); it runs on
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True)
    assert proc.returncode == 0 and "still running" in proc.stdout


# ---------------------------------------------------------------- a killed rank, as the launcher tells it

def test_a_rank_killed_by_a_signal_is_named_not_the_rank_that_lost_it(tmp_path, capsys):
    from hf_zero.launch import launcher

    lost = ("hf-zero: error: distributed: rank 0 lost a rank while waiting for the banner (it exited); see why that "
            "rank stopped: its error, or the launcher's line naming it")
    (tmp_path / "error-rank0.json").write_text(json.dumps({"kind": "user", "rank": 0, "line": lost,
                                                           "lost_rank": True}))
    (tmp_path / "run.json").write_text(json.dumps({"output_dir": str(tmp_path / "out")}))
    rc = launcher._failed(tmp_path, {0: 2, 1: -signal.SIGKILL}, first=0)
    err = capsys.readouterr().err
    assert rc == 128 + signal.SIGKILL and lost not in err
    assert err.strip().splitlines()[-1].startswith("hf-zero: rank 1 was killed by SIGKILL (out of memory?")
    assert f"no complete checkpoint in {tmp_path / 'out'}" in err
    # a mistake in the input is still the story, whatever happened to the ranks after it
    (tmp_path / "error-rank1.json").write_text(json.dumps({"kind": "user", "rank": 1, "line": "hf-zero: error: x: y"}))
    assert launcher._failed(tmp_path, {0: 2, 1: 2}, first=1) == 2
    assert capsys.readouterr().err.strip() == "hf-zero: error: x: y"


# ---------------------------------------------------------------- end to end, through hf-zero train

def _train(out, *extra, log, **popen):
    cmd = [sys.executable, "-m", "hf_zero.cli", "train", "--profile", "cpu", "--config", TINY, "--output_dir", out,
           "--disable_tqdm", "true", *extra]
    return subprocess.Popen([str(c) for c in cmd], cwd=REPO, stdout=log, stderr=subprocess.STDOUT, **popen)


def _wait_for(condition, proc, log: Path, timeout=900):
    deadline = time.time() + timeout
    while not condition():
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.time() < deadline
        time.sleep(0.05)


def _ranks(launcher_pid: int) -> list:
    children = psutil.Process(launcher_pid).children(recursive=True)
    return [c for c in children if "curriculum.py" in " ".join(c.cmdline())]


@pytest.mark.multiproc
def test_sigkill_of_the_launcher_group_stops_every_rank_before_it_writes_again(tmp_path):
    out, log = tmp_path / "run", tmp_path / "run.log"
    proc = _train(out, "--save_strategy", "steps", "--save_steps", "3", log=log.open("w"), start_new_session=True)
    _wait_for(lambda: (out / "latest_checkpoint").is_file(), proc, log)
    ranks = _ranks(proc.pid)
    assert len(ranks) == 2
    killed_at = time.time()
    os.killpg(proc.pid, signal.SIGKILL)  # the launcher's group; torch elastic put each rank in a session of its own
    proc.wait(60)
    assert not _gone(ranks, timeout=10), "ranks outlived their launcher"
    assert not (out / "final").exists(), "killed too late: the run had finished"
    changed = [p for p in out.rglob("*") if p.stat().st_mtime > killed_at + 1.0]
    assert not changed, changed
    # The kernel released the lock with the launcher; its record names it for the next run.
    lock = RunLock(out)
    assert f"left locked by pid {proc.pid} on host " in lock.acquire()
    lock.release()


@pytest.mark.multiproc
def test_a_second_run_is_refused_and_a_rank_killed_by_sigkill_is_named_with_its_signal(tmp_path):
    """One launch: a second run on its folder is refused while it runs (and moves nothing); the first goes on to
    write a checkpoint, then its rank 1 is SIGKILLed and named with its signal, and the run ends without its lock."""
    out, log, log2 = tmp_path / "run", tmp_path / "run.log", tmp_path / "second.log"
    # Rank 1 waits 40 s before its first collective: the second run starts well within it.
    proc = _train(out, "--save_strategy", "steps", "--save_steps", "3", log=log.open("w"),
                  env={**os.environ, "HF_ZERO_TEST_STALL": "1:40"})
    _wait_for(lambda: (out / LOCK_NAME).is_file() and (out / LOCK_NAME).read_text(), proc, log)
    second = _train(out, "--fresh_start", "true", log=log2.open("w"))
    assert second.wait(600) == 2
    text = log2.read_text()
    lines = [ln for ln in text.splitlines() if ln.startswith("hf-zero:")]
    assert lines == [text.strip().splitlines()[-1]] and "Traceback" not in text, text[-3000:]
    assert lines[0].startswith(f"hf-zero: error: output_dir: {out} is in use by pid {proc.pid} on host ")
    assert lines[0].endswith("wait for it, or pass another --output_dir")
    assert proc.poll() is None  # the refusal came while the first run was still running
    assert not (out / "previous-run").exists()  # the refused --fresh_start moved nothing
    _wait_for(lambda: (out / "latest_checkpoint").is_file(), proc, log)  # and the first run went on training
    (rank1,) = [r for r in _ranks(proc.pid) if r.environ().get("RANK") == "1"]
    rank1.send_signal(signal.SIGKILL)
    rc = proc.wait(300)
    text = log.read_text()
    assert rc == 128 + signal.SIGKILL, text[-3000:]
    last = text.strip().splitlines()[-1]
    assert last.startswith("hf-zero: rank 1 was killed by SIGKILL (out of memory?"), text[-3000:]
    assert f"newest complete checkpoint: {out}/checkpoint-" in last and "resume with: hf-zero train" in last
    assert "hf-zero: error:" not in text and "see that rank's error above" not in text
    assert not (out / LOCK_NAME).exists()
