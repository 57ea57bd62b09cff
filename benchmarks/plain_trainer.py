"""The same training as hf_zero's recipe, written with nothing but transformers.Trainer + DeepSpeed (+ peft for LoRA):
the baseline `hf-zero bench` measures hf_zero's overhead against. It imports no hf_zero code, on purpose.

    torchrun --nproc_per_node 2 benchmarks/plain_trainer.py --spec SPEC.json --output_dir DIR

SPEC.json (written by `hf-zero bench`) holds what the user of a plain script would have decided for themselves, set
to exactly what hf_zero used: the model folder and its `from_pretrained` arguments (dtype, attention), LoRA's
settings and the seed, the training rows in step order (packed rows with their position_ids), the learning rate of
every step, the TrainingArguments values, and the path of the DeepSpeed config (the same dict hf_zero hands to the
Trainer, as JSON). Written as a competent user would: rows held in memory, no per-step tokenization, one collator.
It records the same per-rank timings and training fingerprint as hf_zero's bench probe, in the same file format,
and its start-up phases the way hf_zero's ranks do (each phase's name and wall-clock start; HF_ZERO_T0, set by the
bench, is when the launch began).
"""

import argparse
import json
import os
import resource
import time
from pathlib import Path

PHASES = []  # (what this process started doing, wall time): the bench's start-up breakdown


def _phase(doing: str) -> None:
    PHASES.append((doing, time.time()))


def _fingerprint(trainer) -> dict:
    """What was trained, as the engine holds it after step 1: bench refuses to compare runs that differ here."""
    import torch

    model = trainer.model_wrapped
    params = [p for p in model.parameters() if p.requires_grad]
    state = trainer.accelerator.state
    return {"param_dtype": str(params[0].dtype) if params else None,
            "trainable_params": sum(getattr(p, "ds_numel", p.numel()) for p in params),
            "attn_implementation": getattr(trainer.model.config, "_attn_implementation", None),
            "distributed_type": str(state.distributed_type), "mixed_precision": str(state.mixed_precision),
            "world_size": state.num_processes, "torch_threads": torch.get_num_threads()}


def _callback(output_dir: Path, trainer_ref: list):
    from transformers import TrainerCallback

    class StepTimes(TrainerCallback):
        """Wall time of each step's begin and end, peak memory, DDP's bucket bytes: bench_rank{R}.json."""

        def __init__(self):
            self.begin, self.end, self.buckets, self.fingerprint = [], [], 0, {}

        def on_train_begin(self, args, state, control, **kwargs):
            _phase("loading the first batch")

        def on_step_begin(self, args, state, control, **kwargs):
            self.begin.append(time.time())

        def on_step_end(self, args, state, control, **kwargs):
            self.end.append(time.time())
            if len(self.end) > 1:
                return
            self.fingerprint = _fingerprint(trainer_ref[0])
            get = getattr(trainer_ref[0].model_wrapped, "_get_ddp_logging_data", None)
            if get is not None:
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
                      "device_peak_bytes": device, "fingerprint": self.fingerprint,
                      "t0": float(os.environ.get("HF_ZERO_T0") or 0) or None, "startup_phases": PHASES}
            output_dir.mkdir(parents=True, exist_ok=True)
            (output_dir / f"bench_rank{rank}.json").write_text(json.dumps(record))

    return StepTimes()


def _collate(tokenizer):
    """Unpacked rows: transformers' seq2seq collator (pads with the pad token, labels with -100, attention mask).
    Packed rows, whose position_ids restart at every document: stacked without an attention mask and with
    use_cache=False, so that transformers builds the block-diagonal mask that keeps documents apart."""
    import torch
    from transformers import DataCollatorForSeq2Seq

    padded = DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100, padding=True, return_tensors="pt")

    def collate(rows):
        if "position_ids" not in rows[0]:
            return padded(rows)
        width = max(len(r["input_ids"]) for r in rows)

        def stack(key, value):
            return torch.tensor([r[key] + [value] * (width - len(r[key])) for r in rows])

        positions = [r["position_ids"] + list(range(width - len(r["position_ids"]))) for r in rows]
        return {"input_ids": stack("input_ids", tokenizer.pad_token_id), "labels": stack("labels", -100),
                "position_ids": torch.tensor(positions), "use_cache": False}

    return collate


def main():
    _phase("reading the spec")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", required=True, help="JSON written by `hf-zero bench`")
    parser.add_argument("--output_dir", required=True)
    cli = parser.parse_args()
    spec = json.loads(Path(cli.spec).read_text())
    output_dir = Path(cli.output_dir)

    # Under `accelerate launch` with a DeepSpeed profile accelerate refuses a DeepSpeed config handed to the Trainer
    # next to the profile's DeepSpeed fields (so none is silently dropped); the spec's config holds those settings.
    os.environ.pop("ACCELERATE_CONFIG_DS_FIELDS", None)
    _phase("importing torch and transformers")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments, set_seed

    _phase("setting up the process group")
    # TrainingArguments first: with a ZeRO-3 config it is what makes from_pretrained build the model under zero.Init.
    args = TrainingArguments(output_dir=str(output_dir), deepspeed=spec["deepspeed_config"],
                             **spec["training_args"])
    _ = args.device  # sets up the process group now
    if spec["deepspeed_config"] and not torch.cuda.is_available():
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")  # on CPU DeepSpeed must join the gloo group explicitly
    _phase("loading the tokenizer and the data")
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    with open(spec["samples"]) as fh:
        train = [json.loads(line) for line in fh]
    set_seed(spec["seed"])  # LoRA's initial weights are random
    load = dict(spec["from_pretrained"], dtype=getattr(torch, spec["from_pretrained"]["dtype"]))
    _phase("building the model")
    model = AutoModelForCausalLM.from_pretrained(spec["model"], **load)
    if spec["lora"]:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(**spec["lora"]))

    lrs = spec["learning_rates"]

    class PerStepLR(Trainer):
        """The learning rate of every step, as given (hf_zero's curriculum warms up and decays per stage)."""

        def create_scheduler(self, num_training_steps, optimizer=None):
            if self.lr_scheduler is None:
                self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
                    optimizer or self.optimizer, lambda step: lrs[min(step, len(lrs) - 1)] / args.learning_rate)
            return self.lr_scheduler

    ref = []
    _phase("building the Trainer")
    trainer = PerStepLR(model=model, args=args, train_dataset=train, processing_class=tokenizer,
                        data_collator=_collate(tokenizer), callbacks=[_callback(output_dir, ref)])
    ref.append(trainer)
    _phase("initializing the engine")
    trainer.train()
    if trainer.is_world_process_zero():
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h and "step" in h]
        (output_dir / "summary.json").write_text(json.dumps({"losses": losses}))


if __name__ == "__main__":
    main()
