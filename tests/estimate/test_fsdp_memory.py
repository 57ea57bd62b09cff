"""`hf-zero estimate`'s FSDP2 rows (hf_zero/estimate/fsdp.py): the arithmetic, the recommendation and profile pick
beside ZeRO, and the estimate against the bytes each of 2 CPU ranks really holds after step 1 (the sum of the local
shards of parameters, gradients and optimizer state: hf_zero.estimate.measure reads DTensor.to_local()).

Default: the arithmetic, and fsdp2 LoRA on 2 ranks in fp32 and in bf16 (its base held in bf16; ~1 min each).
Slow: fsdp2 full, fsdp2_offload full and LoRA (fp32 and bf16), and fsdp2 full in bf16:
`pytest -m slow tests/estimate/test_fsdp_memory.py`.
"""

import json

import pytest
from testing_utils import ONE_STEP_LORA as LORA  # the same one-step recipe as the ZeRO rows
from testing_utils import REPO, launch_recipe, read_summary

from hf_zero.cli import main
from hf_zero.estimate import fsdp as fsdp_memory
from hf_zero.estimate.measure import read_measurements
from hf_zero.estimate.memory import estimate
from hf_zero.estimate.model_count import ModelCount, count_model

GIB = 2**30


@pytest.fixture(scope="module")
def llama7b():
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                         vocab_size=32000, max_position_embeddings=4096)
    return count_model(config)


# ---------------------------------------------------------------- arithmetic (no launch)

