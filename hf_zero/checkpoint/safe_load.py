"""No code runs from a checkpoint: every pickle read from a checkpoint or a final model goes through torch's
weights-only unpickler (or, for the pickles torch's distributed checkpoint reads with plain `pickle`, an unpickler
with the same allowlist), which builds tensors, containers and the few types below and nothing else.

- `safe_checkpoint_loading()`: for the duration of a resume, an export or a conversion, every `torch.load` in the
  process is weights-only with the allowlist, whatever its caller asks for (DeepSpeed's checkpoint engine,
  zero_to_fp32, ds_to_universal and torch's distributed checkpoint all pass weights_only=False). torch honours
  TORCH_FORCE_WEIGHTS_ONLY_LOAD=1 even over an explicit weights_only=False (torch/serialization.py `load`), which
  also reaches subprocesses; `torch.load` itself is wrapped only to name the refused file.
- `check_checkpoint(folder)`: every pickle of a checkpoint loaded under that loader before any engine reads it (zip
  files memory-mapped, so no tensor data is read), refusing the first file that holds anything else in one line.
  Files are found where they really are (checkpoint/paths.py: links followed, a link leaving the checkpoint
  refused), the `latest` / `latest_universal` files must name a folder inside it, and a distributed checkpoint's
  `.metadata` must name only files inside its folder, each long enough for the items read from it.
- torch's distributed checkpoint reads `.metadata` with plain `pickle.load` (FileSystemReader.read_metadata), which
  no weights-only switch reaches: under the guard, every such read is preceded by the same check of that file.
- `python -m hf_zero.checkpoint.safe_load MODULE ARGS`: runs a module (DeepSpeed's ds_to_universal) under the guard.

The allowlist (hf_zero/checkpoint/allowlist.py) is what DeepSpeed, the Trainer, accelerate and torch's distributed
checkpoint write into checkpoints of the zero1/2/3, fsdp2 and ddp profiles.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import re
import runpy
import sys
import zipfile
from pathlib import Path

from hf_zero.checkpoint.allowlist import ALLOWED, allowed_globals
from hf_zero.checkpoint.paths import checkpoint_files, inside, read_tag
from hf_zero.core.errors import EXIT_USAGE, UserError
from hf_zero.integrations.torch import check_dcp_metadata_first, restore_dcp_read_metadata, set_torch_load

__all__ = ["FORCE_ENV", "safe_checkpoint_loading", "check_checkpoint", "safe_load", "refusal"]

FORCE_ENV = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"

_ORIGINAL_LOAD: list = []  # torch.load as torch defines it, kept while the guard wraps it
_FIX = ("hf_zero loads only tensors and the training state DeepSpeed, the Trainer and torch write; use a checkpoint "
        "from a run you trust, or re-save its weights as safetensors")
_STATE = {"depth": 0, "registered": False}
_DCP_METADATA = re.compile(r"^(__\d+)?\.metadata$")  # torch's distributed checkpoint: global, or one rank's


def _register() -> None:
    """The allowlist for the whole process, once (torch's safe_globals context removes its globals on exit, also
    under an enclosing guard). Registered as (object, name) pairs, so transformers' own numpy context, which
    removes the bare objects on exit, leaves them in place."""
    import torch

    if not _STATE["registered"]:
        torch.serialization.add_safe_globals(allowed_globals())
        _STATE["registered"] = True
    if not _ORIGINAL_LOAD:
        _ORIGINAL_LOAD.append(torch.load)


def refusal(file, what: str) -> UserError:
    return UserError("checkpoint", f"{file} holds {what}, which hf_zero does not load", _FIX)


def _unsafe_type(message: str) -> str:
    """The refused type, from the weights-only unpickler's message (the payload is never built, only named)."""
    m = (re.search(r"GLOBAL (\S+) was not an allowed global", message)
         or re.search(r"GLOBAL (\S+) whose module", message)
         or re.search(r"(?:function|but got) <?(?:class |function |built-in function )?'?([\w.]+)", message))
    return m.group(1) if m else "a type outside the allowlist"


def _file_name(f) -> str:
    return os.fspath(f) if isinstance(f, (str, os.PathLike)) else getattr(f, "name", "a checkpoint file")


class _RestrictedUnpickler(pickle.Unpickler):
    """Plain pickles (torch's distributed checkpoint .metadata): the allowlist and torch dtypes, nothing else; the
    weights-only unpickler reads only protocol 2, these are protocol 4."""

    def find_class(self, module, name):
        import torch

        full = f"{module}.{name}"
        if full in ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"Unsupported global: GLOBAL {full} was not an allowed global")

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("Unsupported global: GLOBAL persistent_id was not an allowed global")


def _load_raw(path: Path):
    """Every pickle in the file, one after another (a file may chain several): the first one's value."""
    values = []
    with open(path, "rb") as f:
        end = os.fstat(f.fileno()).st_size
        while f.tell() < end:
            values.append(_RestrictedUnpickler(f).load())
    return values[0] if values else None


