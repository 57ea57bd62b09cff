"""`hf-zero bench --preset gpu-matrix`'s report: MFU and the loss against the reference per variant, the fastest
variant per strategy with the settings that make it, the issue-46 speed targets, written as matrix.md (the one file a
GPU session brings back), matrix.json and matrix.csv."""

from __future__ import annotations

import csv
import json
import shlex
from pathlib import Path

from hf_zero.bench.compare import max_abs_diff
from hf_zero.bench.report import machine_line
from hf_zero.bench.views import mib
from hf_zero.estimate.flops import device_peak_flops

__all__ = ["analyse", "write_reports", "TARGETS", "CSV_KEYS"]

# The one-GPU targets (1.1B shape, one rank): single_gpu's MFU, and ZeRO-2 and ZeRO-3 as fractions of single_gpu.
TARGETS = {"single_gpu_mfu_min": 0.45, "zero2_over_single_gpu_min": 0.95, "zero3_over_single_gpu_min": 0.75}
CSV_KEYS = ("variant", "strategy", "micro_batch", "seq_len", "status", "reason", "step_time_s", "tokens_per_s",
            "mfu", "peak_memory_bytes", "peak_memory_kind", "estimate_bytes", "loss_reference",
            "max_abs_loss_diff_vs_reference", "flags", "deepspeed")


def _is_baseline(r: dict) -> bool:
    return not r.get("flags") and not r.get("deepspeed")


def _apply(r: dict) -> dict:
    """How to run a variant's settings: the recipe flags (with its micro-batch) and the DeepSpeed settings."""
    flags = ["--per_device_train_batch_size", str(r["micro_batch"]), *r.get("flags", [])]
    return {"recipe_flags": shlex.join(flags), "deepspeed": r.get("deepspeed")}


def analyse(summary: dict) -> dict:
    """MFU, the loss reference, the fastest variant per strategy and the targets, added to `summary`."""
    gpus = summary["machine"]["gpus"]
    peak = device_peak_flops(gpus[0] if gpus else None, "bf16")
    ok = [r for r in summary["rows"] if r["status"] == "ok"]
    # same rows only where the micro-batch is the same: single_gpu with hf_zero's defaults at that micro-batch
    refs = {r["micro_batch"]: r for r in ok if r["strategy"] == "single_gpu" and _is_baseline(r)}
    for r in ok:
        r["mfu"] = r["flops_per_token"] * r["tokens_per_s"] / peak if peak else None
        ref = refs.get(r["micro_batch"])
        r["loss_reference"] = ref["variant"] if ref else None
        r["max_abs_loss_diff_vs_reference"] = max_abs_diff(r["losses"], ref["losses"]) if ref else None
    fastest = {}
    for r in ok:
        best = fastest.get(r["strategy"])
        if best is None or r["tokens_per_s"] > best["tokens_per_s"]:
            fastest[r["strategy"]] = r
    base = {r["strategy"]: r for r in ok if _is_baseline(r) and r["micro_batch"] == 8}
    single = fastest.get("single_gpu")
    summary["fastest"] = {
        s: {"variant": r["variant"], "micro_batch": r["micro_batch"], "tokens_per_s": r["tokens_per_s"],
            "mfu": r["mfu"], "peak_memory_bytes": r["peak_memory_bytes"], **_apply(r),
            "vs_default": r["tokens_per_s"] / base[s]["tokens_per_s"] if s in base else None,
            "vs_single_gpu": r["tokens_per_s"] / single["tokens_per_s"] if single else None}
        for s, r in fastest.items()}
    f = summary["fastest"]
    mfu = f.get("single_gpu", {}).get("mfu")
    summary["targets"] = [
        {"target": f"single_gpu MFU >= {TARGETS['single_gpu_mfu_min']}", "value": mfu,
         "met": None if mfu is None else mfu >= TARGETS["single_gpu_mfu_min"]},
        *({"target": f"{s} >= {TARGETS[f'{s}_over_single_gpu_min']}x single_gpu",
           "value": f.get(s, {}).get("vs_single_gpu"),
           "met": None if f.get(s, {}).get("vs_single_gpu") is None
           else f[s]["vs_single_gpu"] >= TARGETS[f"{s}_over_single_gpu_min"]} for s in ("zero2", "zero3"))]
    return summary


