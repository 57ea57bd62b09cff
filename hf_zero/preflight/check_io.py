"""`hf-zero check`'s checks of what a run loads and writes: the model (and tokenizer), the stages' data, offload
targets and the output folder. Each takes the check state (hf_zero.preflight.checks) and returns a one-line verdict,
None for "not checked for this recipe", or raises UserError."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from types import SimpleNamespace

from hf_zero.checkpoint.compare import (
    check_finished_settings,
    check_resume_reaches,
    check_resume_settings,
    run_settings,
)
from hf_zero.checkpoint.resume import check_profile_switch
from hf_zero.checkpoint.store import list_checkpoints, read_metadata, validate_checkpoint
from hf_zero.core.config import Stage
from hf_zero.core.errors import UserError, flag_hint
from hf_zero.core.validate import yaml_lines
from hf_zero.data.chat import FormatOptions
from hf_zero.data.curriculum import build_schedule
from hf_zero.data.model_names import (
    get_model_config,
    get_tokenizer,
    read_config_json,
    resolve_model_path,
    tokenizer_size,
    weight_module_names,
)
from hf_zero.data.stages import check_stage_files, load_stage_data
from hf_zero.estimate.memory import estimate
from hf_zero.plan.parse import build_stage
from hf_zero.plan.profiles import gpu_count
from hf_zero.plan.quantization import verify_quantization
from hf_zero.preflight.check_rules import (
    count_for,
    output_needs,
    strategy_of,
    verify_offload,
    verify_output,
    verify_seq_length,
    verify_weights_reachable,
)


def model_check(st):
    if not st.curriculum:
        return None
    model_args = st.parsed[0]
    name = model_args.model_name_or_path
    resolve_model_path(name)
    verify_weights_reachable(name)
    if st.light:
        light = _model_files(st, model_args)
        if light is not None:
            return light
    config = get_model_config(name)
    try:
        st.tokenizer = get_tokenizer(name, model_args.tokenizer_name_or_path)
    except (OSError, ValueError) as err:
        raise UserError("tokenizer_name_or_path", f"no tokenizer for {name} ({str(err).splitlines()[0][:120]})",
                        "point tokenizer_name_or_path at a folder with tokenizer files") from None
    vocab = getattr(config, "vocab_size", None)
    if vocab is not None and len(st.tokenizer) > vocab:
        raise UserError("tokenizer_name_or_path", f"the tokenizer has {len(st.tokenizer)} tokens but the model only "
                        f"{vocab} embeddings", "use the model's own tokenizer")
    verify_seq_length(config, st.value("max_seq_length"), st.parsed[-2])
    # a model with parts (encoders, a vision tower) counted whole, by the recipe's own counter: the LLM with its
    # LoRA alone would understate what trains and what the final folder holds
    st.parts = parts = st.count_parts(st.args.config, st.args.extra) if st.count_parts else None
    st.count = c = parts.count if parts else count_for(model_args)
    lora = f", LoRA r={model_args.lora_r}: {c.trainable_params:,} trainable" if model_args.use_peft else ""
    if parts:
        lora = f"{parts.label}; {c.trainable_params:,} trainable in some stage ({', '.join(parts.trains)})"
    quantized = verify_quantization(model_args, st.profile, gpu_count() if st.args.gpus is None else st.args.gpus) \
        if st.profile is not None else None
    return f"{name}: {type(config).__name__.replace('Config', '')}, {c.total_params:,} parameters{lora}" + (
        f"; {quantized}" if quantized else "")


def _model_files(st, model_args):
    """The launch path's model check, from config.json, tokenizer.json and the weights' names read as files:
    transformers' model and tokenizer classes are the ranks' to load (they check the same again, and the sizes from
    the parameter count, before writing anything). None when the files are not local: then the full check."""
    name = model_args.model_name_or_path
    config = read_config_json(name)
    size = tokenizer_size(name, model_args.tokenizer_name_or_path)
    if config is None or size is None:
        return None
    vocab = config.get("vocab_size")
    if isinstance(vocab, int) and size > vocab:
        raise UserError("tokenizer_name_or_path", f"the tokenizer has {size} tokens but the model only {vocab} "
                        "embeddings", "use the model's own tokenizer")
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    verify_seq_length(SimpleNamespace(**text), st.value("max_seq_length"), st.parsed[-2])
    _lora_targets(model_args)
    quantized = verify_quantization(model_args, st.profile, gpu_count() if st.args.gpus is None else st.args.gpus) \
        if st.profile is not None else None
    return f"{name}: {config.get('model_type', 'model')}, {size} tokens; parameters counted by `hf-zero check`" + (
        f"; {quantized}" if quantized else "")


def _lora_targets(model_args) -> None:
    """LoRA's target_modules against the module names in the model's weight files, matched as peft matches a list
    (the name, or its last dotted parts): peft refuses a list of which no name matches."""
    targets = model_args.lora_target_modules
    if not model_args.use_peft or not isinstance(targets, list | tuple) or not targets:
        return  # peft's default targets for the model type, or a regex: the ranks' peft decides
    modules = weight_module_names(model_args.model_name_or_path)
    if modules is None or any(m == t or m.endswith(f".{t}") for m in modules for t in targets):
        return
    ends = sorted({m.rsplit(".", 1)[-1] for m in modules if not m.rsplit(".", 1)[-1].isdigit()})
    raise UserError("lora_target_modules", f"none of {', '.join(targets)} is a module of "
                    f"{model_args.model_name_or_path} (its weights are in: {', '.join(ends[:12])})",
                    "name modules the model has")


def data_check(st):
    if not st.curriculum or st.check_data is not None:  # a recipe's own checker wins (the multimodal recipe's)
        return _recipe_data(st)
    stages = st.raw.get("stages")
    if not isinstance(stages, list) or not stages or not all(isinstance(s, dict) for s in stages):
        raise UserError("stages", "the recipe needs a non-empty `stages:` list of mappings",
                        "see recipes/configs/tiny_curriculum.yaml")
    names = [s.get("name") for s in stages]
    problems = [f"stage name {n!r} is used {names.count(n)} times" for n in dict.fromkeys(names) if names.count(n) > 1]
    keys = {f.name for f in fields(Stage)}
    seq, text, held, seed = (st.value(k, d) for k, d in (("max_seq_length", 128), ("text_field", "text"),
                                                         ("eval_samples", 32), ("seed", 42)))
    sizes, seen, lines = [], [], yaml_lines(st.args.config)
    formats = FormatOptions.from_args(st.recipe_values) if st.parsed else None  # chat formats and column names
    for i, s in enumerate(stages):
        try:
            stage = build_stage({k: v for k, v in s.items() if k in keys}, i, st.args.config, lines)
            if st.tokenizer is None or st.light:  # every file read and parsed as the run reads it, not tokenized
                check_stage_files(stage, held, light=st.light)
                continue
            data = load_stage_data(stage, st.tokenizer, seq, text, held, seed, formats=formats)
            pools, kinds = data.sources, sorted({r.format for r in data.reports} - {"text"})
            sizes.append(sum(map(len, pools)))
            kind = f" ({', '.join(kinds)})" if kinds else ""
            seen.append(f"{stage.name} {'+'.join(str(len(p)) for p in pools)}{kind}")
        except (UserError, TypeError) as err:
            problems.append(err.line() if isinstance(err, UserError) else f"stage {s.get('name')}: {err}")
    if problems:
        # stages that share a source fail with the same line: say it once
        raise UserError("stages", "; ".join(dict.fromkeys(problems)), "fix the stages in the recipe")
    if st.tokenizer is None or st.light:
        why = "`hf-zero check` tokenizes them" if st.light else "not checked: the model did not load (see above)"
        return f"{len(stages)} stage(s), every data file readable; tokenization {why}"
    st.pool_sizes = sizes
    return f"{len(stages)} stage(s), training samples after tokenization: {', '.join(seen)}"


def _recipe_data(st):
    """Another recipe's data, through the checker it declares (CHECK_DATA: stages and its data arguments in, one
    line out); None when it declares none."""
    if st.check_data is None or st.parsed is None:
        return None
    import inspect

    # a checker that also lists what the model trains (the multimodal recipe's) takes the model's arguments: not in
    # the light check before a launch, which reads files only
    wants = "model_args" in inspect.signature(st.check_data).parameters and not st.light
    return st.check_data(st.parsed[-2], st.recipe_values, **({"model_args": st.parsed[0]} if wants else {}))


def offload_check(st):
    nvme = None
    if st.count is not None and "nvme" in (st.profile.offload_optimizer, st.profile.offload_param):
        nvme = estimate(st.count, strategy_of(st.profile), gpus_per_node=st.nproc, nodes=st.shape.nodes,
                        precision=st.profile.precision)["nvme_bytes"]
    return verify_offload(st.profile, nvme, build_cpu_adam=not st.light)


def output_check(st):
    *instances, stages, training = st.parsed
    where = st.args.output_dir or training["output_dir"]
    switch = None
    if not st.value("fresh_start"):
        checkpoint = _compare_with_output(where, run_settings(instances, stages, training), training)
        if checkpoint is not None and st.batch is not None:
            switch = check_profile_switch(checkpoint, st.profile, st.batch.world, st.batch, st.profile.precision)
    if (Path(where) / "summary.json").is_file() and not st.value("fresh_start") and not training.get(
            "resume_from_checkpoint"):
        st.args.finished_run = where  # `hf-zero train` says so without launching
        return (f"{where} holds a finished run: `hf-zero train` will say so and change nothing "
                f"({flag_hint('--fresh_start true')} "
                "trains again, keeping it in previous-run/)")
    if st.count is None:  # the model did not load, or the recipe loads its own: writable is all we can say
        return verify_output(where, 0, "size not estimated")
    if stages and st.pool_sizes is not None and st.batch is not None:  # epoch-based stages are sized by their data
        steps = build_schedule(stages, st.pool_sizes, st.batch.global_batch, 1.0).total_steps
    else:
        steps = sum(int(s.get("steps") or 0) for s in st.raw.get("stages") or [] if isinstance(s, dict))
    needed, what, _ = output_needs(st.count, st.profile, st.nproc, training, steps,
                                   st.parts.final_params if st.parts else None)
    verdict = verify_output(where, needed, what)
    return f"{verdict}; resume: {switch}" if switch else verdict


def _compare_with_output(where, settings: dict, training: dict) -> Path | None:
    """The ranks' comparison (checkpoint/compare.py), before any launch: a finished run asked with other settings,
    or the checkpoint a resume would take trained with other settings, is one line here. Returns that
    checkpoint."""
    import json

    out = Path(where)
    asked = training.get("resume_from_checkpoint")
    if (out / "summary.json").is_file() and not asked:
        try:
            recorded = json.loads((out / "summary.json").read_text()).get("settings")
        except (OSError, ValueError):
            recorded = None
        check_finished_settings(where, recorded, settings)
        return
    if asked:
        checkpoint = Path(asked) if Path(asked).is_dir() else None
    else:  # the newest complete one, as the ranks pick it (sizes only: checksums are the ranks' to read)
        checkpoint = next((c for c in reversed(list_checkpoints(out)) if validate_checkpoint(c, checksums=False)
                           is None), None)
    if checkpoint is not None:
        meta = read_metadata(checkpoint)
        check_resume_settings(checkpoint.name, meta.get("settings"), settings, training.get("allow_changes"))
        check_resume_reaches(checkpoint.name, meta, settings, training.get("max_steps"))
    return checkpoint
