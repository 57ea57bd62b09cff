"""The offline cache: `$HF_ZERO_CACHE`, else ~/.cache/hf_zero, shared by every run (and a team, on a shared disk).

An entry is built in a temporary folder under a file lock, checked to be usable (`verify`), completed with a marker
file and renamed into place. An entry is used only when it is marked and still passes the check; one that does not is
rebuilt, with one line saying so. Builds happen in plain processes (the launcher, or a child of local rank 0), never
inside a process group or ZeRO-3's zero.Init, where they would need collectives the other ranks cannot join.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import struct
import sys
import tempfile
import time
from pathlib import Path

from hf_zero.core.distributed import DIST_TIMEOUT_ENV, dist_timeout
from hf_zero.core.errors import UserError
from hf_zero.core.files import write_text_atomic

__all__ = ["get_cache_dir", "hub_cache_dir", "hub_snapshot_dir", "build_once", "build_hub_snapshot", "entry_problem",
           "model_folder_problem", "MARKER"]

MARKER = ".complete"


def get_cache_dir() -> Path:
    return Path(os.environ.get("HF_ZERO_CACHE") or Path.home() / ".cache" / "hf_zero").expanduser()


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache (HF_HUB_CACHE, else $HF_HOME/hub), read at each call as huggingface_hub reads it at
    import: a process started later with the same environment looks in the same place."""
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache",
                                             "huggingface")
    hub = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE") or Path(home) / "hub"
    return Path(os.path.expandvars(str(hub))).expanduser()


def _repo_dir(repo_id: str) -> Path:
    return hub_cache_dir() / ("models--" + repo_id.replace("/", "--"))


def hub_snapshot_dir(repo_id: str, revision: str) -> Path:
    return _repo_dir(repo_id) / "snapshots" / revision


def build_hub_snapshot(repo_id: str, revision: str, build, *args, verify=None) -> Path:
    """A model built by hf_zero, kept in the hub cache's own layout (models--ORG--NAME/snapshots/REV, refs/main) under
    its hub id: transformers' and peft's plain `from_pretrained(repo_id)` find it offline (HF_HUB_OFFLINE=1) with no
    hf_zero import, so an adapter or a model card can name its base by that id and load on any machine."""
    repo = _repo_dir(repo_id)
    folder = build_once(repo / "snapshots" / revision, build, *args, verify=verify,
                        lock_dir=hub_cache_dir() / ".locks" / repo.name)  # where huggingface_hub keeps its locks
    ref = repo / "refs" / "main"
    if not ref.is_file() or ref.read_text().strip() != revision:
        ref.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(ref, revision)
    return folder


def _holder(path: Path) -> tuple[int | None, str]:
    """(pid, words) of the process that wrote `path` (the lock's side file); pid None when it is not on this host."""
    import socket

    try:
        pid_text, host = path.read_text().split()
        pid = int(pid_text)
    except (OSError, ValueError):
        return None, "another process"
    if host != socket.gethostname():
        return None, f"pid {pid} on {host}"
    return pid, f"pid {pid}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process, alive
        pass
    return True


@contextlib.contextmanager
def _cache_lock(path: Path, what: str):
    """`path` locked for building `what`; the holder's pid sits next to it (`<lock>.pid`) so a waiter can say who it
    waits for, and give up when that process is gone or after HF_ZERO_DIST_TIMEOUT seconds."""
    import socket

    from filelock import FileLock, Timeout

    lock, side = FileLock(str(path)), path.with_name(path.name + ".pid")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        limit = dist_timeout()
        print(f"hf-zero: waiting up to {limit} s for {path}: {_holder(side)[1]} is building {what}",
              file=sys.stderr, flush=True)
        deadline, dead_polls = time.monotonic() + limit, 0
        while True:
            try:
                lock.acquire(timeout=max(min(2.0, deadline - time.monotonic()), 0.01))
                break
            except Timeout:
                pid, who = _holder(side)
                # Twice in a row: a new holder may not have written its pid yet over a crashed one's.
                dead_polls = dead_polls + 1 if pid is not None and not _alive(pid) else 0
                if dead_polls >= 2:
                    raise UserError("cache", f"{path} is still locked but its holder ({who}) has exited",
                                    f"if no hf-zero process is building {what}, delete {path} and {side}") from None
                if time.monotonic() >= deadline:
                    raise UserError("cache", f"gave up after {limit} s waiting for {path}, held by {who}",
                                    f"let it finish or stop it; raise {DIST_TIMEOUT_ENV} if the build is only slow"
                                    ) from None
    try:
        side.write_text(f"{os.getpid()} {socket.gethostname()}\n")
        yield
    finally:
        side.unlink(missing_ok=True)
        lock.release()


