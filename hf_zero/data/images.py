"""Image samples for recipes/classify.py: grayscale images upscaled to the model's size, augmented by a random
affine map when they are training images, then encoded by the model's image processor, one at a time on access."""

from __future__ import annotations

from hf_zero.core.console import rank

__all__ = ["ImageSource", "random_affine"]


def random_affine(img, rng, degrees: float = 12.0, shift: float = 0.1, scale: tuple = (0.9, 1.1)):
    """Rotate, scale and shift a PIL image about its centre (torchvision's RandomAffine, without torchvision)."""
    import math

    from PIL import Image

    w, h = img.size
    angle = math.radians(rng.uniform(-degrees, degrees))
    s = rng.uniform(*scale)
    tx, ty = rng.uniform(-shift, shift) * w, rng.uniform(-shift, shift) * h
    cx, cy = w / 2, h / 2
    # PIL maps each output pixel back to its input pixel: the inverse of (scale s, rotate angle, shift t).
    a, b = math.cos(angle) / s, math.sin(angle) / s
    d, e = -math.sin(angle) / s, math.cos(angle) / s
    c = cx - a * (cx + tx) - b * (cy + ty)
    f = cy - d * (cx + tx) - e * (cy + ty)
    return img.transform((w, h), Image.Transform.AFFINE, (a, b, c, d, e, f), resample=Image.Resampling.BILINEAR)


class ImageSource:
    """Grayscale images encoded on access: upscaled, augmented (training only), then the model's image processor.

    Augmentation draws from a generator seeded by (seed, rank): reproducible for a given seed and world size."""

    def __init__(self, images: list, labels: list[int], processor, augment: bool, seed: int):
        self.images, self.labels, self.processor, self.augment, self.seed = images, labels, processor, augment, seed
        size = processor.size
        self.side = size.get("shortest_edge") or size.get("height") or 224
        self._rng = None

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> dict:
        from PIL import Image

        img = Image.fromarray(self.images[i]).resize((self.side, self.side), Image.Resampling.BICUBIC)
        if self.augment:
            if self._rng is None:
                import numpy as np

                self._rng = np.random.default_rng([self.seed, rank()])
            img = random_affine(img, self._rng)
        pixels = self.processor(img.convert("RGB"), return_tensors="pt")["pixel_values"][0]
        return {"pixel_values": pixels, "labels": int(self.labels[i])}
