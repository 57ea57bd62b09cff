"""`hf-zero check`: every configuration mistake in one line each, before any process starts.

    hf-zero check --profile zero3 --config recipes/configs/tiny_curriculum.yaml
    hf-zero check --profile h100x8 --gpus 8 --config my.yaml --output-dir /scratch/run1 --per_device_train_batch_size 8

Prints `ok <check>: ...` or `FAIL <check>: ...` per check and exits 0 when all pass, 2 otherwise. Recipe flags after
the known ones are checked as `hf-zero train` would pass them. The checks themselves live in hf_zero.preflight; the
cheap ones run again inside the recipe before the engine is built.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from dataclasses import dataclass, fields, replace
from pathlib import Path

from .errors import EXIT_USAGE, UserError

__all__ = ["CHECKS", "CheckResult", "run_checks", "add_arguments", "run", "ACCEPTS_EXTRA"]

CHECKS = ("profile", "recipe", "batch", "devices", "precision", "launch", "hostfile", "model", "data", "offload",
          "fsdp", "output")
ACCEPTS_EXTRA = True  # recipe flags (e.g. --learning_rate 1e-4) are checked with the YAML


@dataclass
class CheckResult:
    name: str
    ok: bool
    message: str
    error: UserError | None = None

    def line(self) -> str:
        return f"{'ok' if self.ok else 'FAIL'} {self.name}: {self.message}"


class _State:
    """What earlier checks produced for later ones; None when that check failed."""

    def __init__(self, args):
        self.args, self.profile, self.raw, self.parsed = args, None, None, None
        self.tokenizer = self.count = self.pool_sizes = None
        self.hosts = None
        if args.hostfile:  # as `hf-zero train --hostfile` does; a bad file is the hostfile check's to report
            from .hostfile import read_hostfile

            with contextlib.suppress(UserError), contextlib.redirect_stdout(sys.stderr):
                self.hosts = read_hostfile(args.hostfile)

    @property
    def machines(self) -> int:
        return len(self.hosts) if self.hosts else self.profile.num_machines

    @property
    def nproc(self) -> int:
        if self.args.nproc or self.hosts:
            return self.args.nproc or self.hosts[0][1]
        return max(self.profile.num_processes // max(self.profile.num_machines, 1), 1)

    def value(self, key, default=None):
        if self.parsed is None:
            return default
        model_args, data_args, _, training = self.parsed
        for source in (training, vars(model_args), vars(data_args)):
            if key in source:
                return source[key]
        return default


def _profile(st):
    from .preflight import verify_profile_keys
    from .profiles import load_profile, pick_profile

    prof = load_profile(st.args.profile or pick_profile()[0])
    message = verify_profile_keys(prof)
    if st.args.precision:
        if st.args.precision not in ("fp32", "bf16", "fp16"):
            raise UserError("--precision", f"unknown precision {st.args.precision!r}", "use fp32, bf16 or fp16")
        prof = replace(prof, mixed_precision="no" if st.args.precision == "fp32" else st.args.precision)
    st.profile = prof
    return message


def _parse(yaml_values: dict, name: str, extra: list):
    """parse_recipe_args on a copy of the YAML holding only known keys (same file name, so the same default
    output_dir), so that one misspelled key does not hide every other mistake."""
    import yaml
    from transformers import TrainingArguments

    from .config import CurriculumArguments, ModelArguments, parse_recipe_args

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / name
        path.write_text(yaml.safe_dump(yaml_values))
        return parse_recipe_args((ModelArguments, CurriculumArguments, TrainingArguments),
                                 ["--config", str(path), *extra])[:4]


def _recipe(st):
    import difflib

    from transformers import TrainingArguments

    from .config import CurriculumArguments, ModelArguments, Stage, load_yaml_config

    config = st.args.config
    st.raw = raw = load_yaml_config(config)
    known = {f.name for t in (ModelArguments, CurriculumArguments, TrainingArguments) for f in fields(t) if f.init}
    stage_keys = {f.name for f in fields(Stage)}
    stages = raw.get("stages") if isinstance(raw.get("stages"), list) else []
    unknown = [(k, k, known) for k in raw if k not in known | {"stages"}]
    unknown += [(f"stages[{s.get('name', i)}].{k}", k, stage_keys) for i, s in enumerate(stages)
                if isinstance(s, dict) for k in s if k not in stage_keys]
    hints = [f"{label} (did you mean {c[0]}?)" if (c := difflib.get_close_matches(key, sorted(options), n=1))
             else label for label, key, options in unknown]
    problems = [f"unknown keys: {', '.join(hints)}"] if hints else []
    clean = {k: v for k, v in raw.items() if k in known}
    try:
        st.parsed = _parse({**clean, "stages": [{k: v for k, v in s.items() if k in stage_keys} for s in stages
                                                if isinstance(s, dict)] or None}, Path(config).name, st.args.extra)
    except UserError as err:
        problems.append(err.line())
        # Later checks still get values: without the stages (checked one by one under `data`), then without flags.
        for extra in (st.args.extra, []):
            with contextlib.suppress(UserError):
                st.parsed = st.parsed or _parse(clean, Path(config).name, extra)
    if problems:
        raise UserError(f"--config {config}", "; ".join(problems), "fix the spelling or remove those keys" if hints
                        else "")
    flags = f", flags {' '.join(st.args.extra)}" if st.args.extra else ""
    return f"{config}: {len(raw)} settings, {len(stages)} stage(s){flags}"


def _batch(st):
    from .reconcile import plan_batch

    accum = st.value("gradient_accumulation_steps")
    accum = int(1 if accum is None else accum)
    in_profile = (st.profile.raw.get("deepspeed_config") or {}).get("gradient_accumulation_steps")
    if in_profile not in (None, 1, "1") and int(in_profile) != accum:
        raise UserError("gradient_accumulation_steps", f"profile {st.profile.name} says {in_profile} but the recipe "
                        f"says {accum}", "remove gradient_accumulation_steps from the profile (the recipe owns it)")
    world = st.nproc * st.machines
    micro = st.value("per_device_train_batch_size")
    plan = plan_batch(int(1 if micro is None else micro), accum, world, st.value("global_batch_size"))
    return plan.line()


def _devices(st):
    from .preflight import verify_devices
    from .profiles import gpu_count

    return verify_devices(st.profile, st.nproc, gpu_count() if st.args.gpus is None else st.args.gpus)


def _precision(st):
    from .preflight import verify_precision
    from .profiles import gpu_count

    real = gpu_count()
    gpus = real if st.args.gpus is None else st.args.gpus
    return verify_precision(st.profile, st.profile.mixed_precision, st.parsed[3] if st.parsed else {}, gpus,
                            real_gpus=real > 0 and st.args.gpus in (None, real))


def _launch(st):
    from .preflight import verify_launch

    flags = "".join(f" --{k} {v}" for k, v in (("nproc", st.args.nproc), ("hostfile", st.args.hostfile)) if v)
    return verify_launch(st.profile, dict(os.environ), st.args.config, in_recipe=False, hosts=st.hosts,
                         world=st.nproc * st.machines, flags=flags)


def _hostfile(st):
    from .preflight import verify_hostfile

    return verify_hostfile(st.args.hostfile or (st.profile.raw.get("deepspeed_config") or {}).get(
        "deepspeed_hostfile"), st.nproc)


def _model(st):
    from .models import get_model_config, get_tokenizer, resolve_model_path
    from .preflight import count_for

    model_args = st.parsed[0]
    name = model_args.model_name_or_path
    resolve_model_path(name)
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
    st.count = c = count_for(model_args)
    lora = f", LoRA r={model_args.lora_r}: {c.trainable_params:,} trainable" if model_args.use_peft else ""
    return f"{name}: {type(config).__name__.replace('Config', '')}, {c.total_params:,} parameters{lora}"


def _data(st):
    from .config import Stage
    from .data import load_source, load_stage_data

    stages = st.raw.get("stages")
    if not isinstance(stages, list) or not stages or not all(isinstance(s, dict) for s in stages):
        raise UserError("stages", "the recipe needs a non-empty `stages:` list of mappings",
                        "see recipes/configs/tiny_curriculum.yaml")
    names = [s.get("name") for s in stages]
    problems = [f"stage name {n!r} is used {names.count(n)} times" for n in dict.fromkeys(names) if names.count(n) > 1]
    keys = {f.name for f in fields(Stage)}
    seq, text, held, seed = (st.value(k, d) for k, d in (("max_seq_length", 128), ("text_field", "text"),
                                                         ("eval_samples", 32), ("seed", 42)))
    sizes, seen = [], []
    for s in stages:
        try:
            stage = Stage(**{k: v for k, v in s.items() if k in keys})
            if st.tokenizer is None:
                for j, spec in enumerate(stage.data):
                    load_source(spec, f"stages[{stage.name}].data[{j}]")
                continue
            pools = load_stage_data(stage, st.tokenizer, seq, text, held, seed).sources
            sizes.append(sum(map(len, pools)))
            seen.append(f"{stage.name} {'+'.join(str(len(p)) for p in pools)}")
        except (UserError, TypeError) as err:
            problems.append(err.line() if isinstance(err, UserError) else f"stage {s.get('name')}: {err}")
    if problems:
        raise UserError("stages", "; ".join(problems), "fix the stages in the recipe")
    if st.tokenizer is None:
        raise UserError("data", "files readable, but not tokenized: the tokenizer did not load (see model)")
    st.pool_sizes = sizes
    return f"{len(stages)} stage(s), training samples after tokenization: {', '.join(seen)}"


def _offload(st):
    from .memory import estimate
    from .preflight import strategy_of, verify_offload

    nvme = None
    if st.count is not None and "nvme" in (st.profile.offload_optimizer, st.profile.offload_param):
        nvme = estimate(st.count, strategy_of(st.profile), gpus_per_node=st.nproc, nodes=st.machines,
                        precision=st.profile.precision)["nvme_bytes"]
    return verify_offload(st.profile, nvme)


def _fsdp(st):
    from .fsdp import verify_fsdp
    from .models import get_model_config
    from .profiles import gpu_count

    config = None
    if st.profile.uses_fsdp:
        with contextlib.suppress(UserError):  # an unloadable model is the model check's to report
            config = get_model_config(st.parsed[0].model_name_or_path)
    return verify_fsdp(st.profile, st.parsed[3], gpu_count() if st.args.gpus is None else st.args.gpus, config)


def _output(st):
    from .curriculum import build_schedule
    from .preflight import output_needs, verify_output

    _, _, stages, training = st.parsed
    if stages and st.pool_sizes is not None:  # epoch-based stages are sized by their data
        world = st.nproc * st.machines
        per_step = max(1, training["per_device_train_batch_size"] * world * training["gradient_accumulation_steps"])
        steps = build_schedule(stages, st.pool_sizes, per_step, 1.0).total_steps
    else:
        steps = sum(int(s.get("steps") or 0) for s in st.raw.get("stages") or [] if isinstance(s, dict))
    needed, what, _ = output_needs(st.count, st.profile, st.nproc, training, steps)
    return verify_output(st.args.output_dir or training["output_dir"], needed, what)


# check -> (function, what it needs from earlier checks)
_TABLE = {"profile": (_profile, ()), "recipe": (_recipe, ()), "batch": (_batch, ("profile", "parsed")),
          "devices": (_devices, ("profile",)), "precision": (_precision, ("profile",)),
          "launch": (_launch, ("profile",)), "hostfile": (_hostfile, ("profile",)), "model": (_model, ("parsed",)),
          "data": (_data, ("raw",)), "offload": (_offload, ("profile",)), "fsdp": (_fsdp, ("profile", "parsed")),
          "output": (_output, ("profile", "parsed", "count"))}
_WHO = {"profile": "the profile", "parsed": "the recipe", "raw": "the recipe", "count": "the model"}


def run_checks(args, on_result=None) -> list[CheckResult]:
    """Every check in CHECKS order; a check whose inputs failed earlier is reported as not checked."""
    st, results = _State(args), []
    for name in CHECKS:
        func, needs = _TABLE[name]
        missing = [_WHO[n] for n in needs if getattr(st, n) is None]
        if missing:
            result = CheckResult(name, False, f"not checked: {' and '.join(dict.fromkeys(missing))} did not load "
                                 "(see above)")
        else:
            try:
                with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed logs to stdout on import
                    result = CheckResult(name, True, func(st))
            except UserError as err:  # "FAIL devices: devices: ..." says it twice
                line = err.line()[len(name) + 2:] if err.field == name else err.line()
                result = CheckResult(name, False, line, err)
            except Exception as err:  # a check must report, never crash the others
                first = str(err).splitlines()[0][:200] if str(err) else ""
                result = CheckResult(name, False, f"{type(err).__name__}: {first}")
        results.append(result)
        if on_result:
            on_result(result)
    return results


def add_arguments(parser) -> None:
    from .launch import DEFAULT_CONFIG

    parser.add_argument("--profile", help="profile name or accelerate YAML (default: picked from the hardware)")
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="recipe YAML")
    parser.add_argument("--nproc", type=int, help="processes per machine (default: the profile's)")
    parser.add_argument("--hostfile", help="DeepSpeed hostfile (`host slots=N` per line) for a multi-node run")
    parser.add_argument("--output-dir", help="where the run will write (default: the recipe's output_dir)")
    parser.add_argument("--gpus", type=int, help="GPUs per machine to check against (default: this machine's)")
    parser.add_argument("--precision", help="override the profile's precision, as `hf-zero train --precision`")


def run(args) -> int:
    if args.nproc is not None and args.nproc < 1:
        raise UserError("--nproc", f"must be at least 1, got {args.nproc}")
    if args.gpus is not None and args.gpus < 0:
        raise UserError("--gpus", f"cannot be negative, got {args.gpus}")
    args.extra = [a for a in args.extra if a != "--"]
    results = run_checks(args, on_result=lambda r: print(r.line(), flush=True))
    return 0 if all(r.ok for r in results) else EXIT_USAGE
