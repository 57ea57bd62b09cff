"""What packing buys a stock VLM (docs/vlm.md, Packing): the same image chat rows of varied lengths trained unpacked
and packed (`packing: true`), the same steps, on the `cpu` profile's 2 ranks, compared by non-padding tokens per
optimizer step (a count: the same on any machine, from the Trainer's `num_input_tokens_seen`, all ranks) and tokens
per second (a time: only as quiet as the machine; the runs are interleaved, unpacked and packed in turn, so each
pair's ratio saw the same neighbours).

    python scripts/vlm_packing.py --model hf-zero/tiny-qwen2-vl --out runs/vlm_packing

The rows (written under --out): each a digit image (scikit-learn's 8x8 digits, recipes/data/tiny_multimodal/digits,
resized to 16 x 16 pixels: the tiny Qwen2-VL's size bound, 4 visual tokens) and a question, answered in 1 to 4
sentences; every fourth row a second question and answer. Prints a table and writes <out>/vlm_packing.json.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
DIGITS = REPO / "recipes" / "data" / "tiny_multimodal" / "digits"
NAMES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
QUESTIONS = ("What digit is this?", "Which digit does this small picture show?",
             "Look at the image and tell me which number is written in it, and how you can tell.")
SENTENCES = ("It is drawn in a few grey pixels.", "The strokes are thick and a little blurred.",
             "The picture is only eight pixels on a side, scaled up.", "Its shape is the usual handwritten one.",
             "There is no other mark in the image.", "The background is black and the strokes are light.")


def write_rows(folder: Path, rows: int, seed: int = 0) -> Path:
    """`rows` image chat rows of varied lengths, with their images, in `folder`; the label of each digit is its
    file's (the tiny configs' rows)."""
    from PIL import Image

    labels = {}
    for line in (DIGITS.parent / "digits.jsonl").read_text().splitlines():
        row = json.loads(line)
        image = next(i["image"] for i in row["messages"][0]["content"] if i["type"] == "image")
        labels[Path(image).name] = int(row["messages"][1]["content"][0]["text"])
    rng = random.Random(seed)
    (folder / "img").mkdir(parents=True, exist_ok=True)
    for name in labels:
        Image.open(DIGITS / name).convert("RGB").resize((16, 16)).save(folder / "img" / name)
    names = sorted(labels)
    lines = []
    for n in range(rows):
        name = names[n % len(names)]
        answer = " ".join([f"It is a {NAMES[labels[name]]}."] + rng.sample(SENTENCES, rng.randint(0, 3)))
        messages = [{"role": "user", "content": [{"type": "image", "image": f"img/{name}"},
                                                 {"type": "text", "text": rng.choice(QUESTIONS)}]},
                    {"role": "assistant", "content": [{"type": "text", "text": answer}]}]
        if n % 4 == 3:
            messages += [{"role": "user", "content": [{"type": "text", "text": "Are you sure?"}]},
                         {"role": "assistant", "content": [{"type": "text", "text": " ".join(
                             ["Yes."] + rng.sample(SENTENCES, rng.randint(0, 2)))}]}]
        lines.append(json.dumps({"messages": messages}))
    data = folder / "rows.jsonl"
    data.write_text("\n".join(lines) + "\n")
    return data


def write_config(path: Path, model: str, data: Path, steps: int, batch: int, seq: int, packing: bool) -> Path:
    path.write_text(yaml.safe_dump({
        "recipe": "vlm", "model_name_or_path": model, "use_peft": True, "lora_r": 8, "lora_alpha": 16,
        "lora_dropout": 0.0, "lora_target_modules": ["q_proj", "v_proj"], "image_max_pixels": 256,
        "max_seq_length": seq, "packing": packing, "eval_samples": 0, "sample_prompts": 0,
        "stages": [{"name": "tune", "data": str(data), "steps": steps, "train": ["projector", "lora"]}],
        "per_device_train_batch_size": batch, "gradient_accumulation_steps": 1, "learning_rate": 1.0e-3,
        "seed": 42, "dataloader_num_workers": 0, "save_final_model": False}, sort_keys=False))
    return path


def read_run(out: Path) -> dict:
    """Per optimizer step: non-padding tokens (all ranks) and tokens/s, from the run's log history."""
    history = json.loads((out / "log_history.json").read_text())
    steps = sorted((h for h in history if "loss" in h and "tokens_per_second" in h), key=lambda h: h["step"])
    seen = [0] + [h["num_input_tokens_seen"] for h in steps]
    tokens = [b - a for a, b in zip(seen, seen[1:])]
    timed = [h["tokens_per_second"] for h in steps[1:]] or [h["tokens_per_second"] for h in steps]  # 1st: warm-up
    return {"steps": len(steps), "tokens_per_step": tokens, "mean_tokens_per_step": statistics.mean(tokens),
            "median_tokens_per_second": statistics.median(timed),
            "seconds_per_step": statistics.median(t / s for t, s in zip(tokens[1:] or tokens, timed))}


