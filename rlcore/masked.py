"""Masked reductions, whitening, and the token-aggregation modes of policy losses.

Every function here reads a value only where its mask is True: positions outside the mask may
hold anything (padding garbage, NaN, inf) without changing a result, and an empty mask gives a
defined value (0), never NaN. Masks are ``torch.bool`` and shaped exactly like the values.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rlcore.checks import check_float, check_mask, check_ndim, lookup

__all__ = [
    "masked_sum",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "zero_outside",
    "aggregate",
    "AGGREGATIONS",
    "token_mean",
    "seq_mean_token_sum",
    "seq_mean_token_mean",
    "seq_sum_norm",
]

Dim = int | tuple[int, ...] | None


def _check(x: torch.Tensor, mask: torch.Tensor, name: str = "values") -> None:
    check_float(name, x)
    check_mask("mask", mask, like=x, like_name=name)


def zero_outside(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x`` where ``mask``, exactly 0 elsewhere (in value and gradient).

    ``torch.where``, never ``x * mask``: padding may hold NaN or inf, and ``0 · NaN`` is NaN (in the
    backward pass too). ``mask``: bool, the shape of ``x``.

    >>> zero_outside(torch.tensor([1.0, float("nan")]), torch.tensor([True, False]))
    tensor([1., 0.])
    """
    check_ndim("x", x)
    check_mask("mask", mask, like=x, like_name="x")
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))


def _count(mask: torch.Tensor, dim: Dim, keepdim: bool) -> torch.Tensor:
    return mask.sum() if dim is None else mask.sum(dim=dim, keepdim=keepdim)


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: Dim = None, keepdim: bool = False) -> torch.Tensor:
    """``Σ_{mask} x`` over ``dim`` (all dims when ``None``).

    Args:
        x: ``[...]`` float.
        mask: ``[...]`` bool, same shape as ``x``.
        dim, keepdim: as in ``torch.sum``.
    Returns:
        The reduced tensor; 0 where the mask is empty.

    >>> masked_sum(torch.tensor([1.0, 2.0, float("nan")]), torch.tensor([True, True, False]))
    tensor(3.)
    """
    _check(x, mask)
    z = zero_outside(x, mask)
    return z.sum() if dim is None else z.sum(dim=dim, keepdim=keepdim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: Dim = None, keepdim: bool = False) -> torch.Tensor:
    """``Σ_{mask} x / max(Σ mask, 1)`` over ``dim``: the mean of the selected values, 0 if none.

    >>> masked_mean(torch.tensor([[1.0, 3.0], [5.0, 7.0]]), torch.tensor([[True, True], [False, False]]), dim=-1)
    tensor([2., 0.])
    """
    total = masked_sum(x, mask, dim, keepdim)
    return total / _count(mask, dim, keepdim).clamp(min=1).to(total.dtype)


def _centred(x: torch.Tensor, mask: torch.Tensor, dim: Dim, unbiased: bool):
    """``(mean, x − mean under the mask (0 elsewhere), variance)`` with one masking of ``x`` and
    one count: the shared moments of :func:`masked_var` and :func:`masked_whiten` (keepdim)."""
    n = _count(mask, dim, keepdim=True)
    z = zero_outside(x, mask)
    mean = (z.sum() if dim is None else z.sum(dim=dim, keepdim=True)) / n.clamp(min=1).to(x.dtype)
    centred = (z - mean) * mask  # z is finite off the mask (0): the product is an exact 0 there
    sq = centred.square()
    var = (sq.sum() if dim is None else sq.sum(dim=dim, keepdim=True)) / (n - 1 if unbiased else n).clamp(min=1).to(
        x.dtype)
    return mean, centred, var


def masked_var(x: torch.Tensor, mask: torch.Tensor, dim: Dim = None, keepdim: bool = False, *,
               unbiased: bool = True) -> torch.Tensor:
    """Variance of the selected values: ``Σ_{mask}(x - μ)² / (n - 1)`` (or ``/ n`` when biased).

    ``n`` counts the selected values. With ``n = 0`` the variance is 0; with ``n = 1`` the unbiased
    variance is 0 as well (peers differ: TRL gives NaN, verl raises; a lone value has no spread,
    and 0 keeps whitening defined).

    Args:
        x: ``[...]`` float.  mask: ``[...]`` bool.
        unbiased: Bessel's correction (``n - 1``), as TRL and verl; ``False`` as OpenRLHF.

    >>> masked_var(torch.tensor([1.0, 3.0, 100.0]), torch.tensor([True, True, False]))
    tensor(2.)
    """
    _check(x, mask)  # before the first torch.where, which would broadcast a mis-shaped mask
    var = _centred(x, mask, dim, unbiased)[2]
    if keepdim or dim is None:
        return var
    dims = (dim,) if isinstance(dim, int) else dim
    return var.squeeze(dims)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, *, dim: Dim = None, shift_mean: bool = True,
                  unbiased: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """Normalise the selected values to mean 0 and variance 1: ``(x - μ)·rsqrt(σ² + eps)``.

    With ``shift_mean=False`` the mean is added back (``(x - μ)/σ + μ``), as PPO does for
    rewards. Statistics are over the mask along ``dim`` (everything when ``None``).

    Args:
        x: ``[...]`` float.  mask: ``[...]`` bool.
        unbiased: Bessel-corrected variance (TRL, verl).  eps: added to the variance.
    Returns:
        ``[...]``, 0 outside the mask. Differentiable (callers usually pass detached values).
    """
    _check(x, mask)
    mean, centred, var = _centred(x, mask, dim, unbiased)
    out = centred * torch.rsqrt(var + eps)  # 0 outside the mask already
    return out if shift_mean else torch.where(mask, out + mean, torch.zeros((), dtype=x.dtype, device=x.device))


