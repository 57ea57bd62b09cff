"""The multimodal rows' collator: text padded (or packed rows' positions kept), each modality's items loaded and
stacked in reading order, the order the model fills its placeholder runs in (hf_zero.data.multimodal reads, checks
and tokenizes the rows; hf_zero.data.vlm's collator adds a stock VLM's image tensors)."""

from __future__ import annotations

from pathlib import Path

from hf_zero.data.chat import IGNORE
from hf_zero.data.multimodal import load_media
from hf_zero.data.packing import pad_id

__all__ = ["MultimodalCollator"]


class MultimodalCollator:
    """Pads text (pad token, labels -100, attention mask 0) and stacks each modality's items in reading order (row
    by row, left to right), the order the model fills its placeholder runs in: `<modality>_values` (items x
    input_shape, zero items when the batch has none) and `<modality>_rows` (the batch row each item fills).
    Packed rows (hf_zero.data.packing: they carry position_ids) keep their positions and get no attention mask and
    no cache, as the text collator sends them, so transformers keeps their conversations apart."""

    def __init__(self, tokenizer, specs: dict):
        self.pad, self.specs = pad_id(tokenizer), specs

    def __call__(self, samples: list[dict]) -> dict:
        import numpy as np
        import torch

        longest = max(len(s["input_ids"]) for s in samples)
        ids = torch.full((len(samples), longest), self.pad, dtype=torch.long)
        labels = torch.full((len(samples), longest), IGNORE, dtype=torch.long)
        attention = torch.zeros((len(samples), longest), dtype=torch.long)
        packed = "position_ids" in samples[0]
        positions = torch.zeros((len(samples), longest), dtype=torch.long) if packed else None
        for i, s in enumerate(samples):
            n = len(s["input_ids"])
            ids[i, :n], labels[i, :n], attention[i, :n] = (torch.tensor(s["input_ids"]), torch.tensor(s["labels"]), 1)
            if packed:  # rows of a stage share a length; a shorter one's tail is one more padding segment
                positions[i] = torch.tensor(s["position_ids"] + list(range(longest - n)))
        batch = {"input_ids": ids, "attention_mask": attention, "labels": labels} if not packed else \
            {"input_ids": ids, "labels": labels, "position_ids": positions, "use_cache": False}
        for m, spec in self.specs.items():
            items = [(i, Path(p)) for i, s in enumerate(samples) for kind, p in s.get("media", ()) if kind == m]
            values = np.stack([load_media(spec, p) for _, p in items]) if items else \
                np.zeros((0, *spec.input_shape), dtype=np.float32)
            batch[f"{m}_values"] = torch.from_numpy(values)
            batch[f"{m}_rows"] = torch.tensor([i for i, _ in items], dtype=torch.long)
        return batch