def test_fsdp2_holds_16_bytes_per_param_over_n_in_fp32_and_bf16(llama7b):
    psi, n = llama7b.total_params, 8
    tensors = len(llama7b.param_numels)
    for precision in ("fp32", "bf16"):
        g = estimate(llama7b, "fsdp2", gpus_per_node=n, precision=precision)["gpu_bytes_per_rank"]
        # llama-7B's dims all divide by 8: the padded shards are exact eighths
        assert (g["params"], g["grads"], g["optimizer"]) == (4 * psi // n, 4 * psi // n, 8 * psi // n + 4 * tensors)
    fp32, bf16 = (estimate(llama7b, "fsdp2", gpus_per_node=n, precision=p)["gpu_bytes_per_rank"]
                  for p in ("fp32", "bf16"))
    assert bf16["gathered"] * 2 == fp32["gathered"] > 0  # the working layer is gathered in the compute precision
    # Fewer bytes than ZeRO-3 in fp32 (DeepSpeed clones an fp32 master partition), same order in bf16.
    z3 = estimate(llama7b, "zero3", gpus_per_node=n, precision="fp32")["gpu_bytes_per_rank"]
    states = {k: fp32[k] for k in ("params", "grads", "optimizer")}
    assert sum(states.values()) < 0.7 * (z3["params"] + z3["grads"] + z3["optimizer"])


def test_shards_are_padded_to_the_first_ranks_rows():
    """Rank 0 holds ceil(dim0 / N) rows of every parameter: 10 rows on 3 ranks is 4 rows, not 10/3."""
    count = ModelCount(total_params=10 * 6 + 6, largest_layer_params=60, trainable_params=60,
                       param_numels=(60, 6), param_shapes=((10, 60, True), (6, 6, False)), shard_groups=(66, 60, 0, 0))
    params, grads, optim = fsdp_memory.shard_states(count, 3)
    assert (params, grads, optim) == (4 * (4 * 6 + 2), 4 * 4 * 6, 8 * 4 * 6 + 4)


def test_groups_follow_accelerates_wrapping(tmp_path):
    from hf_zero.data.model_names import get_model_config

    cfg = get_model_config("tiny-llama")
    h, i, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    kv = h // cfg.num_attention_heads * cfg.num_key_value_heads
    layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h  # q, o; k, v; gate, up, down; two norms
    count = count_model("tiny-llama")
    largest, trainable, tail, _ = count.shard_groups
    # The input embeddings are a group of their own (v x h, larger than a layer here); the tail (final norm +
    # untied lm_head) stays gathered from its forward to its backward.
    assert (largest, trainable, tail) == (max(layer, v * h), max(layer, v * h), h + v * h)
    lora = count_model("tiny-llama", lora={"r": 4, "task_type": "CAUSAL_LM"})
    assert lora.shard_groups[0] == largest and lora.shard_groups[1] == 0  # embeddings: no adapter
    assert sum(1 for *_, t in lora.param_shapes if t) == 2 * 2 * cfg.num_hidden_layers  # A and B on q and v


def test_offload_keeps_only_the_working_layers_on_the_device(llama7b):
    on, off = (estimate(llama7b, s, gpus_per_node=8, precision="bf16", micro_batch=1, seq_len=1024)
               for s in ("fsdp2", "fsdp2_offload"))
    g, o = on["gpu_bytes_per_rank"], off["gpu_bytes_per_rank"]
    assert (o["params"], o["grads"], o["optimizer"]) == (0, 0, 0) and o["gathered"] == g["gathered"]
    assert off["offloaded_bytes_per_rank"] == g["params"] + g["grads"] + g["optimizer"]
    assert on["offloaded_bytes_per_rank"] == 0
    # CPU per node: 8 ranks' shards, or the fp32 model each rank reads before sharding, whichever is larger, x1.5
    assert off["cpu_bytes_per_node"] == int(1.5 * max(8 * off["offloaded_bytes_per_rank"],
                                                      8 * 4 * llama7b.total_params))
    assert o["resident"] < g["resident"] / 4 and o["total"] < g["total"]  # activations are the same
    # At the optimizer step nothing is gathered: that phase's peak is the sharded states alone.
    short = estimate(llama7b, "fsdp2", gpus_per_node=8, micro_batch=1, seq_len=8)
    s = short["gpu_bytes_per_rank"]
    assert short["peak"] == "optimizer step"
    assert s["total"] == s["model_states"] - s["gathered"] + s["buffers"]
    # Checkpoints: fp32 shards + two moments, no separate master copy.
    assert short["checkpoint_bytes"] == 12 * llama7b.total_params


def test_the_pick_takes_fsdp2_only_where_zero3_does_not_fit(llama7b):
    """hf_zero.estimate.pick's order (candidates): FSDP2 right after its ZeRO counterpart, so ZeRO wins where both
    fit; Llama-7B in full on 8 GPUs in fp32."""
    from transformers import LlamaConfig

    from hf_zero.estimate.pick import HEADROOM, candidates, plan
    from hf_zero.estimate.recipe import RecipeMemory

    kw = dict(gpus_per_node=8, precision="fp32", micro_batch=1, seq_len=1024, grad_checkpointing=True)
    total = {s: estimate(llama7b, s, **kw)["gpu_bytes_per_rank"]["total"]
             for s in ("zero2", "zero3", "fsdp2", "zero3_offload", "fsdp2_offload")}
    assert total["fsdp2"] < total["zero3"] < total["zero2"]
    config = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                         vocab_size=32000, max_position_embeddings=4096)
    recipe = RecipeMemory(model=config, micro=1, accumulation=1, seq_len=1024, gradient_checkpointing=True)

    def pick(usable, choices=None):  # on a GPU whose memory less the headroom is `usable`
        return plan(recipe, 8, int(usable / (1 - HEADROOM)) + 1, precision="fp32", choices=choices)["profile"]

    assert pick((total["fsdp2"] + total["zero3"]) // 2) == "fsdp2"
    assert pick(total["zero3"]) == "zero3"  # both fit: ZeRO wins
    offloaded = [c for c in candidates(8) if "offload" in c[0]]
    assert [p for p, _ in offloaded] == ["zero3_offload", "fsdp2_offload"]
    assert pick(max(total["zero3_offload"], total["fsdp2_offload"]), offloaded) == "zero3_offload"
    assert pick(total["fsdp2_offload"], offloaded[1:]) == "fsdp2_offload"


def test_train_without_profile_picks_fsdp2_where_it_alone_fits(llama7b):
    from hf_zero.estimate.pick import candidates, pick_profile
    from hf_zero.estimate.recipe import RecipeMemory

    assert [p for p, _ in candidates(8)] == ["zero2", "zero3", "fsdp2", "zero3_offload", "fsdp2_offload"]
    assert [p for p, _ in candidates(1)] == ["single_gpu", "zero2", "zero3_offload", "fsdp2_offload"]
    recipe = RecipeMemory(model=str(REPO / "benchmarks" / "models" / "llama-1b"), micro=1, accumulation=1,
                          seq_len=1024)
    count = count_model(str(REPO / "benchmarks" / "models" / "llama-1b"))
    kw = dict(gpus_per_node=8, precision="fp32", micro_batch=1, seq_len=1024)
    need = {s: estimate(count, s, **kw)["gpu_bytes_per_rank"]["total"] for s in ("zero3", "fsdp2")}
    assert need["fsdp2"] < need["zero3"]
    # The README's example: 8 GPUs of 8 GiB, 10% kept back
    assert need["fsdp2"] < 0.9 * 8 * GIB < need["zero3"]
    name, why = pick_profile(8, gpu_memory_bytes=8 * GIB, recipe=recipe, precision="fp32")
    assert name == "fsdp2" and "fsdp2 on 8 ranks" in why
    assert pick_profile(8, gpu_memory_bytes=int(need["zero3"] / 0.9) + 1, recipe=recipe, precision="fp32")[0] == \
        "zero3"


def test_cli_estimates_an_fsdp_profile(capsys):
    assert main(["estimate", "--model", "tiny-llama", "--profile", "fsdp2_offload", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [s["name"] for s in out["strategies"]] == ["fsdp2_offload"]
    assert out["inputs"]["gpus_per_node"] == 2 and out["inputs"]["precision"] == "fp32"  # the profile's
    assert main(["estimate", "--model", "tiny-llama", "--gpus-per-node", "2"]) == 0
    table = capsys.readouterr().out
    assert "\nfsdp2 " in table and "\nfsdp2_offload " in table


def test_cli_refuses_an_unknown_profile_in_one_line(capsys):
    assert main(["estimate", "--model", "tiny-llama", "--profile", "fsdp3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hf-zero: error: --profile: ") and "fsdp2" in err[0]


# ---------------------------------------------------------------- against 2 CPU ranks

SLOW = pytest.mark.slow
CASES = [("fsdp2", True, "fp32"), ("fsdp2", True, "bf16"),
         pytest.param("fsdp2", False, "fp32", marks=SLOW), pytest.param("fsdp2_offload", False, "fp32", marks=SLOW),
         pytest.param("fsdp2_offload", True, "fp32", marks=SLOW), pytest.param("fsdp2", False, "bf16", marks=SLOW),
         pytest.param("fsdp2_offload", True, "bf16", marks=SLOW)]


def _profile(tmp_path, name: str, precision: str):
    if precision == "fp32":
        return name
    text = (REPO / "accelerate_configs" / f"{name}.yaml").read_text().replace("mixed_precision: 'no'",
                                                                                f"mixed_precision: {precision}")
    path = tmp_path / f"{name}_{precision}.yaml"
    path.write_text(text)
    return str(path.with_suffix(""))  # launch_recipe adds .yaml to the profile's name


@pytest.mark.multiproc
@pytest.mark.parametrize("strategy,lora,precision", CASES)
def test_estimate_equals_what_each_rank_holds(tmp_path, one_step_config, strategy, lora, precision):
    out = tmp_path / "run"
    launch_recipe(_profile(tmp_path, strategy, precision), out, *(LORA if lora else []), "--measure_memory", "true",
                  config=one_step_config)
    count = count_model("tiny-llama", lora={"r": 4, "task_type": "CAUSAL_LM"} if lora else None)
    summary = read_summary(out)
    assert (summary["engine"], summary["precision"], summary["trainable_params"], summary["total_params"]) == (
        "fsdp2", precision, count.trainable_params, count.total_params)
    est = estimate(count, strategy, world_size=2, precision=precision, additional_buffer_factor=1.0)
    gpu = est["gpu_bytes_per_rank"]
    # A LoRA base in bf16 stays bf16 (hf_zero loads it so); accelerate upcasts only the adapters to fp32
    frozen = 2 if precision != "fp32" else 4
    expected = dict(zip(("params", "grads", "optimizer"), fsdp_memory.shard_states(count, 2, frozen)))
    if lora and precision != "fp32":  # the frozen shards are half their fp32 bytes; the adapters' are unchanged
        fp32 = fsdp_memory.shard_states(count, 2, 4)
        adapters = fp32[1]  # 4 bytes per trainable element on this rank, as its gradients
        assert expected["params"] - adapters == (fp32[0] - adapters) // 2 and expected["grads"] == fp32[1]
    if strategy == "fsdp2":
        assert {k: gpu[k] for k in expected} == expected
    else:  # everything sharded lives in host RAM; the device holds only the gathered layer(s)
        assert (gpu["params"], gpu["grads"], gpu["optimizer"]) == (0, 0, 0)
        assert est["offloaded_bytes_per_rank"] == sum(expected.values())
    records = read_measurements(out)
    assert [(r["rank"], r["world_size"], r["step"]) for r in records] == [(0, 2, 1), (1, 2, 1)]
    print(f"{strategy} {'LoRA' if lora else 'full'} {precision}: estimate {sum(expected.values())} B/rank, measured "
          f"{[r['measured']['model_states'] for r in records]}")  # shown with -s
    for r in records:
        m = r["measured"]
        for part, value in expected.items():
            # Rank 0 holds the largest (padded) shards; the other rank's can only be as large or smaller.
            assert m[part] == value if r["rank"] == 0 else value * 0.99 <= m[part] <= value, (part, r, expected)
        assert r["after_step"]["gathered_params"] == 0  # no DeepSpeed working copies under FSDP2
