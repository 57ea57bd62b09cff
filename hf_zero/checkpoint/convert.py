"""Carry a checkpoint to another engine: any ZeRO stage <-> FSDP2, through the two formats that already reshard.

DeepSpeed's universal checkpoint (`ds_to_universal`: one folder per parameter, `zero/<name>/{fp32,exp_avg,
exp_avg_sq,step}.pt`, plus `zero/optimizer_state.pt` and the engine's `*model_states.pt`) is what every ZeRO stage
loads on any rank count; torch's distributed checkpoint (`pytorch_model_fsdp_0/`, `optimizer_0/`: the model's and
the optimizer's state dicts keyed by parameter name) is what FSDP2 reshards. Both hold, per parameter, the fp32
weight and both Adam moments, and per group the hyper-parameters; conversion maps one onto the other a parameter at
a time (a distributed checkpoint is written by a planner that reads each tensor from its universal file only when
it is written, and read back one key at a time), so no step holds the model. Everything else in a checkpoint
(scheduler.pt, trainer_state.json, rng_state*.pth, hf_zero_checkpoint.json) is the Trainer's and engine-free, but
for one list: the scheduler keeps a base LR per optimizer group, and DeepSpeed drops an empty group FSDP2 keeps
(train/trainer.py sizes it to the optimizer on resume).

Measured on DeepSpeed 0.19.8 / torch 2.13: a universal checkpoint written from ZeRO-1/2 does not load under ZeRO-3
as it is (ZeRO-3 looks for `zero_pp_rank_0_mp_rank_00_model_states.pt` and takes the Adam step from
`optimizer_state.pt`'s `optimizer_state_dict`), and one written from ZeRO-3 lacks the per-parameter `step.pt` that
ZeRO-1/2 read (without it Adam restarts its bias correction). `complete_universal` adds what each stage reads, so
one universal folder serves every stage.

The conversion is kept inside the checkpoint, where each engine looks (`global_stepN_universal/` + `latest_universal`
for DeepSpeed, `pytorch_model_fsdp_0/` + `optimizer_0/` for FSDP2), written under temporary names first: a second
resume finds it and does not convert again, an interrupted one is redone.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

from hf_zero.checkpoint.fsdp import FSDP_MODEL_DIR
from hf_zero.checkpoint.safe_load import check_checkpoint, safe_checkpoint_loading, safe_load
from hf_zero.checkpoint.store import (
    METADATA_NAME,
    checkpoint_step,
    crc32_of,
    file_sizes,
    read_metadata,
    validate_checkpoint,
    write_json_atomic,
    write_manifest,
)
from hf_zero.core.errors import UserError
from hf_zero.plan.profiles import load_profile

__all__ = ["UNIVERSAL_SUFFIX", "convert_to_universal", "FSDP_OPTIM_DIR", "engine_of",
           "needs_conversion", "converted_for", "convert_in_place",
           "complete_universal", "universal_groups", "universal_to_dcp", "dcp_to_universal", "read_dcp_groups",
           "convert_checkpoint"]

UNIVERSAL_SUFFIX = "_universal"
_REFUSED = "hf-zero: error: checkpoint: "

FSDP_OPTIM_DIR = "optimizer_0"  # accelerate's save_fsdp_optimizer: the optimizer's distributed checkpoint
_MOMENTS = ("exp_avg", "exp_avg_sq")
_MODEL_STATES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")  # ZeRO-1/2, ZeRO-3
# The files of a checkpoint no engine owns: carried as they are by `hf-zero convert`.
_ENGINE_FREE = ("trainer_state.json", "scheduler.pt", "rng_state*.pth", "training_args.bin", "config.json",
                "generation_config.json", "tokenizer*", "special_tokens_map.json", "chat_template*",
                "adapter_config.json", "*.safetensors", "README.md")


def engine_of(meta: dict) -> str:
    """"deepspeed" or "fsdp2" (the two formats that convert), or what else wrote the checkpoint."""
    engine = meta.get("engine") or ("deepspeed" if meta.get("zero_stage") else "")
    return "fsdp2" if engine.startswith("fsdp") else engine


def needs_conversion(meta: dict, target_engine: str) -> str | None:
    """The engine format the checkpoint must be converted to before `target` can load it, or None. A ZeRO stage
    change within DeepSpeed goes through the universal checkpoint like a rank change does (resume.py)."""
    source = engine_of(meta)
    target = "fsdp2" if target_engine.startswith("fsdp") else target_engine
    if source == target or source not in ("deepspeed", "fsdp2") or target not in ("deepspeed", "fsdp2"):
        return None
    return target


def converted_for(checkpoint: Path, target: str) -> bool:
    """Whether a conversion for `target` ("deepspeed" or "fsdp2") is already kept inside the checkpoint."""
    checkpoint = Path(checkpoint)
    if target == "fsdp2":
        return (checkpoint / FSDP_MODEL_DIR / ".complete").is_file() and (checkpoint / FSDP_OPTIM_DIR).is_dir()
    tag = checkpoint / "latest_universal"
    return tag.is_file() and (checkpoint / tag.read_text().strip() / ".complete").is_file()


def convert_in_place(checkpoint: Path, target: str, to_universal) -> None:
    """Convert the checkpoint for `target` inside itself (a no-op when done before). `to_universal` is resume.py's
    convert_to_universal (DeepSpeed's own converter), passed in: resume.py imports this module."""
    checkpoint = Path(checkpoint)
    if converted_for(checkpoint, target):
        return
    meta = read_metadata(checkpoint)
    with safe_checkpoint_loading():
        if target == "fsdp2":
            _replace_dcp(checkpoint, to_universal(checkpoint))
        else:
            _write_universal(checkpoint, checkpoint, meta)


def _replace_dcp(checkpoint: Path, universal: Path) -> None:
    tmp = checkpoint / ".converting_fsdp2"
    shutil.rmtree(tmp, ignore_errors=True)
    universal_to_dcp(universal, tmp, checkpoint)
    for name in (FSDP_OPTIM_DIR, FSDP_MODEL_DIR):  # the model folder last: its .complete marks the conversion done
        shutil.rmtree(checkpoint / name, ignore_errors=True)
        os.rename(tmp / name, checkpoint / name)
    tmp.rmdir()


def _write_universal(source: Path, dest: Path, meta: dict) -> Path:
    """dest/global_stepN_universal from source's distributed checkpoint, `latest_universal` naming it."""
    step = meta.get("global_step", checkpoint_step(source) or 0)
    final = dest / f"global_step{step}_universal"
    tmp = dest / f"global_step{step}_universal.partial"
    for stale in (tmp, final):
        shutil.rmtree(stale, ignore_errors=True)
    dcp_to_universal(source, tmp, step=step, world=meta.get("world_size", 1),
                     global_batch=meta.get("global_batch", 0))
    (tmp / ".complete").write_text("ok\n")
    os.rename(tmp, final)
    (dest / "latest_universal").write_text(final.name)
    return final


# ---------------------------------------------------------------- universal checkpoint

def _model_states(universal: Path) -> dict:
    found = sorted(glob.glob(str(universal / "*model_states.pt")))
    if not found:
        raise UserError("checkpoint", f"{universal} has no *model_states.pt", "convert the checkpoint again")
    return safe_load(found[0])


def _optimizer_state(universal: Path) -> dict:
    return safe_load(universal / "zero" / "optimizer_state.pt")


def _shapes(universal: Path) -> dict:
    """name -> shape of every parameter, trained and frozen (ZeRO-3 stores the tensors flat)."""
    states = _model_states(universal)
    out = {name: shape for group in states["param_shapes"] for name, shape in group.items()}
    out.update(states.get("frozen_param_shapes") or {})
    return out


def universal_groups(universal: Path) -> list[dict]:
    """Per param group: its hyper-parameters, the names of its parameters in order ("names") and its Adam step.
    ZeRO-1/2 record one name list per group; ZeRO-3 one per sub-group, which the inner optimizer's groups list."""
    universal = Path(universal)
    shapes = _model_states(universal)["param_shapes"]
    optim = _optimizer_state(universal)
    inner = optim.get("optimizer_state_dict")
    out = []
    if inner is not None and "state" in inner:  # ZeRO-3: params index the sub-groups
        for group in inner["param_groups"]:
            names = [n for sub in group["params"] for n in shapes[sub]]
            step = inner["state"].get(group["params"][0], {}).get("step") if group["params"] else None
            out.append({**{k: v for k, v in group.items() if k != "params"}, "names": names, "step": step})
        return out
    for index, group in enumerate(optim["param_groups"]):
        names = list(shapes[index])
        step_file = universal / "zero" / names[0] / "step.pt" if names else None
        step = safe_load(step_file) if step_file is not None and step_file.is_file() else None
        out.append({**{k: v for k, v in group.items() if k != "params"}, "names": names, "step": step})
    return out


def complete_universal(universal: Path) -> None:
    """Make a universal folder loadable by every ZeRO stage: the model-states file under both stages' names, the
    Adam step per parameter (ZeRO-1/2) and in optimizer_state.pt's inner state (ZeRO-3). Idempotent."""
    import torch

    universal = Path(universal)
    groups = universal_groups(universal)
    for name in _MODEL_STATES:
        if not (universal / name).is_file():
            shutil.copyfile(sorted(glob.glob(str(universal / "*model_states.pt")))[0], universal / name)
    for group in groups:
        for name in group["names"]:
            step_file = universal / "zero" / name / "step.pt"
            if group["step"] is not None and not step_file.is_file():
                torch.save(_as_step(group["step"]), step_file)
    shapes = _shapes(universal)
    for path in (universal / "zero").glob("*/*.pt"):
        if path.stem in ("fp32", *_MOMENTS) and torch.is_tensor(loaded := safe_load(path)):
            # ZeRO-3's converter saves bare flat tensors, ZeRO-1/2 read {"param": tensor of the parameter's shape}
            _save_replacing({"param": loaded.view(shapes[path.parent.name]), "cat_dim": 0}, path)
    optim = _optimizer_state(universal)
    changed = "ds_version" not in optim  # ZeRO-1/2 refuse a global state without it
    optim.setdefault("ds_version", _ds_version())
    if "optimizer_state_dict" not in optim:
        changed = True
        hyper = [{k: v for k, v in g.items() if k not in ("names", "step")} for g in groups]
        optim = {**optim, "optimizer_state_dict": {
            "state": {i: {"step": _as_step(g["step"])} for i, g in enumerate(groups) if g["step"] is not None},
            "param_groups": [{**h, "params": [i]} for i, h in enumerate(hyper)]}}
    if changed:
        _save_replacing(optim, universal / "zero" / "optimizer_state.pt")


def _save_replacing(obj, path: Path) -> None:
    """torch.save over a file `obj` was memory-mapped from: a new file renamed over it (truncating the mapped
    file in place would pull the data from under the tensors being written)."""
    import torch

    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _ds_version() -> str:
    import deepspeed

    return deepspeed.__version__


def _as_step(step):
    import torch

    return step.detach().clone().float() if torch.is_tensor(step) else torch.tensor(float(step))


# ---------------------------------------------------------------- distributed checkpoint (FSDP2)

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
    shapes = _shapes(universal)
    peft = checkpoint is not None and (Path(checkpoint) / "adapter_config.json").is_file()
    if peft:  # the adapter only: what the optimizer trains
        names = [n for group in groups for n in group["names"]]
    model, model_src = {}, {}
    for name in names:
        key = _adapter_key(name) if peft else name
        model[key] = _meta_like(zero / name / "fp32.pt", shapes.get(name))
        model_src[f"model.{key}"] = _reader(zero / name / "fp32.pt", model[key].shape)
    defaults = _adamw_defaults()
    state, optim_src, param_groups = {}, {}, []
    for group in groups:
        hyper = {**defaults, **{k: v for k, v in group.items() if k not in ("names", "step")}}
        param_groups.append({**hyper, "params": list(group["names"])})
        for name in group["names"]:
            entry = {m: _meta_like(zero / name / f"{m}.pt", shapes.get(name)) for m in _MOMENTS}
            for m in _MOMENTS:
                optim_src[f"optimizer.state.{name}.{m}"] = _reader(zero / name / f"{m}.pt", entry[m].shape)
            entry["step"] = _as_step(group["step"] if group["step"] is not None else 0)
            state[name] = entry
    if len(param_groups) == 1:
        # The Trainer's groups are [weight decay, no weight decay]; DeepSpeed drops an empty one (LoRA trains no
        # norm), FSDP2 keeps it, and its loader pairs groups by position and wants the empty one present.
        param_groups.append({**param_groups[0], "weight_decay": 0.0, "params": []})
    dest.mkdir(parents=True, exist_ok=True)
    _dcp_save({"model": model}, model_src, dest / FSDP_MODEL_DIR)
    _dcp_save({"optimizer": {"state": state, "param_groups": param_groups}}, optim_src, dest / FSDP_OPTIM_DIR)
    (dest / FSDP_MODEL_DIR / ".complete").write_text("ok\n")


def _adapter_key(name: str) -> str:
    """A LoRA parameter's name in peft's state dict: without the adapter's name (get_peft_model_state_dict), e.g.
    `...q_proj.lora_A.default.weight` -> `...q_proj.lora_A.weight`; hf_zero trains peft's "default" adapter."""
    return name.replace(".default.", ".")


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
    names = {name: name if name in model_entries else _adapter_key(name) for name in trained}
    names.update({key: key for key in model_entries if key not in names.values()})  # frozen weights, if saved
    zero = universal / "zero"
    for name, key in names.items():
        meta = model_entries[key]
        (zero / name).mkdir(parents=True, exist_ok=True)
        torch.save({"param": _dcp_tensor(model_dir, f"model.{key}", meta), "cat_dim": 0}, zero / name / "fp32.pt")
        for m in (*_MOMENTS, "step"):
            key = f"optimizer.state.{name}.{m}"
            if key in optim_entries:
                value = _dcp_tensor(optim_dir, key, optim_entries[key])
                torch.save(value if m == "step" else {"param": value, "cat_dim": 0}, zero / name / f"{m}.pt")
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in groups]
    steps = [safe_load(zero / g["params"][0] / "step.pt") if g["params"] else None for g in groups]
    torch.save({"param_groups": [{**h, "params": [i]} for i, h in enumerate(hyper)],
                "optimizer_state_dict": {"state": {i: {"step": _as_step(s)} for i, s in enumerate(steps)
                                                   if s is not None},
                                         "param_groups": [{**h, "params": [i]} for i, h in enumerate(hyper)]},
                "ds_version": deepspeed.__version__}, zero / "optimizer_state.pt")
    shapes = [{n: model_entries[names[n]].size for n in g["params"]} for g in groups]
    states = {"module": None, "buffer_names": [], "optimizer": None, "param_shapes": shapes,
              "frozen_param_shapes": {}, "shared_params": {}, "frozen_param_fragments": {}, "lr_scheduler": None,
              "data_sampler": None, "random_ltd": None, "skipped_steps": 0, "global_steps": step,
              "global_samples": step * global_batch, "dp_world_size": world, "mp_world_size": 1,
              "ds_version": deepspeed.__version__}
    for name in _MODEL_STATES:
        torch.save(states, universal / name)


