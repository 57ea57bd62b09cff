"""Reading a recipe: `--config recipe.yaml` sets defaults, command-line flags override them, `HfArgumentParser`
fills the recipe's argument classes (plan/arguments.py), and an unknown key in either is a one-line error naming the
key (with the closest known key). The YAML's `stages:` list is the one nested value; it is read into `Stage`
objects with the same strictness. Light to import (no transformers until a recipe is parsed): the launcher and
`hf-zero slurm` read YAMLs and flags with it.
"""

from __future__ import annotations

import difflib
import re
import sys
from dataclasses import fields
from pathlib import Path

import yaml

from hf_zero.core.config import Stage
from hf_zero.core.distributed import dist_timeout
from hf_zero.core.errors import UserError
from hf_zero.core.once import once, read_text
from hf_zero.core.validate import at_line, check_values, check_yaml_types, resolve_recipe_paths, yaml_lines
from hf_zero.core.yaml_safe import load_yaml
from hf_zero.integrations.parsers import parser_actions, set_action_types

__all__ = ["HF_ZERO_TRAINING_DEFAULTS", "load_yaml_config", "build_stage", "parse_stages", "parse_recipe_args",
           "recipe_fields", "pop_flag", "recipe_assets"]


# What hf_zero changes in TrainingArguments' defaults (the YAML and flags still override them): per-step loss
# logs for exact stage tables, TensorBoard, and no surprise hub pushes or wandb.
HF_ZERO_TRAINING_DEFAULTS = {
    "logging_steps": 1,
    "report_to": ["tensorboard"],
    "save_strategy": "no",
    "eval_strategy": "no",
    "learning_rate": 1e-3,
    "per_device_train_batch_size": 2,
    "per_device_eval_batch_size": 4,
    "disable_tqdm": None,  # decided at start: a progress bar on a terminal, one line per step in a log file
    "include_num_input_tokens_seen": "non_padding",  # tokens/s in every logging step
    "save_only_model": False,
    "lr_scheduler_type": "constant",
    "warmup_steps": 0,
}


# Names people carry over from other trainers: too short for difflib to match to the key they mean.
_ALIASES = {"lr": "learning_rate", "batch_size": "per_device_train_batch_size", "bs": "per_device_train_batch_size",
            "epochs": "num_train_epochs", "steps": "max_steps", "grad_accum": "gradient_accumulation_steps",
            "model": "model_name_or_path", "output": "output_dir", "out": "output_dir"}


def _unknown_key_error(key: str, known: list[str], where: str) -> UserError:
    key = key.split("=", 1)[0] if key.startswith("-") else key  # `--lr=1e-4`: the flag, not its value
    dashes = "--" if key.startswith("--") else ""
    bare = key.removeprefix("--")
    names = [k.removeprefix("--") for k in known]
    close = [_ALIASES[bare]] if _ALIASES.get(bare) in names else difflib.get_close_matches(bare, names, n=1)
    close = close or sorted(k for k in names if len(bare) >= 2 and k.startswith(bare))[:1]  # an abbreviation
    hint = f"did you mean `{dashes}{close[0]}`?" if close else "remove it or check the spelling"
    return UserError(key, f"unknown key in {where}", hint)


def load_yaml_config(path: str) -> dict:
    return once("yaml", str(Path(path).resolve()), lambda: _read_yaml_config(path), mutable=True)


def _read_yaml_config(path: str) -> dict:
    p = Path(path)
    if not p.is_file():
        raise UserError("--config", f"{path} does not exist",
                        "pass a recipe YAML, e.g. recipes/configs/tiny_curriculum.yaml")
    try:
        data = load_yaml(read_text(p), f"--config {path}") or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise UserError(f"--config {path}{where}", f"not valid YAML: {problem}",
                        "fix the indentation or quoting there") from None
    if not isinstance(data, dict):
        raise UserError("--config", f"{path} must hold a mapping of key: value")
    return data


