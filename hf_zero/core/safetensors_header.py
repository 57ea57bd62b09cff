"""A .safetensors file's header checked before any library reads it: `hf-zero export` and `generate` take folders
from anywhere, and a crafted header (a length past the end of the file, offsets outside the data, a shape that does
not match its bytes, an unknown dtype) made safetensors, torch or transformers raise one of many exceptions, each a
traceback. Checked here, it is one line naming the file and the tensor. Reads the header only (no torch)."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

from hf_zero.core.errors import UserError

__all__ = ["safetensors_problem", "verify_safetensors"]

# bits per element of every dtype safetensors writes
_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "I16": 16, "U16": 16, "F16": 16,
         "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "I64": 64, "U64": 64, "F64": 64, "C64": 64, "F4": 4,
         "F6_E2M3": 6, "F6_E3M2": 6}
_MAX_HEADER = 100 * 2**20  # safetensors' own limit


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _tensor_problem(name: str, spec, data_size: int) -> str | None:
    if not isinstance(spec, dict):
        return f"tensor {name!r} is described by a {type(spec).__name__}, not a mapping"
    dtype, shape, offsets = spec.get("dtype"), spec.get("shape"), spec.get("data_offsets")
    if dtype not in _BITS:
        return f"tensor {name!r} has an unknown dtype {dtype!r}"
    if not isinstance(shape, list) or not all(map(_whole, shape)):
        return f"tensor {name!r} has shape {shape!r}, not a list of sizes"
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_whole, offsets))
            and offsets[0] <= offsets[1] <= data_size):
        return f"tensor {name!r} has data_offsets {offsets!r} outside the file's {data_size} data bytes"
    if math.prod(shape) * _BITS[dtype] != 8 * (offsets[1] - offsets[0]):
        return f"tensor {name!r}: shape {shape} in {dtype} does not fill its {offsets[1] - offsets[0]} bytes"
    return None


def safetensors_problem(path: Path) -> str | None:
    """What is wrong with the file's header and layout (None: nothing)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                return "it is shorter than a safetensors header"
            length = struct.unpack("<Q", head)[0]
            if length > min(size - 8, _MAX_HEADER):
                return f"its header length {length} runs past the end of the file ({size} bytes)"
            header = json.loads(fh.read(length).decode("utf-8"))
    except (ValueError, RecursionError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        return "its header is not JSON"
    if not isinstance(header, dict):
        return f"its header is a JSON {type(header).__name__}, not a mapping"
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        return "its __metadata__ is not a mapping of strings"
    data_size = size - 8 - length
    spans = []
    for name, spec in header.items():
        if problem := _tensor_problem(name, spec, data_size):
            return problem
        spans.append(tuple(spec["data_offsets"]))
    end = 0
    for begin, stop in sorted(spans):  # one tensor after the other, to the end: no overlap, gap or trailing bytes
        if begin != end:
            return "its tensors overlap or leave gaps in the data"
        end = stop
    if end != data_size:
        return f"its tensors end at byte {end} of {data_size} data bytes (cut or padded)"
    return None


def verify_safetensors(folder: Path, field: str) -> None:
    """Every .safetensors file directly in `folder` (a file: that one) checked; one line naming `field` and the file
    for the first bad one."""
    folder = Path(folder)
    files = [folder] if folder.is_file() else sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    for path in files:
        if path.suffix == ".safetensors" and (problem := safetensors_problem(path)):
            raise UserError(field, f"{path} is not a usable safetensors file: {problem}",
                            "use a checkpoint or model folder written by hf-zero or save_pretrained")