def _safetensors_problem(path: Path) -> str | None:
    """Whether the file's header parses and its tensors end exactly at the end of the file (a cut copy does not)."""
    try:
        with open(path, "rb") as fh:
            size = struct.unpack("<Q", fh.read(8))[0]
            header = json.loads(fh.read(size))
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=-1)
    except (OSError, ValueError, struct.error, KeyError, TypeError, AttributeError):
        return f"{path.name} is missing or unreadable"
    if end < 0 or 8 + size + end != path.stat().st_size:
        return f"{path.name} is truncated"
    return None


def model_folder_problem(folder: Path) -> str | None:
    """What keeps `folder` from loading with from_pretrained (None: nothing): config, every weight file, tokenizer.
    A file check, exact for the folders hf_zero writes, and cheap (no torch): it runs on every use of the cache."""
    try:
        json.loads((folder / "config.json").read_text())["model_type"]
    except (OSError, ValueError, KeyError, TypeError):
        return "it has no readable config.json"
    index = folder / "model.safetensors.index.json"
    try:
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else [
            "model.safetensors"]
    except (OSError, ValueError, KeyError, AttributeError):
        return f"{index.name} is unreadable"
    for shard in shards:
        if problem := _safetensors_problem(folder / shard):
            return f"its weights are not usable ({problem})"
    missing = [f for f in ("tokenizer.json", "tokenizer_config.json") if not (folder / f).is_file()]
    return f"its tokenizer is incomplete (no {', '.join(missing)})" if missing else None


def entry_problem(final: Path, verify) -> str | None:
    """What keeps the cache entry `final` from being used (not built, or `verify`'s finding); None when usable."""
    if not (final / MARKER).is_file():
        return "it is not built"
    return verify(final) if verify else None


def _in_distributed_process() -> bool:
    """Inside a process group (or with ZeRO-3's zero.Init armed), building would run collectives, or write nothing
    on a rank other than 0 (transformers' save_pretrained): builds happen before, in a plain process."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return True
    ds = sys.modules.get("transformers.integrations.deepspeed")
    return bool(ds and ds.is_deepspeed_zero3_enabled())


def build_once(final: Path, build, *args, verify=None, lock_dir: Path | None = None) -> Path:
    """`final` built by `build(tmp_dir, *args)`, at most once however many processes ask at the same time. Usable
    means marked complete and passing `verify(folder) -> problem or None`; an entry that is not is rebuilt."""
    problem = entry_problem(final, verify)
    if problem is None:
        return final
    if (final / MARKER).is_file():
        print(f"hf-zero: cache: {final} is marked complete but {problem}; rebuilding it", file=sys.stderr, flush=True)
    if _in_distributed_process():
        raise UserError("cache", f"{final} is needed inside a distributed run but {problem}", "build it first "
                        "in one process: python -m hf_zero.data.assets --model NAME (hf-zero train does this for you)")
    final.parent.mkdir(parents=True, exist_ok=True)
    (lock_dir or final.parent).mkdir(parents=True, exist_ok=True)
    with _cache_lock((lock_dir or final.parent) / f".{final.name}.lock", final.name):
        if entry_problem(final, verify) is None:  # another process finished it while we waited
            return final
        # Leftovers of a crashed build: nobody else can be writing them while we hold the lock.
        for stale in [final, *final.parent.glob(f".{final.name}.tmp-*")]:
            if stale.exists():
                shutil.rmtree(stale)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
        try:
            build(tmp, *args)
            if verify and (problem := verify(tmp)):
                raise RuntimeError(f"building {final.name} wrote an unusable folder: {problem}")
            for path in [tmp, *tmp.rglob("*")]:  # mkdtemp (and safetensors) make private files; a team shares caches
                os.chmod(path, 0o755 if path.is_dir() else 0o644)
            (tmp / MARKER).write_text("ok\n")  # last, so a folder copied or renamed half-way is never trusted
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final