def build_stage(item: dict, i: int, where: str | None, lines: dict | None = None) -> Stage:
    """Stage(**item), its mistakes located: `(in recipe.yaml line 7)`."""
    for key, fix in (("name", "give each stage a name"), ("data", "give each stage its data files")):
        if item.get(key) in (None, "", []):  # else Stage() says "__init__() missing 1 required positional argument"
            raise UserError(f"stages[{i}].{key}", f"missing {at_line(where, lines, f'stages[{i}]')}", fix)
    try:
        return Stage(**_yaml_spellings(item))
    except TypeError as err:  # a value of the wrong kind, e.g. `steps: ten`
        raise UserError(f"stages[{item.get('name', i)}]", f"a value has the wrong type ({str(err).splitlines()[0]}) "
                        f"{at_line(where, lines, f'stages[{i}]')}", "see docs/reference/recipe-keys.md") from None
    except UserError as err:
        key = err.field.rsplit(".", 1)[-1]
        raise UserError(err.field, f"{err.problem} {at_line(where, lines, f'stages[{i}].{key}', f'stages[{i}]')}",
                        err.fix) from None


_YAML11_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def _yaml_spellings(item: dict) -> dict:
    """A stage's values as the top-level keys read them (through argparse): `learning_rate: 1e-4`, a string to
    PyYAML (YAML 1.1 wants a dot), is the number; `train: lora`, one item, is the list of it."""
    import typing


    hints = typing.get_type_hints(Stage)
    out = dict(item)
    for key, value in item.items():
        kinds = typing.get_args(hints.get(key)) or (hints.get(key),)
        if float in kinds and isinstance(value, str) and _YAML11_FLOAT.fullmatch(value.strip()):
            out[key] = float(value)
        elif value is not None and not isinstance(value, (list, dict)) and any(
                typing.get_origin(k) is list for k in kinds):
            out[key] = [value]
    return out


def parse_stages(raw, where: str, lines: dict | None = None) -> list[Stage]:
    if raw is None:
        return []
    if not isinstance(raw, list) or not raw:
        raise UserError("stages", f"must be a non-empty list in {where}", "see recipes/configs/tiny_curriculum.yaml")

    known = [f.name for f in fields(Stage)]
    stages, seen = [], set()
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise UserError(f"stages[{i}]", "each stage needs at least `name` and `data`",
                            "see docs/reference/recipe-keys.md")
        if item.get("name") in (None, "", []):  # the keys below are named by the stage's name
            build_stage(item, i, where, lines)
        for key in item:
            if key not in known:
                raise _unknown_key_error(f"stages[{item['name']}].{key}", known, where)
        if item["name"] in seen:
            raise UserError(f"stages[{item['name']}].name", "stage names must be unique", "rename one of them")
        seen.add(item["name"])
        stages.append(build_stage(item, i, where, lines))
    return stages


def parse_recipe_args(dataclass_types: tuple, argv: list[str] | None = None, yaml_values: dict | None = None):
    """Parse `--config YAML` plus flags into the given dataclasses, the last one the recipe's TrainingArguments
    subclass.

    Returns (instances..., stages, training_kwargs, config path): the last class is *not* yet built, only its values
    (checked by its `clean_values`): the run plan decides part of them first, so it is constructed exactly once.
    `yaml_values` replaces the file's content (hf-zero check parses a copy without the keys it already reported);
    paths still resolve against the file.
    """
    from transformers import HfArgumentParser

    argv = list(sys.argv[1:] if argv is None else argv)
    config_path, argv = pop_flag(argv, "--config")
    if yaml_values is None:
        yaml_values = load_yaml_config(config_path) if config_path else {}
    yaml_values = resolve_recipe_paths(yaml_values, config_path)
    lines = yaml_lines(config_path)
    stages = parse_stages(yaml_values.pop("stages", None), config_path or "the command line", lines)
    # which recipe the YAML is for: read by the tools (hf_zero.plan.shipped), not by it
    yaml_values.pop("recipe", None)

    class _Parser(HfArgumentParser):
        def error(self, message):
            # "argument --learning_rate: invalid float value: 'x'" -> field --learning_rate, where it came from
            flag, _, problem = message.partition(": ") if message.startswith("argument ") else ("", "", message)
            raise UserError(flag.replace("argument ", "").split("/")[0] or "command line",
                            f"{problem} (on the command line)", "run with --help for the list of flags")

    *model_types, training_type = dataclass_types
    # no abbreviations: `--lr` would be "ambiguous" and `--learning_rat` silently --learning_rate; an unknown flag
    # gets its "did you mean" instead
    parser = _Parser(dataclass_types, allow_abbrev=False)
    _accept_str_or_bool(parser, dataclass_types)
    known = {a.dest for a in parser_actions(parser)}
    for key in yaml_values:
        if key not in known:
            raise _unknown_key_error(key, sorted(known), config_path)
    check_yaml_types(parser, yaml_values, config_path, lines)
    # `lora_target_modules: q_proj` is the list `--lora_target_modules q_proj` gives
    for action in parser_actions(parser):
        value = yaml_values.get(action.dest)
        if action.nargs in ("+", "*") and value is not None and not isinstance(value, (list, dict)):
            yaml_values[action.dest] = [value]
    defaults = {k: v for k, v in HF_ZERO_TRAINING_DEFAULTS.items() if k in known}
    defaults["output_dir"] = f"runs/{Path(config_path).stem}" if config_path else "runs/default"
    # minutes, not torch's 30: a stuck rank fails the run soon (hf_zero/core/distributed.py)
    if "ddp_timeout" in known:
        defaults["ddp_timeout"] = dist_timeout()
    parser.set_defaults(**{**defaults, **yaml_values})
    namespace, remaining = parser.parse_known_args(argv)
    if remaining:
        flag = next((r for r in remaining if r.startswith("-")), remaining[0])
        raise _unknown_key_error(flag, sorted("--" + k for k in known), "the command line")
    values = vars(namespace)
    check_values(values, argv, config_path, lines)
    instances = []
    for dtype in model_types:
        names = {f.name for f in fields(dtype) if f.init}
        instances.append(dtype(**{k: values.pop(k) for k in list(values) if k in names}))
    training_names = {f.name for f in fields(training_type) if f.init}
    training_kwargs = {k: v for k, v in values.items() if k in training_names}
    if hasattr(training_type, "clean_values"):
        training_type.clean_values(training_kwargs)
    return (*instances, stages, training_kwargs, config_path)


