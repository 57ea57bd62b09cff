"""Every documented recipe key (docs/reference/recipe-keys.md, generated from the argument dataclasses by
scripts/gen_key_reference.py), each documented value written the way people write it in a YAML (bare bools,
numbers, lists, `null`) and as a flag, read by the parser `hf-zero check`, `estimate --config`, `preview` and the
ranks share (hf_zero.plan.parse.parse_recipe_args) and built as the ranks build it: accepted, with the same value
from the YAML and from the flag, or refused in one line naming the key. The cases are generated from the
dataclasses, so a key added tomorrow is covered. The last tests run a YAML of bare bools through each of those
commands in-process."""

from __future__ import annotations

import dataclasses
import importlib.util
import types
import typing
from pathlib import Path

import pytest
import yaml
from testing_utils import REPO

from hf_zero.core.errors import UserError
from hf_zero.plan.parse import HF_ZERO_TRAINING_DEFAULTS, parse_recipe_args
from hf_zero.plan.shipped import load_recipe, recipe_argument_types


def _generator():
    spec = importlib.util.spec_from_file_location("gen_key_reference", REPO / "scripts" / "gen_key_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GEN = _generator()
RECIPES = {"curriculum": REPO / "recipes" / "curriculum.py", "classify": REPO / "recipes" / "classify.py"}
BASE = {  # the least each recipe needs; the key under test is added to it
    "curriculum": {"model_name_or_path": "tiny-llama", "stages": [{"name": "one", "data": "d.jsonl", "steps": 2}]},
    "classify": {"recipe": "classify", "model_name_or_path": "minilm",
                 "stages": [{"name": "one", "data": "builtin:bbc/train", "steps": 2}]},
}


def _kinds(hint) -> set:
    """The plain types a field's annotation allows: {bool}, {int, None}, {str, bool}, {list}, ..."""
    out = set()
    for arg in typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,):
        origin = typing.get_origin(arg)
        if arg is type(None):
            out.add(None)
        elif origin in (list, tuple):
            out.add(list)
        elif origin is typing.Literal:
            out.update(type(v) for v in typing.get_args(arg))
        elif origin is dict or arg is dict:
            out.add(dict)
        elif isinstance(arg, type) and issubclass(arg, (bool, int, float, str)):
            out.add(next(t for t in (bool, int, float, str) if issubclass(arg, t)))  # Enums of str are str
    return out


def _item_kind(hint):
    """A list field's element type (list[float] weights, list[str] data)."""
    for arg in typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,):
        if typing.get_origin(arg) in (list, tuple):
            return typing.get_args(arg)[0]
    return str


def _yaml_text(value) -> str:
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


def documented_values(f, hint, default) -> list[str]:
    """The values a person writes for this key in a YAML, as YAML text: the documented default as the reference
    page spells it, and what the type takes (true/false bare, numbers bare and as 1e-4, lists in brackets and as
    one bare item, null for an optional key)."""
    kinds = _kinds(hint)
    out = []
    if default is not None and not isinstance(default, dict) and default is not dataclasses.MISSING:
        out.append(GEN._yaml(default).strip("`"))
    if bool in kinds:
        out += ["true", "false"]
    if int in kinds:
        out.append("2")
    if float in kinds:
        out += ["0.5", "1e-4", "1.0e-4"]  # PyYAML reads 1e-4 (no dot) as a string: people write it anyway
    if list in kinds:
        item = _item_kind(hint)
        sample = ["0.5"] if item is float else ["learning_rate"] if f.name == "allow_changes" else ["q_proj"]
        out += [f"[{', '.join(sample)}]", sample[0]]
    if str in kinds and default in (None, dataclasses.MISSING) and list not in kinds:
        out.append("/data/x.jsonl" if f.name in ("data", "eval_data") else "word")  # a YAML's relative paths
        # are taken from its folder, a flag's from the working folder: absolute, they are the same file
    if None in kinds:
        out.append("null")
    return list(dict.fromkeys(out))


