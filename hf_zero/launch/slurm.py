"""`hf-zero slurm`: an sbatch script that runs a recipe on N nodes with the launchers that already exist.

One Slurm task per node; `srun` starts `accelerate launch` on every node with the machine rank Slurm gives it
($SLURM_NODEID) and the allocation's first host as the rendezvous. The script is requeue-safe: `--requeue`,
checkpoints in a fixed output_dir, and the recipe resumes from the latest one by itself. Every value is either
shell-quoted or checked against a strict pattern, so nothing in a user string can run as a command.

    hf-zero slurm --profile zero3 --config recipes/configs/tiny_curriculum.yaml --nodes 2 --gpus-per-node 8 \
        --partition gpu --time 04:00:00 --out job.sbatch && sbatch job.sbatch
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from hf_zero.core.errors import UserError
from hf_zero.core.validate import at_least
from hf_zero.launch.launch_command import build_launch_command
from hf_zero.plan.parse import load_yaml_config, pop_flag
from hf_zero.plan.profiles import load_profile
from hf_zero.plan.run_plan import resolve_plan
from hf_zero.plan.shipped import recipe_script
from hf_zero.plan.world import launch_shape

__all__ = ["build_sbatch_script"]


# #SBATCH lines are read by sbatch, not by a shell: quoting does not apply there, so values must be plain words.
_SLURM_WORD = re.compile(r"^[A-Za-z0-9_.,:+=@/-]+$")
_SLURM_TIME = re.compile(r"^(\d+|\d+:\d{2}(:\d{2})?|\d+-\d+(:\d{2}(:\d{2})?)?|infinite|UNLIMITED)$")
_SAFE_PATH = re.compile(r"^[A-Za-z0-9_.,:+=@/-]+$")  # also no '%': Slurm expands %j, %n... in log paths


def _check_word(flag: str, value, pattern=_SLURM_WORD, example="gpu") -> None:
    if value is not None and not pattern.match(str(value)):
        raise UserError(flag, f"{value!r} is not a plain Slurm value (no spaces, quotes, newlines or $)",
                        f"e.g. {flag} {example}")


def _comment(text) -> str:
    """Text safe inside a `#` comment: a newline in a user string would end the comment and start a command."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text))


def _output_dir(args, extra: list[str], yaml_values: dict) -> tuple[Path, list[str]]:
    """One output folder for every attempt of the job: a requeue resumes only if it looks in the same place."""
    from_extra, extra = pop_flag(extra, "--output_dir")
    if from_extra and args.output_dir and Path(from_extra).resolve() != Path(args.output_dir).resolve():
        raise UserError("--output_dir", f"given twice ({args.output_dir} and {from_extra})", "keep --output-dir only")
    chosen = args.output_dir or from_extra or yaml_values.get("output_dir") or f"runs/{Path(args.config).stem}"
    return Path(chosen).expanduser().resolve(), extra


def _requeue_checkpointing(yaml_values: dict, extra: list[str], save_steps: int) -> list[str]:
    """Flags that make a requeued attempt resume: checkpoints must exist and the recipe must look for them."""
    values = dict(yaml_values)
    for i, arg in enumerate(extra):
        name, eq, value = arg.partition("=")
        if name in ("--save_strategy", "--fresh_start"):
            following = extra[i + 1] if i + 1 < len(extra) else ""
            # A bare `--fresh_start` means true, as HfArgumentParser reads it.
            values[name[2:]] = value if eq else following if following and not following.startswith("--") else "true"
    if str(values.get("fresh_start", False)).lower() in ("true", "1", "yes"):
        raise UserError("fresh_start", "a requeued job would ignore its checkpoints and start over",
                        "drop fresh_start (use a new --output-dir for a fresh run)")
    if "save_strategy" not in values:
        return ["--save_strategy", "steps", "--save_steps", str(save_steps)]
    if str(values["save_strategy"]).lower() == "no":
        raise UserError("save_strategy", "is 'no': a requeued job would have no checkpoint and start over",
                        "remove it (hf-zero slurm then saves every --save-steps) or use save_strategy: steps")
    return []


