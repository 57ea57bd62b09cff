"""`hf-zero export CHECKPOINT --out DIR [--dtype bf16|fp32] [--merge-lora]`: a Hugging Face folder (safetensors,
config, tokenizer) from any checkpoint, ZeRO shards and FSDP2 distributed checkpoints included. CHECKPOINT may be a
run's output_dir: its final/ when the run finished, else its newest complete checkpoint-N, else its final/.

DeepSpeed checkpoints are consolidated from the fp32 master weights in the shards with DeepSpeed's own
zero_to_fp32 reader in lazy mode (memory-mapped shards, one tensor materialised at a time), written one
safetensors shard at a time, so at most one copy of the model is ever in memory; FSDP2 checkpoints are read the same
way, one tensor at a time, with torch.distributed.checkpoint (no process group needed). LoRA checkpoints give the
adapter (or, with --merge-lora, the base model with the adapter merged in, loadable without peft). The folder is
written under a temporary name and renamed when complete.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from hf_zero.checkpoint.final import make_shareable
from hf_zero.checkpoint.fsdp import is_fsdp_checkpoint, lazy_dcp_state
from hf_zero.checkpoint.paths import read_tag
from hf_zero.checkpoint.safe_load import check_checkpoint, safe_checkpoint_loading
from hf_zero.checkpoint.store import MANIFEST_NAME, find_resume_checkpoint, list_checkpoints, validate_checkpoint
from hf_zero.core.console import progress_prints
from hf_zero.core.disk import disk_error
from hf_zero.core.errors import UserError
from hf_zero.core.safetensors_header import verify_safetensors
from hf_zero.data.model_names import hub_model_id, resolve_model_path
from hf_zero.data.vlm import is_vlm_config
from hf_zero.plan.profiles import Profile, with_precision
from hf_zero.plan.quantization import quantization_config

__all__ = ["export_checkpoint", "DTYPES"]

DTYPES = ("fp32", "bf16")
_SHARD_BYTES = 5 << 30
_PARTIAL_MARK = ".hf_zero_export_partial"  # in OUT.partial while an export writes it
_PROCESSOR_FILES = ("tokenizer*", "special_tokens_map.json", "vocab*", "merges.txt", "*.model", "added_tokens.json",
                    "chat_template*", "preprocessor_config.json", "processor_config.json", "generation_config.json")


def _resolve_checkpoint(path: str) -> Path:
    folder = Path(path)
    if not folder.is_dir():
        raise UserError("CHECKPOINT", f"{path} is not a folder", "give a checkpoint-N folder or a run's output_dir")
    if not any((folder / f).is_file() for f in ("trainer_state.json", "config.json", "adapter_config.json")):
        folder = _pick_from_run(folder)
    if (folder / MANIFEST_NAME).is_file() and (problem := validate_checkpoint(folder)):
        raise UserError("CHECKPOINT", f"{folder.name} is damaged: {problem}", "export an earlier checkpoint")
    check_checkpoint(folder)  # with or without a manifest: every pickle loads under the safe loader, or none is read
    if not (folder / "config.json").is_file() and not (folder / "adapter_config.json").is_file():
        raise UserError("CHECKPOINT", f"{folder} has no config.json or adapter_config.json",
                        "give a checkpoint written by the Trainer (checkpoint-N)")
    return folder


def _pick_from_run(run: Path) -> Path:
    """A run's output_dir: the model it finished with, else the newest complete checkpoint, said in one line."""
    final = run / "final"
    finished = (run / "summary.json").is_file() and final.is_dir()
    found = None if finished else find_resume_checkpoint(run)
    if found is not None:
        print(f"[hf_zero] exporting {found}: the newest complete checkpoint in {run}", flush=True)
        return Path(found)
    if final.is_dir():
        why = "the finished run's model" if finished else "no complete checkpoint-N"
        print(f"[hf_zero] exporting {final}: {why}", flush=True)
        return final
    incomplete = f" ({len(list_checkpoints(run))} incomplete)" if list_checkpoints(run) else ""
    raise UserError("export", f"{run} holds no complete checkpoint-N{incomplete} and no final/",
                    "give a checkpoint-N or final/ folder, or the output_dir of a run that saved one")


def _torch_dtype(name: str):
    import torch

    if name not in DTYPES:
        raise UserError("--dtype", f"unknown dtype {name!r}", f"use one of: {', '.join(DTYPES)}")
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[name]


def _is_deepspeed(folder: Path) -> bool:
    tag = read_tag(folder, "latest")  # a folder name inside the checkpoint, or a one-line refusal
    return tag is not None and (folder / tag).is_dir()


