"""Log-probabilities of preference rows' answers (a dpo stage, hf_zero.train.preference): per token in TRL's
`FusedCausalLMOutput`, and per row summed over each answer, computed without gradients in eval mode, each rank its
contiguous share of the rows, the shares gathered so every rank holds the whole table (row i at position i)."""

from __future__ import annotations

import torch

from hf_zero.data.packing import IGNORE
from hf_zero.data.preference import PREFERENCE_KEYS

__all__ = ["sequence_outputs", "answer_labels", "share", "answer_logps", "reference_logps"]


def sequence_outputs(model, input_ids, attention_mask, labels):
    """Per-token log-probabilities of `labels` (shifted; 0 where -100) and what DPOTrainer logs beside them, in TRL's
    `FusedCausalLMOutput` (what `add_fused_lm_head` gives it). Full logits: a preference batch is not fused yet."""
    from trl.trainer.utils import FusedCausalLMOutput

    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits[:, :-1].float()
    targets = labels[:, 1:].to(logits.device)
    mask = targets != IGNORE
    logsm = logits.log_softmax(-1)
    log_probs = logsm.gather(-1, targets.masked_fill(~mask, 0)[..., None])[..., 0].masked_fill(~mask, 0.0)
    with torch.no_grad():
        entropy = -(logsm.exp() * logsm).sum(-1).masked_fill(~mask, 0.0)
        mean_logits = logits.mean(-1).masked_fill(~mask, 0.0)
        is_top1 = (logits.argmax(-1) == targets) & mask
    return FusedCausalLMOutput(log_probs=log_probs, entropy=entropy, mean_logits=mean_logits, is_top1=is_top1,
                               label_mask=mask)


def answer_labels(batch: dict) -> torch.Tensor:
    return batch["input_ids"].masked_fill(batch["completion_mask"] == 0, IGNORE)


def share(n: int, rank: int, world: int) -> tuple[int, int, int]:
    """(start, end, per): the contiguous rows [start, end) of `n` a rank computes, `per` rows on every rank (the
    last shares padded), so the gathered shares hold row i at position i."""
    per = -(-n // world) if n else 0
    return min(n, rank * per), min(n, (rank + 1) * per), per


def answer_logps(model, samples: list[dict], batch_size: int, device, pad_token_id: int,
                 accelerator=None) -> torch.Tensor:
    """(rows, 4) float32: each row's chosen and rejected log-probability (summed over the answer) and the answers'
    token counts, in eval mode, no grad. With `accelerator` on several ranks each rank computes its share of the
    rows (`share`; padded by repeating a row, so every rank runs as many batches) and the shares are gathered."""
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    if not samples:  # the same on every rank: no collective to meet
        return torch.zeros(0, 4)
    world = accelerator.num_processes if accelerator is not None else 1
    rank = accelerator.process_index if accelerator is not None else 0
    start, end, per = share(len(samples), rank, world)
    mine = samples[start:end]
    mine = mine + [mine[-1] if mine else samples[0]] * (per - len(mine))  # padding, dropped below
    collate = DataCollatorForPreference(pad_token_id=pad_token_id)
    out = torch.zeros(per, 4, dtype=torch.float32)
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for first in range(0, per, batch_size):
                chunk = mine[first:first + batch_size]
                batch = {k: v.to(device) for k, v in collate([{k: s[k] for k in PREFERENCE_KEYS}
                                                              for s in chunk]).items()}
                seq = sequence_outputs(model, batch["input_ids"], batch["attention_mask"], answer_labels(batch))
                logps, tokens = seq.log_probs.sum(1).float().cpu(), seq.label_mask.sum(1).float().cpu()
                out[first:first + len(chunk)] = torch.stack([*logps.chunk(2), *tokens.chunk(2)], dim=1)
    finally:
        model.train(training)
    if world > 1:
        out = accelerator.gather(out.to(device)).cpu()
    return out[:len(samples)]


def reference_logps(model, samples: list[dict], batch_size: int, device, pad_token_id: int,
                    accelerator=None) -> torch.Tensor:
    """(rows, 2): each row's chosen and rejected log-probability (summed over the answer); `samples` in `row`
    order from 0; on several ranks each computes its share (answer_logps)."""
    return answer_logps(model, samples, batch_size, device, pad_token_id, accelerator)[:, :2].contiguous()
