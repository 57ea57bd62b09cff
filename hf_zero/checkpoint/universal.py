"""DeepSpeed's universal checkpoint (`ds_to_universal`): one folder per parameter, `zero/<name>/{fp32,exp_avg,
exp_avg_sq,step}.pt`, plus `zero/optimizer_state.pt` and the engine's `*model_states.pt`; what every ZeRO stage loads
on any rank count. Read here (its groups and shapes) and completed so that one folder serves every stage
(checkpoint/convert.py says what each stage lacks)."""

from __future__ import annotations

import glob
import os
import shutil
from pathlib import Path

from hf_zero.checkpoint.safe_load import safe_load
from hf_zero.core.errors import UserError

__all__ = ["MOMENTS", "MODEL_STATES", "universal_groups", "param_shapes", "complete_universal", "as_step"]

MOMENTS = ("exp_avg", "exp_avg_sq")
MODEL_STATES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")  # ZeRO-1/2, ZeRO-3


def _model_states(universal: Path) -> dict:
    found = sorted(glob.glob(str(universal / "*model_states.pt")))
    if not found:
        raise UserError("checkpoint", f"{universal} has no *model_states.pt", "convert the checkpoint again")
    return safe_load(found[0])


def _optimizer_state(universal: Path) -> dict:
    return safe_load(universal / "zero" / "optimizer_state.pt")


def param_shapes(universal: Path) -> dict:
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
    for name in MODEL_STATES:
        if not (universal / name).is_file():
            shutil.copyfile(sorted(glob.glob(str(universal / "*model_states.pt")))[0], universal / name)
    for group in groups:
        for name in group["names"]:
            step_file = universal / "zero" / name / "step.pt"
            if group["step"] is not None and not step_file.is_file():
                torch.save(as_step(group["step"]), step_file)
    shapes = param_shapes(universal)
    for path in (universal / "zero").glob("*/*.pt"):
        if path.stem in ("fp32", *MOMENTS) and torch.is_tensor(loaded := safe_load(path)):
            # ZeRO-3's converter saves bare flat tensors, ZeRO-1/2 read {"param": tensor of the parameter's shape}
            _save_replacing({"param": loaded.view(shapes[path.parent.name]), "cat_dim": 0}, path)
    optim = _optimizer_state(universal)
    changed = "ds_version" not in optim  # ZeRO-1/2 refuse a global state without it
    optim.setdefault("ds_version", _ds_version())
    if "optimizer_state_dict" not in optim:
        changed = True
        hyper = [{k: v for k, v in g.items() if k not in ("names", "step")} for g in groups]
        optim = {**optim, "optimizer_state_dict": {
            "state": {i: {"step": as_step(g["step"])} for i, g in enumerate(groups) if g["step"] is not None},
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


def as_step(step):
    import torch

    return step.detach().clone().float() if torch.is_tensor(step) else torch.tensor(float(step))
