"""Speed switches other than the fused loss (tests/train/test_fused_ce.py) and packing (tests/data/test_packing.py):
ZeRO-3's gather settings sized from the model, the one-rank ZeRO banner line, Liger's kernels and torch_compile as
recipe switches (equal losses where they run; skipped with one line where they need a GPU)."""

import math

import pytest
import torch

from hf_zero.core.errors import UserError
from hf_zero.data.model_names import get_model_config
from hf_zero.plan.arguments import ModelArguments
from hf_zero.plan.deepspeed_config import zero3_speed_settings
from hf_zero.plan.profiles import Profile, load_profile, one_rank_note
from hf_zero.plan.reconcile import reconcile_training_kwargs


def _tiny_layer_params():
    """One tiny-llama decoder layer by hand: hidden 32, 4 heads of 8, 2 KV heads, MLP 64, two RMSNorms."""
    h, heads, kv, d, inter = 32, 4, 2, 8, 64
    return h * heads * d * 2 + h * kv * d * 2 + 3 * h * inter + 2 * h


def test_zero3_settings_are_sized_from_one_decoder_layer():
    z = zero3_speed_settings(get_model_config("tiny-llama"))
    layer = _tiny_layer_params()
    assert z["stage3_prefetch_bucket_size"] == z["stage3_max_reuse_distance"] == layer == 9280
    assert z["stage3_param_persistence_threshold"] == 10 * 32 and z["stage3_max_live_parameters"] >= 3 * layer
    assert z["leaf_module"]["classes"][-1] == "LlamaMLP"


@pytest.mark.parametrize("targets,leaf", [(None, True), (["q_proj", "k_proj", "v_proj", "o_proj"], True),
                                          (["q_proj", "up_proj"], False), ("all-linear", False)])
def test_the_mlp_is_a_leaf_module_only_without_lora_inside(targets, leaf):
    """DeepSpeed crashes in backward on a leaf module that holds LoRA weights (measured); peft's default targets
    for Llama are q_proj and v_proj."""
    args = ModelArguments(model_name_or_path="tiny-llama", use_peft=True, lora_target_modules=targets)
    kwargs, _ = reconcile_training_kwargs({}, load_profile("zero3"), 2, False, None, model_args=args)
    z = kwargs["deepspeed"]["zero_optimization"]
    assert ("leaf_module" in z) is leaf and z["stage3_max_reuse_distance"] == _tiny_layer_params()


def test_zero3_overlaps_gradient_reduction_on_gpus_only():
    from hf_zero.plan.deepspeed_config import build_deepspeed_config

    for on_cpu in (True, False):
        z = build_deepspeed_config(load_profile("zero3"), on_cpu=on_cpu)["zero_optimization"]
        assert z["overlap_comm"] is not on_cpu


def test_stage_2_does_not_read_the_model():
    args = ModelArguments(model_name_or_path="/nonexistent/model")  # would fail if it were read
    kwargs, _ = reconcile_training_kwargs({}, load_profile("zero2"), 2, False, None, model_args=args)
    assert "stage3_max_reuse_distance" not in kwargs["deepspeed"]["zero_optimization"]


@pytest.mark.parametrize("profile,world,says", [
    ("zero3", 1, "saves no memory over single_gpu"), ("zero2", 1, "saves no memory over single_gpu"),
    ("zero3_offload", 1, "only the offload to cpu saves device memory"), ("zero3", 2, None), ("ddp", 1, None),
])
def test_the_banner_says_one_rank_zero_saves_nothing(profile, world, says):
    lines = one_rank_note(load_profile(profile), world)
    assert (lines[0] if lines else None) is None if says is None else says in lines[0]


# --- Liger's kernels -------------------------------------------------------------------------------------------------

def test_liger_on_cpu_runs_without_it_in_one_line(capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    kwargs, _ = reconcile_training_kwargs({"use_liger_kernel": True}, Profile(name="cpu"), 1, False, None)
    assert kwargs["use_liger_kernel"] is False
    out = capsys.readouterr().out.strip().splitlines()
    assert out == ["[hf_zero] use_liger_kernel: Liger's kernels need a CUDA GPU; running without them here"]


def test_liger_never_takes_over_the_loss():
    with pytest.raises(UserError, match="liger_kernel_config.fused_linear_cross_entropy: hf_zero computes the loss"):
        reconcile_training_kwargs({"use_liger_kernel": True,
                                   "liger_kernel_config": {"fused_linear_cross_entropy": True}},
                                  Profile(name="single_gpu"), 1, True, None)


def _liger_runs() -> bool:
    try:
        import liger_kernel.transformers  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.skipif(not _liger_runs(), reason="Liger's kernels: need a CUDA GPU with liger-kernel installed")
def test_liger_kernels_keep_the_loss():
    """RMSNorm, SwiGLU and RoPE swapped for Liger's (as the Trainer applies them), fused loss on both sides."""
    from liger_kernel.transformers import _apply_liger_kernel_to_instance
    from transformers import AutoModelForCausalLM

    from hf_zero.data.model_names import get_tiny_llama_path
    from hf_zero.train.fused_ce import FusedCrossEntropyMixin  # noqa: F401 (the loss both runs use)

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 200, (2, 48), generator=g).cuda()
    losses, grads = [], []
    for liger in (False, True):
        model = AutoModelForCausalLM.from_pretrained(get_tiny_llama_path()).cuda().train()
        if liger:
            _apply_liger_kernel_to_instance(model=model, fused_linear_cross_entropy=False, cross_entropy=False)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert math.isclose(losses[0], losses[1], abs_tol=1e-5)
    torch.testing.assert_close(grads[1], grads[0], atol=1e-5, rtol=1e-4)


