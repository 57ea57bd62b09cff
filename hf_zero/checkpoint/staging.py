"""The one private Trainer method hf_zero overrides, and why.

The Trainer writes a checkpoint straight into `<output_dir>/checkpoint-N` and offers no hook between "every rank
wrote its files" and "the folder is visible": a crash mid-save leaves a folder any resume takes for the newest
checkpoint. `_save_checkpoint` therefore lets the Trainer save as usual, with the staging area
as its output folder for the length of the save (the Trainer places checkpoint-N under `args.output_dir`, through
`_get_output_dir`); its own rotation only ever sees that one staged folder. hf_zero then verifies the folder, writes
its metadata and manifest, renames it into place and rotates (checkpoint/write.py).
tests/checkpoint/test_trainer_hooks.py fails loudly when transformers changes what this relies on.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from hf_zero.checkpoint.store import STAGING_DIR
from hf_zero.checkpoint.write import complete_checkpoint, is_disk_full, stop_on_full_disk
from hf_zero.core.errors import RunInterrupted
from hf_zero.integrations.deepspeed import frozen_weights_left_out

__all__ = ["StagedCheckpointMixin"]


class StagedCheckpointMixin:
    """Mix into a Trainer subclass (before Trainer): staged, verified, manifest-checked checkpoints."""

    def _save_checkpoint(self, model, trial) -> None:
        chosen = self.args.output_dir
        run_dir = Path(chosen)
        staged = run_dir / STAGING_DIR / f"checkpoint-{self.state.global_step}"
        if self.is_world_process_zero():
            shutil.rmtree(staged, ignore_errors=True)  # left by a crash: never mixed with new files
            staged.parent.mkdir(parents=True, exist_ok=True)
        self.accelerator.wait_for_everyone()
        started = time.time()
        try:
            self.args.output_dir = str(staged.parent)
            # A LoRA checkpoint under DeepSpeed: no frozen weight, tied ones included (integrations/deepspeed.py).
            engine = self.model_wrapped if getattr(self, "is_deepspeed_enabled", False) else None
            try:
                with frozen_weights_left_out(engine):
                    super()._save_checkpoint(model, trial)  # the Trainer's own saving does all the writing
            finally:
                self.args.output_dir = chosen
            complete_checkpoint(self, staged, run_dir, started)
        except BaseException as err:  # FSDP2's CheckpointException (every rank's error) is a BaseException
            if not isinstance(err, (KeyboardInterrupt, SystemExit, GeneratorExit, RunInterrupted)) \
                    and is_disk_full(err, staged):
                stop_on_full_disk(run_dir, staged, err)
            raise
        self.accelerator.wait_for_everyone()
