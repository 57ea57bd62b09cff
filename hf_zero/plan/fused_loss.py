"""Which models the fused loss (`fused_cross_entropy`) is exact for, read from the model's config alone, and how many
tokens it computes logits for at once: the run (hf_zero.train.fused_ce) and the memory estimate (hf_zero.estimate)
use the same answers."""

from __future__ import annotations

import math

__all__ = ["EXACT_MODEL_TYPES", "LOGIT_CHANGING_FIELDS", "config_problem", "chunk_tokens"]

# Model types whose causal-LM forward applies nothing to the logits after lm_head (checked in transformers 5.23's
# modeling files): for them the fused loss is the same computation. Gemma2/3 (softcapping), Cohere (logit_scale) and
# Granite (logits_scaling) change the logits; MoE models add their router loss only when given labels.
EXACT_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "phi", "phi3", "gpt2", "gemma", "olmo", "olmo2",
                               "starcoder2", "smollm3", "glm", "gpt_neox"})
LOGIT_CHANGING_FIELDS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "router_aux_loss_coef")


def config_problem(config, mode) -> str | None:
    """Why the fused loss cannot replace the standard one for a model of this config under `mode` (auto or True),
    None when it can. What needs the built model (a causal LM with a plain Linear lm_head) is checked by the run."""
    model_type = getattr(config, "model_type", None)
    changed = [f for f in LOGIT_CHANGING_FIELDS if getattr(config, f, None) not in (None, 1, 1.0)]
    if changed:
        return f"{model_type} changes the logits or the loss after lm_head ({changed[0]})"
    if getattr(config, "loss_type", None) not in (None, "ForCausalLM"):
        return f"the model's loss is {config.loss_type}, not ForCausalLM"
    if model_type not in EXACT_MODEL_TYPES and mode == "auto":
        return (f"model type {model_type} is not one hf_zero checked to apply nothing to the logits after lm_head "
                "(set fused_cross_entropy: true if it applies nothing)")
    return None


def chunk_tokens(tokens: int, vocab: int, hidden: int) -> int:
    """Tokens per chunk such that a chunk's logits hold about as many numbers as the hidden states of all tokens
    (Liger's rule): the loss then costs no more memory than one more copy of the activations entering lm_head."""
    return max(1, math.ceil(tokens / math.ceil(vocab / hidden)))
