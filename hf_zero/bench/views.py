"""bench.md, bench.csv and the console table of `hf-zero bench`, from the report dict (hf_zero.bench.report)."""

from __future__ import annotations

import csv
from pathlib import Path

from hf_zero.core.files import human_bytes

__all__ = ["table", "markdown", "startup_markdown", "write_csv", "mib"]

# Measured on one H100 (llama-1.1B shape, bf16, 12 steps): what the bf16 note quotes.
BF16_FAMILIES_H100 = "0.23 after 12 steps on llama-1.1B, while ZeRO-2/3/offload agreed with each other to 0.004"


def mib(b) -> str:
    return "-" if b is None else human_bytes(b, unit="MiB", grouped=True)


def _columns(report) -> tuple:
    return ("strategy", "s/step", "tokens/s", "GFLOP/s", "MFU", "peak mem/rank", "model states on device/rank",
            "offloaded to host/rank", "in optimizer step", "estimate device + host",
            f"max |Δloss| vs {report['loss_reference'] or '-'}")


def _cells(r: dict, width: int) -> list[str]:
    if r["status"] != "ok":
        return [r["name"], "failed", *["-"] * (width - 2)]
    diff, mfu = r.get("max_abs_loss_diff_vs_reference"), r.get("mfu")
    host = r.get("model_state_host_bytes_per_rank")
    return [r["name"], f"{r['step_time_median_s']:.3f} ({r['step_time_p25_s']:.3f}-{r['step_time_p75_s']:.3f})",
            f"{r['tokens_per_s']:,.0f}", f"{r['achieved_flops_per_s'] / 1e9:,.2f}",
            "-" if mfu is None else f"{mfu:.3f}", mib(r["peak_memory_bytes_per_rank"]),
            mib(r.get("model_state_device_bytes_per_rank")), "-" if not host else mib(host),
            mib(r.get("model_state_peak_bytes_per_rank")),
            f"{mib(r['estimate_device_bytes_per_rank'])} + {mib(r['estimate_host_bytes_per_rank'])}"
            if r.get("estimate_host_bytes_per_rank") else mib(r.get("estimate_device_bytes_per_rank")),
            "-" if diff is None else f"{diff:.2e}"]


def table(report) -> str:
    cols = _columns(report)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    return "\n".join(lines + ["| " + " | ".join(_cells(r, len(cols))) + " |" for r in report["strategies"]])


def markdown(report, machine: str) -> str:
    m = report["machine"]
    rows = "packed rows" if report.get("packing") else "sequences"
    head = [f"# hf-zero bench: {report['model']} ({report['params']:,} params), {report['precision']}",
            "", f"Machine: {machine}. {m['date']}; load average {m['loadavg_start']} at start, "
            f"{m['loadavg_end']} at end." + (f" Also running: {m['note']}." if m["note"] else ""), "",
            f"{report['steps']} steps of {report['global_batch']} {rows} ({report['micro_batch']} micro x "
            f"{report['grad_accum']} accum x {report['nproc']} ranks), up to {report['seq_len']} tokens; step-time "
            f"statistics leave out {report['warmup_steps']} warm-up steps (s/step: median, p25-p75).", "",
            table(report), ""]
    return "\n".join(head + _notes(report) + ["", startup_markdown(report)]) + "\n"


_PLAIN_LAUNCHERS = {"accelerate": "through `accelerate launch` with the same profile", "torchrun": "through torchrun"}


def startup_markdown(report, machine: str | None = None) -> str:
    """Where start-up goes, hf_zero beside the plain script: seconds per phase from the launch to the first step,
    the median over the measured overhead pairs (rank 0's phases, the launcher's handed on to it)."""
    over = report["plain_trainer"]
    hf, plain = over.get("startup_breakdown_hf_zero") or [], over.get("startup_breakdown_plain") or []
    if not hf and not plain:
        return "## Start-up breakdown\n\nNot measured (no overhead pair ran)."
    pairs = over["repeats"] - over.get("warmup_pairs", 0)
    out = ["## Start-up breakdown", ""]
    if machine:
        out += [f"Machine: {machine}.", ""]
    out += [f"{over['strategy']}, seconds from the launch to the first optimizer step, median over {pairs} pair"
            f"{'s' if pairs != 1 else ''}; a phase lasts until the next one starts.", ""]
    for title, rows in ((f"hf_zero ({sum(s for _, s in hf):.1f} s)", hf),
                        (f"plain Trainer script, {_PLAIN_LAUNCHERS[over.get('launcher', 'torchrun')]} "
                         f"({sum(s for _, s in plain):.1f} s)", plain)):
        out += [f"| {title} | s |", "|---|---:|", *(f"| {name} | {s:.2f} |" for name, s in rows), ""]
    return "\n".join(out).rstrip()


