"""`hf-zero preview`: a recipe's training samples as the model will see them, before anything is launched.

    hf-zero preview --config recipes/configs/smollm2_chat.yaml -n 1
    hf-zero preview --config my.yaml --stage chat --max_seq_length 256
    hf-zero preview --model tiny-llama --data my.jsonl          (the one-stage recipe `hf-zero train --data` runs)

Per stage and source: the format detected, what carries the loss, token lengths (min / median / p95 / max), how many
samples were truncated or dropped (cut before their answer), the share of tokens that carry loss; then samples
decoded with the tokens that carry loss between [[ and ]]. Recipe flags after the known ones apply as in training.
"""

from __future__ import annotations

from hf_zero.core.errors import UserError
from hf_zero.core.validate import at_least
from hf_zero.data.chat import FormatOptions
from hf_zero.data.model_names import get_tokenizer
from hf_zero.data.packing import pack_documents, pad_id, padding_stats
from hf_zero.data.preference import sample_views
from hf_zero.data.stages import load_stage_data
from hf_zero.estimate.pick import pick_profile
from hf_zero.plan.one_stage import config_from_flags
from hf_zero.plan.parse import parse_recipe_args, recipe_fields
from hf_zero.plan.profiles import load_profile
from hf_zero.plan.run_plan import resolve_plan
from hf_zero.plan.shipped import DEFAULT_CONFIG, load_recipe, recipe_argument_types, recipe_script

__all__ = ["add_arguments", "run", "marked_text", "source_lines", "plan_line", "packing_line", "ACCEPTS_EXTRA"]

ACCEPTS_EXTRA = True  # recipe flags, e.g. --max_seq_length 64
OPEN, CLOSE = "[[", "]]"


def add_arguments(parser) -> None:
    parser.add_argument("--config", help=f"recipe YAML (default: {DEFAULT_CONFIG}, unless --data is given)")
    parser.add_argument("--model", help="model name, hub id or folder: sets model_name_or_path (with --data: the "
                        "model of a one-stage recipe)")
    parser.add_argument("--data", nargs="+", metavar="FILE", help="preview these files as one stage, without a YAML "
                        "(as hf-zero train --model M --data FILE trains them)")
    parser.add_argument("--stage", help="only this stage (default: all)")
    parser.add_argument("-n", "--samples", type=int, default=3, help="samples shown per source (default 3)")
    parser.add_argument("--profile", help="the profile the plan line is resolved for (default: picked from the "
                        "hardware, as hf-zero train picks it)")
    parser.add_argument("--nproc", type=int, help="processes per machine for the plan line (default: the profile's)")
    parser.add_argument("--precision", help="override the profile's precision: fp32, bf16 or fp16")


def marked_text(tokenizer, sample: dict) -> str:
    """The sample decoded, special tokens included, with the tokens that carry loss between [[ and ]]."""
    out, run, trained = [], [], None
    for tok, label in zip(sample["input_ids"], sample["labels"]):
        if (label != -100) != trained and run:
            text = tokenizer.decode(run, skip_special_tokens=False)
            out.append(f"{OPEN}{text}{CLOSE}" if trained else text)
            run = []
        trained = label != -100
        run.append(tok)
    if run:
        text = tokenizer.decode(run, skip_special_tokens=False)
        out.append(f"{OPEN}{text}{CLOSE}" if trained else text)
    return "".join(out)


def source_lines(report) -> list[str]:
    import numpy as np

    n = np.asarray(report.lengths)
    lines = [f"{report.format}, loss on {report.trains}",
             f"{report.rows:,} rows -> {len(n):,} samples; {report.truncated:,} truncated, {report.dropped:,} dropped "
             f"(cut before the answer){f', {report.empty:,} empty' if report.empty else ''}"]
    if len(n):
        lines.append(f"tokens per sample: min {n.min()} / median {int(np.median(n))} / p95 "
                     f"{int(np.percentile(n, 95))} / max {n.max()}; "
                     f"{100 * report.loss_tokens / n.sum():.1f}% carry loss")
    return lines


