"""`hf-zero init`: a commented recipe YAML for a model and your data, to run and grow from.

    hf-zero init --model tiny-llama --data my.jsonl > my.yaml
    hf-zero init --model tiny-llama --stages easy.jsonl hard.jsonl --out configs/my.yaml   (one stage per file)

The YAML is the one `hf-zero train --model M --data FILE` builds and runs (hf_zero/plan/one_stage.py): the format
read from the columns, a held-out slice for the eval loss, and, as a comment, the profile this machine would use.
Two differences, so that it is a recipe of its own: data named by a relative path is written relative to the YAML's
folder (the current folder when the YAML goes to stdout, --out's folder otherwise: the YAML moves with its data), and
its output_dir is its own (runs/<YAML's name>, or runs/<stage>_yaml on stdout), not the `--data` run's runs/<stage>:
training it right after that run trains, instead of finding a finished run there.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from hf_zero.core.console import quiet_environment
from hf_zero.core.errors import UserError
from hf_zero.core.files import write_text_atomic
from hf_zero.estimate.pick import pick_profile
from hf_zero.plan.one_stage import data_recipe_flags

__all__ = ["add_arguments", "run"]


def add_arguments(parser) -> None:
    parser.add_argument("--model", help="model name, hub id or folder (e.g. tiny-llama, "
                        "HuggingFaceTB/SmolLM2-135M-Instruct)")
    parser.add_argument("--data", nargs="+", metavar="FILE", help="data files for one stage (.jsonl/.json/.csv/"
                        ".parquet/.txt, or a hub dataset id): text, prompt-completion or chat messages")
    parser.add_argument("--stages", nargs="+", metavar="FILE", help="data files, one stage each, in this order "
                        "(a curriculum; after the --data stage when both are given)")
    parser.add_argument("--out", metavar="FILE", help="write the YAML to FILE (data paths relative to its folder) "
                        "instead of stdout (paths relative to the current folder: save it here, e.g. > my.yaml)")


def run(args) -> int:
    quiet_environment()  # stdout is the YAML: no progress bars or library chatter in it
    profile, why = pick_profile()
    out = Path(args.out).expanduser() if args.out else None
    if out is not None and out.is_dir():
        raise UserError("--out", f"{args.out} is a folder", "name the YAML file, e.g. --out my.yaml")
    # its own run folder: runs/<stage> is where `hf-zero train --data` trains the same data
    name = out.stem.replace("{", "{{").replace("}", "}}") if out is not None else None
    output_dir = f"runs/{name}" if name else "runs/{first}_yaml"
    text = data_recipe_flags(args.model, args.data, args.stages, note=[
        f"Profile on this machine: {profile} ({why}); another: hf-zero train --profile NAME (hf-zero profiles "
        "lists them)."], yaml_dir=str(out.parent) if out is not None else os.curdir, output_dir=output_dir)
    if out is None:
        sys.stdout.write(text)
        return 0
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out, text)
    print(f"[hf_zero] wrote {out}; train it: hf-zero train --config {out}")
    return 0
