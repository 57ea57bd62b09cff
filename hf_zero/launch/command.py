"""Starting recipes under a profile: `hf-zero train`, `hf-zero profiles`, and the recipe's own relaunch when a
profile is passed after the script (`accelerate launch recipe.py --config_file zero3.yaml`)."""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

from hf_zero.core.errors import EXIT_USAGE, UserError
from hf_zero.estimate.recipe import pick_profile
from hf_zero.plan.parse import HF_ZERO_TRAINING_DEFAULTS
from hf_zero.plan.profiles import (
    PROFILE_ENV,
    accelerate_precision,
    list_profiles,
    load_profile,
    resolve_profile_path,
)
from hf_zero.plan.shipped import shipped_dir

__all__ = ["build_launch_command", "ensure_launched", "add_arguments", "run", "DEFAULT_RECIPE", "DEFAULT_CONFIG"]

DEFAULT_RECIPE = shipped_dir("recipes") / "curriculum.py"
DEFAULT_CONFIG = shipped_dir("recipes") / "configs" / "smollm2_shakespeare.yaml"


def build_launch_command(profile: str, script: str, script_args: list[str], nproc: int | None = None,
                         precision: str | None = None, nodes: int | None = None, machine_rank: int | None = None,
                         main_ip: str | None = None, main_port: int | None = None,
                         launcher: str = "accelerate.commands.launch") -> tuple[list[str], dict]:
    """The `accelerate launch` line (and extra environment) that runs `script` under `profile`; `launcher`
    "hf_zero.launch.launcher" is the same launch with its failures and interruptions told in one line."""
    prof = load_profile(profile)
    cmd = [sys.executable, "-m", launcher, "--config_file", prof.path]
    if nodes is not None:
        cmd += ["--num_machines", str(nodes)]
    if nproc is not None:
        # accelerate counts processes over all machines; NPROC is per machine, as users think of GPUs.
        cmd += ["--num_processes", str(nproc * (nodes or prof.num_machines))]
    if machine_rank is not None:
        cmd += ["--machine_rank", str(machine_rank)]
    if main_ip:
        cmd += ["--main_process_ip", main_ip]
    if main_port:
        cmd += ["--main_process_port", str(main_port)]
    if precision:
        cmd += ["--mixed_precision", accelerate_precision(precision)]
    if prof.num_machines > 1 or (nodes or 1) > 1:
        cmd += ["--deepspeed_multinode_launcher", "standard"] if prof.uses_deepspeed else []
    env = {PROFILE_ENV: prof.path}
    return cmd + [script, *script_args], env


def ensure_launched(argv: list[str], script: str) -> list[str]:
    """Handle `--config_file PROFILE` given to the recipe itself; return argv without it.

    Under the right profile already: nothing to do. In a single process: re-exec under `accelerate launch` with
    that profile. Inside a multi-process launch of another profile: a one-line error with the right command.
    """
    if "--config_file" not in argv and not any(a.startswith("--config_file=") for a in argv):
        return argv
    from hf_zero.plan.parse import pop_flag

    profile, rest = pop_flag(argv, "--config_file")
    path = str(resolve_profile_path(profile))
    if os.environ.get(PROFILE_ENV) and str(resolve_profile_path(os.environ[PROFILE_ENV])) == path:
        return rest
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        right = f"accelerate launch --config_file {shlex.quote(profile)} {shlex.quote(script)} {shlex.join(rest)}"
        raise UserError("--config_file", "a profile given after the script cannot change a running launch",
                        f"run: {right}")
    cmd, env = build_launch_command(profile, script, rest, launcher="hf_zero.launch.launcher")
    _prepare_assets(rest)
    print(f"[hf_zero] relaunching under profile {Path(path).stem}: {shlex.join(cmd)}", file=sys.stderr, flush=True)
    from hf_zero.launch.interrupt import RESUME_ENV

    if RESUME_ENV not in os.environ:  # "resume with: ..." repeats what the user ran
        env[RESUME_ENV] = shlex.join(["python", script, *argv])
    os.execvpe(cmd[0], cmd, {**os.environ, **env})
    return rest  # not reached


def _prepare_assets(recipe_argv: list[str]) -> None:
    """The run's offline model and data, built here, once, before any rank starts (hf_zero/data/assets.py)."""
    from hf_zero.data.assets import prepare_run_assets
    from hf_zero.plan.parse import recipe_assets

    prepare_run_assets(*recipe_assets(recipe_argv))


