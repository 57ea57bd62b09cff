"""A dpo stage's reference log-probabilities on disk: `<output_dir>/reference_logps/<stage>.safetensors` (rows x
[chosen, rejected]: the training rows, then the held-out pairs, by row whatever the rank count that computed them)
and `<stage>.json` beside it, with fingerprints of the rows and of the weights they were computed from, so a later
run reuses the cache without recomputing it and refuses one made from other rows or another model
(hf_zero.train.preference computes it and says when)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from hf_zero.core.errors import UserError
from hf_zero.data.preference import PREFERENCE_KEYS

__all__ = ["REFERENCE_DIR", "ReferenceCache", "fingerprint_model", "fingerprint_rows"]

REFERENCE_DIR = "reference_logps"

def fingerprint_rows(samples: list[dict]) -> str:
    digest = hashlib.sha256()
    for s in samples:
        digest.update(json.dumps([s[k] for k in PREFERENCE_KEYS]).encode())
    return digest.hexdigest()[:16]


def _whole(p) -> torch.Tensor:
    """A parameter's full value on the CPU, also where each rank holds a part (a collective there: every rank
    fingerprints at the same step). One parameter at a time: never the whole model gathered."""
    if hasattr(p, "ds_numel"):  # a ZeRO-3 partition
        import deepspeed

        with deepspeed.zero.GatheredParameters([p]):
            return p.detach().cpu().clone()
    if hasattr(p, "full_tensor"):  # FSDP2's DTensor
        return p.full_tensor().detach().cpu()
    return p.detach().cpu()


def fingerprint_model(model) -> str:
    """Every parameter's name and bytes: the weights (and adapter) the reference is computed from."""
    digest = hashlib.sha256()
    for name, p in sorted(model.named_parameters(), key=lambda item: item[0]):
        digest.update(name.encode())
        digest.update(_whole(p).contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


class ReferenceCache:
    """One dpo stage's reference log-probabilities in output_dir/reference_logps/<stage>.{safetensors,json}."""

    def __init__(self, output_dir, stage):  # a hf_zero.train.preference.PreferenceStage
        self.dir = Path(output_dir) / REFERENCE_DIR
        self.stage = stage
        self.tensors, self.meta = self.dir / f"{stage.stage.name}.safetensors", self.dir / f"{stage.stage.name}.json"

    def _refuse(self, problem: str, fix: str):
        raise UserError(str(self.meta), problem, fix)

    def check_rows(self) -> str:
        """The rows' fingerprint; a cache made from other rows refused (before any step: the Trainer's start)."""
        rows = fingerprint_rows(self.stage.rows)
        if self.tensors.is_file() and self.meta.is_file():
            meta = json.loads(self.meta.read_text())
            if meta.get("rows") != rows:
                self._refuse(f"made from other rows ({meta.get('count')} rows, fingerprint {meta.get('rows')}) than "
                             f"stage {self.stage.stage.name}'s data ({len(self.stage.rows)} rows, fingerprint "
                             f"{rows})", f"delete {self.dir} to compute it again, or give the stage the data it was "
                             "made from")
        return rows

    def get(self, model, unwrapped, at_start: bool, compute) -> tuple[torch.Tensor, str]:
        """(logps, "computed" or "reused"). `compute()` gives the log-probabilities when there is no cache; at the
        stage's start only (the weights then are the reference's)."""
        from safetensors.torch import load_file

        name = self.stage.stage.name
        rows = self.check_rows()
        weights = fingerprint_model(unwrapped) if at_start else None
        delete = f"delete {self.dir} to compute it again"
        if self.tensors.is_file() and self.meta.is_file():
            meta = json.loads(self.meta.read_text())
            if weights is not None and meta.get("weights") != weights:
                self._refuse(f"made from another model (weights fingerprint {meta.get('weights')}; the model at "
                             f"stage {name}'s start is {weights})", f"{delete}, or use another output_dir")
            logps = load_file(self.tensors)["logps"]
            if logps.shape != (len(self.stage.rows), 2):
                self._refuse(f"holds {tuple(logps.shape)} values for {len(self.stage.rows)} rows", delete)
            return logps, "reused"
        if not at_start:
            self._refuse(f"missing: stage {name}'s reference is computed at its start, from the model as it was "
                         "then, and this run resumes past it", "resume from a checkpoint at or before the stage's "
                         "start, or start afresh (--fresh_start true)")
        logps = compute()
        if int(os.environ.get("RANK", "0")) == 0:
            self._write(logps, rows, weights)
        return logps, "computed"

    def _write(self, logps: torch.Tensor, rows: str, weights: str) -> None:
        from safetensors.torch import save_file

        self.dir.mkdir(parents=True, exist_ok=True)
        for path, write in ((self.tensors, lambda p: save_file({"logps": logps.contiguous()}, str(p))),
                            (self.meta, lambda p: p.write_text(json.dumps({
                                "stage": self.stage.stage.name, "count": len(self.stage.rows),
                                "held_out": len(self.stage.held_out), "rows": rows,
                                "weights": weights, "columns": ["chosen", "rejected"]}, indent=1)))):
            tmp = path.with_name(path.name + ".tmp")
            write(tmp)
            os.replace(tmp, path)  # a run killed while writing leaves no half cache for the next to trust
