"""The conversions kept inside a checkpoint join its manifest: a resume on another engine, ZeRO stage or number of
ranks writes `global_stepN_universal/` + `latest_universal` (DeepSpeed) or `pytorch_model_fsdp_0/` + `optimizer_0/`
(FSDP2) into the checkpoint, and each of their files is recorded with its size and CRC-32 under the manifest's
"converted" key once the conversion is complete. A later resume uses the conversion only while every file of it
matches (and no other file joined it); otherwise it is converted again from the checkpoint's own files, which the
manifest's "files" protect as before. Without that, 64 flipped bytes in a universal fp32.pt trained on from
embeddings of 1e29, "done".

A checkpoint without a manifest (not written by hf_zero, given by flag) has no checksums for its own files either:
its conversion is trusted by its `.complete` marker, as the checkpoint itself is trusted.
"""

from __future__ import annotations

import json
from pathlib import Path

from hf_zero.checkpoint.paths import checkpoint_files, read_tag
from hf_zero.checkpoint.store import MANIFEST_NAME, crc32_of, write_json_atomic

__all__ = ["CONVERTED_KEY", "conversion_parts", "conversion_problem", "record_conversion"]

CONVERTED_KEY = "converted"
_FSDP_PARTS = ("pytorch_model_fsdp_0", "optimizer_0")  # checkpoint/fsdp.py, checkpoint/dcp.py
_UNIVERSAL_TAG = "latest_universal"


def _manifest(checkpoint: Path) -> dict | None:
    try:
        manifest = json.loads((checkpoint / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) and isinstance(manifest.get("files"), dict) else None


def conversion_parts(checkpoint, target: str) -> tuple[list[str], str | None]:
    """(the top-level names a conversion for `target` consists of, its completion marker) or ([], None) when none
    is named (no latest_universal)."""
    checkpoint = Path(checkpoint)
    if target == "fsdp2":
        return list(_FSDP_PARTS), f"{_FSDP_PARTS[0]}/.complete"
    tag = read_tag(checkpoint, _UNIVERSAL_TAG)
    return ([_UNIVERSAL_TAG, tag], f"{tag}/.complete") if tag else ([], None)


def _files_under(checkpoint: Path, parts: list[str]) -> list[str]:
    out = []
    for name in parts:
        path = checkpoint / name
        if path.is_dir():
            out += [str(p.relative_to(checkpoint)) for p in checkpoint_files(path)]
        elif path.is_file():
            out.append(name)
    return sorted(out)


def conversion_problem(checkpoint, target: str, checksums: bool = True) -> str | None:
    """None when a complete conversion for `target` ("fsdp2" or "deepspeed") is kept inside the checkpoint and its
    files are the ones recorded; else what is missing or wrong (one short phrase)."""
    checkpoint = Path(checkpoint)
    parts, marker = conversion_parts(checkpoint, target)
    if marker is None or not (checkpoint / marker).is_file():
        return "not converted"
    manifest = _manifest(checkpoint)
    if manifest is None:
        return None if not (checkpoint / MANIFEST_NAME).exists() else f"unreadable {MANIFEST_NAME}"
    recorded = {**manifest["files"], **(manifest.get(CONVERTED_KEY) or {})}  # `hf-zero convert` lists it in files
    listed = {rel for rel in recorded if rel.split("/", 1)[0] in parts}
    present = set(_files_under(checkpoint, parts))
    if marker not in listed:
        return "not recorded in the manifest (an interrupted or older conversion)"
    if present != listed:
        extra, missing = sorted(present - listed), sorted(listed - present)
        return f"{extra[0]} is not in the manifest" if extra else f"{missing[0]} is missing"
    for rel in sorted(listed):
        entry = recorded[rel]
        size = (checkpoint / rel).stat().st_size
        if size != entry.get("bytes"):
            return f"{rel} has {size} bytes, the manifest says {entry.get('bytes')}"
        if checksums and crc32_of(checkpoint / rel) != entry.get("crc32"):
            return f"{rel} does not match its checksum"
    return None


def record_conversion(checkpoint, target: str) -> None:
    """Add the finished conversion's files to the manifest's "converted" entries (replacing what was recorded under
    the same names); nothing without a manifest."""
    checkpoint = Path(checkpoint)
    manifest = _manifest(checkpoint)
    if manifest is None:
        return
    parts, _ = conversion_parts(checkpoint, target)
    kept = {rel: e for rel, e in (manifest.get(CONVERTED_KEY) or {}).items() if rel.split("/", 1)[0] not in parts}
    for rel in _files_under(checkpoint, parts):
        kept[rel] = {"bytes": (checkpoint / rel).stat().st_size, "crc32": crc32_of(checkpoint / rel, fsync=True)}
    write_json_atomic(checkpoint / MANIFEST_NAME, {**manifest, CONVERTED_KEY: kept})
