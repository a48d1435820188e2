"""Seeding. Pure functions never touch global RNG; randomness takes a ``torch.Generator``."""

from __future__ import annotations

import os
import random

import torch

__all__ = ["set_seed", "make_generator"]


def set_seed(seed: int, *, deterministic: bool = False) -> torch.Generator:
    """Seed Python, NumPy (if installed) and torch's global generators; return a fresh generator.

    The global seeds cover third-party code (model init, dropout, HF ``generate``); rlcore's own
    random functions take the returned ``torch.Generator`` explicitly. ``deterministic=True``
    also asks torch for deterministic kernels (and sets ``CUBLAS_WORKSPACE_CONFIG`` for CUDA).
    """
    random.seed(seed)
    try:
        import numpy as np
        np.random.seed(seed % 2**32)
    except ImportError:  # numpy is optional
        pass
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    return make_generator(seed)


def make_generator(seed: int, device: str | torch.device = "cpu") -> torch.Generator:
    """A ``torch.Generator`` on ``device`` seeded with ``seed``."""
    return torch.Generator(device=device).manual_seed(seed)
