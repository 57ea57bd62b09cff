"""What a training step keeps on the GPU besides model states: the tensors autograd saves for backward, the loss's
logits work and the autocast weight copies, counted per decoder layer from the model's real modules.

Modes: "autocast" = the Trainer without DeepSpeed in bf16/fp16 (fp32 weights, so the residual stream and norms stay
fp32, every matmul casts its input; autocast caches one 16-bit copy of each trainable weight until the forward ends,
and the matmuls save those copies for backward), "half" = DeepSpeed bf16/fp16 (16-bit weights, fp32 only inside
the norms; also autocast over a LoRA base held in 16 bits, whose fp32 weights that train are all it casts: their
copies are added by hf_zero.estimate.memory, from ModelCount.autocast_params), "fp32". Per token
and decoder layer, e = 2 (16-bit) or 4 (fp32) bytes, h hidden, q = heads x head_dim, i intermediate, s the sequence:
- each RMS/LayerNorm saves its input upcast to fp32 (4h) and, when its weight trains, its normalised output (the
  residual dtype: 4h autocast / fp32, 2h half);
- a trainable linear saves its input: under autocast each linear casts the fp32 norm output anew (q, k and v: three
  2h copies), otherwise one shared copy; a frozen one saves nothing of its input (only its weight);
- LoRA on a linear of width n: the dropout mask (1 byte/element on CUDA) + the dropout output in e bytes (without
  dropout just the input), + e x r for lora_B's input;
- per-head query and key norms (Qwen3's, OLMo2's `q_norm`, `k_norm`) save their input upcast to fp32 (4 (q + kv))
  and, when their weights train, their normalised output (e (q + kv));
- attention: sdpa with a mask (packed rows or padding; transformers repeats the KV heads then) saves q, k, v and
  the output (4 e q) and its own 16-bit copy of the mask (e s); eager saves q, k, v (3 e q) and the probabilities
  twice (fp32 softmax + 16-bit copy: 6 a s; fp32: 4 a s); flash_attention_2 saves q, k, v unrepeated + output;
- the attention output projection's input (e q) and, gated MLP: gate, act, up outputs (3 e i) + down's input (e i).
Loss (transformers ForCausalLMLoss): bf16 logits are upcast (.float()), log_softmax keeps its fp32 output; in
backward nll's gradient, log_softmax's gradient and its saved output are alive together: 12 V bytes per token
(forward end: 2 + 4 + 4 = 10 V; fp32: 8 V). Gradient checkpointing (non-reentrant) keeps each layer's input
(r h) and recomputes one layer at a time. Derived from the installed transformers/torch sources, checked against
the H100 runs in tests/data/calibration (tests/estimate/test_estimate_calibration.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hf_zero.integrations.transformers import attn_implementation
from hf_zero.plan.fused_loss import chunk_tokens

__all__ = ["LayerShape", "describe_layers", "step_bytes", "loss_work_bytes"]

ATTENTION = ("sdpa", "eager", "flash_attention_2")
_QK_NORMS = ("q_norm", "k_norm", "q_layernorm", "k_layernorm")


@dataclass(frozen=True)
class LayerShape:
    """One decoder layer as the activation count needs it, read from the model built on the meta device."""

    hidden: int
    q_dim: int
    kv_dim: int
    heads: int
    intermediate: int
    attn_in: int = 3  # linears reading the attention's input (q, k, v = 3; a fused qkv = 1)
    mlp_in: int = 2  # linears reading the MLP's input (gate + up = 2)
    gated: bool = True
    lora: tuple = ()  # (role, in_features) per LoRA-adapted linear; role: attn_in, attn_out, mlp_in, mlp_out
    lora_r: int = 0
    lora_dropout: float = 0.0
    layer_linear: int = 0  # weight elements of the layer's linears (its autocast copies)
    linear: int = 0  # weight elements of every linear, tied lm_head included
    linear_trainable: int = 0
    lm_head: int = 0
    lm_head_trainable: bool = True
    attn_implementation: str = "sdpa"
    qk_norm: bool = False  # per-head norms of the queries and keys (q_norm, k_norm) inside the attention


def _decoder_layers(module, config_layers: int):
    """The module list of the decoder layers: the one of `config_layers` modules; where several have that length (a
    vision-language model whose vision tower has as many layers as its language model, as the tiny Qwen3-VL's 2 and
    2), the one beside the input embeddings (the language model's), not the first (the vision tower's blocks)."""
    import torch

    lists = [m for m in module.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == config_layers
             and config_layers]
    if len(lists) > 1 and hasattr(module, "get_input_embeddings"):
        embed = module.get_input_embeddings()
        owner = next((m for m in module.modules() if any(c is embed for c in m.children())), None)
        inside = [m for m in lists if owner is not None and any(m is c for c in owner.modules())]
        lists = inside or lists
    return lists[0] if lists else None


def _linears(module, config_layers: int):
    """(path, Linear, LoRA wrapper or None) for the first decoder layer, in registration order."""
    import torch

    layers = _decoder_layers(module, config_layers)
    if layers is None:
        return None, []
    layer = layers[0]
    out = []
    for path, m in layer.named_modules():
        if hasattr(m, "base_layer") and hasattr(m, "lora_A"):  # peft's wrapper: one adapted linear
            out.append((path, m.base_layer, m))
        elif isinstance(m, torch.nn.Linear) and "lora_" not in path and not path.endswith("base_layer"):
            out.append((path, m, None))
    return layer, out


def describe_layers(model, config, text) -> LayerShape | None:
    """The LayerShape of a (meta) model; None when it has no recognisable decoder layers."""
    import torch

    h, layers = getattr(text, "hidden_size", 0), getattr(text, "num_hidden_layers", 0)
    heads = getattr(text, "num_attention_heads", 0)
    if not (h and layers and heads):
        return None
    head_dim = getattr(text, "head_dim", None) or h // heads
    inter = getattr(text, "intermediate_size", None) or getattr(text, "n_inner", None) or 4 * h
    roles = {"attn": [], "mlp": []}
    first, found = _linears(model, layers)
    for path, lin, lora in found:
        roles["attn" if any(k in path for k in ("attn", "attention")) else "mlp"].append((lin, lora))
    lora = tuple((f"{group}_{'out' if k == len(items) - 1 else 'in'}", lin.in_features)
                 for group, items in roles.items() for k, (lin, wrap) in enumerate(items) if wrap is not None)
    lcfg = next(iter(getattr(model, "peft_config", {}).values()), None)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    mlp_in = [lin for lin, _ in roles["mlp"][:-1]]
    return LayerShape(
        hidden=h, q_dim=heads * head_dim, heads=heads,
        kv_dim=(getattr(text, "num_key_value_heads", None) or heads) * head_dim, intermediate=inter,
        attn_in=max(len(roles["attn"]) - 1, 1), mlp_in=max(len(mlp_in), 1),
        gated=sum(lin.out_features for lin in mlp_in) >= 2 * inter if mlp_in else True, lora=lora,
        lora_r=int(getattr(lcfg, "r", 0) or 0), lora_dropout=float(getattr(lcfg, "lora_dropout", 0) or 0),
        layer_linear=sum(m.weight.numel() for m in first.modules() if isinstance(m, torch.nn.Linear)) if first else 0,
        linear=sum(m.weight.numel() for m in linears),
        linear_trainable=sum(m.weight.numel() for m in linears if m.weight.requires_grad),
        lm_head=head.weight.numel() if head is not None else 0,
        lm_head_trainable=bool(head is not None and head.weight.requires_grad),
        attn_implementation=attn_implementation(config) or "sdpa",
        qk_norm=first is not None and any(path.rsplit(".", 1)[-1] in _QK_NORMS for path, _ in first.named_modules()))


def _layer_bytes(ls: LayerShape, mode: str, seq: int, attn: str, full: bool, frozen_inputs: bool = False,
                 liger: bool = False) -> float:
    """Bytes one decoder layer saves for backward, per token; `frozen_inputs`: frozen linears save their input too;
    `liger`: Liger's RMSNorm saves its input (residual dtype) and a per-row rstd instead of the fp32 upcast and the
    normalised output, and its SwiGLU saves gate and up, recomputing the activation in backward (2 e i, not 3 e i).
    Checked on an H100: the 1.1B shape's peak fell by 4,815 MiB with them, this counts 4,752 MiB."""
    e = 4 if mode == "fp32" else 2  # matmuls and attention
    r = 2 if mode == "half" else 4  # residual stream and norm outputs
    h, q, i = ls.hidden, ls.q_dim, ls.intermediate

    def inputs(width: int, role: str, linears: int, low: bool) -> float:
        """Saved inputs of the linears of one role reading one tensor; `low`: that tensor is already 16-bit."""
        base = linears if full or frozen_inputs else 0
        own_casts = mode == "autocast" and not low  # autocast casts a non-leaf fp32 input once per linear
        saved = 2 * width * base if own_casts else (e * width if base else 0)
        shared = bool(base) and not own_casts  # the one shared input is already counted
        for _ in [n for rl, n in ls.lora if rl == role]:
            saved += e * ls.lora_r  # lora_B's input
            if ls.lora_dropout > 0:
                saved += width + e * width  # bool mask + dropout output (its 16-bit cast under autocast)
            elif own_casts or not shared:
                saved, shared = saved + e * width, not own_casts
        return saved

    norm = r * h if liger else 4 * h + (r * h if full else 0)
    if attn == "eager":
        core = 3 * e * q + (6 if e == 2 else 4) * ls.heads * seq
    elif attn == "flash_attention_2":
        core = e * (2 * q + 2 * ls.kv_dim)
    else:  # sdpa; flex and others are counted like it
        core = 4 * e * q + e * seq
    mlp = (3 - liger if ls.gated else 1) * e * i
    qk_norm = (e if liger else 4 + (e if full else 0)) * (q + ls.kv_dim) if ls.qk_norm else 0
    return (2 * norm + qk_norm + inputs(h, "attn_in", ls.attn_in, False) + core + inputs(q, "attn_out", 1, True)
            + inputs(h, "mlp_in", ls.mlp_in, False) + mlp + inputs(i, "mlp_out", 1, True))


