"""Evaluation metrics that ship with hf_zero as `evaluate` modules and load offline by path.

`evaluate.load("accuracy")` fetches its script from the hub and fails offline; the modules in this folder are
loaded by path instead. evaluate copies a module into `$HF_HOME/modules` on first load, so ranks load one after the
other (main process first) rather than racing on that copy.
"""

from __future__ import annotations

from pathlib import Path

from hf_zero.core.errors import UserError

__all__ = ["METRICS_DIR", "CLASSIFICATION_METRICS", "load_metric", "build_compute_metrics"]

METRICS_DIR = Path(__file__).resolve().parent
CLASSIFICATION_METRICS = ("accuracy", "f1_macro")


def load_metric(name: str):
    """One of hf_zero's metric modules as an `evaluate.EvaluationModule`."""
    import evaluate

    folder = METRICS_DIR / name
    if not (folder / f"{name}.py").is_file():
        known = sorted(p.name for p in METRICS_DIR.iterdir() if (p / f"{p.name}.py").is_file())
        raise UserError("metric", f"hf_zero ships no metric {name!r}", f"use one of {', '.join(known)}")
    # keep_in_memory: every rank computes on the full, already gathered predictions; no shared cache files.
    return evaluate.load(str(folder), keep_in_memory=True)


def build_compute_metrics(training_args=None, names=CLASSIFICATION_METRICS):
    """A `compute_metrics` for the Trainer: argmax of the logits, then every metric -> {"accuracy": ..., ...}."""
    import contextlib

    ctx = (training_args.main_process_first(local=True, desc="load metrics") if training_args
           else contextlib.nullcontext())
    with ctx:
        metrics = [load_metric(n) for n in names]

    def compute_metrics(eval_pred) -> dict:
        import numpy as np

        logits = eval_pred.predictions[0] if isinstance(eval_pred.predictions, tuple) else eval_pred.predictions
        predictions = np.asarray(logits).argmax(axis=-1).tolist()
        references = np.asarray(eval_pred.label_ids).reshape(-1).tolist()
        out = {}
        for metric in metrics:
            out.update(metric.compute(predictions=predictions, references=references))
        return out

    return compute_metrics
