"""Multi-node launch, proven on one machine: two "machines" on loopback (two launches, machine_rank 0 and 1, main
process 127.0.0.1) under ZeRO-3 give the same losses as one machine with the same global batch (the README's
zero3 run of the tiny curriculum, run once per session: no launch of its own).

Machine 0 is started with plain `accelerate launch` and its multi-node flags, machine 1 with `hf-zero train
--hostfile` (a DeepSpeed `host slots=N` file): the two routes must interoperate. `hf-zero train --nodes
--machine-rank --main-ip` builds the same line as the hostfile route (checked on dry runs).
"""

import os
import signal
import subprocess
import sys

import pytest
from testing_utils import PROFILES, RECIPE, REPO, TINY, free_port, read_summary, readme_command

from hf_zero.cli import main as cli_main


def _dry_run(capsys, *flags) -> str:
    assert cli_main(["train", "--profile", "multinode", "--config", str(TINY), *flags, "--dry-run"]) == 0
    return capsys.readouterr().out.strip()


def test_hostfile_builds_the_same_launch_line_as_explicit_flags(tmp_path, capsys):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# two machines, 4 processes each\nnode-a slots=4\nnode-b slots=4\n")
    from_flags = _dry_run(capsys, "--nodes", "2", "--nproc", "4", "--machine-rank", "1", "--main-ip", "node-a",
                          "--main-port", "29555")
    from_hostfile = _dry_run(capsys, "--hostfile", str(hostfile), "--machine-rank", "1", "--main-port", "29555")
    assert from_hostfile == from_flags
    for part in ("--num_machines 2", "--num_processes 8", "--machine_rank 1", "--main_process_ip node-a",
                 "--deepspeed_multinode_launcher standard"):
        assert part in from_flags


def test_hostfile_finds_this_machines_rank_by_name(tmp_path, capsys):
    import socket

    hostfile = tmp_path / "hostfile"
    hostfile.write_text(f"main-node slots=2\n{socket.gethostname()} slots=2\n")
    assert "--machine_rank 1 --main_process_ip main-node" in _dry_run(capsys, "--hostfile", str(hostfile))


@pytest.mark.parametrize("text, flags, field, says", [
    (None, [], "--hostfile", "does not exist"),
    ("node-a slotz=2\n", [], "--hostfile", "bad entry"),
    ("node-a slots=2\nnode-b slots=4\n", [], "--hostfile", "same slots"),
    ("node-a slots=2\nnode-b slots=2\n", [], "--machine-rank", "cannot tell which line"),
    ("node-a slots=2\nnode-b slots=2\n", ["--machine-rank", "2"], "--machine-rank", "outside 0..1"),
    ("node-a slots=2\nnode-b slots=2\n", ["--nodes", "3", "--machine-rank", "0"], "--nodes", "lists 2"),
])
def test_bad_hostfile_is_one_line(tmp_path, capsys, text, flags, field, says):
    hostfile = tmp_path / "hostfile"
    if text is not None:
        hostfile.write_text(text)
    rc = cli_main(["train", "--profile", "multinode", "--config", str(TINY), "--hostfile", str(hostfile), *flags,
                   "--dry-run"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith(f"hf-zero: error: {field}") and says in err and "\n" not in err, err


def _start_machine(cmd):
    # Own session: on failure the test stops this machine's launcher and its workers without touching pytest.
    return subprocess.Popen([str(c) for c in cmd], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


@pytest.mark.multiproc
def test_two_machines_on_loopback_match_one_machine(tmp_path, readme_checkout, readme_runs):
    config = TINY  # as the README's one-machine zero3 run, the reference
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("127.0.0.1 slots=1\nlocalhost slots=1\n")
    port = free_port()
    multi = tmp_path / "multi"
    recipe_args = [RECIPE, "--config", config, "--output_dir", multi, "--disable_tqdm", "true"]
    machines = [
        # Machine 0: accelerate's own flags, as the multinode profile documents.
        _start_machine([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                        PROFILES / "multinode.yaml", "--num_processes", "2", "--machine_rank", "0",
                        "--main_process_ip", "127.0.0.1", "--main_process_port", port, *recipe_args]),
        # Machine 1: hf-zero from a DeepSpeed hostfile (nodes, processes per node and main host come from it).
        _start_machine([sys.executable, "-m", "hf_zero.cli", "train", "--profile", "multinode", "--hostfile",
                        hostfile, "--machine-rank", "1", "--main-port", port, "--config", config, "--output_dir",
                        multi, "--disable_tqdm", "true"]),
    ]
    logs = []
    try:
        for proc in machines:
            logs.append(proc.communicate(timeout=900)[0])
    finally:
        for proc in machines:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)  # the launcher forwards it to its workers
                proc.wait(timeout=60)
    for rank, (proc, log) in enumerate(zip(machines, logs)):
        assert proc.returncode == 0, f"machine {rank}:\n" + "\n".join(log.splitlines()[-40:])

    cmd = readme_command("accelerate launch --config_file accelerate_configs/zero3.yaml", "runs/tiny_zero3")
    assert readme_runs[cmd].returncode == 0, readme_runs[cmd].stderr[-3000:]
    m, s = read_summary(multi), read_summary(readme_checkout / "runs" / "tiny_zero3")
    assert (m["world_size"], m["global_batch"]) == (s["world_size"], s["global_batch"]) == (2, 4)
    assert m["zero_stage"] == s["zero_stage"] == 3
    assert len(m["losses"]) == len(s["losses"]) == 15
    assert max(abs(a - b) for a, b in zip(m["losses"], s["losses"])) < 1e-4, (m["losses"], s["losses"])
    assert (multi / "final" / "model.safetensors").is_file()
