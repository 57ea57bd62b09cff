"""The `accelerate launch` line that runs a recipe under a profile, and the recipe's own relaunch when a profile is
passed after the script (`python recipe.py --config_file zero3.yaml`)."""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

from hf_zero.core.errors import UserError
from hf_zero.data.assets import prepare_run_assets
from hf_zero.launch.interrupt import RESUME_ENV
from hf_zero.plan.parse import pop_flag, recipe_assets
from hf_zero.plan.profiles import PROFILE_ENV, accelerate_precision, load_profile, resolve_profile_path
from hf_zero.plan.world import launch_shape, world_from_env

__all__ = ["build_launch_command", "ensure_launched", "prepare_assets"]


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
    if nproc is not None or nodes is not None:
        # accelerate counts processes over all machines; NPROC is per machine, as users think of GPUs (and
        # without it, the profile's per machine: the world the run plan resolves for these flags).
        cmd += ["--num_processes", str(launch_shape(prof, nproc=nproc, nodes=nodes).world)]
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
    profile, rest = pop_flag(argv, "--config_file")
    path = str(resolve_profile_path(profile))
    if os.environ.get(PROFILE_ENV) and str(resolve_profile_path(os.environ[PROFILE_ENV])) == path:
        return rest
    if world_from_env() > 1:
        right = f"accelerate launch --config_file {shlex.quote(profile)} {shlex.quote(script)} {shlex.join(rest)}"
        raise UserError("--config_file", "a profile given after the script cannot change a running launch",
                        f"run: {right}")
    cmd, env = build_launch_command(profile, script, rest, launcher="hf_zero.launch.launcher")
    prepare_assets(rest)
    print(f"[hf_zero] relaunching under profile {Path(path).stem}: {shlex.join(cmd)}", file=sys.stderr, flush=True)
    if RESUME_ENV not in os.environ:  # "resume with: ..." repeats what the user ran
        env[RESUME_ENV] = shlex.join(["python", script, *argv])
    os.execvpe(cmd[0], cmd, {**os.environ, **env})
    return rest  # not reached


def prepare_assets(recipe_argv: list[str]) -> None:
    """The run's offline model and data, built here, once, before any rank starts (hf_zero/data/assets.py)."""
    prepare_run_assets(*recipe_assets(recipe_argv))