# --- torch_compile ---------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_torch_compile_keeps_the_losses(tmp_path, quiet_env):
    """The Trainer's torch_compile flag (inductor on CPU: minutes to compile even the tiny model), fused loss on:
    three steps' losses equal the eager run's."""
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    from hf_zero.data.model_names import get_tiny_llama_path
    from hf_zero.train.fused_ce import FusedCrossEntropyMixin

    class FusedTrainer(FusedCrossEntropyMixin, Trainer):
        pass

    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(3, 200, (6, 32), generator=g)]
    losses = {}
    for compile_ in (False, True):
        args = TrainingArguments(output_dir=str(tmp_path / str(compile_)), use_cpu=True, report_to=[], max_steps=3,
                                 per_device_train_batch_size=2, logging_steps=1, learning_rate=1e-3,
                                 torch_compile=compile_, disable_tqdm=True, save_strategy="no", seed=0)
        model = AutoModelForCausalLM.from_pretrained(get_tiny_llama_path())
        trainer = FusedTrainer(model=model, args=args, train_dataset=data)
        assert trainer.fused_head is not None
        trainer.train()
        losses[compile_] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses[True]) == 3
    torch.testing.assert_close(torch.tensor(losses[True]), torch.tensor(losses[False]), atol=1e-5, rtol=0)


# ---------------------------------------------------------------- what the H100 speed matrix made the default


def test_zero3_on_one_gpu_keeps_every_parameter_whole():
    """1.29x on an H100 at the same peak (hf_zero/plan/deepspeed_config.py); on 2 ranks and on CPU: unchanged."""
    from hf_zero.plan.deepspeed_config import ONE_RANK_PERSISTENCE, build_deepspeed_config

    config = get_model_config("tiny-llama")

    def threshold(world, on_cpu):
        zero = build_deepspeed_config(load_profile("zero3"), on_cpu=on_cpu, model_config=config, world=world)
        return zero["zero_optimization"]["stage3_param_persistence_threshold"]

    assert threshold(1, on_cpu=False) == ONE_RANK_PERSISTENCE
    assert threshold(2, on_cpu=False) == threshold(1, on_cpu=True) == 10 * config.hidden_size


@pytest.mark.parametrize("value, expect", [("auto", "auto"), ("AUTO", "auto"), (True, True), ("false", False)])
def test_use_liger_kernel_takes_auto_and_yaml_bools(value, expect):
    from hf_zero.plan.arguments import CurriculumArguments

    values = {"use_liger_kernel": value}
    CurriculumArguments.clean_values(values)
    assert values["use_liger_kernel"] == expect
    with pytest.raises(UserError, match="use_liger_kernel: 'yes' is not auto, true or false"):
        CurriculumArguments.clean_values({"use_liger_kernel": "yes"})


@pytest.mark.parametrize("has_gpu, installed, model, expect", [
    (True, True, "tiny-llama", True),  # llama: a type Liger patches
    (True, False, "tiny-llama", False),  # no liger-kernel: off, no error (auto)
    (False, True, "tiny-llama", False),  # CPU
    (True, True, "minilm", False),  # a type Liger does not patch (BERT)
])
def test_liger_auto_is_on_only_where_it_runs(monkeypatch, capsys, has_gpu, installed, model, expect):
    import hf_zero.plan.reconcile

    monkeypatch.setattr(hf_zero.plan.reconcile, "liger_installed", lambda: installed)
    kwargs, _ = reconcile_training_kwargs({"use_liger_kernel": "auto"}, Profile(name="single_gpu"), 1,
                                          has_gpu, None, model_args=ModelArguments(model_name_or_path=model))
    assert kwargs["use_liger_kernel"] is expect
    assert "liger" not in capsys.readouterr().out.lower()  # auto decides quietly
