"""`hf-zero check`: every configuration mistake in one line each, before any process starts.

    hf-zero check --profile zero3 --config recipes/configs/tiny_curriculum.yaml
    hf-zero check --profile h100x8 --gpus 8 --config my.yaml --output-dir /scratch/run1 --per_device_train_batch_size 8

Prints `ok <check>: ...`, `FAIL <check>: ...` or `skip <check>: not checked (...)` (when what it needs failed
earlier) per check and exits 0 when none fails, 2 otherwise. Recipe flags after the known ones are checked as
`hf-zero train` would pass them. The checks live in hf_zero/preflight/ (checks.py); `hf-zero train` runs them all
(light: files read but not tokenized, no cpu_adam build) before it starts any process, and the cheapest run again
inside the recipe before the engine is built.
"""

from __future__ import annotations

from hf_zero.core.errors import EXIT_USAGE, UserError
from hf_zero.plan.one_stage import config_from_flags
from hf_zero.plan.shipped import DEFAULT_CONFIG, recipe_script
from hf_zero.preflight.checks import run_checks

__all__ = ["add_arguments", "run", "ACCEPTS_EXTRA", "DASH_ONLY"]

ACCEPTS_EXTRA = True  # recipe flags (e.g. --learning_rate 1e-4) are checked with the YAML
DASH_ONLY = ("--output-dir",)  # --output_dir is the recipe's own flag: checked with the recipe, as it will run


def add_arguments(parser) -> None:
    parser.add_argument("--profile", help="profile name or accelerate YAML (default: picked from the hardware)")
    parser.add_argument("--config", help=f"recipe YAML (default: {DEFAULT_CONFIG}, unless --data is given)")
    parser.add_argument("--model", help="sets model_name_or_path (with --data: the model of a one-stage recipe)")
    parser.add_argument("--data", nargs="+", metavar="FILE",
                        help="check a one-stage recipe on these files, as `hf-zero train --model M --data FILE`")
    parser.add_argument("--nproc", type=int, help="processes per machine (default: the profile's)")
    parser.add_argument("--hostfile", help="DeepSpeed hostfile (`host slots=N` per line) for a multi-node run")
    parser.add_argument("--output-dir", help="where the run will write (default: the recipe's output_dir)")
    parser.add_argument("--gpus", type=int, help="GPUs per machine to check against (default: this machine's)")
    parser.add_argument("--precision", help="override the profile's precision, as `hf-zero train --precision`")
    parser.add_argument("--recipe", help="recipe script whose arguments the YAML sets (default: the YAML's "
                        "`recipe:`, else the curriculum recipe)")


def run(args) -> int:
    args.config, args.extra, _ = config_from_flags(args.config, args.model, args.data, args.extra)
    args.recipe = str(recipe_script(args.recipe, args.config))
    if args.nproc is not None and args.nproc < 1:
        raise UserError("--nproc", f"must be at least 1, got {args.nproc}")
    if args.gpus is not None and args.gpus < 0:
        raise UserError("--gpus", f"cannot be negative, got {args.gpus}")
    args.extra = [a for a in args.extra if a != "--"]
    results = run_checks(args, on_result=lambda r: print(r.line(), flush=True))
    return EXIT_USAGE if any(r.ok is False for r in results) else 0
