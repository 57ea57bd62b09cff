"""`hf-zero bench`'s results: one dict (bench.json) and its views, bench.csv, bench.md and bench.png, each naming
the machine, ranks and library versions it was measured on."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path

from hf_zero import __version__
from hf_zero.bench.compare import TARGETS, loss_agreement, max_abs_diff, offload_split, overhead
from hf_zero.bench.plan import estimate_bytes
from hf_zero.bench.plot import plot
from hf_zero.bench.views import markdown, mib, startup_markdown, table, write_csv
from hf_zero.core.files import human_bytes
from hf_zero.estimate.flops import device_peak_flops
from hf_zero.plan.profiles import load_profile

__all__ = ["machine_info", "assemble", "write_all", "progress_line", "console_summary", "TARGETS"]


def console_summary(report) -> str:
    """The table, then the start-up breakdown: its tables as they are, its prose as the bench's own lines."""
    startup = [line if not line or line.startswith("|") else f"[hf_zero bench] {line.lstrip('# ')}"
               for line in startup_markdown(report).splitlines()]
    return table(report) + "\n\n" + "\n".join(startup)


def machine_info(nproc: int, loadavg_start, note: str = "") -> dict:
    import accelerate
    import deepspeed
    import peft
    import torch
    import transformers

    info = Path("/proc/cpuinfo")
    cpu = next((ln.split(":", 1)[1].strip() for ln in info.read_text().splitlines() if ln.startswith("model name")),
               platform.processor()) if info.exists() else platform.processor()
    gpus = [torch.cuda.get_device_name(i)
            for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0)]
    return {
        "cpu": cpu, "logical_cpus": os.cpu_count(),
        "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        "gpus": gpus, "device": "cuda" if gpus else "cpu", "ranks": nproc, "os": platform.platform(),
        "threads_per_rank": int(os.environ.get("OMP_NUM_THREADS") or max(1, (os.cpu_count() or 1) // nproc)),
        "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
        "accelerate": accelerate.__version__, "deepspeed": deepspeed.__version__, "peft": peft.__version__,
        "hf_zero": __version__, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "loadavg_start": [round(x, 2) for x in loadavg_start], "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        "note": note,
    }


def machine_line(m: dict) -> str:
    where = f"{len(m['gpus'])}x {m['gpus'][0]}" if m["gpus"] else f"CPU only, {m['cpu']}, {m['logical_cpus']} cores"
    ranks = f"{m['ranks']} rank{'s' if m['ranks'] != 1 else ''}"
    return (f"{where}, {human_bytes(m['memory_bytes'], digits=0, unit='GiB')} RAM; {ranks}; torch {m['torch']}, "
            f"transformers {m['transformers']}, accelerate {m['accelerate']}, deepspeed {m['deepspeed']}, "
            f"peft {m['peft']}")


def _ratio(a, b):
    return a / b if a is not None and b else None


def assemble(plan, args, machine, names, results, overhead_strategy, pairs, flipped) -> dict:
    precision = args.precision or load_profile(names[0]).precision
    peak = device_peak_flops(machine["gpus"][0] if machine["gpus"] else None, precision)
    ok = {n: results[n] for n in names if results[n]["status"] == "ok"}
    agreement = loss_agreement(ok, precision)
    ref = agreement["reference"]
    rows = []
    for name in names:
        r, prof = results[name], load_profile(name)
        est = estimate_bytes(plan, name, precision)
        row = {"name": name, "zero_stage": int(prof.zero_stage or 0), "offload_optimizer": prof.offload_optimizer,
               "offload_param": prof.offload_param, **r, "estimate_bytes_per_rank": est["device"] + est["host"],
               "estimate_device_bytes_per_rank": est["device"], "estimate_host_bytes_per_rank": est["host"],
               "estimate_source": est["source"],
               "flops_per_step": plan.flops_per_token * statistics.mean(plan.text_tokens_per_step)}
        if r["status"] == "ok":
            row["achieved_flops_per_s"] = plan.flops_per_token * r["tokens_per_s"]
            row["mfu"] = row["achieved_flops_per_s"] / (peak * plan.nproc) if peak else None
            row["max_abs_loss_diff_vs_reference"] = agreement["max_abs_diff_vs_reference"].get(name)
            if r.get("model_state_by_rank"):
                split = [offload_split(m, prof.offload_optimizer, prof.offload_param)
                         for m in r["model_state_by_rank"]]
                row["model_state_device_bytes_per_rank"] = max(x["device"] for x in split)
                row["model_state_host_bytes_per_rank"] = max(x["host"] for x in split)
        rows.append(row)
    if "torch_loop" in results:  # the GPU preset's bare PyTorch loop: no profile, no engine to measure
        loop = results["torch_loop"]
        row = {"name": "torch_loop", **loop, "estimate_device_bytes_per_rank": None, "estimate_host_bytes_per_rank": 0}
        if loop["status"] == "ok":
            row["achieved_flops_per_s"] = plan.flops_per_token * loop["tokens_per_s"]
            row["mfu"] = row["achieved_flops_per_s"] / peak if peak else None
            row["max_abs_loss_diff_vs_reference"] = max_abs_diff(loop["losses"], ok[ref]["losses"]) if ref else None
        rows.insert(0, row)
    report = {
        "machine": machine, "nproc": plan.nproc, "precision": precision, "model": plan.model,
        "params": plan.count.total_params, "trainable_params": plan.count.trainable_params,
        "steps": plan.total_steps, "warmup_steps": args.warmup, "global_batch": plan.global_batch,
        "micro_batch": plan.micro, "grad_accum": plan.accumulation, "seq_len": plan.seq_len, "packing": plan.packing,
        "flops_per_token": plan.flops_per_token, "recipe": str(plan.recipe_yaml), "strategies": rows,
        "loss_reference": ref, "loss_agreement": agreement,
        "plain_trainer": {**overhead(overhead_strategy, pairs, precision, getattr(args, "overhead_warmup_pairs", 0)),
                          "launcher": args.plain_launcher},
        "packing_comparison": _packing(plan, overhead_strategy, results.get(overhead_strategy), flipped),
        "targets": TARGETS, "retries": _retries(results, pairs, flipped),
    }
    report["checks"] = _checks(report, {r["name"]: r for r in rows if r["status"] == "ok" and r["name"] in names},
                               precision)
    return report


def _retries(results, pairs, flipped) -> list[dict]:
    """Runs whose first launch crashed and were launched again: listed in the report, so that none goes unseen."""
    named = [*results.items(), *((f"hf_zero #{i + 1}", a) for i, (a, _) in enumerate(pairs)),
             *((f"plain #{i + 1}", b) for i, (_, b) in enumerate(pairs)),
             *([("packing switched", flipped)] if flipped else [])]
    return [{"run": name, **r["retried_after"], "second_attempt": r["status"]} for name, r in named
            if r.get("retried_after")]


def _packing(plan, strategy, as_recipe, flipped) -> dict:
    """The recipe's layout against the other one (packed against unpacked, whichever the recipe trains)."""
    out = {"strategy": strategy, "recipe_packs": plan.packing,
           "non_padding_fraction_unpacked": plan.padding["unpacked"]["non_padding_fraction"],
           "non_padding_fraction_packed": plan.padding["packed"]["non_padding_fraction"],
           "text_tokens_unpacked": sum(plan.unpacked_text_tokens_per_step),
           "text_tokens_packed": sum(plan.packed_text_tokens_per_step), "status": "skipped"}
    if flipped is None:
        return out
    out["status"] = flipped["status"]
    packed, unpacked = (as_recipe, flipped) if plan.packing else (flipped, as_recipe)
    if flipped["status"] == "ok" and as_recipe and as_recipe["status"] == "ok":
        out.update(tokens_per_s_unpacked=unpacked["tokens_per_s"], tokens_per_s_packed=packed["tokens_per_s"],
                   tokens_per_s_ratio=packed["tokens_per_s"] / unpacked["tokens_per_s"],
                   packed_losses=packed["losses"], unpacked_losses=unpacked["losses"])
    return out


def _within(value, limit, below=True):
    return None if value is None else (value <= limit if below else value >= limit)


def _checks(report, ok, precision) -> dict:
    """The targets; ZeRO's memory ratios only where sharding exists (N >= 2: at one rank every stage holds all)."""
    t = report["targets"]
    diffs = [r.get("max_abs_loss_diff_vs_reference") for n, r in ok.items() if n != report["loss_reference"]]
    parity = None
    if report["loss_reference"] == "ddp" and diffs and precision == "fp32":
        parity = all(d is not None and d <= t["loss_parity_atol"] for d in diffs)
    sharded = report["nproc"] >= 2
    state = {n: r.get("model_state_bytes_per_rank") for n, r in ok.items()} if sharded else {}
    z3 = _ratio(state.get("zero3"), state.get("ddp"))
    fsdp2 = _ratio(state.get("fsdp2"), state.get("ddp"))
    # FSDP2 shards what ZeRO-3 shards: it belongs below every stage that keeps whole parameters or gradients.
    above = [n for n in ("ddp", "zero1", "zero2") if state.get(n)]
    peak = {n: r.get("model_state_peak_bytes_per_rank") for n, r in ok.items()}
    paper = [n for n in ("ddp", "zero1", "zero2", "zero3") if state.get(n)]
    over, pack = report["plain_trainer"], report["packing_comparison"]
    return {
        "loss_parity": parity,
        "zero3_over_ddp_model_state": z3,
        "zero3_over_ddp_within_target": _within(z3, t["zero3_over_ddp_model_state_max"]),
        "zero3_over_ddp_model_state_peak": _ratio(peak.get("zero3"), peak.get("ddp")) if sharded else None,
        "model_state_order": paper,
        "model_state_in_paper_order": all(state[a] > state[b] for a, b in zip(paper, paper[1:]))
        if len(paper) > 1 else None,
        "fsdp2_over_ddp_model_state": fsdp2,
        "fsdp2_over_ddp_within_target": _within(fsdp2, t["zero3_over_ddp_model_state_max"]),
        "fsdp2_over_zero3_model_state": _ratio(state.get("fsdp2"), state.get("zero3")) if sharded else None,
        "fsdp2_below": above if state.get("fsdp2") else [],
        "fsdp2_in_zero3_place": all(state[n] > state["fsdp2"] for n in above) if state.get("fsdp2") and above
        else None,
        "overhead_verdict": over["verdict"],
        "step_time_ratio_within_target": {"yes": True, "no": False}.get(over["verdict"]),
        "startup_ratio_within_target": _within(over["startup_ratio"], t["startup_ratio_max"]),
        "packing_within_target": _within(pack["non_padding_fraction_packed"], t["packed_non_padding_min"], False),
    }


def progress_line(name: str, r: dict) -> str:
    retried = r.get("retried_after")
    again = f" [launched twice: the first attempt crashed: {retried['cause']}]" if retried else ""
    if r["status"] != "ok":
        return f"[hf_zero bench] {name}: FAILED (exit {r['exit_code']}, log {r['log']}): {r.get('cause', '')}{again}"
    return (f"[hf_zero bench] {name}: {r['step_time_median_s']:.3f} s/step (median of "
            f"{r['steps'] - r['warmup_steps']}), start-up {r['startup_s']:.1f} s, peak {r['peak_memory_kind']} "
            f"{mib(r['peak_memory_bytes_per_rank'])}/rank{again}")


def write_all(report: dict, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"bench.{ext}" for ext in ("json", "csv", "md", "png")] + [out / "startup.md"]
    paths[0].write_text(json.dumps(report, indent=2, default=str))
    write_csv(report, paths[1], machine_line(report["machine"]))
    paths[2].write_text(markdown(report, machine_line(report["machine"])))
    plot(report, paths[3], machine_line(report["machine"]))
    paths[4].write_text(startup_markdown(report, machine_line(report["machine"])) + "\n")
    return paths
