"""Reading a stage's data file before anything tokenizes it: the file format from its suffix (or its rows), the
file's rows checked in one line each (hf_zero.data.row_checks), and datasets' reader with its stray log lines
kept off the console. hf_zero.data.stages loads and tokenizes what this reads."""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path

from hf_zero.core.console import verbose
from hf_zero.core.errors import UserError
from hf_zero.data.builtin import resolve_data_path
from hf_zero.data.row_checks import RowKinds, verify_csv

__all__ = ["load_source", "verify_data_file"]


_FORMATS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}


def _json_rows(text: str) -> bool:
    """Whether a .json file is JSON lines (datasets reads both); a single document starts with [ or { and parses."""
    head = text.lstrip()[:1]
    if head not in ("[", "{"):
        return True
    try:
        json.loads(text)
        return False
    except (ValueError, RecursionError):
        return head == "{"  # a JSON-lines file also starts with {; an array that does not parse is one document


def verify_data_file(path: Path, spec: str, where: str) -> None:
    """A local data file decoded and parsed the way the loader will, row by row: datasets decodes lazily, so a bad
    byte used to pass `hf-zero check` and fail the run at tokenization, and a bad JSON line failed with no row."""
    if path.is_dir():
        raise UserError(where, f"{spec} is a folder, not a data file", "name the files in it under `data:`")
    if path.stat().st_size == 0:
        raise UserError(where, f"{spec} is empty", "give it rows, or remove it from the stage")
    if path.suffix == ".parquet":  # binary and typed: datasets' own reader is the check
        return
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if key in _VERIFIED:  # each rank checks its files before writing anything, then loads them
        return
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        row, start = raw.count(b"\n", 0, err.start) + 1, raw.rfind(b"\n", 0, err.start) + 1
        raise UserError(where, f"{spec} row {row}: byte 0x{raw[err.start]:02x} is not UTF-8 (byte "
                        f"{err.start - start + 1} of the line)",
                        "save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None
    if not text.strip():
        raise UserError(where, f"{spec} has only blank lines", "give it rows, or remove it from the stage")
    if path.suffix == ".jsonl" or path.suffix == ".json" and _json_rows(text):
        kinds = RowKinds(spec, where)
        for row, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except ValueError as err:
                raise UserError(where, f"{spec} row {row}: not valid JSON ({getattr(err, 'msg', err)} at column "
                                f"{getattr(err, 'colno', '?')})", "fix or remove the row") from None
            except RecursionError:  # the parser recurses per level: a row nested thousands deep
                raise UserError(where, f"{spec} row {row}: nested too deeply to read",
                                "fix or remove the row") from None
            if not isinstance(value, dict):
                raise UserError(where, f"{spec} row {row}: a JSON {type(value).__name__}, not an object",
                                'give each row as {"column": value, ...}')
            kinds.add(row, value)
    elif path.suffix == ".json":
        try:
            value = json.loads(text)
        except ValueError as err:
            raise UserError(where, f"{spec} line {err.lineno}: not valid JSON ({err.msg} at column {err.colno})",
                            "fix the file") from None
        except RecursionError:
            raise UserError(where, f"{spec}: nested too deeply to read", "fix the file") from None
        kinds = RowKinds(spec, where, "item")
        for row, item in enumerate(value if isinstance(value, list) else [], 1):
            if isinstance(item, dict):
                kinds.add(row, item)
    elif path.suffix == ".csv":
        verify_csv(text, spec, where)
    _VERIFIED.add(key)


_VERIFIED: set = set()
_LOADED: dict = {}  # (path, size, mtime) -> the datasets.Dataset load_source read from it in this process


def load_source(spec: str, where: str):
    """One data source as a `datasets.Dataset`."""
    import datasets

    if not verbose():  # "Generating train split" bars, once per file and rank, bury the run's own lines
        datasets.disable_progress_bars()
    if spec.startswith("builtin:"):
        spec = resolve_data_path(spec)
    path = spec
    local = Path(path)
    if local.is_dir():  # datasets would read the files inside as one source, silently
        verify_data_file(local, spec, where)
    if local.suffix in _FORMATS:
        if not local.exists():
            raise UserError(where, f"data file {path} does not exist",
                            "fix the path (a relative path is read from the recipe YAML's folder)")
        verify_data_file(local, spec, where)
        stat = local.stat()
        key = (str(local.resolve()), stat.st_size, stat.st_mtime_ns)
        if key in _LOADED:  # each rank counts a file's rows before writing anything, then tokenizes the same rows
            return _LOADED[key]
        try:
            with _datasets_errors_silenced():
                ds = datasets.load_dataset(_FORMATS[local.suffix], data_files=str(local), split="train")
        except Exception as err:  # datasets raises many types for unreadable files
            raise UserError(where, f"cannot read {path} ({type(err).__name__}: {str(err).splitlines()[0][:120]})",
                            "check the file's format") from None
        if not len(ds):
            raise UserError(where, f"{spec} has no rows", "give it rows, or remove it from the stage")
        _LOADED[key] = ds  # a Dataset never changes in place (map/filter return new ones): safe to hand out again
        return ds
    try:
        return datasets.load_dataset(path, split="train")
    except Exception as err:
        raise UserError(where, f"{spec!r} is neither a local data file nor a reachable hub dataset "
                        f"({type(err).__name__})", "use a .jsonl/.json/.csv/.parquet/.txt path") from None


@contextlib.contextmanager
def _datasets_errors_silenced():
    """datasets logs a reader's failure ("Failed to read schema from ...") before raising it: the raise becomes the
    one line, so its log line is a stray second one (shown with --verbose)."""
    logger = logging.getLogger("datasets")
    level = logger.level
    if not verbose():
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)
