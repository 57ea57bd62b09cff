"""torch's distributed checkpoint, as FSDP2 saves and reshards it (`pytorch_model_fsdp_0/`, `optimizer_0/`: the
model's and the optimizer's state dicts keyed by parameter name), to and from DeepSpeed's universal checkpoint
(checkpoint/universal.py), a parameter at a time: written by a planner that reads each tensor from its universal
file only when it is written, read back one key at a time, so no step holds the model."""

from __future__ import annotations

import warnings
from pathlib import Path

from hf_zero.checkpoint.fsdp import FSDP_MODEL_DIR, adapter_state_key
from hf_zero.checkpoint.safe_load import safe_load
from hf_zero.checkpoint.universal import MODEL_STATES, MOMENTS, as_step, param_shapes, universal_groups

__all__ = ["FSDP_OPTIM_DIR", "universal_to_dcp", "dcp_to_universal", "read_dcp_groups"]

FSDP_OPTIM_DIR = "optimizer_0"  # accelerate's save_fsdp_optimizer: the optimizer's distributed checkpoint


def _adamw_defaults() -> dict:
    """The keys torch's AdamW keeps per group: a distributed checkpoint must hold every key the target's optimizer
    has (DeepSpeed's CPU Adam keeps fewer). This run's own values replace them after loading (train/trainer.py)."""
    import torch

    group = torch.optim.AdamW([torch.zeros(1)]).param_groups[0]
    return {k: v for k, v in group.items() if k != "params"}


class _LazyPlanner:
    """A DefaultSavePlanner whose meta tensors are read from their universal file only when written: the writer
    resolves one tensor at a time (torch/distributed/checkpoint/filesystem.py, _SerialCpuLoader)."""

    def __new__(cls, sources: dict):
        from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

        class Planner(DefaultSavePlanner):
            def resolve_data(self, write_item):
                read = sources.get(write_item.index.fqn)
                return read() if read is not None else super().resolve_data(write_item)

        return Planner()


def _dcp_save(state: dict, sources: dict, folder: Path) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # "torch.distributed is disabled ... assuming a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(folder)), planner=_LazyPlanner(sources),
                 no_dist=True)


def universal_to_dcp(universal: Path, dest: Path, checkpoint: Path | None = None) -> None:
    """dest/pytorch_model_fsdp_0 (fp32 weights) and dest/optimizer_0 (both Adam moments, step, param groups), in
    the layout accelerate's FSDP2 save writes: {"model": {name: tensor}} and {"optimizer": {"state": {name: {...}},
    "param_groups": [{..., "params": [names]}]}}. For a LoRA `checkpoint` the model part is the adapter alone, named
    as peft's state dict names it (the Trainer saves and loads FSDP2 adapters that way)."""
    universal, dest = Path(universal), Path(dest)
    groups = universal_groups(universal)
    zero = universal / "zero"
    # Every parameter folder gives a weight (ZeRO-1/2 universal checkpoints also hold LoRA's frozen base weights).
    names = sorted(p.name for p in zero.iterdir() if (p / "fp32.pt").is_file())
    shapes = param_shapes(universal)
    peft = checkpoint is not None and (Path(checkpoint) / "adapter_config.json").is_file()
    if peft:  # the adapter only: what the optimizer trains
        names = [n for group in groups for n in group["names"]]
    model, model_src = {}, {}
    for name in names:
        key = adapter_state_key(name) if peft else name
        model[key] = _meta_like(zero / name / "fp32.pt", shapes.get(name))
        model_src[f"model.{key}"] = _reader(zero / name / "fp32.pt", model[key].shape)
    if not peft and checkpoint is not None:
        _frozen_from_weights(Path(checkpoint), set(shapes) - set(names), model, model_src)
    defaults = _adamw_defaults()
    state, optim_src, param_groups = {}, {}, []
    for group in groups:
        hyper = {**defaults, **{k: v for k, v in group.items() if k not in ("names", "step")}}
        param_groups.append({**hyper, "params": list(group["names"])})
        for name in group["names"]:
            entry = {m: _meta_like(zero / name / f"{m}.pt", shapes.get(name)) for m in MOMENTS}
            for m in MOMENTS:
                optim_src[f"optimizer.state.{name}.{m}"] = _reader(zero / name / f"{m}.pt", entry[m].shape)
            entry["step"] = as_step(group["step"] if group["step"] is not None else 0)
            state[name] = entry
    if len(param_groups) == 1:
        # The Trainer's groups are [weight decay, no weight decay]; DeepSpeed drops an empty one (LoRA trains no
        # norm), FSDP2 keeps it, and its loader pairs groups by position and wants the empty one present.
        param_groups.append({**param_groups[0], "weight_decay": 0.0, "params": []})
    dest.mkdir(parents=True, exist_ok=True)
    _dcp_save({"model": model}, model_src, dest / FSDP_MODEL_DIR)
    _dcp_save({"optimizer": {"state": state, "param_groups": param_groups}}, optim_src, dest / FSDP_OPTIM_DIR)
    (dest / FSDP_MODEL_DIR / ".complete").write_text("ok\n")


