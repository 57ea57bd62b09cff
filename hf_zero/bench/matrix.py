"""`hf-zero bench --preset gpu-matrix`: the settings that decide the one-GPU speed gap, each a few steps, in one
command with a time budget. The TinyLlama-1.1B shape (random weights) at one rank in bf16 over packed rows of 1024
tokens: micro-batches of 8, 16 and 32 rows (32 only where `hf-zero estimate` says it fits), Liger's kernels,
torch_compile, the fused loss off, flash attention's varlen path for packed rows, and ZeRO-3's gather settings
(persistence threshold, live parameters, prefetch bucket; DeepCompile) beside single_gpu and zero2.

The variants run in VARIANTS' order (what tells most first). Before each one the budget is checked against the
median of the runs so far: once too little is left, every remaining variant is recorded as not run. A variant whose
requirement is missing (no CUDA, liger-kernel or flash-attn) is recorded as not run with the reason; one that fails
keeps its cause. OUT/matrix.md is the table (one file to bring back), with the fastest variant per strategy and the
recipe flags and DeepSpeed settings that make it: what the defaults should become (docs/bench.md). matrix.json and
matrix.csv hold the same rows."""

from __future__ import annotations

import copy
import importlib.util
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from hf_zero.bench import gpu
from hf_zero.bench.dryrun import config_only_folder, dry_run
from hf_zero.bench.execute import run_hf_zero
from hf_zero.bench.matrix_report import write_reports
from hf_zero.bench.plan import build_plan, recipe_types
from hf_zero.bench.report import machine_info, progress_line
from hf_zero.core.errors import UserError
from hf_zero.data.cache import get_cache_dir
from hf_zero.estimate.memory import estimate, strategies_for
from hf_zero.plan.deepspeed_config import BENCH_DEEPSPEED_ENV
from hf_zero.plan.parse import parse_recipe_args

__all__ = ["Variant", "VARIANTS", "run_matrix", "schedule", "variant_names"]

LIGER = ("--use_liger_kernel", "true")
COMPILE = ("--torch_compile", "true")
PERSIST_ALL = {"zero_optimization": {"stage3_param_persistence_threshold": 10**9}}


@dataclass(frozen=True)
class Variant:
    name: str
    strategy: str  # the profile it runs under
    micro: int  # rows of the sequence length per step
    flags: tuple = ()  # recipe flags, as `hf-zero train` takes them
    deepspeed: dict | None = None  # merged over hf_zero's DeepSpeed config (BENCH_DEEPSPEED_ENV)
    needs: tuple = ()  # "cuda", "liger_kernel", "flash_attn": recorded as not run where one is missing


VARIANTS = (
    Variant("single_gpu-mb8", "single_gpu", 8),
    Variant("zero2-mb8", "zero2", 8),
    Variant("zero3-mb8", "zero3", 8),
    Variant("single_gpu-mb16", "single_gpu", 16),
    Variant("single_gpu-mb8-liger", "single_gpu", 8, LIGER, needs=("cuda", "liger_kernel")),
    # at one rank ZeRO-3 saves nothing: every parameter whole is its gather-and-release cost alone
    Variant("zero3-mb8-persist-all", "zero3", 8, deepspeed=PERSIST_ALL),
    Variant("zero3-mb8-prefetch", "zero3", 8, deepspeed={"zero_optimization": {
        "stage3_prefetch_bucket_size": 2 * 10**8, "stage3_max_live_parameters": 3 * 10**9}}),
    Variant("single_gpu-mb8-compile", "single_gpu", 8, COMPILE, needs=("cuda",)),
    Variant("single_gpu-mb8-unfused", "single_gpu", 8, ("--fused_cross_entropy", "false")),
    Variant("single_gpu-mb8-varlen", "single_gpu", 8, ("--attn_implementation", "flash_attention_2"),
            needs=("cuda", "flash_attn")),
    Variant("single_gpu-mb32", "single_gpu", 32),
    Variant("single_gpu-mb16-liger", "single_gpu", 16, LIGER, needs=("cuda", "liger_kernel")),
    # the attention matrices whole (q and o are h^2 = 4.2M elements at this shape), the MLP's still gathered
    Variant("zero3-mb8-persist-1e7", "zero3", 8, deepspeed={"zero_optimization": {
        "stage3_param_persistence_threshold": 10**7}}),
    Variant("zero2-mb16-liger", "zero2", 16, LIGER, needs=("cuda", "liger_kernel")),
    Variant("zero3-mb16-persist-all-liger", "zero3", 16, LIGER, deepspeed=PERSIST_ALL,
            needs=("cuda", "liger_kernel")),
    Variant("single_gpu-mb16-liger-compile", "single_gpu", 16, LIGER + COMPILE, needs=("cuda", "liger_kernel")),
    Variant("zero3-mb8-deepcompile", "zero3", 8, COMPILE, deepspeed={"compile": {"deepcompile": True}},
            needs=("cuda",)),
)


