"""FSDP2 beside ZeRO: the fsdp2 and fsdp2_offload profiles through the whole stack on 2 CPU ranks.

Fast: profile fields, `hf-zero check`'s FSDP2 constraints, resume across engines, and one 2-rank run each of DDP and
fsdp2 (losses, per-rank bytes, checkpoints, final/ and export). Slow: offload, LoRA with checkpointing and packing,
2 -> 1 -> 2 ranks, two machines on loopback. SIGKILL-and-resume runs in test_checkpoints.py's seeded chain.
"""

import json

import pytest
import torch
from safetensors.torch import load_file
from testing_utils import (
    TINY,
    OutAndRun,
    check,
    check_at_start,
    failed,
    launch_recipe,
    losses_after,
    max_weight_diff,
    profile,
    published,
    read_summary,
    start_args,
    with_meta,
)
from testing_utils import TINY24_FLAGS as COMMON  # test_checkpoints.py's runs: checkpoints every 3 steps

from hf_zero.checkpoint.store import read_metadata, size_breakdown, validate_checkpoint
from hf_zero.core.errors import UserError
from hf_zero.plan.profiles import load_profile, profile_from_env

LORA = ["--use_peft", "true", "--lora_r", "4", "--lora_dropout", "0", "--lora_target_modules", "q_proj", "v_proj"]


# ---------------------------------------------------------------- profiles and checks (no launch)

def test_fsdp_profiles_describe_engine_sharding_and_offload():
    for name, offload in (("fsdp2", "none"), ("fsdp2_offload", "cpu")):
        p = load_profile(name)
        assert (p.engine, p.fsdp_version, p.zero_stage, p.offload_param, p.offload_optimizer) == \
            ("fsdp2", 2, None, offload, offload)
        assert p.uses_fsdp and not p.uses_deepspeed and p.fsdp_layer_cls is None  # read from the model
        assert p.sharding == "FSDP2 full shard, reshard after forward"
    # Started by plain `accelerate launch`: the profile is read back from the launcher's variables.
    env = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_OFFLOAD_PARAMS": "true", "WORLD_SIZE": "4",
           "FSDP_RESHARD_AFTER_FORWARD": "false", "FSDP_TRANSFORMER_CLS_TO_WRAP": "LlamaDecoderLayer",
           "ACCELERATE_MIXED_PRECISION": "bf16"}
    p = profile_from_env(env)
    assert (p.name, p.engine, p.num_processes, p.precision, p.offload_param) == \
        ("fsdp2_offload", "fsdp2", 4, "bf16", "cpu")
    assert p.sharding == "FSDP2 full shard per LlamaDecoderLayer, kept gathered until backward"


def test_precision_is_the_profiles_and_reaches_the_trainer_as_for_zero():
    from dataclasses import replace

    from hf_zero.plan.reconcile import reconcile_training_kwargs

    bf16 = replace(load_profile("fsdp2"), mixed_precision="bf16")  # PRECISION=bf16 at launch
    kwargs, plan = reconcile_training_kwargs({"per_device_train_batch_size": 2}, bf16, 2, has_gpu=False,
                                             global_batch=8)
    assert (kwargs["bf16"], kwargs["fp16"], kwargs["use_cpu"], plan.accumulation) == (True, False, True, 2)
    assert "deepspeed" not in kwargs  # FSDP2's mixed-precision policy comes from the same profile, via accelerate
    with pytest.raises(UserError) as err:
        reconcile_training_kwargs({"bf16": True}, load_profile("fsdp2"), 2, has_gpu=False, global_batch=None)
    assert "profile fsdp2 says mixed_precision: no" in err.value.line()


def test_check_passes_fsdp2_and_names_the_layer_class(capsys, tmp_path):
    rc, res = check(capsys, "--profile", "fsdp2_offload", "--config", str(TINY), output_dir=tmp_path / "o")
    assert rc == 0, res
    assert res["fsdp"][1].startswith("FSDP2: one shard group per LlamaDecoderLayer, resharded after forward")
    assert "CPUOffloadPolicy" in res["offload"][1]
    rc, res = check(capsys, "--profile", "zero2", "--config", str(TINY), output_dir=tmp_path / "o")
    assert res["fsdp"] == (True, "not used by profile zero2")


