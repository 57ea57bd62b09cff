"""What each rank really holds during the first optimizer step, written next to the run so `hf-zero estimate` can be
checked against it (`--measure_memory true`, or HF_ZERO_MEASURE_MEMORY=1): `<output_dir>/memory_rank{R}.json`.

Gradients live only for part of a step, and not at the same moment under every strategy: DDP and ZeRO-1 hold whole
`param.grad`s at the end of backward; at the step ZeRO-1/2/3 make a flat fp32 copy of their gradient partition
(the optimizer steps on it) while the partition still exists; ZeRO-3 keeps a partition buffer all run. Inside
the Trainer, accelerate runs DeepSpeed's backward and step as one call, so no callback event falls between them.
`StepPeakRecorder` therefore snapshots `measure_engine_bytes` after every gradient accumulation in
backward, when ZeRO-1/2 free the gradients the flat copy was made from, and just before the innermost torch
optimizer steps; it reports the largest gradient bytes seen, with parameters and optimizer state after the step
(Adam's moments exist only then). ZeRO-3's whole gradients in backward count as "gathered", like its gathered
params: the estimate's transient working layer. So do FSDP2's: its sharded parameters' hooks run after each shard
group's reduce-scatter, and a group whose post-backward waits for the end of backward (the input embeddings, whose
input needs no gradient; in a composed model also the root group, which holds the encoders, projectors and LM head
there) can still hold its whole gradient then: the working set hf_zero.estimate.fsdp counts as "gathered", not as
the sharded gradients.

Activations (`ActivationRecorder`, `<output_dir>/activations_rank{R}.json`, every optimizer step): the bytes autograd
saves for backward in one micro-batch's forward and loss (each storage once, parameters and views of them left
out), the largest micro-batch of each step, with the tokens this rank held (under sequence parallelism its slice of
the sequence).
On a CPU no allocator reports a peak; what autograd saves is the part of the activations that lives from forward to
backward, the part sequence parallelism divides. Not in it: the loss's gradient buffers in backward and transient
work (all-to-all buffers), which the estimate's peak adds, and under gradient checkpointing what torch's checkpoint
keeps (its own saved-tensor hooks take over inside each checkpointed layer).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from transformers import TrainerCallback

from hf_zero.core.console import rank
from hf_zero.core.files import write_json_atomic
from hf_zero.integrations.deepspeed import before_gradients_freed, gradients_freed_as_before
from hf_zero.integrations.torch import viewed_base

__all__ = ["count_parameters", "parameter_numel", "StepPeakRecorder", "MemoryMeasureCallback", "measure_engine_bytes",
           "measure_requested", "read_measurements", "MEASURE_ENV", "ActivationRecorder"]

MEASURE_ENV = "HF_ZERO_MEASURE_MEMORY"
KINDS = ("params", "grads", "optimizer", "gathered_params", "buffers")
WHERE = ("in_backward", "gradients_freed", "before_step")


def measure_requested(flag: bool = False) -> bool:
    return bool(flag) or os.environ.get(MEASURE_ENV, "").lower() in ("1", "true", "yes")


def _optimizer_chain(optimizer) -> list:
    """accelerate's wrapper -> DeepSpeed's ZeRO optimizer -> the torch optimizer, outermost first."""
    chain = []
    while optimizer is not None and all(optimizer is not o for o in chain):
        chain.append(optimizer)
        optimizer = getattr(optimizer, "optimizer", None)
    return chain


class StepPeakRecorder:
    """Per-kind peak bytes at the snapshot points of one step (see the module docstring). Arm it before the step,
    call `result()` after it."""

    def __init__(self, model, optimizer):
        import torch

        self.model, self.optimizer = model, optimizer
        self.peaks = {where: dict.fromkeys(KINDS, 0) for where in WHERE}
        self.handles, self.restore = [], []
        for p in model.parameters():
            if p.requires_grad:
                self.handles.append(p.register_post_accumulate_grad_hook(lambda _: self._snapshot("in_backward")))
        chain = _optimizer_chain(optimizer)
        inner = next((o for o in reversed(chain) if isinstance(o, torch.optim.Optimizer)), None)
        if inner is not None:  # the step pre-hook runs after ZeRO has put the flat gradient copy in place
            self.handles.append(inner.register_step_pre_hook(lambda *_: self._snapshot("before_step")))
        for opt in chain:  # ZeRO-1/2 free the source gradients only once the flat copy exists: look just before
            if before_gradients_freed(opt, lambda: self._snapshot("gradients_freed")):  # integrations/deepspeed.py
                self.restore.append(opt)

    def _snapshot(self, where: str) -> None:
        now = measure_engine_bytes(self.model, optimizer=self.optimizer)
        for kind in KINDS:
            self.peaks[where][kind] = max(self.peaks[where][kind], now[kind])

    def result(self) -> dict:
        """Disarm, and return {"measured": params/grads/optimizer/model_states, "after_step": ..., peaks...}."""

        for handle in self.handles:
            handle.remove()
        for opt in self.restore:
            gradients_freed_as_before(opt)
        self.handles, self.restore = [], []
        after = measure_engine_bytes(self.model, optimizer=self.optimizer)
        grads = max([after["grads"]] + [p["grads"] for p in self.peaks.values()])
        measured = {"params": after["params"], "grads": grads, "optimizer": after["optimizer"]}
        measured["model_states"] = sum(measured.values())
        return {"measured": measured, "after_step": after, **self.peaks}


class ActivationRecorder:
    """Saved-for-backward bytes of each micro-batch (see the module docstring): `begin()` at an optimizer step's
    start, `end(step)` after it; a forward pre-hook on the model starts each micro-batch's count."""

    def __init__(self, model, output_dir):
        import torch

        self.output_dir, self.steps = Path(output_dir), []
        self.hooks = None
        self.seen, self.tokens, self.peak = {}, 0, {"saved_bytes": 0, "tokens": 0}
        self.handle = model.register_forward_pre_hook(self._forward, with_kwargs=True)
        self.torch = torch

    def _close_micro_batch(self) -> None:
        saved = sum(self.seen.values())
        if saved > self.peak["saved_bytes"]:
            self.peak = {"saved_bytes": saved, "tokens": self.tokens}
        self.seen = {}

    def _forward(self, module, args, kwargs):
        if self.hooks is None:  # an evaluation or generation forward: not a training step
            return
        self._close_micro_batch()
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.tokens = int(ids.shape[-1]) if ids is not None else 0

    def _pack(self, t):
        # A weight saved by its matmul is a model state, whether saved as the parameter or as a view of it (a linear
        # saves `weight.t()`, a view of the parameter). Counting the views had added every frozen linear's weight,
        # and every trainable one's, to the activations: 253 KB of the tiny Qwen2-VL's 1.76 MB.
        if not isinstance(t, self.torch.nn.Parameter) and not isinstance(viewed_base(t), self.torch.nn.Parameter):
            storage = t.untyped_storage()
            self.seen[(storage.data_ptr(), str(t.device))] = storage.nbytes()
        return t

    def begin(self) -> None:
        if self.hooks is None:
            self.hooks = self.torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
            self.hooks.__enter__()
        self.seen, self.peak = {}, {"saved_bytes": 0, "tokens": 0}

    def end(self, step: int) -> None:
        if self.hooks is None:
            return
        self.hooks.__exit__(None, None, None)
        self.hooks = None
        self._close_micro_batch()
        self.steps.append({"step": step, **self.peak})
        self.output_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.output_dir / f"activations_rank{rank()}.json", {"rank": rank(), "steps": self.steps})

    def close(self) -> None:
        if self.hooks is not None:
            self.hooks.__exit__(None, None, None)
            self.hooks = None
        self.handle.remove()


