"""The world size: how many ranks a run has and how they spread over machines, derived here and nowhere else.

Before any rank starts it comes from the launch: processes per machine (`--nproc`, a hostfile's slots, a profile's
num_processes over its machines) times machines. Inside a rank it comes from what torchrun / accelerate put in every
rank's environment (WORLD_SIZE, LOCAL_WORLD_SIZE). The run plan (plan/run_plan.py) is resolved from these
functions, and a rank reads its world and nodes from the plan. Reading the live process group's size right before a
collective (`torch.distributed.get_world_size()`, to size its buffers) is reading, not deriving, and stays where the
collective is.
"""

from __future__ import annotations

import os

__all__ = ["world_of", "per_machine_of", "world_from_env", "per_machine_from_env", "nodes_from_env"]


def world_of(per_machine: int, machines: int) -> int:
    """All ranks of a launch: accelerate's num_processes counts every machine's processes, while `--nproc`, a
    hostfile's slots and a Slurm node's GPUs count one machine's."""
    return per_machine * machines


def per_machine_of(num_processes: int, machines: int) -> int:
    """One machine's processes from a profile's num_processes, which counts all machines."""
    return max(num_processes // max(machines, 1), 1)


def world_from_env(env=None, default: int | None = 1) -> int | None:
    """The running launch's world size, from the environment every rank gets; `default` outside a launch (None
    tells a plain `python` process apart from a launched one)."""
    env = os.environ if env is None else env
    return int(env["WORLD_SIZE"]) if "WORLD_SIZE" in env else default


def per_machine_from_env(env, world: int, machines: int = 1) -> int:
    """This machine's ranks (LOCAL_WORLD_SIZE), else the world spread evenly over `machines`."""
    return int(env.get("LOCAL_WORLD_SIZE") or per_machine_of(world, machines))


def nodes_from_env(env, world: int) -> int:
    """The machines a launch spans: its world over one machine's ranks (one without LOCAL_WORLD_SIZE)."""
    return max(world // per_machine_from_env(env, world), 1)
