"""The checks of `hf-zero check`, in one table: every configuration mistake in one line each, before any process
starts. Each check reports `ok`, `FAIL` or `skip` (when what it needs failed earlier). The rules themselves live in
hf_zero.preflight.check_rules and check_io; `hf-zero train` runs them all (light: files read but not tokenized, no
cpu_adam build) before it starts any process, and the cheapest run again inside the recipe before the engine is
built.
"""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass, fields
from pathlib import Path

from hf_zero.core.config import Stage
from hf_zero.core.errors import UserError
from hf_zero.core.validate import resolve_recipe_paths
from hf_zero.data.model_names import get_model_config
from hf_zero.estimate.pick import pick_profile
from hf_zero.plan.fsdp import verify_fsdp
from hf_zero.plan.hostfile import read_hostfile
from hf_zero.plan.parse import load_yaml_config, parse_recipe_args, recipe_fields
from hf_zero.plan.profiles import gpu_count, load_profile, with_precision
from hf_zero.plan.run_plan import resolve_plan
from hf_zero.plan.sequence_parallel import verify_recipe_kind, verify_recipe_sp
from hf_zero.plan.shipped import load_recipe, recipe_argument_types
from hf_zero.plan.world import launch_shape
from hf_zero.preflight.check_rules import (
    verify_devices,
    verify_hostfile,
    verify_launch,
    verify_precision,
    verify_profile_keys,
)

__all__ = ["CHECKS", "CheckResult", "run_checks"]

CHECKS = ("profile", "recipe", "batch", "devices", "precision", "launch", "hostfile", "model", "data", "offload",
          "fsdp", "output")


@dataclass
class CheckResult:
    name: str
    ok: bool | None  # None: not checked, because what it needs failed earlier (reported there, once)
    message: str
    error: UserError | None = None

    def line(self) -> str:
        return f"{ {True: 'ok', False: 'FAIL', None: 'skip'}[self.ok]} {self.name}: {self.message}"


class _State:
    """What earlier checks produced for later ones; None when that check failed."""

    def __init__(self, args, light: bool = False):
        self.args, self.profile, self.raw, self.parsed = args, None, None, None
        self.whole = None  # True once the YAML, its stages and the flags all parsed (not a fallback's values)
        self.light = light
        recipe = load_recipe(getattr(args, "recipe", None))
        self.types = recipe_argument_types(recipe)
        self.check_data = getattr(recipe, "CHECK_DATA", None)  # a recipe's own data checker (curriculum: built in)
        # a recipe's own model counter (a model with parts: hf_zero.train.recipe_count), for the model line
        self.count_parts = getattr(recipe, "COUNT_PARTS", None)
        self.parts = None  # what it counted: hf_zero.estimate.recipe.CountedParts
        self.tokenizer = self.count = self.pool_sizes = self.batch = None
        self.plan = None  # hf_zero.plan.run_plan.RunPlan, once the batch check has resolved it
        self.hosts = None
        if args.hostfile:  # as `hf-zero train --hostfile` does; a bad file is the hostfile check's to report
            with contextlib.suppress(UserError), contextlib.redirect_stdout(sys.stderr):
                self.hosts = read_hostfile(args.hostfile)

    @property
    def shape(self):
        """Ranks and machines as `hf-zero train` launches them for these flags (`--nproc`, `--hostfile`, and
        train's `--nodes`)."""
        return launch_shape(self.profile, nproc=self.args.nproc, nodes=getattr(self.args, "nodes", None),
                            hosts=self.hosts)

    @property
    def nproc(self) -> int:
        return self.shape.per_machine

    def value(self, key, default=None):
        if self.parsed is None:
            return default
        *instances, _, training = self.parsed
        for source in (training, *map(vars, instances)):
            if key in source:
                return source[key]
        return default

    @property
    def recipe_values(self):
        """The recipe's own values (data, formats) as attributes, as its TrainingArguments subclass would hold them."""
        return recipe_fields(self.types[-1], self.parsed[-1])

    @property
    def curriculum(self) -> bool:
        """The model and data checks know the curriculum recipe's loaders; other recipes bring their own."""
        from hf_zero.plan.arguments import CurriculumArguments

        return issubclass(self.types[-1], CurriculumArguments)


def _profile(st):
    prof = load_profile(st.args.profile or pick_profile()[0])
    message = verify_profile_keys(prof)
    st.profile = with_precision(prof, st.args.precision)
    return message


def _parse(st, yaml_values: dict, extra: list):
    """parse_recipe_args on the YAML's known keys only, so that one misspelled key does not hide every other
    mistake (paths and line numbers still come from the file)."""
    return parse_recipe_args(st.types, ["--config", st.args.config, *extra],
                             yaml_values=yaml_values)[:len(st.types) + 1]