class MemoryMeasureCallback(TrainerCallback):
    """Records the first optimizer step of a fresh run on every rank, and every step's activations."""

    def __init__(self, output_dir, world: int):
        self.output_dir, self.world = Path(output_dir), world  # world: the run plan's
        self.recorder = None
        self.activations = None
        self.done = False

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if state.global_step > 0:  # a resumed run has no first step to measure
            self.done = True
        if not self.done:
            self.recorder = StepPeakRecorder(model, optimizer)
        if self.activations is None:
            self.activations = ActivationRecorder(model, self.output_dir)

    def on_step_begin(self, args, state, control, **kwargs):
        if self.activations is not None:
            self.activations.begin()

    def on_train_end(self, args, state, control, **kwargs):
        if self.activations is not None:
            self.activations.close()
            self.activations = None

    def on_step_end(self, args, state, control, **kwargs):
        if self.activations is not None:
            self.activations.end(state.global_step)
        if self.done or self.recorder is None:
            return
        record = {"rank": rank(), "world_size": self.world, "step": state.global_step,
                  **self.recorder.result()}
        self.recorder, self.done = None, True
        self.output_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.output_dir / f"memory_rank{rank()}.json", record)


def read_measurements(output_dir) -> list[dict]:
    """Every rank's record, ordered by rank."""
    files = sorted(Path(output_dir).glob("memory_rank*.json"), key=lambda p: int(p.stem[len("memory_rank"):]))
    return [json.loads(f.read_text()) for f in files]


def _tensors(obj):
    if hasattr(obj, "to_local"):  # an FSDP2 DTensor (parameter, gradient or Adam moment): this rank's shard
        yield obj.to_local()
    elif hasattr(obj, "untyped_storage"):
        yield obj
    elif isinstance(obj, (dict, list, tuple)):
        for v in obj.values() if isinstance(obj, dict) else obj:
            yield from _tensors(v)


