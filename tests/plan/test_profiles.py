"""Every shipped profile loads through accelerate's own validator and says what it is for."""


import pytest
from testing_utils import PROFILES, REPO

from hf_zero.core.errors import UserError
from hf_zero.estimate.pick import pick_profile
from hf_zero.plan.deepspeed_config import build_deepspeed_config
from hf_zero.plan.profiles import list_profiles, load_profile, profile_from_env

REQUIRED = {"cpu", "single_gpu", "ddp", "zero1", "zero2", "zero3", "zero3_offload", "zero3_nvme", "l40x4",
            "h100x8", "multinode", "fsdp2", "fsdp2_offload"}
EXPECTED = {  # name: (distributed_type, zero_stage, offload optimizer, offload params, precision, processes)
    "cpu": ("DEEPSPEED", 2, "none", "none", "no", 2),
    "single_gpu": ("NO", None, "none", "none", "bf16", 1),
    "ddp": ("MULTI_GPU", None, "none", "none", "no", 2),
    "zero1": ("DEEPSPEED", 1, "none", "none", "no", 2),
    "zero2": ("DEEPSPEED", 2, "none", "none", "no", 2),
    "zero3": ("DEEPSPEED", 3, "none", "none", "no", 2),
    "zero3_offload": ("DEEPSPEED", 3, "cpu", "cpu", "no", 2),
    "zero3_nvme": ("DEEPSPEED", 3, "nvme", "nvme", "no", 2),
    "l40x4": ("DEEPSPEED", 3, "none", "none", "bf16", 4),
    "h100x8": ("DEEPSPEED", 2, "none", "none", "bf16", 8),
    "multinode": ("DEEPSPEED", 3, "none", "none", "no", 4),
    "fsdp2": ("FSDP", None, "none", "none", "no", 2),
    "fsdp2_offload": ("FSDP", None, "cpu", "cpu", "no", 2),
}


def test_all_required_profiles_ship():
    assert REQUIRED <= set(list_profiles())


@pytest.mark.parametrize("name", sorted(p.stem for p in PROFILES.glob("*.yaml")))
def test_profile_loads_and_is_documented(name):
    prof = load_profile(name)
    text = (PROFILES / f"{name}.yaml").read_text()
    assert text.startswith(f"# {name}:"), "each profile opens with a comment saying what it is for"
    assert "Launch" in text or "launch" in text.splitlines()[1] + text
    if name in EXPECTED:
        assert (prof.distributed_type, prof.zero_stage, prof.offload_optimizer, prof.offload_param,
                prof.mixed_precision, prof.num_processes) == EXPECTED[name]
    ds = build_deepspeed_config(prof, on_cpu=True)
    if prof.uses_deepspeed:
        assert ds["zero_optimization"]["stage"] == prof.zero_stage
        # Batch and precision stay "auto": TrainingArguments (already reconciled) fills them in.
        assert ds["train_batch_size"] == ds["gradient_accumulation_steps"] == "auto"


def test_zero3_without_a_model_removes_reuse_stall_and_has_offload_sections():
    z3 = build_deepspeed_config(load_profile("zero3_offload"), on_cpu=True)["zero_optimization"]
    assert z3["stage3_max_reuse_distance"] == 0
    assert z3["offload_optimizer"]["device"] == "cpu" and z3["offload_param"]["device"] == "cpu"
    # the reuse walk is Python work, the same on a GPU machine (model-sized settings: tests/train/test_speed.py)
    on_gpu = build_deepspeed_config(load_profile("zero3"), on_cpu=False)
    assert on_gpu["zero_optimization"]["stage3_max_reuse_distance"] == 0


def test_nvme_path_comes_from_env(monkeypatch):
    monkeypatch.setenv("HF_ZERO_NVME_PATH", "/scratch/nvme")
    z = build_deepspeed_config(load_profile("zero3_nvme"), on_cpu=True)["zero_optimization"]
    assert z["offload_param"]["nvme_path"] == "/scratch/nvme" == z["offload_optimizer"]["nvme_path"]


def test_unknown_profile_names_the_choices():
    with pytest.raises(UserError) as err:
        load_profile("zero4")
    assert "zero4" in err.value.line() and "zero3" in err.value.line()


def test_bad_profile_key_is_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("distributed_type: DEEPSPEED\nnum_processes: 2\nzero_stagee: 3\n")
    with pytest.raises(UserError) as err:
        load_profile(str(bad))
    assert "zero_stagee" in err.value.line() and "\n" not in err.value.line()