def loss_work_bytes(vocab: int, tokens: float) -> float:
    """Of the full-logits loss's 12 V bytes per token in step_bytes' "backward", what autograd does not save: nll's
    and log_softmax's fp32 gradients (8 V), alive only in backward. The other 4 V, log_softmax's fp32 output, is
    saved for backward, so "backward" less this is what hf_zero.estimate.measure.ActivationRecorder measures
    (without gradient checkpointing, autocast copies or sequence parallelism's all-to-all buffers: tests/vlm)."""
    return 8 * vocab * tokens


def step_bytes(ls: LayerShape, layers: int, vocab: int, mode: str, micro: int, seq: int, checkpointing: bool,
               attn: str | None = None, full: bool = True, sp: int = 1, quantized: bool = False,
               frozen_inputs: bool = False, fused_loss: bool = False, liger: bool = False) -> dict:
    """Bytes alive besides model states at each candidate peak of one training step (all tokens of a micro-batch):
    `frozen_inputs`: every linear saves its input, frozen or not, as ZeRO-3's does (LinearFunctionForZeroStage3,
    which zero.Init installs as torch.nn.functional.linear under memory_efficient_linear, DeepSpeed's default:
    its setup_context saves input and weight whatever needs a gradient);
    "backward" (all saved activations + the loss's 12 V per token + autocast copies; with checkpointing the layer
    inputs instead), and with checkpointing "forward" (the loss forward with every cached autocast copy) and
    "recompute" (one layer recomputed; the caller adds the gradients accumulated by then).
    `sp`: Ulysses sequence-parallel ranks. A rank holds seq / sp tokens outside attention and all seq tokens of
    heads / sp heads inside it: both are tokens / sp per rank. Ulysses drops the attention mask (causal kernels
    instead), so sdpa's mask term goes; one layer's all-to-all send and receive buffers of q, k, v and the
    attention output are alive at once (2 e (2 q + 2 kv) per local token).
    `fused_loss` (hf_zero.train.fused_ce, on by default where exact): no full logits. The forward computes the
    gradients for the hidden states (their dtype) and, when lm_head trains, its fp32 weight gradient, and holds one
    chunk's logits at a time (16-bit, fp32 and the fp32 softmax gradient: chunk_tokens keeps a chunk near the
    hidden states' size); backward only scales what is kept."""
    attn = attn or ls.attn_implementation
    tokens = micro * seq / sp
    e, r = (4, 4) if mode == "fp32" else (2, 2 if mode == "half" else 4)
    layer = _layer_bytes(ls, mode, seq if sp == 1 else 0, attn, full, frozen_inputs, liger) * tokens
    a2a = 2 * e * (2 * ls.q_dim + 2 * ls.kv_dim) * tokens if sp > 1 else 0  # transient: one layer's at a time
    head = (4 * ls.hidden + (r * ls.hidden if full else 0)
            + (e * ls.hidden if ls.lm_head_trainable or frozen_inputs else 0)) * tokens
    loss_bwd = 4 * vocab * tokens + loss_work_bytes(vocab, tokens)  # 12 V: saved output + gradients
    loss_fwd = (8 if mode == "fp32" else 10) * vocab * tokens
    if fused_loss:
        chunk = chunk_tokens(math.ceil(tokens), vocab, ls.hidden)
        loss_bwd = loss_fwd = (r * ls.hidden * tokens + (4 * vocab * ls.hidden if ls.lm_head_trainable else 0)
                               + (e + 8) * chunk * vocab)
    casts = 2 if mode == "autocast" else 0  # bytes per weight element of a 16-bit autocast copy
    linear, layer_linear, lm_head = ls.linear, ls.layer_linear, ls.lm_head
    if quantized:  # 4-bit linears are dequantized by bitsandbytes, not autocast (the caller adds that copy); the
        linear, layer_linear, lm_head = ls.linear_trainable, 0, 0  # head is held in 16 bits (embeddings_in_16bit)
    if not checkpointing:
        return {"backward": layers * layer + head + loss_bwd + casts * linear + a2a}
    kept = layers * r * ls.hidden * tokens  # each layer's input
    lm_cast = casts * lm_head
    return {"forward": kept + head + loss_fwd + casts * ls.linear_trainable + (0 if ls.lm_head_trainable else lm_cast),
            "backward": kept + head + loss_bwd + lm_cast,
            "recompute": r * ls.hidden * tokens + layer + casts * layer_linear + a2a}
