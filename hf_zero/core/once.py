"""One command, one read: inside `read_once()`, the recipe YAML, the recipe script and the profile are read, parsed
and validated the first time a tool asks for them, and every later ask (the preflight's checks, the profile pick,
the asset builder, the launcher's run plan) gets that result. `hf-zero train` resolves a run from these before any
rank starts; re-reading them there cost seconds of start-up and proved nothing new: nothing rewrites them meanwhile.
Outside the scope (the ranks, long-lived callers such as tests) every call reads afresh."""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path

__all__ = ["read_once", "once", "read_text"]

_memo: dict | None = None


@contextlib.contextmanager
def read_once():
    """The scope of one command: what `once` computes inside it is kept until it ends (nested scopes share it)."""
    global _memo
    outer = _memo
    _memo = {} if outer is None else outer
    try:
        yield
    finally:
        _memo = outer


def once(kind: str, key, compute, mutable: bool = False):
    """`compute()`, or inside `read_once()` its first result for (kind, key); `mutable`: a deep copy each time, for
    results the caller changes (a YAML's dict)."""
    if _memo is None:
        return compute()
    if (kind, key) not in _memo:
        _memo[kind, key] = compute()
    return copy.deepcopy(_memo[kind, key]) if mutable else _memo[kind, key]


def read_text(path) -> str:
    """The file's text; inside `read_once()` read from disk once (its values and its line numbers come from it)."""
    return once("text", str(Path(path).resolve()), lambda: Path(path).read_text())
