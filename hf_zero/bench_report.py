"""`hf-zero bench`'s results: one dict (bench.json) and its views, bench.csv, bench.md and bench.png, each naming
the machine, ranks and library versions it was measured on."""

from __future__ import annotations

import csv
import json
import os
import platform
import statistics
import time
from pathlib import Path

__all__ = ["machine_info", "assemble", "write_all", "progress_line", "console_summary", "TARGETS"]

# The targets: checked and reported; only fp32 loss parity fails the command (the others are measurements).
TARGETS = {"loss_parity_atol": 1e-4, "zero3_over_ddp_model_state_max": 0.55, "step_time_ratio_max": 1.03,
           "startup_ratio_max": 1.10, "packed_non_padding_min": 0.95}


def _mib(b) -> str:
    return "-" if b is None else f"{b / 2**20:,.1f} MiB"


def machine_info(nproc: int, loadavg_start, note: str = "") -> dict:
    import accelerate
    import deepspeed
    import peft
    import torch
    import transformers

    from . import __version__

    info = Path("/proc/cpuinfo")
    cpu = next((ln.split(":", 1)[1].strip() for ln in info.read_text().splitlines() if ln.startswith("model name")),
               platform.processor()) if info.exists() else platform.processor()
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0)]
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
    return (f"{where}, {m['memory_bytes'] / 2**30:.0f} GiB RAM; {m['ranks']} ranks; torch {m['torch']}, transformers "
            f"{m['transformers']}, accelerate {m['accelerate']}, deepspeed {m['deepspeed']}, peft {m['peft']}")


def _ratio(a, b):
    return a / b if a is not None and b else None


def assemble(plan, args, machine, names, results, overhead, pairs, packed) -> dict:
    from .bench_plan import device_peak_flops, estimate_bytes
    from .profiles import load_profile

    precision = args.precision or load_profile(names[0]).precision
    peak = device_peak_flops(machine["gpus"][0] if machine["gpus"] else None, precision)
    ddp = results.get("ddp") if results.get("ddp", {}).get("status") == "ok" else None
    rows = []
    for name in names:
        r, prof = results[name], load_profile(name)
        est, source = estimate_bytes(plan, name, precision)
        row = {"name": name, "zero_stage": int(prof.zero_stage or 0), "offload_optimizer": prof.offload_optimizer,
               "offload_param": prof.offload_param, **r, "estimate_bytes_per_rank": est, "estimate_source": source,
               "flops_per_step": plan.flops_per_token * statistics.mean(plan.text_tokens_per_step)}
        if r["status"] == "ok":
            row["achieved_flops_per_s"] = plan.flops_per_token * r["tokens_per_s"]
            row["mfu"] = row["achieved_flops_per_s"] / (peak * plan.nproc) if peak else None
            if ddp and len(ddp["losses"]) == len(r["losses"]):
                row["max_abs_loss_diff_vs_ddp"] = max(abs(a - b) for a, b in zip(r["losses"], ddp["losses"]))
        rows.append(row)
    ok = {r["name"]: r for r in rows if r["status"] == "ok"}
    report = {
        "machine": machine, "nproc": plan.nproc, "precision": precision, "model": plan.model,
        "params": plan.count.total_params, "trainable_params": plan.count.trainable_params,
        "steps": plan.total_steps, "warmup_steps": args.warmup, "global_batch": plan.global_batch,
        "micro_batch": plan.micro, "grad_accum": plan.accumulation, "seq_len": plan.seq_len,
        "flops_per_token": plan.flops_per_token, "recipe": str(plan.recipe_yaml), "strategies": rows,
        "plain_trainer": _overhead(overhead, pairs), "packing": _packing(plan, overhead, ok.get(overhead), packed),
        "targets": TARGETS, "retries": _retries(results, pairs, packed),
    }
    report["checks"] = _checks(report, ok, precision)
    return report


def _retries(results, pairs, packed) -> list[dict]:
    """Runs whose first launch crashed and were launched again: listed in the report, so that none goes unseen."""
    named = [*results.items(), *((f"hf_zero #{i + 1}", a) for i, (a, _) in enumerate(pairs) if i),
             *((f"plain #{i + 1}", b) for i, (_, b) in enumerate(pairs)), *([("packed", packed)] if packed else [])]
    return [{"run": name, **r["retried_after"], "second_attempt": r["status"]} for name, r in named
            if r.get("retried_after")]


