"""`loss.png` beside summary.json: the training loss of every step, each stage's held-out loss at every evaluation
and the stage boundaries, drawn from the run's log history alone (the stage index each step log carries), so every
recipe gets it from write_summary."""

from __future__ import annotations

from pathlib import Path

__all__ = ["LOSS_PLOT", "plot_losses"]

LOSS_PLOT = "loss.png"


def _stage_starts(log_history: list[dict]) -> list[tuple[int, int]]:
    """(first step, stage index) of each stage that trained, from the step logs' `stage`."""
    starts, last = [], None
    for h in log_history:
        if "loss" in h and "stage" in h and h["stage"] != last:
            starts.append((h["step"], h["stage"]))
            last = h["stage"]
    return starts


def plot_losses(log_history: list[dict], path: Path, stage_names: list[str] | None = None) -> Path | None:
    """Write the plot to `path`; None (nothing written) when no step logged a loss."""
    steps = [(h["step"], h["loss"]) for h in log_history if "loss" in h and "step" in h]
    if not steps:
        return None
    import matplotlib

    matplotlib.use("Agg")  # no display on servers; set before pyplot is imported
    import matplotlib.pyplot as plt

    evals: dict[str, list[tuple[int, float]]] = {}
    for h in log_history:
        for key, value in h.items():
            if key.startswith("eval_") and key.endswith("_loss") and key != "eval_loss" and "step" in h:
                evals.setdefault(key[len("eval_"):-len("_loss")], []).append((h["step"], value))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot(*zip(*steps), label="train loss", color="tab:gray", linewidth=1)
    for name, points in evals.items():
        style = dict(color="black", linewidth=2) if name == "mean" else dict(linewidth=1, alpha=0.8)
        ax.plot(*zip(*sorted(points)), marker="o", markersize=4, label=f"eval {name}", **style)
    for first, index in _stage_starts(log_history):
        ax.axvline(first - 0.5, color="grey", linestyle=":", linewidth=1)
        name = stage_names[index] if stage_names and index < len(stage_names) else f"stage {index + 1}"
        ax.annotate(name, (first - 0.5, 1), xycoords=("data", "axes fraction"), xytext=(3, -12),
                    textcoords="offset points", fontsize=8, color="grey")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