@pytest.mark.parametrize("replace, append, flags, field, says", [
    ({"fsdp_version: 2": "fsdp_version: 1"}, "", [], "fsdp_version", "FSDP2 only"),
    ({"SHARDED_STATE_DICT": "FULL_STATE_DICT"}, "", [], "fsdp_state_dict_type", "whole model and optimizer"),
    ({"  fsdp_offload_params: false": "  fsdp_transformer_layer_cls_to_wrap: GPT2Block"}, "", [],
     "fsdp_transformer_layer_cls_to_wrap", "names 'GPT2Block', which matches no layer of LlamaModel"),
    ({"TRANSFORMER_BASED_WRAP": "NO_WRAP"}, "", [], "fsdp_auto_wrap_policy", "gathered whole for every forward"),
    ({"fsdp_activation_checkpointing: false": "fsdp_activation_checkpointing: true"}, "",
     ["--gradient_checkpointing", "true"], "gradient_checkpointing", "the Trainer refuses both"),
    ({}, "", ["--save_only_model", "true"], "save_only_model", "sharded"),
    ({}, "", ["--fsdp", "full_shard"], "fsdp", "the profile owns the sharding engine"),
    ({"use_cpu: false": "use_cpu: true"}, "", ["--gpus", "2"], "use_cpu", "drop FSDP and train on the CPU"),
    ({}, "deepspeed_config:\n  zero_stage: 3\n", [], "deepspeed_config", "ignores DeepSpeed settings"),
])
def test_check_refuses_what_fsdp2_cannot_do_in_one_line(capsys, tmp_path, replace, append, flags, field, says):
    bad = profile(tmp_path, base="fsdp2", replace=replace, append=append)
    gpus = flags[flags.index("--gpus"):][:2] if "--gpus" in flags else []
    extra = [f for f in flags if f not in gpus]
    rc, res = check(capsys, "--profile", bad, *gpus, "--config", str(TINY), *extra, output_dir=tmp_path / "o")
    assert rc == 2 and "fsdp" in failed(res), res
    assert field in res["fsdp"][1] and says in res["fsdp"][1], res["fsdp"]


def test_layer_classes_follow_what_accelerate_can_shard():
    """BERT lists its embeddings among _no_split_modules, but accelerate shards the input embeddings in a group of
    their own (twice would crash in fully_shard); a ResNet has no input embeddings at all (accelerate fails)."""
    from hf_zero.data.model_names import get_model_config
    from hf_zero.plan.fsdp import verify_fsdp

    fsdp2 = load_profile("fsdp2")
    assert verify_fsdp(fsdp2, {}, 0, get_model_config("minilm")).startswith("FSDP2: one shard group per BertLayer,")
    with pytest.raises(UserError) as err:
        verify_fsdp(fsdp2, {}, 0, get_model_config("recipes/models/digits_resnet"))
    assert "ResNetModel has no input embeddings" in err.value.line() and "ddp or a zero profile" in err.value.fix


def test_misspelled_fsdp_key_is_refused_with_a_hint(capsys, tmp_path):
    bad = profile(tmp_path, base="fsdp2", replace={"fsdp_reshard_after_forward": "fsdp_reshard_after_forwrd"})
    rc, res = check(capsys, "--profile", bad, "--config", str(TINY))
    assert "fsdp_reshard_after_forwrd (did you mean fsdp_reshard_after_forward?)" in res["profile"][1]


def test_recipe_refuses_fsdp_mistakes_before_the_engine(tmp_path):
    kwargs, parsed, stages = start_args(tmp_path)
    launched = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_WORLD_SIZE": "2"}
    fsdp2 = load_profile("fsdp2")
    check_at_start(fsdp2, kwargs, parsed, stages, 2, str(TINY), env=launched)  # fine
    with pytest.raises(UserError) as err:
        check_at_start(fsdp2, {**kwargs, "save_only_model": True}, parsed, stages, 2, env=launched)
    assert err.value.field == "save_only_model"


