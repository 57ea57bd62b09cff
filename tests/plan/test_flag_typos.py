"""A mistyped recipe flag gets one line, its "did you mean", and nothing else: the output folder is compared with
the settings only when they all parsed (issue 40, item 6). Before, the checks fell back to the YAML without the
flags, so `--output_dir` was ignored and the YAML's folder, holding a finished run, was blamed for "other settings"
with advice (`--fresh_start true`) that would move that run aside."""

import json

import pytest
import yaml
from testing_utils import TINY, check, failed, skipped

from hf_zero.cli import main
from hf_zero.core.errors import UserError
from hf_zero.plan.arguments import CurriculumArguments, ModelArguments
from hf_zero.plan.parse import parse_recipe_args


@pytest.fixture
def finished_elsewhere(tmp_path):
    """The tiny recipe whose YAML output_dir holds a run finished with other settings; (recipe, another folder)."""
    data = yaml.safe_load(TINY.read_text())
    for stage in data["stages"]:
        specs = stage["data"] if isinstance(stage["data"], list) else [stage["data"]]
        stage["data"] = [str((TINY.parent / s).resolve()) for s in specs]
    finished = tmp_path / "finished"
    finished.mkdir()
    (finished / "summary.json").write_text(json.dumps({"settings": {"learning_rate": 5.0}}))
    data["output_dir"] = str(finished)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path), str(tmp_path / "e1")


def test_check_reports_only_the_typo_and_leaves_the_output_folder_unchecked(capsys, finished_elsewhere):
    config, other = finished_elsewhere
    _, res = check(capsys, "--profile", "zero2", "--config", config, "--learnig_rate", "1e-4", "--output_dir", other)
    assert failed(res) == {"recipe"}, res
    assert "did you mean `--learning_rate`?" in res["recipe"][1]
    assert "output" in skipped(res) and "finished" not in res["output"][1]


def test_train_prints_one_error_line_for_a_typo(capsys, finished_elsewhere):
    config, other = finished_elsewhere
    code = main(["train", "--profile", "zero2", "--config", config, "--learnig_rate", "1e-4", "--output_dir", other])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("hf-zero: error:")]
    assert code == 2
    assert len(errors) == 1 and "did you mean `--learning_rate`?" in errors[0], err
    assert "fresh_start" not in err


@pytest.mark.parametrize(("flag", "meant"), [
    ("--lr", "--learning_rate"), ("--lr=1e-4", "--learning_rate"), ("--learning_rat", "--learning_rate"),
    ("--epochs", "--num_train_epochs")])
def test_short_or_cut_flags_get_a_did_you_mean(flag, meant):
    """`--lr` was "ambiguous option: --lr could match --lr_scheduler_type, ...", and `--learning_rat` silently
    taken as --learning_rate (argparse's abbreviations): each is now the unknown key it is, with the key meant."""
    argv = ["--config", str(TINY), flag, *([] if "=" in flag else ["1e-4"])]
    with pytest.raises(UserError) as err:
        parse_recipe_args((ModelArguments, CurriculumArguments), argv)
    assert err.value.field == flag.split("=")[0] and f"did you mean `{meant}`?" in err.value.line()
