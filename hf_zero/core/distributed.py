"""Waits between processes that end: every collective, barrier and cache lock gives up after a stated time
(`HF_ZERO_DIST_TIMEOUT` seconds, or the recipe's `ddp_timeout`) with one line naming the rank and what it waited for,
instead of hanging for torch's default of 30 minutes (or forever, on a file lock)."""

from __future__ import annotations

import contextlib
import os
import time

from hf_zero.core import startup
from hf_zero.core.console import rank
from hf_zero.core.errors import UserError
from hf_zero.integrations.torch import set_default_group_timeout

__all__ = ["DIST_TIMEOUT_ENV", "DEFAULT_DIST_TIMEOUT", "DistWaitError", "RankLostError", "dist_timeout",
           "set_dist_timeout", "waiting_for", "stall_if_asked"]

DIST_TIMEOUT_ENV = "HF_ZERO_DIST_TIMEOUT"
# Long enough for the slowest legitimate gap between two collectives here (rank 0 verifying a saved SmolLM2, a
# DeepSpeed op JIT-built by one rank), short enough that a stuck run is noticed in minutes, not hours.
DEFAULT_DIST_TIMEOUT = 300
STALL_ENV = "HF_ZERO_TEST_STALL"  # "RANK:SECONDS": that rank sleeps before its first collective (tests only)

_timeout_s: int | None = None  # what the process group was given, for the message


class DistWaitError(UserError):
    """A wait that ran out. Printed by the rank that waited, whichever it is: rank 0 may be the one that is stuck."""

    every_rank = True


class RankLostError(UserError):
    """What the surviving ranks see when one exits: hf_zero's launcher tells the story of the rank that ended (its
    error, or the signal that killed it) instead of this line."""

    lost_rank = True


def dist_timeout() -> int:
    raw = os.environ.get(DIST_TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_DIST_TIMEOUT
    try:
        seconds = int(float(raw))
    except ValueError:
        seconds = 0
    if seconds <= 0:
        raise UserError(DIST_TIMEOUT_ENV, f"{raw!r} is not a positive number of seconds",
                        f"export {DIST_TIMEOUT_ENV}=600 (default {DEFAULT_DIST_TIMEOUT})")
    return seconds


def set_dist_timeout(seconds: int) -> None:
    """Give the default process group this timeout. accelerate creates it without one on the CPU (MULTI_CPU) path,
    and DeepSpeed's init_distributed ignores its timeout when the group already exists."""
    global _timeout_s
    from datetime import timedelta

    import torch.distributed as dist

    _timeout_s = int(seconds)
    if dist.is_available() and dist.is_initialized():
        set_default_group_timeout(timedelta(seconds=seconds))  # hf_zero/integrations/torch.py


@contextlib.contextmanager
def waiting_for(what: str, start_up_phase: bool = True):
    """Turn a collective that timed out (or lost its peer) inside the block into one line naming this rank and `what`
    it waited for. A lost peer is said only by rank 0: the rank that died has printed its own error. During
    start-up, `what` is the phase the heartbeat names meanwhile, unless `start_up_phase` is False: a block that
    names its own phases inside (train(): the engine's set-up, the first batch) keeps them."""
    before = startup.current() if start_up_phase else None
    if start_up_phase:
        startup.phase(f"waiting for {what}")
    try:
        yield
    except RuntimeError as err:  # gloo/NCCL raise RuntimeError (torch.distributed.DistError is one)
        import torch.distributed as dist

        text = str(err).lower()
        if not (isinstance(err, dist.DistError) or "gloo" in text or "nccl" in text):
            raise  # not a wait between ranks (e.g. a DataLoader's own timeout)
        limit = f"{_timeout_s} s" if _timeout_s else "its timeout"
        if "timed out" in text or "timeout" in text:
            raise DistWaitError(
                "distributed",
                f"rank {rank()} gave up after {limit} waiting for {what} (a rank is stuck or has died)",
                f"see that rank's output; if it is only slow, raise {DIST_TIMEOUT_ENV} (seconds) or ddp_timeout",
            ) from None
        if any(w in text for w in ("connection closed", "connection reset", "broken pipe", "connection refused")):
            raise RankLostError("distributed", f"rank {rank()} lost a rank while waiting for {what} (it exited)",
                                "see why that rank stopped: its error, or the launcher's line naming it") from None
        raise
    finally:
        if before:
            startup.phase(before)


def stall_if_asked() -> None:
    """Test hook: `HF_ZERO_TEST_STALL=1:600` makes rank 1 sleep 600 s before its first collective."""
    spec = os.environ.get(STALL_ENV)
    if spec:
        who, _, seconds = spec.partition(":")
        if who.strip() == str(rank()):
            time.sleep(float(seconds or 3600))