def _universal_outside(source: Path, work: Path) -> Path:
    """DeepSpeed's universal conversion of `source`, written under `work`: the source checkpoint is only read (a
    view of it, its `latest` and tag folder linked, is what resume.py's converter writes into)."""
    if not (source / "latest").is_file() and converted_for(source, "deepspeed"):  # `hf-zero convert` wrote it
        tag = (source / "latest_universal").read_text().strip()
        shutil.copytree(source / tag, work / ".source" / tag)
        return work / ".source" / tag
    view = work / ".source"
    view.mkdir()
    tag = (source / "latest").read_text().strip()
    for name in ("latest", tag):
        (view / name).symlink_to((source / name).resolve())
    return convert_to_universal(view)


def convert_checkpoint(checkpoint, profile_name: str, out, nproc: int | None = None) -> Path:
    """out/checkpoint-N: the checkpoint in the layout `profile_name` loads on `nproc` ranks without converting
    again (a universal checkpoint for ZeRO, distributed checkpoints for FSDP2), the engine-free files copied."""
    source = Path(checkpoint)
    if not source.is_dir() or not (source / METADATA_NAME).is_file():
        raise UserError("CHECKPOINT", f"{checkpoint} is not an hf_zero checkpoint-N folder",
                        "give a checkpoint-N folder of a run")
    if (problem := validate_checkpoint(source)) is not None:
        raise UserError("CHECKPOINT", f"{source.name} is damaged: {problem}", "convert an earlier checkpoint")
    profile = load_profile(profile_name)
    meta = read_metadata(source)
    written = engine_of(meta)
    if written not in ("deepspeed", "fsdp2"):
        raise UserError("CHECKPOINT", f"{source.name} was written by {meta.get('profile') or written or 'an unknown'} "
                        "profile; only zero and fsdp2 checkpoints convert", "resume it with the profile that wrote it")
    target = "fsdp2" if profile.uses_fsdp else "deepspeed" if profile.uses_deepspeed else None
    if target is None:
        raise UserError("--to", f"{profile.name} keeps no sharded optimizer state to convert to",
                        "pick a zero or fsdp2 profile")
    root = Path(out)
    if root.exists() and any(root.iterdir()):
        raise UserError("--out", f"{out} is not empty", "give a new folder")
    check_checkpoint(source)
    dest = root / source.name
    tmp = root / f".{source.name}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for pattern in _ENGINE_FREE:
        for path in source.glob(pattern):
            if path.is_file():
                shutil.copy2(path, tmp / path.name)
    with safe_checkpoint_loading():
        if target == "fsdp2":
            if written == "fsdp2":
                for name in (FSDP_MODEL_DIR, FSDP_OPTIM_DIR):
                    shutil.copytree(source / name, tmp / name)
                (tmp / FSDP_MODEL_DIR / ".complete").write_text("ok\n")
            else:
                universal_to_dcp(_universal_outside(source, tmp), tmp, source)
        elif written == "fsdp2":
            _write_universal(source, tmp, meta)
        else:
            universal = _universal_outside(source, tmp)
            os.rename(universal, tmp / universal.name)
            (tmp / "latest_universal").write_text(universal.name)
        shutil.rmtree(tmp / ".source", ignore_errors=True)
    world = nproc or meta.get("world_size") or 1
    new_meta = {**meta, "profile": profile.name, "engine": profile.engine,
                "zero_stage": int(profile.zero_stage or 0) if profile.uses_deepspeed else 0, "world_size": world,
                "converted": {"from": meta.get("profile"), "layout": "universal" if target == "deepspeed" else "dcp"}}
    write_json_atomic(tmp / METADATA_NAME, new_meta)
    write_manifest(tmp, {rel: crc32_of(tmp / rel) for rel in file_sizes(tmp)})
    os.rename(tmp, dest)
    return dest

