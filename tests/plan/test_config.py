"""YAML + command line: the YAML sets defaults, flags override, unknown keys are one-line errors."""

from pathlib import Path

import pytest
from testing_utils import REPO, TINY
from transformers import TrainingArguments

from hf_zero.core.config import Stage
from hf_zero.core.errors import UserError
from hf_zero.plan.arguments import CurriculumArguments, ModelArguments
from hf_zero.plan.parse import parse_recipe_args, recipe_fields

TYPES = (ModelArguments, CurriculumArguments)


def parse(argv):
    """(model arguments, the recipe's own values, stages, TrainingArguments kwargs, config path)."""
    model, stages, training, path = parse_recipe_args(TYPES, argv)
    return model, recipe_fields(CurriculumArguments, training), stages, training, path


def test_the_recipe_arguments_are_training_arguments_built_once_from_what_was_parsed(tmp_path):
    """TRL's pattern: the recipe's class extends TrainingArguments, every field documented; parsing only collects
    its values (the run plan decides part of them), and one construction gives the Trainer its arguments."""
    from dataclasses import fields

    own = [f for f in fields(CurriculumArguments) if f.name not in {g.name for g in fields(TrainingArguments)}]
    assert issubclass(CurriculumArguments, TrainingArguments) and own
    assert all(f.metadata.get("help") for f in own)
    _, data, _, training, _ = parse(["--config", str(TINY), "--packing", "true", "--output_dir", str(tmp_path)])
    assert isinstance(training, dict) and data.packing is True and "learning_rate" not in vars(data)
    args = CurriculumArguments(**training)
    assert args.packing is True and args.max_seq_length == 64 and args.output_dir == str(tmp_path)


def test_yaml_sets_defaults_and_flags_override():
    model, data, stages, training, path = parse(["--config", str(TINY), "--learning_rate", "0.5", "--lora_r", "4"])
    assert model.model_name_or_path == "tiny-llama" and model.lora_r == 4
    assert training["learning_rate"] == 0.5 and training["seed"] == 42
    assert data.max_seq_length == 64 and [s.name for s in stages] == ["short", "medium", "long"]
    tiny = REPO / "recipes" / "data" / "tiny"  # data paths in a YAML are relative to the YAML's folder
    assert stages[2].data == [str(tiny / "long.jsonl"), str(tiny / "medium.jsonl")]
    assert training["output_dir"] == "runs/tiny_curriculum" and path == str(TINY)


def test_every_training_arguments_field_is_a_flag():
    _, _, _, training, _ = parse(["--config", str(TINY), "--save_steps", "3", "--seed", "7", "--output_dir", "x"])
    assert (training["save_steps"], training["seed"], training["output_dir"]) == (3, 7, "x")


def test_hf_zero_defaults_are_overridable():
    _, _, _, training, _ = parse(["--logging_steps", "5"])
    assert training["logging_steps"] == 5 and training["report_to"] == ["tensorboard"]


def test_unknown_yaml_key_names_key_and_suggestion(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("lerning_rate: 0.1\n")
    with pytest.raises(UserError) as err:
        parse(["--config", str(cfg)])
    assert err.value.line().startswith("lerning_rate: unknown key") and "learning_rate" in err.value.line()


def test_unknown_flag_names_flag():
    with pytest.raises(UserError) as err:
        parse(["--lora_rank", "8"])
    assert "--lora_rank" in err.value.line() and "--lora_r" in err.value.line()


def test_unknown_stage_key(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("stages:\n  - {name: a, data: x.jsonl, steps: 2, learnig_rate: 1}\n")
    with pytest.raises(UserError) as err:
        parse(["--config", str(cfg)])
    assert "stages[a].learnig_rate" in err.value.line() and "learning_rate" in err.value.line()


@pytest.mark.parametrize("stage,field", [
    ({"name": "a", "data": "x"}, "steps"),
    ({"name": "a", "data": "x", "steps": 2, "epochs": 1}, "steps"),
    ({"name": "a", "data": ["x", "y"], "weights": [1], "steps": 2}, "weights"),
    ({"name": "a", "data": "x", "steps": 2, "lr_schedule": "step"}, "lr_schedule"),
])
def test_bad_stage_values(stage, field):
    with pytest.raises(UserError) as err:
        Stage(**stage)
    assert field in err.value.line()


def test_duplicate_stage_names(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("stages:\n  - {name: a, data: x, steps: 1}\n  - {name: a, data: y, steps: 1}\n")
    with pytest.raises(UserError, match="unique"):
        parse(["--config", str(cfg)])


def test_missing_config_file():
    with pytest.raises(UserError) as err:
        parse(["--config", "nope.yaml"])
    assert err.value.line().startswith("--config")


@pytest.mark.parametrize("path", sorted((REPO / "recipes" / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_recipe_yaml_parses(path):
    """Each shipped YAML is checked against the arguments of the recipe it names (`recipe:`, as `hf-zero train`
    picks it: the curriculum by default), so a new config of any recipe is covered without a list here."""
    from hf_zero.plan.shipped import load_recipe, recipe_argument_types, recipe_script

    types = recipe_argument_types(load_recipe(str(recipe_script(None, str(path)))))
    *_, stages, training, _ = parse_recipe_args(types, ["--config", str(path)])
    text = path.read_text()
    assert text.startswith("#"), "each config opens with a comment giving its launch command"
    first = text.split("\n\n")[0]
    assert any(cmd in first for cmd in ("accelerate launch", "make train", "hf-zero train", "hf-zero bench"))
    for stage in stages:
        for spec in stage.data:
            if not spec.startswith("builtin:"):
                assert Path(spec).is_file(), f"{path.name}: stage {stage.name} data {spec} is missing"
