"""What `hf-zero bench` reads from every rank of a run (HF_ZERO_BENCH=1): the wall time at which each optimizer step
begins and ends, peak memory, and DDP's gradient buckets. Written to `<output_dir>/bench_rank{R}.json` when
training ends. benchmarks/plain_trainer.py records the same fields with its own copy of this callback.

Wall-clock (`time.time()`) rather than a per-process clock: bench computes start-up time as the first step's begin
minus the moment it launched the run, across processes. Peak memory is the process's peak RSS (what a CPU run
costs) and, on GPUs, the device's peak allocation.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from transformers import TrainerCallback

from hf_zero.core import startup
from hf_zero.core.console import rank
from hf_zero.core.files import write_json_atomic
from hf_zero.integrations.torch import ddp_logging_data
from hf_zero.integrations.transformers import attn_implementation

__all__ = ["BENCH_ENV", "bench_requested", "BenchProbeCallback", "StartupCallback", "ddp_bucket_bytes", "peak_memory",
           "training_fingerprint"]

BENCH_ENV = "HF_ZERO_BENCH"


def bench_requested() -> bool:
    return os.environ.get(BENCH_ENV, "").lower() in ("1", "true", "yes")


def ddp_bucket_bytes(wrapped) -> int:
    """Bytes of DDP's gradient buckets: a second copy of every gradient unless gradient_as_bucket_view is on."""
    data = ddp_logging_data(wrapped)
    if data is None:
        return 0
    if int(data.get("gradient_as_bucket_view", 0)):
        return 0  # the gradients are views into the buckets: one copy, already counted as gradients
    return sum(int(b) for b in str(data.get("bucket_sizes", "")).split(",") if b.strip())


def training_fingerprint(trainer) -> dict:
    """What was trained, as the engine holds it after step 1 (weights' dtype, trainable count, attention, precision,
    launcher's world and threads): `hf-zero bench` refuses to compare an hf_zero run with a baseline that differs here.
    benchmarks/plain_trainer.py computes the same dict with its own copy (it imports no hf_zero code)."""
    import torch

    params = [p for p in trainer.model_wrapped.parameters() if p.requires_grad]
    state = trainer.accelerator.state
    return {"param_dtype": str(params[0].dtype) if params else None,
            "trainable_params": sum(getattr(p, "ds_numel", p.numel()) for p in params),
            "attn_implementation": attn_implementation(trainer.model.config),
            "distributed_type": str(state.distributed_type), "mixed_precision": str(state.mixed_precision),
            "world_size": state.num_processes, "torch_threads": torch.get_num_threads()}


def peak_memory() -> dict:
    import resource

    import torch

    out = {"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "device_peak_bytes": None}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["device_peak_bytes"] = int(torch.cuda.max_memory_allocated())
    return out


class BenchProbeCallback(TrainerCallback):
    def __init__(self, output_dir, world: int, trainer=None):
        self.output_dir, self.world, self.trainer = Path(output_dir), world, trainer  # world: the run plan's
        self.begin, self.end, self.buckets, self.fingerprint = [], [], 0, {}

    def on_step_begin(self, args, state, control, **kwargs):
        self.begin.append(time.time())

    def on_step_end(self, args, state, control, **kwargs):
        self.end.append(time.time())
        if len(self.end) == 1 and self.trainer is not None:
            self.buckets = ddp_bucket_bytes(self.trainer.model_wrapped)
            self.fingerprint = training_fingerprint(self.trainer)

    def on_train_end(self, args, state, control, **kwargs):
        import psutil

        record = {"rank": rank(), "world_size": self.world,
                  "process_start": psutil.Process().create_time(), "step_begin": self.begin,
                  "step_end": self.end, "train_end": time.time(), "ddp_bucket_bytes": self.buckets, **peak_memory(),
                  "fingerprint": self.fingerprint, "t0": startup.t0(), "startup_phases": startup.phases()}
        self.output_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.output_dir / f"bench_rank{rank()}.json", record)


class StartupCallback(TrainerCallback):
    """Start-up ends where the first optimizer step begins (hf_zero.core.startup): the heartbeat stops there, and
    the engine's set-up inside train() is told apart from the wait for the first batch."""

    def on_train_begin(self, args, state, control, **kwargs):
        startup.phase("evaluating before training" if args.eval_on_start else "loading the first batch")

    def on_step_begin(self, args, state, control, **kwargs):
        if startup.current() is not None:
            startup.finish()
