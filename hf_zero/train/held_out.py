"""The held-out loss of a causal LM as one number whatever the rank count: the token-weighted mean over the whole
held-out set.

The Trainer's evaluation loop averages one mean per micro-batch, each repeated `per_device_eval_batch_size` times: a
batch of short rows weighs as much as one of long rows, the last, smaller batch as much as a full one, and on several
ranks accelerate completes that last batch with rows from the start of the set (`even_batches`), whose tokens then
count in the batch's mean. The same weights measured 0.3044 on 2 ranks and 0.2826 on 1 (issue 40). Here every row's
summed token loss and its token count are gathered with `gather_for_metrics` (which drops the rows added to even out
the last batch), and `<prefix>_loss` is their ratio. Only `compute_loss` (the forward the Trainer runs anyway) and
`evaluation_loop` (the number it reports) are wrapped; predictions and metrics stay the Trainer's.
"""

from __future__ import annotations

import torch

from hf_zero.data.packing import IGNORE

__all__ = ["HeldOutLossMixin", "row_losses"]


def row_losses(logits: torch.Tensor, labels: torch.Tensor, shifted: bool = False) -> torch.Tensor:
    """(rows x 2) float64: each row's summed cross-entropy over its counted tokens, and how many it counted; as the
    model's own causal-LM loss shifts labels (unless `shifted`) and ignores -100. One row's logits are upcast at a
    time, never the whole batch's."""
    if not shifted:
        labels = torch.nn.functional.pad(labels, (0, 1), value=IGNORE)[..., 1:]
    out = torch.zeros(labels.shape[0], 2, dtype=torch.float64, device=logits.device)
    for i in range(labels.shape[0]):
        target = labels[i].to(logits.device)
        total = torch.nn.functional.cross_entropy(logits[i].float(), target, ignore_index=IGNORE, reduction="sum")
        out[i, 0] = total.double()
        out[i, 1] = (target != IGNORE).sum()
    return out


class HeldOutLossMixin:
    """Mix into a Trainer subclass (first): `eval_loss` (and `eval_<set>_loss`) as the token-weighted mean over the
    whole held-out set, the same on any number of ranks. Models whose outputs are not per-token logits matching
    their labels (a classifier) keep the Trainer's number."""

    _held_out: list | None = None  # [summed loss, tokens] while an evaluation loop runs

    def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None,
                        metric_key_prefix: str = "eval"):
        self._held_out = [0.0, 0]
        try:
            output = super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys,
                                             metric_key_prefix)
            total, tokens = self._held_out
        finally:
            self._held_out = None
        if tokens > 0:
            output.metrics[f"{metric_key_prefix}_loss"] = total / tokens
        return output

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        shifted = "shift_labels" in inputs
        labels = inputs.get("shift_labels", inputs.get("labels"))  # read first: a loss may pop them
        result = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if self._held_out is not None and return_outputs and labels is not None and not model.training:
            logits = getattr(result[1], "logits", None)
            if logits is None and isinstance(result[1], dict):
                logits = result[1].get("logits")
            if logits is not None and logits.dim() == 3 and logits.shape[:2] == labels.shape:
                # Collective on every rank for every batch (each rank runs as many batches): the rows added to
                # even out the last batch are dropped by gather_for_metrics.
                rows = self.accelerator.gather_for_metrics(row_losses(logits.detach(), labels, shifted))
                self._held_out[0] += rows[:, 0].sum().item()
                self._held_out[1] += int(rows[:, 1].sum().item())
        return result