def _quantization_constants(holder) -> list:
    """A 4-bit (bitsandbytes) weight's absmax, offset and code tables, and those of its double quantization: held
    beside the packed weight, whole on every rank (by the weight, and by its module, which keeps them when FSDP2
    replaces the weight by a shard)."""
    state = getattr(holder, "quant_state", None)
    nested = getattr(state, "state2", None)
    return [t for s in (state, nested) if s is not None for t in (s.absmax, s.code, getattr(s, "offset", None))
            if t is not None]


def measure_engine_bytes(engine_or_model, optimizer=None) -> dict:
    """Bytes this rank holds now: {"params", "grads", "optimizer"} (+ "gathered_params", "buffers").

    Each storage counts once (a view of a DeepSpeed flat buffer counts the buffer), first-come in this order:
    - params: ZeRO-3 each param's `ds_tensor` (local partition; whole params gathered right now, e.g. persistent
      ones, and their whole gradients in backward, go to "gathered_params"); FSDP2 each DTensor's local shard (the
      plain parameters an unsharded group holds in its place, and their whole gradients in backward, go to
      "gathered_params"); otherwise `param.data` (ZeRO-1/2: views of `bit16_groups_flat`); a 4-bit weight's
      quantization constants.
    - optimizer: fp32 master partitions (`single_partition_of_fp32_groups`, ZeRO-3 `fp32_partitioned_groups_flat`)
      + the torch optimizer's state (Adam's moments exist after the first step).
    - buffers: the IPG reduce buckets (before grads: a param.grad may be a view into one).
    - grads: ZeRO-3 `grad_partitions_flat_buffer` (allocated at init, kept all run); ZeRO-1/2 `averaged_gradients`
      / `grads_in_partition` / masters' `.grad` / `param.grad`, alive only between backward() and step() (ZeRO-1
      holds whole `param.grad`s until the backward epilogue: snapshot from a post-accumulate-grad hook to see them;
      StepPeakRecorder looks at every moment that matters).
    """
    import torch

    module = getattr(engine_or_model, "module", engine_or_model)
    chain, opt = [], optimizer if optimizer is not None else getattr(engine_or_model, "optimizer", None)
    while opt is not None and opt not in chain:
        chain.append(opt)
        opt = getattr(opt, "optimizer", None)
    out = dict.fromkeys(("params", "grads", "optimizer", "gathered_params", "buffers"), 0)
    seen = set()

    def add(kind, *objs):
        for t in _tensors(list(objs)):
            st = t.untyped_storage()
            key = (st.data_ptr(), str(t.device))
            if st.nbytes() and key not in seen:
                seen.add(key)
                out[kind] += st.nbytes()

    def attrs(*names):
        return [getattr(o, n, None) for o in chain for n in names]

    params = list(module.parameters())
    # FSDP2's whole working copies: while a shard group is unsharded its module holds plain parameters in place of
    # the DTensor shards, and in backward their whole gradients until the group's reduce-scatter
    unsharded = [p for p in params if not hasattr(p, "to_local")] if any(hasattr(p, "to_local") for p in params) \
        else []
    add("gathered_params", *[t for p in unsharded for t in (p.data, p.grad)])
    add("params", *[getattr(p, "ds_tensor", p.data) for p in params], *attrs("bit16_groups_flat",
                                                                             "fp16_partitioned_groups_flat"))
    add("params", *[_quantization_constants(x) for x in (*params, *module.modules())])
    # ZeRO-3's whole working copies: gathered params and, in backward, their whole gradients before reduce-scatter
    add("gathered_params", *[t for p in params if hasattr(p, "ds_tensor") for t in (p.data, p.grad)])
    masters = list(_tensors(attrs("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat")))
    add("optimizer", *masters, *[dict(st) for o in chain if isinstance(o, torch.optim.Optimizer)
                                 for st in o.state.values()])
    # Buckets before grads: in backward a param.grad can be a view into the reduce bucket, which is a buffer.
    add("buffers", *[getattr(b, "buffer", None) for d in attrs("ipg_buckets") if isinstance(d, dict)
                     for b in d.values()])
    add("grads", *attrs("grad_partitions_flat_buffer", "averaged_gradients", "grads_in_partition", "all_grad_tensors"),
        *[t.grad for t in masters], *[p.grad for p in params], *[getattr(p, "grad_accum", None) for p in params])
    return out


def parameter_numel(p) -> int:
    # A 4-bit parameter holds two weights a byte; its quant_state has the weight's shape. Under ZeRO-3 a parameter's
    # local tensor is empty; ds_numel is its full size.
    if getattr(p, "quant_state", None) is not None:
        return p.quant_state.shape.numel()
    return getattr(p, "ds_numel", p.numel())


def count_parameters(model) -> tuple[int, int]:
    """(trainable, total) parameters, counted at full size even when partitioned."""
    trainable = total = 0
    for p in model.parameters():
        n = parameter_numel(p)
        total += n
        trainable += n if p.requires_grad else 0
    return trainable, total