def variant_names() -> list[str]:
    return [v.name for v in VARIANTS]


def _select(spec: str | None) -> list[Variant]:
    if not spec:
        return list(VARIANTS)
    by_name = {v.name: v for v in VARIANTS}
    names = [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [n for n in names if n not in by_name]
    if unknown or not names:
        raise UserError("--variants", f"unknown variant {unknown[0]!r}" if unknown else "is empty",
                        f"use names from: {', '.join(by_name)}")
    return [by_name[n] for n in names]


def _missing(needs: tuple) -> str | None:
    for need in needs:
        if need == "cuda":
            import torch

            if not torch.cuda.is_available():
                return "needs a CUDA GPU"
        elif importlib.util.find_spec(need) is None:
            return f"{need.replace('_', '-')} is not installed"
    return None


def schedule(variants, run_one, budget_s: float, clock=time.monotonic) -> list[dict]:
    """Each variant's row from `run_one(variant, seconds_left)` while the budget lasts: a variant starts only when
    the time left is at least the median of the launches so far; the rest are recorded as not run."""
    start, durations, rows = clock(), [], []
    for v in variants:
        left = budget_s - (clock() - start)
        need = statistics.median(durations) if durations else 1.0
        if left < need:
            rows.append({"variant": v.name, "strategy": v.strategy, "micro_batch": v.micro, "flags": list(v.flags),
                         "deepspeed": v.deepspeed, "status": "not run",
                         "reason": f"budget: {max(left, 0):.0f} of {budget_s:.0f} s left, a run takes ~{need:.0f} s"})
            continue
        began = clock()
        row = run_one(v, left)
        if row["status"] in ("ok", "failed"):
            durations.append(clock() - began)
        rows.append(row)
    return rows


def _check(args) -> tuple[Path, int, list[Variant]]:
    config_dir, lengths = gpu._check(args)
    if args.budget is not None and args.budget < 1:
        raise UserError("--budget", f"must be at least 1 second, got {args.budget}")
    return config_dir, lengths[0], _select(args.variants)


def _estimate(plan, strategy: str) -> int | None:
    (name,), _ = strategies_for(strategy)
    e = estimate(plan.count, name, world_size=1, gpus_per_node=1, precision="bf16", micro_batch=plan.micro,
                 seq_len=plan.seq_len, attn_implementation=plan.model_args.attn_implementation,
                 fused_cross_entropy=plan.training_kwargs.get("fused_cross_entropy", "auto"),
                 use_liger_kernel=plan.training_kwargs.get("use_liger_kernel", "auto"))
    return int(e["gpu_bytes_per_rank"]["total"])


def _with_flags(plan, recipe: Path, flags: tuple):
    """`plan` with the recipe's arguments as `flags` make them (parsed and checked as build_plan parses them)."""
    from dataclasses import replace

    model_args, _, kwargs, _ = parse_recipe_args(recipe_types(), ["--config", str(recipe), *flags])
    return replace(plan, model_args=model_args, training_kwargs=kwargs)


def _device_bytes() -> int | None:
    import torch

    return torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None


def run_matrix(args) -> int:
    import json

    t0, loadavg = time.monotonic(), os.getloadavg()
    config_dir, seq_len, variants = _check(args)
    out, steps, budget = Path(args.out), args.steps or 6, float(args.budget or 10**9)
    if not args.dry_run and args.warmup is not None and steps - args.warmup < 2:
        raise UserError("--steps", f"{steps} steps leave fewer than 2 after {args.warmup} warm-up steps",
                        f"use --steps {args.warmup + 2} or more, or a smaller --warmup")
    model = config_only_folder(config_dir) if args.dry_run else gpu.model_folder(config_dir)
    device_bytes = _device_bytes()
    limit = f"{args.budget} s" if args.budget else "none"
    print(f"[hf_zero bench] gpu-matrix: {len(variants)} variants of {config_dir.name} at {seq_len} tokens per row, "
          f"{steps} steps each, budget {limit}{' (dry run: nothing launched)' if args.dry_run else ''}; "
          f"output in {out}", flush=True)

    meta, plans = {"params": None}, {}

    def run_one(v: Variant, left: float) -> dict:
        row = {"variant": v.name, "strategy": v.strategy, "micro_batch": v.micro, "seq_len": seq_len,
               "flags": list(v.flags), "deepspeed": v.deepspeed}
        missing = _missing(v.needs)
        if missing and not args.dry_run:
            return {**row, "status": "not run", "reason": missing}
        env = {BENCH_DEEPSPEED_ENV: json.dumps(v.deepspeed)} if v.deepspeed else {}
        folder = out / "variants" / v.name
        try:
            recipe = gpu._recipe(out / "recipes" / f"mb{v.micro}.yaml", model, seq_len, v.micro, steps)
            if args.dry_run:  # the rows are the flags' too: one plan per micro-batch, each variant's flags parsed
                if v.micro not in plans:
                    plans[v.micro] = build_plan(str(recipe), None, steps, 1, [], out / "plans" / f"mb{v.micro}",
                                                min_steps=(args.warmup or 0) + 2)
                plan = _with_flags(plans[v.micro], recipe, v.flags)
            else:
                plan = build_plan(str(recipe), None, steps, 1, list(v.flags), folder,
                                  min_steps=(args.warmup or 0) + 2)
            row["estimate_bytes"] = _estimate(plan, v.strategy)
        except UserError as err:
            return {**row, "status": "failed", "reason": str(err)}
        row["flops_per_token"], meta["params"] = plan.flops_per_token, plan.count.total_params
        if args.dry_run:
            done = dry_run(plan, v.strategy, ["--disable_tqdm", "true", *v.flags], env)
            return {**row, **({"status": "failed", "reason": done["cause"]} if done["status"] == "failed" else
                              {"status": "planned", "reason": missing or "", "command": done["command"]})}
        if device_bytes and row["estimate_bytes"] > 0.97 * device_bytes:
            return {**row, "status": "skipped", "reason": f"estimate {row['estimate_bytes'] / 2**30:.1f} GiB > "
                    f"{device_bytes / 2**30:.1f} GiB on the device"}
        sub = copy.copy(args)
        sub.extra, sub.nproc, sub.precision = list(v.flags), 1, "bf16"
        sub.timeout = max(1, int(min(args.timeout, left)))
        result = run_hf_zero(v.strategy, plan, sub, folder / "run", measure=False, switches=env)
        print(progress_line(v.name, result), flush=True)
        if result["status"] != "ok":
            return {**row, "status": "failed", "reason": result.get("cause", ""), "log": result.get("log")}
        return {**row, "status": "ok", "step_time_s": result["step_time_median_s"],
                "tokens_per_s": result["tokens_per_s"], "peak_memory_bytes": result["peak_memory_bytes_per_rank"],
                "peak_memory_kind": result["peak_memory_kind"], "losses": result["losses"],
                "startup_s": result["startup_s"]}

    rows = schedule(variants, run_one, budget - (time.monotonic() - t0))
    machine = machine_info(1, loadavg, args.note)
    summary = {"preset": "gpu-matrix", "model": str(config_dir), "seq_len": seq_len, "steps": steps,
               "warmup": args.warmup, "budget_s": args.budget, "used_s": round(time.monotonic() - t0, 1),
               "dry_run": bool(args.dry_run), "params": meta["params"], "machine": machine,
               "cache": str(get_cache_dir()), "rows": rows}
    paths = write_reports(summary, out)
    print((out / "matrix.md").read_text())
    print(f"[hf_zero bench] wrote {', '.join(str(p) for p in paths)}")
    failed = [r for r in rows if r["status"] == "failed"]
    return 1 if failed or not any(r["status"] in ("ok", "planned") for r in rows) else 0
