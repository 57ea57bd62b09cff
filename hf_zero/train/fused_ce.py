"""Causal-LM cross-entropy without the full logits (`fused_cross_entropy`).

The standard loss builds logits for every token (tokens x vocabulary), upcasts them to fp32 and keeps the fp32
log-softmax for backward: with a 152k vocabulary that is the largest tensor of a step. Here the loss and its
gradients (w.r.t. the hidden states, the lm_head weight and bias) are computed chunk by chunk over tokens during the
forward; the chunk's logits are freed at once and the gradients wait for backward, which only scales them. On CUDA
with liger-kernel installed, Liger's Triton kernel does the same; elsewhere `ChunkedLinearCrossEntropy` (PyTorch).

Why the loss is computed inside the lm_head's own call (its forward swapped for one training forward) rather than by
calling the decoder and then the head: the model still runs through its wrapper (the DeepSpeed engine's and DDP's
forward and backward hooks see one ordinary forward), and under ZeRO-3 the head's weight is whole exactly while its
module runs (DeepSpeed gathers it before the call and again before its backward, and partitions it after).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch.autograd.function import once_differentiable

from hf_zero.core.errors import UserError
from hf_zero.data.packing import IGNORE
from hf_zero.integrations.torch import forward_replaced, printed_class_name
from hf_zero.plan.fused_loss import chunk_tokens, config_problem

__all__ = ["ChunkedLinearCrossEntropy", "FusedCrossEntropyMixin", "plan_fused_head", "chunk_tokens",
           "linear_cross_entropy", "shifted_targets", "loss_in_head"]



class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """sum over tokens of CE(hidden @ weight.T + bias, target) / denom, targets == -100 ignored; logits in fp32."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, denom, chunk: int):
        want_h, want_w, want_b = ctx.needs_input_grad[:3]
        want_grad = want_h or want_w or want_b
        # Logits and accumulators in (at least) fp32, as ForCausalLMLoss upcasts: the chunks' contributions to the
        # weight gradient are then summed as precisely as the unfused path's one big matmul sums them.
        acc = torch.promote_types(weight.dtype, torch.float32)
        grad_h = torch.empty_like(hidden) if want_h else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if want_w else None
        grad_b = torch.zeros(bias.shape, dtype=acc, device=bias.device) if want_b else None
        total = torch.zeros((), dtype=acc, device=hidden.device)
        scale = 1.0 / torch.as_tensor(denom, dtype=acc, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk):
            h, t = hidden[start:start + chunk], targets[start:start + chunk]
            logits = torch.nn.functional.linear(h, weight, bias).to(acc)
            valid = t != IGNORE
            safe = torch.where(valid, t, 0)[:, None]
            lse = torch.logsumexp(logits, dim=-1)
            total += torch.where(valid, lse - logits.gather(1, safe)[:, 0], 0.0).sum()
            if not want_grad:
                continue
            # d loss / d logits = (softmax - one_hot) / denom on counted tokens, 0 on ignored ones; in place.
            g = logits.sub_(lse[:, None]).exp_()
            g.scatter_add_(1, safe, torch.full_like(safe, -1, dtype=g.dtype))
            g.mul_((valid * scale)[:, None])
            if want_b:
                grad_b += g.sum(0)
            g = g.to(h.dtype)
            if want_h:
                grad_h[start:start + chunk] = g @ weight
            if want_w:
                # the chunk's operands upcast (small), never the product: a vocabulary x hidden temporary in bf16,
                # added into fp32, would cost another fp32 copy of it (measured on CPU). On a GPU this matmul is
                # then fp32: liger-kernel's path is the fast one there.
                grad_w.addmm_(g.t().to(acc), h.to(acc))
        # Kept until backward in the parameters' own dtype (half the bytes of the accumulator for bf16 weights).
        ctx.grads = (grad_h, None if grad_w is None else grad_w.to(weight.dtype),
                     None if grad_b is None else grad_b.to(bias.dtype))
        return total * scale

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        # Scaled in place (as Liger does): no second copy of a vocabulary-sized gradient. So the graph can be
        # backpropagated once only (the Trainer never does it twice); a second time is an error, not wrong gradients.
        grads, ctx.grads = ctx.grads, None
        if grads is None:
            raise RuntimeError("fused cross-entropy: backward ran twice through one forward; "
                               "set fused_cross_entropy: false")
        return (*(None if g is None else g.mul_(grad_loss.to(g.dtype)) for g in grads), None, None, None)


