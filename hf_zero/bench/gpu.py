"""`hf-zero bench --preset gpu` (`make bench-gpu`): the one-GPU speed table. A bare PyTorch loop for reference
(benchmarks/torch_loop.py: fp32 weights + bf16 autocast, fused AdamW), then hf_zero's single_gpu, zero2, zero3 and
zero3_offload at one rank, in bf16, on a model built with random weights from a config folder (default: the
TinyLlama-1.1B shape), over packed rows of 8 x 1024 and 8 x 2048 tokens. Each shape gets the full reports in
OUT/seq<S>/; OUT/bench.{md,json,csv} hold the table: s/step, tokens/s, MFU ((6N + 12·L·h·s) per token against the
device's dense bf16 peak, e.g. 989 TFLOP/s for an H100 SXM), peak device memory, speed against single_gpu.

Without a GPU it runs the same table on the CPU (MFU null), which is how its output is tested."""

from __future__ import annotations

import copy
import json
from pathlib import Path

from hf_zero.bench.dryrun import config_only_folder, dry_run
from hf_zero.bench.execute import REFERENCE_SCRIPT, execute
from hf_zero.bench.plan import build_plan, write_plain_spec
from hf_zero.bench.report import machine_line
from hf_zero.bench.views import mib
from hf_zero.core.errors import UserError
from hf_zero.data.cache import build_once, get_cache_dir
from hf_zero.data.model_names import TINY_TOKENIZER_DIR
from hf_zero.plan.shipped import shipped_dir

__all__ = ["add_preset_arguments", "run_preset", "PRESET_STRATEGIES", "DEFAULT_MODEL_CONFIG"]

DEFAULT_MODEL_CONFIG = shipped_dir("benchmarks") / "models" / "llama-1b"
PRESET_STRATEGIES = ("single_gpu", "zero2", "zero3", "zero3_offload")
DATA = "builtin:shakespeare/passages"


def add_preset_arguments(parser) -> None:
    parser.add_argument("--preset", choices=("gpu", "gpu-matrix"), help="gpu: the one-GPU speed table (bare "
                        "PyTorch loop, single_gpu, zero2, zero3, zero3_offload; bf16; packed rows) instead of "
                        "--config/--strategies; gpu-matrix: the speed settings (micro-batch, Liger, torch_compile, "
                        "fused loss, varlen attention, ZeRO-3's gather settings) variant by variant, within --budget")
    parser.add_argument("--model-config", help="--preset gpu: folder with the model's config.json (random weights "
                        "are built from it; default benchmarks/models/llama-1b, TinyLlama-1.1B's shape)")
    parser.add_argument("--seq-lens", default="1024,2048", help="--preset gpu: packed row lengths, one table block "
                        "each (default 1024,2048)")
    parser.add_argument("--micro-batch", type=int, default=8, help="--preset gpu: rows per step (default 8)")
    parser.add_argument("--budget", type=int, help="--preset gpu-matrix: seconds for the whole command; variants "
                        "that would start after it are recorded as not run (default: no limit)")
    parser.add_argument("--variants", help="--preset gpu-matrix: comma-separated variant names (default: all, in "
                        "the order of hf_zero/bench/matrix.py's VARIANTS)")
    parser.add_argument("--dry-run", action="store_true", help="--preset gpu/gpu-matrix: plan every run (recipe, "
                        "data, flags, DeepSpeed settings, launch line) without weights or launches")


def _check(args) -> tuple[Path, list[int]]:
    config = Path(args.model_config or DEFAULT_MODEL_CONFIG)
    if not (config / "config.json").is_file():
        raise UserError("--model-config", f"{config} has no config.json",
                        "give a folder holding a model's config.json")
    try:
        lengths = [int(x) for x in str(args.seq_lens).split(",") if x.strip()]
    except ValueError:
        raise UserError("--seq-lens", f"cannot read {args.seq_lens!r}", "e.g. --seq-lens 1024,2048") from None
    if not lengths or min(lengths) < 8:
        raise UserError("--seq-lens", f"{args.seq_lens!r}: give row lengths of 8 tokens or more", "e.g. 1024,2048")
    if args.micro_batch < 1:
        raise UserError("--micro-batch", f"must be at least 1, got {args.micro_batch}")
    if args.config:
        raise UserError("--config", "does not go with --preset gpu (the preset writes its own recipe)",
                        "drop --config, or drop --preset")
    return config, lengths


