"""Where a recipe's values come from and whether they make sense, before anything runs: input paths resolved
against the YAML's folder, each YAML key's line (so an error can say `(in recipe.yaml line 7)`), YAML values
checked against the type their flag would accept, and numeric fields against their sign and range."""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

import yaml

from hf_zero.core.errors import UserError
from hf_zero.core.once import read_text
from hf_zero.integrations.parsers import parser_actions

__all__ = ["yaml_lines", "resolve_recipe_paths", "at_line", "positive", "at_least", "check_yaml_types", "check_values"]

_KINDS = {"int": "an integer", "float": "a number", "string_to_bool": "true or false", "str": "text",
          "_str_or_bool": "true, false or a word"}


def yaml_lines(path: str | None) -> dict[str, int]:
    """1-based line of each top-level key, of `parent.key` one level down, and of `stages[i].key`, so errors can
    say where a value came from."""
    if not path:
        return {}
    try:
        root = yaml.compose(read_text(path))
    except (OSError, yaml.YAMLError):
        return {}
    lines = {}
    for key, value in getattr(root, "value", []) if isinstance(root, yaml.MappingNode) else []:
        lines[str(key.value)] = key.start_mark.line + 1
        if isinstance(value, yaml.MappingNode):  # e.g. a profile's deepspeed_config.zero_stage
            for k, _ in value.value:
                lines[f"{key.value}.{k.value}"] = k.start_mark.line + 1
        if key.value == "stages" and isinstance(value, yaml.SequenceNode):
            for i, item in enumerate(value.value):
                lines[f"stages[{i}]"] = item.start_mark.line + 1
                for k, _ in item.value if isinstance(item, yaml.MappingNode) else []:
                    lines[f"stages[{i}].{k.value}"] = k.start_mark.line + 1
    return lines


# Keys whose YAML values name local inputs; output_dir (and other outputs) stay relative to where you launch.
_INPUT_KEYS = ("model_name_or_path", "tokenizer_name_or_path", "eval_data", "resume_from_checkpoint")
_DATA_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet", ".txt")


def _relative_to(value, base: Path, is_data: bool):
    """`value` as written in a YAML in folder `base`: a relative local path is taken from `base`; absolute paths,
    `builtin:` data, hub ids and hf_zero's offline model names are left as they are."""
    if not isinstance(value, str) or not value or value.startswith("builtin:") or os.path.isabs(value):
        return value
    candidate = os.path.abspath(base / value)
    local = value.startswith(("./", "../")) or Path(candidate).exists()
    if local or (is_data and value.endswith(_DATA_SUFFIXES)):
        return candidate
    return value


def resolve_recipe_paths(values: dict, config_path: str | None) -> dict:
    """The YAML's input paths resolved against the YAML's own folder, so a recipe works from any directory."""
    if not config_path:
        return values
    base = Path(config_path).parent
    out = dict(values)
    for key in _INPUT_KEYS:
        if key in out:
            out[key] = _relative_to(out[key], base, is_data=key == "eval_data")
    if isinstance(out.get("stages"), list):
        out["stages"] = [
            {**s, "data": [_relative_to(d, base, True) for d in s["data"]] if isinstance(s.get("data"), list)
             else _relative_to(s.get("data"), base, True)} if isinstance(s, dict) and "data" in s else s
            for s in out["stages"]]
    return out


def at_line(path: str | None, lines: dict | None, *keys: str) -> str:
    """Where a YAML value sits: `(in recipe.yaml line 7)`."""
    line = next((lines[k] for k in keys if lines and k in lines), None)
    return f"(in {path}{f' line {line}' if line else ''})"


def _source(key: str, argv: list[str], path: str | None, lines: dict) -> str:
    flag = f"--{key}"
    if any(a == flag or a.startswith(flag + "=") for a in argv):
        return f"(flag {flag})"
    return at_line(path, lines, key) if key in lines else "(default)"


def positive(v) -> bool:
    return v > 0 and math.isfinite(v)