def _liger_kernel():
    """Liger's fused linear cross-entropy, or None where it cannot run (no CUDA, liger-kernel or Triton)."""
    if not torch.cuda.is_available():
        return None
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
    except ImportError:
        return None
    return liger_fused_linear_cross_entropy


def linear_cross_entropy(hidden, weight, bias, targets, denom, chunk: int | None = None):
    """The loss of `hidden` (tokens x hidden) through a linear head, normalised by `denom`, never holding the logits
    of more than one chunk: Liger's kernel for CUDA tensors when installed, `ChunkedLinearCrossEntropy` otherwise."""
    liger = _liger_kernel() if hidden.is_cuda else None
    if liger is not None:
        import inspect

        # fp32 accumulation of the weight gradient over chunks, as the chunked path does (liger-kernel >= 0.6)
        extra = {"accum_dtype": torch.float32} if "accum_dtype" in inspect.signature(liger).parameters else {}
        return liger(hidden, weight, targets, bias=bias, ignore_index=IGNORE, reduction="sum", **extra) / denom
    chunk = chunk or chunk_tokens(hidden.shape[0], weight.shape[0], weight.shape[1])
    return ChunkedLinearCrossEntropy.apply(hidden, weight, bias, targets, denom, chunk)


def shifted_targets(inputs: dict) -> torch.Tensor:
    """The flat targets of every position, as transformers' ForCausalLMLoss shifts them (the last one ignored)."""
    if "shift_labels" in inputs:
        return inputs["shift_labels"].reshape(-1)
    labels = torch.nn.functional.pad(inputs["labels"], (0, 1), value=IGNORE)
    return labels[..., 1:].reshape(-1)


@contextmanager
def loss_in_head(head, targets, denom):
    """For one forward, `head(hidden)` returns the loss instead of the logits."""

    def forward(hidden):
        hidden = hidden.reshape(-1, hidden.shape[-1])
        return linear_cross_entropy(hidden, head.weight, head.bias, targets.to(hidden.device), denom)

    with forward_replaced(head, forward):  # hf_zero/integrations/torch.py
        yield


def plan_fused_head(model, mode) -> tuple[torch.nn.Module | None, str]:
    """(the lm_head to compute the loss in, or None; why). Raises UserError when `mode` is True but it cannot be."""
    if mode is False:
        return None, "off (fused_cross_entropy: false)"
    from transformers.trainer_utils import unwrap_peft_model

    base = unwrap_peft_model(model)
    config = getattr(base, "config", None)
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if head is None or printed_class_name(base) not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        why = "the model is not a causal LM with an lm_head"
    elif not isinstance(head, torch.nn.Linear):
        why = f"its lm_head is a {type(head).__name__} (LoRA or modules_to_save on lm_head), not a plain Linear"
    elif (problem := config_problem(config, mode)) is not None:
        why = problem
    else:
        kind = "Liger's Triton kernel" if _liger_kernel() is not None else "chunked PyTorch"
        return head, f"on ({kind}): the logits of all tokens never exist at once"
    if mode is True:
        raise UserError("fused_cross_entropy", f"cannot be used: {why}", "set it to auto or false")
    return None, f"standard: {why}"


class FusedCrossEntropyMixin:
    """A Trainer whose training loss is computed without full logits where that is exact (`plan_fused_head`).
    Evaluation keeps the standard path: the Trainer may want the logits there, and nothing is kept for backward."""

    def __init__(self, *args, fused_cross_entropy="auto", **kwargs):
        super().__init__(*args, **kwargs)
        self.fused_head, self.fused_ce_status = plan_fused_head(self.model, fused_cross_entropy)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if (self.fused_head is None or return_outputs or not model.training or "labels" not in inputs
                or self.label_smoother is not None or self.compute_loss_func is not None):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        targets = shifted_targets(inputs)
        # The same normalisation as the model's own loss: by the tokens of the whole accumulated batch when the
        # Trainer passes num_items_in_batch to the model, else the mean over this micro-batch.
        scaled = self.model_accepts_loss_kwargs and num_items_in_batch is not None
        denom = num_items_in_batch if scaled else (targets != IGNORE).sum()
        rest = {k: v for k, v in inputs.items() if k not in ("labels", "shift_labels")}
        with loss_in_head(self.fused_head, targets, denom):
            loss = model(**rest).logits
        if self.args.average_tokens_across_devices and scaled:
            # as Trainer.compute_loss: num_items_in_batch counted the tokens of every rank
            loss = loss * (self.accelerator.num_processes // self.get_tp_size() if self.args.n_gpu <= 1
                           else self.args.n_gpu)
        return loss