def _fresh_partial(tmp: Path) -> None:
    """OUT.partial, made empty and marked as this command's: one an interrupted export left (it holds the mark) is
    removed; anything else there is someone's, and never deleted."""
    if tmp.is_symlink() or (tmp.exists() and not (tmp / _PARTIAL_MARK).is_file()):
        raise UserError("--out", f"{tmp} exists and was not left by hf-zero export; it is where the export is "
                        "written until complete", f"move or remove {tmp}, or choose another --out")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / _PARTIAL_MARK).write_text("an unfinished `hf-zero export`: removed by the next one to the same --out\n")


def _lazy_zero_state(folder: Path, trainable_only: bool) -> dict:
    """name -> lazy tensor from the ZeRO shards; tied parameters appear once (first name, as save_pretrained does)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with progress_prints():  # "Processing zero checkpoint ...", four lines per export
        lazy = get_fp32_state_dict_from_zero_checkpoint(str(folder), exclude_frozen_parameters=trainable_only,
                                                        lazy_mode=True)
    seen, out = set(), {}
    for name, tensor in lazy.items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            out[name] = tensor
    return out


def _write_sharded(lazy: dict, out: Path, dtype) -> int:
    """model.safetensors (or model-0000i-of-0000n.safetensors + index), materialising one shard at a time."""
    from safetensors.torch import save_file

    shards, current, size = [], [], 0
    for name, t in lazy.items():
        nbytes = t.shape.numel() * (dtype.itemsize if t.dtype.is_floating_point else t.dtype.itemsize)
        if current and size + nbytes > _SHARD_BYTES:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    shards.append(current)
    names = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map, total = {}, 0
    for fname, shard_names in zip(names, shards):
        shard = {}
        for name in shard_names:
            t = lazy[name].contiguous()
            shard[name] = t.to(dtype) if t.is_floating_point() else t
            total += shard[name].numel() * shard[name].element_size()
            weight_map[name] = fname
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        del shard
    if len(shards) > 1:
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return len(weight_map)


def _copy_processor_files(src: Path, out: Path) -> None:
    for pattern in _PROCESSOR_FILES:
        for f in src.glob(pattern):
            if f.is_file():
                shutil.copy2(f, out / f.name)


def _export_full(folder: Path, out: Path, dtype) -> int:
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    if _is_deepspeed(folder):
        count = _write_sharded(_lazy_zero_state(folder, trainable_only=False), out, dtype)
    elif is_fsdp_checkpoint(folder):
        count = _write_sharded(lazy_dcp_state(folder), out, dtype)
    else:
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise UserError("CHECKPOINT", f"{folder} holds neither ZeRO shards nor safetensors weights",
                            "give a checkpoint written with save_only_model false")
        count = 0
        for f in files:  # one file in memory at a time
            tensors = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in load_file(str(f)).items()}
            save_file(tensors, str(out / f.name), metadata={"format": "pt"})
            count += len(tensors)
        for index in folder.glob("*.safetensors.index.json"):
            shutil.copy2(index, out / index.name)
    config = AutoConfig.from_pretrained(str(folder))
    config.dtype = dtype
    config.save_pretrained(str(out))
    return count


def _auto_class(task_type: str | None, base_path: str | None = None):
    import transformers

    name = {"CAUSAL_LM": "AutoModelForCausalLM", "SEQ_CLS": "AutoModelForSequenceClassification",
            "TOKEN_CLS": "AutoModelForTokenClassification", "SEQ_2_SEQ_LM": "AutoModelForSeq2SeqLM",
            "QUESTION_ANS": "AutoModelForQuestionAnswering"}.get(task_type or "", "AutoModel")
    config = Path(base_path or "") / "config.json"
    if name == "AutoModelForCausalLM" and config.is_file() and is_vlm_config(json.loads(config.read_text())):
        name = "AutoModelForImageTextToText"  # a vision-language model's adapter (recipes/vlm.py) is a CAUSAL_LM one
    return getattr(transformers, name)


def _quantization(folder: Path):
    """The BitsAndBytesConfig a QLoRA run (load_in_4bit) loaded its base with, from the checkpoint's record (a run's
    final folder: the run's summary.json beside it); None for any other run."""
    for record in (folder / "hf_zero_checkpoint.json", folder.parent / "summary.json"):
        if record.is_file():
            info = json.loads(record.read_text())
            if not (info.get("settings") or {}).get("load_in_4bit"):
                return None
            from hf_zero.plan.arguments import ModelArguments

            return quantization_config(ModelArguments(use_peft=True, load_in_4bit=True),
                                       with_precision(Profile(name="export"), info.get("precision")))
    return None


def _grow_to_tokenizer(base, folder: Path) -> None:
    """Rows for the tokens a chat template added during the run (their embeddings trained with the adapter), as
    peft's AutoPeftModel sizes a base from the adapter folder's tokenizer."""
    if not (folder / "tokenizer_config.json").is_file() or not hasattr(base, "get_input_embeddings"):
        return
    from transformers import AutoTokenizer

    size = len(AutoTokenizer.from_pretrained(str(folder)))
    if size > base.get_input_embeddings().weight.shape[0]:
        base.resize_token_embeddings(size)