def safe_load(path, raw_pickle: bool = False):
    """Load one checkpoint pickle under the allowlist (mmap: no tensor data is read), or raise the refusal."""
    _register()
    try:
        if raw_pickle:
            return _load_raw(Path(path))
        return _ORIGINAL_LOAD[0](path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as err:
        raise refusal(path, _unsafe_type(str(err))) from None
    except (OSError, EOFError, ValueError, RuntimeError, TypeError, AttributeError) as err:
        # Truncated or corrupt: no payload ran, but nothing in it can be trusted to load either.
        raise UserError("checkpoint", f"{path} cannot be read ({str(err).splitlines()[0][:120]})",
                        "pick an earlier checkpoint") from None


def _is_pickle(path: Path) -> str | None:
    """"zip" (torch.save), "raw" (a plain pickle), or None (safetensors, JSON, text: nothing to unpickle). A
    distributed checkpoint's metadata is "raw" whatever its first byte (a protocol 0 pickle has no header, and torch
    unpickles it with plain pickle; what torch.load reads, it reads weights-only under the guard)."""
    with open(path, "rb") as f:
        head = f.read(2)
    if _DCP_METADATA.match(path.name):
        return "raw"
    if head == b"PK" and zipfile.is_zipfile(path):
        return "zip"
    return "raw" if head[:1] == b"\x80" else None


def _check_dcp(folder: Path, metadata) -> None:
    """A distributed checkpoint's items: each in a file inside `folder` that is long enough for it (a truncated
    .distcp is refused here, not in a traceback from torch); the non-tensor items (torch.save'd bytes, which torch
    loads with weights_only=False) each through the weights-only loader. Tensor items torch loads weights-only."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    byte_keys = {k for k, v in metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)}
    sizes: dict[str, int] = {}
    for index, info in metadata.storage_data.items():
        path = inside(folder, info.relative_path)
        if info.relative_path not in sizes:
            sizes[info.relative_path] = path.stat().st_size if path.is_file() else -1
        if sizes[info.relative_path] < 0:
            raise UserError("checkpoint", f"{path} is missing (its .metadata names it)", "pick an earlier checkpoint")
        if info.offset + info.length > sizes[info.relative_path]:
            raise UserError("checkpoint", f"{path} is truncated ({sizes[info.relative_path]} bytes; its .metadata "
                            f"reads up to byte {info.offset + info.length})", "pick an earlier checkpoint")
        if index.fqn not in byte_keys:
            continue
        with open(path, "rb") as f:
            f.seek(info.offset)
            blob = io.BytesIO(f.read(info.length))
        try:
            _ORIGINAL_LOAD[0](blob, weights_only=True)
        except pickle.UnpicklingError as err:
            raise refusal(path, _unsafe_type(str(err))) from None


def _check_metadata(path: Path) -> None:
    """A distributed checkpoint's .metadata and what it names, before torch unpickles it."""
    loaded = safe_load(path, raw_pickle=True)
    if not hasattr(loaded, "storage_data") or not hasattr(loaded, "state_dict_metadata"):
        raise UserError("checkpoint", f"{path} holds no distributed checkpoint metadata", "pick an earlier checkpoint")
    _check_dcp(path.parent, loaded)


def check_checkpoint(folder) -> int:
    """Load every pickle under `folder` with the safe loader; the first one holding anything else is refused
    (UserError). Returns how many files were checked."""
    _register()
    for name in ("latest", "latest_universal"):  # DeepSpeed and hf_zero build paths from them
        read_tag(folder, name)
    checked = 0
    for path in checkpoint_files(folder):
        if path.suffix in (".safetensors", ".json", ".py", ".txt", ".distcp"):
            continue
        kind = _is_pickle(path)
        if kind is None:
            continue
        if _DCP_METADATA.match(path.name):
            _check_metadata(path)
        else:
            safe_load(path, raw_pickle=kind == "raw")
        checked += 1
    return checked


def _guarded_load(f, map_location=None, pickle_module=None, *, weights_only=None, **kwargs):
    # pickle_module is dropped: torch refuses it with weights_only, and no allowlisted load needs one.
    try:
        return _ORIGINAL_LOAD[0](f, map_location, weights_only=True, **kwargs)
    except pickle.UnpicklingError as err:
        raise refusal(_file_name(f), _unsafe_type(str(err))) from None


@contextlib.contextmanager
def safe_checkpoint_loading():
    """Every torch.load in this process (and the environment of any subprocess started meanwhile) weights-only with
    the allowlist; a refused file raises UserError naming it. Re-entrant."""
    _register()
    if _STATE["depth"]:
        _STATE["depth"] += 1
        try:
            yield
        finally:
            _STATE["depth"] -= 1
        return
    before = os.environ.get(FORCE_ENV)
    os.environ[FORCE_ENV] = "1"
    set_torch_load(_guarded_load)  # hf_zero/integrations/torch.py
    check_dcp_metadata_first(_check_metadata)
    _STATE["depth"] = 1
    try:
        yield
    finally:
        _STATE["depth"] = 0
        set_torch_load(_ORIGINAL_LOAD[0])
        restore_dcp_read_metadata()
        if before is None:
            os.environ.pop(FORCE_ENV, None)
        else:
            os.environ[FORCE_ENV] = before


def main(argv: list[str] | None = None) -> int:
    """`python -m hf_zero.checkpoint.safe_load MODULE ARGS`: MODULE's __main__ under the guard; a refused file is
    the one line on stderr and exit 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    module, sys.argv = argv[0], argv
    try:
        with safe_checkpoint_loading():
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    except UserError as err:
        print(f"hf-zero: error: {err.line()}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    return 0


if __name__ == "__main__":
    sys.exit(main())