def test_resume_converts_a_checkpoint_of_another_engine_and_refuses_ddp(tmp_path):
    from types import SimpleNamespace

    from hf_zero.checkpoint.resume import _choose
    from hf_zero.plan.reconcile import BatchPlan

    ck = with_meta(tmp_path, engine="fsdp2", profile="fsdp2", zero_stage=0)

    def ctx(name, world):
        plan = SimpleNamespace(batch=BatchPlan(4 // world, 1, world), world=world)  # the run plan's part resume reads
        return SimpleNamespace(profile=load_profile(name), plan=plan,
                               training_args=SimpleNamespace(output_dir=str(tmp_path), resume_from_checkpoint=None))

    # Under ZeRO the FSDP2 checkpoint is converted once (tests/checkpoint/test_cross_engine.py runs it end to end).
    decision = _choose(ctx("zero2", 2), fresh_start=False)
    assert decision["resume"] == str(ck) and decision.get("convert")
    with pytest.raises(UserError) as err:  # DDP keeps no sharded optimizer state to convert to
        _choose(ctx("ddp", 2), fresh_start=False)
    assert err.value.field == "profile" and "hf-zero export" in err.value.fix
    # Another rank count needs no conversion: distributed checkpoints reshard on load.
    assert _choose(ctx("fsdp2", 1), fresh_start=False) == {"resume": str(ck), "universal": False}


def test_slurm_and_multinode_lines_for_fsdp2(tmp_path, capsys):
    from hf_zero.cli import main

    assert main(["slurm", "--profile", "fsdp2", "--config", str(TINY), "--nodes", "2", "--gpus-per-node", "4",
                 "--output-dir", str(tmp_path / "run")]) == 0
    task = capsys.readouterr().out.splitlines()[-1]
    assert "accelerate_configs/fsdp2.yaml --num_machines 2 --num_processes 8" in task
    assert '--machine_rank "$SLURM_NODEID" --main_process_ip "$MAIN_IP"' in task and "deepspeed" not in task
    assert main(["train", "--profile", "fsdp2", "--nodes", "2", "--nproc", "8", "--machine-rank", "1", "--main-ip",
                 "node-a", "--config", str(TINY), "--dry-run"]) == 0
    line = capsys.readouterr().out
    assert "--num_machines 2 --num_processes 16 --machine_rank 1 --main_process_ip node-a" in line
    assert "deepspeed" not in line


def test_size_breakdown_knows_distributed_checkpoints():
    sizes = {"pytorch_model_fsdp_0/__0_0.distcp": 10, "optimizer_0/__1_0.distcp": 20, "optimizer_0/.metadata": 1,
             "scheduler.pt": 3}
    assert size_breakdown(sizes) == {"weights": 10, "optimizer": 21, "other": 3}


# ---------------------------------------------------------------- 2-rank runs through the real launcher

@pytest.fixture(scope="module")
def runs(strategy_runs):
    """The session's shared runs (tests/conftest.py): checkpoints every 5 steps, the memory probe on."""
    return OutAndRun(strategy_runs)


def _bytes(out) -> list[dict]:
    return [json.loads((out / f"memory_rank{r}.json").read_text())["measured"] for r in (0, 1)]


@pytest.mark.multiproc
def test_fsdp2_matches_ddp_and_really_shards(runs):
    (ddp, _), (out, proc) = runs["ddp"], runs["fsdp2"]
    base, s = read_summary(ddp), read_summary(out)
    assert (s["engine"], s["world_size"], s["zero_stage"]) == ("fsdp2", 2, 0)
    assert len(s["losses"]) == len(base["losses"]) == 15
    assert max(abs(a - b) for a, b in zip(s["losses"], base["losses"])) <= 1e-4
    assert "[hf_zero] FSDP2: one shard group per LlamaDecoderLayer (2 in all)" in proc.stdout
    # Each rank holds half of every parameter and gradient (accelerate alone would have run plain DDP on CPU).
    for full, half in zip(_bytes(ddp), _bytes(out)):
        assert (half["params"], half["grads"]) == (full["params"] // 2, full["grads"] // 2)
        assert half["optimizer"] < 0.51 * full["optimizer"]


@pytest.mark.multiproc
def test_fsdp2_final_model_loads_and_checkpoints_export_exactly(runs, tmp_path):
    from transformers import AutoModelForCausalLM

    from hf_zero.checkpoint.export import export_checkpoint

    (ddp, _), (out, proc) = runs["ddp"], runs["fsdp2"]
    final = load_file(str(out / "final" / "model.safetensors"))
    ref = load_file(str(ddp / "final" / "model.safetensors"))
    assert final.keys() == ref.keys() and all(torch.allclose(final[k], ref[k], atol=1e-5) for k in final)
    model = AutoModelForCausalLM.from_pretrained(str(out / "final"))
    assert all(torch.equal(model.state_dict()[k], v) for k, v in final.items())
    assert published(out) == [5, 10, 15]
    for step in (5, 10, 15):
        ck = out / f"checkpoint-{step}"
        meta = read_metadata(ck)
        assert validate_checkpoint(ck) is None and (meta["engine"], meta["world_size"]) == ("fsdp2", 2)
        assert meta["bytes"]["weights"] > 0 and meta["bytes"]["optimizer"] > meta["bytes"]["weights"]
        assert f"[hf_zero] checkpoint-{step}: " in proc.stdout
    # The last checkpoint is the end of training: its export equals the weights the run gathered into final/.
    exported = export_checkpoint(str(out / "checkpoint-15"), str(tmp_path / "hf"))
    assert exported["tensors"] == len(final)
    again = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert again.keys() == final.keys() and all(torch.equal(again[k], final[k]) for k in final)
    assert type(AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))).__name__ == "LlamaForCausalLM"
    export_checkpoint(str(out / "checkpoint-15"), str(tmp_path / "bf16"), dtype="bf16")
    assert {t.dtype for t in load_file(str(tmp_path / "bf16" / "model.safetensors")).values()} == {torch.bfloat16}


# ---------------------------------------------------------------- slow: offload, LoRA, rank changes, machines

@pytest.mark.slow
@pytest.mark.multiproc
def test_fsdp2_offload_matches_ddp(runs, tmp_path):
    out = tmp_path / "offload"
    proc = launch_recipe("fsdp2_offload", out)
    s, base = read_summary(out), read_summary(runs["ddp"][0])
    assert s["offload_param"] == s["offload_optimizer"] == "cpu" and "CPUOffloadPolicy" in proc.stdout
    assert max(abs(a - b) for a, b in zip(s["losses"], base["losses"], strict=True)) <= 1e-4
    assert max_weight_diff(out, runs["ddp"][0]) <= 1e-5


@pytest.mark.slow
@pytest.mark.multiproc
def test_fsdp2_lora_with_checkpointing_and_packing_matches_ddp(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from hf_zero.checkpoint.export import export_checkpoint
    from hf_zero.data.model_names import get_tiny_llama_path

    flags = [*LORA, "--gradient_checkpointing", "true", "--packing", "true", "--save_strategy", "steps",
             "--save_steps", "5"]
    for name in ("ddp", "fsdp2"):
        launch_recipe(name, tmp_path / name, *flags)
    s, base = read_summary(tmp_path / "fsdp2"), read_summary(tmp_path / "ddp")
    assert s["use_peft"] and s["trainable_params"] < s["total_params"] / 5
    assert max(abs(a - b) for a, b in zip(s["losses"], base["losses"], strict=True)) <= 1e-4
    adapter = load_file(str(tmp_path / "fsdp2" / "final" / "adapter_model.safetensors"))
    assert len(adapter) == 2 * 2 * 2 and all(t.numel() > 0 for t in adapter.values())
    assert all(t.abs().sum() > 0 for k, t in adapter.items() if "lora_B" in k)  # trained, not the zero init
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(get_tiny_llama_path()),
                                      str(tmp_path / "fsdp2" / "final"))
    loaded = {n: p for n, p in model.named_parameters() if "lora_" in n}
    assert len(loaded) == len(adapter)
    # Checkpoints carry the gathered adapter next to the distributed checkpoint; the last one is the final adapter.
    ck = tmp_path / "fsdp2" / "checkpoint-15"
    assert read_metadata(ck)["peft"] and (ck / "pytorch_model_fsdp_0").is_dir()
    in_ck = load_file(str(ck / "adapter_model.safetensors"))
    assert all(torch.equal(in_ck[k], adapter[k]) for k in adapter)
    export_checkpoint(str(ck), str(tmp_path / "merged"), merge_lora=True)
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"))
    ids = torch.tensor([[3, 17, 42, 99, 7, 250]])
    with torch.no_grad():
        assert (model(ids).logits - merged(ids).logits).abs().max() < 1e-5


@pytest.mark.slow
@pytest.mark.multiproc
def test_fsdp2_tied_embeddings_are_saved_and_exported_once(tmp_path):
    """SmolLM2-style tied input/output embeddings: same losses as DDP, and final/ and the export hold the shared
    tensor once, as save_pretrained writes it (from_pretrained ties it again)."""
    from transformers import AutoModelForCausalLM

    from hf_zero.checkpoint.export import export_checkpoint
    from hf_zero.data.model_names import get_model_config, get_tokenizer

    tokenizer = get_tokenizer("tiny-llama")
    cfg = get_model_config("tiny-llama", vocab_size=len(tokenizer))
    cfg.tie_word_embeddings, cfg.pad_token_id = True, tokenizer.pad_token_id
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "tied")
    tokenizer.save_pretrained(tmp_path / "tied")
    flags = ["--model_name_or_path", str(tmp_path / "tied"), "--save_strategy", "steps", "--save_steps", "15"]
    for name in ("ddp", "fsdp2"):
        launch_recipe(name, tmp_path / name, *flags)
    s, base = read_summary(tmp_path / "fsdp2"), read_summary(tmp_path / "ddp")
    assert max(abs(a - b) for a, b in zip(s["losses"], base["losses"], strict=True)) <= 1e-4
    final, ref = (load_file(str(tmp_path / n / "final" / "model.safetensors")) for n in ("fsdp2", "ddp"))
    assert final.keys() == ref.keys() and "lm_head.weight" not in final
    export_checkpoint(str(tmp_path / "fsdp2" / "checkpoint-15"), str(tmp_path / "hf"))
    again = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert again.keys() == final.keys() and all(torch.equal(again[k], final[k]) for k in final)
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.slow
@pytest.mark.multiproc
def test_fsdp2_text_classification_with_lora_matches_ddp(tmp_path):
    from testing_utils import REPO

    for name in ("ddp", "fsdp2"):
        proc = launch_recipe(name, tmp_path / name, config=REPO / "recipes" / "configs" / "tiny_classify.yaml",
                             recipe=REPO / "recipes" / "classify.py")
    assert "one shard group per BertLayer (6 in all)" in proc.stdout
    s, base = read_summary(tmp_path / "fsdp2"), read_summary(tmp_path / "ddp")
    assert max(abs(a - b) for a, b in zip(s["losses"], base["losses"], strict=True)) <= 1e-4
    assert (tmp_path / "fsdp2" / "final" / "adapter_model.safetensors").is_file()