def train(config: Path, out: Path, nproc: int, profile: str) -> dict:
    cmd = [sys.executable, "-m", "hf_zero.cli", "train", "--profile", profile, "--nproc", str(nproc), "--config",
           str(config), "--output_dir", str(out), "--fresh_start", "true", "--disable_tqdm", "true"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{(proc.stdout + proc.stderr)[-3000:]}")
    return read_run(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--model", default="hf-zero/tiny-qwen2-vl")
    parser.add_argument("--out", default="runs/vlm_packing")
    parser.add_argument("--rows", type=int, default=1200, help="rows written (default 1200)")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps a run (default 30)")
    parser.add_argument("--batch", type=int, default=8, help="rows per rank a step (default 8)")
    parser.add_argument("--max_seq_length", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3, help="unpacked/packed pairs, interleaved (default 3)")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--profile", default="cpu")
    args = parser.parse_args(argv)
    out = (REPO / args.out).resolve() if not Path(args.out).is_absolute() else Path(args.out)
    data = write_rows(out / "data", args.rows)
    configs = {packed: write_config(out / f"{'packed' if packed else 'unpacked'}.yaml", args.model, data, args.steps,
                                    args.batch, args.max_seq_length, packed) for packed in (False, True)}
    runs = {False: [], True: []}
    for r in range(args.repeats):
        for packed in ((False, True) if r % 2 == 0 else (True, False)):  # each goes first in turn
            name = f"{'packed' if packed else 'unpacked'}_{r}"
            runs[packed].append(train(configs[packed], out / name, args.nproc, args.profile))
            last = runs[packed][-1]
            print(f"{name}: {last['mean_tokens_per_step']:,.1f} tokens/step, "
                  f"{last['median_tokens_per_second']:,.0f} tok/s", flush=True)
    plain, packed = runs[False][0], runs[True][0]
    ratios = [p["median_tokens_per_second"] / u["median_tokens_per_second"] for u, p in zip(runs[False], runs[True])]
    result = {
        "model": args.model, "nproc": args.nproc, "profile": args.profile, "steps": args.steps, "rows": args.rows,
        "rows_per_rank_per_step": args.batch, "max_seq_length": args.max_seq_length, "repeats": args.repeats,
        "tokens_per_step": {"unpacked": plain["mean_tokens_per_step"], "packed": packed["mean_tokens_per_step"]},
        "tokens_per_step_gain": packed["mean_tokens_per_step"] / plain["mean_tokens_per_step"],
        "same_tokens_every_repeat": all(r["tokens_per_step"] == runs[k][0]["tokens_per_step"]
                                        for k in runs for r in runs[k]),
        "tokens_per_second": {"unpacked": [r["median_tokens_per_second"] for r in runs[False]],
                              "packed": [r["median_tokens_per_second"] for r in runs[True]]},
        "seconds_per_step": {"unpacked": [r["seconds_per_step"] for r in runs[False]],
                             "packed": [r["seconds_per_step"] for r in runs[True]]},
        "tokens_per_second_ratios": ratios, "median_tokens_per_second_ratio": statistics.median(ratios),
        "command": " ".join(["python", "scripts/vlm_packing.py", *(argv if argv is not None else sys.argv[1:])]),
    }
    (out / "vlm_packing.json").write_text(json.dumps(result, indent=2))
    print(f"{args.model}, {args.nproc} ranks ({args.profile}), {args.steps} steps of {args.batch} rows a rank, "
          f"max_seq_length {args.max_seq_length}:")
    print(f"  non-padding tokens per step: unpacked {plain['mean_tokens_per_step']:,.1f}, packed "
          f"{packed['mean_tokens_per_step']:,.1f} ({result['tokens_per_step_gain']:.2f}x)")
    speeds = {k: ", ".join(f"{x:,.0f}" for x in v) for k, v in result["tokens_per_second"].items()}
    print(f"  tokens/s (median step, each run): unpacked {speeds['unpacked']}; packed {speeds['packed']}; packed / "
          f"unpacked per pair {', '.join(f'{x:.2f}' for x in ratios)} (median "
          f"{result['median_tokens_per_second_ratio']:.2f})")
    print(f"  written: {out / 'vlm_packing.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