def add_arguments(parser, name: str) -> None:
    if name == "profiles":
        parser.add_argument("--pick", action="store_true", help="print only the profile this machine would use")
        return
    parser.add_argument("--profile", help="profile name or accelerate YAML (default: picked from the hardware)")
    parser.add_argument("--nproc", type=int, help="processes per machine (default: the profile's)")
    parser.add_argument("--precision", help="override the profile's precision: fp32, bf16 or fp16")
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="recipe YAML (default: %(default)s)")
    parser.add_argument("--recipe", help="recipe script (default: the YAML's `recipe:`, else the curriculum recipe)")
    parser.add_argument("--help-recipe", nargs="?", const="own", choices=("own", "all"), metavar="all",
                        help="list the recipe's flags with their help and exit (all: TrainingArguments' too)")
    parser.add_argument("--nodes", type=int, help="machines in the job (multi-node)")
    parser.add_argument("--machine-rank", type=int, help="this machine's rank (multi-node)")
    parser.add_argument("--main-ip", help="address of machine 0 (multi-node)")
    parser.add_argument("--main-port", type=int, help="port on machine 0 (multi-node)")
    parser.add_argument("--hostfile", help="DeepSpeed hostfile (`HOST slots=N` lines): sets --nodes, --nproc, "
                        "--main-ip (first host) and --machine-rank (this host's line) unless given")
    parser.add_argument("--dry-run", action="store_true", help="print the launch command instead of running it")
    parser.add_argument("--verbose", action="store_true", help="every rank's output and the libraries' warnings, "
                        "progress bars and launcher logs, unfiltered")
    parser.epilog = (
        "Every field of the recipe is a flag too, passed on to it and overriding its YAML key, in the YAML's\n"
        "spelling (e.g. hf-zero train --max_steps 20 --learning_rate 1e-4): the recipe's own fields and every\n"
        "TrainingArguments field (transformers). List them: hf-zero train --help-recipe (all: every one).\n"
        f"Default config: {DEFAULT_CONFIG}")


def recipe_help(types: tuple, everything: bool = False) -> list[str]:
    """The recipe's flags from its dataclasses (its ARGUMENT_TYPES), each with its help: the recipe's own fields,
    then the TrainingArguments ones, counted (listed too when `everything`)."""
    import dataclasses
    import textwrap

    from transformers import TrainingArguments

    inherited = {f.name: f for f in dataclasses.fields(TrainingArguments)}
    lines = []

    def describe(f) -> None:
        default = HF_ZERO_TRAINING_DEFAULTS.get(f.name, f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None))
        lines.append(f"  --{f.name} (default: {default})")
        lines.extend(textwrap.wrap(str(f.metadata.get("help", "")), 110, initial_indent=" " * 6,
                                   subsequent_indent=" " * 6))

    for cls in types:
        own = [f for f in dataclasses.fields(cls) if f.name not in inherited and f.init]
        lines.append(f"{cls.__name__}:")
        for f in own:
            describe(f)
    # the recipe's own class: a recipe may redeclare a TrainingArguments field with another default
    trainer = [f for f in dataclasses.fields(types[-1])
               if f.name in inherited and f.init and not f.name.startswith("_")]
    lines.append(f"and every TrainingArguments field (transformers): {len(trainer)} more, e.g. --learning_rate, "
                 "--max_steps, --save_steps" + (":" if everything else " (list them: --help-recipe all)"))
    if everything:
        for f in trainer:
            describe(f)
    return lines


ACCEPTS_EXTRA = {"train"}  # train passes unknown flags on to the recipe (e.g. --learning_rate 1e-4)


def _recipe_memory(config: str, extra: list[str]):
    """The recipe as it will run (flags after it included), for sizing the profile; None when unreadable: the recipe
    itself then reports what is wrong."""
    from hf_zero.core.errors import UserError
    from hf_zero.estimate.recipe import read_recipe

    try:
        return read_recipe(config, extra)
    except (UserError, OSError):
        return None


def validate_flags(args) -> None:
    """`hf-zero train`'s own numbers, before they reach accelerate (which asserts, or launches 0 processes)."""
    for flag, value, low in (("--nproc", args.nproc, 1), ("--nodes", args.nodes, 1), ("--machine-rank",
                             args.machine_rank, 0), ("--main-port", args.main_port, 1)):
        if value is not None and value < low:
            raise UserError(flag, f"must be at least {low}, got {value}",
                            "e.g. --nproc 2" if flag == "--nproc" else f"pass {flag} {low} or more")
    if args.main_port is not None and args.main_port > 65535:
        raise UserError("--main-port", f"{args.main_port} is not a TCP port", "use a port from 1024 to 65535")
    if args.nodes is not None and args.machine_rank is not None and args.machine_rank >= args.nodes:
        raise UserError("--machine-rank", f"{args.machine_rank} with --nodes {args.nodes}",
                        f"machine ranks run from 0 to {args.nodes - 1}")


