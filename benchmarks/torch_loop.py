"""The reference of `hf-zero bench --preset gpu`: the same training as a bare PyTorch loop, no Trainer, no DeepSpeed,
no hf_zero (fp32 weights + bf16 autocast, fused AdamW, the model's attention, gradient clipping as the Trainer's
max_grad_norm). It reads the spec `hf-zero bench` writes for benchmarks/plain_trainer.py (rows in step order, the
learning rate of every step, from_pretrained arguments, seed) and writes bench_rank0.json and summary.json in the same
format. One process.

    python benchmarks/torch_loop.py --spec SPEC.json --output_dir DIR
"""

import argparse
import json
import resource
import time
from pathlib import Path


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", required=True)
    parser.add_argument("--output_dir", required=True)
    cli = parser.parse_args()
    spec, out = json.loads(Path(cli.spec).read_text()), Path(cli.output_dir)
    if not spec["packing"]:
        raise SystemExit("torch_loop.py trains packed rows (equal lengths, position_ids): use a recipe that packs")

    import psutil
    import torch
    from transformers import AutoModelForCausalLM

    targs = spec["training_args"]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(spec["seed"])
    load = dict(spec["from_pretrained"], dtype=getattr(torch, spec["from_pretrained"]["dtype"]))
    model = AutoModelForCausalLM.from_pretrained(spec["model"], **load).to(device)
    model.train()
    lrs, micro = spec["learning_rates"], targs.get("per_device_train_batch_size", 8)
    accum = targs.get("gradient_accumulation_steps", 1)
    opt = torch.optim.AdamW(model.parameters(), lr=lrs[0], weight_decay=targs.get("weight_decay", 0.0),
                            fused=device == "cuda")
    rows = [json.loads(line) for line in open(spec["samples"])]
    half = torch.bfloat16 if targs.get("bf16") else torch.float16 if targs.get("fp16") else None
    begin, end, losses = [], [], []
    for step, lr in enumerate(lrs):
        begin.append(time.time())
        for group in opt.param_groups:
            group["lr"] = lr
        total = 0.0
        for k in range(accum):
            batch = rows[(step * accum + k) * micro:(step * accum + k + 1) * micro]
            ids = torch.tensor([r["input_ids"] for r in batch], device=device)
            labels = torch.tensor([r["labels"] for r in batch], device=device)
            pos = torch.tensor([r["position_ids"] for r in batch], device=device)
            with torch.autocast(device, dtype=half, enabled=half is not None):
                loss = model(input_ids=ids, labels=labels, position_ids=pos, use_cache=False).loss / accum
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), targs.get("max_grad_norm", 1.0))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
        end.append(time.time())
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_rank0.json").write_text(json.dumps({
        "rank": 0, "world_size": 1, "process_start": psutil.Process().create_time(), "step_begin": begin,
        "step_end": end,
        "train_end": time.time(), "ddp_bucket_bytes": 0, "device_peak_bytes": peak,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "fingerprint": {"param_dtype": str(next(model.parameters()).dtype),
                        "attn_implementation": model.config._attn_implementation}}))
    (out / "summary.json").write_text(json.dumps({"losses": losses}))


if __name__ == "__main__":
    main()