# --- aggregation of per-token losses ---------------------------------------------------------
# Each mode reduces ``values [..., T]`` under ``mask [..., T]`` to a scalar. Rows are all dims but
# the last. The optional global denominators make a sum over micro-batches (or ranks) equal the
# loss of the whole batch: pass the token count / sequence count of the *whole* optimiser step.
# Every entry has the same signature.

def _rows(mask: torch.Tensor, num_seqs) -> torch.Tensor | float:
    # Rows with no valid token are not sequences: adding an empty row changes nothing.
    return mask.any(dim=-1).sum().clamp(min=1) if num_seqs is None else num_seqs


def token_mean(values: torch.Tensor, mask: torch.Tensor, *, num_tokens=None, num_seqs=None,
               max_length=None) -> torch.Tensor:
    """``Σ_{i,t} m·ℓ / N_tok``, ``N_tok = num_tokens`` or the tokens under ``mask`` (DAPO, verl)."""
    denom = mask.sum().clamp(min=1) if num_tokens is None else num_tokens
    return masked_sum(values, mask) / denom


def seq_mean_token_sum(values: torch.Tensor, mask: torch.Tensor, *, num_tokens=None, num_seqs=None,
                       max_length=None) -> torch.Tensor:
    """``Σ_i Σ_t m·ℓ / N_seq``: each sequence's summed loss, averaged over sequences."""
    return masked_sum(values, mask) / _rows(mask, num_seqs)


def seq_mean_token_mean(values: torch.Tensor, mask: torch.Tensor, *, num_tokens=None, num_seqs=None,
                        max_length=None) -> torch.Tensor:
    """``Σ_i (Σ_t m·ℓ / Σ_t m) / N_seq``: per-sequence token means, averaged (original GRPO)."""
    return masked_mean(values, mask, dim=-1).sum() / _rows(mask, num_seqs)


def seq_sum_norm(values: torch.Tensor, mask: torch.Tensor, *, num_tokens=None, num_seqs=None,
                 max_length=None) -> torch.Tensor:
    """``Σ_i Σ_t m·ℓ / (N_seq · L)`` with a constant ``L`` (Dr. GRPO, https://arxiv.org/abs/2503.20783).

    ``L = max_length``: pass the generation limit. Left ``None``, ``L`` is the padded width
    ``T`` (at least 1, so a width-0 batch gives 0), which makes the value depend on padding.
    """
    length = max(values.shape[-1], 1) if max_length is None else max_length
    return masked_sum(values, mask) / (_rows(mask, num_seqs) * length)


AGGREGATIONS: dict[str, Callable[..., torch.Tensor]] = {
    "token_mean": token_mean,
    "seq_mean_token_sum": seq_mean_token_sum,
    "seq_mean_token_mean": seq_mean_token_mean,
    "seq_sum_norm": seq_sum_norm,
}


def aggregate(values: torch.Tensor, mask: torch.Tensor, mode: str = "token_mean", *, num_tokens=None,
              num_seqs=None, max_length=None) -> torch.Tensor:
    """Reduce per-token losses ``[..., T]`` to a scalar with one of ``AGGREGATIONS``.

    Args:
        values: ``[..., T]`` float per-token losses.  mask: ``[..., T]`` bool.
        mode: ``token_mean`` | ``seq_mean_token_sum`` | ``seq_mean_token_mean`` | ``seq_sum_norm``.
        num_tokens: global token count of the optimiser step (``token_mean``).
        num_seqs: global count of non-empty sequences of the step (the ``seq_*`` modes).
        max_length: the constant ``L`` of ``seq_sum_norm``.
    Returns:
        ``[]`` scalar. With global counts, summing the result over micro-batches gives the loss
        of the whole step, so gradient accumulation and data parallelism change nothing.

    >>> v = torch.tensor([[1.0, 2.0, 0.0], [4.0, 0.0, 0.0]]); m = v > 0
    >>> aggregate(v, m, "token_mean"), aggregate(v, m, "seq_mean_token_mean")
    (tensor(2.3333), tensor(2.7500))
    """
    check_ndim("values", values, min_ndim=1, layout="[..., T]")
    return lookup(AGGREGATIONS, mode, what="mode")(values, mask, num_tokens=num_tokens, num_seqs=num_seqs, max_length=max_length)
