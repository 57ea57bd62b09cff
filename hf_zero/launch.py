"""Starting recipes under a profile: `hf-zero train`, `hf-zero profiles`, and the recipe's own relaunch when a
profile is passed after the script (`accelerate launch recipe.py --config_file zero3.yaml`)."""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

from .errors import UserError
from .profiles import PROFILE_ENV, list_profiles, load_profile, pick_profile, resolve_profile_path

__all__ = ["build_launch_command", "ensure_launched", "add_arguments", "run", "DEFAULT_RECIPE", "DEFAULT_CONFIG"]

REPO = Path(__file__).resolve().parent.parent
DEFAULT_RECIPE = REPO / "recipes" / "curriculum.py"
DEFAULT_CONFIG = REPO / "recipes" / "configs" / "smollm2_shakespeare.yaml"


def build_launch_command(profile: str, script: str, script_args: list[str], nproc: int | None = None,
                         precision: str | None = None, nodes: int | None = None, machine_rank: int | None = None,
                         main_ip: str | None = None, main_port: int | None = None) -> tuple[list[str], dict]:
    """The `accelerate launch` line (and extra environment) that runs `script` under `profile`."""
    prof = load_profile(profile)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", prof.path]
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
        if precision not in ("no", "fp32", "bf16", "fp16"):
            raise UserError("--precision", f"unknown precision {precision!r}", "use fp32, bf16 or fp16")
        cmd += ["--mixed_precision", "no" if precision == "fp32" else precision]
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
    from .config import _pop_flag

    profile, rest = _pop_flag(argv, "--config_file")
    path = str(resolve_profile_path(profile))
    if os.environ.get(PROFILE_ENV) and str(resolve_profile_path(os.environ[PROFILE_ENV])) == path:
        return rest
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        right = f"accelerate launch --config_file {shlex.quote(profile)} {shlex.quote(script)} {shlex.join(rest)}"
        raise UserError("--config_file", "a profile given after the script cannot change a running launch",
                        f"run: {right}")
    cmd, env = build_launch_command(profile, script, rest)
    print(f"[hf_zero] relaunching under profile {Path(path).stem}: {shlex.join(cmd)}", file=sys.stderr, flush=True)
    os.execvpe(cmd[0], cmd, {**os.environ, **env})
    return rest  # not reached


def add_arguments(parser, name: str) -> None:
    if name == "profiles":
        parser.add_argument("--pick", action="store_true", help="print only the profile this machine would use")
        return
    parser.add_argument("--profile", help="profile name or accelerate YAML (default: picked from the hardware)")
    parser.add_argument("--nproc", type=int, help="processes per machine (default: the profile's)")
    parser.add_argument("--precision", help="override the profile's precision: fp32, bf16 or fp16")
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="recipe YAML")
    parser.add_argument("--recipe", default=str(DEFAULT_RECIPE), help="recipe script")
    parser.add_argument("--nodes", type=int, help="machines in the job (multi-node)")
    parser.add_argument("--machine-rank", type=int, help="this machine's rank (multi-node)")
    parser.add_argument("--main-ip", help="address of machine 0 (multi-node)")
    parser.add_argument("--main-port", type=int, help="port on machine 0 (multi-node)")
    parser.add_argument("--hostfile", help="DeepSpeed hostfile (`HOST slots=N` lines): sets --nodes, --nproc, "
                        "--main-ip (first host) and --machine-rank (this host's line) unless given")
    parser.add_argument("--dry-run", action="store_true", help="print the launch command instead of running it")


ACCEPTS_EXTRA = {"train"}  # train passes unknown flags on to the recipe (e.g. --learning_rate 1e-4)


def _recipe_memory(config: str, extra: list[str]):
    """The recipe as it will run (flags after it included), for sizing the profile; None when unreadable: the recipe
    itself then reports what is wrong."""
    from .errors import UserError
    from .recipe_memory import read_recipe

    try:
        return read_recipe(config, extra)
    except (UserError, OSError):
        return None


def run(args) -> int:
    if args.command == "profiles":
        name, why = pick_profile()
        if args.pick:
            print(name)
            return 0
        for p in list_profiles():
            print(f"{'*' if p == name else ' '} {p}")
        print(f"this machine: {name} ({why})")
        return 0
    profile = args.profile
    if not profile:
        from .profiles import gpu_count

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
        from .hostfile import apply_hostfile

        apply_hostfile(args)
    cmd, env = build_launch_command(
        profile, args.recipe, ["--config", args.config, *extra], nproc=args.nproc, precision=args.precision,
        nodes=args.nodes, machine_rank=args.machine_rank, main_ip=args.main_ip, main_port=args.main_port,
    )
    if args.dry_run:
        print(" ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()), shlex.join(cmd))
        return 0
    os.execvpe(cmd[0], cmd, {**os.environ, **env})
    return 0