def _export_lora(folder: Path, out: Path, dtype, merge: bool, base_model: str | None) -> int:
    import torch
    from peft import LoraConfig, PeftModel, get_peft_model

    config = json.loads((folder / "adapter_config.json").read_text())
    name = base_path = base_model or config.get("base_model_name_or_path")
    try:
        base_path = resolve_model_path(name)  # hf_zero's offline models, by hub id or short name
        verify_safetensors(Path(base_path), "--base-model")
        quantized = _quantization(folder)
        if quantized is None:
            base = _auto_class(config.get("task_type"), base_path).from_pretrained(base_path, dtype=torch.float32)
        else:  # the base the adapter trained on: quantized as in the run, then dequantized to plain linears
            base = _auto_class(config.get("task_type")).from_pretrained(
                base_path, quantization_config=quantized, dtype=quantized.bnb_4bit_compute_dtype)
            base = base.dequantize().to(torch.float32)
    except (OSError, ValueError) as err:
        raise UserError("--base-model", f"cannot load the base model {base_path!r} ({str(err).splitlines()[0][:120]})",
                        "pass --base-model with the folder of the model the adapter was trained on") from None
    # The exported adapter (and its model card) names its base as the checkpoint did, an offline model by its hub id.
    base.name_or_path = base.config.name_or_path = hub_model_id(name)
    _grow_to_tokenizer(base, folder)
    if _is_deepspeed(folder):
        # The adapter from the fp32 master weights in the shards (the checkpoint's adapter file holds the engine's
        # working copy, which differs from them in mixed precision).
        model = get_peft_model(base, LoraConfig.from_pretrained(str(folder)))
        trained = {k: v.contiguous() for k, v in _lazy_zero_state(folder, trainable_only=True).items()}
        result = model.load_state_dict(trained, strict=False)
        wanted = {n for n, p in model.named_parameters() if p.requires_grad}
        if result.unexpected_keys or wanted - set(trained):
            raise UserError("CHECKPOINT", f"the ZeRO shards of {folder.name} do not match the adapter config "
                            f"({len(result.unexpected_keys)} unexpected, {len(wanted - set(trained))} missing)",
                            "export with the hf_zero version that wrote it")
    else:
        model = PeftModel.from_pretrained(base, str(folder))
    if merge:
        merged = model.merge_and_unload().to(dtype)
        merged.save_pretrained(str(out))
        return len(merged.state_dict())
    adapter = [p for n, p in model.named_parameters() if f".{model.active_adapter}." in n]
    for p in adapter:  # only the adapter is written; the base stays as loaded
        p.data = p.data.to(dtype)
    model.save_pretrained(str(out))
    return len(adapter)


def export_checkpoint(checkpoint: str, out: str, dtype: str = "fp32", merge_lora: bool = False,
                      base_model: str | None = None, overwrite: bool = False) -> dict:
    """Write a from_pretrained-loadable folder from `checkpoint`; returns what was written."""
    torch_dtype = _torch_dtype(dtype)
    target = Path(out)
    if target.exists() and (not target.is_dir() or any(target.iterdir())) and not overwrite:
        raise UserError("--out", f"{out} already exists and is not empty", "choose a new folder or pass --overwrite")
    folder = _resolve_checkpoint(checkpoint)
    verify_safetensors(folder, "CHECKPOINT")  # a crafted header: one line, before --out is touched
    is_lora = (folder / "adapter_config.json").is_file()
    if merge_lora and not is_lora:
        raise UserError("--merge-lora", f"{folder.name} is a full-model checkpoint, not a LoRA one",
                        "drop --merge-lora")
    tmp = target.with_name(target.name + ".partial")
    _fresh_partial(tmp)
    try:
        with safe_checkpoint_loading():  # zero_to_fp32 loads the shards with weights_only=False
            if is_lora:
                count = _export_lora(folder, tmp, torch_dtype, merge_lora, base_model)
            else:
                count = _export_full(folder, tmp, torch_dtype)
        _copy_processor_files(folder, tmp)
        (tmp / _PARTIAL_MARK).unlink()
        make_shareable(tmp)
    except BaseException as err:
        # a full or read-only disk, in safetensors' and torch's words too: the one `disk:` line
        failed = disk_error(err, tmp, where=str(target))
        shutil.rmtree(tmp, ignore_errors=True)  # this command's own, made above: a failed export leaves nothing
        if failed is not None:
            raise failed from None
        raise
    if target.exists():
        shutil.rmtree(target) if target.is_dir() else target.unlink()
    os.rename(tmp, target)
    kind = "merged LoRA model" if merge_lora else "LoRA adapter" if is_lora else "full model"
    return {"source": str(folder), "out": str(target), "kind": kind, "tensors": count}