def build_sbatch_script(args, extra: list[str], command_line: str = "") -> str:
    """The sbatch script text for parsed `hf-zero slurm` args; raises UserError on anything unsafe or inconsistent."""
    at_least("--nodes", args.nodes, 1, "e.g. --nodes 1")
    at_least("--gpus-per-node", args.gpus_per_node, 0, "e.g. --gpus-per-node 1")
    at_least("--nproc-per-node", args.nproc_per_node, 1, "e.g. --nproc-per-node 1")
    at_least("--cpus-per-task", args.cpus_per_task, 1, "e.g. --cpus-per-task 1")
    at_least("--save-steps", args.save_steps, 1, "e.g. --save-steps 1")
    if not 1 <= args.main_port <= 65535:
        raise UserError("--main-port", f"{args.main_port} is not a TCP port", "e.g. --main-port 29500")
    for flag, value in (("--partition", args.partition), ("--account", args.account), ("--job-name", args.job_name)):
        _check_word(flag, value)
    _check_word("--time", args.time, _SLURM_TIME, "04:00:00")
    profile = load_profile(args.profile)
    config = Path(args.config).expanduser().resolve()
    yaml_values = load_yaml_config(str(config))
    recipe = recipe_script(args.recipe, args.config).expanduser().resolve()
    if not recipe.is_file():
        raise UserError("--recipe", f"{recipe} does not exist", "pass a recipe script, e.g. recipes/curriculum.py")
    nproc = launch_shape(profile, nproc=args.nproc_per_node or args.gpus_per_node or None,
                         nodes=args.nodes).per_machine
    if args.gpus_per_node and nproc > args.gpus_per_node:
        raise UserError("--nproc-per-node", f"{nproc} processes for {args.gpus_per_node} GPUs per node",
                        "use at most one process per GPU")
    extra = [a for a in extra if a != "--"]
    output_dir, extra = _output_dir(args, extra, yaml_values)
    log_dir = Path(args.log_dir).expanduser().resolve() if args.log_dir else output_dir / "slurm_logs"
    _check_word("--log-dir", str(log_dir), _SAFE_PATH, "/shared/logs")
    checkpointing = _requeue_checkpointing(yaml_values, extra, args.save_steps)

    launch, env = build_launch_command(profile.path, str(recipe), [], nproc=nproc, precision=args.precision,
                                       nodes=args.nodes, main_port=args.main_port)
    launcher = launch[:-1]  # the recipe comes last; the per-node flags must precede it
    launcher[0] = args.python
    recipe_args = ["--config", str(config), "--output_dir", str(output_dir), *checkpointing, *extra]
    # the plan every node's launcher will resolve for this line (hf_zero.plan.run_plan), checked here, before sbatch
    plan = resolve_plan(profile, str(recipe), recipe_args, nproc=nproc, nodes=args.nodes, precision=args.precision,
                        gpus=args.gpus_per_node, env={})
    # The node's rank and the main host are known only inside the allocation: expanded by the task's own shell.
    task = (f'exec {shlex.join(launcher)} --machine_rank "$SLURM_NODEID" --main_process_ip "$MAIN_IP" '
            f"{shlex.join([str(recipe), *recipe_args])}")
    sbatch = {"job-name": args.job_name, "nodes": args.nodes, "ntasks-per-node": 1,
              "gpus-per-node": args.gpus_per_node or None, "cpus-per-task": args.cpus_per_task,
              "partition": args.partition, "account": args.account, "time": args.time}
    cpus = ' ${SLURM_CPUS_PER_TASK:+--cpus-per-task="$SLURM_CPUS_PER_TASK"}'  # srun no longer inherits it (22.05+)
    lines = [
        "#!/bin/bash",
        f"# Written by: {_comment(command_line or 'hf-zero slurm')}",
        f"# {plan.nodes} node(s) x {nproc} process(es) = {plan.world} ranks, profile {_comment(profile.name)}.",
        f"# batch: {plan.batch.line()} | precision: {plan.precision}",
        "# Requeue-safe: a requeued job (scontrol requeue, node failure, preemption) reruns this script and the",
        f"# recipe resumes from the latest checkpoint in {_comment(output_dir)}.",
        *(f"#SBATCH --{k}={v}" for k, v in sbatch.items() if v is not None),
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
        f"#SBATCH --output={log_dir}/%x-%j.out",
        "set -euo pipefail",
        f"cd {shlex.quote(str(Path.cwd()))}",
        *(f"export {k}={shlex.quote(v)}" for k, v in env.items()),
        "# Machine 0 of the allocation hosts the rendezvous; every task reads it from the environment.",
        "# (sed, not head: head's early exit would SIGPIPE scontrol and pipefail would end the job.)",
        'MAIN_IP=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)',
        "export MAIN_IP",
        f'mkdir -p {shlex.quote(str(log_dir))}',
        'echo "[hf_zero] job $SLURM_JOB_ID attempt $((${SLURM_RESTART_COUNT:-0} + 1)) on $SLURM_JOB_NODELIST, '
        'main $MAIN_IP"',
        f"srun --nodes={args.nodes} --ntasks-per-node=1{cpus} --kill-on-bad-exit=1 \\",
        f"    --output={log_dir}/%x-%j-node%n.out \\",
        f"    bash -c {shlex.quote(task)}",
        "",
    ]
    return "\n".join(lines)


