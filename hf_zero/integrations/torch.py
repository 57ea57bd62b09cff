"""torch's private names hf_zero reads or writes (entries in registry.py). torch itself is imported inside the
functions that need it: this module is loaded by `hf-zero --help`."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

__all__ = ["last_lr", "set_last_lr", "set_default_group_timeout", "batch_norm_base", "printed_class_name",
           "ddp_logging_data", "tensorboard_thread_file", "set_torch_load", "check_dcp_metadata_first",
           "restore_dcp_read_metadata", "forward_replaced", "saved_bytes", "viewed_base"]


def last_lr(scheduler) -> list[float]:
    """The LRs a scheduler last set (what get_last_lr returns), one per param group.

    Reads LRScheduler._last_lr (torch 2.13.0): get_last_lr() returns it, but there is no setter (set_last_lr).
    Can go when LRScheduler offers a public way to re-base a loaded scheduler."""
    return scheduler._last_lr


def set_last_lr(scheduler, values: list[float]) -> None:
    """Make a loaded scheduler report (get_last_lr, the Trainer's logged LR) `values`, as if it had set them itself.

    Writes LRScheduler._last_lr (torch 2.13.0): a resume that changes the stages' LR, or a checkpoint of another
    engine with another number of param groups, re-bases the scheduler after load_state_dict; torch recomputes
    _last_lr only at its next step. Can go with last_lr."""
    scheduler._last_lr = list(values)


def set_default_group_timeout(timeout) -> None:
    """Give the existing default process group `timeout` (a timedelta).

    Calls torch.distributed.distributed_c10d._set_pg_timeout (torch 2.13.0): accelerate creates the CPU (gloo) group
    without a timeout and DeepSpeed ignores its own once a group exists; torch has no public setter. Can go when
    accelerate passes InitProcessGroupKwargs' timeout on its MULTI_CPU path, or torch offers a public setter."""
    from torch.distributed.distributed_c10d import _set_pg_timeout

    _set_pg_timeout(timeout)


def batch_norm_base() -> type:
    """The base class of every BatchNorm variant (BatchNorm1d/2d/3d, SyncBatchNorm, the lazy ones).

    torch.nn.modules.batchnorm._NormBase (torch 2.13.0); can go when torch exports a public base class."""
    import torch

    return torch.nn.modules.batchnorm._NormBase


def printed_class_name(module) -> str:
    """The class name torch prints for `module` (Module._get_name, torch 2.13.0); can go when wrapped models no
    longer need it (type(module).__name__ answers for plain ones)."""
    return module._get_name()


def ddp_logging_data(wrapped) -> dict | None:
    """DDP's own account of `wrapped` (its bucket sizes, gradient_as_bucket_view), None for anything but DDP.

    DistributedDataParallel._get_ddp_logging_data (torch 2.13.0); can go when DDP reports its buckets publicly."""
    get = getattr(wrapped, "_get_ddp_logging_data", None)
    return None if get is None else get()


def tensorboard_thread_file(thread):
    """The file a TensorBoard writer thread was writing (None for any other thread).

    Follows the thread's _record_writer._writer.filename (torch.utils.tensorboard / tensorboard with torch 2.13.0);
    can go when tensorboard names the file in the error its thread raises."""
    return getattr(getattr(getattr(thread, "_record_writer", None), "_writer", None), "filename", None)


def set_torch_load(load) -> None:
    """torch.load (and torch.serialization.load, the same function) is `load` for the whole process.

    checkpoint/safe_load.py sets its weights-only loader (which names the file it refuses) for a resume, an export
    or a conversion, and torch's own back after: DeepSpeed, zero_to_fp32 and DCP call torch.load with
    weights_only=False (torch 2.13.0 honours TORCH_FORCE_WEIGHTS_ONLY_LOAD over it, but names no file). Can go when
    torch's refusal names the file it refuses."""
    import torch

    torch.load = torch.serialization.load = load


_ORIGINAL_READ_METADATA: list = []  # torch's FileSystemReader.read_metadata, kept while it is wrapped


def check_dcp_metadata_first(check) -> None:
    """Until restore_dcp_read_metadata: every FileSystemReader.read_metadata first calls `check(path)` on the
    `.metadata` file it is about to read (when there is one; else torch's own FileNotFoundError, from which it falls
    back from a rank's metadata to the global one).

    Wraps torch.distributed.checkpoint.filesystem.FileSystemReader.read_metadata and reads its private
    _get_metadata_path (torch 2.13.0): DCP unpickles `.metadata` with plain pickle.load, which no weights-only
    switch reaches. Can go when torch reads DCP metadata with a restricted unpickler."""
    from torch.distributed.checkpoint import filesystem

    def read_metadata(self, *args, **kwargs):
        path = Path(self._get_metadata_path(kwargs.get("rank")))
        if path.is_file():
            check(path)
        return _ORIGINAL_READ_METADATA[0](self, *args, **kwargs)

    _ORIGINAL_READ_METADATA.append(filesystem.FileSystemReader.read_metadata)
    filesystem.FileSystemReader.read_metadata = read_metadata


def restore_dcp_read_metadata() -> None:
    from torch.distributed.checkpoint import filesystem

    filesystem.FileSystemReader.read_metadata = _ORIGINAL_READ_METADATA.pop()


@contextmanager
def forward_replaced(module, forward):
    """For the duration, `module(x)` calls `forward(x)` (the module's forward attribute shadows the class's; the
    class's again after). torch 2.13.0's Module.__call__ dispatches to `self.forward`; can go when transformers'
    causal-LM models accept a loss kernel for their head (train/fused_ce.py)."""
    module.forward = forward
    try:
        yield
    finally:
        del module.forward


def viewed_base(t):
    """The tensor whose storage `t` views (`t` itself when it is no view): a saved `weight.t()` is its parameter.
    Reads Tensor._base (torch 2.13.0); can go when torch.Tensor exposes the viewed base publicly."""
    return t._base if t._base is not None else t


def saved_bytes(run, params) -> int:
    """Bytes autograd saves for backward while `run()` runs: each saved storage once (a view is counted by the
    tensor it views), `params` (parameters, which are held anyway) excluded; shapes and dtypes only, so it counts
    on the meta device too (a view's storage through viewed_base)."""
    import torch

    ids, seen, total = {id(p) for p in params}, set(), 0

    def pack(t):
        nonlocal total
        base = viewed_base(t)
        if id(base) not in ids and id(t) not in ids and id(base) not in seen:
            seen.add(id(base))
            total += base.numel() * base.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return total