def test_pick_profile_by_gpu_count():
    assert pick_profile(0)[0] == "cpu"
    assert pick_profile(1)[0] == "single_gpu"
    name, why = pick_profile(4)
    assert name.startswith("zero") and "4" in why


def test_profile_from_accelerate_env_without_hf_zero_launcher():
    env = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3", "WORLD_SIZE": "2",
           "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "cpu", "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "cpu",
           "ACCELERATE_MIXED_PRECISION": "bf16"}
    prof = profile_from_env(env)
    assert (prof.name, prof.zero_stage, prof.num_processes, prof.precision) == ("zero3_offload", 3, 2, "bf16")
    assert profile_from_env({"WORLD_SIZE": "2"}).name == "ddp"
    named = profile_from_env({"HF_ZERO_PROFILE": str(PROFILES / "zero2.yaml"), "WORLD_SIZE": "4"})
    assert (named.name, named.num_processes) == ("zero2", 4)


GIB = 2**30
LLAMA_1B = str(REPO / "tests" / "data" / "calibration" / "models" / "llama-1b")


def _peaks(recipe, gpus, strategies):
    """The estimator's peak per GPU for each strategy, as pick_profile sizes them (bf16)."""
    from hf_zero.data.model_names import get_model_config
    from hf_zero.estimate.memory import estimate
    from hf_zero.estimate.model_count import count_model

    model = get_model_config(recipe.model) if isinstance(recipe.model, str) else recipe.model
    count = count_model(model, lora=recipe.lora)
    return {s: estimate(count, s, world_size=gpus, gpus_per_node=gpus, micro_batch=recipe.micro,
                        seq_len=recipe.seq_len, grad_checkpointing=recipe.gradient_checkpointing)
            ["gpu_bytes_per_rank"]["total"] for s in strategies}


def _device_between(low, high):
    """A device size whose usable part (90%) lies between two peaks: the first fits, the second does not."""
    return int((low + high) / 2 / 0.9)


def test_pick_profile_for_one_gpu_follows_the_estimate():
    """One GPU: single_gpu if it fits, else ZeRO-2 (bf16 weights, smaller activations), else everything offloaded,
    else a one-line error naming the estimate and a launch that fits (same global batch)."""
    from hf_zero.estimate.recipe import RecipeMemory

    recipe = RecipeMemory(model=LLAMA_1B, micro=8, accumulation=1, seq_len=1024, path="recipe.yaml")
    peaks = _peaks(recipe, 1, ("ddp", "zero2", "zero3_offload"))
    assert peaks["zero3_offload"] < peaks["zero2"] < peaks["ddp"]
    name, why = pick_profile(1, recipe=recipe, gpu_memory_bytes=80 * GIB)
    assert name == "single_gpu" and "1 GPU found" in why and "GiB" in why and "left" in why
    assert pick_profile(1, recipe=recipe, gpu_memory_bytes=_device_between(peaks["zero2"], peaks["ddp"]))[0] == "zero2"
    assert pick_profile(1, recipe=recipe, gpu_memory_bytes=_device_between(peaks["zero3_offload"], peaks["zero2"]))[
        0] == "zero3_offload"
    with pytest.raises(UserError) as err:
        pick_profile(1, recipe=recipe, gpu_memory_bytes=int(peaks["zero3_offload"] * 0.8))
    line = err.value.line()
    assert "\n" not in line and "micro-batch 8 x 1024 tokens needs" in line and "zero3_offload" in line
    assert "accumulation 2" in line and "run: hf-zero train --profile" in line  # micro 4 x 2 keeps the batch of 8
    assert "--per_device_train_batch_size 4 --gradient_accumulation_steps 2" in line


def test_pick_profile_for_several_gpus_uses_the_estimator():
    from transformers import LlamaConfig

    from hf_zero.estimate.recipe import RecipeMemory

    seven_b = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                          vocab_size=32000)
    assert pick_profile(8, model=seven_b, gpu_memory_bytes=80 * GIB)[0] == "zero2"
    peaks = _peaks(RecipeMemory(model=seven_b, micro=1, accumulation=1, seq_len=1024), 8,
                   ("zero2", "zero3", "zero3_offload"))
    name, why = pick_profile(8, model=seven_b, gpu_memory_bytes=_device_between(peaks["zero3"], peaks["zero2"]))
    assert name == "zero3" and "8 GPUs found" in why
    with pytest.raises(UserError) as err:  # nothing fits: the estimate and what would
        pick_profile(2, model=seven_b, gpu_memory_bytes=4 * GIB)
    assert "needs" in err.value.line() and "gradient_checkpointing: true" in err.value.line()
