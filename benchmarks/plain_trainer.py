"""The same training as hf_zero's recipe, written with nothing but transformers.Trainer + DeepSpeed: the baseline
`hf-zero bench` measures hf_zero's overhead against. It imports no hf_zero code, on purpose.

    accelerate launch --multi_gpu --num_processes 2 benchmarks/plain_trainer.py --spec SPEC.json --output_dir DIR

SPEC.json (written by `hf-zero bench`) holds what the user of a plain script would have decided for themselves, set
to exactly what hf_zero used: the model folder, a JSONL of training samples (token ids, in step order), the learning
rate of every step, the TrainingArguments values, and the path of the DeepSpeed config (the same dict hf_zero hands
to the Trainer, as JSON). It records the same per-rank timings as hf_zero's bench probe, in the same file format.
"""

import argparse
import json
import os
import resource
import time
from pathlib import Path


def _callback(output_dir: Path, trainer_ref: list):
    from transformers import TrainerCallback

    class StepTimes(TrainerCallback):
        """Wall time of each step's begin and end, peak memory, DDP's bucket bytes: bench_rank{R}.json."""

        def __init__(self):
            self.begin, self.end, self.buckets = [], [], 0

        def on_step_begin(self, args, state, control, **kwargs):
            self.begin.append(time.time())

        def on_step_end(self, args, state, control, **kwargs):
            self.end.append(time.time())
            get = getattr(trainer_ref[0].model_wrapped, "_get_ddp_logging_data", None)
            if len(self.end) == 1 and get is not None:
                data = get()
                if not int(data.get("gradient_as_bucket_view", 0)):
                    self.buckets = sum(int(b) for b in str(data.get("bucket_sizes", "")).split(",") if b.strip())

        def on_train_end(self, args, state, control, **kwargs):
            import psutil
            import torch

            rank = int(os.environ.get("RANK", "0"))
            device = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
            record = {"rank": rank, "world_size": int(os.environ.get("WORLD_SIZE", "1")),
                      "process_start": psutil.Process().create_time(), "step_begin": self.begin,
                      "step_end": self.end, "train_end": time.time(), "ddp_bucket_bytes": self.buckets,
                      "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                      "device_peak_bytes": device}
            output_dir.mkdir(parents=True, exist_ok=True)
            (output_dir / f"bench_rank{rank}.json").write_text(json.dumps(record))

    return StepTimes()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", required=True, help="JSON written by `hf-zero bench`")
    parser.add_argument("--output_dir", required=True)
    cli = parser.parse_args()
    spec = json.loads(Path(cli.spec).read_text())
    output_dir = Path(cli.output_dir)

    import datasets
    import torch
    from transformers import (AutoModelForCausalLM, AutoTokenizer, DataCollatorForSeq2Seq, Trainer,
                              TrainingArguments)

    # TrainingArguments first: with a ZeRO-3 config it is what makes from_pretrained build the model under zero.Init.
    args = TrainingArguments(output_dir=str(output_dir), deepspeed=spec["deepspeed_config"],
                             **spec["training_args"])
    _ = args.device  # sets up the process group now
    if spec["deepspeed_config"] and not torch.cuda.is_available():
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")  # on CPU DeepSpeed must join the gloo group explicitly
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    train = datasets.load_dataset("json", data_files=spec["samples"], split="train")
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)

    lrs = spec["learning_rates"]

    class PerStepLR(Trainer):
        """The learning rate of every step, as given (hf_zero's curriculum warms up and decays per stage)."""

        def create_scheduler(self, num_training_steps, optimizer=None):
            if self.lr_scheduler is None:
                self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
                    optimizer or self.optimizer, lambda step: lrs[min(step, len(lrs) - 1)] / args.learning_rate)
            return self.lr_scheduler

    ref = []
    trainer = PerStepLR(model=model, args=args, train_dataset=train, processing_class=tokenizer,
                        data_collator=DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100, padding=True),
                        callbacks=[_callback(output_dir, ref)])
    ref.append(trainer)
    trainer.train()
    if trainer.is_world_process_zero():
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h and "step" in h]
        (output_dir / "summary.json").write_text(json.dumps({"losses": losses}))


if __name__ == "__main__":
    main()
