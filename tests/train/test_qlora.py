"""QLoRA (load_in_4bit): LoRA on a 4-bit NF4 base through transformers' BitsAndBytesConfig and peft's
prepare_model_for_kbit_training; bitsandbytes' CPU backend runs it here under the Trainer, ZeRO and FSDP2.

In-process: the refusals, the model as built (its bytes against the estimate's 4-bit row), the estimate and the
recommendation for Llama-3.1-8B LoRA on a 12 GiB GPU. 2 CPU ranks (one module fixture): ddp, zero3 and fsdp2 in bf16
with bytes per rank measured against the estimate, falling losses, and `hf-zero export --merge-lora` of the checkpoint
into a plain 16-bit model that answers as the 4-bit model with its adapter did. (Resuming a QLoRA checkpoint was
checked by hand: steps 11-15 repeat the uninterrupted run's losses within 1e-4; the resume itself is tested for
LoRA in tests/test_lora_16bit.py.)
"""

import json
import sys
from dataclasses import replace

import pytest
import torch
import yaml
from testing_utils import GPU_NPROC as NPROC
from testing_utils import GPU_RECIPE_YAML as RECIPE_YAML
from testing_utils import REPO, SMOL_SHAPE, launch_recipe, read_summary, run_cmd, write_short_config

from hf_zero.core.errors import UserError
from hf_zero.estimate.measure import count_parameters, measure_engine_bytes
from hf_zero.estimate.memory import estimate
from hf_zero.estimate.model_count import count_model, nf4_bytes
from hf_zero.estimate.pick import plan
from hf_zero.estimate.recipe import RecipeMemory, lora_fields
from hf_zero.plan.arguments import ModelArguments
from hf_zero.plan.profiles import gpu_count, load_profile
from hf_zero.plan.quantization import quantization_config, verify_quantization
from hf_zero.train.model import build_causal_lm, describe_weights, keep_4bit_layout_on_cpu

GIB = 2**30
LLAMA_8B = REPO / "benchmarks" / "models" / "llama-3.1-8b"
TINY_LORA = {"r": 4, "task_type": "CAUSAL_LM"}
QLORA = ModelArguments(model_name_or_path="tiny-llama", use_peft=True, lora_r=4, load_in_4bit=True)


def _profile(name: str, precision: str = "bf16"):
    return replace(load_profile(name), mixed_precision={"fp32": "no"}.get(precision, precision))


def test_load_in_4bit_needs_lora_and_a_profile_without_nvme():
    with pytest.raises(UserError) as err:
        verify_quantization(replace(QLORA, use_peft=False), _profile("ddp"), 0)
    assert err.value.line() == ("load_in_4bit: a 4-bit base cannot be trained, only adapters on it; "
                                "add use_peft: true (QLoRA) or drop load_in_4bit")
    with pytest.raises(UserError, match="offloads to NVMe"):
        verify_quantization(QLORA, _profile("zero3_nvme"), 0)
    assert verify_quantization(replace(QLORA, load_in_4bit=False), _profile("ddp"), 0) is None
    for name in ("single_gpu", "ddp", "cpu", "zero3", "zero3_offload", "fsdp2", "fsdp2_offload"):
        assert verify_quantization(QLORA, _profile(name), 0).startswith("QLoRA: NF4 base")


@pytest.mark.recipe_run
def test_check_and_the_recipe_refuse_load_in_4bit_without_lora(tmp_path):
    from hf_zero.preflight.at_start import check_launch_at_start

    with pytest.raises(UserError, match="^load_in_4bit"):
        check_launch_at_start(_profile("single_gpu"), (replace(QLORA, use_peft=False),), 1, env={})
    proc = run_cmd([sys.executable, "-m", "hf_zero.cli", "check", "--profile", "ddp", "--config",
                    REPO / "recipes" / "configs" / "tiny_curriculum.yaml", "--output-dir", tmp_path,
                    "--load_in_4bit", "true"], check=False)
    assert proc.returncode == 2 and "FAIL model: load_in_4bit: a 4-bit base cannot be trained" in proc.stdout
    assert "Traceback" not in proc.stdout + proc.stderr