def _overhead(strategy, pairs) -> dict:
    out = {"strategy": strategy, "repeats": len(pairs), "step_time_ratio": None, "startup_ratio": None}
    good = [(a, b) for a, b in pairs if a["status"] == b["status"] == "ok"]
    if not good:
        return {**out, "status": "skipped" if not pairs else "failed"}
    hf, plain = [a["step_time_median_s"] for a, _ in good], [b["step_time_median_s"] for _, b in good]
    hf_start, plain_start = [a["startup_s"] for a, _ in good], [b["startup_s"] for _, b in good]
    launchers = {"hf_zero_launcher_s": [a["launcher_s"] for a, _ in good],
                 "plain_launcher_s": [b["launcher_s"] for _, b in good]}
    diffs = [max(abs(p - q) for p, q in zip(a["losses"], b["losses"])) for a, b in good
             if len(a["losses"]) == len(b["losses"])]
    return {**out, "status": "ok", "hf_zero_step_time_median_s": hf, "plain_step_time_median_s": plain,
            "hf_zero_startup_s": hf_start, "plain_startup_s": plain_start, **launchers,
            "step_time_ratio": statistics.median(hf) / statistics.median(plain),
            "startup_ratio": statistics.median(hf_start) / statistics.median(plain_start),
            "max_abs_loss_diff_vs_hf_zero": max(diffs) if diffs else None}


def _packing(plan, strategy, unpacked, packed) -> dict:
    out = {"strategy": strategy, "non_padding_fraction_unpacked": plan.padding["unpacked"]["non_padding_fraction"],
           "non_padding_fraction_packed": plan.padding["packed"]["non_padding_fraction"],
           "text_tokens_unpacked": sum(plan.text_tokens_per_step),
           "text_tokens_packed": sum(plan.packed_text_tokens_per_step), "status": "skipped"}
    if packed is None:
        return out
    out["status"] = packed["status"]
    if packed["status"] == "ok" and unpacked:
        out.update(tokens_per_s_unpacked=unpacked["tokens_per_s"], tokens_per_s_packed=packed["tokens_per_s"],
                   tokens_per_s_ratio=packed["tokens_per_s"] / unpacked["tokens_per_s"],
                   packed_losses=packed["losses"])
    return out


def _within(value, limit, below=True):
    return None if value is None else (value <= limit if below else value >= limit)


def _checks(report, ok, precision) -> dict:
    t = report["targets"]
    diffs = [r.get("max_abs_loss_diff_vs_ddp") for n, r in ok.items() if n != "ddp"]
    parity = None
    if "ddp" in ok and diffs and precision == "fp32":
        parity = all(d is not None and d <= t["loss_parity_atol"] for d in diffs)
    state = {n: r.get("model_state_bytes_per_rank") for n, r in ok.items()}
    z3 = _ratio(state.get("zero3"), state.get("ddp"))
    peak = {n: r.get("model_state_peak_bytes_per_rank") for n, r in ok.items()}
    paper = [n for n in ("ddp", "zero1", "zero2", "zero3") if state.get(n)]
    over, pack = report["plain_trainer"], report["packing"]
    return {
        "loss_parity": parity,
        "zero3_over_ddp_model_state": z3,
        "zero3_over_ddp_within_target": _within(z3, t["zero3_over_ddp_model_state_max"]),
        "zero3_over_ddp_model_state_peak": _ratio(peak.get("zero3"), peak.get("ddp")),
        "model_state_order": paper,
        "model_state_in_paper_order": all(state[a] > state[b] for a, b in zip(paper, paper[1:]))
        if len(paper) > 1 else None,
        "step_time_ratio_within_target": _within(over["step_time_ratio"], t["step_time_ratio_max"]),
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
            f"{_mib(r['peak_memory_bytes_per_rank'])}/rank{again}")


COLUMNS = ("strategy", "s/step", "samples/s", "tokens/s", "GFLOP/s", "peak mem/rank", "model-state bytes/rank",
           "in optimizer step", "estimate", "max |Δloss| vs DDP")


