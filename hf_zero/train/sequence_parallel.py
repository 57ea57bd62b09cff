"""The Trainer side of Ulysses sequence parallelism (plan/sequence_parallel.py has the profile side).

transformers' Trainer and accelerate do the heavy part: DeepSpeed's UlyssesSPAttentionHF swaps each attention call
for all-to-alls (sequence shards <-> head shards), and UlyssesSPDataLoaderAdapter gathers the micro-batches of the
sp_size ranks of a group and hands every rank its slice of each, one after another. Two things are added here:

- Batches: the adapter needs `position_ids` and a length divisible by sp_size, and it all-gathers the ranks'
  batches, which gloo (the CPU backend) allows only for equal shapes. Each micro-batch is therefore padded at the
  end to the longest in its SP group, rounded up to a multiple of sp_size: labels -100, positions continuing. Under
  causal attention no real token sees the padding, so the loss is that of the unpadded batch.
- Order: accelerate deals micro-batch k to rank k mod world, and the adapter has a group train its ranks'
  micro-batches one after another, so with several data-parallel groups a step would take micro-batches of
  different laid-out steps (and, at a stage end, of two stages). The training set is read in the order that undoes
  this (`sp_sample_order`): each optimizer step trains the samples the curriculum laid out for it, as without SP.
- Loss: the Trainer's own SP loss is a token mean per micro-batch, divided by the accumulation steps; without SP the
  Trainer normalises by the tokens of the whole accumulated batch. Here each rank returns the sum of its tokens'
  losses divided by the tokens of the whole accumulated batch over all ranks, times the world size (DeepSpeed
  averages gradients over the world): the same gradient as without SP, and the same logged loss. The fused loss
  (train/fused_ce.py) computes the rank's sum without full logits.
"""

from __future__ import annotations

import torch

from hf_zero.data.packing import IGNORE
from hf_zero.integrations.accelerate import set_ulysses_attention
from hf_zero.integrations.deepspeed import ulysses_group, ulysses_rank, ulysses_world_size
from hf_zero.integrations.transformers import attn_implementation
from hf_zero.train.fused_ce import loss_in_head

__all__ = ["SequenceParallelMixin", "pad_batch", "sp_enabled", "sp_sample_order", "SpOrderedDataset"]


def sp_enabled(accelerator) -> bool:
    pc = getattr(accelerator, "parallelism_config", None)
    return pc is not None and pc.sp_backend == "deepspeed" and pc.sp_enabled


def pad_batch(batch: dict, width: int) -> dict:
    """The micro-batch padded at the end to `width` tokens: labels IGNORE, position_ids continuing (arange when the
    collator wrote none), attention_mask 0, input_ids and other per-token tensors 0."""
    length = batch["input_ids"].shape[1]
    out = dict(batch)
    if "position_ids" not in out:
        out["position_ids"] = torch.arange(length, device=batch["input_ids"].device).expand_as(batch["input_ids"])
    pad = width - length
    if pad <= 0:
        return out
    for key, value in out.items():
        if not torch.is_tensor(value) or value.dim() < 2 or value.shape[1] != length:
            continue
        if key == "position_ids":
            tail = value[:, -1:] + torch.arange(1, pad + 1, device=value.device)
            out[key] = torch.cat([value, tail], dim=1)
        else:
            fill = IGNORE if key in ("labels", "shift_labels") else 0
            out[key] = torch.nn.functional.pad(value, (0, pad), value=fill)
    return out


def sp_sample_order(micro_batches: int, dp: int, sp: int) -> list[int]:
    """For each position of the sampler's micro-batch sequence, the laid-out micro-batch to read there.

    Rank r receives positions r, r + world, r + 2 world, ... (accelerate's BatchSamplerShard); SP group g holds ranks
    g sp .. g sp + sp - 1 (DeepSpeed's groups) and trains, in each round j, its ranks' micro-batches in rank order.
    So position j world + g sp + p is trained at micro-step j sp + p by group g, and must hold laid-out micro-batch
    (j sp + p) dp + g (micro-step t of the layout is its micro-batches t dp .. t dp + dp - 1). A last partial round
    stays in layout order. The identity for dp = 1."""
    world, full = dp * sp, micro_batches - micro_batches % (dp * sp)
    order = []
    for q in range(micro_batches):
        if q >= full:
            order.append(q)
            continue
        j, rest = divmod(q, world)
        g, p = divmod(rest, sp)
        order.append((j * sp + p) * dp + g)
    return order


