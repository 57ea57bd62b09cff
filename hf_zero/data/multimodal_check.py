"""`hf-zero check`'s data check of multimodal rows (the composed-model and stock-VLM recipes): every row's items
valid and every image and array opened as the run opens them, without tokenizing (`hf-zero preview` does), and
the input shapes the recipe's encoders declare, read without building them."""

from __future__ import annotations

import sys
from collections import Counter
from types import SimpleNamespace

from hf_zero.core.errors import UserError
from hf_zero.data.chat import FormatOptions, Row
from hf_zero.data.model_names import resolve_model_path
from hf_zero.data.multimodal import ModalitySpec, items_folder, message_text, read_rows

__all__ = ["check_multimodal_data", "declared_specs", "config_input_shape", "pretrained_config"]


def check_multimodal_data(stages, args, specs: dict | None = None) -> str:
    """`hf-zero check`'s data check for recipes/multimodal.py (its CHECK_DATA): every row's items valid and every
    image and array opened as the run opens them; one line with the rows and files per stage. `specs`: the item
    types (the recipe's declared encoders unless given: a stock VLM's image alone)."""
    specs, opts = specs or declared_specs(args.encoders), FormatOptions.from_args(args)
    counts, fullest = [], (0, "", "")  # the most items of one modality in a row: (items, modality, which row)
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
                for kind, n in Counter(kind for kind, _ in media).items():
                    fullest = max(fullest, (n, kind, f"row {i + 1} of {where}"), key=lambda f: f[0])
        counts.append(f"{stage.name} {rows} rows, {files} files")
    allowed = getattr(args, "items_per_row", 1)
    if fullest[0] > allowed:  # the estimate would count too few: say so before anyone sizes a GPU on it
        print(f"[hf_zero] warning: items_per_row: {fullest[2]} holds {fullest[0]} {fullest[1]} items, the estimate "
              f"counts {allowed} per row; set items_per_row: {fullest[0]}", file=sys.stderr, flush=True)
    return f"{len(stages)} stage(s), every image and array opened: {'; '.join(counts)}"


def declared_specs(encoders) -> dict:
    """{modality: ModalitySpec} from the recipe's `encoders:` without building them (token counts unknown: 1), for
    the checks that only open files: `input_shape`, or a transformers config's [num_channels, image_size x 2]
    (`hf_config`, or a `pretrained` model's config.json)."""
    specs = {}
    for m, cfg in (encoders or {}).items():
        cfg = cfg if isinstance(cfg, dict) else {}
        shape = cfg.get("input_shape")
        if shape is None and "hf_config" in cfg:
            shape = config_input_shape(SimpleNamespace(**(cfg["hf_config"] or {})))
        elif shape is None and "pretrained" in cfg:
            config = pretrained_config(str(cfg["pretrained"]), f"encoders.{m}.pretrained")[1]
            shape = config_input_shape(getattr(config, "vision_config", None) or config)  # a pair: its vision tower
        if not isinstance(shape, list) or not all(isinstance(n, int) and n > 0 for n in shape):
            raise UserError(f"encoders.{m}.input_shape", f"{shape!r} is not a list of positive sizes",
                            "e.g. input_shape: [1, 8, 8] for an image, [256, 3] for a point cloud")
        specs[m] = ModalitySpec(m, tuple(shape), 1)
    if not specs:
        raise UserError("encoders", "the multimodal recipe needs at least one encoder",
                        "e.g. encoders: {points: {class: hf_zero.train.encoders:PointNet, input_shape: [256, 3]}}")
    return specs


def config_input_shape(config) -> list | None:
    """[num_channels, height, width] of a transformers vision config (its image_size), None for another."""
    if not hasattr(config, "image_size"):
        return None
    size = config.image_size if isinstance(config.image_size, (list, tuple)) else [config.image_size] * 2
    return [getattr(config, "num_channels", 3), *size]


def pretrained_config(name: str, where: str):
    """(folder, config) of a `pretrained` encoder, by hub id in the offline cache or folder, read without its
    weights; a name that is not a model is one line naming `where`."""
    from transformers import AutoConfig

    fix = "give a hub id in the offline cache or a folder with config.json and its weights"
    try:
        path = resolve_model_path(name)
        return path, AutoConfig.from_pretrained(path)
    except UserError as err:  # resolve_model_path's own line names model_name_or_path: say which key it was
        raise UserError(where, f"cannot read {name!r} ({err.problem})", fix) from None
    except (OSError, ValueError) as err:
        raise UserError(where, f"cannot read {name!r} ({type(err).__name__}: {str(err).splitlines()[0][:120]})",
                        fix) from None
