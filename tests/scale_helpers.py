"""Helpers for the scale-out tests (multi-node, Slurm, NVMe): short recipe YAMLs, free ports, a single-host Slurm."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_short_config(src: Path, dst: Path, steps: list[int], **overrides) -> Path:
    """`src` cut to the first len(steps) stages of the given lengths, without eval, data paths made absolute (the
    run may start elsewhere, e.g. under Slurm): the same model and data as the shipped YAML, fewer steps."""
    data = yaml.safe_load(Path(src).read_text())
    stages = []
    for stage, n in zip(data["stages"], steps):
        paths = stage["data"] if isinstance(stage["data"], list) else [stage["data"]]
        data_paths = [p if p.startswith("builtin:") else str((Path(src).parent / p).resolve()) for p in paths]
        # A warmup as long as the stage never reaches its peak LR, which the stage checks refuse: shorten it too.
        warmup = {"warmup_steps": min(stage["warmup_steps"], n - 1)} if "warmup_steps" in stage else {}
        stages.append({**stage, "steps": n, "data": data_paths, **warmup})
    data.update(stages=stages, eval_samples=0, **overrides)
    dst.write_text(yaml.safe_dump(data, sort_keys=False))
    return dst


SLURM_CONF = """\
ClusterName=hfzero
SlurmctldHost={host}
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={state}/munge/munge.socket
SlurmUser=root
SlurmdUser=root
StateSaveLocation={state}/ctld
SlurmdSpoolDir={state}/slurmd
SlurmctldPidFile={state}/slurmctld.pid
SlurmdPidFile={state}/slurmd.pid
SlurmctldLogFile={state}/slurmctld.log
SlurmdLogFile={state}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=2
NodeName={host} CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


def libaio_missing_reason() -> str | None:
    """Why NVMe offload cannot run here (None: it can), asked exactly as the preflight asks."""
    from hf_zero.core.ops import libaio_available

    if libaio_available():
        return None
    return "libaio not installed (run scripts/system_deps.sh: apt-get install -y libaio-dev)"


def slurm_missing_reason() -> str | None:
    """Why a real Slurm cannot run here (None: it can)."""
    if os.geteuid() != 0:
        return "starting slurmd/munged needs root"
    missing = [b for b in ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "sinfo") if not shutil.which(b)]
    if missing:
        return f"{', '.join(missing)} not installed (run scripts/system_deps.sh: apt-get install slurm-wlm munge)"
    if not Path("/etc/munge/munge.key").is_file():
        return "no /etc/munge/munge.key (reinstall munge)"
    return None


class SingleHostSlurm:
    """munged + slurmctld + slurmd on this host, all state in a private temp folder; stopped by their pid files.

    A private munge socket and free ports keep it apart from any other Slurm on the machine."""

    def __init__(self):
        self.host = socket.gethostname()
        self.state = Path(tempfile.mkdtemp(prefix="hfz-slurm-"))  # not under pytest's root-only 0700 tmp tree:
        self.state.chmod(0o755)  # munged runs as user munge and must reach its socket folder
        self.conf = self.state / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    def run(self, *cmd, check=True, timeout=60) -> subprocess.CompletedProcess:
        proc = subprocess.run(list(cmd), env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stdout}{proc.stderr}")
        return proc

    def start(self) -> "SingleHostSlurm":
        munge = self.state / "munge"
        munge.mkdir()
        munge.chmod(0o755)  # munged insists that everyone can reach its socket
        shutil.chown(munge, "munge", "munge")
        for sub in ("ctld", "slurmd"):
            (self.state / sub).mkdir()
        self.conf.write_text(SLURM_CONF.format(host=self.host, state=self.state, cpus=os.cpu_count() or 2,
                                               ctld_port=free_port(), slurmd_port=free_port()))
        self.run("runuser", "-u", "munge", "--", "munged", f"--socket={munge}/munge.socket",
                 f"--pid-file={munge}/munged.pid", f"--log-file={munge}/munged.log",
                 f"--seed-file={munge}/munged.seed")
        self.run("slurmctld", "-c", "-f", str(self.conf))
        self.run("slurmd", "-f", str(self.conf))
        deadline = time.time() + 60
        while time.time() < deadline:
            state = self.run("sinfo", "-h", "-o", "%T", check=False).stdout.strip()
            if state in ("idle", "mixed", "allocated"):
                return self
            time.sleep(1)
        raise RuntimeError(f"the node never became idle (sinfo: {state!r}):\n{self.logs()}")

    def submit(self, script: Path) -> str:
        out = self.run("sbatch", "--parsable", str(script)).stdout.strip()
        return out.split(";")[0]

    def job_state(self, job_id: str) -> str:
        out = self.run("scontrol", "show", "job", job_id, check=False).stdout
        fields = dict(f.split("=", 1) for f in out.split() if "=" in f)
        return fields.get("JobState", "UNKNOWN")

    def wait(self, job_id: str, timeout: float = 600, until=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT",
                                                                  "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL")) -> str:
        deadline = time.time() + timeout
        while time.time() < deadline:
            state = self.job_state(job_id)
            if state in until:
                return state
            time.sleep(2)
        raise TimeoutError(f"job {job_id} still {self.job_state(job_id)} after {timeout} s")

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-20:])
                         for p in sorted(self.state.rglob("*.log")))

    def stop(self) -> None:
        pids = []
        for pid_file in ("slurmd.pid", "slurmctld.pid", "munge/munged.pid"):
            try:
                pid = int((self.state / pid_file).read_text().strip())
                os.kill(pid, 15)
                pids.append(pid)
            except (OSError, ValueError):
                pass
        deadline = time.time() + 10  # a clean exit before the folder goes
        for pid in pids:
            while time.time() < deadline:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.1)
        shutil.rmtree(self.state, ignore_errors=True)

