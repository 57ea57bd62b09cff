"""Data for the multimodal recipe's tiny configs and demos, generated offline: point clouds of five shapes (cube,
sphere, cylinder, cone, torus; random pose, scale and noise) as .npy files, scikit-learn's 8x8 digits as PNG files,
and chat rows in TRL's multimodal form that point at them (paths relative to the rows' file).

    python -m hf_zero.data.multimodal_demo OUT_DIR [--shapes N] [--digits N] [--points P] [--seed S]

The demo's data (recipes/configs/multimodal_demo.yaml: `builtin:multimodal_demo/shapes`, `.../shapes_test`,
`.../digits`, `.../digits_test`) is `write_demo`'s, built once into the cache when a run first names it.
"""

from __future__ import annotations  # numpy is imported where used: hf_zero.data.builtin imports this module

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

__all__ = ["SHAPES", "sample_shape", "write_shapes", "write_digits", "write_demo", "DEMO_VERSION", "main"]

SHAPES = ("cube", "sphere", "cylinder", "cone", "torus")
SHAPE_QUESTION, DIGIT_QUESTION = "What shape is this?", "What digit is this?"
DEMO_VERSION = "v3"  # the demo's cache folder: a change to write_demo's output gets a new one (v2: slim cylinders;
# v3: an empty system message)
# The demo's rows carry an empty system message: without one SmolLM2's chat template writes its default (17 tokens,
# "You are a helpful AI assistant named SmolLM...") into every row, 40% of a 42-token shape row, and the encoder
# stages' steps cost in proportion to their tokens.
DEMO_SYSTEM = ""
DEMO_TEST_PER_CLASS = 10  # held-out shapes per shape: 50 held-out rows, and as many held-out digits


def _surface(shape: str, n: int, rng) -> np.ndarray:
    """n points on the unit-sized surface of `shape`, centred at the origin."""
    import numpy as np

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
    if shape == "cylinder":  # twice as long as it is wide: at height 2 and radius 1 its points lie as a cube's do
        z = np.where(on_cap, rng.choice([-1.0, 1.0], n), rng.uniform(-1, 1, n))
        r = np.where(on_cap, 0.5 * r_cap, 0.5)
    elif shape == "cone":  # apex at z = 1, base of radius 1 at z = -1; uniform over the side's area
        t = np.sqrt(rng.uniform(size=n))
        z, r = np.where(on_cap, -1.0, 1 - 2 * t), np.where(on_cap, r_cap, t)
    else:
        raise ValueError(f"unknown shape {shape!r}")
    return np.stack([r * np.cos(theta), r * np.sin(theta), z], axis=1)


def sample_shape(shape: str, n: int, rng) -> np.ndarray:
    """A random pose (rotation, scale, shift) and noise on the shape's surface: float32 (n, 3)."""
    import numpy as np

    q, r = np.linalg.qr(rng.normal(size=(3, 3)))
    rotation = q * np.sign(np.diag(r))
    points = _surface(shape, n, rng) @ rotation.T * rng.uniform(0.5, 1.5) + rng.uniform(-0.5, 0.5, 3)
    return (points + rng.normal(scale=0.02, size=points.shape)).astype(np.float32)


def _row(kind: str, file: str, question: str, answer: str, system: str | None = None) -> dict:
    head = [] if system is None else [{"role": "system", "content": system}]
    return {"messages": [*head, {"role": "user", "content": [{"type": kind, kind: file}, {"type": "text", "text":
                                                                                       question}]},
                         {"role": "assistant", "content": [{"type": "text", "text": answer}]}]}


def write_shapes(out: Path, count: int, points: int = 256, seed: int = 0, name: str = "shapes",
                 system: str | None = None) -> Path:
    """out/<name>/*.npy and out/<name>.jsonl ("What shape is this?" -> the shape's name), shapes in turn; `system`:
    each row's system message (None: none)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    (out / name).mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(count):
        shape = SHAPES[i % len(SHAPES)]
        file = f"{name}/{i:05d}_{shape}.npy"
        np.save(out / file, sample_shape(shape, points, rng))
        rows.append(_row("points", file, SHAPE_QUESTION, shape, system))
    path = out / f"{name}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_digits(out: Path, count: int, seed: int = 0, name: str = "digits", skip: int = 0,
                 system: str | None = None) -> Path:
    """out/<name>/*.png (scikit-learn's 8x8 digits, drawn in a fixed random order, the first `skip` of it left out)
    and out/<name>.jsonl."""
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    order = np.random.default_rng(seed).permutation(len(digits.target))[skip:skip + count]
    (out / name).mkdir(parents=True, exist_ok=True)
    rows = []
    for i in order:
        file = f"{name}/{i:05d}.png"
        Image.fromarray((digits.images[i] * (255.0 / 16.0)).round().astype(np.uint8)).save(out / file)
        rows.append(_row("image", file, DIGIT_QUESTION, str(digits.target[i]), system))
    path = out / f"{name}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_demo(out: Path, shapes: int = 1000, points: int = 256) -> None:
    """The demo's four sources: `shapes` training point clouds and 50 held-out ones (another seed: other poses and
    noise), scikit-learn's 1,797 digits as 50 held-out and 1,747 training images (no image in both); every row with
    DEMO_SYSTEM as its system message."""
    out = Path(out)
    write_shapes(out, shapes, points, seed=0, system=DEMO_SYSTEM)
    write_shapes(out, DEMO_TEST_PER_CLASS * len(SHAPES), points, seed=1, name="shapes_test", system=DEMO_SYSTEM)
    held_out = DEMO_TEST_PER_CLASS * len(SHAPES)
    write_digits(out, held_out, name="digits_test", system=DEMO_SYSTEM)
    write_digits(out, 1797 - held_out, skip=held_out, system=DEMO_SYSTEM)


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
