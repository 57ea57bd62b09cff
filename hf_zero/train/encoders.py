"""Small encoders trained from scratch, for the multimodal recipe's tiny configs and demos. They are plain
`torch.nn.Module`s named by import path in a recipe (`class: hf_zero.train.encoders:PointNet`), exactly as a user's
own encoder is: nothing in the composed model knows them.

Each takes a batch of items (B, *input_shape) and returns (B, tokens, width): the composed model's projector maps
`width` to the LLM's hidden size, and the data puts `tokens` placeholder positions in the text per item.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["PointNet", "TinyConvEncoder"]


class PointNet(nn.Module):
    """PointNet-style: a shared MLP on every point, then max-pooling over the points (order does not matter), and
    `tokens` output vectors read from the pooled feature.

    `canonical=True` first puts every cloud in a pose and size of its own: centred, scaled to a mean distance of 1
    from its centre, turned onto its principal axes (each axis's sign set by the side its points lean to), and each
    point given its distance from the centre as a fourth feature. A shape's pose and size say nothing about what it
    is; PointNet learns an alignment (its T-Net) only from far more clouds than a demo trains on: from scratch, a
    plain PointNet read the demo's five shapes at chance after 90 steps, where the canonical one learns them."""

    def __init__(self, in_dim: int = 3, hidden: int = 64, width: int = 64, tokens: int = 4, canonical: bool = False):
        super().__init__()
        self.tokens, self.width, self.canonical = tokens, width, canonical
        self.point_mlp = nn.Sequential(nn.Linear(in_dim + canonical, hidden), nn.GELU(), nn.Linear(hidden, hidden),
                                       nn.GELU(), nn.Linear(hidden, hidden))
        self.head = nn.Linear(hidden, tokens * width)

    def forward(self, points: torch.Tensor) -> torch.Tensor:
        # Centred per item: a shape's position in space says nothing about what shape it is.
        points = points - points.mean(dim=1, keepdim=True)
        if self.canonical:
            points = _canonical_pose(points)
        pooled = self.point_mlp(points).max(dim=1).values
        return self.head(pooled).view(points.shape[0], self.tokens, self.width)


def _canonical_pose(points: torch.Tensor) -> torch.Tensor:
    """Centred clouds (B, N, 3) -> (B, N, 4): scaled, on their principal axes, with each point's distance."""
    work = points.float()
    work = work / work.norm(dim=2).mean(dim=1).clamp_min(1e-6)[:, None, None]
    covariance = work.transpose(1, 2) @ work / work.shape[1]
    _, axes = torch.linalg.eigh(covariance)  # ascending: the last axis is the longest
    work = work @ axes
    work = work * torch.where((work ** 3).mean(dim=1, keepdim=True) >= 0, 1.0, -1.0)
    return torch.cat([work, work.norm(dim=2, keepdim=True)], dim=2).to(points.dtype)


class TinyConvEncoder(nn.Module):
    """Two strided convolutions; every cell of the final feature map is one output token."""

    def __init__(self, in_channels: int = 1, channels: int = 32, width: int = 64):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(in_channels, channels, 3, stride=2, padding=1), nn.GELU(),
                                 nn.Conv2d(channels, width, 3, stride=2, padding=1))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.net(images).flatten(2).transpose(1, 2)
