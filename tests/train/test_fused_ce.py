"""Fused (chunked) linear cross-entropy (`fused_cross_entropy`): the loss and every gradient equal the standard
path's (fp32, <= 1e-5) for the bare function, for the Trainer's compute_loss on the tiny model (plain, tied
embeddings, LoRA, gradient accumulation's num_items_in_batch), and it needs far less memory on a large vocabulary."""

import json
import subprocess
import sys

import pytest
import torch
from testing_utils import REPO

from hf_zero.core.errors import UserError
from hf_zero.train.fused_ce import ChunkedLinearCrossEntropy, chunk_tokens, linear_cross_entropy, plan_fused_head

TOL = dict(atol=1e-5, rtol=1e-5)


def _problem(n=70, hidden=16, vocab=97, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=g).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) / 4).requires_grad_()
    b = torch.randn(vocab, generator=g).requires_grad_() if bias else None
    t = torch.randint(0, vocab, (n,), generator=g)
    t[::5] = -100
    return h, w, b, t


def _grads(loss, tensors):
    return torch.autograd.grad(loss, [x for x in tensors if x is not None])


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
@pytest.mark.parametrize("bias", [True, False])
def test_chunked_loss_and_grads_equal_cross_entropy(chunk, bias):
    h, w, b, t = _problem(bias=bias)
    want = torch.nn.functional.cross_entropy(torch.nn.functional.linear(h, w, b).float(), t)
    got = ChunkedLinearCrossEntropy.apply(h, w, b, t, (t != -100).sum(), chunk)
    torch.testing.assert_close(got, want, **TOL)
    # a non-unit upstream gradient (loss scaling, DeepSpeed's accumulation scaling) scales every gradient
    for a, e in zip(_grads(3 * got, (h, w, b)), _grads(3 * want, (h, w, b))):
        torch.testing.assert_close(a, e, **TOL)


def test_sum_over_a_given_token_count_as_under_gradient_accumulation():
    """num_items_in_batch: the sum over this micro-batch's tokens divided by the whole accumulated batch's count."""
    h, w, b, t = _problem()
    want = torch.nn.functional.cross_entropy(torch.nn.functional.linear(h, w, b), t, reduction="sum") / 123
    got = linear_cross_entropy(h, w, b, t, torch.tensor(123))
    torch.testing.assert_close(got, want, **TOL)
    for a, e in zip(_grads(got, (h, w, b)), _grads(want, (h, w, b))):
        torch.testing.assert_close(a, e, **TOL)


def test_frozen_head_gets_no_weight_gradient_and_the_default_chunk_splits_the_tokens():
    h, w, b, t = _problem(n=300, vocab=500, hidden=8)
    assert 1 < chunk_tokens(300, 500, 8) < 300  # several chunks: the logits of all tokens never exist at once
    w.requires_grad_(False)
    b.requires_grad_(False)
    loss = linear_cross_entropy(h, w, b, t, (t != -100).sum())
    (gh,) = torch.autograd.grad(loss, [h])
    want = torch.nn.functional.cross_entropy(torch.nn.functional.linear(h, w, b), t)
    torch.testing.assert_close(gh, torch.autograd.grad(want, [h])[0], **TOL)


# --- the Trainer hook on the real tiny model -------------------------------------------------------------------------

def _tiny(tied=False, lora_targets=None, model_type=None, **config_overrides):
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM

    from hf_zero.data.model_names import get_tiny_llama_path

    if tied:
        config = AutoConfig.from_pretrained(get_tiny_llama_path(), tie_word_embeddings=True)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
        assert model.lm_head.weight is model.model.embed_tokens.weight
    else:
        model = AutoModelForCausalLM.from_pretrained(get_tiny_llama_path())
    assert isinstance(model, LlamaForCausalLM)
    for key, value in config_overrides.items():
        setattr(model.config, key, value)
    if model_type:
        model.config.model_type = model_type
    if lora_targets:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=lora_targets,
                                                 task_type="CAUSAL_LM"))
        # LoRA B starts at zero, which would hide a wrong LoRA-A gradient
        for name, p in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.02)
    return model.train()


def _trainer(model, tmp_path, mode):
    from transformers import Trainer, TrainingArguments

    from hf_zero.train.fused_ce import FusedCrossEntropyMixin

    class FusedTrainer(FusedCrossEntropyMixin, Trainer):
        pass

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], disable_tqdm=True)
    return FusedTrainer(model=model, args=args, fused_cross_entropy=mode)


def _batch(seed=0, rows=3, width=40):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 200, (rows, width), generator=g)
    labels = ids.clone()
    labels[1, 30:] = -100  # padding
    labels[2, :5] = -100  # a prompt
    return {"input_ids": ids, "labels": labels, "position_ids": torch.arange(width).repeat(rows, 1),
            "use_cache": False}


