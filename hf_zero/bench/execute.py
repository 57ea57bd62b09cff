"""`hf-zero bench`: DDP vs ZeRO-1/2/3/offload and FSDP2 side by side on the same model, data, seed, precision and
global batch.

Every strategy runs the real recipe through the real launcher (`accelerate launch`, N ranks). Each rank reports its
step times, start-up and peak memory (hf_zero.train.bench_probe) and the bytes it holds in parameters, gradients and
optimizer state after step 1 (hf_zero.estimate.measure); bench adds `hf-zero estimate`'s figure, FLOPs, and the
largest loss difference against DDP. Then, interleaved A/B, B/A, ..., hf_zero against benchmarks/plain_trainer.py (the
same training in a plain transformers.Trainer + DeepSpeed script, checked to be the same) for the layer's overhead, and
one run with sequence packing switched the other way from the recipe.
Output in --out: bench.json (everything), bench.csv, bench.md, bench.png (hf_zero.bench.report).
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

from hf_zero.bench import report as bench_report
from hf_zero.bench.plan import build_plan, write_plain_spec
from hf_zero.bench.runs import measure_launch, model_state_bytes, root_cause, summarize_run
from hf_zero.core.errors import UserError
from hf_zero.launch.launch_command import build_launch_command
from hf_zero.plan.profiles import list_profiles, load_profile
from hf_zero.plan.shipped import DEFAULT_RECIPE, shipped_dir

# summarize_run, root_cause, model_state_bytes: hf_zero.bench.runs's, re-exported as bench's own.
__all__ = ["execute", "DEFAULT_STRATEGIES", "DEFAULT_BENCH_CONFIG", "PLAIN_SCRIPT",
           "summarize_run", "root_cause", "model_state_bytes", "plain_launch_command", "run_hf_zero"]

DEFAULT_BENCH_CONFIG = shipped_dir("recipes") / "configs" / "bench.yaml"
PLAIN_SCRIPT = shipped_dir("benchmarks") / "plain_trainer.py"
REFERENCE_SCRIPT = shipped_dir("benchmarks") / "torch_loop.py"
DEFAULT_STRATEGIES = "ddp,zero1,zero2,zero3,zero3_offload,fsdp2,fsdp2_offload"


def _check_args(args) -> list[str]:
    if args.overhead_repeats is None:
        args.overhead_repeats = 4
    names = [s.strip() for s in str(args.strategies).split(",") if s.strip()]
    known = list_profiles()
    if not names:
        raise UserError("--strategies", "is empty", f"e.g. --strategies {DEFAULT_STRATEGIES}")
    for name in names:
        if name not in known:
            raise UserError("--strategies", f"unknown strategy {name!r}", f"use profiles from: {', '.join(known)}")
    if len(set(names)) != len(names):
        raise UserError("--strategies", "lists a strategy twice", "name each once")
    for flag, value, low in (("--nproc", args.nproc, 1), ("--steps", args.steps, 1), ("--warmup", args.warmup, 0),
                             ("--overhead-repeats", args.overhead_repeats, 0), ("--timeout", args.timeout, 1),
                             ("--overhead-warmup-pairs", getattr(args, "overhead_warmup_pairs", 0), 0)):
        if value is not None and value < low:
            raise UserError(flag, f"must be at least {low}, got {value}")
    if args.steps is not None and args.steps - args.warmup < 2:
        raise UserError("--steps", f"{args.steps} steps leave fewer than 2 after {args.warmup} warm-up steps",
                        f"use --steps {args.warmup + 2} or more, or a smaller --warmup")
    if args.overhead_strategy and args.overhead_strategy not in names:
        raise UserError("--overhead-strategy", f"{args.overhead_strategy!r} is not among --strategies",
                        "pick one of the benchmarked strategies")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UserError("--out", f"{out} is a file", "give a folder")
    return names


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(threads_per_rank: int, **extra) -> dict:
    """This environment without the switches bench sets per run (a user's export must not leak into the baseline)."""
    switches = ("HF_ZERO_BENCH", "HF_ZERO_MEASURE_MEMORY", "HF_ZERO_PROFILE", "HF_ZERO_BENCH_DEEPSPEED")
    env = {k: v for k, v in os.environ.items() if k not in switches}
    # Same threads per rank under both launchers (torchrun and accelerate each have their own default).
    env.setdefault("OMP_NUM_THREADS", str(threads_per_rank))
    return {**env, **extra}


def _threads(nproc: int) -> int:
    return max(1, (os.cpu_count() or 1) // nproc)


def run_hf_zero(profile: str, plan, args, run_dir: Path, measure: bool, flip_packing: bool = False,
                 switches: dict | None = None) -> dict:
    """One hf_zero run of the bench's recipe; `flip_packing`: with packing switched the other way from the recipe;
    `switches`: bench switches for this run alone (the GPU matrix's DeepSpeed settings)."""
    from hf_zero.train.bench_probe import BENCH_ENV

    packing = plan.packing != flip_packing
    script_args = ["--config", str(plan.recipe_yaml), "--output_dir", str(run_dir), "--disable_tqdm", "true",
                   "--fresh_start", "true", *args.extra, "--packing", str(packing).lower()]
    cmd, env = build_launch_command(profile, str(DEFAULT_RECIPE), script_args, nproc=args.nproc,
                                    precision=args.precision, main_port=_free_port())
    extra = {BENCH_ENV: "1", **({"HF_ZERO_MEASURE_MEMORY": "1"} if measure else {}), **(switches or {})}
    tokens = plan.packed_text_tokens_per_step if packing else plan.unpacked_text_tokens_per_step
    return measure_launch(cmd, _env(_threads(args.nproc), **env, **extra), run_dir, args, tokens, plan.global_batch)


def plain_launch_command(profile: str, nproc: int, port: int, spec: Path, run_dir: Path, launcher: str = "accelerate",
                         precision: str | None = None) -> list[str]:
    """How the plain script is started. "accelerate": `accelerate launch` with the same profile, process count and
    precision as hf_zero's run (build_launch_command, the line hf_zero's recipe gets), so the pair differs only in
    the script. "torchrun": the launcher accelerate itself runs underneath for DeepSpeed and DDP (the plain
    interpreter for a one-process profile without either), which leaves accelerate's own launcher time on hf_zero's
    side. The script takes its precision from the TrainingArguments in the spec, as hf_zero's recipe does."""
    script = [str(PLAIN_SCRIPT), "--spec", str(spec), "--output_dir", str(run_dir)]
    if launcher == "accelerate":
        return build_launch_command(profile, script[0], script[1:], nproc=nproc, precision=precision,
                                    main_port=port)[0]
    if load_profile(profile).distributed_type == "NO" and nproc == 1:
        return [sys.executable, *script]
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", str(nproc),
            "--master_addr", "127.0.0.1", "--master_port", str(port), *script]


def _run_plain(spec: Path, profile: str, args, run_dir: Path, plan) -> dict:
    cmd = plain_launch_command(profile, args.nproc, _free_port(), spec, run_dir,
                               args.plain_launcher, args.precision)
    return measure_launch(cmd, _env(_threads(args.nproc)), run_dir, args, plan.text_tokens_per_step, plan.global_batch)


def _overhead_pairs(plan, args, overhead: str, out: Path, log) -> list[tuple[dict, dict]]:
    """hf_zero / plain Trainer pairs, fresh launches in the order A/B, B/A, A/B, ...: a load that drifts on a shared
    machine, or a first launch that finds cold caches, hits both sides alike."""
    spec = write_plain_spec(plan, overhead, args.precision, out / "plain")
    pairs = []
    for i in range(args.overhead_repeats):
        launch = {"hf": lambda: run_hf_zero(overhead, plan, args, out / "runs" / f"overhead_hf_zero_{i + 1}",
                                             measure=False),
                  "plain": lambda: _run_plain(spec, overhead, args, out / "runs" / f"overhead_plain_{i + 1}", plan)}
        got = {side: launch[side]() for side in (("hf", "plain") if i % 2 == 0 else ("plain", "hf"))}
        a, b = got["hf"], got["plain"]
        pairs.append((a, b))
        log(bench_report.progress_line(f"hf_zero #{i + 1}", a), flush=True)
        log(bench_report.progress_line(f"plain #{i + 1}", b), flush=True)
    return pairs


def _run_reference(plan, args, out: Path) -> dict:
    """The bare PyTorch loop (benchmarks/torch_loop.py) on the same rows, learning rates and precision, one process."""
    spec = write_plain_spec(plan, "single_gpu", args.precision, out / "reference")
    cmd = [sys.executable, str(REFERENCE_SCRIPT), "--spec", str(spec), "--output_dir", str(out / "runs" / "reference")]
    return measure_launch(cmd, _env(_threads(1)), out / "runs" / "reference", args, plan.text_tokens_per_step,
                    plan.global_batch)


def execute(args, reference: bool = False) -> tuple[dict, int]:
    """Every run of one bench, its report written to --out; (report, exit code). `reference`: also the bare PyTorch
    loop (GPU preset)."""
    names = _check_args(args)
    extra = [a for a in getattr(args, "extra", []) if a != "--"]
    args.extra = extra
    config = args.config or str(DEFAULT_BENCH_CONFIG)
    out = Path(args.out)
    loadavg_start = os.getloadavg()
    plan = build_plan(config, args.model, args.steps, args.nproc, extra, out, min_steps=args.warmup + 2,
                      keep_models=args.keep_models)
    overhead = args.overhead_strategy or ("zero2" if "zero2" in names else names[0])
    log = print
    log(f"[hf_zero bench] {plan.model}: {plan.count.total_params:,} params, {plan.total_steps} steps x "
        f"{plan.global_batch} {'packed rows' if plan.packing else 'samples'} (batch: {plan.batch.line()}); "
        f"strategies {', '.join(names)}; output in {out}", flush=True)

    results = {}
    if reference:
        results["torch_loop"] = _run_reference(plan, args, out)
        log(bench_report.progress_line("torch loop (reference)", results["torch_loop"]), flush=True)
    for name in names:
        results[name] = run_hf_zero(name, plan, args, out / "runs" / name, measure=True)
        log(bench_report.progress_line(name, results[name]), flush=True)

    pairs = _overhead_pairs(plan, args, overhead, out, log) if args.overhead_repeats else []

    flipped = None
    if not args.no_packing:
        flipped = run_hf_zero(overhead, plan, args, out / "runs" / ("unpacked" if plan.packing else "packing"),
                               measure=False, flip_packing=True)
        log(bench_report.progress_line(f"{overhead} {'unpacked' if plan.packing else 'packed'}", flipped), flush=True)

    machine = bench_report.machine_info(args.nproc, loadavg_start, args.note)
    report = bench_report.assemble(plan, args, machine, names, results, overhead, pairs, flipped)
    paths = bench_report.write_all(report, out)
    log(bench_report.console_summary(report))
    log(f"[hf_zero bench] wrote {', '.join(str(p) for p in paths)}")
    failed = [r for r in [*results.values(), *(x for p in pairs for x in p), flipped] if r and r["status"] != "ok"]
    checks = report["checks"]
    # fp32 runs of the same training must agree: a difference there is a bug, in hf_zero or in the bench.
    disagree = checks.get("loss_parity") is False or (
        report["precision"] == "fp32" and report["plain_trainer"].get("comparable") is False)
    return report, 1 if failed or disagree else 0