def _documented_keys():
    """(recipe, owner class name, field, annotation, default) for every key the reference page documents: each
    documented class's own fields, and the Trainer defaults hf_zero changes (its first table)."""
    from transformers import TrainingArguments

    cases = []
    for cls in GEN.documented_types():
        recipe = "classify" if cls.__name__ == "ClassificationArguments" else "curriculum"
        hints = typing.get_type_hints(cls)
        for f in GEN.own_fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else (
                f.default_factory() if f.default_factory is not dataclasses.MISSING else dataclasses.MISSING)
            cases.append((recipe, cls.__name__, f, hints[f.name], default))
    hints = typing.get_type_hints(TrainingArguments)
    for f in dataclasses.fields(TrainingArguments):
        if f.name in HF_ZERO_TRAINING_DEFAULTS:
            cases.append(("curriculum", "TrainingArguments", f, hints[f.name], HF_ZERO_TRAINING_DEFAULTS[f.name]))
    return cases


KEYS = _documented_keys()
CASES = [pytest.param(recipe, owner, f, hint, text, id=f"{owner}.{f.name}={text}")
         for recipe, owner, f, hint, default in KEYS for text in documented_values(f, hint, default)]


def _types(recipe: str) -> tuple:
    return recipe_argument_types(load_recipe(str(RECIPES[recipe])))


def _read(recipe: str, tmp_path: Path, values: dict, flags: list[str]):
    """What the ranks do with a YAML and flags: parse them, then build the recipe's TrainingArguments subclass.
    Returns {key: value} of everything parsed (stages' fields under `stages.<key>`)."""
    path = tmp_path / f"{recipe}.yaml"
    path.write_text(yaml.safe_dump(values))
    kinds = _types(recipe)
    *models, stages, training, _ = parse_recipe_args(kinds, ["--config", str(path), *flags])
    built = kinds[-1](**{**training, "output_dir": str(tmp_path / "out"), "use_cpu": True})
    out = {k: v for m in models for k, v in vars(m).items()}
    out.update({k: getattr(built, k) for k in training})  # as the Trainer sees them (report_to: a list, ...)
    out.update({f"stages.{k}": v for k, v in vars(stages[0]).items()})
    return out


def _outcome(call, key: str):
    """("ok", parsed values) or ("refused", line); anything else fails the test with what escaped."""
    try:
        return "ok", call()
    except UserError as err:
        assert key in err.line(), f"refused without naming {key}: {err.line()}"
        assert "\n" not in err.line(), err.line()
        return "refused", err.line()


def _flag(key: str, text: str) -> list[str] | None:
    """The same value as `hf-zero train` flags: a list's items as separate words; null has no flag spelling."""
    value = yaml.safe_load(f"v: {text}")["v"]
    if value is None:
        return None
    items = value if isinstance(value, list) else [value]
    return [f"--{key}", *[(str(v).lower() if isinstance(v, bool) else str(v)) for v in items]]


def _of_its_type(value, hint) -> bool:
    kinds = _kinds(hint)
    if value is None:
        return None in kinds or not kinds
    if isinstance(value, bool):
        return bool in kinds
    if isinstance(value, list):
        return list in kinds
    if isinstance(value, (int, float)):
        return bool(kinds & {int, float}) and (float in kinds or isinstance(value, int))
    return str in kinds or not kinds


