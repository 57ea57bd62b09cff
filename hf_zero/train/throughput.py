"""Throughput in every logging step (console, TensorBoard, log_history.json and the summary's stage table):
tokens/s over the steps since the last log, and on GPUs model FLOPs utilisation and peak device memory.

Time counts from one optimizer step's end to the next, data loading included; evaluations, checkpoint saves and
logging in between are left out, so a stage-end evaluation does not read as a slow step. Tokens are the Trainer's
own count over all ranks (`include_num_input_tokens_seen: non_padding`, hf_zero's default)."""

from __future__ import annotations

import time
from types import SimpleNamespace

from hf_zero.estimate.flops import device_peak_flops, flops_per_token
from hf_zero.estimate.measure import count_parameters

__all__ = ["throughput_callback"]


def _flops_per_token(model) -> float:
    """The bench's model FLOPs per token without its attention term (12·L·h·s): rows change length from stage to
    stage, so the MFU logged during training is a slight lower bound; `hf-zero bench` reports it with the row
    length."""
    trainable, total = count_parameters(model)
    count = SimpleNamespace(total_params=total, trainable_params=trainable, num_layers=0, hidden_size=0)
    return flops_per_token(count, model.config, seq_len=0)


def throughput_callback(model, precision: str):
    """A callback whose `metrics(state, args)` the Trainer adds to each training log."""
    from transformers import TrainerCallback

    class Throughput(TrainerCallback):
        def __init__(self):
            self.mark = self.tokens = None
            self.busy, self.between = 0.0, False
            self.per_token = _flops_per_token(model)

        def on_train_begin(self, args, state, control, **kwargs):
            self.mark, self.tokens, self.between = time.perf_counter(), state.num_input_tokens_seen, True

        def on_step_begin(self, args, state, control, **kwargs):
            self.between = False

        def on_step_end(self, args, state, control, **kwargs):
            now = time.perf_counter()
            self.busy += now - self.mark
            self.mark, self.between = now, True

        def _skip(self, *args, **kwargs):
            # Time since the step's end went to eval, saving or logging. A log inside a step (another callback's
            # on_step_end before this one: a dpo stage's held-out rewards) is that step's time: resetting the clock
            # there left a step of 0.2 ms, and the console said 6,113,750 tok/s.
            if self.between:
                self.mark = time.perf_counter()

        on_evaluate = on_save = on_log = _skip

        def metrics(self, state, args) -> dict:
            import torch

            out = {}
            seen = state.num_input_tokens_seen
            if seen and self.busy > 0 and self.tokens is not None:
                out["tokens_per_second"] = (seen - self.tokens) / self.busy
            self.busy, self.tokens = 0.0, seen
            if torch.cuda.is_available() and args.device.type == "cuda":
                import torch.distributed as dist

                peak = torch.tensor([float(torch.cuda.max_memory_allocated())], device=args.device)
                if dist.is_available() and dist.is_initialized():
                    dist.all_reduce(peak, op=dist.ReduceOp.MAX)  # every rank logs at the same steps
                out["peak_memory_bytes"] = int(peak.item())
                device_peak = device_peak_flops(torch.cuda.get_device_name(args.device), precision)
                if device_peak and "tokens_per_second" in out:
                    out["mfu"] = out["tokens_per_second"] * self.per_token / (device_peak * args.world_size)
            return out

    return Throughput()
