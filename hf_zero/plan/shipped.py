"""Where the profiles, recipes and bench scripts hf_zero ships are: one copy of each, at the top of the repository
(`accelerate_configs/`, `recipes/`, `benchmarks/`, what users open, copy and launch), which setup.cfg packages as
`hf_zero.accelerate_configs`, `hf_zero.recipes` and `hf_zero.benchmarks`. A wheel (`pip install .`) finds them
through the import system; a checkout or an editable install, whose import system does not map those names to the
top-level folders, finds them beside the package."""

from __future__ import annotations

from functools import cache
from pathlib import Path

from hf_zero.core.errors import UserError
from hf_zero.core.once import once
from hf_zero.plan.parse import load_yaml_config

__all__ = ["DEFAULT_RECIPE", "DEFAULT_CONFIG", "shipped_dir", "recipe_script", "check_recipe_matches", "load_recipe",
           "recipe_argument_types"]

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
    return Path(__file__).resolve().parents[2] / kind


DEFAULT_RECIPE = shipped_dir("recipes") / "curriculum.py"
DEFAULT_CONFIG = shipped_dir("recipes") / "configs" / "smollm2_shakespeare.yaml"
RECIPE_KEY = "recipe"  # the YAML key naming the recipe a config is for (the curriculum recipe when absent)


def recipe_script(flag: str | None, config: str | None) -> Path:
    """The recipe script a run uses: `--recipe` if given, else the YAML's `recipe:` (a shipped recipe's name such as
    `classify`, or a path relative to the YAML), else the shipped curriculum recipe."""
    if flag:
        return Path(flag)
    named = _named_recipe(config)
    if named is None:
        return shipped_dir("recipes") / "curriculum.py"
    if "/" not in named and not named.endswith(".py"):
        path = shipped_dir("recipes") / f"{named}.py"
        if not path.is_file():
            shipped = sorted(p.stem for p in shipped_dir("recipes").glob("*.py"))
            raise UserError(RECIPE_KEY, f"no shipped recipe {named!r} (in {config})",
                            f"use one of {', '.join(shipped)} or a path to a recipe script")
        return path
    path = Path(named).expanduser()
    path = path if path.is_absolute() else Path(config).resolve().parent / path
    if not path.is_file():
        raise UserError(RECIPE_KEY, f"{path} does not exist (in {config})", "fix the path (relative to the YAML)")
    return path


def check_recipe_matches(config: str | None, script: str) -> None:
    """A YAML written for one recipe, launched with another, stops in one line instead of failing on its keys."""
    named = _named_recipe(config)
    if named is None:
        return
    want = recipe_script(None, config)
    if want.resolve() != Path(script).resolve() and want.name != Path(script).name:
        raise UserError(RECIPE_KEY, f"{config} is for {want.name}, launched with {Path(script).name}",
                        f"launch {want} (or `hf-zero train --config {config}`, which picks it)")


def _named_recipe(config: str | None) -> str | None:
    if not config or not Path(config).is_file():
        return None
    try:
        value = load_yaml_config(config).get(RECIPE_KEY)
    except UserError:  # unreadable YAML: the recipe itself (or check's recipe check) says where, in one line
        return None
    return str(value) if value is not None else None


def load_recipe(script: str | None):
    """The recipe script as a module, for what it declares to the tools (ARGUMENT_TYPES, CHECK_DATA); None when
    there is no such file."""
    if not script or not Path(script).is_file():
        return None
    return once("recipe", str(Path(script).resolve()), lambda: _exec_recipe(script))


def _exec_recipe(script: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"hf_zero_recipe_{Path(script).stem}", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # recipes keep their heavy imports inside main()
    return module


def recipe_argument_types(recipe_module) -> tuple:
    """The dataclasses a recipe parses, the last one its TrainingArguments subclass (its ARGUMENT_TYPES; the
    curriculum recipe's when it declares none)."""
    from hf_zero.plan.arguments import CurriculumArguments, ModelArguments

    return tuple(getattr(recipe_module, "ARGUMENT_TYPES", (ModelArguments, CurriculumArguments)))
