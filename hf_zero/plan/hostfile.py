"""Multi-node from a DeepSpeed hostfile (`host slots=N` per line): the same file users keep for the `deepspeed`
launcher, turned into accelerate's standard (torchrun-style) per-node launch. The first host is machine 0 and
hosts the rendezvous; each machine runs the same `hf-zero train --hostfile FILE` and finds its rank by its name.
"""

from __future__ import annotations

import socket

from hf_zero.core.errors import UserError

__all__ = ["read_hostfile", "find_machine_rank", "apply_hostfile"]


def read_hostfile(path: str) -> list[tuple[str, int]]:
    """[(host, slots), ...] in file order, parsed by DeepSpeed's own reader so both launchers agree on the format."""
    import contextlib
    import logging
    import os
    import sys

    if not os.path.isfile(path):
        raise UserError("--hostfile", f"{path} does not exist", "write one line per machine: `HOST slots=N`")
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed names its accelerator on stdout; a dry run prints there
        from deepspeed.launcher.runner import fetch_hostfile, logger

    level = logger.level
    logger.setLevel(logging.CRITICAL)  # DeepSpeed logs the whole file before raising; one line is enough
    try:
        pool = fetch_hostfile(path)
    except ValueError as err:
        raise UserError("--hostfile", f"{path}: {err}", "write one line per machine: `HOST slots=N`") from None
    finally:
        logger.setLevel(level)
    hosts = list(pool.items())
    if len({slots for _, slots in hosts}) != 1:
        # accelerate's standard launcher starts num_processes / num_machines on every machine.
        raise UserError("--hostfile", f"{path} gives machines different slot counts ({hosts})",
                        "use the same slots=N on every line")
    if hosts[0][1] < 1:
        raise UserError("--hostfile", f"{path} gives slots=0", "use slots=N with N >= 1 (processes per machine)")
    return hosts


def find_machine_rank(hosts: list[str]) -> int | None:
    """This machine's line in the hostfile, matched by hostname, FQDN or address; None when not exactly one."""
    names = {socket.gethostname(), socket.getfqdn()}
    names |= {n.split(".")[0] for n in names}
    try:
        names.add(socket.gethostbyname(socket.gethostname()))
    except OSError:
        pass
    matches = [i for i, h in enumerate(hosts) if h in names or h.split(".")[0] in names]
    return matches[0] if len(matches) == 1 else None


def apply_hostfile(args) -> None:
    """Fill `hf-zero train`'s --nodes/--nproc/--main-ip/--machine-rank from --hostfile; explicit flags win."""
    hosts = read_hostfile(args.hostfile)
    names = [h for h, _ in hosts]
    args.nodes = args.nodes or len(hosts)
    if args.nodes != len(hosts):
        raise UserError("--nodes", f"{args.nodes} machines but {args.hostfile} lists {len(hosts)}",
                        "drop --nodes (the hostfile sets it) or fix the hostfile")
    args.nproc = args.nproc or hosts[0][1]
    args.main_ip = args.main_ip or names[0]
    if args.machine_rank is None:
        args.machine_rank = find_machine_rank(names)
        if args.machine_rank is None:
            raise UserError("--machine-rank", f"cannot tell which line of {args.hostfile} is this machine "
                            f"({socket.gethostname()})", f"pass --machine-rank 0..{len(hosts) - 1}")
    if not 0 <= args.machine_rank < len(hosts):
        raise UserError("--machine-rank", f"{args.machine_rank} is outside 0..{len(hosts) - 1}",
                        f"{args.hostfile} lists {len(hosts)} machines")
