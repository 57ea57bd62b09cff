"""bench.png: step time, peak memory and model states per strategy as bars, the loss curves overlaid, the machine
in the title."""

from __future__ import annotations

from pathlib import Path

__all__ = ["plot"]


def plot(report: dict, path: Path, machine: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display on servers; set before pyplot is imported
    import matplotlib.pyplot as plt

    rows = [r for r in report["strategies"] if r["status"] == "ok"]
    names = [r["name"] for r in rows]
    x = list(range(len(rows)))
    fig, ((ax_time, ax_rss), (ax_state, ax_loss)) = plt.subplots(2, 2, figsize=(14, 9))

    med = [r["step_time_median_s"] for r in rows]
    err = [[m - r["step_time_p25_s"] for m, r in zip(med, rows)], [r["step_time_p75_s"] - m for m, r in zip(med, rows)]]
    ax_time.bar(x, med, yerr=err, capsize=4, color="tab:blue")
    ax_time.set(xticks=x, xticklabels=names, ylabel="seconds per step (median, p25-p75)", title="Step time")

    kind = "device memory" if rows and rows[0]["peak_memory_kind"] == "device" else "process RSS"
    ax_rss.bar(x, [r["peak_memory_bytes_per_rank"] / 2**20 for r in rows], color="tab:gray")
    ax_rss.set(xticks=x, xticklabels=names, ylabel="MiB", title=f"Peak memory per rank ({kind})")

    series = [("measured in the engine", "model_state_bytes_per_rank", "tab:orange"),
              ("hf-zero estimate", "estimate_bytes_per_rank", "tab:green")]
    for i, (label, key, color) in enumerate(series):
        ax_state.bar([v + (i - 0.5) * 0.4 for v in x], [(r.get(key) or 0) / 2**20 for r in rows], 0.4, label=label,
                     color=color)
    ax_state.set(xticks=x, xticklabels=names, ylabel="MiB",
                 title="Model states per rank (params + grads + optimizer state)")
    ax_state.legend(fontsize=8)

    styles = ["-", "--", "-.", ":"]
    for i, r in enumerate(rows):  # identical curves overlap: distinct line styles keep each one visible
        ax_loss.plot(range(1, len(r["losses"]) + 1), r["losses"], linestyle=styles[i % len(styles)],
                     marker="o", markersize=9 - 1.5 * i, fillstyle="none", label=r["name"], alpha=0.9)
    packed = report.get("packing", {}).get("packed_losses")
    if packed:
        ax_loss.plot(range(1, len(packed) + 1), packed, color="black", alpha=0.5,
                     label=f"{report['packing']['strategy']} + packing (more text per step)")
    ax_loss.set(xlabel="optimizer step", ylabel="training loss", title="Loss per step (overlapping curves: parity)")
    ax_loss.legend(fontsize=8)

    fig.suptitle(f"hf-zero bench: {report['model']}, {report['precision']}, global batch {report['global_batch']} | "
                 f"{machine}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