def at_least(flag: str, value, minimum: int = 1, fix: str | None = None):
    """A command-line number checked before it is used: `value` (None: not given) or one line naming `flag`."""
    if value is not None and value < minimum:
        raise UserError(flag, f"must be at least {minimum}, got {value}", fix)
    return value


# Numeric fields checked before anything runs: (ok(value), problem, example). A wrong sign or range otherwise
# surfaces steps later as a NaN loss, an empty batch or an assertion inside DeepSpeed.
_RULES = {
    "learning_rate": (positive, "must be a positive number", "1.0e-4"),
    "per_device_train_batch_size": (lambda v: v >= 1, "must be at least 1", "2"),
    "per_device_eval_batch_size": (lambda v: v >= 1, "must be at least 1", "4"),
    "gradient_accumulation_steps": (lambda v: v >= 1, "must be at least 1", "1"),
    "global_batch_size": (lambda v: v >= 1, "must be at least 1", "8"),
    "max_seq_length": (lambda v: v >= 2, "must be at least 2", "128"),
    "eval_samples": (lambda v: v >= 0, "cannot be negative", "32"),
    "lora_r": (lambda v: v >= 1, "must be at least 1", "16"),
    "lora_alpha": (lambda v: v > 0, "must be positive", "32"),
    "lora_dropout": (lambda v: 0 <= v < 1, "must be in [0, 1)", "0.05"),
    "weight_decay": (lambda v: v >= 0, "cannot be negative", "0.01"),
    "max_grad_norm": (lambda v: v >= 0, "cannot be negative (0 turns clipping off)", "1.0"),
    "warmup_steps": (lambda v: v >= 0, "cannot be negative", "0"),
    "warmup_ratio": (lambda v: 0 <= v <= 1, "must be in [0, 1]", "0.0"),
    "logging_steps": (lambda v: v > 0, "must be positive", "1"),
    "save_steps": (lambda v: v > 0, "must be positive", "100"),
    "eval_steps": (lambda v: v > 0, "must be positive", "100"),
    "save_total_limit": (lambda v: v >= 1, "must be at least 1", "2"),
    "adam_beta1": (lambda v: 0 <= v < 1, "must be in [0, 1)", "0.9"),
    "adam_beta2": (lambda v: 0 <= v < 1, "must be in [0, 1)", "0.999"),
    "adam_epsilon": (positive, "must be positive", "1.0e-8"),
    "seed": (lambda v: v >= 0, "cannot be negative", "42"),
}


def check_yaml_types(parser, yaml_values: dict, path: str, lines: dict) -> None:
    """A YAML value must be what the flag would accept: argparse converts (and rejects) only command-line strings,
    so a wrong type in the YAML would otherwise pass unnoticed, or fail later under another name."""
    actions = {a.dest: a for a in parser_actions(parser)}
    for key, value in yaml_values.items():
        action = actions[key]
        if value is None or action.type is None or isinstance(value, dict):  # dict fields take their YAML as is
            continue
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, (dict, list)):
                continue
            try:
                if action.type in (int, float) and isinstance(item, bool):
                    raise ValueError
                if action.type is int and isinstance(item, float) and not item.is_integer():
                    raise ValueError
                converted = action.type(item if isinstance(item, (str, int, float)) else str(item))
            except (ValueError, TypeError, argparse.ArgumentTypeError):
                kind = _KINDS.get(getattr(action.type, "__name__", ""), "a valid value")
                raise UserError(key, f"{item!r} is not {kind} {at_line(path, lines, key)}",
                                f"e.g. {key}: {_RULES[key][2] if key in _RULES else action.default}") from None
            if action.choices and converted not in action.choices:
                raise UserError(key, f"{item!r} is not one of {', '.join(map(str, action.choices))} "
                                f"{at_line(path, lines, key)}", "pick one of those")


def check_values(values: dict, argv: list[str], path: str | None, lines: dict) -> None:
    for key, (ok, problem, example) in _RULES.items():
        value = values.get(key)
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if not ok(value):
            raise UserError(key, f"{problem}, got {value!r} {_source(key, argv, path, lines)}",
                            f"e.g. {key}: {example}")
