"""`hf-zero check`'s data check of multimodal rows (the composed-model and stock-VLM recipes): every row's items
valid and every image and array opened as the run opens them, without tokenizing (`hf-zero preview` does)."""

from __future__ import annotations

from hf_zero.data.chat import FormatOptions, Row
from hf_zero.data.multimodal import declared_specs, items_folder, message_text, read_rows

__all__ = ["check_multimodal_data"]


def check_multimodal_data(stages, args, specs: dict | None = None) -> str:
    """`hf-zero check`'s data check for recipes/multimodal.py (its CHECK_DATA): every row's items valid and every
    image and array opened as the run opens them; one line with the rows and files per stage. `specs`: the item
    types (the recipe's declared encoders unless given: a stock VLM's image alone)."""
    specs, opts = specs or declared_specs(args.encoders), FormatOptions.from_args(args)
    counts = []
    for stage in stages:
        rows = files = 0
        for j, spec in enumerate(stage.data):
            where = f"stages[{stage.name}].data[{j}]"
            row, folder = Row(where, spec), items_folder(spec)
            for i, raw in enumerate(read_rows(spec, where, opts.messages_field)):
                row.n, media = i + 1, []
                if not isinstance(raw, list):
                    row.fail(f"{opts.messages_field} must be a list of messages")
                for k, msg in enumerate(raw):
                    if isinstance(msg, dict):
                        message_text(msg, k, row, specs, folder, media)
                rows, files = rows + 1, files + len(media)
        counts.append(f"{stage.name} {rows} rows, {files} files")
    return f"{len(stages)} stage(s), every image and array opened: {'; '.join(counts)}"