def run(args) -> int:
    from hf_zero.plan.arguments import CurriculumArguments, ModelArguments
    if args.samples < 0:
        raise UserError("-n", f"must be 0 or more, got {args.samples}")
    # the same recipe `hf-zero train` would run for these flags (--data: the one-stage YAML it builds)
    args.config, extra, _ = config_from_flags(args.config, args.model, args.data, args.extra)
    if _multimodal(args.config):
        return _preview_multimodal(args, extra)
    model_args, stages, training, _ = parse_recipe_args(
        (ModelArguments, CurriculumArguments), ["--config", args.config, *extra])
    print(plan_line(args, extra, (model_args,), training))
    data_args = recipe_fields(CurriculumArguments, training)
    if args.stage:
        names = [s.name for s in stages]
        if args.stage not in names:
            raise UserError("--stage", f"no stage {args.stage!r} in {args.config}", f"use one of: {', '.join(names)}")
        stages = [s for s in stages if s.name == args.stage]
    tokenizer = get_tokenizer(model_args.model_name_or_path, model_args.tokenizer_name_or_path)
    for stage in stages:
        length = stage.max_seq_length or data_args.max_seq_length
        data = load_stage_data(stage, tokenizer, data_args.max_seq_length, data_args.text_field,
                               data_args.eval_samples, training.get("seed", 42),
                               formats=FormatOptions.from_args(data_args))
        print(f"stage {stage.name!r}: {len(stage.data)} source(s), max_seq_length {length}, "
              f"{data.pool_size:,} training samples, {len(data.eval_samples):,} held out")
        if data_args.packing and stage.objective != "dpo":  # a dpo stage is not packed
            print(packing_line(data.sources, length, tokenizer.pad_token_id))
        for j, (report, samples) in enumerate(zip(data.reports, data.sources)):
            print(f"  data[{j}] {report.spec}: " + "\n    ".join(source_lines(report)))
            for i, sample in enumerate(samples[: args.samples]):
                for name, view in sample_views(sample):  # a preference row: its chosen and rejected sequences
                    print(f"  sample {i + 1}{name} ({len(view['input_ids'])} tokens; loss on the tokens between "
                          f"{OPEN} and {CLOSE}):")
                    print("    " + marked_text(tokenizer, view).rstrip().replace("\n", "\n    "))
    return 0


def packing_line(sources: list[list[dict]], length: int, pad_id: int) -> str:
    """How a stage's training samples pack: rows of its length and the share of their tokens that are text."""
    rows = pack_documents([s for src in sources for s in src], length, pad_id)
    samples = sum(len(src) for src in sources)
    return (f"  packing: {samples:,} samples in {len(rows):,} rows of {length} tokens, "
            f"{100 * padding_stats(rows, 1)['non_padding_fraction']:.1f}% text")


def plan_line(args, extra: list[str], instances: tuple, training: dict) -> str:
    """The run these samples train in, as `hf-zero train` would resolve it (hf_zero.plan.run_plan): its profile,
    ranks, batch and precision."""
    at_least("--nproc", args.nproc)
    profile = load_profile(args.profile or pick_profile()[0])
    plan = resolve_plan(profile, str(recipe_script(None, args.config)), ["--config", args.config, *extra],
                        nproc=args.nproc, precision=args.precision, parsed=(instances, training, args.config), env={})
    return (f"plan: profile {plan.profile.name}, {plan.world} rank(s) on {plan.nodes} machine(s); "
            f"batch: {plan.batch.line()} | precision: {plan.precision}")


def _multimodal(config: str) -> bool:
    """Whether the YAML's recipe composes encoders (recipes/multimodal.py) or trains a stock VLM (recipes/vlm.py)."""
    types = recipe_argument_types(load_recipe(str(recipe_script(None, config))))
    return any({"encoders", "image_max_pixels"} & set(getattr(t, "__dataclass_fields__", {})) for t in types)


