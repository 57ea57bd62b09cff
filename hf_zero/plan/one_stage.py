"""A recipe from a model and a data file, without writing YAML first: `hf-zero train --model M --data F` and
`hf-zero init` build the same YAML here, from the same dataclasses the curriculum recipe parses (one stage of the
`--data` files, or one stage per `--stages` file; the format read from the columns as stages read it), so what
`init` prints is what `--data` runs."""

from __future__ import annotations

import hashlib
import json
import os
import re
import textwrap
from pathlib import Path
from typing import NamedTuple

from hf_zero.core.config import Stage
from hf_zero.core.errors import UserError
from hf_zero.core.files import write_text_atomic
from hf_zero.data.cache import get_cache_dir
from hf_zero.data.chat import FormatOptions, detect_format, trains_what
from hf_zero.data.model_names import get_model_config
from hf_zero.data.preference import TRAINS, is_preference
from hf_zero.data.sources import load_source
from hf_zero.data.vlm import is_vlm_config
from hf_zero.plan.parse import HF_ZERO_TRAINING_DEFAULTS
from hf_zero.plan.shipped import DEFAULT_CONFIG

__all__ = ["DataSource", "inspect_data", "check_model", "one_stage_yaml", "write_data_recipe", "data_recipe_flags",
           "config_from_flags"]

_LOCAL_HINT = "give a .jsonl/.json/.csv/.parquet/.txt file, or a hub dataset id (online)"
_EVAL_MAX = 50
_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet", ".txt")  # what hf_zero.data.sources.load_source reads


class DataSource(NamedTuple):
    """One `--data` argument as the recipe will read it: its spec (a local path made absolute), format and rows."""

    spec: str
    format: str
    rows: int
    trains: str  # which tokens carry the loss: "all tokens" or "answers only"


def _local_path(spec: str, flag: str) -> str:
    """A local file's path made absolute (the YAML may live anywhere), checked to be one hf_zero reads; a hub
    dataset id as it is."""
    if not spec.strip():  # Path("") is the current folder: "<project folder> is a folder" named the wrong thing
        raise UserError(flag, "an empty file name", f"name your data file: {flag} FILE")
    local = Path(spec).expanduser()
    if not (local.exists() or local.suffix or spec.startswith((".", "/", "~"))):
        return spec
    if not local.exists():
        raise UserError(flag, f"{spec} does not exist", _LOCAL_HINT)
    if local.is_file() and local.suffix not in _SUFFIXES:
        raise UserError(flag, f"{spec}: {local.suffix or 'a file without a suffix'} is not a format hf_zero reads",
                        f"save it as {'/'.join(_SUFFIXES)} (a file's suffix names its format)")
    return os.path.abspath(local)


def inspect_data(spec: str, flag: str = "--data") -> DataSource:
    """The data read and its format detected the way a stage reads them; one line naming `flag` when it cannot be."""

    spec = _local_path(spec, flag)
    ds = load_source(spec, flag)
    if is_preference(ds.column_names):  # prompt/chosen/rejected: a dpo stage (hf_zero.data.preference)
        return DataSource(spec, "preference", len(ds), TRAINS)
    opts = FormatOptions()
    fmt = detect_format(ds.column_names, ds[0] if len(ds) else None, opts, flag, spec)
    return DataSource(spec, fmt, len(ds), trains_what(fmt, opts))


def check_model(model: str, flag: str = "--model") -> None:
    """The model's config read (no weights): an unknown name, or a hub id offline that is not cached, in one line."""
    try:
        get_model_config(model)
    except UserError as err:
        raise UserError(flag, err.problem, err.fix) from None


def _stage_name(spec: str, taken: set) -> str:
    base = re.sub(r"[^A-Za-z0-9_]+", "_", Path(spec).stem if Path(spec).suffix else spec.rsplit("/", 1)[-1]).strip("_")
    name, n = base or "data", 2
    while name in taken:
        name, n = f"{base}_{n}", n + 1
    taken.add(name)
    return name


