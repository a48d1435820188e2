"""Masked reductions, whitening, and the token-aggregation modes of policy losses.

Every function here reads a value only where its mask is True: positions outside the mask may
hold anything (padding garbage, NaN, inf) without changing a result, and an empty mask gives a
defined value (0), never NaN. Masks are ``torch.bool`` and shaped exactly like the values.

Sums and moments accumulate in float64 and the result is cast back *saturating*
(:func:`saturate`): finite inputs anywhere in the float32 / bfloat16 range give finite results
(a sum past the dtype's largest value is that value, not inf; a mean of values near it is exact).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch

from rlcore.checks import check_float, check_mask, check_ndim, check_same_shape, lookup

__all__ = [
    "masked_sum",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "zero_outside",
    "wide",
    "saturate",
    "in_float64",
    "wide_mean",
    "wide_sum",
    "aggregate",
    "AGGREGATIONS",
    "token_mean",
    "seq_mean_token_sum",
    "seq_mean_token_mean",
    "seq_sum_norm",
    "local_token_mean",
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
    return _zeroed(x, mask)


def _zeroed(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """:func:`zero_outside` for arguments already checked."""
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))


class _Widen(torch.autograd.Function):
    """float64 forward; the backward casts the gradient back saturating, so a gradient past the
    input dtype's range (e.g. ``∂(a·b)/∂b = a`` times a large upstream factor) is its largest value."""

    @staticmethod
    def forward(ctx, x, target):
        ctx.dtype = x.dtype
        return x.to(target)

    @staticmethod
    def backward(ctx, grad):
        return saturate(grad, ctx.dtype), None


def wide(x: torch.Tensor) -> torch.Tensor:
    """``x`` in float64 (``x`` itself when it already is; float32 on Apple's MPS, which has no
    float64): the precision the statistics of this module, the returns and the preference losses
    are computed in, so that no intermediate of
    finite float32 / bfloat16 inputs overflows. Pair it with :func:`saturate` on the way out; the
    gradient comes back to ``x``'s dtype saturating too."""
    target = torch.float32 if x.device.type == "mps" else torch.float64  # MPS has no float64
    if x.dtype == torch.float64 or x.dtype == target:
        return x
    return _Widen.apply(x, target) if x.requires_grad and torch.is_grad_enabled() else x.to(target)


