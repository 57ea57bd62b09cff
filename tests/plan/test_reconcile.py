"""One owner per setting: batch arithmetic and precision decided once, before any engine starts."""

import pytest

from hf_zero.core.errors import UserError
from hf_zero.plan.profiles import load_profile
from hf_zero.plan.reconcile import plan_batch, reconcile_training_kwargs


@pytest.mark.parametrize("world,accum", [(1, 16), (2, 8), (4, 4), (8, 2)])
def test_global_batch_fixed_across_world_sizes(world, accum):
    plan = plan_batch(micro=2, accumulation=1, world=world, global_batch=32)
    assert plan.accumulation == accum and plan.global_batch == 32
    assert plan.line() == f"2 micro x {accum} accum x {world} ranks = 32 global"


def test_indivisible_global_batch_names_field_and_fix():
    with pytest.raises(UserError) as err:
        plan_batch(micro=4, accumulation=1, world=3, global_batch=32)
    line = err.value.line()
    assert line.startswith("global_batch_size") and "divisible" in line


def test_without_global_batch_the_recipe_accumulation_stands():
    assert plan_batch(3, 5, 2, None).global_batch == 30


def test_bf16_profile_with_silent_recipe_runs_on_cpu():
    kwargs, plan = reconcile_training_kwargs({"per_device_train_batch_size": 2}, load_profile("l40x4"), 4,
                                             has_gpu=False, global_batch=None)
    assert kwargs["bf16"] is True and kwargs["fp16"] is False and kwargs["use_cpu"] is True
    assert kwargs["deepspeed"]["bf16"] == {"enabled": "auto"}
    assert plan.global_batch == 8


def test_recipe_precision_conflicting_with_profile_names_both():
    with pytest.raises(UserError) as err:
        reconcile_training_kwargs({"bf16": True}, load_profile("zero2"), 2, has_gpu=False, global_batch=None)
    assert "bf16" in err.value.line() and "zero2" in err.value.line()


def test_fp16_needs_a_gpu(tmp_path):
    prof = load_profile("zero2")
    prof.mixed_precision = "fp16"
    with pytest.raises(UserError, match="fp16"):
        reconcile_training_kwargs({}, prof, 2, has_gpu=False, global_batch=None)


def test_recipe_may_not_bring_its_own_deepspeed_config():
    with pytest.raises(UserError, match="deepspeed"):
        reconcile_training_kwargs({"deepspeed": "ds.json"}, load_profile("zero3"), 2, has_gpu=False, global_batch=None)


def test_profile_accumulation_disagreeing_with_recipe(monkeypatch):
    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "4")
    with pytest.raises(UserError) as err:
        reconcile_training_kwargs({"gradient_accumulation_steps": 2}, load_profile("zero2"), 2, False, None)
    assert "gradient_accumulation_steps" in err.value.line() and "profile" in err.value.line()


def test_gradient_checkpointing_under_zero3_uses_non_reentrant():
    kwargs, _ = reconcile_training_kwargs({"gradient_checkpointing": True}, load_profile("zero3"), 2, False, None)
    assert kwargs["gradient_checkpointing_kwargs"]["use_reentrant"] is False
