"""The run plan (hf_zero/plan/run_plan.py): resolved once, read by every rank, copied by checkpoints and summaries.
A value given in one place (here `--nproc` and `--precision`, against what the profile's YAML says) must be what
the worker trains with, what each checkpoint records and what summary.json says."""

import json
import os
import sys

import pytest
from testing_utils import REPO, TINY, run_cmd

from hf_zero.checkpoint.safe_load import safe_load
from hf_zero.core.errors import UserError
from hf_zero.plan.profiles import load_profile
from hf_zero.plan.run_plan import PLAN_ENV, PLAN_NAME, RunPlan, plan_for_launch, plan_in_worker, resolve_run
from hf_zero.plan.shipped import recipe_argument_types

RECIPE = str(REPO / "recipes" / "curriculum.py")
TYPES = recipe_argument_types(None)  # the curriculum recipe's, plus TrainingArguments


def _argv(out):
    return ["--config", str(TINY), "--output_dir", str(out)]


def test_the_plan_reads_back_from_its_json_unchanged(tmp_path):
    from hf_zero.plan.parse import parse_recipe_args

    *parsed, _, training, config = parse_recipe_args(TYPES, _argv(tmp_path))
    plan, kwargs = resolve_run(load_profile("zero3"), tuple(parsed), training, world=4, nodes=2, gpus=0,
                               recipe=RECIPE, config=config, argv=_argv(tmp_path))
    again = RunPlan.from_json(plan.to_json())
    assert again == plan
    assert (again.world, again.nodes, again.recipe, again.batch.global_batch) == (4, 2, "curriculum", 8)
    assert again.training["deepspeed"]["zero_optimization"]["stage"] == 3 == kwargs["deepspeed"]["zero_optimization"][
        "stage"]
    assert again.record()["sharding"] == "DeepSpeed ZeRO-3"
    with pytest.raises(AttributeError):  # frozen: nothing downstream can change what the ranks agreed on
        again.nodes = 3


def test_a_rank_takes_the_launchers_plan_not_its_environment(tmp_path):
    from dataclasses import replace

    profile = replace(load_profile("cpu"), mixed_precision="bf16")
    path = plan_for_launch(profile, RECIPE, _argv(tmp_path), world=1, nodes=1, folder=tmp_path / "launch")
    assert path.name == PLAN_NAME and not (tmp_path / PLAN_NAME).exists()  # beside the outputs once the run starts
    env = {"WORLD_SIZE": "1"}  # an environment that says nothing of bf16
    *_, own, _ = plan_in_worker(TYPES, _argv(tmp_path), RECIPE, env=env)
    assert own["bf16"] is False
    *_, kwargs, plan = plan_in_worker(TYPES, _argv(tmp_path), RECIPE, env={**env, PLAN_ENV: str(path)})
    assert kwargs["bf16"] is True and plan.precision == "bf16"


def test_a_plan_resolved_for_another_launch_is_one_line(tmp_path):
    path = plan_for_launch(load_profile("cpu"), RECIPE, _argv(tmp_path), world=1, nodes=1, folder=tmp_path)
    with pytest.raises(UserError) as err:
        plan_in_worker(TYPES, _argv(tmp_path), RECIPE, env={"WORLD_SIZE": "2", PLAN_ENV: str(path)})
    assert err.value.field == PLAN_ENV and "1 ranks" in err.value.line() and "\n" not in err.value.line()


@pytest.mark.multiproc  # `hf-zero train --nproc 1`: a launcher and its one rank
def test_nproc_and_precision_given_once_reach_the_worker_the_checkpoints_and_the_summary(tmp_path):
    zero2 = load_profile("zero2")
    assert (zero2.num_processes, zero2.precision) == (2, "fp32")  # the flags below change both
    out = tmp_path / "run"
    proc = run_cmd([sys.executable, "-m", "hf_zero.cli", "train", "--profile", "zero2", "--nproc", "1",
                    "--precision", "bf16", "--config", TINY, "--output_dir", out, "--disable_tqdm", "true",
                    "--save_strategy", "steps", "--save_steps", "10"], timeout=900)
    plan = json.loads((out / PLAN_NAME).read_text())
    assert (plan["batch"]["world"], plan["profile"]["mixed_precision"], plan["training"]["bf16"]) == (1, "bf16", True)
    assert "world size 1 |" in proc.stdout and "precision: bf16" in proc.stdout  # the worker's banner
    checkpoint = out / "checkpoint-10"
    args = safe_load(checkpoint / "training_args.bin")  # what the worker's Trainer ran with
    assert args.bf16 and args.deepspeed["zero_optimization"]["stage"] == 2
    meta = json.loads((checkpoint / "hf_zero_checkpoint.json").read_text())
    summary = json.loads((out / "summary.json").read_text())
    for record in (meta, summary):
        assert (record["profile"], record["precision"], record["world_size"], record["global_batch"]) == (
            "zero2", "bf16", 1, 2)
    assert summary["run_plan"] == str(out / PLAN_NAME)


def test_hf_zero_train_reads_the_yaml_and_profile_and_runs_the_recipe_once_before_the_ranks(tmp_path, monkeypatch):
    """The launcher side of `hf-zero train` (flags, profile, preflight, assets, the run plan): each input is read,
    parsed and validated once, and the plan the ranks get was resolved from it. The launch itself is stood in."""
    import pathlib

    from accelerate.commands import launch as accelerate_launch

    from hf_zero import cli
    from hf_zero.plan import parse, profiles, shipped

    counts = {"yaml": 0, "yaml file": 0, "recipe": 0, "profile": 0}

    def counting(module, name, key):
        real = getattr(module, name)

        def wrapper(*a, **k):
            counts[key] += 1
            return real(*a, **k)
        monkeypatch.setattr(module, name, wrapper)

    counting(parse, "_read_yaml_config", "yaml")
    counting(shipped, "_exec_recipe", "recipe")
    counting(profiles, "_read_profile", "profile")
    read_text = pathlib.Path.read_text

    def reading(self, *a, **k):
        counts["yaml file"] += self.resolve() == TINY.resolve()
        return read_text(self, *a, **k)
    monkeypatch.setattr(pathlib.Path, "read_text", reading)
    launched = []
    monkeypatch.setattr(accelerate_launch, "launch_command", lambda args: launched.append(
        RunPlan.from_json(pathlib.Path(os.environ[PLAN_ENV]).read_text())))
    assert cli.main(["train", "--profile", "zero3", "--nproc", "2", *_argv(tmp_path / "out"),
                     "--max_steps", "2"]) == 0
    assert counts == {"yaml": 1, "yaml file": 1, "recipe": 1, "profile": 1}
    (plan,) = launched
    assert (plan.profile.name, plan.world, plan.argv[-2:]) == ("zero3", 2, ("--max_steps", "2"))
    # outside `hf-zero train`, a second read reads again (a test, a long-lived caller, a file written meanwhile)
    parse.load_yaml_config(str(TINY))
    assert counts["yaml"] == 2