def test_quantization_config_follows_the_profile():
    ddp, zero3, fsdp2 = (quantization_config(QLORA, _profile(n)) for n in ("ddp", "zero3", "fsdp2"))
    assert (ddp.bnb_4bit_quant_type, ddp.bnb_4bit_use_double_quant, ddp.bnb_4bit_compute_dtype) == (
        "nf4", True, torch.bfloat16)
    assert ddp.bnb_4bit_quant_storage == torch.uint8  # sharded, the packed weights are 16-bit elements
    assert zero3.bnb_4bit_quant_storage == fsdp2.bnb_4bit_quant_storage == torch.bfloat16
    assert quantization_config(QLORA, _profile("zero3", "fp16")).bnb_4bit_compute_dtype == torch.float16
    assert quantization_config(replace(QLORA, load_in_4bit=False), _profile("ddp")) is None


@pytest.mark.parametrize("name", ["ddp", "zero3"])
def test_built_model_holds_the_bytes_of_the_estimates_4bit_row(name):
    """The model after loading: NF4 linears (+ their quantization constants), 16-bit embeddings, fp32 norms and
    adapters; its bytes (one rank, nothing sharded yet) are the estimate's ddp row, whose parts it checks."""
    from hf_zero.data.model_names import get_tokenizer

    profile = _profile(name)
    model = build_causal_lm(QLORA, get_tokenizer("tiny-llama"), profile)
    count = count_model("tiny-llama", lora=TINY_LORA)
    assert count_parameters(model) == (count.trainable_params, count.total_params)
    assert describe_weights(model, profile) == "frozen base NF4 (4-bit; the rest bf16, fp32), trainable fp32"
    packed = [p for p in model.parameters() if hasattr(p, "quant_state")]
    assert len(packed) == len(count.quantizable) == 14 and {p.dtype for p in packed} == {
        torch.bfloat16 if name == "zero3" else torch.uint8}
    assert model.get_input_embeddings().weight.dtype == model.get_output_embeddings().weight.dtype == torch.bfloat16
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}
    packed_bytes, constants = nf4_bytes(count)
    assert sum(p.untyped_storage().nbytes() for p in packed) == packed_bytes
    measured = measure_engine_bytes(model)["params"]
    row = estimate(count, "ddp", world_size=1, precision="bf16", frozen_base="nf4")["gpu_bytes_per_rank"]
    assert measured == row["params"] == packed_bytes + constants + 2 * sum(count.embeddings) + 4 * (
        count.total_params - sum(count.quantizable) - sum(count.embeddings))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # and it trains: gradients reach the adapters only
        ids = torch.randint(0, 500, (2, 16))
        model(input_ids=ids, labels=ids).loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    model.eval()  # and it evaluates, then saves, as a run does (on any CPU: bitsandbytes' AVX512-BF16 repack is off)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.isfinite(model(input_ids=ids).logits).all()
    assert not any(getattr(m, "support_avx512bf16_for_cpu", False) for m in model.modules())
    saved = model.state_dict()  # a checkpoint's: bitsandbytes' layout, packed weights as they were built
    assert all(saved[name].dtype == p.dtype for name, p in model.named_parameters() if hasattr(p, "quant_state"))


def test_a_4bit_model_that_trains_keeps_its_layout_on_any_cpu():
    """bitsandbytes' AVX512-BF16 repack (in place, at an evaluation) is off for every 4-bit linear of a model hf_zero
    trains, whatever the CPU (the flag is what bitsandbytes read from it, set here on a stand-in)."""
    from types import SimpleNamespace

    def linear(repack):
        module = torch.nn.Module()
        module.weight = SimpleNamespace(quant_state=SimpleNamespace(shape=torch.Size([32, 64]), blocksize=64))
        module.support_avx512bf16_for_cpu = repack
        return module

    model = torch.nn.ModuleList([linear(True), linear(1), linear(False), torch.nn.Linear(3, 5)])
    assert keep_4bit_layout_on_cpu(model) == 2
    assert [getattr(m, "support_avx512bf16_for_cpu", None) for m in model] == [False, False, False, None]


@pytest.fixture(scope="module")
def llama8b():
    from hf_zero.data.model_names import get_model_config

    return count_model(get_model_config(str(LLAMA_8B)), lora=lora_fields(ModelArguments(use_peft=True)))


