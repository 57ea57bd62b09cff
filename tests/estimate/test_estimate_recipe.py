"""`hf-zero estimate --config` sizes the recipe as it will run, and `--gpu-memory` recommends a profile, micro-batch x
accumulation (keeping the global batch) and the exact `hf-zero train` command; `hf-zero train` on a GPU picks its
profile the same way. Bad input to every flag: one line, exit 2."""

import json

import pytest
from testing_utils import REPO

from hf_zero.cli import main

GIB = 2**30
SHAKESPEARE = "recipes/configs/smollm2_shakespeare.yaml"
LLAMA_1B = REPO / "tests" / "data" / "calibration" / "models" / "llama-1b"


def _estimate_json(capsys, *args) -> dict:
    assert main(["estimate", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _recipe(tmp_path, text: str) -> str:
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return str(path)


def test_recipe_as_it_will_run(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    out = _estimate_json(capsys, "--config", SHAKESPEARE, "--gpus-per-node", "1")
    inputs = out["inputs"]
    # the longest of the stages' max_seq_length (48, 128, 192), not the model's context
    assert (inputs["seq_len"], inputs["longest_stage"], inputs["micro_batch"]) == (192, "sonnets", 2)
    assert inputs["lora"]["r"] == 8 and inputs["lora"]["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert inputs["lora"]["lora_dropout"] == 0.05 and inputs["attn_implementation"] == "sdpa"
    # silent recipe: hf_zero's defaults (max_seq_length 128, micro-batch 2, no LoRA)
    silent = _recipe(tmp_path, "model_name_or_path: tiny-llama\nstages:\n  - {name: a, data: x.jsonl, steps: 1}\n")
    inputs = _estimate_json(capsys, "--config", silent)["inputs"]
    assert (inputs["seq_len"], inputs["micro_batch"], inputs["lora"]) == (128, 2, None)
    # flags override the recipe, as they would on `hf-zero train`
    inputs = _estimate_json(capsys, "--config", silent, "--micro-batch", "3", "--gradient-accumulation", "2",
                            "--attn-implementation", "eager", "--gradient-checkpointing")["inputs"]
    assert (inputs["micro_batch"], inputs["gradient_accumulation"], inputs["attn_implementation"],
            inputs["gradient_checkpointing"]) == (3, 2, "eager", True)


def test_gpu_memory_recommends_a_profile_and_a_runnable_command(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert main(["estimate", "--config", SHAKESPEARE, "--gpus-per-node", "1", "--gpu-memory", "24GiB"]) == 0
    out = capsys.readouterr().out
    assert "micro-batch 2 x 192 tokens (stage sonnets" in out
    assert "recommended: profile single_gpu, --nproc 1, micro-batch 2 x accumulation 1" in out
    assert "left; 10% of the GPU kept free" in out
    command = out.strip().splitlines()[-1].strip()
    assert command == f"hf-zero train --profile single_gpu --nproc 1 --config {SHAKESPEARE}"
    assert main([*command.split()[1:], "--dry-run"]) == 0  # it runs: the launch line it makes
    assert "single_gpu.yaml" in capsys.readouterr().out


def test_recommendation_keeps_the_global_batch(capsys, tmp_path):
    """llama-1.1B, micro-batch 8 x 1024, on a 16 GiB GPU: nothing fits at 8; zero3_offload at 4 x 2 does, and the
    command says so (in bf16, which that profile does not default to)."""
    recipe = _recipe(tmp_path, f"model_name_or_path: {LLAMA_1B}\nper_device_train_batch_size: 8\n"
                               "max_seq_length: 1024\npacking: true\n")
    rec = _estimate_json(capsys, "--config", recipe, "--gpu-memory", "16GiB")["recommendation"]
    assert (rec["profile"], rec["micro_batch"], rec["accumulation"], rec["global_batch"]) == ("zero3_offload", 4, 2, 8)
    assert rec["peak_bytes"] <= 0.9 * 16 * GIB and rec["headroom_bytes"] == 16 * GIB - rec["peak_bytes"]
    assert rec["command"] == (f"hf-zero train --profile zero3_offload --nproc 1 --precision bf16 --config {recipe} "
                              "--per_device_train_batch_size 4 --gradient_accumulation_steps 2")
    assert main(["estimate", "--config", recipe, "--gpu-memory", "3GiB"]) == 0  # nothing fits: say what would
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("recommended:"))
    assert "recommended: none (nothing fits 3.0 GiB" in line and "needs" in line and "gradient_checkpointing" in line


def test_train_on_one_gpu_picks_by_the_estimate(capsys, tmp_path, monkeypatch):
    """`hf-zero train` with 1 (faked) GPU sizes the recipe: single_gpu when it fits, else an offload profile in
    the precision it was sized for, else one line with the estimate and a command that fits."""
    import torch

    import hf_zero.plan.profiles

    memory = {"bytes": 80 * GIB}
    monkeypatch.setattr(hf_zero.plan.profiles, "gpu_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: type("P", (), {"total_memory": memory["bytes"]}))
    recipe = _recipe(tmp_path, f"model_name_or_path: {LLAMA_1B}\nper_device_train_batch_size: 8\n"
                               "max_seq_length: 1024\n")
    assert main(["train", "--config", recipe, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "[hf_zero] profile single_gpu: 1 GPU found: single_gpu on 1 rank is the fastest" in out
    memory["bytes"] = 24 * GIB
    assert main(["train", "--config", recipe, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "[hf_zero] profile zero3_offload:" in out and "--mixed_precision bf16" in out
    memory["bytes"] = 12 * GIB
    assert main(["train", "--config", recipe, "--dry-run", "--per_device_train_batch_size", "16"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hf-zero: error: profile: micro-batch 16 x 1024 tokens needs")
    assert "run: hf-zero train --profile zero3_offload" in err[0]


BAD = [
    (["--model", "tiny-llama", "--attn-implementation", "flash"], "--attn-implementation"),
    (["--model", "tiny-llama", "--attn-implementation", "eager", "--flash-attention"], "--flash-attention"),
    (["--model", "tiny-llama", "--gradient-accumulation", "0"], "--gradient-accumulation"),
    (["--model", "tiny-llama", "--gradient-accumulation", "two"], "--gradient-accumulation"),
    (["--model", "tiny-llama", "--gpu-memory", "-3GiB"], "--gpu-memory"),
    (["--model", "tiny-llama", "--seq-len", "0"], "--seq-len"),
    (["--model", "tiny-llama", "--use-peft", "--lora-target-modules", "nope_proj"], "--lora-target-modules"),
    (["--config", "does/not/exist.yaml"], "--config"),
    (["--model", "tiny-llama", "--lora-r", "4"], "--lora-r"),
    (["--model", "tiny-llama", "--use-peft", "--lora-r", "0"], "--lora-r"),
]
BAD_RECIPES = [
    ("model_name_or_path: tiny-llama\nstages:\n  - {name: a, data: x.jsonl, steps: 1, max_seq_length: long}\n",
     "stages[a].max_seq_length"),
    ("model_name_or_path: tiny-llama\nper_device_train_batch_size: 0\n", "per_device_train_batch_size"),
    ("model_name_or_path: tiny-llama\nuse_peft: maybe\n", "use_peft"),
    ("model_name_or_path: tiny-llama\nper_device_train_batch_size: 3\nglobal_batch_size: 8\n", "global_batch_size"),
]


@pytest.mark.parametrize("args,field", BAD + [([None, text], field) for text, field in BAD_RECIPES])
def test_bad_input_is_one_line_exit_2(capsys, tmp_path, args, field):
    if args[0] is None:
        args = ["--config", _recipe(tmp_path, args[1])]
    assert main(["estimate", *args, "--gpu-memory", "24GiB"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hf-zero: error: ") and field in err[0], err


LONG = str(REPO / "recipes" / "configs" / "tiny_long_context.yaml")


def test_long_context_recipe_gets_sequence_parallel_rows_per_stage_and_an_sp_size(capsys):
    """The context curriculum on 2 GPUs: each stage's ZeRO-3 peak with and without Ulysses (activations / sp), and
    on a GPU that the longest stage overflows without SP, the sp_size that fits it and the command."""
    out = _estimate_json(capsys, "--config", LONG, "--gpus-per-node", "2", "--gpu-memory", "1MiB")
    sp = out["sequence_parallel"]
    assert sp["sizes"] == [2]  # 4 heads and 2 kv heads, lengths 32/64/128, 2 ranks
    stages = {r["stage"]: r for r in sp["stages"]}
    assert [r["seq_len"] for r in sp["stages"]] == [32, 64, 128]
    for r in sp["stages"]:
        assert r["peak_bytes"]["2"] < r["peak_bytes"]["1"]  # json keys: the sizes as text
    # the split saves more the longer the sequence: activations grow with it, model states do not
    saved = [r["peak_bytes"]["1"] - r["peak_bytes"]["2"] for r in sp["stages"]]
    assert saved == sorted(saved) and saved[0] < saved[-1]
    usable = int(2**20 * 0.9)
    assert stages["ctx128"]["peak_bytes"]["1"] > usable >= stages["ctx128"]["peak_bytes"]["2"]
    assert stages["ctx128"]["fits_at_sp"] == 2 and stages["ctx32"]["fits_at_sp"] == 0
    assert sp["longest_stage"] == "ctx128" and sp["recommended_sp_size"] == 2
    assert main(["estimate", "--config", LONG, "--gpus-per-node", "2", "--gpu-memory", "1MiB"]) == 0
    text = capsys.readouterr().out
    assert (f"recommended for the longest stage ctx128: sp_size 2, the smallest that fits: hf-zero train --profile "
            f"zero3_sp --nproc 2 --precision bf16 --config {LONG}") in text


def test_no_sequence_parallel_rows_where_it_cannot_apply(capsys):
    """One GPU, or a bare model (no stages to split): no sequence-parallel section."""
    assert _estimate_json(capsys, "--config", LONG, "--gpus-per-node", "1")["sequence_parallel"] is None
    assert _estimate_json(capsys, "--model", "tiny-llama", "--gpus-per-node", "2")["sequence_parallel"] is None


def test_the_recommended_command_names_the_shipped_sp_size():
    from hf_zero.estimate.table import ZERO3_SP_SIZE
    from hf_zero.plan.profiles import load_profile

    assert load_profile("zero3_sp").sp_size == ZERO3_SP_SIZE


LONG_GPU = str(REPO / "recipes" / "configs" / "long_context_gpu.yaml")


def test_the_pick_turns_to_sequence_parallelism_only_when_nothing_else_fits():
    """No profile fits the longest stage but zero3_sp does: the recommendation and the automatic pick are zero3_sp
    at the smallest sp_size that fits; where a plain profile fits, SP is not picked."""
    from hf_zero.core.errors import UserError
    from hf_zero.estimate.pick import pick_profile, plan
    from hf_zero.estimate.recipe import read_recipe

    tiny = read_recipe(LONG)
    small = 2**20  # ctx128 needs 1.03 MiB per GPU without SP, 802 KiB with sp_size 2 (0.9 MiB usable)
    rec = plan(tiny, 2, small)
    assert (rec["profile"], rec["sp_size"], rec["global_batch"]) == ("zero3_sp", 2, 2)
    assert rec["command"] == f"hf-zero train --profile zero3_sp --nproc 2 --precision bf16 --config {LONG}"
    assert "zero3_sp at sp_size 2, the smallest that fits the longest stage ctx128" in rec["reason"]
    profile, why = pick_profile(2, recipe=tiny, gpu_memory_bytes=small)
    assert profile == "zero3_sp" and why.startswith("2 GPUs found: no profile fits without sequence parallelism")
    assert plan(tiny, 2, 24 * GIB)["profile"] == "zero2"
    assert pick_profile(2, recipe=tiny, gpu_memory_bytes=24 * GIB)[0] == "zero2"
    assert plan(tiny, 2, int(0.6 * 2**20))["profile"] is None  # not even an offload or sp_size 2 fits 0.6 MiB

    # Llama 3.1 8B at 128k tokens on 8 x 40 GiB: sp_size 2 does not fit, 4 does (8 would too), a copy of zero3_sp
    llama = read_recipe(LONG_GPU)
    rec = plan(llama, 8, 40 * GIB)
    assert (rec["profile"], rec["sp_size"], rec["micro_batch"], rec["global_batch"]) == ("zero3_sp", 4, 1, 8)
    assert rec["command"] == f"hf-zero train --profile zero3_sp4.yaml --nproc 8 --precision bf16 --config {LONG_GPU}"
    with pytest.raises(UserError) as err:
        pick_profile(8, recipe=llama, gpu_memory_bytes=40 * GIB)
    line = err.value.line()
    assert "\n" not in line and "parallelism_config_sp_size: 4" in line and "run: hf-zero train --profile zero3_sp4" \
        in line


def test_train_on_gpus_picks_sequence_parallelism(capsys, monkeypatch):
    """`hf-zero train` on 2 (faked) GPUs too small for the longest stage without SP launches zero3_sp."""
    import torch

    import hf_zero.plan.profiles

    monkeypatch.setattr(hf_zero.plan.profiles, "gpu_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: type("P", (), {"total_memory": 2**20}))
    assert main(["train", "--config", LONG, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "[hf_zero] profile zero3_sp: 2 GPUs found: no profile fits without sequence parallelism" in out, out


def test_long_context_gpu_recipe_recommends_an_sp_size_offline(capsys):
    """The shipped 4k -> 32k -> 128k curriculum of Llama 3.1 8B (its shape ships with hf_zero: no hub needed) on
    8 x 40 GiB: the estimate's recommendation and its SP rows agree on sp_size 4 for ctx128k."""
    out = _estimate_json(capsys, "--config", LONG_GPU, "--gpus-per-node", "8", "--gpu-memory", "40GiB")
    assert (out["recommendation"]["profile"], out["recommendation"]["sp_size"]) == ("zero3_sp", 4)
    assert out["recommendation"]["largest_micro_batch"] >= 1
    sp = out["sequence_parallel"]
    assert sp["sizes"] == [2, 4, 8] and sp["longest_stage"] == "ctx128k" and sp["recommended_sp_size"] == 4
    assert [r["fits_at_sp"] for r in sp["stages"]] == [0, 0, 4]
