"""TrainingArguments are complete when built: what only the data decides (max_steps from the schedule, the best
metric when there is eval data, a recipe's eval_on_start / label_names) goes into one more build
(recipe_steps.final_training_args), never into a field of an instance that exists. A field set afterwards skips
TrainingArguments' own checks and normalization, and whoever read the instance before holds other values."""

import ast
import dataclasses
from pathlib import Path

from testing_utils import REPO, TINY
from transformers import TrainingArguments

from hf_zero.checkpoint.write import best_metric_default
from hf_zero.plan.arguments import CurriculumArguments, ModelArguments
from hf_zero.plan.parse import parse_recipe_args
from hf_zero.train.recipe_steps import final_training_args

FIELDS = {f.name for f in dataclasses.fields(TrainingArguments)}
# Names the code gives a TrainingArguments instance: `args.x = ...`, `self.args.x = ...`, `ctx.training_args.x = ...`.
HOLDERS = {"args", "training_args", "targs"}

# The Trainer's own instance, changed while it runs, because the Trainer reads it there and offers no other way:
# "file: field" -> why.
WHILE_TRAINING = {
    "hf_zero/checkpoint/staging.py: output_dir": "the Trainer's _save_checkpoint writes under args.output_dir: "
                                                 "pointed at the staging folder for one save, then restored",
    "hf_zero/train/sequence_parallel.py: ignore_data_skip": "under Ulysses the data adapter skips a resumed run's "
                                                            "batches itself, once the accelerator exists",
}


def _holder(node) -> bool:
    return (isinstance(node, ast.Name) and node.id in HOLDERS) or (
        isinstance(node, ast.Attribute) and node.attr in HOLDERS)


def _assigned_fields(path: Path, root: Path = REPO) -> set[str]:
    """`file: field` for every TrainingArguments field the file assigns on an instance (=, +=, setattr)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
              and len(node.args) > 1 and _holder(node.args[0]) and isinstance(node.args[1], ast.Constant)):
            found.add(f"{path.relative_to(root)}: {node.args[1].value}")
        flat = [t for target in targets for t in (target.elts if isinstance(target, ast.Tuple) else [target])]
        found.update(f"{path.relative_to(root)}: {t.attr}" for t in flat
                     if isinstance(t, ast.Attribute) and t.attr in FIELDS and _holder(t.value))
        # What __post_init__ derived from a field (the DeepSpeed config from `deepspeed`): a rebuild drops a change.
        found.update(f"{path.relative_to(root)}: hf_deepspeed_config" for t in flat
                     if isinstance(t, (ast.Attribute, ast.Subscript)) and "hf_deepspeed_config" in ast.unparse(t))
    return found


def test_no_code_sets_a_training_arguments_field_after_it_is_built():
    files = [*sorted((REPO / "hf_zero").rglob("*.py")), *sorted((REPO / "recipes").glob("*.py"))]
    found = set().union(*(_assigned_fields(p) for p in files))
    assert found - set(WHILE_TRAINING) == set(), (
        "a TrainingArguments field set after the instance is built: pass it to recipe_steps.lay_out / "
        "final_training_args instead")
    assert set(WHILE_TRAINING) - found == set(), "listed in WHILE_TRAINING but gone: remove it from the list"


def test_the_scan_sees_each_way_of_setting_a_field(tmp_path):
    src = tmp_path / "x.py"
    src.write_text("args.max_steps = 3\nself.args.eval_on_start += 1\nctx.training_args.seed: int = 2\n"
                   "a, targs.label_names = 1, []\nsetattr(args, 'logging_steps', 1)\nargs.nproc = 2\n"
                   "args.hf_deepspeed_config.config['checkpoint'] = {}\n")
    found = {line.split(": ")[1] for line in _assigned_fields(src, tmp_path)}
    assert found == {"max_steps", "eval_on_start", "seed", "label_names", "logging_steps", "hf_deepspeed_config"}


def test_the_final_arguments_carry_the_schedule_and_the_best_metric(tmp_path):
    """The values the Trainer used to get by assignment (max_steps, eval_on_start, and the best-metric default a
    callback set at train begin, greater_is_better derived from it) are in the one final build; the rest stays."""
    _, _, training, _ = parse_recipe_args((ModelArguments, CurriculumArguments),
                                          ["--config", str(TINY), "--output_dir", str(tmp_path), "--use_cpu", "true",
                                           "--save_strategy", "steps", "--save_steps", "5"])
    args = CurriculumArguments(**training)
    assert args.metric_for_best_model is None and args.greater_is_better is None
    final = final_training_args(args, max_steps=15, **best_metric_default(args, has_eval=True), eval_on_start=True)
    assert (final.max_steps, final.eval_on_start) == (15, True)
    assert final.metric_for_best_model == "eval_loss" and final.greater_is_better is False
    same = {f.name for f in dataclasses.fields(final) if f.init} - {"max_steps", "eval_on_start",
                                                                    "metric_for_best_model", "greater_is_better"}
    assert {k: getattr(final, k) for k in same} == {k: getattr(args, k) for k in same}
    assert final.device == args.device
    assert best_metric_default(args, has_eval=False) == {}
    assert best_metric_default(dataclasses.replace(args, metric_for_best_model="eval_short_loss"), True) == {}