def _build_model(folder: Path, config_dir: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TINY_TOKENIZER_DIR)
    config = AutoConfig.from_pretrained(config_dir)
    if len(tokenizer) > config.vocab_size:
        raise UserError("--model-config", f"vocab_size {config.vocab_size} is smaller than the tokenizer's "
                        f"{len(tokenizer)} tokens", "use a config with a larger vocabulary")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def model_folder(config_dir: Path) -> Path:
    """Random-init weights of the config's shape with hf_zero's tiny tokenizer, built once per config."""
    import hashlib

    digest = hashlib.sha256((config_dir / "config.json").read_bytes()).hexdigest()[:12]
    return build_once(get_cache_dir() / "bench_models" / f"{config_dir.name}-{digest}", _build_model, config_dir)


def _recipe(path: Path, model: Path, seq_len: int, micro: int, steps: int) -> Path:
    import yaml

    recipe = {"model_name_or_path": str(model), "packing": True, "eval_samples": 0, "max_seq_length": seq_len,
              "stages": [{"name": "passages", "data": DATA, "steps": steps, "learning_rate": 1.0e-4,
                          "warmup_steps": 1}],
              "per_device_train_batch_size": micro, "gradient_accumulation_steps": 1, "learning_rate": 1.0e-4,
              "seed": 42, "dataloader_num_workers": 0,
              # like for like with the plain PyTorch loop, which has none of Liger's kernels (on by default on a
              # GPU); the speed matrix measures them as variants of their own (`--use_liger_kernel true`)
              "use_liger_kernel": False}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("# Written by `hf-zero bench --preset gpu`.\n" + yaml.safe_dump(recipe, sort_keys=False))
    return path


def table_rows(seq_len: int, report: dict) -> list[dict]:
    ok = {r["name"]: r for r in report["strategies"] if r["status"] == "ok"}
    base = ok.get("single_gpu")
    rows = []
    for r in report["strategies"]:
        row = {"seq_len": seq_len, "rows": report["micro_batch"], "strategy": r["name"], "status": r["status"]}
        if r["status"] == "ok":
            row.update(step_time_s=r["step_time_median_s"], tokens_per_s=r["tokens_per_s"], mfu=r.get("mfu"),
                       peak_memory_bytes=r["peak_memory_bytes_per_rank"], peak_memory_kind=r["peak_memory_kind"],
                       vs_single_gpu=r["tokens_per_s"] / base["tokens_per_s"] if base else None)
        rows.append(row)
    return rows


def _markdown(summary: dict) -> str:
    m = summary["machine"]
    lines = [f"# hf-zero bench --preset gpu: {summary['model']} ({summary['params']:,} params), bf16, 1 rank", "",
             f"Machine: {summary['machine_line']}. {m['date']}." + (" No GPU: this is the CPU fallback, MFU not "
                                                                    "measured." if not m["gpus"] else ""), "",
             f"{summary['steps']} steps per run, the first {summary['warmup']} left out; packed rows of the "
             f"built-in Shakespeare passages; MFU = (6N + 12·L·h·s) x tokens/s / the device's dense bf16 peak. "
             "Full reports per row length in seq<S>/.", "",
             "| rows x tokens | strategy | s/step | tokens/s | MFU | peak memory | vs single_gpu |",
             "|---|---|---|---|---|---|---|"]
    for r in summary["table"]:
        if r["status"] != "ok":
            lines.append(f"| {r['rows']} x {r['seq_len']} | {r['strategy']} | failed | - | - | - | - |")
            continue
        mfu = "-" if r["mfu"] is None else f"{r['mfu']:.3f}"
        vs = "-" if r["vs_single_gpu"] is None else f"{r['vs_single_gpu']:.2f}x"
        lines.append(f"| {r['rows']} x {r['seq_len']} | {r['strategy']} | {r['step_time_s']:.3f} | "
                     f"{r['tokens_per_s']:,.0f} | {mfu} | {mib(r['peak_memory_bytes'])} ({r['peak_memory_kind']}) "
                     f"| {vs} |")
    return "\n".join(lines) + "\n"


