"""`hf-zero slurm`: the generated sbatch script, checked three ways.

1. Dry run (always): `bash -n`, its #SBATCH and srun lines, and the script *executed* with stand-ins for `srun`,
   `scontrol` and Python that record what every node would run: machine rank per node, the main host, process
   counts, and user strings arriving as single arguments (nothing injected).
2. Bad input: one line naming the flag, exit 2, no script written.
3. A real Slurm (Debian's slurm-wlm + munge, started here on loopback and stopped after): the generated script
   for a 2-rank CPU run completes and the model exists; (slow) `scontrol requeue` mid-run and the second attempt
   resumes from the checkpoint. Skipped, with the reason, where Slurm cannot run.
"""

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from testing_utils import REPO, TINY, SingleHostSlurm, read_summary, slurm_missing_reason, write_short_config

from hf_zero.cli import main as cli_main

INJECT = "x; touch {p}/pwned-semicolon $(touch {p}/pwned-subst) `touch {p}/pwned-tick`"


def _write_script(tmp_path, *flags, out="job.sbatch") -> Path:
    path = tmp_path / out
    assert cli_main(["slurm", *flags, "--out", str(path)]) == 0
    return path


def _stubs(tmp_path) -> Path:
    """`srun` that runs its command once per node with SLURM_NODEID set, `scontrol` that lists two hosts, and a
    `python` that writes its argv and environment to argv-<node>.json."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text('#!/bin/bash\nprintf "node-a\\nnode-b\\n"\n')
    (bin_dir / "srun").write_text(
        '#!/bin/bash\necho "$@" > "$STUB_OUT/srun-args.txt"\n'
        'while [ "$1" != bash ]; do shift; done\n'
        'for node in $(seq 0 $((${STUB_NODES} - 1))); do SLURM_NODEID=$node "$@" || exit $?; done\n')
    (bin_dir / "python").write_text(
        f"#!{sys.executable}\nimport json, os, sys\n"
        "node = os.environ['SLURM_NODEID']\n"
        "json.dump({'argv': sys.argv[1:], 'profile': os.environ.get('HF_ZERO_PROFILE')},\n"
        "          open(os.path.join(os.environ['STUB_OUT'], f'argv-{node}.json'), 'w'))\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return bin_dir


def test_sbatch_script_runs_each_node_with_its_rank(tmp_path):
    run_name = INJECT.format(p=tmp_path)
    script = _write_script(
        tmp_path, "--profile", "zero3", "--config", str(TINY), "--nodes", "2", "--gpus-per-node", "4",
        "--partition", "gpu", "--account", "proj-1", "--time", "04:00:00", "--cpus-per-task", "16",
        "--output-dir", str(tmp_path / "run"), "--python", str(tmp_path / "bin" / "python"),
        "--run_name", run_name, "--learning_rate", "1e-4")
    text = script.read_text()
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    sbatch = [line for line in text.splitlines() if line.startswith("#SBATCH")]
    for expected in ("--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=4", "--cpus-per-task=16",
                     "--partition=gpu", "--account=proj-1", "--time=04:00:00", "--requeue", "--job-name=hf_zero"):
        assert f"#SBATCH {expected}" in sbatch
    assert (tmp_path / "run" / "slurm_logs").is_dir(), "sbatch needs the log folder before the job starts"

    bin_dir = _stubs(tmp_path)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "STUB_OUT": str(tmp_path), "STUB_NODES": "2",
           "SLURM_JOB_NODELIST": "node-[a-b]", "SLURM_JOB_ID": "7", "SLURM_CPUS_PER_TASK": "16"}
    proc = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    srun = (tmp_path / "srun-args.txt").read_text()
    assert "--nodes=2 --ntasks-per-node=1 --cpus-per-task=16 --kill-on-bad-exit=1" in srun
    assert f"--output={tmp_path}/run/slurm_logs/%x-%j-node%n.out" in srun
    for node in (0, 1):
        seen = json.loads((tmp_path / f"argv-{node}.json").read_text())
        argv = seen["argv"]
        flag = lambda name: argv[argv.index(name) + 1]  # noqa: E731
        assert argv[:2] == ["-m", "accelerate.commands.launch"]
        assert (flag("--machine_rank"), flag("--main_process_ip")) == (str(node), "node-a")
        assert (flag("--num_machines"), flag("--num_processes"), flag("--main_process_port")) == ("2", "8", "29500")
        assert flag("--deepspeed_multinode_launcher") == "standard"
        recipe = argv.index(str(REPO / "recipes" / "curriculum.py"))
        assert argv.index("--machine_rank") < recipe, "launcher flags must precede the recipe"
        assert flag("--run_name") == run_name, "a user string must arrive as one untouched argument"
        assert flag("--output_dir") == str(tmp_path / "run")
        # Requeue-safety: the tiny recipe saves no checkpoints, so the script adds them.
        assert (flag("--save_strategy"), flag("--save_steps")) == ("steps", "100")
        assert seen["profile"] == str(REPO / "accelerate_configs" / "zero3.yaml")
    assert not list(tmp_path.glob("pwned*")), "a user string was executed"


def test_sbatch_keeps_the_recipes_own_checkpointing_and_cpu_process_count(tmp_path, capsys):
    config = write_short_config(TINY, tmp_path / "c.yaml", [2], save_strategy="steps", save_steps=7)
    assert cli_main(["slurm", "--profile", "zero2", "--config", str(config), "--output-dir", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    task = shlex.split(text.splitlines()[-1].split("bash -c ", 1)[1])[0]
    assert "--save_strategy" not in task and "--num_processes 2" in task and "--num_machines 1" in task
    assert "#SBATCH --gpus-per-node" not in text


@pytest.mark.parametrize("flags, field", [
    (["--partition", "gpu\n#SBATCH --uid=0"], "--partition"),
    (["--account", "a;rm -rf /"], "--account"),
    (["--time", "$(reboot)"], "--time"),
    (["--job-name", "a b"], "--job-name"),
    (["--nodes", "0"], "--nodes"),
    (["--gpus-per-node", "2", "--nproc-per-node", "4"], "--nproc-per-node"),
    (["--log-dir", "/tmp/has space"], "--log-dir"),
    (["--main-port", "70000"], "--main-port"),
    (["--config", "/nonexistent.yaml"], "--config"),
    (["--profile", "zero9"], "profile"),
    (["--fresh_start"], "fresh_start"),
    (["--save_strategy", "no"], "save_strategy"),
    (["--output_dir", "/elsewhere"], "--output_dir"),
    (["--precision", "fp64"], "--precision"),
])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys, flags, field):
    args = ["slurm", "--profile", "zero3", "--config", str(TINY), "--output-dir", str(tmp_path / "run"), *flags,
            "--out", str(tmp_path / "job.sbatch")]
    if flags[0] == "--profile":
        args[1:3] = []
    assert cli_main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"hf-zero: error: {field}") and "\n" not in err, err
    assert not (tmp_path / "job.sbatch").exists()


@pytest.fixture(scope="module")
def slurm():
    reason = slurm_missing_reason()
    if reason:
        pytest.skip(f"no real Slurm here: {reason}")
    cluster = SingleHostSlurm()
    try:
        yield cluster.start()
    finally:
        cluster.stop()


@pytest.mark.multiproc
def test_real_slurm_runs_the_generated_script(tmp_path, slurm):
    """sbatch on a real single-host cluster: a 2-rank ZeRO-2 CPU run completes and writes its model."""
    config = write_short_config(TINY, tmp_path / "c.yaml", [3, 3])
    out = tmp_path / "run"
    script = _write_script(tmp_path, "--profile", "zero2", "--config", str(config), "--nodes", "1",
                           "--cpus-per-task", str(os.cpu_count() or 2), "--output-dir", str(out),
                           "--job-name", "hfz-test", "--save-steps", "3", "--disable_tqdm", "true",
                           "--run_name", INJECT.format(p=tmp_path))
    job = slurm.submit(script)
    state = slurm.wait(job, timeout=600)
    logs = "\n".join(p.read_text(errors="replace") for p in sorted((out / "slurm_logs").glob("*")))
    assert state == "COMPLETED", f"job {job}: {state}\n{logs[-4000:]}\n{slurm.logs()}"
    assert f"hfz-test-{job}-node0.out" in {p.name for p in (out / "slurm_logs").iterdir()}
    summary = read_summary(out)
    assert summary["world_size"] == 2 and summary["total_steps"] == 6 and len(summary["losses"]) == 6
    assert (out / "final" / "model.safetensors").is_file()
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-6"]
    assert not list(tmp_path.glob("pwned*"))


@pytest.mark.slow  # ~90 s: two attempts of a run; the default suite checks the script's requeue parts instead
@pytest.mark.multiproc
def test_requeued_job_resumes_from_its_checkpoint(tmp_path, slurm):
    """`scontrol requeue` mid-run (what preemption or a node failure does): the script runs again from the top and
    the recipe picks up the latest checkpoint instead of starting over."""
    import time

    config = write_short_config(TINY, tmp_path / "c.yaml", [3, 3])
    out = tmp_path / "run"
    script = _write_script(tmp_path, "--profile", "zero2", "--config", str(config), "--cpus-per-task",
                           str(os.cpu_count() or 2), "--output-dir", str(out), "--save-steps", "2",
                           "--disable_tqdm", "true")
    job = slurm.submit(script)
    deadline = time.time() + 600
    while not (out / "checkpoint-2" / "trainer_state.json").is_file():
        assert slurm.job_state(job) in ("PENDING", "RUNNING", "CONFIGURING"), slurm.job_state(job)
        assert time.time() < deadline, "no checkpoint-2 after 600 s"
        time.sleep(0.5)
    slurm.run("scontrol", "requeue", job)
    # Slurm holds a requeued job ~2-3 min (Reason=BeginTime) before it may start again: skip that wait only.
    while slurm.job_state(job) not in ("PENDING", "RUNNING", "COMPLETED"):
        time.sleep(0.2)
    slurm.run("scontrol", "update", f"JobId={job}", "StartTime=now", check=False)
    state = slurm.wait(job, timeout=900)
    job_log = (out / "slurm_logs" / f"hf_zero-{job}.out").read_text()
    assert state == "COMPLETED", f"{state}\n{job_log[-3000:]}\n{slurm.logs()}"
    assert "attempt 2" in job_log, job_log
    summary = read_summary(out)
    resumed = summary["resumed_from"]
    assert resumed and Path(resumed).name in ("checkpoint-2", "checkpoint-4"), resumed
    assert summary["total_steps"] == 6 and len(summary["losses"]) == 6
    assert (out / "final" / "model.safetensors").is_file()
