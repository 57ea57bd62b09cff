"""`hf-zero export` of a composed multimodal model (hf_zero.train.composed): its final/ folder (or the run's
output_dir) written again as one folder that `ComposedModel.from_pretrained` and `hf-zero generate --image/--points`
load, with `--merge-lora` the LLM's LoRA merged into its weights (no peft needed to load it; the encoders and
projectors as trained). Written under OUT.partial and renamed when complete, as every export is.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from hf_zero.checkpoint.safe_load import check_checkpoint
from hf_zero.core.disk import disk_error
from hf_zero.core.errors import UserError
from hf_zero.core.safetensors_header import verify_safetensors
from hf_zero.train.composed import ComposedModel

__all__ = ["export_composed", "refuse_composed_checkpoint"]


def export_composed(folder: Path, out: str, dtype: str = "fp32", merge_lora: bool = False,
                    base_model: str | None = None, overwrite: bool = False) -> dict:
    """Write `folder` (a composed model's folder) to `out`; returns what was written, as export_checkpoint does."""
    import torch
    from transformers import AutoTokenizer


    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    if dtype not in dtypes:
        raise UserError("--dtype", f"unknown dtype {dtype!r}", f"use one of: {', '.join(dtypes)}")
    if base_model is not None:
        raise UserError("--base-model", f"{folder} is a multimodal model, which holds its LLM's weights itself",
                        "drop --base-model")
    target = Path(out)
    if target.exists() and (not target.is_dir() or any(target.iterdir())) and not overwrite:
        raise UserError("--out", f"{out} already exists and is not empty", "choose a new folder or pass --overwrite")
    verify_safetensors(folder, "CHECKPOINT")  # a crafted header: one line, before --out is touched
    check_checkpoint(folder)  # a file linked outside the folder, or a pickle holding code: refused, as for any export
    model = ComposedModel.from_pretrained(folder)
    if merge_lora and not model.uses_lora:
        raise UserError("--merge-lora", f"{folder} trained its LLM without LoRA: there is no adapter to merge",
                        "drop --merge-lora")
    if merge_lora:
        model.llm = model.llm.merge_and_unload()  # peft's merge: W + B @ A x scale, the adapter layers removed
    model.to(dtypes[dtype])
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    tmp = target.with_name(target.name + ".partial")
    if tmp.exists() or tmp.is_symlink():
        raise UserError("--out", f"{tmp} exists; it is where the export is written until complete",
                        f"move or remove {tmp}, or choose another --out")
    try:
        model.save_pretrained(tmp, tokenizer)
    except BaseException as err:
        failed = disk_error(err, tmp, where=str(target))  # a full or read-only disk: the one `disk:` line
        shutil.rmtree(tmp, ignore_errors=True)
        if failed is not None:
            raise failed from None
        raise
    if target.exists():
        shutil.rmtree(target) if target.is_dir() else target.unlink()
    tmp.rename(target)
    kind = "multimodal model, LoRA merged" if merge_lora else "multimodal model"
    return {"source": str(folder), "out": str(target), "kind": kind, "tensors": len(model.state_dict())}


def refuse_composed_checkpoint(path: str) -> None:
    """One line for a multimodal run's checkpoint-N (its model.safetensors holds encoders and projectors, and no
    composed_config.json is beside it), which the text export would call a folder without config.json."""
    from safetensors import safe_open

    weights = Path(path) / "model.safetensors"
    if (Path(path) / "config.json").is_file() or not weights.is_file():
        return
    try:
        with safe_open(str(weights), "pt") as f:
            composed = any(k.startswith(("encoders.", "projectors.")) for k in f.keys())
    except Exception:  # a damaged or crafted file: the export's own header check says so in its words
        return
    if composed:
        raise UserError("CHECKPOINT", f"{path} is a checkpoint of a multimodal run: it holds the weights but not the "
                        "composed model's config", "export the run's final/ folder (or its output_dir once the run "
                        "finished), or resume the run to its end")
