"""LoRA under ZeRO-3: every linear saves its input for backward, frozen or not.

zero.Init (and the ZeRO-3 engine, which runs it over the model) installs DeepSpeed's LinearFunctionForZeroStage3 as
torch.nn.functional.linear (memory_efficient_linear, on by default); its setup_context saves input and weight whatever
needs a gradient, where torch's own linear keeps no input of a frozen layer. The estimate counts those inputs under
zero3 and its offload variants (activations.step_bytes' frozen_inputs): measured here as the bytes autograd saves in
one forward of the tiny Llama with LoRA, with torch's linear and with DeepSpeed's, in-process.
"""

import pytest
import torch

from hf_zero.estimate.activations import step_bytes
from hf_zero.estimate.memory import estimate
from hf_zero.estimate.model_count import count_model

LORA = {"r": 4, "lora_dropout": 0.0, "task_type": "CAUSAL_LM"}


def _saved_bytes(model, ids) -> int:
    """Bytes of the tensors autograd saves for backward in one forward, each storage once, parameters left out."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, labels=ids)
    return sum(seen.values())


def test_zero3_linear_saves_the_frozen_inputs_the_estimate_adds(monkeypatch):
    from deepspeed.runtime.zero.linear import zero3_linear_wrap
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from hf_zero.data.model_names import resolve_model_path

    # eager attention: its output is a tensor of its own, as CUDA's sdpa kernels give it (CPU's sdpa hands o_proj a
    # view of the storage it saved, which would hide that input)
    model = AutoModelForCausalLM.from_pretrained(resolve_model_path("tiny-llama"), dtype=torch.float32,
                                                 attn_implementation="eager")
    model = get_peft_model(model, LoraConfig(**LORA))
    micro, seq = 2, 64
    ids = torch.randint(0, 500, (micro, seq))
    torch_linear = _saved_bytes(model, ids)
    monkeypatch.setattr(torch.nn.functional, "linear", zero3_linear_wrap)
    zero3_linear = _saved_bytes(model, ids)
    count = count_model("tiny-llama", lora=LORA)
    plain, zero3 = (step_bytes(count.layer, count.num_layers, count.vocab_size, "fp32", micro, seq, False, "eager",
                               full=False, frozen_inputs=f)["backward"] for f in (False, True))
    assert zero3_linear - torch_linear == zero3 - plain > 0  # o_proj, gate/up, down and lm_head inputs


def test_zero3_lora_estimate_counts_them_and_nothing_else_moves():
    from hf_zero.data.model_names import get_model_config

    config = get_model_config("benchmarks/models/llama-1b")
    lora, full = count_model(config, lora={"r": 16, "task_type": "CAUSAL_LM"}), count_model(config)
    # as the H100 runs the +19% is about were made: transformers' loss (before hf_zero's fused loss)
    kw = dict(world_size=1, precision="bf16", micro_batch=8, seq_len=1024, fused_cross_entropy=False)
    rows = {s: estimate(lora, s, **kw)["gpu_bytes_per_rank"] for s in ("ddp", "zero2", "zero3", "zero3_offload")}
    # Llama-1.1B shape, bf16, packed 1024 x 8: the linear inputs a frozen layer saves under ZeRO-3 alone
    ls, tokens = lora.layer, 8 * 1024
    per_layer = 2 * (ls.q_dim + ls.hidden + ls.intermediate)  # o_proj, gate/up (one shared input), down; q/k/v's
    extra = (lora.num_layers * per_layer + 2 * ls.hidden) * tokens  # input is LoRA's already; + lm_head's
    assert rows["zero3"]["activations"] - rows["zero2"]["activations"] == extra
    assert rows["zero3_offload"]["activations"] == rows["zero3"]["activations"]
    # torch's linear: unchanged, but for autocast's 16-bit copies of the fp32 adapters (DeepSpeed holds them in bf16)
    assert rows["ddp"]["activations"] == rows["zero2"]["activations"] + 2 * lora.autocast_params > 0
    assert rows["zero3"]["total"] / (rows["zero3"]["total"] - extra) == pytest.approx(1.19, abs=0.01)
    # a full fine-tune saved every input already
    assert estimate(full, "zero3", **kw)["gpu_bytes_per_rank"]["activations"] == \
        estimate(full, "zero2", **kw)["gpu_bytes_per_rank"]["activations"]