def _yes(flag) -> str:
    return {True: "yes", False: "**no**", None: "not measured"}[flag]


def _loss_lines(report) -> list[str]:
    c, t, agree = report["checks"], report["targets"], report["loss_agreement"]
    if report["precision"] == "fp32":
        return [f"- Loss parity, every strategy within {t['loss_parity_atol']:g} of DDP at every step (fp32): "
                f"{_yes(c['loss_parity']) if report['loss_reference'] == 'ddp' else 'not measured (no ddp run)'}."]
    among = agree["zero_max_abs_diff"]
    return [f"- Loss agreement in {report['precision']} (largest per-step difference, column above; not a target): "
            f"ZeRO strategies among themselves {'-' if among is None else f'{among:.2e}'}. ddp/single_gpu keep fp32 "
            f"weights and autocast, ZeRO keeps {report['precision']} weights with an fp32 master copy: the two "
            f"families differ numerically by design (measured on an H100: {BF16_FAMILIES_H100})."]


def _overhead_line(report) -> str:
    over, t, c = report["plain_trainer"], report["targets"], report["checks"]
    if over["status"] != "ok":
        return f"- Overhead against a plain Trainer script: {over['status']}."

    def seq(key, digits=1):
        return ", ".join(f"{x:.{digits}f}" for x in over[key])

    verdict = {"yes": "yes", "no": "**no**"}.get(over["verdict"], f"**{over['verdict']}**")
    why = f" ({over['verdict_reason']})" if over.get("verdict_reason") else ""
    spread = over["step_time_ratio_spread"]
    warm = over.get("warmup_pairs", 0)
    return (f"- hf_zero vs a plain Trainer + DeepSpeed script started "
            f"{_PLAIN_LAUNCHERS[over.get('launcher', 'torchrun')]} ({over['strategy']}, {over['repeats']} interleaved "
            f"pair{'s' if over['repeats'] != 1 else ''}" + (f", the first {warm} left out as warm-up" if warm else "")
            + f"): step time x{over['step_time_ratio']:.3f} (mean of the "
            f"pair ratios {seq('step_time_ratios', 3)}; spread, 2 standard errors, "
            f"{'-' if spread is None else f'{spread:.3f}'}); target <= {t['step_time_ratio_max']} with a "
            f"spread within {t['overhead_spread_max']}: {verdict}{why}. Start-up x{over['startup_ratio']:.3f} "
            f"(target <= {t['startup_ratio_max']}: {_yes(c['startup_ratio_within_target'])}). Median s/step hf_zero "
            f"{seq('hf_zero_step_time_median_s', 3)} vs plain {seq('plain_step_time_median_s', 3)}; start-up s "
            f"hf_zero {seq('hf_zero_startup_s')} (launcher {seq('hf_zero_launcher_s')}) vs plain "
            f"{seq('plain_startup_s')} (launcher {seq('plain_launcher_s')}); first-step loss "
            f"{over['first_step_loss_hf_zero']:.6f} vs {over['first_step_loss_plain']:.6f}, largest loss difference "
            f"{over['max_abs_loss_diff_vs_hf_zero']:.2e}.")