def _recipe(st):
    import difflib

    config = st.args.config
    raw = load_yaml_config(config)
    st.raw = resolve_recipe_paths(raw, config)
    known = {f.name for t in st.types for f in fields(t) if f.init}
    stage_keys = {f.name for f in fields(Stage)}
    stages = raw.get("stages") if isinstance(raw.get("stages"), list) else []
    unknown = [(k, k, known) for k in raw if k not in known | {"stages", "recipe"}]
    unknown += [(f"stages[{s.get('name', i)}].{k}", k, stage_keys) for i, s in enumerate(stages)
                if isinstance(s, dict) for k in s if k not in stage_keys]
    hints = [f"{label} (did you mean {c[0]}?)" if (c := difflib.get_close_matches(key, sorted(options), n=1))
             else label for label, key, options in unknown]
    problems = [f"unknown keys: {', '.join(hints)}"] if hints else []
    clean = {k: v for k, v in raw.items() if k in known}
    try:
        st.parsed = _parse(st, {**clean, "stages": [{k: v for k, v in s.items() if k in stage_keys} for s in stages
                                                    if isinstance(s, dict)] or None}, st.args.extra)
        st.whole = True
    except UserError as err:
        if not err.field.startswith("stages"):  # a stage's own mistake is the data check's to report, once
            problems.append(err.line())
        # Later checks still get values: without the stages (checked one by one under `data`), then without flags.
        for extra in (st.args.extra, []):
            with contextlib.suppress(UserError):
                st.parsed = st.parsed or _parse(st, clean, extra)
    if problems:
        raise UserError(f"--config {config}", "; ".join(problems), "fix the spelling or remove those keys" if hints
                        else "")
    flags = f", flags {' '.join(st.args.extra)}" if st.args.extra else ""
    return f"{config}: {len(raw)} settings, {len(stages)} stage(s){flags}"


def _batch(st):
    # the run plan as `hf-zero train`'s launcher resolves it (hf_zero.plan.run_plan), from the values parsed above;
    # env={}: this shell's ACCELERATE_* variables are not the launch's
    *instances, _, training = st.parsed
    st.plan = resolve_plan(st.profile, st.args.recipe, ["--config", st.args.config, *st.args.extra],
                           nproc=st.args.nproc, nodes=st.shape.nodes, hosts=st.hosts, gpus=st.args.gpus,
                           parsed=(instances, training, st.args.config), env={})
    st.batch, world, sp = st.plan.batch, st.plan.world, st.profile.sp_size
    if sp > 1 and st.parsed:
        verify_recipe_kind(sp, st.types[-1])
        model = next((a for a in st.parsed if hasattr(a, "model_name_or_path")), None)
        return f"{st.batch.line()}; {verify_recipe_sp(sp, world, model, st.parsed[-1], st.parsed[-2])}"
    return st.batch.line()


def _devices(st):
    return verify_devices(st.profile, st.nproc, gpu_count() if st.args.gpus is None else st.args.gpus)


def _precision(st):
    real = gpu_count()
    gpus = real if st.args.gpus is None else st.args.gpus
    return verify_precision(st.profile, st.profile.mixed_precision, st.parsed[-1] if st.parsed else {}, gpus,
                            real_gpus=real > 0 and st.args.gpus in (None, real))


def _launch(st):
    flags = "".join(f" --{k} {v}" for k, v in (("nproc", st.args.nproc), ("hostfile", st.args.hostfile)) if v)
    return verify_launch(st.profile, dict(os.environ), st.args.config, in_recipe=False, hosts=st.hosts,
                         world=st.shape.world, flags=flags)


def _hostfile(st):
    return verify_hostfile(st.args.hostfile or (st.profile.raw.get("deepspeed_config") or {}).get(
        "deepspeed_hostfile"), st.nproc)


from hf_zero.preflight.check_io import (  # noqa: E402  (after _State, which they use)
    data_check,
    model_check,
    offload_check,
    output_check,
)


def _fsdp(st):
    config = None
    if st.profile.uses_fsdp and not st.light:  # the layer classes need the model's code: the ranks check them
        with contextlib.suppress(UserError):  # an unloadable model is the model check's to report
            config = get_model_config(st.parsed[0].model_name_or_path)
    return verify_fsdp(st.profile, st.parsed[-1], gpu_count() if st.args.gpus is None else st.args.gpus, config)



# check -> (function, what it needs from earlier checks)
_TABLE = {"profile": (_profile, ()), "recipe": (_recipe, ()), "batch": (_batch, ("profile", "parsed")),
          "devices": (_devices, ("profile",)), "precision": (_precision, ("profile",)),
          "launch": (_launch, ("profile",)), "hostfile": (_hostfile, ("profile",)),
          "model": (model_check, ("parsed",)), "data": (data_check, ("raw",)),
          "offload": (offload_check, ("profile",)), "fsdp": (_fsdp, ("profile", "parsed")),
          "output": (output_check, ("profile", "whole"))}
# The output folder is compared with the settings as they will run: never with a fallback's (no flags, no stages)
_WHO = {"profile": "the profile", "parsed": "the recipe", "raw": "the recipe", "count": "the model",
        "whole": "the recipe"}


def run_checks(args, on_result=None, light: bool = False) -> list[CheckResult]:
    """Every check in CHECKS order; a check whose inputs failed earlier is reported as not checked. `light`: what
    `hf-zero train` runs before a launch (data files read, not tokenized; cpu_adam not built)."""
    st, results = _State(args, light), []
    for name in CHECKS:
        func, needs = _TABLE[name]
        missing = [_WHO[n] for n in needs if getattr(st, n) is None]
        if missing:
            result = CheckResult(name, None, f"not checked: {' and '.join(dict.fromkeys(missing))} did not load "
                                 "(see above)")
        else:
            try:
                with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed logs to stdout on import
                    message = func(st)
                result = CheckResult(name, True, message) if message is not None else CheckResult(
                    name, None, f"not checked: {Path(args.recipe).name} builds its {name} itself")
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
