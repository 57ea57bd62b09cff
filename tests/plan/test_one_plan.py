"""One plan for every command (issue 42, item 4): `hf-zero train`'s launcher, `check`, `estimate --config`,
`preview`, `slurm` and the bench resolve recipe + profile + flags with the one resolver (hf_zero.plan.run_plan) and
read world, machines, batch and precision from the plan it returns. Each command runs on the same inputs; every plan
the resolver hands out is recorded, and they must agree with each other and with what each command prints.
No rank starts: `hf-zero train` runs up to accelerate's launch, which is stood in."""

import json
import os
import re
from pathlib import Path

import pytest
from testing_utils import TINY, write_short_config

from hf_zero.bench.plan import build_plan, run_profile
from hf_zero.cli import main
from hf_zero.plan import run_plan
from hf_zero.plan.run_plan import PLAN_ENV, RunPlan

BATCH = re.compile(r"batch: (\d+ micro x \d+ accum x \d+ ranks = \d+ global) \| precision: (\w+)")

# (profile, processes per machine or None for the profile's, --precision or None, recipe changes, expected)
CASES = [
    ("zero2", "2", None, {}, ("2 micro x 1 accum x 2 ranks = 4 global", "fp32")),
    ("zero3", "1", "bf16", {"per_device_train_batch_size": 1, "global_batch_size": 4},
     ("1 micro x 4 accum x 1 ranks = 4 global", "bf16")),
    ("cpu", None, None, {"global_batch_size": 8}, ("2 micro x 2 accum x 2 ranks = 8 global", "fp32")),
]


def _laid_out(plan: RunPlan) -> tuple:
    """What every command must agree on: the record checkpoints keep (profile, engine, precision, world, micro,
    accumulation, global batch) and the machines."""
    return plan.record(), plan.nodes, plan.recipe


@pytest.fixture
def resolved(monkeypatch):
    """Every plan the one resolver returns, in order."""
    plans = []
    real = run_plan.resolve_run

    def recording(*args, **kwargs):
        plan, kwargs_out = real(*args, **kwargs)
        plans.append(plan)
        return plan, kwargs_out
    monkeypatch.setattr(run_plan, "resolve_run", recording)
    return plans


def _take(plans: list) -> list:
    taken = list(plans)
    plans.clear()
    return taken


@pytest.mark.parametrize("profile,nproc,precision,changes,expected", CASES, ids=[c[0] for c in CASES])
def test_every_command_resolves_the_same_plan(profile, nproc, precision, changes, expected, resolved, tmp_path,
                                              capsys, monkeypatch):
    from accelerate.commands import launch as accelerate_launch

    config = str(write_short_config(TINY, tmp_path / "recipe.yaml", [2, 2, 2], **changes))
    procs = ["--nproc", nproc] if nproc else []
    prec = ["--precision", precision] if precision else []
    by_command = {}

    launched = []
    monkeypatch.setattr(accelerate_launch, "launch_command", lambda args: launched.append(
        RunPlan.from_json(Path(os.environ[PLAN_ENV]).read_text())))
    assert main(["train", "--profile", profile, *procs, *prec, "--config", config,
                 "--output_dir", str(tmp_path / "out")]) == 0
    capsys.readouterr()
    (by_command["train"],) = launched  # the plan the ranks would read
    by_command["train's preflight"], launcher = _take(resolved)
    assert launcher == by_command["train"]

    assert main(["check", "--profile", profile, *procs, *prec, "--config", config]) == 0
    out = capsys.readouterr().out
    (by_command["check"],) = _take(resolved)
    assert f"ok batch: {by_command['check'].batch.line()}" in out

    assert main(["estimate", "--config", config, "--profile", profile, *prec, "--json",
                 *(["--gpus-per-node", nproc] if nproc else [])]) == 0
    shown = json.loads(capsys.readouterr().out)
    (by_command["estimate"],) = _take(resolved)
    assert shown["plan"] == by_command["estimate"].record()
    assert shown["inputs"]["batch"] == by_command["estimate"].batch.line()

    assert main(["preview", "--config", config, "--profile", profile, *procs, *prec, "-n", "0"]) == 0
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("plan: ")]
    (by_command["preview"],) = _take(resolved)
    assert BATCH.search(line).groups() == expected

    assert main(["slurm", "--profile", profile, "--config", config, "--output-dir", str(tmp_path / "slurm"),
                 *(["--nproc-per-node", nproc] if nproc else []), *prec]) == 0
    script = capsys.readouterr().out
    (by_command["slurm"],) = _take(resolved)
    assert BATCH.search(script).groups() == expected
    assert f"--num_processes {by_command['slurm'].world}" in script

    first = _laid_out(by_command["train"])
    assert (by_command["train"].batch.line(), by_command["train"].precision) == expected
    for command, plan in by_command.items():
        assert _laid_out(plan) == first, command

    # the bench runs every strategy at one rank count: its batch is the plan's, its precision the profile's
    bench = build_plan(config, None, None, by_command["train"].world, [], tmp_path / "bench")
    assert (bench.batch.line(), run_profile(profile, precision).precision) == expected


def test_a_command_line_world_reaches_accelerate_as_the_plan_counts_it(capsys):
    """`--nodes` without `--nproc`: the profile's processes on each machine, on the command line accelerate gets
    (else accelerate would spread the profile's total over the machines and the ranks would refuse the plan)."""
    assert main(["train", "--profile", "zero2", "--nodes", "2", "--machine-rank", "0", "--main-ip", "node-a",
                 "--config", str(TINY), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "--num_machines 2" in out and "--num_processes 4" in out
