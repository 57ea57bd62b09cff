"""`hf-zero convert CHECKPOINT --to PROFILE --out DIR`: a checkpoint rewritten for another profile
(hf_zero/checkpoint/convert.py)."""

from __future__ import annotations

from pathlib import Path

from hf_zero.checkpoint.convert import convert_checkpoint
from hf_zero.core.errors import UserError

__all__ = ["add_arguments", "run"]


def add_arguments(parser) -> None:
    parser.add_argument("checkpoint", help="a checkpoint-N folder written under any zero or fsdp2 profile")
    parser.add_argument("--to", required=True, help="the profile the run resumes under, e.g. fsdp2 or zero3")
    parser.add_argument("--nproc", type=int, default=None,
                        help="the number of ranks it resumes on (default: the number that wrote it)")
    parser.add_argument("--out", required=True,
                        help="folder to write (must not exist or be empty): it receives checkpoint-N, so "
                        "`--output_dir DIR` resumes from it")


def run(args) -> int:
    if Path(args.out).exists() and not Path(args.out).is_dir():  # before the checkpoint is read: NotADirectoryError
        raise UserError("--out", f"{args.out} is a file, not a folder", "give a new folder")
    out = convert_checkpoint(args.checkpoint, args.to, args.out, args.nproc)
    print(f"[hf_zero] converted {args.checkpoint} -> {out} ({out.name} for {args.to}); resume with --output_dir "
          f"{out.parent} or --resume_from_checkpoint {out}")
    return 0