def preflight(args, profile: str, extra: list[str]) -> bool | str:
    """`hf-zero check`'s checks (tokenizing the data and building cpu_adam aside) before any process starts: a
    configuration mistake costs seconds, not a launch. Every failure is one `hf-zero: error:` line."""
    from argparse import Namespace

    from hf_zero.tools.check import run_checks

    check_args = Namespace(profile=profile, config=args.config, nproc=args.nproc, hostfile=args.hostfile,
                           output_dir=None, gpus=None, precision=args.precision, extra=extra, recipe=args.recipe)
    failed = [r for r in run_checks(check_args, light=True) if r.ok is False]
    for r in failed:
        print(f"hf-zero: error: {r.error.line() if r.error else f'{r.name}: {r.message}'}", file=sys.stderr)
    return not failed and (getattr(check_args, "finished_run", None) or True)


def profiles_table(pick: str | None = None) -> list[str]:
    """One row per profile: processes, strategy, offload, precision and what it is for (its YAML's `# For:`)."""
    rows = [("profile", "processes", "strategy", "offload (optimizer / params)", "precision", "for")]
    for name in list_profiles():
        p = load_profile(name)
        strategy = f"ZeRO-{p.zero_stage}" if p.uses_deepspeed else {"NO": "none", "MULTI_GPU": "DDP"}.get(
            p.distributed_type, p.distributed_type)
        procs = f"{p.num_processes}" + (f" on {p.num_machines} machines" if p.num_machines > 1 else "")
        offload = " / ".join("-" if d == "none" else d.upper() if d == "cpu" else "NVMe"
                             for d in (p.offload_optimizer, p.offload_param))
        uses = next((ln[len("# For:"):].strip() for ln in Path(p.path).read_text().splitlines()
                     if ln.startswith("# For:")), "")
        rows.append((("* " if name == pick else "  ") + name, procs, strategy, offload, p.precision, uses))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1] for r in rows]


def run(args) -> int:
    if args.command == "profiles":
        name, why = pick_profile()
        if args.pick:
            print(name)
            return 0
        print("\n".join(profiles_table(name)))
        print(f"this machine: {name} ({why})")
        return 0
    validate_flags(args)
    from hf_zero.plan.shipped import load_recipe, recipe_argument_types, recipe_script

    args.recipe = str(recipe_script(args.recipe, args.config))
    if args.help_recipe:
        print(f"Flags of {args.recipe} (each also a key of the --config YAML; a flag overrides the YAML):")
        print("\n".join(recipe_help(recipe_argument_types(load_recipe(args.recipe)), args.help_recipe == "all")))
        return 0
    from hf_zero.launch.launcher import VERBOSE_ENV, quiet_environment

    if args.verbose:
        os.environ[VERBOSE_ENV] = "1"
    quiet_environment()  # before the preflight loads data and models: no progress bars there either
    profile = args.profile
    if not profile:
        from hf_zero.plan.profiles import gpu_count

        gpus = gpu_count()
        recipe = _recipe_memory(args.config, args.extra) if gpus else None
        profile, why = pick_profile(gpus, recipe=recipe, precision=args.precision)
        if gpus > 1 and args.nproc is None:
            args.nproc = gpus
        if recipe is not None and args.precision is None:  # run in the precision it was sized for
            args.precision = "bf16"
        print(f"[hf_zero] profile {profile}: {why}", flush=True)
    extra = [a for a in args.extra if a != "--"]
    if args.hostfile:
        from hf_zero.plan.hostfile import apply_hostfile

        apply_hostfile(args)
    cmd, env = build_launch_command(
        profile, args.recipe, ["--config", args.config, *extra], nproc=args.nproc, precision=args.precision,
        nodes=args.nodes, machine_rank=args.machine_rank, main_ip=args.main_ip, main_port=args.main_port,
        launcher="hf_zero.launch.launcher",
    )
    if args.dry_run:
        print(" ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()), shlex.join(cmd))
        return 0
    verdict = preflight(args, profile, extra)
    if not verdict:
        return EXIT_USAGE
    if isinstance(verdict, str):  # a finished run: the recipe would say the same after a launch
        from hf_zero.checkpoint.resume import complete_message

        print(f"[hf_zero] {complete_message(Path(verdict))}", flush=True)
        return 0
    _prepare_assets(["--config", args.config, *extra])
    from hf_zero.launch import launcher
    from hf_zero.launch.interrupt import RESUME_ENV

    env[RESUME_ENV] = shlex.join(["hf-zero", *getattr(args, "argv", ["train"])])
    os.environ.update(env)
    return launcher.main(cmd[3:])