class SpOrderedDataset(torch.utils.data.Dataset):
    """The training set read in `sp_sample_order`, micro-batch by micro-batch."""

    def __init__(self, dataset, micro: int, dp: int, sp: int):
        self.dataset, self.micro = dataset, micro
        self.order = sp_sample_order(-(-len(dataset) // micro), dp, sp)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int):
        m, r = divmod(i, self.micro)
        j = self.order[m] * self.micro + r
        return self.dataset[j if j < len(self.dataset) else i]


def _group_adapter(trainer):
    """accelerate's `deepspeed_ulysses_dl_adapter`, with each batch padded to its SP group's longest first, and on a
    resume the micro-steps already trained skipped here: the Trainer's own skip (accelerate's skip_first_batches)
    rebuilds a plain DataLoader from the adapter it is given, which has no dataset, so it is turned off under SP."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter

    class PaddedUlyssesAdapter(UlyssesSPDataLoaderAdapter):
        def refill(self):
            try:
                batch = next(self.iter)
            except StopIteration:
                self.iter = iter(self.dl)
                raise
            width = torch.tensor([batch["input_ids"].shape[1]], dtype=torch.int64, device=self.device)
            torch.distributed.all_reduce(width, op=torch.distributed.ReduceOp.MAX, group=self.sp_group)
            width = -(-int(width.item()) // self.sp_world_size) * self.sp_world_size
            rest, self.iter = self.iter, iter([pad_batch(batch, width)])
            try:
                super().refill()
            finally:
                self.iter = rest

    def adapter(dl, model):
        from accelerate import skip_first_batches

        sp = ulysses_world_size()
        # The curriculum is one epoch: the steps already trained are the first global_step x accumulation micro-steps
        done = trainer.state.global_step * trainer.args.gradient_accumulation_steps if trainer.sp_skip_data else 0
        rounds, within = divmod(done, sp)  # a round: one batch of each rank of the group, one micro-step each
        if rounds:
            dl = skip_first_batches(dl, rounds)
        out = PaddedUlyssesAdapter(dl, sp_rank=ulysses_rank(),
                                   sp_group=ulysses_group(), sp_world_size=sp,
                                   device=model.device)
        for _ in range(within):
            next(out)
        return out

    return adapter


class SequenceParallelMixin:
    """A Trainer under Ulysses (`parallelism_config` with sp_size > 1): padded group batches and a loss normalised
    as without SP. Without SP it changes nothing. Expects FusedCrossEntropyMixin after it (its `fused_head`)."""

    def __init__(self, *args, **kwargs):
        model, targs = kwargs.get("model"), kwargs.get("args")
        pc = getattr(targs, "parallelism_config", None)
        if pc is not None and pc.sp_enabled and model is not None:
            # Ulysses wraps the attention the model really uses (DeepSpeed compares the two names)
            set_ulysses_attention(pc, attn_implementation(model.config))  # hf_zero/integrations/accelerate.py
        if pc is not None and pc.sp_enabled and kwargs.get("train_dataset") is not None:
            kwargs["train_dataset"] = SpOrderedDataset(kwargs["train_dataset"], targs.per_device_train_batch_size,
                                                       targs.world_size // pc.sp_size, pc.sp_size)
        super().__init__(*args, **kwargs)

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        if sp_enabled(self.accelerator):
            # The Trainer asks the accelerator for the adapter after loading a checkpoint's state and preparing the
            # model (trainer.py, train loop); the adapter skips what a resumed run already trained (_group_adapter).
            self.sp_skip_data, self.args.ignore_data_skip = not self.args.ignore_data_skip, True
            self.accelerator.deepspeed_ulysses_dl_adapter = _group_adapter(self)
            self.loss_is_scaled_for_ga = True  # normalised by the accumulated batch's tokens below

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batches, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        if not sp_enabled(self.accelerator) or not batches or "shift_labels" not in batches[0]:
            return batches, num_items
        # Label tokens of the accumulated batch on all ranks: every rank holds a disjoint slice of them.
        count = sum((b["shift_labels"] != IGNORE).sum() for b in batches).to(device=device, dtype=torch.int64)
        torch.distributed.all_reduce(count)
        return batches, count

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if not sp_enabled(self.accelerator) or not model.training or return_outputs or "shift_labels" not in inputs:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        targets = inputs["shift_labels"].reshape(-1)
        rest = {k: v for k, v in inputs.items() if k not in ("labels", "shift_labels")}
        head = getattr(self, "fused_head", None)
        if head is not None:
            with loss_in_head(head, targets, 1):  # the sum over this rank's tokens
                local = model(**rest).logits
        else:
            logits = model(**rest).logits
            local = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                                      targets.to(logits.device), ignore_index=IGNORE, reduction="sum")
        if num_items_in_batch is None:  # a batch not counted by get_batch_samples: this micro-batch over the world
            num_items_in_batch = (targets != IGNORE).sum().to(local.device)
            torch.distributed.all_reduce(num_items_in_batch)
        # Read live, not from the plan: the engine averages gradients over this process group, and x world
        # undoes that average so the step's loss is the global token mean.
        world = torch.distributed.get_world_size()
        return local * world / num_items_in_batch.to(local.device).clamp(min=1)
