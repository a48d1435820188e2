"""Per-token KL(π‖π_ref) estimators from sampled-token log-probs, and the exact KL from logits.

Given the log-prob of the sampled token under the policy (``lp = log π(y_t)``) and under the
reference (``ref = log π_ref(y_t)``), with ``y_t ~ π``, Schulman's estimators of
``KL(π‖π_ref) = E_π[log π − log π_ref]`` are, with the log-ratio ``d = lp − ref``:

======  ===========================  ==========================  =======================
name    value                        E_π[value]                  peers' names
======  ===========================  ==========================  =======================
k1      ``d``                        KL (unbiased, high var.)    ``kl``, ``k1``
abs     ``|d|``                      ≥ KL (biased)               ``abs``
k2      ``½ d²``                     ≈ KL for small d (biased)   ``mse``, ``k2``
k3      ``e^{−d} + d − 1 ≥ 0``       KL (unbiased, low var.)     ``low_var_kl``, ``k3``
======  ===========================  ==========================  =======================

Where the estimator goes matters as much as which one (gradient notes, on-policy sampling):

- **k1 in the reward** (PPO, RLOO: ``r_t −= β·k1``, no gradient through it): the policy gradient
  then follows ``∇KL(π‖π_ref)`` without bias.
- **k1 in the loss** has gradient ``∇lp`` whose expectation ``E_π[∇log π]`` is 0: pure noise.
- **k2 in the loss**: ``∇½d² = d·∇lp``, whose expectation is exactly ``∇KL(π‖π_ref)``.
- **k3 in the loss** (GRPO): ``∇k3 = (1 − π_ref/π)·∇lp``, whose expectation is
  ``∇KL(π_ref‖π)``, the *other* direction; cheap, non-negative and low variance, which is why
  GRPO uses it. ``straight_through=True`` keeps k3's value but takes k2's gradient.

Clamping the log-ratio: verl clamps ``ref − lp`` to ±20 for k3 and the k3 value to ≤ 10;
OpenRLHF clamps every estimator's value to ±10; TRL does not clamp. Ours clamps the log-ratio
``d`` to ``[−clamp, clamp]`` before any estimator when ``clamp`` is given, and not at all by
default (``clamp=None``).

References:
    J. Schulman, "Approximating KL Divergence", http://joschu.net/blog/kl-approx.html (2020).
    Z. Shao et al., "DeepSeekMath" (GRPO's k3 penalty), https://arxiv.org/abs/2402.03300
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rlcore.checks import check_float, check_ndim, check_number, check_same_shape
from rlcore.masked import saturate, wide

__all__ = [
    "kl_k1",
    "kl_abs",
    "kl_k2",
    "kl_k3",
    "kl_estimate",
    "kl_full",
    "KL_ESTIMATORS",
    "KL_ALIASES",
]


def _log_ratio(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, clamp: float | None) -> torch.Tensor:
    check_float("logprobs", logprobs)
    check_float("ref_logprobs", ref_logprobs)
    check_same_shape("logprobs", logprobs, ref_logprobs=ref_logprobs)
    # float64: a difference of log-probs anywhere in the float32 / bfloat16 range (and its square,
    # its exponential) stays finite; each estimator casts back saturating (rlcore.masked.saturate)
    d = wide(logprobs) - wide(ref_logprobs)
    if clamp is None:
        return d
    check_number("clamp", clamp, low=0.0, low_open=True, allow_inf=True)  # a negative one empties the range
    return d.clamp(-clamp, clamp)


def kl_k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, *, clamp: float | None = None) -> torch.Tensor:
    """k1 estimator: ``lp − ref`` (the log-ratio itself).

    Args:
        logprobs: ``[..., T]`` float, log π of the sampled tokens.
        ref_logprobs: ``[..., T]`` float, log π_ref of the same tokens.
        clamp: optional bound ``c``; the log-ratio is clamped to ``[−c, c]`` first.
    Returns:
        ``[..., T]``, dtype of the inputs. Unbiased for KL(π‖π_ref) under y ~ π; can be negative.

    Gradient: flows into both inputs as written (``∇lp − ∇ref``); its expectation on-policy is
    zero, so use k1 in the reward (detached), not in the loss.

    >>> kl_k1(torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0]))
    tensor([ 0.5000, -1.0000])

    References: Schulman, "Approximating KL Divergence", http://joschu.net/blog/kl-approx.html
    """
    return saturate(_log_ratio(logprobs, ref_logprobs, clamp), logprobs.dtype)


def kl_abs(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, *, clamp: float | None = None) -> torch.Tensor:
    """Absolute log-ratio ``|lp − ref|`` (TRL's ``abs`` penalty); a biased, non-negative proxy.

    Args / Returns: as :func:`kl_k1`. Gradient: ``sign(d)·(∇lp − ∇ref)``.

    >>> kl_abs(torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0]))
    tensor([0.5000, 1.0000])

    References: Schulman, "Approximating KL Divergence", http://joschu.net/blog/kl-approx.html
    """
    return saturate(_log_ratio(logprobs, ref_logprobs, clamp).abs(), logprobs.dtype)


def kl_k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, *, clamp: float | None = None) -> torch.Tensor:
    """k2 estimator: ``½(lp − ref)²`` (TRL's ``mse``); biased, low variance, non-negative.

    Args / Returns: as :func:`kl_k1`.

    Gradient: ``d·∇lp``, whose on-policy expectation is exactly ``∇KL(π‖π_ref)``: the gradient
    that ``kl_estimate(..., straight_through=True)`` borrows.

    >>> kl_k2(torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0]))
    tensor([0.1250, 0.5000])

    References: Schulman, "Approximating KL Divergence", http://joschu.net/blog/kl-approx.html
    """
    return saturate(0.5 * _log_ratio(logprobs, ref_logprobs, clamp).square(), logprobs.dtype)


def _expm1_minus_x(x: torch.Tensor) -> torch.Tensor:
    # e^x − 1 − x without cancellation: Taylor series (Horner, to x^8) where |x| < 0.1 (relative
    # truncation error < 1e-12), expm1(x) − x elsewhere (the terms no longer cancel). Both
    # branches are ≥ 0 in floating point, and torch.where keeps the gradient of the branch taken.
    small = x.abs() < 0.1
    s = torch.where(small, x, torch.zeros((), dtype=x.dtype, device=x.device))
    poly = 1 / 2 + s * (1 / 6 + s * (1 / 24 + s * (1 / 120 + s * (1 / 720 + s * (1 / 5040 + s / 40320)))))
    # e^700 is finite in float64 and past every float32 value: the exponent is capped there, so that
    # neither the value nor its gradient (e^x) is inf before the caller saturates
    return torch.where(small, s.square() * poly, torch.expm1(x.clamp(max=700.0)) - x)


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, *, clamp: float | None = None) -> torch.Tensor:
    """k3 estimator: ``e^{ref−lp} − (ref−lp) − 1`` (verl's ``low_var_kl``); unbiased and ≥ 0.

    Computed as ``expm1(x) − x`` with ``x = ref − lp`` (a short Taylor series for ``|x| < 0.1``),
    so it keeps full relative precision for tiny log-ratios (≈ ``x²/2``, like k2) and is never
    negative. With large positive ``x`` it grows like ``e^x``: pass ``clamp`` to bound it.

    Args / Returns: as :func:`kl_k1`.

    Gradient: ``(1 − e^{ref−lp})·∇lp`` (and the opposite for ref); on-policy its expectation is
    ``∇KL(π_ref‖π)`` rather than ``∇KL(π‖π_ref)`` (see the module notes).

    >>> kl_k3(torch.tensor([-1.0, -2.0]), torch.tensor([-1.0, -1.0]))
    tensor([0.0000, 0.7183])

    References: Schulman, "Approximating KL Divergence", http://joschu.net/blog/kl-approx.html;
    Shao et al., "DeepSeekMath", https://arxiv.org/abs/2402.03300
    """
    return saturate(_expm1_minus_x(-_log_ratio(logprobs, ref_logprobs, clamp)), logprobs.dtype)


KL_ESTIMATORS: dict[str, Callable[..., torch.Tensor]] = {
    "k1": kl_k1,
    "abs": kl_abs,
    "k2": kl_k2,
    "k3": kl_k3,
}

#: The peers' names for the same estimators (TRL: kl / mse; verl: low_var_kl).
KL_ALIASES: dict[str, str] = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}


def _lookup(kind: str) -> Callable[..., torch.Tensor]:
    fn = KL_ESTIMATORS.get(KL_ALIASES.get(kind, kind))
    if fn is None:
        raise ValueError(f"kind: unknown KL estimator {kind!r}; valid: {sorted(KL_ESTIMATORS)} "
                         f"and aliases {sorted(KL_ALIASES)}")
    return fn


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k1", *,
                clamp: float | None = None, straight_through: bool = False) -> torch.Tensor:
    """Per-token KL estimate of the named kind: ``KL_ESTIMATORS[kind](lp, ref)``.

    With ``straight_through=True`` the value is the chosen estimator's and the gradient is k2's:
    ``k2 + (est − k2).detach()`` (verl's ``"k3+"`` is ``kind="k3", straight_through=True``),
    so a low-variance value can be logged or penalised while the gradient stays unbiased for
    ``KL(π‖π_ref)`` on-policy.

    Args:
        logprobs: ``[..., T]`` float.  ref_logprobs: ``[..., T]`` float.
        kind: ``"k1" | "abs" | "k2" | "k3"`` or an alias ``"kl" | "mse" | "low_var_kl"``.
        clamp: optional bound on the log-ratio, applied before the estimator (both paths).
        straight_through: value of ``kind``, gradient of k2.
    Returns:
        ``[..., T]``, dtype of the inputs.
    Raises:
        ValueError: unknown ``kind`` (the message lists the valid names).

    >>> lp, ref = torch.tensor([-1.0]), torch.tensor([-2.0])
    >>> kl_estimate(lp, ref, "low_var_kl"), kl_estimate(lp, ref, "k3", straight_through=True)
    (tensor([0.3679]), tensor([0.3679]))

    References: Schulman, "Approximating KL Divergence", http://joschu.net/blog/kl-approx.html
    """
    fn = _lookup(kind)
    value = fn(logprobs, ref_logprobs, clamp=clamp)
    if not straight_through:
        return value
    k2 = kl_k2(logprobs, ref_logprobs, clamp=clamp)
    return k2 + (value - k2).detach()


# --- exact KL from full-vocabulary logits -----------------------------------------------------
def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _chunk_bounds(n: int, chunk_size: int | None) -> list[tuple[int, int]]:
    size = max(n, 1) if chunk_size is None else chunk_size
    return [(s, min(s + size, n)) for s in range(0, n, size)]


def _log_softmax(x: torch.Tensor, temperature: float, dtype: torch.dtype) -> torch.Tensor:
    # log softmax(x/τ) of the row maximum's shift: x − max ≤ 0, so dividing by τ < 1 cannot overflow
    # for logits anywhere in the float range; a log-prob past the range is its largest negative value.
    x = x.to(dtype)
    shifted = (x - x.amax(dim=-1, keepdim=True)) / temperature
    return torch.log_softmax(shifted, dim=-1).clamp(min=torch.finfo(dtype).min)


def _kl_terms(z: torch.Tensor, r: torch.Tensor, temperature: float) -> tuple[torch.Tensor, ...]:
    # One chunk of rows, upcast: p = softmax(z/τ), a = log p − log q (0 where p = 0, so that
    # logits at −inf, e.g. filtered tokens, contribute 0 rather than 0·(−inf) = NaN). Each term of
    # p·a is finite (|a| ≤ the largest float once log p and log q are clamped); the sum saturates.
    dtype = _compute_dtype(z.dtype)
    logp = _log_softmax(z, temperature, dtype)
    logq = _log_softmax(r, temperature, dtype)
    p = logp.exp()
    a = torch.where(p > 0, logp - logq, torch.zeros((), dtype=dtype, device=z.device))
    big = torch.finfo(dtype).max
    return p, a, (p * a).sum(-1).clamp(-big, big)


class _FullKL(torch.autograd.Function):
    """Row-chunked exact KL; saves only the inputs and recomputes one chunk at a time."""

    generate_vmap_rule = True

    @staticmethod
    def forward(logits, ref_logits, temperature, chunk_size):
        parts = [_kl_terms(logits[s:e], ref_logits[s:e], temperature)[2]
                 for s, e in _chunk_bounds(logits.shape[0], chunk_size)]
        out = torch.cat(parts) if parts else logits.new_zeros(0, dtype=_compute_dtype(logits.dtype))
        return saturate(out, logits.dtype)

    @staticmethod
    def setup_context(ctx, inputs, output):
        logits, ref_logits, temperature, chunk_size = inputs
        ctx.save_for_backward(logits, ref_logits)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size

    @staticmethod
    def backward(ctx, grad_out):
        # ∂KL/∂z_j = p_j·(a_j − KL)/τ, one chunk of rows at a time (as p·a − p·KL: each finite).
        logits, ref_logits = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for s, e in _chunk_bounds(logits.shape[0], ctx.chunk_size):
            p, a, kl = _kl_terms(logits[s:e], ref_logits[s:e], ctx.temperature)
            big = torch.finfo(p.dtype).max
            g = grad_out[s:e, None].to(p.dtype) * (p * a - p * kl[:, None]).clamp(-big, big) / ctx.temperature
            grad[s:e] = saturate(g.clamp(-big, big), grad.dtype)
        return grad, None, None, None


def kl_full(logits: torch.Tensor, ref_logits: torch.Tensor, *, temperature: float = 1.0,
            chunk_size: int | None = None) -> torch.Tensor:
    """Exact ``KL(π‖π_ref) = Σ_v π(v)(log π(v) − log π_ref(v))`` from full-vocabulary logits.

    ``π = softmax(logits/τ)``, ``π_ref = softmax(ref_logits/τ)`` (the same sampling temperature
    ``τ`` for both). Rows (all dims but the vocabulary) are processed ``chunk_size`` at a time
    in at least float32: neither the forward nor the backward keeps an upcast copy of the whole
    ``[..., V]`` beyond one chunk (the backward recomputes each chunk's softmax). Tokens where
    ``π(v) = 0`` (logits at −inf) contribute 0.

    Args:
        logits: ``[..., V]`` float, policy logits (differentiable).
        ref_logits: ``[..., V]`` float, reference logits, treated as constants (detached).
        temperature: ``τ > 0``, divides both logits.
        chunk_size: rows per chunk; ``None`` processes all rows at once.
    Returns:
        ``[...]`` (e.g. ``[B, T]``), dtype of ``logits``; ≥ 0 up to rounding.

    Gradient: w.r.t. ``logits`` only, ``∂KL/∂z_v = π(v)·(log π(v) − log π_ref(v) − KL)/τ``;
    no gradient reaches ``ref_logits``.

    >>> kl_full(torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 0.0]]))  # log 2 − H(π)
    tensor([0.1109])

    References: Schulman, "Approximating KL Divergence", http://joschu.net/blog/kl-approx.html
    """
    check_ndim("logits", logits, min_ndim=1, layout="[..., V]")
    check_float("logits", logits)
    check_float("ref_logits", ref_logits)
    check_same_shape("logits", logits, ref_logits=ref_logits)
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size: expected a positive number of rows or None, got {chunk_size}")
    lead, vocab = logits.shape[:-1], logits.shape[-1]
    out = _FullKL.apply(logits.reshape(-1, vocab), ref_logits.detach().reshape(-1, vocab),
                        float(temperature), chunk_size)
    return out.reshape(lead)