def _frozen_from_weights(checkpoint: Path, frozen: set, model: dict, sources: dict) -> None:
    """The frozen weights of a full model that is not a peft model (a composed multimodal model: its LLM's base
    under LoRA), which a ZeRO-3 universal checkpoint leaves out (no optimizer state, no parameter folder) and FSDP2's
    loader wants with the rest: read from the checkpoint's gathered model.safetensors."""
    weights = checkpoint / "model.safetensors"
    if not frozen or not weights.is_file():
        return
    import torch
    from safetensors import safe_open

    with safe_open(str(weights), "pt") as f:
        for name in sorted(frozen & set(f.keys())):
            shape = f.get_slice(name).get_shape()
            model[name] = torch.empty(shape, dtype=torch.float32, device="meta")
            sources[f"model.{name}"] = (lambda n=name: _safetensors_tensor(weights, n))


def _safetensors_tensor(path: Path, name: str):
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return f.get_tensor(name).float().contiguous()


def _meta_like(path: Path, shape=None):
    import torch

    tensor = _param(safe_load(path))  # memory-mapped: only the header is read
    return torch.empty(shape if shape is not None else tensor.shape, dtype=torch.float32, device="meta")


def _reader(path: Path, shape):
    def read():
        return _param(safe_load(path)).float().reshape(shape).contiguous().clone()
    return read


def _param(loaded):
    return loaded["param"] if isinstance(loaded, dict) else loaded


def _dcp_entries(folder: Path) -> dict:
    import torch.distributed.checkpoint as dcp

    return dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata


def _dcp_read(folder: Path, values: dict) -> dict:
    """Read only `values`' keys (flat names) of a distributed checkpoint; tensors give the shapes to fill."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(values, storage_reader=dcp.FileSystemReader(str(folder)), no_dist=True)
    return values


def _dcp_tensor(folder: Path, key: str, meta):
    import torch

    return _dcp_read(folder, {key: torch.empty(meta.size, dtype=meta.properties.dtype)})[key]


def read_dcp_groups(folder: Path) -> list[dict]:
    """The optimizer's param groups in a distributed checkpoint: hyper-parameters and "params" (names)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    entries = _dcp_entries(folder)
    keys = [k for k, v in entries.items() if k.startswith("optimizer.param_groups.")
            and isinstance(v, BytesStorageMetadata)]
    values = _dcp_read(folder, {k: None for k in keys})
    groups: dict[int, dict] = {}
    for key, value in values.items():
        index, field = key[len("optimizer.param_groups."):].split(".", 1)
        groups.setdefault(int(index), {})[field] = value
    return [groups[i] for i in sorted(groups)]


def dcp_to_universal(source: Path, universal: Path, step: int, world: int, global_batch: int) -> None:
    """A universal checkpoint (every ZeRO stage's layout, see complete_universal) from a checkpoint's
    distributed checkpoints, one tensor at a time."""
    import deepspeed
    import torch
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    source, universal = Path(source), Path(universal)
    model_dir, optim_dir = source / FSDP_MODEL_DIR, source / FSDP_OPTIM_DIR
    model_entries = {k[len("model."):]: v for k, v in _dcp_entries(model_dir).items()
                     if k.startswith("model.") and isinstance(v, TensorStorageMetadata)}
    optim_entries = _dcp_entries(optim_dir)
    groups = [g for g in read_dcp_groups(optim_dir) if g["params"]]  # DeepSpeed keeps no empty group
    # The parameters' names are the optimizer's (the model's own); a LoRA model part is keyed as peft names it.
    trained = {n for g in groups for n in g["params"]}
    names = {name: name if name in model_entries else adapter_state_key(name) for name in trained}
    names.update({key: key for key in model_entries if key not in names.values()})  # frozen weights, if saved
    zero = universal / "zero"
    for name, key in names.items():
        meta = model_entries[key]
        (zero / name).mkdir(parents=True, exist_ok=True)
        torch.save({"param": _dcp_tensor(model_dir, f"model.{key}", meta), "cat_dim": 0}, zero / name / "fp32.pt")
        for m in (*MOMENTS, "step"):
            key = f"optimizer.state.{name}.{m}"
            if key in optim_entries:
                value = _dcp_tensor(optim_dir, key, optim_entries[key])
                torch.save(value if m == "step" else {"param": value, "cat_dim": 0}, zero / name / f"{m}.pt")
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in groups]
    steps = [safe_load(zero / g["params"][0] / "step.pt") if g["params"] else None for g in groups]
    torch.save({"param_groups": [{**h, "params": [i]} for i, h in enumerate(hyper)],
                "optimizer_state_dict": {"state": {i: {"step": as_step(s)} for i, s in enumerate(steps)
                                                   if s is not None},
                                         "param_groups": [{**h, "params": [i]} for i, h in enumerate(hyper)]},
                "ds_version": deepspeed.__version__}, zero / "optimizer_state.pt")
    shapes = [{n: model_entries[names[n]].size for n in g["params"]} for g in groups]
    states = {"module": None, "buffer_names": [], "optimizer": None, "param_shapes": shapes,
              "frozen_param_shapes": {}, "shared_params": {}, "frozen_param_fragments": {}, "lr_scheduler": None,
              "data_sampler": None, "random_ltd": None, "skipped_steps": 0, "global_steps": step,
              "global_samples": step * global_batch, "dp_world_size": world, "mp_world_size": 1,
              "ds_version": deepspeed.__version__}
    for name in MODEL_STATES:
        torch.save(states, universal / name)