@pytest.mark.parametrize(("recipe", "owner", "f", "hint", "text"), CASES)
def test_documented_value_is_read_the_same_from_yaml_and_flag_or_refused_naming_the_key(recipe, owner, f, hint,
                                                                                          text, tmp_path):
    values = {**BASE[recipe], "stages": [dict(s) for s in BASE[recipe]["stages"]]}
    parsed = yaml.safe_load(f"v: {text}")["v"]
    if owner == "Stage":  # a stage's keys live in its `stages:` entry only: no flag spelling
        stage = values["stages"][0]
        if f.name in ("steps", "epochs"):
            stage.pop("steps")
        stage[f.name] = parsed
        if f.name == "weights" and isinstance(parsed, list):
            stage["data"] = ["d.jsonl"] * len(parsed)
        kind, got = _outcome(lambda: _read(recipe, tmp_path, values, []), f.name)
        if kind == "ok":
            assert _of_its_type(got[f"stages.{f.name}"], hint), (text, got[f"stages.{f.name}"])
        return
    from_yaml = _outcome(lambda: _read(recipe, tmp_path, {**values, f.name: parsed}, []), f.name)
    if from_yaml[0] == "ok":
        assert _of_its_type(from_yaml[1][f.name], hint), (text, from_yaml[1][f.name])
    flags = _flag(f.name, text)
    if flags is None:
        return
    from_flag = _outcome(lambda: _read(recipe, tmp_path, values, flags), f.name)
    assert from_flag[0] == from_yaml[0], f"YAML {from_yaml}, flag {from_flag}"
    if from_yaml[0] == "ok":
        assert from_flag[1][f.name] == from_yaml[1][f.name]


def test_every_documented_key_is_covered():
    page = (REPO / "docs" / "reference" / "recipe-keys.md").read_text()
    keys = {line.split("`")[1] for line in page.splitlines() if line.startswith("| `")}
    covered = {c.values[2].name for c in CASES}
    assert keys and keys <= covered, keys - covered


def test_bare_yaml_bools_of_str_or_bool_keys_are_bools(tmp_path):
    """The crash of issue 40: `fused_cross_entropy: false` and `include_num_input_tokens_seen: true` in a YAML."""
    mixed = [(recipe, f) for recipe, _, f, hint, _ in KEYS if {str, bool} <= _kinds(hint)]
    assert {f.name for _, f in mixed} >= {"fused_cross_entropy", "include_num_input_tokens_seen"}
    for recipe, f in mixed:
        for value in (True, False):
            path = tmp_path / f"{recipe}.yaml"
            path.write_text(yaml.safe_dump({**BASE[recipe], f.name: value}))
            training = parse_recipe_args(_types(recipe), ["--config", str(path)])[-2]
            assert training[f.name] is value


@pytest.fixture
def bools_yaml(tmp_path):
    """The tiny curriculum with every `str | bool` key written as a bare YAML bool."""
    raw = yaml.safe_load((REPO / "recipes" / "configs" / "tiny_curriculum.yaml").read_text())
    data = REPO / "recipes" / "data" / "tiny"
    for stage in raw["stages"]:
        stage["data"] = [str(data / Path(d).name) for d in ([stage["data"]] if isinstance(stage["data"], str)
                                                              else stage["data"])]
    raw.update(fused_cross_entropy=False, include_num_input_tokens_seen=True, output_dir=str(tmp_path / "run"))
    path = tmp_path / "bools.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.parametrize("command", [["estimate", "--gpus-per-node", "1"], ["preview", "-n", "0"],
                                     ["check", "--profile", "cpu"]])
def test_bare_yaml_bools_through_each_command(command, bools_yaml, capsys):
    from hf_zero.cli import main

    code = main([command[0], "--config", str(bools_yaml), *command[1:]])
    err = capsys.readouterr().err
    assert "Traceback" not in err and "AttributeError" not in err, err
    assert code == 0, err


def test_bare_yaml_bools_through_the_ranks_parser(bools_yaml, monkeypatch):
    from hf_zero.plan.run_plan import plan_in_worker

    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "HF_ZERO_RUN_PLAN"):
        monkeypatch.delenv(name, raising=False)
    parsed, stages, kwargs, plan = plan_in_worker(_types("curriculum"), ["--config", str(bools_yaml)],
                                                  str(RECIPES["curriculum"]))
    assert kwargs["fused_cross_entropy"] is False and kwargs["include_num_input_tokens_seen"] is True