def test_llama_8b_lora_on_12gib_is_recommended_qlora(llama8b):
    from hf_zero.estimate.pick import pick_profile

    c = llama8b
    kw = dict(world_size=1, precision="bf16", micro_batch=1, seq_len=2048, grad_checkpointing=True)
    half, four = (estimate(c, "ddp", frozen_base=b, **kw)["gpu_bytes_per_rank"] for b in (None, "nf4"))
    packed, constants = nf4_bytes(c)
    assert packed == sum(c.quantizable) // 2 and constants < packed / 30  # 0.5 B + ~1/64 B per weight
    assert four["params"] < 6 * GIB < 14 * GIB < half["params"]
    assert four["total"] <= 0.9 * 12 * GIB < half["total"]
    recipe = RecipeMemory(model=str(LLAMA_8B), micro=1, accumulation=1, seq_len=2048,
                          lora=lora_fields(ModelArguments(use_peft=True)), gradient_checkpointing=True)
    found = plan(recipe, 1, 12 * GIB)
    assert (found["profile"], found["load_in_4bit"]) == ("single_gpu", True)
    assert found["reason"].startswith("QLoRA (add load_in_4bit: true")
    assert (plan(recipe, 1, 24 * GIB)["profile"], plan(recipe, 1, 24 * GIB)["load_in_4bit"]) == ("single_gpu", False)
    # hf-zero train without --profile: the same pick; it names the change instead of making it unasked
    with pytest.raises(UserError) as err:
        pick_profile(1, gpu_memory_bytes=12 * GIB, recipe=recipe, precision="bf16")
    assert err.value.field == "load_in_4bit" and "QLoRA" in err.value.problem
    assert pick_profile(1, gpu_memory_bytes=12 * GIB, recipe=replace(recipe, load_in_4bit=True),
                        precision="bf16")[0] == "single_gpu"