def _cells(r: dict) -> list[str]:
    if r["status"] != "ok":
        return [r["name"], "failed", *["-"] * (len(COLUMNS) - 2)]
    diff = r.get("max_abs_loss_diff_vs_ddp")
    return [r["name"], f"{r['step_time_median_s']:.3f} ({r['step_time_p25_s']:.3f}-{r['step_time_p75_s']:.3f})",
            f"{r['samples_per_s']:.2f}", f"{r['tokens_per_s']:,.0f}", f"{r['achieved_flops_per_s'] / 1e9:.2f}",
            _mib(r["peak_memory_bytes_per_rank"]), _mib(r.get("model_state_bytes_per_rank")),
            _mib(r.get("model_state_peak_bytes_per_rank")), _mib(r["estimate_bytes_per_rank"]),
            "-" if diff is None else f"{diff:.2e}"]


def _table(report) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    return "\n".join(lines + ["| " + " | ".join(_cells(r)) + " |" for r in report["strategies"]])


def console_summary(report) -> str:
    return _table(report)


def _markdown(report) -> str:
    m = report["machine"]
    head = [f"# hf-zero bench: {report['model']} ({report['params']:,} params), {report['precision']}",
            "", f"Machine: {machine_line(m)}. {m['date']}; load average {m['loadavg_start']} at start, "
            f"{m['loadavg_end']} at end." + (f" Also running: {m['note']}." if m["note"] else ""), "",
            f"{report['steps']} steps of {report['global_batch']} sequences ({report['micro_batch']} micro x "
            f"{report['grad_accum']} accum x {report['nproc']} ranks), up to {report['seq_len']} tokens; step-time "
            f"statistics leave out {report['warmup_steps']} warm-up steps (s/step: median, p25-p75).", "",
            _table(report), ""]
    return "\n".join(head + _notes(report)) + "\n"


def _yes(flag) -> str:
    return {True: "yes", False: "**no**", None: "not measured"}[flag]