def _num(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _markdown(s: dict) -> str:
    m = s["machine"]
    ran = sum(r["status"] in ("ok", "failed") for r in s["rows"])
    params = f" ({s['params']:,} params)" if s.get("params") else ""
    lines = [f"# hf-zero bench --preset gpu-matrix: {Path(s['model']).name}{params}, {s['seq_len']} tokens per row, "
             "bf16, 1 rank", "",
             f"Machine: {machine_line(m)}. {m['date']}."
             + (" No GPU: the CPU stand-in, MFU not measured." if not m["gpus"] else ""),
             ("Dry run: every variant planned (recipe, data, flags, DeepSpeed settings, launch line), none launched."
              if s["dry_run"] else
              f"{s['steps']} steps per variant, the first {s['warmup']} left out; {ran} of {len(s['rows'])} variants "
              f"launched in {s['used_s']:.0f} s (budget {s['budget_s'] or 'none'} s). MFU = (6N + 12·L·h·s) x "
              "tokens/s / the device's dense bf16 peak; loss vs reference: largest difference over the steps "
              "against single_gpu with the defaults at the same micro-batch (the same rows)."), "",
             "| variant | strategy | rows | settings | status | s/step | tokens/s | MFU | peak memory | estimate "
             "| loss vs reference |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in s["rows"]:
        settings = " ".join([*r.get("flags", []), *([json.dumps(r["deepspeed"])] if r.get("deepspeed") else [])])
        status = r["status"] if not r.get("reason") else f"{r['status']}: {r['reason']}"
        lines.append(f"| {r['variant']} | {r.get('strategy', '-')} | {r.get('micro_batch', '-')} x "
                     f"{s['seq_len']} | {settings or 'defaults'} | {status.replace('|', '/')} | "
                     f"{_num(r.get('step_time_s'), '.3f')} | {_num(r.get('tokens_per_s'), ',.0f')} | "
                     f"{_num(r.get('mfu'), '.3f')} | "
                     f"{mib(r.get('peak_memory_bytes')) if r.get('peak_memory_bytes') else '-'} | "
                     f"{mib(r.get('estimate_bytes')) if r.get('estimate_bytes') else '-'} | "
                     f"{_num(r.get('max_abs_loss_diff_vs_reference'), '.2e')} |")
    lines += ["", "## Fastest per strategy", "",
              "What the defaults should become: the profile's micro-batch and recipe flags, and for ZeRO-3 the "
              "DeepSpeed settings (hf_zero/plan/deepspeed_config.py's zero3_speed_settings).", "",
              "| strategy | fastest variant | tokens/s | MFU | vs the strategy's defaults | vs single_gpu | recipe "
              "flags | DeepSpeed settings |", "|---|---|---|---|---|---|---|---|"]
    for name, f in s["fastest"].items():
        ds = json.dumps(f["deepspeed"]) if f["deepspeed"] else "-"
        lines.append(f"| {name} | {f['variant']} | {f['tokens_per_s']:,.0f} | {_num(f['mfu'], '.3f')} | "
                     f"{_num(f['vs_default'], '.2f')}{'x' * (f['vs_default'] is not None)} | "
                     f"{_num(f['vs_single_gpu'], '.2f')}{'x' * (f['vs_single_gpu'] is not None)} | "
                     f"`{f['recipe_flags']}` | {ds} |")
    if not s["fastest"]:
        lines.append("| - | none ran | | | | | | |")
    lines += ["", "## Targets", ""]
    for t in s["targets"]:
        verdict = {True: "met", False: "missed", None: "not measured"}[t["met"]]
        lines.append(f"- {t['target']}: {_num(t['value'], '.3f')} ({verdict})")
    return "\n".join(lines) + "\n"


def write_reports(summary: dict, out: Path) -> list[Path]:
    analyse(summary)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "matrix.md", out / "matrix.json", out / "matrix.csv"]
    paths[0].write_text(_markdown(summary))
    paths[1].write_text(json.dumps(summary, indent=2, default=str))
    with open(paths[2], "w", newline="") as fh:
        fh.write(f"# hf-zero bench --preset gpu-matrix, {summary['model']}: {machine_line(summary['machine'])}\n")
        writer = csv.writer(fh)
        writer.writerow(CSV_KEYS)
        for r in summary["rows"]:
            cells = [r.get(k) for k in CSV_KEYS]
            writer.writerow(["" if c is None else json.dumps(c) if isinstance(c, (dict, list)) else c
                             for c in cells])
    return paths
