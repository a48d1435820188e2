"""Input validation with messages that name the argument, the shape expected and the shape seen.

All checks read only shapes and dtypes (never tensor values), so they cost nothing on the
device, never synchronise, and trace cleanly under ``torch.compile``. ``check_finite`` is the one
exception: it reads values, and is meant for the loop boundary (``loops/``), not inside kernels.
Hyper-parameters (``check_number``, ``check_scalar``) are checked where they are used, so a kernel
called directly refuses a bad one as a config would: Python numbers are read as they are (free under
``torch.compile``); a tensor-valued coefficient has its shape and dtype checked, its value only
where the caller asks for it (``read=True``), outside ``torch.compile``.

Validation happens once, at the boundary: a TensorDict-level loss (``ppo_loss``, ``dpo_loss``, ...)
checks every key it reads, then computes inside :func:`validated`, where the checks of the tensor
kernels it calls (``clipped_surrogate``, ``masked_mean``, ...) return at once. Called directly, each
kernel checks its own arguments.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import numbers
import threading
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
    "check_number",
    "check_divisor",
    "MIN_DIVISOR",
    "check_scalar",
    "NonFiniteError",
    "lookup",
    "bind_keywords",
    "validated",
    "check_leaves",
]

_scope = threading.local()  # depth of `validated()` scopes on this thread (torch.compile traces it)


@contextlib.contextmanager
def validated():
    """A scope whose inputs are already checked: inside it ``check_ndim``, ``check_same_shape``,
    ``check_mask`` and ``check_float`` return at once (``require_keys`` still checks: a key that
    one branch needs is asked for where the branch is taken). A boundary function checks
    what it was given, then computes inside it, so the kernels it calls do not check again.
    Per thread; nests.

    >>> with validated():
    ...     check_mask("mask", torch.zeros(2))  # a float mask passes unseen inside the scope
    >>> check_mask("mask", torch.zeros(2))
    Traceback (most recent call last):
    ...
    TypeError: mask: expected a torch.bool mask, got dtype torch.float32 with shape [2] (convert with .bool())
    """
    _scope.depth = getattr(_scope, "depth", 0) + 1
    try:
        yield
    finally:
        _scope.depth -= 1


def _trusted() -> bool:
    return getattr(_scope, "depth", 0) > 0


class NonFiniteError(FloatingPointError):
    """A loss, gradient or statistic came out NaN or infinite."""


def _fmt(shape: Iterable[int]) -> str:
    return "[" + ", ".join(str(int(s)) for s in shape) + "]"


def check_ndim(name: str, x: torch.Tensor, *, ndim: int | None = None, min_ndim: int | None = None,
               layout: str = "") -> None:
    """Raise ``ValueError`` unless ``x`` is a tensor of rank ``ndim`` (or at least ``min_ndim``).

    ``layout`` is the documented shape (e.g. ``"[B, T]"``) quoted in the message.
    """
    if _trusted():
        return
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
    if _trusted():
        return
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
    if _trusted():
        return
    check_ndim(name, mask)
    if mask.dtype != torch.bool:
        raise TypeError(f"{name}: expected a torch.bool mask, got dtype {mask.dtype} "
                        f"with shape {_fmt(mask.shape)} (convert with .bool())")
    if like is not None and mask.shape != like.shape:
        raise ValueError(f"{name}: expected shape {_fmt(like.shape)} (the shape of {like_name}), "
                         f"got {_fmt(mask.shape)}")


def check_float(name: str, x: torch.Tensor) -> None:
    """Raise ``TypeError`` unless ``x`` is a floating-point tensor."""
    if _trusted():
        return
    check_ndim(name, x)
    if not x.is_floating_point():
        raise TypeError(f"{name}: expected a floating-point tensor, got dtype {x.dtype} "
                        f"with shape {_fmt(x.shape)}")


def require_keys(batch: Any, keys: Sequence, *, where: str, layouts: Mapping | None = None) -> None:
    """Raise ``KeyError`` naming every key of ``keys`` missing from ``batch`` (a TensorDict).

    ``layouts`` maps a key to its documented shape, quoted in the message.
    """
    nested = hasattr(batch, "batch_size")
    names = batch.keys(include_nested=True, leaves_only=False) if nested else batch.keys()
    missing = [k for k in keys if k not in names]
    if missing:
        present = set(names)
        layouts = layouts or {}
        described = ", ".join(f"{k!r}" + (f" {layouts[k]}" if k in layouts else "") for k in missing)
        raise KeyError(f"{where}: batch is missing {described}; it has {sorted(map(str, present))}")


def _key_name(key: Any) -> str:
    return ".".join(key) if isinstance(key, tuple) else str(key)


def check_leaves(batch: Any, *, where: str, mask: Any = None, tokens: Sequence = (), sequences: Sequence = ()) -> None:
    """Check the leaves a TensorDict adapter reads, each error naming the batch key (not the name
    of the kernel argument it feeds): every key present; ``mask`` a ``torch.bool`` ``[B, R]`` (one dim
    past the batch's); each of ``tokens`` a float tensor of the mask's shape; each of ``sequences``
    a float tensor of the batch's shape ``[B]`` (the mask's without ``R``; with no mask, the first
    one's). After it the kernel's own checks pass for these
    leaves (an adapter may call it inside :func:`validated`).

    >>> from tensordict import TensorDict
    >>> td = TensorDict({"rewards": torch.zeros(2, 3), "response_mask": torch.ones(2, 4, dtype=torch.bool)}, [2])
    >>> check_leaves(td, where="with_gae", mask="response_mask", tokens=["rewards"])
    Traceback (most recent call last):
    ...
    ValueError: rewards: expected shape [2, 4] (the shape of response_mask), got [2, 3]
    """
    layouts = {**({} if mask is None else {mask: "[B, R] bool"}), **dict.fromkeys(tokens, "[B, R] float"),
               **dict.fromkeys(sequences, "[B] float")}
    require_keys(batch, list(layouts), where=where, layouts=layouts)
    first = _key_name(sequences[0]) if sequences else ""
    checks = [(sequences, tuple(batch.get(sequences[0]).shape) if sequences else (), f"the shape of {first}")]
    if mask is not None:
        m, mask_name = batch.get(mask), _key_name(mask)
        check_mask(mask_name, m)
        check_ndim(mask_name, m, ndim=len(batch.batch_size) + 1, layout="[B, R]")
        checks = [(tokens, tuple(m.shape), f"the shape of {mask_name}"), (sequences, tuple(m.shape[:-1]), "the batch")]
    elif tokens:
        raise ValueError("tokens: token leaves are checked against a mask; pass mask")
    for keys, shape, of in checks:
        for key in keys:
            x, name = batch.get(key), _key_name(key)
            check_float(name, x)
            if tuple(x.shape) != shape:
                raise ValueError(f"{name}: expected shape {_fmt(shape)} ({of}), got {_fmt(x.shape)}")


def check_finite(name: str, x: torch.Tensor) -> None:
    """Raise ``NonFiniteError`` if ``x`` holds a NaN or an infinity. Reads values: synchronises."""
    if not torch.isfinite(x).all():
        n_nan = int(torch.isnan(x).sum())
        n_inf = int(torch.isinf(x).sum())
        raise NonFiniteError(f"{name}: {n_nan} NaN and {n_inf} inf values in a tensor of shape "
                             f"{_fmt(x.shape)}")


def _interval(low: float | None, high: float | None, low_open: bool, high_open: bool) -> str:
    if low is not None and high is not None:
        return f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    if low is not None:
        return f"{'>' if low_open else '>='} {low:g}"
    if high is not None:
        return f"{'<' if high_open else '<='} {high:g}"
    return ""


def check_number(name: str, value: Any, *, low: float | None = None, high: float | None = None,
                 low_open: bool = False, high_open: bool = False, allow_inf: bool = False) -> None:
    """Raise ``ValueError`` unless ``value`` is a real number (not a ``bool``), not NaN, finite unless
    ``allow_inf``, and within ``[low, high]`` (an end excluded where ``low_open`` / ``high_open``):
    a hyper-parameter whose bad value would otherwise invert a loss or make it NaN.

    Reads a Python number only: free, and traced away by ``torch.compile``.

    >>> check_number("beta", 0.1, low=0, low_open=True)
    >>> check_number("beta", float("nan"), low=0, low_open=True)
    Traceback (most recent call last):
    ...
    ValueError: beta: expected a finite number > 0, got nan
    """
    bounds = _interval(low, high, low_open, high_open)
    wanted = ("a number (inf allowed)" if allow_inf else "a finite number") + (f" {bounds}" if bounds else "")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name}: expected {wanted}, got {type(value).__name__} {value!r}")
    v = float(value)
    ok = not math.isnan(v) and (allow_inf or math.isfinite(v))
    ok = ok and (low is None or (v > low if low_open else v >= low))
    ok = ok and (high is None or (v < high if high_open else v <= high))
    if not ok:
        raise ValueError(f"{name}: expected {wanted}, got {value!r}")


# The smallest value of a positive hyper-parameter that a formula divides by (β of IPO's 1/(2β),
# a temperature's 4/τ or x/τ, DiscoPOP's τ): 1/x ≤ 1e12, so with inputs of float32 magnitude
# (|x| ≤ 3.4e38, the log-probs and advantages the losses read) a term such as (Δ − 1/(2β))² or
# A·4/τ stays below 1.2e77 (or its gradient below 1e51) in float64, far from overflow, while a
# denormal such as 1e-310 makes 1/β infinite (then NaN). No setting in use comes near 1e-12.
MIN_DIVISOR = 1e-12


def check_divisor(name: str, value: Any, *, allow_inf: bool = False) -> None:
    """:func:`check_number` for a positive hyper-parameter that a formula divides by: a finite
    number ``> 0`` (the message of ``check_number(low=0, low_open=True)``) and ``>= MIN_DIVISOR``
    (1e-12), so its reciprocal stays finite and far from overflow.

    >>> check_divisor("beta", 1e-310)
    Traceback (most recent call last):
    ...
    ValueError: beta: expected a finite number >= 1e-12 (it is divided by: 1/1e-310 overflows), got 1e-310
    """
    check_number(name, value, low=0.0, low_open=True, allow_inf=allow_inf)
    if value < MIN_DIVISOR:
        raise ValueError(f"{name}: expected a finite number >= {MIN_DIVISOR:g} (it is divided by: 1/{value!r} "
                         f"overflows), got {value!r}")


def check_scalar(name: str, value: Any, *, read: bool = False, **bounds: Any) -> None:
    """:func:`check_number` for a coefficient that may also be a tensor (an adaptive state's ``β``):
    a tensor must be a 0-d floating-point one (``ValueError`` naming the shape seen otherwise: a
    ``[T]`` tensor would silently apply one value per token). Its value is checked against
    ``bounds`` only with ``read=True`` and outside ``torch.compile`` (reading it synchronises).

    >>> check_scalar("kl_coef", torch.zeros(3))
    Traceback (most recent call last):
    ...
    ValueError: kl_coef: expected a float or a 0-d tensor, got a tensor of shape [3]
    """
    if not isinstance(value, torch.Tensor):
        check_number(name, value, **bounds)
        return
    if value.ndim != 0:
        raise ValueError(f"{name}: expected a float or a 0-d tensor, got a tensor of shape {_fmt(value.shape)}")
    if not value.is_floating_point():
        raise TypeError(f"{name}: expected a floating-point tensor, got dtype {value.dtype}")
    if read and not torch.compiler.is_compiling():
        check_number(name, float(value.detach()), **bounds)


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