@pytest.mark.slow
@pytest.mark.multiproc
def test_fsdp2_resume_on_one_rank_then_two(tmp_path, tiny24_config, tiny24_references):
    """2 -> 1 rank from checkpoint-3, then 1 -> 2 from what the 1-rank run wrote at step 12: no conversion, the
    losses after each resume and the final weights match the uninterrupted 2-rank run."""
    import shutil

    config, ref = tiny24_config, tiny24_references["fsdp2"]
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    shutil.copytree(ref / "checkpoint-3", one / "checkpoint-3")
    proc = launch_recipe("fsdp2", one, *COMMON, config=config, nproc=1)
    assert "written by 2 ranks, resharded on load for 1 rank" in proc.stdout
    assert max(abs(a - b) for a, b in zip(losses_after(one, 3), losses_after(ref, 3), strict=True)) <= 1e-4
    two.mkdir()
    shutil.copytree(one / "checkpoint-12", two / "checkpoint-12")
    proc = launch_recipe("fsdp2", two, *COMMON, config=config)
    assert "written by 1 rank, resharded on load for 2 ranks" in proc.stdout
    assert max(abs(a - b) for a, b in zip(losses_after(two, 12), losses_after(ref, 12), strict=True)) <= 1e-4
    assert max_weight_diff(two, ref) <= 1e-5


