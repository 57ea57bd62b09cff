"""`hf-zero slurm`: write (or print) an sbatch script that runs a recipe on N nodes (hf_zero/launch/slurm.py)."""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

from hf_zero.launch.slurm import build_sbatch_script
from hf_zero.plan.shipped import DEFAULT_CONFIG

__all__ = ["add_arguments", "run", "ACCEPTS_EXTRA", "DASH_ONLY"]


ACCEPTS_EXTRA = True  # unknown flags go to the recipe (e.g. --learning_rate 1e-4), quoted into the srun line
# The recipe's own --output_dir and --save_steps: read from the recipe flags (--save-steps only applies when the
# recipe saves nothing; the recipe's --save_steps goes to the recipe).
DASH_ONLY = ("--output-dir", "--save-steps")


def add_arguments(parser) -> None:
    parser.add_argument("--profile", required=True, help="profile name or accelerate YAML (e.g. zero3, multinode)")
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="recipe YAML")
    parser.add_argument("--recipe", help="recipe script (default: the YAML's `recipe:`, else the curriculum recipe)")
    parser.add_argument("--nodes", type=int, default=1, help="machines (one Slurm task each)")
    parser.add_argument("--gpus-per-node", type=int, default=0, help="GPUs per node; 0 for CPU nodes")
    parser.add_argument("--nproc-per-node", type=int,
                        help="processes per node (default: --gpus-per-node, or the profile's on CPU nodes)")
    parser.add_argument("--precision", help="override the profile's precision: fp32, bf16 or fp16")
    parser.add_argument("--partition", help="Slurm partition")
    parser.add_argument("--account", help="Slurm account")
    parser.add_argument("--time", help="wall-clock limit, e.g. 04:00:00 or 1-00:00:00")
    parser.add_argument("--cpus-per-task", type=int, help="CPUs per node (the one task runs every rank of the node)")
    parser.add_argument("--job-name", default="hf_zero", help="Slurm job name")
    parser.add_argument("--output-dir", help="run folder; fixed, so a requeued job finds its checkpoints "
                        "(default: the YAML's output_dir or runs/<config name>)")
    parser.add_argument("--log-dir", help="Slurm logs, one per node per job (default: OUTPUT_DIR/slurm_logs)")
    parser.add_argument("--main-port", type=int, default=29500, help="rendezvous port on the first node")
    parser.add_argument("--save-steps", type=int, default=100,
                        help="checkpoint interval added when the recipe saves none (a requeue resumes from it)")
    parser.add_argument("--python", default=sys.executable, help="Python with hf_zero installed (default: this one)")
    parser.add_argument("--out", help="write the script here (default: print it)")


def run(args) -> int:
    called = sys.argv[1:2] == ["slurm"]  # (not when main() was handed its argv directly)
    script = build_sbatch_script(args, list(args.extra), "hf-zero " + shlex.join(sys.argv[1:]) if called else "")
    if not args.out:
        print(script, end="")
        return 0
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(script)
    out.chmod(0o755)
    log_dir = re.search(r"^#SBATCH --output=(.*)/%x-%j\.out$", script, re.M).group(1)
    # sbatch opens the job log before the script runs: its folder must already exist.
    Path(log_dir).mkdir(parents=True, exist_ok=True)
    print(f"[hf_zero] wrote {out}; submit with: sbatch {shlex.quote(str(out))}", file=sys.stderr)
    return 0
