"""`hf-zero init`: a commented recipe YAML for a model and your data, to run and grow from.

    hf-zero init --model tiny-llama --data my.jsonl > my.yaml
    hf-zero init --model tiny-llama --stages easy.jsonl hard.jsonl > my.yaml     (one stage per file, in order)

The YAML is the one `hf-zero train --model M --data FILE` builds and runs (hf_zero/plan/one_stage.py): the format
read from the columns, a held-out slice for the eval loss, and, as a comment, the profile this machine would use.
"""

from __future__ import annotations

import sys

from hf_zero.core.console import quiet_environment
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


def run(args) -> int:
    quiet_environment()  # stdout is the YAML: no progress bars or library chatter in it
    profile, why = pick_profile()
    text = data_recipe_flags(args.model, args.data, args.stages, note=[
        f"Profile on this machine: {profile} ({why}); another: hf-zero train --profile NAME (hf-zero profiles "
        "lists them)."])
    sys.stdout.write(text)
    return 0