def placeholder_runs(sample: dict, placeholder_ids: dict, tokens: dict) -> list[tuple[str, int, int, str]]:
    """(modality, first position, positions, file) of each modality item of a sample, in reading order: the k-th
    item of a modality fills the k-th `tokens` of that modality's placeholder positions (as the model fills them).
    `tokens` None: a stock VLM's items, whose runs differ in length (hf_zero.data.vlm): each run of the image token
    is one item's (one tile's, for a family that splits images)."""
    if tokens is None:
        import itertools

        ids, runs, p = sample["input_ids"], [], 0
        for t, group in itertools.groupby(ids):
            n = len(list(group))
            if t in placeholder_ids.values():
                runs.append((next(m for m, i in placeholder_ids.items() if i == t), p, n))
            p += n
        media = [path for _, path in sample.get("media", ())]
        return [(m, pos, n, media[k] if len(media) == len(runs) else "") for k, (m, pos, n) in enumerate(runs)]
    at = {m: [p for p, t in enumerate(sample["input_ids"]) if t == i] for m, i in placeholder_ids.items()}
    seen, runs = {}, []
    for kind, path in sample.get("media", ()):
        k = seen[kind] = seen.get(kind, -1) + 1
        where = at[kind][k * tokens[kind]:(k + 1) * tokens[kind]]
        runs.append((kind, where[0], len(where), path))
    return sorted(runs, key=lambda r: r[1])


def _preview_multimodal(args, extra) -> int:
    """A multimodal recipe's stages: per source its rows, then samples with each modality item shown as its
    placeholder and how many positions it takes (`<points> x4`), and where each item goes in the row."""
    import re

    from hf_zero.plan.arguments import ModelArguments
    from hf_zero.train.composed_count import multimodal_data
    from hf_zero.train.vlm_check import vlm_data

    types = recipe_argument_types(load_recipe(str(recipe_script(None, args.config))))
    model_args, *_, all_stages, training, _ = parse_recipe_args(types, ["--config", args.config, *extra])
    if not isinstance(model_args, ModelArguments):
        raise UserError("recipe", "the multimodal recipe's first arguments are not ModelArguments", "check recipe:")
    print(plan_line(args, extra, (model_args,), training))
    stages = [s for s in all_stages if s.name == args.stage] if args.stage else all_stages
    if not stages:
        raise UserError("--stage", f"no stage {args.stage!r} in {args.config}",
                        f"use one of: {', '.join(s.name for s in all_stages)}")
    vlm = any("image_max_pixels" in getattr(t, "__dataclass_fields__", {}) for t in types)  # recipes/vlm.py
    tokenizer, specs, placeholders, data = (vlm_data if vlm else multimodal_data)(model_args, training, stages)
    print("modalities: " + ", ".join(f"{m} {s.placeholder} = {s.tokens} tokens per item (input {list(s.input_shape)})"
                                     if not vlm else f"{m} {s.placeholder}, its count per image from the processor"
                                     for m, s in specs.items()))
    seq = training["max_seq_length"]
    for stage, stage_data in zip(stages, data):
        print(f"stage {stage.name!r}: {len(stage.data)} source(s), max_seq_length {stage.max_seq_length or seq}, "
              f"{stage_data.pool_size:,} training samples, {len(stage_data.eval_samples):,} held out")
        if training.get("packing"):  # each conversation with its items (hf_zero.data.packing)
            print(packing_line(stage_data.sources, stage.max_seq_length or seq, pad_id(tokenizer)))
        for j, (report, samples) in enumerate(zip(stage_data.reports, stage_data.sources)):
            print(f"  data[{j}] {report.spec}: " + "\n    ".join(source_lines(report)))
            for i, sample in enumerate(samples[: args.samples]):
                tokens = None if vlm else {m: sp.tokens for m, sp in specs.items()}
                runs = placeholder_runs(sample, placeholders, tokens)
                print(f"  sample {i + 1} ({len(sample['input_ids'])} tokens, {len(runs)} modality item(s); loss on "
                      f"the tokens between {OPEN} and {CLOSE}):")
                for kind, pos, tokens, path in runs:
                    print(f"    {specs[kind].placeholder} x{tokens} at positions {pos}-{pos + tokens - 1}: {path}")
                text = marked_text(tokenizer, sample)
                for s in specs.values():  # a run of n placeholder tokens shown once, with its count
                    text = re.sub(f"(?:{re.escape(s.placeholder)})+",
                                  lambda mt, ph=s.placeholder: f"{{{ph} x{len(mt.group()) // len(ph)}}}", text)
                print("    " + text.rstrip().replace("\n", "\n    "))
    return 0