def recipe_fields(recipe_type, training_kwargs: dict):
    """The recipe's own values (not TrainingArguments') as attributes, for tools that read a recipe without
    building its TrainingArguments (check, preview, the bench's plan)."""
    from types import SimpleNamespace

    from transformers import TrainingArguments

    own = {f.name for f in fields(recipe_type)} - {f.name for f in fields(TrainingArguments)}
    return SimpleNamespace(**{k: v for k, v in training_kwargs.items() if k in own})


def _str_or_bool(value):
    """A `str | bool` key's value, from a flag (always a string) or a YAML (where `false` is already a bool)."""
    if isinstance(value, bool):
        return value
    if not isinstance(value, str):  # a YAML number: neither a word nor a bool (`1` would be a silent `true`)
        raise ValueError(f"{value!r} is not true, false or a word")
    return {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}.get(value.lower(), value)


def _accept_str_or_bool(parser, dataclass_types) -> None:
    """HfArgumentParser reads a `str | bool` field (e.g. include_num_input_tokens_seen: "non_padding") as a
    bool and rejects its string values; give those flags a type that takes both."""
    import typing

    mixed = set()
    for dtype in dataclass_types:
        hints = typing.get_type_hints(dtype)
        for f in fields(dtype):
            args = set(typing.get_args(hints.get(f.name)))
            if {str, bool} <= args:
                mixed.add(f.name)
    set_action_types(parser, mixed, _str_or_bool)  # hf_zero/integrations/parsers.py


def pop_flag(argv: list[str], flag: str) -> tuple[str | None, list[str]]:
    """`flag`'s value (`--flag V` or `--flag=V`, the last one wins as argparse has it) and argv without it: the tools
    read `--config` before the recipe's own parser sees the rest."""
    import argparse

    class _Parser(argparse.ArgumentParser):
        def error(self, message):
            raise UserError(flag, "needs a value", f"{flag} PATH")

    parser = _Parser(add_help=False, allow_abbrev=False)
    parser.add_argument(flag, dest="value")
    namespace, rest = parser.parse_known_args(argv)
    return namespace.value, rest


def recipe_assets(argv: list[str]) -> tuple[str, list[str]]:
    """(model, data sources) a recipe's `--config YAML` + flags name, read as the recipe will read them."""
    from hf_zero.plan.arguments import ModelArguments  # imports transformers: only when a recipe is read

    config, rest = pop_flag(list(argv), "--config")
    values = load_yaml_config(config) if config else {}
    model, _ = pop_flag(rest, "--model_name_or_path")
    model = model or values.get("model_name_or_path") or ModelArguments.model_name_or_path
    data = []
    for stage in values.get("stages") or []:
        sources = stage.get("data") if isinstance(stage, dict) else None
        data += [d for d in (sources if isinstance(sources, list) else [sources]) if isinstance(d, str)]
    return str(model), data