def _notes(report) -> list[str]:
    c, t, pack = report["checks"], report["targets"], report["packing_comparison"]
    ok = {r["name"]: r for r in report["strategies"] if r["status"] == "ok"}
    sources = "; ".join(sorted({r["estimate_source"] for r in report["strategies"] if r.get("estimate_source")}))
    out = ["## Targets", "", *_loss_lines(report)]
    if report["nproc"] < 2:
        out.append(f"- At {report['nproc']} rank ZeRO shards nothing (every stage holds all the states, offload "
                   "aside): the ZeRO-3/DDP memory ratio and the ZeRO paper's order need 2 ranks or more.")
    if c["zero3_over_ddp_model_state"] is not None:
        out.append(f"- Model-state bytes per rank, ZeRO-3 / DDP = {c['zero3_over_ddp_model_state']:.3f} (target <= "
                   f"{t['zero3_over_ddp_model_state_max']}): {_yes(c['zero3_over_ddp_within_target'])}; with the "
                   f"optimizer step's temporaries {c['zero3_over_ddp_model_state_peak']:.3f}.")
    if c["model_state_in_paper_order"] is not None:
        out.append(f"- Model-state bytes fall in the ZeRO paper's order ({' > '.join(c['model_state_order'])}): "
                   f"{_yes(c['model_state_in_paper_order'])}.")
    if c.get("fsdp2_over_ddp_model_state") is not None:
        line = (f"- FSDP2 shards like ZeRO-3: model-state bytes per rank, FSDP2 / DDP = "
                f"{c['fsdp2_over_ddp_model_state']:.3f} (target <= {t['zero3_over_ddp_model_state_max']}): "
                f"{_yes(c['fsdp2_over_ddp_within_target'])}")
        if c.get("fsdp2_over_zero3_model_state") is not None:
            line += f"; FSDP2 / ZeRO-3 = {c['fsdp2_over_zero3_model_state']:.3f}"
        if c.get("fsdp2_in_zero3_place") is not None:
            line += f"; below {', '.join(c['fsdp2_below'])}: {_yes(c['fsdp2_in_zero3_place'])}"
        out.append(line + ".")
    out.append(_overhead_line(report))
    line = (f"- Packing ({pack['strategy']}; the recipe {'packs' if pack['recipe_packs'] else 'does not pack'}): "
            f"non-padding tokens {pack['non_padding_fraction_unpacked']:.3f} unpacked, "
            f"{pack['non_padding_fraction_packed']:.3f} packed (target >= {t['packed_non_padding_min']}: "
            f"{_yes(c['packing_within_target'])})")
    if pack.get("tokens_per_s_ratio"):
        line += (f"; text tokens/s {pack['tokens_per_s_unpacked']:,.0f} -> {pack['tokens_per_s_packed']:,.0f} "
                 f"(x{pack['tokens_per_s_ratio']:.2f})")
    out.append(line + ".")
    out += [f"- {x['run']} crashed once ({x['cause']}, exit {x['exit_code']}) and was launched again: "
            f"{x['second_attempt']}." for x in report.get("retries", [])]
    out += ["", "## What the columns count", "",
            "- s/step: wall time from one optimizer step's begin to the next (forward, backward, optimizer, logging, "
            "next batch) on rank 0; tokens/s: text tokens (no padding) / s.",
            "- peak mem/rank: the largest peak of any rank: device memory on GPUs (torch.cuda.max_memory_allocated), "
            "process RSS on a CPU machine (both per rank in bench.json).",
            "- model states (largest rank), measured in the engine at step 1 and counted as the ZeRO paper counts "
            "them: parameters, gradients as held through backward, optimizer state; plus the gradient communication "
            "buckets (DDP keeps a second full copy of the gradients in its buckets unless gradient_as_bucket_view is "
            "on). On the device / offloaded to host: where DeepSpeed keeps them (offload_optimizer: fp32 master "
            "weights, Adam's moments and the fp32 gradient partition; offload_param: the parameter partitions; "
            "fsdp2_offload: the parameter shards, their gradients and Adam's state). On a "
            "CPU machine both are the same RAM. The optimizer step's own temporaries are left out (next column).",
            "- in optimizer step: the same plus what exists only inside DeepSpeed's optimizer step (its flattened "
            "fp32 copy of the gradient partition); this is what `hf-zero estimate` predicts.",
            f"- estimate: `hf-zero estimate`'s params + grads + optimizer + gathered layer + buffers per rank (FSDP2: "
            f"without its gathered layer and all-gather buffer, freed before the step), on the "
            f"device + offloaded ({sources}).",
            f"- GFLOP/s: {report['flops_per_token']:,.0f} model FLOPs per text token (6N + 12·L·h·s, N the matmul "
            "parameters, LoRA-aware) x tokens/s, all ranks together; MFU: the same over the devices' dense peak "
            f"({report['precision']}), on GPUs only."]
    breakdown = [f"  - {n}: " + ", ".join(f"{k} {mib(v)}" for k, v in r["model_state_by_rank"][0].items()
                                         if k != "total_with_step_temporaries")
                 for n, r in ok.items() if r.get("model_state_by_rank")]
    if breakdown:
        out += ["- model-state bytes on rank 0:", *breakdown]
    return out


CSV_KEYS = ("name", "status", "zero_stage", "offload_optimizer", "offload_param", "step_time_median_s",
            "step_time_p25_s", "step_time_p75_s", "startup_s", "samples_per_s", "tokens_per_s",
            "peak_rss_bytes_per_rank", "peak_memory_bytes_per_rank", "model_state_bytes_per_rank",
            "model_state_device_bytes_per_rank", "model_state_host_bytes_per_rank", "model_state_peak_bytes_per_rank",
            "estimate_bytes_per_rank", "estimate_device_bytes_per_rank", "estimate_host_bytes_per_rank",
            "flops_per_step", "achieved_flops_per_s", "mfu", "max_abs_loss_diff_vs_reference")


def write_csv(report, path: Path, machine: str) -> None:
    with open(path, "w", newline="") as fh:
        fh.write(f"# hf-zero bench, {report['model']}, {report['precision']}, loss reference "
                 f"{report['loss_reference']}: {machine}\n")
        writer = csv.writer(fh)
        writer.writerow(CSV_KEYS)
        for r in report["strategies"]:
            writer.writerow(["" if r.get(k) is None else r.get(k) for k in CSV_KEYS])
