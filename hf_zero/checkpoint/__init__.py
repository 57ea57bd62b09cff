"""Checkpoints: written crash-safe, verified, resumed (also on another rank count), exported."""
