"""The final model: written in Hugging Face format by the Trainer, then read back and compared with the engine's
gathered weights, so an empty LoRA adapter or placeholder weights under ZeRO-3 fail loudly
instead of shipping. Under FSDP2 the Trainer writes no weights for a sharded state dict: they are gathered here."""

from __future__ import annotations

from pathlib import Path

from hf_zero.checkpoint.fsdp import adapter_state_key, full_tensor, save_pretrained_gathered
from hf_zero.core.distributed import waiting_for

__all__ = ["save_final_model", "verify_saved_weights", "SavedModelMismatch", "make_shareable", "write_training_args"]


class SavedModelMismatch(RuntimeError):
    pass


def _saved_tensors(folder: Path) -> dict:
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise SavedModelMismatch(f"{folder} holds no .safetensors file")
    tensors = {}
    for f in files:
        tensors.update(load_file(str(f)))
    return tensors


def _file_key(param_name: str, is_peft: bool) -> str:
    return adapter_state_key(param_name) if is_peft else param_name


def verify_saved_weights(model, folder: Path, atol: float = 0.0) -> int:
    """Compare every trainable parameter (all of them for a full model) with the saved file; collective under
    ZeRO-3 and FSDP2, so every rank must call it. Returns the number of tensors checked (on rank 0)."""
    import torch
    import torch.distributed as dist

    is_peft = hasattr(model, "peft_config")
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    saved = _saved_tensors(folder) if rank0 else {}
    if rank0:
        empty = [k for k, t in saved.items() if t.numel() == 0]
        if empty:
            raise SavedModelMismatch(
                f"{folder}: {len(empty)} empty tensors (e.g. {empty[0]}): weights were not gathered")
    checked, problems = 0, []
    for name, param in model.named_parameters():
        if is_peft and not param.requires_grad:
            continue
        if hasattr(param, "ds_id"):
            import deepspeed

            ctx = deepspeed.zero.GatheredParameters([param], modifier_rank=None)
        else:
            import contextlib

            ctx = contextlib.nullcontext()
        with ctx:
            value = full_tensor(param.detach())  # an FSDP2 shard is gathered on every rank
            if not rank0:
                continue
            key = _file_key(name, is_peft)
            if key not in saved:
                key = next((k for k in saved if k.endswith(key.split("base_model.model.", 1)[-1])), None)
            if key is None:
                if is_peft:
                    problems.append(f"{name} missing")
                continue
            got, want = saved[key].float(), value.float().cpu()
            if got.shape != want.shape or not torch.allclose(got, want, atol=atol, rtol=0):
                problems.append(f"{key} differs (shape {tuple(got.shape)} vs {tuple(want.shape)})")
            checked += 1
    if rank0 and (problems or checked == 0):
        raise SavedModelMismatch(f"{folder}: saved weights do not match the trained ones: "
                                 f"{'; '.join(problems[:3]) or 'no tensor could be compared'}")
    return checked


def make_shareable(folder: Path) -> None:
    """Give files written private (safetensors goes through a 0600 temporary file) the permissions any normal
    write gets under the umask, so a team can read the model; files already readable by others are left alone."""
    import os

    mask = os.umask(0)
    os.umask(mask)
    for path in [Path(folder), *Path(folder).rglob("*")]:
        mode = path.stat().st_mode & 0o777
        if not mode & 0o077:
            os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~mask)


def save_final_model(trainer, folder: Path) -> Path:
    """`Trainer.save_model` (gathering ZeRO-3 or FSDP2 shards; only the adapter for LoRA), then verify the result."""
    folder = Path(folder)
    with waiting_for("the other ranks while saving and verifying the final model"):
        if getattr(trainer, "is_fsdp_enabled", False):
            save_pretrained_gathered(trainer, folder)
        else:
            trainer.save_model(str(folder))
        trainer.accelerator.wait_for_everyone()
        model = trainer.accelerator.unwrap_model(trainer.model_wrapped) if trainer.model_wrapped is not None else \
            trainer.model
        verify_saved_weights(model, folder)
    if trainer.is_world_process_zero():
        write_training_args(trainer.args, folder)
        make_shareable(folder)
    return folder


def write_training_args(args, folder: Path) -> None:
    """The training arguments as JSON (`training_args.json`) in place of the Trainer's pickled training_args.bin: a
    shipped model holds no pickle, so whoever loads it runs no code from it."""
    (Path(folder) / "training_args.bin").unlink(missing_ok=True)
    (Path(folder) / "training_args.json").write_text(args.to_json_string())