def convert_to_universal(checkpoint: Path) -> Path:
    """DeepSpeed's ds_to_universal into checkpoint/<tag>_universal (where DeepSpeed looks for it), written under a
    temporary name first so an interrupted conversion is redone, never half-used."""
    tag = (checkpoint / "latest").read_text().strip()
    final = checkpoint / f"{tag}{UNIVERSAL_SUFFIX}"
    if (final / ".complete").is_file():
        complete_universal(final)  # one converted before this could load it under another stage
        return final
    tmp = checkpoint / f"{tag}{UNIVERSAL_SUFFIX}.partial"
    for stale in (tmp, final):
        shutil.rmtree(stale, ignore_errors=True)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                            "MASTER_PORT", "LOCAL_WORLD_SIZE")}
    # --inject_missing_state: ZeRO-1/2 checkpoints lack state the converter wants; harmless for ZeRO-3. The
    # converter loads every shard with weights_only=False: it runs under hf_zero's safe loader.
    cmd = [sys.executable, "-m", "hf_zero.checkpoint.safe_load", "deepspeed.checkpoint.ds_to_universal",
           "--input_folder", str(checkpoint / tag), "--output_folder", str(tmp), "--inject_missing_state",
           "--num_extract_workers", "1", "--num_merge_workers", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        last = ([ln for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()] or ["no output"])[-1]
        if last.startswith(_REFUSED):  # the safe loader's one line: passed on as it is
            field, rest = last[len("hf-zero: error: "):].split(": ", 1)
            raise UserError(field, *rest.split("; ", 1))
        raise UserError("resume", f"DeepSpeed could not convert {checkpoint.name} for another number of ranks "
                        f"({last.strip()[:160]})", "resume with the number of processes that wrote it, or "
                        f"`hf-zero export {checkpoint} --out DIR` and start a new run from DIR")
    complete_universal(tmp)
    (tmp / ".complete").write_text("ok\n")
    os.rename(tmp, final)
    (checkpoint / "latest_universal").write_text(final.name)
    return final
