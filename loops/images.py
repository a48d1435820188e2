"""Images for the diffusion recipes: latents to pixels and bytes, the JPEG rewards of the DDPO paper
(``REWARD_FUNCTIONS``), scoring with any ``reward_fn(images, prompts)``, and image grids."""

from __future__ import annotations

import inspect
import io
import itertools
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from rlcore.checks import check_float, check_ndim

try:
    from PIL import Image
except ImportError:  # optional extra
    Image = None

__all__ = ["latents_to_images", "images_to_uint8", "jpeg_sizes", "jpeg_compressibility", "jpeg_incompressibility",
           "REWARD_FUNCTIONS", "get_reward_fn", "score_images", "image_grid", "save_image_grid", "require_extra"]


def require_extra(module: Any, what: str, package: str) -> None:
    """An ``ImportError`` naming the ``rlcore[diffusion]`` extra when an optional ``module`` is missing."""
    if module is None:
        raise ImportError(f"{what} needs {package}: pip install 'rlcore[diffusion]'")


def latents_to_images(latents: torch.Tensor) -> torch.Tensor:
    """Pixel-space samples ``[..., C, H, W]`` in ``[−1, 1]`` to images in ``[0, 1]``: ``clamp(x/2 + 1/2, 0, 1)``.

    >>> latents_to_images(torch.tensor([-1.0, 0.0, 3.0]).reshape(1, 3, 1, 1)).flatten()
    tensor([0.0000, 0.5000, 1.0000])
    """
    check_float("latents", latents)
    return (latents / 2 + 0.5).clamp(0, 1)


def images_to_uint8(images: torch.Tensor) -> torch.Tensor:
    """Images ``[B, C, H, W]`` in ``[0, 1]`` to ``[B, H, W, C]`` uint8 on the CPU: ``round(255·x)``."""
    check_float("images", images)
    check_ndim("images", images, ndim=4, layout="[B, C, H, W]")
    return (images.detach().float() * 255).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).cpu()


def _pil(array: torch.Tensor) -> Any:
    arr = array.numpy()
    return Image.fromarray(arr[..., 0] if arr.shape[-1] == 1 else arr)


def jpeg_sizes(images: torch.Tensor, *, quality: int = 95) -> torch.Tensor:
    """Size of each image saved as JPEG (pillow, ``quality``), in kB (1 kB = 1000 bytes).

    Args: images ``[B, C, H, W]`` float in ``[0, 1]``, ``C`` = 1 or 3.  Returns: ``[B]`` float32.
    References: Black et al., https://arxiv.org/abs/2305.13301 (DDPO's compressibility reward).
    """
    require_extra(Image, "jpeg_sizes", "pillow")
    sizes = []
    for arr in images_to_uint8(images):
        buffer = io.BytesIO()
        _pil(arr).save(buffer, format="JPEG", quality=quality)
        sizes.append(buffer.tell() / 1000)
    return torch.tensor(sizes, dtype=torch.float32)


def jpeg_compressibility(images: torch.Tensor, prompts: Sequence[str] | None = None) -> torch.Tensor:
    """DDPO's compressibility reward: ``−`` JPEG size in kB (``[B]``); ``prompts`` are unused."""
    return -jpeg_sizes(images)


def jpeg_incompressibility(images: torch.Tensor, prompts: Sequence[str] | None = None) -> torch.Tensor:
    """DDPO's incompressibility reward: ``+`` JPEG size in kB (``[B]``); ``prompts`` are unused."""
    return jpeg_sizes(images)


# Reward functions, one signature: (images [B, C, H, W] in [0, 1], prompts: list[str]) -> [B].
REWARD_FUNCTIONS: dict[str, Callable[[torch.Tensor, Sequence[str]], torch.Tensor]] = {
    "jpeg_compressibility": jpeg_compressibility,
    "jpeg_incompressibility": jpeg_incompressibility,
}


def get_reward_fn(reward: str | Callable) -> Callable:
    """A reward function by name (``REWARD_FUNCTIONS``), or ``reward`` itself if it is callable."""
    if callable(reward):
        return reward
    try:
        return REWARD_FUNCTIONS[reward]
    except KeyError:
        raise ValueError(f"reward_fn: unknown {reward!r}; valid: {sorted(REWARD_FUNCTIONS)} "
                         f"or any callable (images, prompts) -> [B]") from None


def _takes_metadata(reward_fn: Callable) -> bool:
    """Whether ``reward_fn`` accepts a third positional argument (DDPO's ``prompt_metadata``)."""
    try:
        inspect.signature(reward_fn).bind(None, None, None)
    except TypeError:
        return False
    except ValueError:  # no signature (a builtin): call it as (images, prompts)
        return False
    return True


def score_images(reward_fn: Callable, images: torch.Tensor, prompts: Sequence[str],
                 metadata: Sequence[Any] | None = None) -> torch.Tensor:
    """``reward_fn(images, prompts)``, or ``reward_fn(images, prompts, metadata)`` when it takes a
    third argument (DDPO's signature), as a ``[B]`` float32 tensor (from a tensor, array or list;
    of a ``(rewards, reward_metadata)`` pair, the rewards).

    Raises:
        ValueError: rewards of another shape than ``[B]``, or NaN / infinite ones (naming the images).
    """
    if _takes_metadata(reward_fn):
        out = reward_fn(images, list(prompts), list(metadata) if metadata is not None else [{}] * len(prompts))
    else:
        out = reward_fn(images, list(prompts))
    if isinstance(out, tuple) and len(out) == 2:
        out = out[0]
    rewards = torch.as_tensor(out, dtype=torch.float32).detach().cpu()
    if rewards.shape != (images.shape[0],):
        raise ValueError(f"reward_fn: expected rewards of shape [{images.shape[0]}] (one per image), "
                         f"got {list(rewards.shape)}")
    if not rewards.isfinite().all():
        bad = (~rewards.isfinite()).nonzero().flatten().tolist()
        raise ValueError(f"reward_fn: returned {rewards[bad[0]].item()} (not finite) for images {bad[:8]} of "
                         f"{images.shape[0]} (prompts {[prompts[i] for i in bad[:3]]})")
    return rewards


def image_grid(images: torch.Tensor, *, nrow: int | None = None, scale: int = 4, padding: int = 2) -> Any:
    """A PIL image of ``images [B, C, H, W]`` (in ``[0, 1]``) in a grid of ``nrow`` per row,
    each upscaled ``scale`` times (nearest), on a white background."""
    require_extra(Image, "image_grid", "pillow")
    tiles = images_to_uint8(images.repeat_interleave(scale, -1).repeat_interleave(scale, -2))
    b, h, w, c = tiles.shape
    nrow = nrow or math.ceil(math.sqrt(b))
    rows = math.ceil(b / nrow)
    grid = torch.full((rows * (h + padding) + padding, nrow * (w + padding) + padding, c), 255, dtype=torch.uint8)
    for i, (r, col) in zip(range(b), itertools.product(range(rows), range(nrow))):
        y, x = padding + r * (h + padding), padding + col * (w + padding)
        grid[y:y + h, x:x + w] = tiles[i]
    return _pil(grid)


def save_image_grid(images: torch.Tensor, path: str | Path, **kwargs: Any) -> Path:
    """Write ``image_grid(images, **kwargs)`` as a PNG to ``path`` (parents created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    image_grid(images, **kwargs).save(path, format="PNG")
    return path
