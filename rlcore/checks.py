"""Input validation with messages that name the argument, the shape expected and the shape seen.

All checks read only shapes and dtypes (never tensor values), so they cost nothing on the
device, never synchronise, and trace cleanly under ``torch.compile``. ``check_finite`` is the one
exception: it reads values, and is meant for the loop boundary (``loops/``), not inside kernels.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import torch

__all__ = [
    "check_ndim",
    "check_same_shape",
    "check_mask",
    "check_float",
    "require_keys",
    "check_finite",
    "NonFiniteError",
    "lookup",
    "bind_keywords",
]


class NonFiniteError(FloatingPointError):
    """A loss, gradient or statistic came out NaN or infinite."""


def _fmt(shape: Iterable[int]) -> str:
    return "[" + ", ".join(str(int(s)) for s in shape) + "]"


def check_ndim(name: str, x: torch.Tensor, *, ndim: int | None = None, min_ndim: int | None = None,
               layout: str = "") -> None:
    """Raise ``ValueError`` unless ``x`` is a tensor of rank ``ndim`` (or at least ``min_ndim``).

    ``layout`` is the documented shape (e.g. ``"[B, T]"``) quoted in the message.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor {layout}, got {type(x).__name__}")
    if ndim is not None and x.ndim != ndim:
        raise ValueError(f"{name}: expected a {ndim}-d tensor {layout}, got shape {_fmt(x.shape)}")
    if min_ndim is not None and x.ndim < min_ndim:
        raise ValueError(
            f"{name}: expected at least {min_ndim} dims {layout}, got shape {_fmt(x.shape)}")


def check_same_shape(ref_name: str, ref: torch.Tensor, **others: torch.Tensor | None) -> None:
    """Raise ``ValueError`` unless every tensor in ``others`` has the shape of ``ref``.

    ``None`` entries are skipped (optional arguments).
    """
    check_ndim(ref_name, ref)
    for name, x in others.items():
        if x is None:
            continue
        check_ndim(name, x)
        if x.shape != ref.shape:
            raise ValueError(f"{name}: expected shape {_fmt(ref.shape)} (the shape of {ref_name}), "
                             f"got {_fmt(x.shape)}")


def check_mask(name: str, mask: torch.Tensor, *, like: torch.Tensor | None = None,
               like_name: str = "values") -> None:
    """Raise unless ``mask`` is a bool tensor (``TypeError``) shaped like ``like`` (``ValueError``).

    Masks are never inferred from pad values and never cast silently: a float or integer mask
    is almost always a bug upstream (a 0/1 attention mask that should have been ``.bool()``).
    """
    check_ndim(name, mask)
    if mask.dtype != torch.bool:
        raise TypeError(f"{name}: expected a torch.bool mask, got dtype {mask.dtype} "
                        f"with shape {_fmt(mask.shape)} (convert with .bool())")
    if like is not None and mask.shape != like.shape:
        raise ValueError(f"{name}: expected shape {_fmt(like.shape)} (the shape of {like_name}), "
                         f"got {_fmt(mask.shape)}")


def check_float(name: str, x: torch.Tensor) -> None:
    """Raise ``TypeError`` unless ``x`` is a floating-point tensor."""
    check_ndim(name, x)
    if not x.is_floating_point():
        raise TypeError(f"{name}: expected a floating-point tensor, got dtype {x.dtype} "
                        f"with shape {_fmt(x.shape)}")


def require_keys(batch: Any, keys: Sequence, *, where: str, layouts: Mapping | None = None) -> None:
    """Raise ``KeyError`` naming every key of ``keys`` missing from ``batch`` (a TensorDict).

    ``layouts`` maps a key to its documented shape, quoted in the message.
    """
    present = set(batch.keys(include_nested=True, leaves_only=False)) if hasattr(batch, "batch_size") \
        else set(batch.keys())
    missing = [k for k in keys if k not in present]
    if missing:
        layouts = layouts or {}
        described = ", ".join(f"{k!r}" + (f" {layouts[k]}" if k in layouts else "") for k in missing)
        raise KeyError(f"{where}: batch is missing {described}; it has {sorted(map(str, present))}")


def check_finite(name: str, x: torch.Tensor) -> None:
    """Raise ``NonFiniteError`` if ``x`` holds a NaN or an infinity. Reads values: synchronises."""
    if not torch.isfinite(x).all():
        n_nan = int(torch.isnan(x).sum())
        n_inf = int(torch.isinf(x).sum())
        raise NonFiniteError(f"{name}: {n_nan} NaN and {n_inf} inf values in a tensor of shape "
                             f"{_fmt(x.shape)}")


V = TypeVar("V")


def lookup(registry: Mapping[str, V], name: str, *, what: str = "name") -> V:
    """``registry[name]``, or a ``ValueError`` naming the argument ``what`` and the valid names.

    Every registry of rlcore is a plain dict; this is the one way they are read.

    >>> lookup({"token_mean": 1}, "token_mean")
    1
    >>> lookup({"token_mean": 1}, "mean", what="agg")
    Traceback (most recent call last):
    ...
    ValueError: agg: unknown 'mean'; valid: ['token_mean']
    """
    try:
        return registry[name]
    except KeyError:
        raise ValueError(f"{what}: unknown {name!r}; valid: {sorted(registry)}") from None


def bind_keywords(fn: Callable[..., Any], keywords: Mapping[str, Any], *, what: str, name: str,
                  positional: Sequence[str] = ("batch",)) -> Callable[..., Any]:
    """``functools.partial(fn, **keywords)`` after checking every keyword is a parameter of ``fn``
    (other than the ``positional`` ones the caller passes): a registry entry chosen by ``name``
    with its hyper-parameters from a config, as ``advantage`` / ``advantage_kwargs``.

    >>> def estimator(batch, *, gamma=1.0): ...
    >>> bind_keywords(estimator, {"lam": 0.9}, what="advantage_kwargs", name="gae")
    Traceback (most recent call last):
    ...
    ValueError: advantage_kwargs: 'gae' takes no ['lam']; its parameters: ['gamma']
    """
    if not isinstance(keywords, Mapping) or not all(isinstance(k, str) for k in keywords):
        raise ValueError(f"{what}: expected a mapping of keyword: value, got {keywords!r}")
    accepted = set(inspect.signature(fn).parameters) - set(positional)
    wrong = sorted(set(keywords) - accepted)
    if wrong:
        raise ValueError(f"{what}: {name!r} takes no {wrong}; its parameters: {sorted(accepted)}")
    return functools.partial(fn, **keywords)