def _notes(report) -> list[str]:
    c, t, over, pack = report["checks"], report["targets"], report["plain_trainer"], report["packing"]
    ok = {r["name"]: r for r in report["strategies"] if r["status"] == "ok"}
    sources = "; ".join(sorted({r["estimate_source"] for r in report["strategies"]}))
    out = ["## Targets", "",
           f"- Loss parity, every strategy within {t['loss_parity_atol']:g} of DDP at every step (fp32): "
           f"{_yes(c['loss_parity'])}."]
    if c["zero3_over_ddp_model_state"] is not None:
        out.append(f"- Model-state bytes per rank, ZeRO-3 / DDP = {c['zero3_over_ddp_model_state']:.3f} (target <= "
                   f"{t['zero3_over_ddp_model_state_max']}): {_yes(c['zero3_over_ddp_within_target'])}; with the "
                   f"optimizer step's temporaries {c['zero3_over_ddp_model_state_peak']:.3f}.")
    if c["model_state_in_paper_order"] is not None:
        out.append(f"- Model-state bytes fall in the ZeRO paper's order ({' > '.join(c['model_state_order'])}): "
                   f"{_yes(c['model_state_in_paper_order'])}.")
    if over["status"] == "ok":
        def secs(key, digits=1):
            return ", ".join(f"{x:.{digits}f}" for x in over[key])

        out.append(f"- hf_zero vs a plain Trainer + DeepSpeed script ({over['strategy']}, {over['repeats']} "
                   f"interleaved pairs, medians): step time x{over['step_time_ratio']:.3f} (target <= "
                   f"{t['step_time_ratio_max']}: {_yes(c['step_time_ratio_within_target'])}), start-up "
                   f"x{over['startup_ratio']:.3f} (target <= {t['startup_ratio_max']}: "
                   f"{_yes(c['startup_ratio_within_target'])}). Median s/step hf_zero "
                   f"{secs('hf_zero_step_time_median_s', 3)} vs plain {secs('plain_step_time_median_s', 3)}; "
                   f"start-up s hf_zero {secs('hf_zero_startup_s')} (launcher {secs('hf_zero_launcher_s')}) vs "
                   f"plain {secs('plain_startup_s')} (launcher {secs('plain_launcher_s')}); largest loss difference "
                   f"{over['max_abs_loss_diff_vs_hf_zero']:.2e}.")
    else:
        out.append(f"- Overhead against a plain Trainer script: {over['status']}.")
    line = (f"- Packing ({pack['strategy']}): non-padding tokens {pack['non_padding_fraction_unpacked']:.3f} "
            f"unpacked, {pack['non_padding_fraction_packed']:.3f} packed (target >= {t['packed_non_padding_min']}: "
            f"{_yes(c['packing_within_target'])})")
    if pack.get("tokens_per_s_ratio"):
        line += (f"; text tokens/s {pack['tokens_per_s_unpacked']:,.0f} -> {pack['tokens_per_s_packed']:,.0f} "
                 f"(x{pack['tokens_per_s_ratio']:.2f})")
    out.append(line + ".")
    out += [f"- {x['run']} crashed once ({x['cause']}, exit {x['exit_code']}) and was launched again: "
            f"{x['second_attempt']}." for x in report.get("retries", [])]
    out += ["", "## What the columns count", "",
            "- s/step: wall time from one optimizer step's begin to the next (forward, backward, optimizer, logging, "
            "next batch) on rank 0; samples/s = global batch / median step; tokens/s: text tokens (no padding).",
            "- peak mem/rank: the largest peak of any rank: device memory on GPUs (torch.cuda.max_memory_allocated), "
            "process RSS on a CPU machine (both per rank in bench.json).",
            "- model-state bytes/rank (largest rank), measured in the engine at step 1 and counted as the ZeRO paper "
            "counts them: parameters, gradients as held through backward, optimizer state; plus the gradient "
            "communication buckets (DDP keeps a second full copy of the gradients in its buckets unless "
            "gradient_as_bucket_view is on). The optimizer step's own temporaries are left out for every strategy "
            "(next column). In fp32 DeepSpeed also keeps a separate fp32 master copy of the parameters (4/N bytes "
            "per parameter).",
            "- in optimizer step: the same plus what exists only inside DeepSpeed's optimizer step (its flattened "
            "fp32 copy of the gradient partition); this is what `hf-zero estimate` predicts.",
            f"- estimate: `hf-zero estimate`'s params + grads + optimizer + gathered layer + buffers per rank, device "
            f"+ offloaded ({sources}).",
            f"- GFLOP/s: {report['flops_per_token']:,.0f} FLOPs per text token (4 x matmul params + 2 x trainable) "
            "x tokens/s, all ranks together."]
    breakdown = [f"  - {n}: " + ", ".join(f"{k} {_mib(v)}" for k, v in r["model_state_by_rank"][0].items()
                                         if k != "total_with_step_temporaries")
                 for n, r in ok.items() if r.get("model_state_by_rank")]
    if breakdown:
        out += ["- model-state bytes on rank 0:", *breakdown]
    return out


def _csv(report, path: Path) -> None:
    keys = ("name", "status", "zero_stage", "offload_optimizer", "offload_param", "step_time_median_s",
            "step_time_p25_s", "step_time_p75_s", "startup_s", "samples_per_s", "tokens_per_s",
            "peak_rss_bytes_per_rank", "peak_memory_bytes_per_rank", "model_state_bytes_per_rank",
            "model_state_peak_bytes_per_rank",
            "estimate_bytes_per_rank", "flops_per_step",
            "achieved_flops_per_s", "mfu", "max_abs_loss_diff_vs_ddp")
    with open(path, "w", newline="") as fh:
        fh.write(f"# hf-zero bench, {report['model']}, {report['precision']}: {machine_line(report['machine'])}\n")
        writer = csv.writer(fh)
        writer.writerow(keys)
        for r in report["strategies"]:
            writer.writerow(["" if r.get(k) is None else r.get(k) for k in keys])


def write_all(report: dict, out: Path) -> list[Path]:
    from .bench_plot import plot

    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"bench.{ext}" for ext in ("json", "csv", "md", "png")]
    paths[0].write_text(json.dumps(report, indent=2, default=str))
    _csv(report, paths[1])
    paths[2].write_text(_markdown(report))
    plot(report, paths[3], machine_line(report["machine"]))
    return paths
