"""Where the profiles, recipes and bench scripts hf_zero ships are: one copy of each, at the top of the repository
(`accelerate_configs/`, `recipes/`, `benchmarks/`, what users open, copy and launch), which setup.cfg packages as
`hf_zero.accelerate_configs`, `hf_zero.recipes` and `hf_zero.benchmarks`. A wheel (`pip install .`) finds them
through the import system; a checkout or an editable install, whose import system does not map those names to the
top-level folders, finds them beside the package."""

from __future__ import annotations

from functools import cache
from pathlib import Path

__all__ = ["shipped_dir"]

_KINDS = ("accelerate_configs", "recipes", "benchmarks")


@cache
def shipped_dir(kind: str) -> Path:
    """The folder of shipped `kind` files (one of accelerate_configs, recipes, benchmarks)."""
    import importlib.util

    if kind not in _KINDS:
        raise ValueError(f"unknown shipped folder {kind!r}")
    spec = importlib.util.find_spec(f"hf_zero.{kind}")  # a data-only folder: a namespace package in the wheel
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    return Path(__file__).resolve().parent.parent / kind
