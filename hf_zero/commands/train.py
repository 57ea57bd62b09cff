"""`hf-zero train`: a recipe under a profile (picked from the hardware when none is given), checked before any
process starts, its offline assets built once, then launched through hf_zero's launcher."""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

from hf_zero.checkpoint.resume import complete_message
from hf_zero.core import startup
from hf_zero.core.console import VERBOSE_ENV, quiet_environment
from hf_zero.core.errors import EXIT_USAGE, UserError
from hf_zero.core.once import read_once
from hf_zero.core.validate import at_least
from hf_zero.estimate.pick import pick_profile
from hf_zero.estimate.recipe import read_recipe
from hf_zero.integrations.lean_import import import_training_args
from hf_zero.launch import launcher
from hf_zero.launch.interrupt import RESUME_ENV
from hf_zero.launch.launch_command import build_launch_command, prepare_assets
from hf_zero.plan import profiles
from hf_zero.plan.hostfile import apply_hostfile
from hf_zero.plan.one_stage import config_from_flags
from hf_zero.plan.parse import HF_ZERO_TRAINING_DEFAULTS
from hf_zero.plan.shipped import DEFAULT_CONFIG, load_recipe, recipe_argument_types, recipe_script
from hf_zero.preflight.checks import run_checks

__all__ = ["add_arguments", "run", "recipe_help", "validate_flags", "preflight", "ACCEPTS_EXTRA"]


def add_arguments(parser) -> None:
    parser.add_argument("--profile", help="profile name or accelerate YAML (default: picked from the hardware)")
    parser.add_argument("--nproc", type=int, help="processes per machine (default: the profile's)")
    parser.add_argument("--precision", help="override the profile's precision: fp32, bf16 or fp16")
    parser.add_argument("--config", help=f"recipe YAML (default: {DEFAULT_CONFIG}, unless --data is given)")
    parser.add_argument("--model", help="model name, hub id or folder: sets model_name_or_path (with --data: the "
                        "model of a one-stage recipe)")
    parser.add_argument("--data", nargs="+", metavar="FILE", help="train on these files (.jsonl/.json/.csv/.parquet/"
                        ".txt, or a hub dataset id) in one stage, without a YAML: text, prompt-completion or chat "
                        "messages, read from the columns (hf-zero init writes the same recipe as a YAML)")
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


ACCEPTS_EXTRA = True  # unknown flags go on to the recipe (e.g. --learning_rate 1e-4)


def _recipe_memory(config: str, extra: list[str]):
    """The recipe as it will run (flags after it included), for sizing the profile, its model counted whole where it
    has encoders or a vision tower; None when unreadable: the recipe itself then reports what is wrong."""
    from hf_zero.train.recipe_count import with_parts

    try:
        return with_parts(read_recipe(config, extra), extra)
    except (UserError, OSError):
        return None


def validate_flags(args) -> None:
    """`hf-zero train`'s own numbers, before they reach accelerate (which asserts, or launches 0 processes)."""
    for flag, value, low in (("--nproc", args.nproc, 1), ("--nodes", args.nodes, 1), ("--machine-rank",
                             args.machine_rank, 0), ("--main-port", args.main_port, 1)):
        at_least(flag, value, low, "e.g. --nproc 2" if flag == "--nproc" else f"pass {flag} {low} or more")
    if args.main_port is not None and args.main_port > 65535:
        raise UserError("--main-port", f"{args.main_port} is not a TCP port", "use a port from 1024 to 65535")
    if args.nodes is not None and args.machine_rank is not None and args.machine_rank >= args.nodes:
        raise UserError("--machine-rank", f"{args.machine_rank} with --nodes {args.nodes}",
                        f"machine ranks run from 0 to {args.nodes - 1}")


def preflight(args, profile: str, extra: list[str]) -> bool | str:
    """`hf-zero check`'s checks (tokenizing the data and building cpu_adam aside) before any process starts: a
    configuration mistake costs seconds, not a launch. Every failure is one `hf-zero: error:` line."""
    from argparse import Namespace

    check_args = Namespace(profile=profile, config=args.config, nproc=args.nproc, nodes=args.nodes,
                           hostfile=args.hostfile, output_dir=None, gpus=None, precision=args.precision, extra=extra,
                           recipe=args.recipe)
    failed = [r for r in run_checks(check_args, light=True) if r.ok is False]
    for r in failed:
        print(f"hf-zero: error: {r.error.line() if r.error else f'{r.name}: {r.message}'}", file=sys.stderr)
    return not failed and (getattr(check_args, "finished_run", None) or True)


def run(args) -> int:
    startup.start_clock()
    try:
        with read_once():  # the YAML, the recipe and the profile read once for the checks, the plan and the launch
            return _run(args)
    finally:
        startup.end_command()


def _run(args) -> int:
    validate_flags(args)
    if args.help_recipe:  # the recipe's argument classes load TrainingArguments without peft (plan/arguments.py)
        args.recipe = str(recipe_script(args.recipe, args.config or str(DEFAULT_CONFIG)))
        print(f"Flags of {args.recipe} (each also a key of the --config YAML; a flag overrides the YAML):")
        print("\n".join(recipe_help(recipe_argument_types(load_recipe(args.recipe)), args.help_recipe == "all")))
        return 0
    if not args.dry_run:  # the first line, before torch loads: a start-up is never silent (hf_zero.core.startup)
        under = f" under profile {Path(args.profile).stem}" if args.profile else ""
        # what the command was given: no config with --data (its YAML is built below), the default without either
        given = args.config or (f"--data {' '.join(args.data)}" if args.data else str(DEFAULT_CONFIG))
        startup.phase(f"checking {given}{under}: recipe, data, model, launch", say=True)
        startup.start_heartbeat()
    import_training_args()  # the checks and the plan parse the recipe; they build no model: no peft here
    if args.verbose:
        os.environ[VERBOSE_ENV] = "1"
    quiet_environment()  # before the preflight loads data and models: no progress bars there either
    args.config, args.extra, line = config_from_flags(args.config, args.model, args.data, args.extra)
    if line:
        print(f"[hf_zero] {line}", flush=True)
    args.recipe = str(recipe_script(args.recipe, args.config))
    profile = args.profile
    if not profile:
        gpus = profiles.gpu_count()  # through the module: a test stands in a GPU count there
        recipe = _recipe_memory(args.config, args.extra) if gpus else None
        profile, why = pick_profile(gpus, recipe=recipe, precision=args.precision)
        if gpus > 1 and args.nproc is None:
            args.nproc = gpus
        if recipe is not None and args.precision is None:  # run in the precision it was sized for
            args.precision = "bf16"
        print(f"[hf_zero] profile {profile}: {why}", flush=True)
    extra = [a for a in args.extra if a != "--"]
    if args.hostfile:
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
        print(f"[hf_zero] {complete_message(Path(verdict))}", flush=True)
        return 0
    startup.phase("building or checking the offline model and data")
    prepare_assets(["--config", args.config, *extra])
    env[RESUME_ENV] = shlex.join(["hf-zero", *getattr(args, "argv", ["train"])])
    os.environ.update(env)
    return launcher.main(cmd[3:])
