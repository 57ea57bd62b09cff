"""The run plan: what every process of a run must agree on, resolved once and written as one file.

`resolve_run` turns (profile, recipe YAML + flags, hardware) into a frozen `RunPlan`: the profile as it runs
(processes and precision applied), world / nodes / devices, the batch plan, the TrainingArguments values that
reconciliation decided (precision flags, accumulation, the DeepSpeed dict), the output folder and the recipe.

- hf_zero's launcher (`hf-zero train`, a recipe relaunching itself) resolves it before any rank starts, writes it
  into the launch's own folder and hands its path to the ranks in HF_ZERO_RUN_PLAN; they read it, and only parse
  what is the recipe's own (data, model, stages).
- A plain `accelerate launch` (the bench, a Slurm job, a user's own command) has no hf_zero launcher: each rank
  resolves the same plan with the same function from what accelerate put in its environment.
- Every command that shows a run before it starts (`hf-zero check`, `estimate --config`, `slurm`, `preview`, the
  bench) resolves it with `resolve_plan`, the same function the launcher's `plan_for_launch` calls, and reads world,
  machines, batch and precision from it.
Once the run starts (not for a finished run asked to train again), rank 0 writes it as `<output_dir>/run_plan.json`.
Checkpoint metadata and summary.json copy `record()`; nothing else derives these values.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from hf_zero.core.errors import UserError
from hf_zero.core.files import write_text_atomic
from hf_zero.plan.parse import parse_recipe_args
from hf_zero.plan.profiles import Profile, gpu_count, profile_from_env, with_precision
from hf_zero.plan.reconcile import BatchPlan, reconcile_training_kwargs, resolve_batch
from hf_zero.plan.shipped import load_recipe, recipe_argument_types
from hf_zero.plan.world import launch_shape, nodes_from_env, world_from_env

__all__ = ["PLAN_ENV", "PLAN_NAME", "RunPlan", "resolve_run", "resolve_plan", "plan_for_launch", "plan_in_worker"]

PLAN_ENV = "HF_ZERO_RUN_PLAN"
PLAN_NAME = "run_plan.json"


@dataclass(frozen=True)
class RunPlan:
    profile: Profile  # as the run uses it: num_processes is the world size, mixed_precision the precision
    batch: BatchPlan
    nodes: int
    gpus: int  # accelerator devices per machine; 0 on a CPU machine
    training: dict = field(repr=False)  # TrainingArguments values reconciliation decided (on top of the recipe's)
    output_dir: str
    recipe: str  # the recipe script's name: curriculum, classify, ...
    config: str | None
    argv: tuple[str, ...]  # the recipe's arguments the plan was resolved from (--config YAML and flags)

    @property
    def world(self) -> int:
        return self.batch.world

    @property
    def precision(self) -> str:
        return self.profile.precision

    @property
    def path(self) -> Path:
        return Path(self.output_dir) / PLAN_NAME

    def record(self) -> dict:
        """What summary.json and every checkpoint's metadata say about how the run was laid out."""
        p = self.profile
        return {
            "profile": p.name,
            "zero_stage": int(p.zero_stage or 0) if p.uses_deepspeed else 0,
            "engine": p.engine,
            "sharding": p.sharding,
            "offload_optimizer": p.offload_optimizer,
            "offload_param": p.offload_param,
            "precision": self.precision,
            "world_size": self.world,
            "micro_batch": self.batch.micro,
            "grad_accum": self.batch.accumulation,
            "global_batch": self.batch.global_batch,
            # only under sequence parallelism, where world_size counts sp ranks per data-parallel group
            **({"sp_size": self.batch.sp, "dp_size": self.batch.dp} if self.batch.sp > 1 else {}),
        }

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> RunPlan:
        data = json.loads(text)
        return cls(**{**data, "profile": Profile(**data["profile"]), "batch": BatchPlan(**data["batch"]),
                      "argv": tuple(data["argv"])})

    def write(self, path: Path | None = None) -> Path:
        path = Path(path or self.path)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, self.to_json())
        return path


