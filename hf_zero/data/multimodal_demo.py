"""Data for the multimodal recipe's tiny configs and demos, generated offline: point clouds of five shapes (cube,
sphere, cylinder, cone, torus; random pose, scale and noise) as .npy files, scikit-learn's 8x8 digits as PNG files,
and chat rows in TRL's multimodal form that point at them (paths relative to the rows' file).

    python -m hf_zero.data.multimodal_demo OUT_DIR [--shapes N] [--digits N] [--points P] [--seed S]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

__all__ = ["SHAPES", "sample_shape", "write_shapes", "write_digits", "main"]

SHAPES = ("cube", "sphere", "cylinder", "cone", "torus")
SHAPE_QUESTION, DIGIT_QUESTION = "What shape is this?", "What digit is this?"


def _surface(shape: str, n: int, rng) -> np.ndarray:
    """n points on the unit-sized surface of `shape`, centred at the origin."""
    if shape == "sphere":
        p = rng.normal(size=(n, 3))
        return p / np.linalg.norm(p, axis=1, keepdims=True)
    if shape == "cube":
        p = rng.uniform(-1, 1, size=(n, 3))
        axis = rng.integers(0, 3, n)
        p[np.arange(n), axis] = rng.choice([-1.0, 1.0], n)
        return p
    if shape == "torus":
        u, v = rng.uniform(0, 2 * np.pi, n), rng.uniform(0, 2 * np.pi, n)
        ring = 1.0 + 0.35 * np.cos(v)
        return np.stack([ring * np.cos(u), ring * np.sin(u), 0.35 * np.sin(v)], axis=1)
    theta = rng.uniform(0, 2 * np.pi, n)
    on_cap = rng.uniform(size=n) < 0.25  # the flat end(s)
    r_cap = np.sqrt(rng.uniform(size=n))  # uniform over a disk
    if shape == "cylinder":
        z = np.where(on_cap, rng.choice([-1.0, 1.0], n), rng.uniform(-1, 1, n))
        r = np.where(on_cap, r_cap, 1.0)
    elif shape == "cone":  # apex at z = 1, base of radius 1 at z = -1; uniform over the side's area
        t = np.sqrt(rng.uniform(size=n))
        z, r = np.where(on_cap, -1.0, 1 - 2 * t), np.where(on_cap, r_cap, t)
    else:
        raise ValueError(f"unknown shape {shape!r}")
    return np.stack([r * np.cos(theta), r * np.sin(theta), z], axis=1)


def sample_shape(shape: str, n: int, rng) -> np.ndarray:
    """A random pose (rotation, scale, shift) and noise on the shape's surface: float32 (n, 3)."""
    q, r = np.linalg.qr(rng.normal(size=(3, 3)))
    rotation = q * np.sign(np.diag(r))
    points = _surface(shape, n, rng) @ rotation.T * rng.uniform(0.5, 1.5) + rng.uniform(-0.5, 0.5, 3)
    return (points + rng.normal(scale=0.02, size=points.shape)).astype(np.float32)


def _row(kind: str, file: str, question: str, answer: str) -> dict:
    return {"messages": [{"role": "user", "content": [{"type": kind, kind: file}, {"type": "text", "text": question}]},
                         {"role": "assistant", "content": [{"type": "text", "text": answer}]}]}


def write_shapes(out: Path, count: int, points: int = 256, seed: int = 0) -> Path:
    """out/shapes/*.npy and out/shapes.jsonl ("What shape is this?" -> the shape's name), shapes in turn."""
    rng = np.random.default_rng(seed)
    (out / "shapes").mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(count):
        shape = SHAPES[i % len(SHAPES)]
        name = f"shapes/{i:05d}_{shape}.npy"
        np.save(out / name, sample_shape(shape, points, rng))
        rows.append(_row("points", name, SHAPE_QUESTION, shape))
    path = out / "shapes.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_digits(out: Path, count: int, seed: int = 0) -> Path:
    """out/digits/*.png (scikit-learn's 8x8 digits, drawn in a fixed random order) and out/digits.jsonl."""
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    order = np.random.default_rng(seed).permutation(len(digits.target))[:count]
    (out / "digits").mkdir(parents=True, exist_ok=True)
    rows = []
    for i in order:
        name = f"digits/{i:05d}.png"
        Image.fromarray((digits.images[i] * (255.0 / 16.0)).round().astype(np.uint8)).save(out / name)
        rows.append(_row("image", name, DIGIT_QUESTION, str(digits.target[i])))
    path = out / "digits.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--shapes", type=int, default=200)
    parser.add_argument("--digits", type=int, default=200)
    parser.add_argument("--points", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(write_shapes(args.out, args.shapes, args.points, args.seed))
    print(write_digits(args.out, args.digits, args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