@pytest.mark.slow
@pytest.mark.multiproc
def test_fsdp2_on_two_machines_on_loopback_matches_one(tmp_path):
    import subprocess
    import sys

    from testing_utils import REPO, free_port, write_short_config

    short = write_short_config(TINY, tmp_path / "short.yaml", [3, 3])
    port, multi = str(free_port()), tmp_path / "multi"
    machines = [subprocess.Popen(
        [sys.executable, "-m", "hf_zero.cli", "train", "--profile", "fsdp2", "--nodes", "2", "--nproc", "1",
         "--machine-rank", str(rank), "--main-ip", "127.0.0.1", "--main-port", port, "--config", str(short),
         "--output_dir", str(multi), "--disable_tqdm", "true"], cwd=REPO, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    logs = [m.communicate(timeout=900)[0] for m in machines]
    assert [m.returncode for m in machines] == [0, 0], logs[0][-3000:]
    launch_recipe("fsdp2", tmp_path / "single", config=short)
    m, s = read_summary(multi), read_summary(tmp_path / "single")
    assert (m["engine"], m["world_size"]) == ("fsdp2", 2) and len(m["losses"]) == len(s["losses"]) == 6
    assert max(abs(a - b) for a, b in zip(m["losses"], s["losses"])) < 1e-4
