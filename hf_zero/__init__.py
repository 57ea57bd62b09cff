"""hf_zero: one fine-tuning recipe from a laptop CPU to a SLURM cluster.

A thin layer over Accelerate, the transformers Trainer, DeepSpeed ZeRO and PEFT. Heavy libraries are imported
inside functions so that `hf-zero --help` answers at once.
"""

__version__ = "0.1.0"
__all__ = ["__version__", "UserError"]

from .errors import UserError  # noqa: E402
