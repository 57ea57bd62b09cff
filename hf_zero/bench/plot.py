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
    err = [[m - r["step_time_p25_s"] for m, r in zip(med, rows)],
           [r["step_time_p75_s"] - m for m, r in zip(med, rows)]]
    ax_time.bar(x, med, yerr=err, capsize=4, color="tab:blue")
    ax_time.set(xticks=x, xticklabels=names, ylabel="seconds per step (median, p25-p75)", title="Step time")

    if rows and rows[0]["peak_memory_kind"] == "device":  # GPUs: the device's peak and the host process's beside it
        ax_rss.bar([v - 0.2 for v in x], [r["peak_memory_bytes_per_rank"] / 2**20 for r in rows], 0.4,
                   color="tab:gray", label="device (max allocated)")
        ax_rss.bar([v + 0.2 for v in x], [r["peak_rss_bytes_per_rank"] / 2**20 for r in rows], 0.4,
                   color="tab:gray", alpha=0.35, hatch="//", label="host process (RSS)")
        ax_rss.legend(fontsize=8)
    else:
        ax_rss.bar(x, [r["peak_memory_bytes_per_rank"] / 2**20 for r in rows], color="tab:gray")
    ax_rss.set(xticks=x, xticklabels=names, ylabel="MiB",
               title="Peak memory per rank" + ("" if rows and rows[0]["peak_memory_kind"] == "device"
                                               else " (process RSS: CPU only)"))

    # Measured and estimated model states side by side, each split into device memory and what is offloaded to
    # host memory (hatched): an offload profile's bytes do not count against the device.
    series = [("measured", "model_state_device_bytes_per_rank", "model_state_host_bytes_per_rank", "tab:orange"),
              ("hf-zero estimate", "estimate_device_bytes_per_rank", "estimate_host_bytes_per_rank", "tab:green")]
    for i, (label, dev_key, host_key, color) in enumerate(series):
        at = [v + (i - 0.5) * 0.4 for v in x]
        dev = [(r.get(dev_key) or 0) / 2**20 for r in rows]
        host = [(r.get(host_key) or 0) / 2**20 for r in rows]
        ax_state.bar(at, dev, 0.4, label=f"{label}: on the device", color=color)
        ax_state.bar(at, host, 0.4, bottom=dev, label=f"{label}: offloaded to host", color=color, alpha=0.35,
                     hatch="//", edgecolor=color)
    ax_state.set(xticks=x, xticklabels=names, ylabel="MiB",
                 title="Model states per rank (params + grads + optimizer state)")
    tallest = max([(r.get(k) or 0) + (r.get(h) or 0) for r in rows for _, k, h, _ in series] or [0]) / 2**20
    ax_state.set_ylim(0, 1.35 * tallest or 1)  # room above the tallest bar for the legend
    ax_state.legend(fontsize=8)

    styles = ["-", "--", "-.", ":"]
    for i, r in enumerate(rows):  # identical curves overlap: distinct line styles keep each one visible
        ax_loss.plot(range(1, len(r["losses"]) + 1), r["losses"], linestyle=styles[i % len(styles)],
                     marker="o", markersize=9 - 1.5 * i, fillstyle="none", label=r["name"], alpha=0.9)
    pack = report.get("packing_comparison", {})
    other = pack.get("unpacked_losses" if pack.get("recipe_packs") else "packed_losses")
    if other:
        ax_loss.plot(range(1, len(other) + 1), other, color="black", alpha=0.5,
                     label=f"{pack['strategy']}, " + ("unpacked (less text per step)" if pack["recipe_packs"]
                                                      else "packed (more text per step)"))
    ax_loss.set(xlabel="optimizer step", ylabel="training loss", title="Loss per step (overlapping curves: parity)")
    ax_loss.legend(fontsize=8)

    fig.suptitle(f"hf-zero bench: {report['model']}, {report['precision']}, global batch {report['global_batch']} | "
                 f"{machine}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
