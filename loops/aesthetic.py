"""An aesthetic-style image reward for DDPO: a CLIP image encoder, its normalised embedding, and an
MLP head laid out as the LAION aesthetic predictor (``768 → 1024 → 128 → 64 → 16 → 1``, dropout
between the first layers; keys ``layers.0`` ... ``layers.7``), the scorer of the DDPO paper's
aesthetic task.

- :func:`build_aesthetic_scorer`: a small one from configs, offline and seeded (its scores mean
  nothing: for tests and for runs that only need the plumbing);
- :func:`save_aesthetic_scorer` / :func:`load_aesthetic_scorer`: a folder holding the image
  encoder (``save_pretrained``: a ``CLIPVisionModelWithProjection``, or a whole CLIP model's
  folder) and the head as ``aesthetic_head.safetensors``. Real weights: a CLIP ViT-L/14 folder
  and the predictor's head converted to safetensors (its keys are already ours).

Images (float, in ``[0, 1]``) are cropped to their centre square, resized to the encoder's
``image_size`` (bicubic, antialiased, on tensors: close to, not exactly, CLIP's PIL preprocessing)
and normalised with CLIP's mean and std.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

__all__ = ["HEAD_FILE", "AestheticHead", "AestheticScorer", "build_aesthetic_scorer", "save_aesthetic_scorer",
           "load_aesthetic_scorer"]

HEAD_FILE = "aesthetic_head.safetensors"
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


class AestheticHead(nn.Module):
    """The LAION aesthetic predictor's MLP over a normalised image embedding of width ``dim``."""

    def __init__(self, dim: int = 768):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(dim, 1024), nn.Dropout(0.2), nn.Linear(1024, 128), nn.Dropout(0.2),
                                    nn.Linear(128, 64), nn.Dropout(0.1), nn.Linear(64, 16), nn.Linear(16, 1))

    def forward(self, embeds: torch.Tensor) -> torch.Tensor:
        return self.layers(embeds)


class AestheticScorer(nn.Module):
    """``score(images) = head(e / ‖e‖)`` with ``e`` the CLIP image embedding; frozen, in eval mode.
    Called as a reward function: ``scorer(images [B, 3, H, W] in [0, 1], prompts, metadata) -> [B]``."""

    def __init__(self, encoder: nn.Module, head: AestheticHead):
        super().__init__()
        self.encoder, self.head = encoder.requires_grad_(False).eval(), head.requires_grad_(False).eval()
        self.register_buffer("mean", torch.tensor(CLIP_MEAN).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(CLIP_STD).view(1, 3, 1, 1), persistent=False)

    @torch.no_grad()
    def forward(self, images: torch.Tensor, prompts: Sequence[str] | None = None,
                metadata: Sequence[Any] | None = None) -> torch.Tensor:
        if images.ndim != 4 or images.shape[1] != 3 or not images.is_floating_point():
            raise ValueError(f"images: expected float [B, 3, H, W] in [0, 1], got {images.dtype} {list(images.shape)}")
        low, high = images.min().item(), images.max().item()
        if low < 0 or high > 1:
            raise ValueError(f"images: expected values in [0, 1], got [{low:.3g}, {high:.3g}] (uint8 or [-1, 1] "
                             "images: convert them first)")
        h, w = images.shape[-2:]
        side = min(h, w)  # the centre square, as CLIP's preprocessing crops
        square = images[..., (h - side) // 2:(h - side) // 2 + side, (w - side) // 2:(w - side) // 2 + side]
        size = self.encoder.config.image_size
        x = F.interpolate(square.float().to(self.mean.device), size=(size, size), mode="bicubic",
                          align_corners=False, antialias=True).clamp(0, 1)
        embeds = self.encoder(pixel_values=(x - self.mean) / self.std).image_embeds
        return self.head(embeds / embeds.norm(dim=-1, keepdim=True)).squeeze(-1).cpu()


def build_aesthetic_scorer(*, seed: int = 0, hidden_size: int = 32, num_layers: int = 2, image_size: int = 32,
                           patch_size: int = 8, projection_dim: int = 32) -> AestheticScorer:
    """A small scorer from configs (``CLIPVisionModelWithProjection`` and the head), offline, seeded."""
    from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        encoder = CLIPVisionModelWithProjection(CLIPVisionConfig(
            hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=num_layers,
            num_attention_heads=4, image_size=image_size, patch_size=patch_size, projection_dim=projection_dim))
        return AestheticScorer(encoder, AestheticHead(projection_dim))


def save_aesthetic_scorer(scorer: AestheticScorer, directory: str | Path) -> Path:
    """The encoder with ``save_pretrained`` and the head as ``HEAD_FILE`` in ``directory``."""
    directory = Path(directory)
    scorer.encoder.save_pretrained(directory)
    save_file({k: v.contiguous() for k, v in scorer.head.state_dict().items()}, str(directory / HEAD_FILE))
    return directory


def load_aesthetic_scorer(directory: str | Path) -> AestheticScorer:
    """The scorer of a folder (``save_aesthetic_scorer``'s layout), offline.

    Raises:
        FileNotFoundError: no ``HEAD_FILE`` in the folder.  ValueError: a head whose tensors do not
            fit the encoder's embedding width (names, shapes).
    """
    from transformers import CLIPVisionModelWithProjection

    directory = Path(directory)
    if not (directory / HEAD_FILE).is_file():
        raise FileNotFoundError(f"reward_model: {directory} has no {HEAD_FILE} (the aesthetic head)")
    encoder = CLIPVisionModelWithProjection.from_pretrained(str(directory), local_files_only=True)
    head = AestheticHead(encoder.config.projection_dim)
    weights, own = load_file(str(directory / HEAD_FILE)), head.state_dict()
    bad = sorted(set(weights) ^ set(own)) + sorted(k for k in set(weights) & set(own)
                                                   if weights[k].shape != own[k].shape)
    if bad:
        raise ValueError(f"reward_model: {directory / HEAD_FILE} does not fit a head over "
                         f"{encoder.config.projection_dim}-wide embeddings: {bad[:6]}")
    head.load_state_dict(weights)
    return AestheticScorer(encoder, head)
