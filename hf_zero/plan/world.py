"""The world size: how many ranks a run has and how they spread over machines, derived here and nowhere else.

Before any rank starts it comes from the launch: processes per machine (`--nproc`, a hostfile's slots, a profile's
num_processes over its machines) times machines. Inside a rank it comes from what torchrun / accelerate put in every
rank's environment (WORLD_SIZE, LOCAL_WORLD_SIZE). The run plan (plan/run_plan.py) is resolved from these
functions, and a rank reads its world and nodes from the plan. Reading the live process group's size right before a
collective (`torch.distributed.get_world_size()`, to size its buffers) is reading, not deriving, and stays where the
collective is.

`launch_shape` is the one place a command turns its flags (`--nproc`, `--nodes`, a hostfile, accelerate's
`--num_processes`) and a profile into ranks and machines: `hf-zero train` and its launcher, `check`, `estimate`,
`slurm`, `preview` and the bench all ask it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["Shape", "launch_shape", "world_of", "per_machine_of", "world_from_env", "per_machine_from_env",
           "nodes_from_env"]


def world_of(per_machine: int, machines: int) -> int:
    """All ranks of a launch: accelerate's num_processes counts every machine's processes, while `--nproc`, a
    hostfile's slots and a Slurm node's GPUs count one machine's."""
    return per_machine * machines


def per_machine_of(num_processes: int, machines: int) -> int:
    """One machine's processes from a profile's num_processes, which counts all machines."""
    return max(num_processes // max(machines, 1), 1)


@dataclass(frozen=True)
class Shape:
    world: int  # every machine's ranks
    nodes: int  # machines

    @property
    def per_machine(self) -> int:
        return per_machine_of(self.world, self.nodes)


def launch_shape(profile=None, *, nproc: int | None = None, nodes: int | None = None, world: int | None = None,
                 hosts=None) -> Shape:
    """The ranks and machines a launch has. `nproc`: processes per machine (`--nproc`, a Slurm node's GPUs);
    `world`: all machines' (accelerate's `--num_processes`); `hosts`: a hostfile's (host, slots) lines, which set
    the machines and, without `nproc`, the processes per machine. Unsaid: the profile's processes per machine (one
    without a profile) on the profile's machines (or `nodes`)."""
    machines = int(nodes or (len(hosts) if hosts else 0) or (profile.num_machines if profile else 1))
    if world is not None:
        return Shape(int(world), machines)
    if nproc is None and hosts:
        nproc = hosts[0][1]
    if nproc is None:
        nproc = per_machine_of(profile.num_processes, profile.num_machines) if profile else 1
    return Shape(world_of(int(nproc), machines), machines)


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