def _dry_run_preset(args, config_dir: Path, lengths: list[int]) -> int:
    """Every run of the preset planned, none launched (hf_zero.bench.dryrun): one line per run, exit 1 if any
    would fail before training."""
    model, out, steps, code = config_only_folder(config_dir), Path(args.out), args.steps or 10, 0
    extra = [a for a in getattr(args, "extra", []) if a != "--"]
    for seq_len in lengths:
        recipe = _recipe(out / "recipes" / f"seq{seq_len}.yaml", model, seq_len, args.micro_batch, steps)
        plan = build_plan(str(recipe), None, steps, 1, extra, out / f"seq{seq_len}", min_steps=args.warmup + 2)
        spec = write_plain_spec(plan, "single_gpu", "bf16", out / f"seq{seq_len}" / "reference")
        print(f"[hf_zero bench] dry run, {seq_len} tokens: torch_loop: {REFERENCE_SCRIPT} --spec {spec}"
              + ("" if REFERENCE_SCRIPT.is_file() else " (MISSING)"))
        code = max(code, 0 if REFERENCE_SCRIPT.is_file() else 1)
        for name in PRESET_STRATEGIES:
            done = dry_run(plan, name, ["--disable_tqdm", "true", *extra])
            print(f"[hf_zero bench] dry run, {seq_len} tokens: {name}: "
                  + (done["command"] if done["status"] == "planned" else f"FAILED: {done['cause']}"))
            code = max(code, 0 if done["status"] == "planned" else 1)
    return code


def run_preset(args) -> int:
    import csv

    config_dir, lengths = _check(args)
    if args.dry_run:
        return _dry_run_preset(args, config_dir, lengths)
    model = model_folder(config_dir)
    out, code, blocks = Path(args.out), 0, []
    steps = args.steps or 10
    for seq_len in lengths:
        sub = copy.copy(args)
        sub.out = str(out / f"seq{seq_len}")
        sub.config = str(_recipe(out / "recipes" / f"seq{seq_len}.yaml", model, seq_len, args.micro_batch, steps))
        sub.strategies, sub.nproc, sub.precision, sub.steps = ",".join(PRESET_STRATEGIES), 1, "bf16", steps
        sub.no_packing, sub.extra, sub.model = True, list(getattr(args, "extra", [])), None
        # the one-GPU table has no plain-Trainer column: pairs only when asked (--overhead-repeats N)
        sub.overhead_repeats = args.overhead_repeats or 0
        sub.overhead_strategy = args.overhead_strategy or "single_gpu"
        report, rc = execute(sub, reference=True)
        code = max(code, rc)
        blocks.append((seq_len, report))
    first = blocks[0][1]
    summary = {"preset": "gpu", "model": str(config_dir), "params": first["params"], "machine": first["machine"],
               "machine_line": machine_line(first["machine"]), "steps": steps, "warmup": args.warmup,
               "table": [row for seq_len, report in blocks for row in table_rows(seq_len, report)]}
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(summary, indent=2, default=str))
    (out / "bench.md").write_text(_markdown(summary))
    with open(out / "bench.csv", "w", newline="") as fh:
        fh.write(f"# hf-zero bench --preset gpu, {summary['model']}: {summary['machine_line']}\n")
        keys = ("seq_len", "rows", "strategy", "status", "step_time_s", "tokens_per_s", "mfu", "peak_memory_bytes",
                "peak_memory_kind", "vs_single_gpu")
        writer = csv.writer(fh)
        writer.writerow(keys)
        for r in summary["table"]:
            writer.writerow(["" if r.get(k) is None else r.get(k) for k in keys])
    print((out / "bench.md").read_text())
    print(f"[hf_zero bench] wrote {out / 'bench.md'}, {out / 'bench.json'}, {out / 'bench.csv'}")
    return code