def _loss_and_grads(trainer, batch, num_items):
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(trainer.model, dict(batch), num_items_in_batch=num_items)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("variant", ["plain", "tied", "lora"])
@pytest.mark.parametrize("num_items", [None, 250])
def test_trainer_loss_and_all_gradients_equal_standard(tmp_path, quiet_env, variant, num_items):
    """One forward and backward through compute_loss: the loss and the gradient of every trainable parameter."""
    kwargs = {"tied": variant == "tied", "lora_targets": ["q_proj", "v_proj"] if variant == "lora" else None}
    fused = _trainer(_tiny(**kwargs), tmp_path / "f", "auto")
    standard = _trainer(_tiny(**kwargs), tmp_path / "s", False)
    assert fused.fused_head is not None and fused.fused_ce_status.startswith("on")
    assert standard.fused_head is None
    batch = _batch()
    got, got_grads = _loss_and_grads(fused, batch, None if num_items is None else torch.tensor(num_items))
    want, want_grads = _loss_and_grads(standard, batch, None if num_items is None else torch.tensor(num_items))
    torch.testing.assert_close(got, want, **TOL)
    assert got_grads.keys() == want_grads.keys() and len(got_grads) > 2
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], **TOL, msg=name)


def test_evaluation_keeps_the_logits(tmp_path, quiet_env):
    trainer = _trainer(_tiny(), tmp_path, "auto")
    trainer.model.eval()
    with torch.no_grad():
        loss, outputs = trainer.compute_loss(trainer.model, _batch(), return_outputs=True)
    assert outputs.logits.shape[-1] == trainer.model.config.vocab_size and loss.ndim == 0


@pytest.mark.parametrize("case,reason", [
    ("lora on lm_head", "not a plain Linear"),
    ("softcapping", "final_logit_softcapping"),
    ("unchecked model type", "is not one hf_zero checked"),
])
def test_auto_falls_back_with_a_reason_and_true_refuses(quiet_env, case, reason):
    if case == "lora on lm_head":
        model = _tiny(lora_targets=["q_proj", "lm_head"])
    elif case == "softcapping":
        model = _tiny(final_logit_softcapping=30.0)
    else:
        model = _tiny(model_type="mixtral-like")
    head, status = plan_fused_head(model, "auto")
    assert head is None and status.startswith("standard: ") and reason in status
    if case == "unchecked model type":
        assert plan_fused_head(model, True)[0] is model.lm_head  # the user vouches for it
    else:
        with pytest.raises(UserError, match="fused_cross_entropy: cannot be used"):
            plan_fused_head(model, True)
    assert plan_fused_head(model, False)[0] is None


@pytest.mark.parametrize("value,want", [("auto", "auto"), ("true", True), (False, False), ("False", False)])
def test_yaml_and_flag_values(value, want):
    from hf_zero.plan.arguments import CurriculumArguments

    assert CurriculumArguments(fused_cross_entropy=value).fused_cross_entropy == want


def test_a_bad_value_is_one_line():
    from hf_zero.plan.arguments import CurriculumArguments

    with pytest.raises(UserError, match="fused_cross_entropy: 'maybe' is not auto, true or false"):
        CurriculumArguments(fused_cross_entropy="maybe")


# --- memory ----------------------------------------------------------------------------------------------------------

PEAK_SCRIPT = REPO / "benchmarks" / "fused_ce_memory.py"


def _peak(mode: str) -> dict:
    out = subprocess.run([sys.executable, PEAK_SCRIPT, mode], capture_output=True, text=True, check=True, timeout=600)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.recipe_run
def test_large_vocabulary_peak_memory_is_a_fraction_of_the_standard_path():
    """A 2048-token step through a 32k-vocabulary head (logits: 256 MiB in fp32), in fresh processes: the standard
    loss's extra peak is several copies of the logits; the fused loss's stays near the gradients it keeps."""
    standard, fused = _peak("standard"), _peak("fused")
    torch.testing.assert_close(torch.tensor(fused["loss"]), torch.tensor(standard["loss"]), **TOL)
    logits = standard["logits_bytes"]
    assert standard["peak_bytes"] >= 2 * logits  # the fp32 logits and their log-softmax at least
    assert fused["peak_bytes"] <= 0.25 * standard["peak_bytes"]


@pytest.mark.multiproc
def test_zero3_two_ranks_same_losses_with_and_without(tmp_path):
    """Under ZeRO-3 the lm_head weight is a partition outside its module's call; the loss is computed inside that
    call, so DeepSpeed gathers it there (and again for backward). With gradient accumulation, so the token count of
    the whole accumulated batch on both ranks (num_items_in_batch) sets the normalisation."""
    from testing_utils import launch_recipe, read_summary

    losses = {}
    for mode in ("true", "false"):
        proc = launch_recipe("zero3", tmp_path / mode, "--fused_cross_entropy", mode, "--gradient_accumulation_steps",
                             "2", nproc=2)
        assert ("cross-entropy: on" in proc.stdout) == (mode == "true")
        s = read_summary(tmp_path / mode)
        assert (s["zero_stage"], s["world_size"], s["grad_accum"]) == (3, 2, 2)
        losses[mode] = s["losses"]
    assert len(losses["true"]) == len(losses["false"]) == 15
    torch.testing.assert_close(torch.tensor(losses["true"]), torch.tensor(losses["false"]), atol=1e-5, rtol=0)
