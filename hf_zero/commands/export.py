"""`hf-zero export CHECKPOINT --out DIR`: a Hugging Face folder from any checkpoint (hf_zero/checkpoint/export.py);
a multimodal run's final/ as a composed model's folder, LoRA merged with --merge-lora (train/composed_export.py)."""

from __future__ import annotations

from hf_zero.checkpoint.export import export_checkpoint
from hf_zero.train.composed_export import export_composed, refuse_composed_checkpoint
from hf_zero.train.composed_generate import composed_folder

__all__ = ["add_arguments", "run"]


def add_arguments(parser) -> None:
    parser.add_argument("checkpoint",
                        help="a checkpoint-N or final/ folder, or a run's output_dir: its final/ when the run "
                        "finished, else its newest complete checkpoint-N")
    parser.add_argument("--out", required=True, help="folder to write (must not exist or be empty)")
    parser.add_argument("--dtype", default="fp32", help="weights dtype: fp32 (default) or bf16")
    parser.add_argument("--merge-lora", dest="merge_lora", action="store_true",
                        help="LoRA checkpoints: merge the adapter into the base model and write the full model (a "
                        "multimodal model: into its LLM, the encoders and projectors beside)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing --out folder (only once the new one is completely written)")
    parser.add_argument("--base-model", dest="base_model", default=None,
                        help="LoRA checkpoints: base model folder if not the one recorded in adapter_config.json")


def run(args) -> int:
    if (composed := composed_folder(args.checkpoint)) is not None:  # a multimodal run's final/ (or its output_dir)
        out = export_composed(composed, args.out, args.dtype, args.merge_lora, args.base_model, args.overwrite)
    else:
        refuse_composed_checkpoint(args.checkpoint)
        out = export_checkpoint(args.checkpoint, args.out, args.dtype, args.merge_lora, args.base_model,
                                args.overwrite)
    print(f"[hf_zero] exported {out['source']} -> {out['out']} "
          f"({out['kind']}, {out['tensors']} tensors, {args.dtype})")
    return 0