def _value(v) -> str:
    if isinstance(v, str):  # quoted only where plain YAML would read it otherwise
        return v if re.fullmatch(r"[A-Za-z_/.~][A-Za-z0-9_./~-]*", v) and v not in ("true", "false", "null") else \
            json.dumps(v)
    return "true" if v is True else "false" if v is False else str(v)


def _shown(text: str) -> str:
    """A file name inside a YAML comment: quoted when it holds a line break or another unprintable character (YAML
    also breaks lines at U+0085, U+2028, U+2029), which would end the comment and make the rest of the name a key."""
    return json.dumps(text) if any(not c.isprintable() for c in text) else text


def one_stage_yaml(model: str, stages: list[list[DataSource]], note: list[str] = (),
                   output_dir: str | None = None, recipe: str | None = None) -> str:
    """The recipe YAML, commented: one stage per list of sources (one stage when given one list). `note`: comment
    lines about this machine (the profile it would use), which parsing ignores. `output_dir`: the run's folder,
    `{first}` standing for the first stage's name (default runs/{first}, where `hf-zero train --data` runs).
    `recipe`: a shipped recipe other than the curriculum one (`vlm` for a vision-language model)."""
    from hf_zero.plan.arguments import CurriculumArguments, ModelArguments

    # Beyond the dataclasses' defaults: LoRA (an adapter of a few MB, the usual first fine-tune), a pass over the data.
    lora = {"use_peft": True, "lora_r": ModelArguments.lora_r, "lora_alpha": ModelArguments.lora_alpha}
    rows = min(sum(s.rows for s in sources) for sources in stages)
    # a quarter of the smallest stage at most (stages hold out no more), never the whole eval budget on a tiny file
    eval_samples = min(_EVAL_MAX, rows // 4)
    taken: set = set()
    lines = ["# A YAML for hf_zero's curriculum recipe (recipes/curriculum.py), written by `hf-zero init`;",
             "# `hf-zero train --model M --data F` builds and runs the same one. Edit and grow it: more stages,",
             "# any key of docs/reference/recipe-keys.md; run it with `hf-zero train --config THIS_FILE`.",
             *[f"# {part}" for line in note for part in textwrap.wrap(line, 114)], "",
             *([f"recipe: {recipe}     # a vision-language model: images in the chat rows (docs/vlm.md)", ""]
               if recipe else []),
             "# Model: LoRA adapters on a frozen base (use_peft: false trains every weight)",
             f"model_name_or_path: {_value(model)}",
             *[f"{k}: {_value(v)}" for k, v in lora.items()], "",
             "# Data: the format is read from the columns (text, prompt + completion, or chat messages)",
             f"max_seq_length: {CurriculumArguments.max_seq_length}     # tokens per sample; longer ones are cut",
             f"eval_samples: {eval_samples}     # held out of each stage's data for the eval loss (0: none)",
             "stages:"]
    for sources in stages:
        lines.append(f"  - name: {_stage_name(sources[0].spec, taken)}")
        for s in sources:
            lines.append(f"    # {_shown(s.spec)}: {s.rows} rows, {s.format} (loss on {s.trains})")
        specs = [s.spec for s in sources]
        lines.append(f"    data: {_value(specs[0]) if len(specs) == 1 else '[' + ', '.join(map(_value, specs)) + ']'}")
        lines.append("    epochs: 1          # passes over the data (or steps: N)")
        if recipe == "vlm":
            lines.append("    # train: [projector, lora]   # parts: vision_tower, projector, lora (default: lora)")
        if all(s.trains == TRAINS for s in sources):  # preference rows: DPO against the model at the stage's start
            lines += ["    objective: dpo     # docs/preference.md", "    beta: 0.1",
                      "    loss_type: sigmoid  # or ipo, or simpo (reference-free)"]
    if len(stages) == 1:  # how the curriculum grows: stages train in order, each with its own data and length
        lines += ["  # A second stage trains after this one (a curriculum), e.g. on harder data at a lower peak LR:",
                  "  # - name: harder",
                  "  #   data: harder.jsonl     # relative to this YAML's folder",
                  "  #   epochs: 1",
                  "  #   learning_rate: 5.0e-4   # this stage's peak (default: learning_rate below)"]
    first = _stage_name(stages[0][0].spec, set())
    run_dir = (output_dir or "runs/{first}").format(first=first)
    if output_dir and run_dir == f"runs/{first}":  # asked for a folder of its own: not the `--data` run's
        run_dir += "_yaml"
    lines += ["", "# Trainer: every TrainingArguments field is a key (and a flag of hf-zero train)",
              f"per_device_train_batch_size: {HF_ZERO_TRAINING_DEFAULTS['per_device_train_batch_size']}",
              "learning_rate: 1.0e-3",
              "seed: 42",
              f"output_dir: {_value(run_dir)}", ""]
    text = "\n".join(lines)
    _check_parses(text)
    return text


def _check_parses(text: str) -> None:
    """Each stage built as the recipe builds it: the YAML this module writes must parse."""
    import yaml


    for item in yaml.safe_load(text)["stages"]:
        Stage(**item)


def data_recipe_flags(model: str | None, data: list[str] | None, stages: list[str] | None = None,
                      note: list[str] = (), yaml_dir: str | None = None, output_dir: str | None = None) -> str:
    """The YAML for `--model` and `--data` (one stage mixing the files), or `--stages` (one stage per file).
    `yaml_dir`: the folder the YAML is saved in (`hf-zero init`): data given by a relative path is written relative
    to it, so the YAML moves with its data; without it (the cache's YAML of `train --data`) every path is absolute."""
    if not data and not stages:
        raise UserError("--data", "missing", "name your data file: --data FILE (or --config YAML)")
    if not model:
        raise UserError("--model", "missing with --data", "name the model: --model NAME_OR_PATH, e.g. tiny-llama or "
                        "HuggingFaceTB/SmolLM2-135M-Instruct")
    for spec in data or []:  # a missing file said before the seconds the model's config takes
        _local_path(spec, "--data")
    for spec in stages or []:
        _local_path(spec, "--stages")
    check_model(model)
    recipe = "vlm" if is_vlm_config(get_model_config(model)) else None
    if Path(model).expanduser().exists():  # a local folder: absolute, as the data (the YAML may live anywhere)
        model = os.path.abspath(Path(model).expanduser())

    def read(spec: str, flag: str) -> DataSource:
        source = inspect_data(spec, flag)
        if yaml_dir is None or source.spec == spec or Path(spec).expanduser().is_absolute():
            return source  # a hub id, or a path given absolute: as given
        relative = os.path.relpath(source.spec, os.path.abspath(yaml_dir))
        return DataSource(relative, source.format, source.rows, source.trains)

    groups = ([[read(d, "--data") for d in data]] if data else []) + [[read(s, "--stages")] for s in stages or []]
    return one_stage_yaml(model, groups, note, output_dir, recipe)


def write_data_recipe(text: str) -> Path:
    """The YAML kept under its content's hash in the cache (recipes/), never overwritten with other content: a run's
    summary names it, and a rerun with the same flags finds the same file."""
    path = get_cache_dir() / "recipes" / f"data-{hashlib.sha256(text.encode()).hexdigest()[:16]}.yaml"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, text)
    return path


def config_from_flags(config: str | None, model: str | None, data: list[str] | None,
                      extra: list[str]) -> tuple[str, list[str], str | None]:
    """(the recipe YAML, the recipe's flags, a banner line or None) for `--config`, `--model`, `--data` as
    `hf-zero train` and `hf-zero check` take them: `--data` builds the one-stage YAML (and cannot go with --config),
    `--model` alone sets model_name_or_path on the config, and no config at all is the default one, said so."""
    if data:
        if config:
            raise UserError("--data", "given with --config", "name the data in the YAML's stages, or drop --config")
        path = write_data_recipe(data_recipe_flags(model, data))
        return str(path), extra, f"config: {path} (built from --model and --data; `hf-zero init` writes it to edit)"
    if model:
        extra = ["--model_name_or_path", model, *extra]
    if config:
        return config, extra, None
    return str(DEFAULT_CONFIG), extra, f"config: {DEFAULT_CONFIG} (the default; pass --config or --data)"