def test_cli_estimate_shows_4bit_rows_and_recommends_qlora(capsys):
    from hf_zero.cli import main

    assert main(["estimate", "--model", str(LLAMA_8B), "--use-peft", "--gradient-checkpointing", "--seq-len", "2048",
                 "--gpus-per-node", "1", "--gpu-memory", "12GiB", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = {(s["name"], s["frozen_base"]): s["gpu_bytes_per_rank"]["total"] for s in out["strategies"]}
    assert {("ddp", "nf4"), ("zero3", "nf4"), ("fsdp2", "nf4"), ("ddp", "bf16")} <= set(rows)
    assert out["recommendation"]["profile"] == "single_gpu" and out["recommendation"]["load_in_4bit"]
    assert main(["estimate", "--model", "tiny-llama", "--load-in-4bit"]) == 2
    assert "--load-in-4bit: a 4-bit base cannot be trained" in capsys.readouterr().err


# ---------------------------------------------------------------- 2 CPU ranks

LORA = ["--use_peft", "true", "--lora_r", "4", "--lora_dropout", "0", "--load_in_4bit", "true",
        "--measure_memory", "true"]


def _bf16(tmp, name):
    text = (REPO / "accelerate_configs" / f"{name}.yaml").read_text().replace("mixed_precision: 'no'",
                                                                               "mixed_precision: bf16")
    path = tmp / f"{name}_bf16.yaml"
    path.write_text(text)
    return str(path.with_suffix(""))  # launch_recipe adds .yaml


@pytest.fixture(scope="module")
def qlora_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("qlora")
    procs = {name: launch_recipe(_bf16(root, name), root / name, *LORA, "--save_strategy", "steps",
                                 "--save_steps", "15") for name in ("ddp", "zero3", "fsdp2")}
    return root, procs


@pytest.mark.multiproc
@pytest.mark.parametrize("name", ["ddp", "zero3", "fsdp2"])
def test_qlora_on_2_cpu_ranks_holds_the_estimated_bytes(qlora_runs, name):
    from hf_zero.estimate.measure import read_measurements

    root, procs = qlora_runs
    assert "weights: frozen base NF4 (4-bit; the rest bf16, fp32), trainable fp32" in procs[name].stdout
    s = read_summary(root / name)
    assert s["eval_loss_after"] < s["eval_loss_before"]
    count = count_model("tiny-llama", lora=TINY_LORA)
    row = estimate(count, name, world_size=2, gpus_per_node=2, precision="bf16", frozen_base="nf4")
    records = read_measurements(root / name)
    assert [r["rank"] for r in records] == [0, 1]
    for r in records:
        # ddp: every rank the whole 4-bit model; zero3: the packed weights and the rest (cast to bf16) partitioned,
        # fsdp2 (FSDP-QLoRA) too, the rest as loaded; the quantization constants whole on each rank
        assert r["measured"]["params"] == row["gpu_bytes_per_rank"]["params"], (r, row)
        if name == "fsdp2":  # sharded adapters, their gradients and Adam state, exactly
            assert [r["measured"][k] for k in ("grads", "optimizer")] == [
                row["gpu_bytes_per_rank"][k] for k in ("grads", "optimizer")]


@pytest.mark.multiproc
def test_qlora_export_merges_into_a_plain_16bit_model(qlora_runs, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from hf_zero.checkpoint.export import export_checkpoint
    from hf_zero.data.model_names import resolve_model_path

    root, _ = qlora_runs
    checkpoint = root / "ddp" / "checkpoint-15"
    assert json.loads((checkpoint / "hf_zero_checkpoint.json").read_text())["settings"]["load_in_4bit"]
    assert not list(checkpoint.glob("model*.safetensors"))  # the adapter only
    export_checkpoint(str(checkpoint), str(tmp_path / "merged"), dtype="bf16", merge_lora=True)
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"))  # no bitsandbytes config
    assert "quantization_config" not in json.loads((tmp_path / "merged" / "config.json").read_text())
    assert {p.dtype for p in merged.parameters()} == {torch.bfloat16}
    base = AutoModelForCausalLM.from_pretrained(resolve_model_path("tiny-llama"), dtype=torch.bfloat16,
                                                quantization_config=quantization_config(QLORA, _profile("ddp")))
    keep_4bit_layout_on_cpu(base)  # bitsandbytes' AVX512-BF16 repack cannot take this small model's shapes
    trained = PeftModel.from_pretrained(base, str(checkpoint))
    ids = torch.tensor([[3, 17, 42, 99, 7, 250]])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want, got = trained(ids).logits.float(), merged(ids).logits.float()
    # the merge rounds base + BA to bf16 once: within bf16's steps of logits near 1
    assert torch.allclose(got, want, atol=0.05), (got - want).abs().max()
    assert got.argmax(-1).tolist() == want.argmax(-1).tolist()


# ---------------------------------------------------------------- on a GPU (`make test-gpu`)

@pytest.mark.gpu
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("profile", ["single_gpu", "zero3"])
def test_qlora_on_a_gpu_peaks_within_10_percent_of_the_estimate(profile, tmp_path):
    """The 4-bit row against torch.cuda.max_memory_allocated on SmolLM2-135M's shape (test_gpu.py's model), as every
    profile's 16-bit row is checked there; not run on a machine without a GPU."""
    if gpu_count() == 0:
        pytest.skip("no CUDA GPU on this machine (torch.cuda.device_count() == 0)")
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from hf_zero.data.model_names import TINY_TOKENIZER_DIR

    model = tmp_path / "smol-rand"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(LlamaConfig(**SMOL_SHAPE), dtype=torch.float32).save_pretrained(model)
    AutoTokenizer.from_pretrained(TINY_TOKENIZER_DIR).save_pretrained(model)
    config = write_short_config(RECIPE_YAML, tmp_path / "short.yaml", [2, 2, 2], load_in_4bit=True)
    nproc = 1 if profile == "single_gpu" else NPROC
    out = tmp_path / "run"
    run_cmd([sys.executable, "-m", "hf_zero.cli", "train", "--profile", profile, "--nproc", nproc, "--precision",
             "bf16", "--config", config, "--model_name_or_path", model, "--output_dir", out, "--disable_tqdm",
             "true"], env={"HF_ZERO_BENCH": "1"}, timeout=1800)
    measured = max(json.loads(p.read_text())["device_peak_bytes"] for p in out.glob("bench_rank*.json"))
    recipe = yaml.safe_load(config.read_text())
    seq = max(s.get("max_seq_length") or recipe.get("max_seq_length", 128) for s in recipe["stages"])
    proc = run_cmd([sys.executable, "-m", "hf_zero.cli", "estimate", "--config", config, "--model", model, "--profile",
                    profile, "--gpus-per-node", nproc, "--precision", "bf16", "--seq-len", seq, "--json"])
    (row,) = json.loads(proc.stdout)["strategies"]
    assert row["frozen_base"] == "nf4"
    estimate_total = row["gpu_bytes_per_rank"]["total"]
    assert abs(estimate_total - measured) <= 0.10 * measured, (profile, estimate_total, measured)