def saturate(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` cast to ``dtype``, values beyond its finite range (±inf included) clamped to
    ``±finfo(dtype).max`` (where a plain cast gives ±inf); NaN stays NaN. Gradient: 1 inside the range, 0 where clamped.

    >>> saturate(torch.tensor([1e39, -1e39, 2.0], dtype=torch.float64), torch.float32)
    tensor([ 3.4028e+38, -3.4028e+38,  2.0000e+00])
    """
    big = torch.finfo(dtype).max
    return x.clamp(-big, big).to(dtype)


def in_float64(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with its floating-point tensor arguments :func:`wide` and its result (a tensor, or a
    tuple of them) cast back :func:`saturate` to their promoted dtype: the kernels whose
    differences, squares or products of values near the range's edge must stay finite (the
    pairwise DPO variants, the ReFT edits, the DDIM predictions). Arguments that are not float
    tensors pass as they are, so ``fn``'s own checks name a wrong one.
    """
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        def is_float(a: Any) -> bool:
            return isinstance(a, torch.Tensor) and a.is_floating_point()

        floats = [a for a in (*args, *kwargs.values()) if is_float(a)]
        if not floats:
            return fn(*args, **kwargs)
        dtype = functools.reduce(torch.promote_types, (a.dtype for a in floats))
        out = fn(*(wide(a) if is_float(a) else a for a in args),
                 **{k: wide(v) if is_float(v) else v for k, v in kwargs.items()})
        return tuple(saturate(o, dtype) for o in out) if isinstance(out, tuple) else saturate(out, dtype)
    return run


def wide_mean(x: torch.Tensor) -> torch.Tensor:
    """The mean of every element of ``x`` (``[]``), accumulated in float64 and cast back saturating:
    finite for finite inputs anywhere in the dtype's range; NaN for an empty ``x``, as ``Tensor.mean``
    (a batch-mean loss of no rows is 0/0: ``update``'s guard skips that step).

    >>> wide_mean(torch.tensor([3e38, 3e38]))
    tensor(3.0000e+38)
    """
    check_float("x", x)
    return saturate(wide(x).mean(), x.dtype)


def wide_sum(terms: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The sum of named same-shaped ``terms`` (e.g. the ``[]`` parts of a loss, by name) in float64,
    cast back saturating to the first term's dtype: two terms near the largest value do not add to
    inf. Errors name the term.

    >>> wide_sum({"loss_dpo": torch.tensor(3e38), "loss_rpo": torch.tensor(3e38)})
    tensor(3.4028e+38)
    """
    (first, ref), *rest = terms.items()
    for name, t in terms.items():
        check_float(name, t)
    check_same_shape(first, ref, **dict(rest))
    return saturate(torch.stack([wide(t) for t in terms.values()]).sum(0), ref.dtype)


def _wide_sum(x: torch.Tensor, mask: torch.Tensor, dim: Dim, keepdim: bool) -> torch.Tensor:
    """``Σ_{mask} x`` over ``dim`` in float64, unchecked."""
    z = wide(_zeroed(x, mask))
    return z.sum() if dim is None else z.sum(dim=dim, keepdim=keepdim)


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
    return saturate(_wide_sum(x, mask, dim, keepdim), x.dtype)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: Dim = None, keepdim: bool = False) -> torch.Tensor:
    """``Σ_{mask} x / max(Σ mask, 1)`` over ``dim``: the mean of the selected values, 0 if none.

    >>> masked_mean(torch.tensor([[1.0, 3.0], [5.0, 7.0]]), torch.tensor([[True, True], [False, False]]), dim=-1)
    tensor([2., 0.])
    """
    _check(x, mask)
    return saturate(_wide_sum(x, mask, dim, keepdim) / _count(mask, dim, keepdim).clamp(min=1), x.dtype)


def _centred(x: torch.Tensor, mask: torch.Tensor, dim: Dim, unbiased: bool):
    """``(mean, x − mean under the mask (0 elsewhere), variance)``, float64, with one masking of
    ``x`` and one count: the shared moments of :func:`masked_var` and :func:`masked_whiten` (keepdim)."""
    n = _count(mask, dim, keepdim=True)
    z = wide(_zeroed(x, mask))
    mean = (z.sum() if dim is None else z.sum(dim=dim, keepdim=True)) / n.clamp(min=1)
    centred = (z - mean) * mask  # z is finite off the mask (0): the product is an exact 0 there
    sq = centred.square()
    var = (sq.sum() if dim is None else sq.sum(dim=dim, keepdim=True)) / (n - 1 if unbiased else n).clamp(min=1)
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
    var = saturate(_centred(x, mask, dim, unbiased)[2], x.dtype)
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
    return saturate(out if shift_mean else torch.where(mask, out + mean, torch.zeros_like(out)), x.dtype)


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
    _check(values, mask)
    denom = mask.sum().clamp(min=1) if num_tokens is None else num_tokens
    return saturate(_wide_sum(values, mask, None, False) / denom, values.dtype)


def seq_mean_token_sum(values: torch.Tensor, mask: torch.Tensor, *, num_tokens=None, num_seqs=None,
                       max_length=None) -> torch.Tensor:
    """``Σ_i Σ_t m·ℓ / N_seq``: each sequence's summed loss, averaged over sequences."""
    _check(values, mask)
    return saturate(_wide_sum(values, mask, None, False) / _rows(mask, num_seqs), values.dtype)


def seq_mean_token_mean(values: torch.Tensor, mask: torch.Tensor, *, num_tokens=None, num_seqs=None,
                        max_length=None) -> torch.Tensor:
    """``Σ_i (Σ_t m·ℓ / Σ_t m) / N_seq``: per-sequence token means, averaged (original GRPO)."""
    _check(values, mask)
    row_means = _wide_sum(values, mask, -1, False) / mask.sum(dim=-1).clamp(min=1)
    return saturate(row_means.sum() / _rows(mask, num_seqs), values.dtype)


def seq_sum_norm(values: torch.Tensor, mask: torch.Tensor, *, num_tokens=None, num_seqs=None,
                 max_length=None) -> torch.Tensor:
    """``Σ_i Σ_t m·ℓ / (N_seq · L)`` with a constant ``L`` (Dr. GRPO, https://arxiv.org/abs/2503.20783).

    ``L = max_length``: pass the generation limit. Left ``None``, ``L`` is the padded width
    ``T`` (at least 1, so a width-0 batch gives 0), which makes the value depend on padding.
    """
    _check(values, mask)
    length = max(values.shape[-1], 1) if max_length is None else max_length
    return saturate(_wide_sum(values, mask, None, False) / (_rows(mask, num_seqs) * length), values.dtype)


def local_token_mean(values: torch.Tensor, mask: torch.Tensor, *, num_tokens=None, num_seqs=None,
                     max_length=None) -> torch.Tensor:
    """``(Σ_{i,t} m·ℓ / n_tok) · n_seq / N_seq``: the token mean of *this* batch (TRL's ``bnpo``).

    ``n_tok`` and ``n_seq`` are the valid tokens and non-empty rows of ``mask`` (the micro-batch
    the loss sees), never the step's: ``num_tokens`` is ignored. ``N_seq = num_seqs`` (the step's
    non-empty rows) or ``n_seq``, so called alone it is the plain token mean of the batch, and with
    the step's ``num_seqs`` each micro-batch weighs its share of the step's sequences: the step's
    loss is the mean of the micro-batches' token means (TRL divides each by the number of
    accumulation steps; the two agree when the micro-batches hold equally many non-empty rows).
    The value depends on how the step is cut into micro-batches, by definition.
    """
    _check(values, mask)
    total = _wide_sum(values, mask, None, False) / mask.sum().clamp(min=1)
    if num_seqs is not None:  # this batch's share of the step, in the sum's precision
        total = total * mask.any(dim=-1).sum() / num_seqs
    return saturate(total, values.dtype)


AGGREGATIONS: dict[str, Callable[..., torch.Tensor]] = {
    "token_mean": token_mean,
    "seq_mean_token_sum": seq_mean_token_sum,
    "seq_mean_token_mean": seq_mean_token_mean,
    "seq_sum_norm": seq_sum_norm,
    "local_token_mean": local_token_mean,
}


def aggregate(values: torch.Tensor, mask: torch.Tensor, mode: str = "token_mean", *, num_tokens=None,
              num_seqs=None, max_length=None) -> torch.Tensor:
    """Reduce per-token losses ``[..., T]`` to a scalar with one of ``AGGREGATIONS``.

    Args:
        values: ``[..., T]`` float per-token losses.  mask: ``[..., T]`` bool.
        mode: ``token_mean`` | ``seq_mean_token_sum`` | ``seq_mean_token_mean`` | ``seq_sum_norm`` |
            ``local_token_mean``.
        num_tokens: global token count of the optimiser step (``token_mean``).
        num_seqs: global count of non-empty sequences of the step (the ``seq_*`` modes; the share
            of each micro-batch in ``local_token_mean``).
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
