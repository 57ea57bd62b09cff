"""Every shipped profile loads through accelerate's own validator and says what it is for."""

import pytest

from hf_zero.errors import UserError
from hf_zero.profiles import build_deepspeed_config, list_profiles, load_profile, pick_profile, profile_from_env

from conftest import PROFILES

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


def test_zero3_on_cpu_removes_reuse_stall_and_offload_sections():
    z3 = build_deepspeed_config(load_profile("zero3_offload"), on_cpu=True)["zero_optimization"]
    assert z3["stage3_max_reuse_distance"] == 0
    assert z3["offload_optimizer"]["device"] == "cpu" and z3["offload_param"]["device"] == "cpu"
    assert "stage3_max_reuse_distance" not in build_deepspeed_config(load_profile("zero3"), on_cpu=False)["zero_optimization"]


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


def test_pick_profile_for_several_gpus_uses_the_estimator():
    from transformers import LlamaConfig

    seven_b = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                          vocab_size=32000)
    gib = 2**30
    assert pick_profile(8, model=seven_b, gpu_memory_bytes=80 * gib)[0] == "zero2"  # 2Ψ + 18Ψ/8 ≈ 30 GB fits
    name, why = pick_profile(8, model=seven_b, gpu_memory_bytes=32 * gib)
    assert name == "zero3" and "zero2 needs" in why  # ZeRO-2's 14 GB of bf16 weights + shards do not fit 32 GB
    name, why = pick_profile(2, model=seven_b, gpu_memory_bytes=8 * gib)
    assert name == "zero3_offload" and "nothing fits" in why