def resolve_run(profile: Profile, parsed: tuple, training_kwargs: dict, *, world: int, nodes: int, gpus: int,
                recipe: str, config: str | None, argv, decide: bool = True, env=None) -> tuple[RunPlan, dict]:
    """The one resolver: the plan, and the TrainingArguments kwargs (the recipe's, with the plan's decisions).
    `decide` False: the plan as a command shows it before any rank starts (world, machines, batch, precision),
    without the decisions only the ranks need (the DeepSpeed dict, use_cpu, Liger), whose own mistakes
    `hf-zero check` reports under their own checks. `env`: where a plain `accelerate launch` says the profile's
    accumulation (default: this process's environment)."""
    profile = replace(profile, num_processes=world, num_machines=nodes)
    if decide:
        kwargs, batch = reconcile_training_kwargs(
            training_kwargs, profile, world, has_gpu=gpus > 0, global_batch=training_kwargs.get("global_batch_size"),
            model_args=next((a for a in parsed if hasattr(a, "model_name_or_path")), None), env=env,
        )
    else:
        kwargs, batch = dict(training_kwargs), resolve_batch(training_kwargs, world, profile, env=env)
    decided = {k: v for k, v in kwargs.items() if k not in training_kwargs or training_kwargs[k] != v}
    plan = RunPlan(profile=profile, batch=batch, nodes=nodes, gpus=gpus, training=decided,
                   output_dir=str(kwargs.get("output_dir") or ""), recipe=Path(recipe).stem, config=config,
                   argv=tuple(argv))
    return plan, kwargs


def resolve_plan(profile: Profile, script: str, argv, *, nproc: int | None = None, nodes: int | None = None,
                 world: int | None = None, hosts=None, precision: str | None = None, gpus: int | None = None,
                 parsed: tuple | None = None, decide: bool = False, env=None) -> RunPlan:
    """Recipe (`script` with its `argv`: --config YAML and flags) + profile + a command's launch flags -> the plan,
    as `hf-zero train`'s launcher resolves it (launch_shape for the ranks, with_precision for `--precision`).
    `parsed`: (recipe dataclasses, TrainingArguments kwargs, config) when the command has parsed them already."""
    shape = launch_shape(profile, nproc=nproc, nodes=nodes, world=world, hosts=hosts)
    if parsed is None:
        instances, _, training_kwargs, config = _parse(script, list(argv))
    else:
        instances, training_kwargs, config = parsed
    plan, _ = resolve_run(with_precision(profile, precision), tuple(instances), training_kwargs, world=shape.world,
                          nodes=shape.nodes, gpus=gpu_count() if gpus is None else gpus, recipe=script,
                          config=config, argv=argv, decide=decide, env=env)
    return plan


def _parse(script: str, argv: list[str], types: tuple | None = None):
    types = types or recipe_argument_types(load_recipe(script))
    *parsed, stages, training_kwargs, config = parse_recipe_args(types, list(argv))
    return tuple(parsed), stages, training_kwargs, config


def plan_for_launch(profile: Profile, script: str, argv: list[str], world: int, nodes: int, folder: Path) -> Path:
    """The launcher's side: resolve before any rank starts and write the plan into the launch's own `folder`; the
    ranks get that path, and rank 0 copies the plan beside the outputs once the run really starts (a finished run
    asked to train again is left as it was)."""
    parsed, _, training_kwargs, config = _parse(script, argv)
    plan, _ = resolve_run(profile, parsed, training_kwargs, world=world, nodes=nodes, gpus=gpu_count(),
                          recipe=script, config=config, argv=argv)
    return plan.write(Path(folder) / PLAN_NAME)


def plan_in_worker(types: tuple, argv: list[str], script: str, env=os.environ):
    """A rank's side: (parsed recipe dataclasses, stages, TrainingArguments kwargs, plan). The plan comes from the
    launcher's file when there is one, else it is resolved here, as the launcher would."""
    parsed, stages, training_kwargs, config = _parse(script, argv, types)
    world = world_from_env(env)
    if env.get(PLAN_ENV):
        path = Path(env[PLAN_ENV])
        try:
            plan = RunPlan.from_json(path.read_text())
        except (OSError, ValueError, TypeError) as err:
            raise UserError(PLAN_ENV, f"cannot read the run plan {path}: {err}",
                            "launch again with hf-zero train (it writes the plan), "
                            "or unset HF_ZERO_RUN_PLAN") from None
        if plan.argv != tuple(argv) or plan.world != world:
            raise UserError(PLAN_ENV, f"{path} was resolved for {plan.world} ranks and arguments "
                            f"{' '.join(plan.argv)}, but this rank runs in {world} with {' '.join(argv)}",
                            "launch through hf-zero train (or the recipe) again, or unset HF_ZERO_RUN_PLAN")
        return parsed, stages, {**training_kwargs, **plan.training}, plan
    nodes = nodes_from_env(env, world)
    plan, kwargs = resolve_run(profile_from_env(env), parsed, training_kwargs, world=world, nodes=nodes,
                               gpus=gpu_count(), recipe=script, config=config, argv=argv)
    return parsed, stages, kwargs, plan
