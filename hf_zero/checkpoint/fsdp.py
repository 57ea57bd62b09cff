"""FSDP2 checkpoints and final models: the Trainer's own FSDP2 checkpoints are torch distributed checkpoints
(`pytorch_model_fsdp_0/`, `optimizer_0/`) that reshard on load, so a run may resume on another number of ranks
without conversion; a Hugging Face folder is written from the sharded model (full weights, or only the adapter for
LoRA) without any rank holding more than it must, and an export reads a checkpoint one tensor at a time.
"""

from __future__ import annotations

from pathlib import Path

from hf_zero.plan.fsdp import meta_model

__all__ = ["FSDP_MODEL_DIR", "is_fsdp_checkpoint", "full_tensor", "gathered_state_dict", "tied_copies",
           "save_pretrained_gathered", "lazy_dcp_state", "adapter_state_key"]

FSDP_MODEL_DIR = "pytorch_model_fsdp_0"  # where accelerate's save_fsdp_model puts the model's distributed checkpoint


def is_fsdp_checkpoint(folder) -> bool:
    return (Path(folder) / FSDP_MODEL_DIR).is_dir()


def adapter_state_key(param_name: str) -> str:
    """A peft model's parameter as peft's state dict names it (get_peft_model_state_dict), which the adapter files
    and FSDP2's adapter checkpoints use: without the adapter's name (`...q_proj.lora_A.default.weight` ->
    `...q_proj.lora_A.weight`), and a whole module trained as modules_to_save (a classifier head, a VLM's projector)
    under the module's own name (`...merger.modules_to_save.default.mlp.0.weight` -> `...merger.mlp.0.weight`).
    hf_zero trains peft's "default" adapter."""
    return param_name.replace(".modules_to_save.default.", ".").replace(".default.", ".")


def full_tensor(tensor):
    """The whole tensor of an FSDP2 shard (a DTensor; a collective: every rank must call it), or the tensor itself."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def gathered_state_dict(model, trainable_only: bool) -> dict:
    """The whole state dict on rank 0 (CPU), {} elsewhere; collective. `trainable_only` (LoRA) gathers only the
    adapter, so no rank ever assembles the frozen base model."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=trainable_only)
    return get_model_state_dict(model, options=options)


def tied_copies(model) -> set[str]:
    """Names under which a parameter appears a second time (tied input and output embeddings): the gathered state
    dict holds them as separate tensors, so they are dropped, as save_pretrained does; from_pretrained ties again."""
    first, out = {}, set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if first.setdefault(id(param), name) != name:
            out.add(name)
    return out


def save_pretrained_gathered(trainer, folder, weights: bool = True) -> None:
    """A from_pretrained-loadable folder from the sharded model: config and tokenizer always; with `weights`, the
    gathered full model (LoRA: the adapter only). Collective: every rank calls it, rank 0 writes."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    peft = hasattr(model, "peft_config")
    state = gathered_state_dict(model, trainable_only=peft) if (weights or peft) else {}
    for name in tied_copies(model):
        state.pop(name, None)
    if trainer.args.should_save:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        if weights or peft:
            # PeftModel.save_pretrained keeps only the adapter's keys of the state dict it is given.
            model.save_pretrained(str(folder), state_dict=state, safe_serialization=True)
        if not peft:
            model.config.save_pretrained(str(folder))
        if trainer.processing_class is not None:
            trainer.processing_class.save_pretrained(str(folder))
    trainer.accelerator.wait_for_everyone()


class _DcpTensor:
    """One tensor of a distributed checkpoint, read from disk only when asked for (`contiguous()`), so an export
    holds at most the shard it is writing."""

    def __init__(self, folder: str, key: str, meta):
        self.folder, self.key = folder, key
        self.shape, self.dtype = meta.size, meta.properties.dtype

    def contiguous(self):
        import warnings

        import torch
        import torch.distributed.checkpoint as dcp

        box = {self.key: torch.empty(self.shape, dtype=self.dtype)}
        with warnings.catch_warnings():  # "torch.distributed is disabled ... assuming ... a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(box, storage_reader=dcp.FileSystemReader(self.folder), no_dist=True)
        return box[self.key]


def lazy_dcp_state(checkpoint) -> dict:
    """name -> lazily read tensor of the model in an FSDP2 checkpoint, named as in the model's own state dict
    (accelerate saves it under a top-level "model" key)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    folder = str(Path(checkpoint) / FSDP_MODEL_DIR)
    entries = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
    tied = tied_copies(meta_model(_config_of(checkpoint), head=True))
    return {name: _DcpTensor(folder, key, meta) for key, meta in entries.items()
            if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)
            and (name := key.split(".", 1)[1]) not in tied}


def _config_of(folder):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(folder))
