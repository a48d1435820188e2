"""PPO: the clipped surrogate and its variants, the clipped value loss, metrics.

Tensor kernels (unreduced, ``[..., T]`` in and out) and one loss on a rollout TensorDict, on the
importance ratios of ``algorithms.ratios``::

    clipped_surrogate      max(−Aρ, −A·clip(ρ, 1−ε_lo, 1+ε_hi)), optional dual clip
    cispo_surrogate        −sg(clip(ρ, 1−ε_lo, 1+ε_hi))·A·log π
    sapo_surrogate         −A·(4/τ)·σ(τ(ρ−1)), a soft gate in place of the clip (SAPO)
    vespo_surrogate        −sg(φ(w))·A·log π, φ a Gamma-shaped weight of the sequence ratio w (VESPO)
    clipped_value_loss     ½·max((V̂−R)², (clip(V̂, V−c, V+c)−R)²)
    approx_kl_k1/_k3, clip_fraction, clip_fraction_extremes, ratio_stats, explained_variance, early_stop   (diagnostics)
    ppo_loss(batch) -> (loss, metrics)

Rollout keys (``rlcore.keys``), all ``[B, R]``: ``logprobs`` (differentiable), ``old_logprobs``,
``advantages``, ``response_mask`` (bool); when used: ``ref_logprobs``, ``value_preds``
(differentiable), ``values``, ``returns``, ``entropy`` (differentiable).

Choices where the peers differ (each one is tested):
- clip fractions count the tokens whose *binding* clip removes the gradient: low = ``ρ < 1−ε_lo``
  with ``A < 0``, high = ``ρ > 1+ε_hi`` with ``A > 0`` (TRL); verl counts "clipped loss larger".
- CISPO detaches the clipped weight (TRL, verl); torchrl does not.
- the log-ratio clamp is symmetric and off by default (verl clamps at ±20 for tokens and at
  +10 for GSPO; TRL does not clamp).
- every term (policy, value, entropy, KL) is reduced by the same aggregation mode, so global
  denominators (``num_tokens`` / ``num_seqs``) make micro-batches add up for all of them.
"""

from __future__ import annotations

import math

from collections.abc import Callable
from typing import NamedTuple

import torch
from tensordict import TensorDict, TensorDictBase

from rlcore import keys as K
from rlcore.algorithms.ratios import importance_log_ratio
from rlcore.checks import (check_divisor, check_float, check_mask, check_ndim, check_number, check_same_shape,
                           check_scalar, lookup, require_keys, validated)
from rlcore.kl import kl_estimate
from rlcore.masked import aggregate, masked_mean, masked_var, saturate, wide, wide_sum, zero_outside

__all__ = [
    "Surrogate",
    "clipped_surrogate",
    "cispo_surrogate",
    "sapo_surrogate",
    "vespo_surrogate",
    "SURROGATES",
    "clipped_value_loss",
    "approx_kl_k1",
    "approx_kl_k3",
    "clip_fraction",
    "clip_fraction_extremes",
    "ratio_stats",
    "explained_variance",
    "early_stop",
    "ppo_loss",
]

Tensor = torch.Tensor
_EXP_MAX = 700.0  # e^700 is finite in float64 and far past every float32 / bfloat16 value
_LOG_MAX64 = math.log(torch.finfo(torch.float64).max)  # the largest x whose exp is finite in float64


# --- policy surrogates ------------------------------------------------------------------------
def _check_clip(clip_eps_low: float, clip_eps_high: float) -> None:
    """``ε_lo, ε_hi ≥ 0`` (inf: no bound on that side); a negative or NaN one inverts or voids the clip."""
    check_number("clip_eps_low", clip_eps_low, low=0.0, allow_inf=True)
    check_number("clip_eps_high", clip_eps_high, low=0.0, allow_inf=True)


class Surrogate(NamedTuple):
    """Per-token policy loss and where each clip bound was active, all ``[..., T]``."""

    loss: Tensor          # float, differentiable
    clipped_low: Tensor   # bool
    clipped_high: Tensor  # bool
    clipped_dual: Tensor  # bool (dual clip active; always False without it)


def clipped_surrogate(log_ratio: Tensor, advantages: Tensor, *, clip_eps_low: float = 0.2,
                      clip_eps_high: float = 0.2, clip_ratio_c: float | None = None) -> Surrogate:
    """PPO's clipped surrogate per token, with asymmetric bounds and an optional dual clip.

    ``ℓ = max(−A·ρ, −A·clip(ρ, 1−ε_lo, 1+ε_hi))``, ``ρ = exp(log_ratio)``; with dual clip
    (``c > 1``), for ``A < 0``: ``ℓ = min(ℓ, −A·c)`` (the loss of a negative-advantage token whose
    ratio exploded is capped). ``ε_hi > ε_lo`` is DAPO's "clip-higher".

    Args:
        log_ratio: ``[..., T]`` float, ``log ρ`` (``importance_log_ratio``), differentiable.
        advantages: ``[..., T]`` float (detached).
        clip_eps_low, clip_eps_high: ``ε_lo``, ``ε_hi``, each ``≥ 0`` (inf: no bound on that side;
            ``ε_lo ≥ 1`` leaves no lower bound).
        clip_ratio_c: dual-clip constant ``c > 1`` (verl uses 3), or ``None``.
    Returns:
        ``Surrogate(loss, clipped_low, clipped_high, clipped_dual)``, each ``[..., T]``:
        ``clipped_low`` is ``ρ < 1−ε_lo ∧ A < 0``, ``clipped_high`` is ``ρ > 1+ε_hi ∧ A > 0`` (the
        tokens whose gradient the clip removes), ``clipped_dual`` is ``A < 0 ∧ ℓ > −A·c``.
    Raises:
        ValueError: ``clip_ratio_c`` is not greater than 1; ``clip_eps_low`` / ``clip_eps_high``
            negative or NaN.

    >>> out = clipped_surrogate(torch.tensor([0.0, 0.5, -0.5]).log1p(), torch.tensor([1.0, 1.0, -1.0]))
    >>> out.loss, out.clipped_high, out.clipped_low
    (tensor([-1.0000, -1.2000,  0.8000]), tensor([False,  True, False]), tensor([False, False,  True]))

    References:
        Schulman et al., "Proximal Policy Optimization Algorithms", https://arxiv.org/abs/1707.06347
        Yu et al., "DAPO: An Open-Source LLM Reinforcement Learning System at Scale",
        https://arxiv.org/abs/2503.14476
        Ye et al., "Mastering Complex Control in MOBA Games with Deep Reinforcement Learning"
        (dual clip), https://arxiv.org/abs/1912.09729
    Gradient: through ``log_ratio`` only; ``advantages`` is detached. Clipped tokens get none.
    """
    check_float("log_ratio", log_ratio)
    check_same_shape("log_ratio", log_ratio, advantages=advantages)
    if clip_ratio_c is not None and not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c: the dual-clip constant must be > 1, got {clip_ratio_c}")
    _check_clip(clip_eps_low, clip_eps_high)
    adv = advantages.detach()
    # max(−Aρ, −A·clip(ρ)) = −A·min(ρ, 1+ε_hi) for A ≥ 0 and −A·max(ρ, 1−ε_lo) for A < 0: each side
    # is evaluated on the log-ratio clamped to its active bound, so a huge ratio never meets 0·inf
    # (a tied GRPO group has A = 0) in the loss or in its gradient. Same values, same gradient.
    # The product is taken in float64 and saturates (rlcore.masked.saturate): |A|·ρ past the
    # dtype's range is its largest value, not inf.
    log_hi = math.log1p(clip_eps_high)
    log_lo = math.log1p(-clip_eps_low) if clip_eps_low < 1.0 else -math.inf
    active = torch.where(adv >= 0, log_ratio.clamp(max=log_hi), log_ratio.clamp(min=log_lo))
    wide_adv = wide(adv)
    loss = -wide_adv * torch.exp(wide(active).clamp(max=_EXP_MAX))
    low = (log_ratio < log_lo) & (adv < 0)
    high = (log_ratio > log_hi) & (adv > 0)
    if clip_ratio_c is None:
        return Surrogate(saturate(loss, log_ratio.dtype), low, high, torch.zeros_like(low))
    cap = -wide_adv * clip_ratio_c
    dual = (adv < 0) & (loss > cap)
    return Surrogate(saturate(torch.where(dual, cap, loss), log_ratio.dtype), low, high, dual)


def cispo_surrogate(log_ratio: Tensor, logprobs: Tensor, advantages: Tensor, *, clip_eps_low: float = 1.0,
                    clip_eps_high: float = 4.0) -> Surrogate:
    """CISPO per token: ``ℓ = −sg(clip(ρ, 1−ε_lo, 1+ε_hi))·A·lp``.

    The importance weight is clipped and detached; unlike PPO every token keeps a gradient
    ``−w·A·∇lp``. Defaults: no lower bound (``ε_lo = 1``, as the paper) and a cap ``ρ ≤ 5``
    (``ε_hi = 4``, the ε_max recommended by ScaleRL, https://arxiv.org/abs/2510.13786).
    Peers differ: TRL and verl detach the clipped weight, torchrl does not; we detach.

    Args:
        log_ratio: ``[..., T]`` float, ``log ρ`` (its gradient is not used).
        logprobs: ``[..., T]`` float, current policy, differentiable.
        advantages: ``[..., T]`` float (detached).
        clip_eps_low, clip_eps_high: bounds of the weight.
    Returns:
        ``Surrogate``: ``clipped_low/high`` mark weights cut at ``1−ε_lo`` / ``1+ε_hi`` (whatever
        the sign of ``A``); ``clipped_dual`` is all False.

    >>> cispo_surrogate(torch.tensor([0.0, 2.0]), torch.tensor([-1.0, -2.0]), torch.tensor([1.0, 1.0])).loss
    tensor([ 1., 10.])

    References:
        MiniMax, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention",
        https://arxiv.org/abs/2506.13585
    Gradient: through ``logprobs`` only.
    """
    check_float("logprobs", logprobs)
    check_same_shape("logprobs", logprobs, log_ratio=log_ratio, advantages=advantages)
    _check_clip(clip_eps_low, clip_eps_high)
    ratio = torch.exp(log_ratio.detach())
    weight = ratio.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high)
    loss = saturate(-wide(weight) * wide(advantages.detach()) * wide(logprobs), logprobs.dtype)
    low, high = ratio < 1.0 - clip_eps_low, ratio > 1.0 + clip_eps_high
    return Surrogate(loss, low, high, torch.zeros_like(low))


def _positive(**values: float) -> None:
    for name, value in values.items():
        check_number(name, value, low=0.0, low_open=True)


def sapo_surrogate(log_ratio: Tensor, advantages: Tensor, *, temperature_pos: float = 1.0,
                   temperature_neg: float = 1.05) -> Surrogate:
    """SAPO per token: ``ℓ = −A·(4/τ)·σ(τ·(ρ − 1))``, ``τ = τ_pos`` where ``A > 0``, else ``τ_neg``.

    A smooth gate replaces the hard clip: ``∂ℓ/∂log ρ = −A·4σ(1−σ)·ρ`` is ``−A`` at ``ρ = 1`` (the
    REINFORCE gradient, whatever ``τ``) and fades smoothly as ``ρ`` leaves 1, faster for larger ``τ``.
    ``τ_neg > τ_pos`` damps negative-advantage tokens more (the paper's choice). Defaults: TRL's
    ``sapo_temperature_pos = 1.0``, ``sapo_temperature_neg = 1.05``.

    Args:
        log_ratio: ``[..., T]`` float, ``log ρ`` (``importance_log_ratio``, token or sequence level),
            differentiable.
        advantages: ``[..., T]`` float (detached).
        temperature_pos, temperature_neg: ``τ`` for ``A > 0`` and ``A ≤ 0``, at least 1e-12
            (``rlcore.checks.MIN_DIVISOR``: below it ``4/τ`` overflows, and ``A = 0`` gives ``0·inf = NaN``).
    Returns:
        ``Surrogate``; nothing is clipped, so the three flags are all False.
    Raises:
        ValueError: a temperature is not a finite number >= 1e-12.

    >>> sapo_surrogate(torch.tensor([0.0, 0.0]), torch.tensor([1.0, -1.0])).loss
    tensor([-2.0000,  1.9048])

    References:
        "Soft Adaptive Policy Optimization" (SAPO), https://arxiv.org/abs/2511.20347
    Gradient: through ``log_ratio`` only; computed in float64 (``ρ`` capped at ``e^700``, where
    the gate is flat), so a huge ratio gives a zero gradient, not NaN.
    """
    check_float("log_ratio", log_ratio)
    check_same_shape("log_ratio", log_ratio, advantages=advantages)
    for name, value in (("temperature_pos", temperature_pos), ("temperature_neg", temperature_neg)):
        check_divisor(name, value)  # >= 1e-12 (rlcore.checks.MIN_DIVISOR): 4/τ stays finite, A·4/τ too
    adv = wide(advantages.detach())
    tau = torch.where(adv > 0, adv.new_tensor(temperature_pos), adv.new_tensor(temperature_neg))
    ratio = torch.exp(wide(log_ratio).clamp(max=_EXP_MAX))
    gate = torch.sigmoid(tau * (ratio - 1)) * (4 / tau)
    none = torch.zeros_like(log_ratio, dtype=torch.bool)
    return Surrogate(saturate(-adv * gate, log_ratio.dtype), none, none, none)


_VESPO_LOG_W_MIN, _VESPO_LOG_W_MAX = math.log(1e-8), 20.0  # the clamp of log w (TRL's, the paper's code)


def vespo_surrogate(log_ratio: Tensor, logprobs: Tensor, advantages: Tensor, *, k_pos: float = 2.0,
                    lambda_pos: float = 3.0, k_neg: float = 3.0, lambda_neg: float = 2.0) -> Surrogate:
    """VESPO per token: ``ℓ_t = −sg(φ(w))·A_t·lp_t`` with a Gamma-shaped weight of the sequence ratio.

    ``log w = clamp(Σ_t clamp(log ρ_t, −20, 20), log 1e-8, 20)`` (the sequence's summed token
    log-ratio), ``φ(w) = e^λ·w^k·e^{−λw}`` (so ``φ(1) = 1``), with ``(k, λ) = (k_pos, λ_pos)``
    where ``A ≥ 0`` and ``(k_neg, λ_neg)`` where ``A < 0``, ``λ`` floored at 1e-4; a non-finite
    ``φ`` is 0. The weight replaces the hard clip: it vanishes as ``w → 0`` (power ``k``) and as
    ``w → ∞`` (decay ``λ``). Defaults: TRL's ``vespo_k_pos = 2``, ``vespo_lambda_pos = 3``,
    ``vespo_k_neg = 3``, ``vespo_lambda_neg = 2``.

    Args:
        log_ratio: ``[..., T]`` float, *token-level* ``log ρ_t``, 0 outside the response (as
            ``importance_log_ratio(level="token")`` returns); summed over the last dim.
        logprobs: ``[..., T]`` float, current policy, differentiable.
        advantages: ``[..., T]`` float (detached); its sign picks ``(k, λ)`` per token.
        k_pos, lambda_pos, k_neg, lambda_neg: ``k > 0``, ``λ > 0`` of each sign.
    Returns:
        ``Surrogate``; nothing is clipped, so the three flags are all False.
    Raises:
        ValueError: a ``k`` or ``λ`` is not positive.

    >>> vespo_surrogate(torch.tensor([[0.0, 0.0]]), torch.tensor([[-1.0, -2.0]]), torch.ones(1, 2)).loss
    tensor([[1., 2.]])

    References:
        "VESPO: Variational Sequence-Level Soft Policy Optimization", https://arxiv.org/abs/2602.10693
    Gradient: through ``logprobs`` only (``φ`` is detached), ``−φ·A·∇lp``.
    """
    check_float("logprobs", logprobs)
    check_same_shape("logprobs", logprobs, log_ratio=log_ratio, advantages=advantages)
    _positive(k_pos=k_pos, lambda_pos=lambda_pos, k_neg=k_neg, lambda_neg=lambda_neg)
    adv = wide(advantages.detach())
    seq = wide(log_ratio.detach()).clamp(-20.0, 20.0).sum(dim=-1, keepdim=True)
    log_w = seq.clamp(_VESPO_LOG_W_MIN, _VESPO_LOG_W_MAX)
    k = torch.where(adv >= 0, adv.new_tensor(k_pos), adv.new_tensor(k_neg))
    lam = torch.where(adv >= 0, adv.new_tensor(lambda_pos), adv.new_tensor(lambda_neg)).clamp(min=1e-4)
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    none = torch.zeros_like(logprobs, dtype=torch.bool)
    return Surrogate(saturate(-phi * adv * wide(logprobs), logprobs.dtype), none, none, none)


def _no_dual_clip(surrogate: str, clip_ratio_c) -> None:
    if clip_ratio_c is not None:
        raise ValueError(f"clip_ratio_c: dual clip applies to surrogate='clip' only, got {clip_ratio_c} "
                         f"(surrogate={surrogate!r})")


# Each entry reads its own keywords and ignores the other surrogates' (``ppo_loss`` passes them all).
def _clip_entry(log_ratio, logprobs, advantages, *, clip_eps_low, clip_eps_high, clip_ratio_c, **_):
    return clipped_surrogate(log_ratio, advantages, clip_eps_low=clip_eps_low, clip_eps_high=clip_eps_high,
                             clip_ratio_c=clip_ratio_c)


def _cispo_entry(log_ratio, logprobs, advantages, *, clip_eps_low, clip_eps_high, clip_ratio_c, **_):
    _no_dual_clip("cispo", clip_ratio_c)
    return cispo_surrogate(log_ratio, logprobs, advantages, clip_eps_low=clip_eps_low,
                           clip_eps_high=clip_eps_high)


def _sapo_entry(log_ratio, logprobs, advantages, *, clip_eps_low, clip_eps_high, clip_ratio_c,
                sapo_temperature_pos=1.0, sapo_temperature_neg=1.05, **_):
    _no_dual_clip("sapo", clip_ratio_c)
    return sapo_surrogate(log_ratio, advantages, temperature_pos=sapo_temperature_pos,
                          temperature_neg=sapo_temperature_neg)


def _vespo_entry(log_ratio, logprobs, advantages, *, clip_eps_low, clip_eps_high, clip_ratio_c, vespo_k_pos=2.0,
                 vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0, **_):
    _no_dual_clip("vespo", clip_ratio_c)
    return vespo_surrogate(log_ratio, logprobs, advantages, k_pos=vespo_k_pos, lambda_pos=vespo_lambda_pos,
                           k_neg=vespo_k_neg, lambda_neg=vespo_lambda_neg)


# One signature: (log_ratio, logprobs, advantages, *, clip_eps_low, clip_eps_high, clip_ratio_c,
# **surrogate_keywords) where the keywords are ppo_loss's sapo_* / vespo_* ones, each with its default.
SURROGATES: dict[str, Callable[..., Surrogate]] = {
    "clip": _clip_entry,
    "cispo": _cispo_entry,
    "sapo": _sapo_entry,
    "vespo": _vespo_entry,
}


# --- value loss ---------------------------------------------------------------------------
def clipped_value_loss(value_preds: Tensor, values: Tensor | None, returns: Tensor, *,
                       cliprange_value: float | None = 0.2) -> Tensor:
    """Clipped value loss per token: ``½·max((V̂−R)², (clip(V̂, V−c, V+c)−R)²)``.

    ``cliprange_value=None`` gives the plain ``½(V̂−R)²`` (``values`` may then be ``None``).

    Args:
        value_preds: ``[..., T]`` float, ``V̂`` of the critic being trained, differentiable.
        values: ``[..., T]`` float, ``V`` recorded with the rollout (detached).
        returns: ``[..., T]`` float, targets ``R`` (detached).
        cliprange_value: ``c``.
    Returns:
        ``[..., T]`` per-token loss.

    >>> clipped_value_loss(torch.tensor([1.0]), torch.tensor([0.0]), torch.tensor([0.0]))
    tensor([0.5000])

    References:
        Schulman et al., "Proximal Policy Optimization Algorithms", https://arxiv.org/abs/1707.06347
        (the value clip of the OpenAI baselines implementation).
    Gradient: through ``value_preds`` only.
    """
    check_float("value_preds", value_preds)
    check_same_shape("value_preds", value_preds, values=values, returns=returns)
    dtype, preds, returns = value_preds.dtype, wide(value_preds), wide(returns.detach())
    unclipped = (preds - returns).square()
    if cliprange_value is None:
        return saturate(0.5 * unclipped, dtype)
    check_number("cliprange_value", cliprange_value, low=0.0, allow_inf=True)
    if values is None:
        raise ValueError("values: required when cliprange_value is set (the clip is around them)")
    values = wide(values.detach())
    clipped = values + (preds - values).clamp(-cliprange_value, cliprange_value)
    return saturate(0.5 * torch.maximum(unclipped, (clipped - returns).square()), dtype)


# --- diagnostics: [..., T] values and bool mask in, detached [] out (0 for an empty mask) ----
def approx_kl_k1(log_ratio: Tensor, mask: Tensor) -> Tensor:
    """k1 estimate of ``KL(π_old‖π_θ)``: ``mean_{mask}(old − lp) = mean(−log ρ)``.

    Legacy TRL's ``policykl`` and verl's ``ppo_kl``; can be negative.

    >>> approx_kl_k1(torch.tensor([0.1, -0.3, 9.0]), torch.tensor([True, True, False]))
    tensor(0.1000)

    Reference: J. Schulman, "Approximating KL Divergence", http://joschu.net/blog/kl-approx.html
    """
    check_mask("mask", mask, like=log_ratio, like_name="log_ratio")
    return masked_mean(-log_ratio.detach(), mask)


def approx_kl_k3(log_ratio: Tensor, mask: Tensor) -> Tensor:
    """k3 estimate of ``KL(π_old‖π_θ)``: ``mean_{mask}(ρ − 1 − log ρ)``, unbiased and ≥ 0.

    >>> approx_kl_k3(torch.tensor([0.0, 0.0]), torch.tensor([True, True]))
    tensor(0.)

    Reference: J. Schulman, "Approximating KL Divergence", http://joschu.net/blog/kl-approx.html
    """
    check_mask("mask", mask, like=log_ratio, like_name="log_ratio")
    # float64, the exponent bounded where exp overflows there, cast back saturating: finite for finite
    # log-ratios (the value past ~88 nats is float32's largest), and exact wherever float64 is finite
    lr = wide(log_ratio.detach())
    return saturate(masked_mean(torch.expm1(lr.clamp(max=_LOG_MAX64)) - lr, mask), log_ratio.dtype)


def clip_fraction(clipped: Tensor, mask: Tensor, *, dtype: torch.dtype = torch.float32) -> Tensor:
    """``Σ_{mask} clipped / Σ mask``: the fraction of valid tokens flagged by ``clipped`` (bool).

    >>> clip_fraction(torch.tensor([True, False, True]), torch.tensor([True, True, False]))
    tensor(0.5000)
    """
    check_mask("mask", mask, like=clipped, like_name="clipped")
    return masked_mean(clipped.to(dtype), mask)


def clip_fraction_extremes(clipped: Tensor, mask: Tensor, *,
                           dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """``(min_b f_b, max_b f_b)`` of the per-sequence clip fractions ``f_b = Σ_t m·clipped / Σ_t m``
    (``clipped`` bool ``[..., T]``), over the sequences with at least one valid token; ``(0, 0)``
    when there are none. TRL's ``clip_ratio/low_min`` (of the low flags) and ``clip_ratio/high_max``
    (of the high flags) on one batch.

    >>> clip_fraction_extremes(torch.tensor([[True, False], [True, True], [False, False]]),
    ...                        torch.tensor([[True, True], [True, False], [False, False]]))
    (tensor(0.5000), tensor(1.))
    """
    check_mask("mask", mask, like=clipped, like_name="clipped")
    frac = masked_mean(clipped.to(dtype), mask, dim=-1)
    valid = mask.any(-1)
    inf = torch.tensor(math.inf, dtype=dtype, device=frac.device)
    # a sentinel beside the rows: the extremes of no sequence (B = 0) are defined too
    low = torch.cat([torch.where(valid, frac, inf).reshape(-1), inf.reshape(1)]).amin()
    high = torch.cat([torch.where(valid, frac, -inf).reshape(-1), -inf.reshape(1)]).amax()
    zero, some = frac.new_zeros(()), valid.any()
    return torch.where(some, low, zero), torch.where(some, high, zero)


def ratio_stats(log_ratio: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """``(mean_{mask} ρ, max_{mask} ρ)`` with ``ρ = exp(log_ratio)``.

    An empty mask gives ``(0, 0)``.

    >>> ratio_stats(torch.tensor([0.0, 0.5, 7.0]).log1p(), torch.tensor([True, True, False]))
    (tensor(1.2500), tensor(1.5000))
    """
    check_mask("mask", mask, like=log_ratio, like_name="log_ratio")
    ratio = torch.exp(zero_outside(log_ratio.detach(), mask))
    # max over the valid tokens (ratios are > 0, so the zeroed padding never wins); 0 when there are none
    return masked_mean(ratio, mask), torch.cat([zero_outside(ratio, mask).flatten(), ratio.new_zeros(1)]).amax()


def explained_variance(predictions: Tensor, targets: Tensor, mask: Tensor) -> Tensor:
    """``1 − Var(R − V)/Var(R)`` over ``mask`` (unbiased variances), ``[]``, detached.

    1 is a perfect critic, 0 no better than a constant, negative worse. Defined as 0 when the
    targets have no variance (peers give NaN).

    Args:
        predictions: ``[..., T]`` float ``V``.  targets: ``[..., T]`` float ``R``.  mask: ``[..., T]`` bool.
    Returns:
        ``[]``, dtype of ``targets``.

    >>> v, r = torch.tensor([1.0, 2.0, 2.0]), torch.tensor([1.0, 3.0, 2.0])
    >>> explained_variance(v, r, torch.ones(3, dtype=torch.bool))
    tensor(0.6667)
    """
    check_same_shape("targets", targets, predictions=predictions)
    dtype, targets, predictions = targets.dtype, wide(targets.detach()), wide(predictions.detach())
    var_t = masked_var(targets, mask)  # float64: the residuals of targets near the range's edge stay finite
    var_res = masked_var(zero_outside(targets, mask) - zero_outside(predictions, mask), mask)
    tiny = torch.finfo(var_t.dtype).tiny
    return saturate(torch.where(var_t > 0, 1 - var_res / var_t.clamp(min=tiny), torch.zeros_like(var_t)), dtype)


def early_stop(approx_kl: Tensor, *, target_kl: float, factor: float = 1.5) -> Tensor:
    """``approx_kl > factor·target_kl``: a ``[]`` bool tensor telling the loop to stop the epoch.

    Legacy TRL skips the rest of a PPO step when the policy KL exceeds 1.5× its target.
    The decision is a tensor: the loop (not a kernel) turns it into a Python bool.

    >>> early_stop(torch.tensor(0.2), target_kl=0.1)
    tensor(True)
    """
    return torch.as_tensor(approx_kl).detach() > factor * target_kl


# --- the loss ------------------------------------------------------------------------------
_LAYOUTS = dict.fromkeys((K.LOGPROBS, K.OLD_LOGPROBS, K.ADVANTAGES, K.RESPONSE_MASK, K.REF_LOGPROBS,
                          K.VALUE_PREDS, K.VALUES, K.RETURNS, K.ENTROPY), "[B, R]")


def _iszero_outside(coef) -> bool:
    # A tensor coefficient (an adaptive state) is never assumed to be 0: no branching on data.
    return isinstance(coef, (int, float)) and coef == 0


def _token_entry(batch: TensorDictBase, key: str, mask: Tensor) -> Tensor:
    """``batch[key]`` (checked by ``_check_inputs``) zeroed outside the mask."""
    return zero_outside(batch.get(key), mask)


def _check_coefficients(*, vf_coef, entropy_coef, kl_coef, ratio_threshold, log_ratio_clamp, cliprange_value) -> None:
    """The loss's weights, named (the kernels check their own clip ranges): a negative weight
    inverts its term, a NaN one makes the loss NaN. A tensor ``kl_coef`` (an adaptive state's) must
    be 0-d; its value is not read."""
    check_number("vf_coef", vf_coef, low=0.0)
    check_number("entropy_coef", entropy_coef)
    check_scalar("kl_coef", kl_coef, low=0.0)
    if cliprange_value is not None:
        check_number("cliprange_value", cliprange_value, low=0.0, allow_inf=True)
    if log_ratio_clamp is not None:
        check_number("log_ratio_clamp", log_ratio_clamp, low=0.0, low_open=True, allow_inf=True)
    if ratio_threshold is not None:
        check_number("ratio_threshold", ratio_threshold, low=0.0, allow_inf=True)  # 0: every batch skipped


def _check_inputs(batch: TensorDictBase, *, entropy_coef, kl_coef, cliprange_value) -> Tensor:
    """Every key ``ppo_loss`` will read, present and a float ``[B, R]`` like the bool mask: the one
    validation of the loss (the kernels then run inside ``rlcore.checks.validated``). Returns the mask."""
    required = [K.LOGPROBS, K.OLD_LOGPROBS, K.ADVANTAGES]
    require_keys(batch, [*required, K.RESPONSE_MASK], where="ppo_loss", layouts=_LAYOUTS)
    mask = batch.get(K.RESPONSE_MASK)
    check_ndim(K.RESPONSE_MASK, mask, min_ndim=1, layout="[B, R]")
    check_mask(K.RESPONSE_MASK, mask)
    if not _iszero_outside(entropy_coef) or K.ENTROPY in batch.keys():
        require_keys(batch, [K.ENTROPY], where="ppo_loss (entropy_coef != 0)", layouts=_LAYOUTS)
        required.append(K.ENTROPY)
    if not _iszero_outside(kl_coef):
        require_keys(batch, [K.REF_LOGPROBS], where="ppo_loss (kl_coef != 0)", layouts=_LAYOUTS)
        required.append(K.REF_LOGPROBS)
    if K.VALUE_PREDS in batch.keys():
        value_keys = [K.VALUE_PREDS, K.RETURNS] + ([] if cliprange_value is None else [K.VALUES])
        require_keys(batch, value_keys, where="ppo_loss (value term)", layouts=_LAYOUTS)
        required += value_keys
    for key in required:
        x = batch.get(key)
        check_float(key, x)
        check_same_shape(K.RESPONSE_MASK, mask, **{key: x})
    return mask


def _policy_terms(batch, mask, agg, *, surrogate, clip_eps_low, clip_eps_high, clip_ratio_c,
                  log_ratio_clamp, ratio_level, entropy_coef, kl_coef, kl, **surrogate_keywords):
    lp = _token_entry(batch, K.LOGPROBS, mask)
    old = _token_entry(batch, K.OLD_LOGPROBS, mask)
    adv = _token_entry(batch, K.ADVANTAGES, mask)
    log_ratio = importance_log_ratio(lp, old, mask, level=ratio_level, clamp=log_ratio_clamp)
    sur = lookup(SURROGATES, surrogate, what="surrogate")(
        log_ratio, lp, adv, clip_eps_low=clip_eps_low, clip_eps_high=clip_eps_high, clip_ratio_c=clip_ratio_c,
        **surrogate_keywords)
    zero = lp.new_zeros(())
    losses = {"loss_policy": agg(sur.loss), "loss_entropy": zero, "loss_kl": zero}
    token_lr = wide(lp.detach()) - wide(old)  # float64: log-probs near ±3e38 differ finitely
    if log_ratio_clamp is not None:  # the metrics see the ratio the loss sees
        token_lr = token_lr.clamp(-log_ratio_clamp, log_ratio_clamp)
    ratio_mean, ratio_max = ratio_stats(log_ratio, mask)
    low_min, _ = clip_fraction_extremes(sur.clipped_low, mask, dtype=lp.dtype)
    _, high_max = clip_fraction_extremes(sur.clipped_high, mask, dtype=lp.dtype)
    metrics = {"approx_kl_k1": approx_kl_k1(token_lr, mask), "approx_kl_k3": approx_kl_k3(token_lr, mask),
               "clipfrac_low": clip_fraction(sur.clipped_low, mask, dtype=lp.dtype),
               "clipfrac_high": clip_fraction(sur.clipped_high, mask, dtype=lp.dtype),
               "clipfrac_low_min": low_min, "clipfrac_high_max": high_max,
               "clipfrac_dual": clip_fraction(sur.clipped_dual, mask, dtype=lp.dtype),
               "ratio_mean": ratio_mean, "ratio_max": ratio_max}
    if K.ENTROPY in batch.keys():
        entropy = _token_entry(batch, K.ENTROPY, mask)
        losses["loss_entropy"] = -entropy_coef * agg(entropy)
        metrics["entropy"] = masked_mean(entropy.detach(), mask)
    if not _iszero_outside(kl_coef):
        kl_tok = kl_estimate(lp, _token_entry(batch, K.REF_LOGPROBS, mask).detach(), kind=kl)
        kl_agg = agg(kl_tok)
        losses["loss_kl"] = kl_coef * kl_agg
        metrics["kl_ref"] = kl_agg.detach()
    return losses, metrics


def _value_terms(batch, mask, agg, *, vf_coef, cliprange_value):
    preds = _token_entry(batch, K.VALUE_PREDS, mask)
    returns = _token_entry(batch, K.RETURNS, mask)
    values = None if cliprange_value is None else _token_entry(batch, K.VALUES, mask)
    per_token = clipped_value_loss(preds, values, returns, cliprange_value=cliprange_value)
    outside = (torch.zeros_like(mask) if values is None
               else (preds.detach() - values).abs() > cliprange_value)
    metrics = {"value_loss_unweighted": agg(per_token).detach(),
               "clipfrac_value": clip_fraction(outside, mask, dtype=preds.dtype),
               "explained_variance": explained_variance(preds, returns, mask)}
    return {"loss_value": vf_coef * agg(per_token)}, metrics


def ppo_loss(batch: TensorDictBase, *, surrogate: str = "clip", clip_eps_low: float = 0.2,
             clip_eps_high: float = 0.2, clip_ratio_c: float | None = None,
             log_ratio_clamp: float | None = None, ratio_level: str = "token", vf_coef: float = 0.1,
             cliprange_value: float | None = 0.2, entropy_coef: float = 0.0, kl_coef: float = 0.0,
             kl: str = "k3", agg: str = "token_mean", num_tokens=None, num_seqs=None, max_length=None,
             ratio_threshold: float | None = None, sapo_temperature_pos: float = 1.0,
             sapo_temperature_neg: float = 1.05, vespo_k_pos: float = 2.0, vespo_lambda_pos: float = 3.0,
             vespo_k_neg: float = 3.0, vespo_lambda_neg: float = 2.0) -> tuple[Tensor, TensorDict]:
    """The PPO loss of a rollout: clipped surrogate + value + entropy bonus + KL in the loss.

    ``loss = agg(ℓ_pg) + vf_coef·agg(ℓ_vf) − entropy_coef·agg(H) + kl_coef·agg(KL(π_θ‖π_ref))``

    with ``ℓ_pg`` from ``SURROGATES[surrogate]`` on ``importance_log_ratio(level=ratio_level)``,
    ``ℓ_vf = clipped_value_loss`` and ``agg = rlcore.masked.aggregate(·, mask, agg, ...)``.
    Each term is present only when asked for, and then its keys are required:
    - value: when ``value_preds`` is in the batch (needs ``returns``, and ``values`` unless
      ``cliprange_value=None``); critic-free methods use ``policy_gradient.policy_loss``;
    - entropy: when ``entropy`` is in the batch or ``entropy_coef != 0``;
    - KL in the loss: when ``kl_coef != 0`` (needs ``ref_logprobs``), per token
      ``rlcore.kl.kl_estimate(lp, ref, kind=kl)``. KL in the *reward* is the other, separate
      placement (``rlcore.rewards``); use one or the other, explicitly.
    ``ratio_threshold`` (legacy TRL, 10 there): when the masked mean ratio exceeds it, every
    term is replaced by 0 (graph kept, no Python branch) and ``skipped_ratio_threshold`` is 1.

    Args:
        batch: TensorDict ``[B]`` with ``logprobs``, ``old_logprobs``, ``advantages`` ``[B, R]``
            float and ``response_mask`` ``[B, R]`` bool; optionally ``value_preds``, ``values``,
            ``returns``, ``entropy``, ``ref_logprobs`` ``[B, R]``. Padding may hold anything.
        surrogate: ``"clip"``, ``"cispo"``, ``"sapo"`` or ``"vespo"`` (``SURROGATES``).
        clip_eps_low, clip_eps_high, clip_ratio_c: see ``clipped_surrogate``.
        log_ratio_clamp, ratio_level: see ``importance_log_ratio``.
        vf_coef, cliprange_value: value-loss weight and clip (``None``: unclipped).
        entropy_coef, kl_coef, kl: entropy bonus weight; KL weight and estimator name.
        agg, num_tokens, num_seqs, max_length: see ``rlcore.masked.aggregate``.
        ratio_threshold: ``None`` or the mean ratio above which the batch is skipped.
        sapo_temperature_pos, sapo_temperature_neg: ``τ_pos``, ``τ_neg`` of ``sapo_surrogate``
            (read with ``surrogate="sapo"`` only).
        vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg: ``k``, ``λ`` of
            ``vespo_surrogate`` (read with ``surrogate="vespo"`` only; it wants ``ratio_level="token"``).
    Returns:
        ``(loss [], metrics)``; metrics (detached ``[]``): ``loss_policy``, ``loss_entropy``,
        ``loss_kl``, ``loss_value`` (with a critic) sum to ``loss``; ``approx_kl_k1/_k3``,
        ``clipfrac_low/_high/_dual``, ``clipfrac_low_min`` / ``clipfrac_high_max`` (the smallest
        low and largest high per-sequence clip fraction, ``clip_fraction_extremes``),
        ``ratio_mean/_max``, ``skipped_ratio_threshold``, and when
        present ``entropy``, ``kl_ref``, ``value_loss_unweighted``, ``clipfrac_value``,
        ``explained_variance`` (of ``value_preds`` against ``returns``). Metrics are cast back
        saturating: finite for finite inputs (a KL of log-probs near ±3e38 is the dtype's largest value).
    Raises:
        ValueError: a hyper-parameter out of its range, named: a negative or NaN ``clip_eps_low`` /
        ``clip_eps_high`` / ``cliprange_value`` / ``vf_coef`` / ``kl_coef`` (a tensor one must be
        0-d), a NaN ``entropy_coef``, ``log_ratio_clamp`` not ``> 0``, a negative or NaN ``ratio_threshold``.

    References:
        Schulman et al., "Proximal Policy Optimization Algorithms", https://arxiv.org/abs/1707.06347
        Ouyang et al., "Training language models to follow instructions with human feedback",
        https://arxiv.org/abs/2203.02155
    Gradient: through ``logprobs``, ``value_preds`` and ``entropy``; ``old_logprobs``,
    ``advantages``, ``ref_logprobs``, ``values`` and ``returns`` are detached. Positions outside
    the mask get exactly zero gradient.
    """
    _check_coefficients(vf_coef=vf_coef, entropy_coef=entropy_coef, kl_coef=kl_coef, ratio_threshold=ratio_threshold,
                        log_ratio_clamp=log_ratio_clamp, cliprange_value=cliprange_value)
    mask = _check_inputs(batch, entropy_coef=entropy_coef, kl_coef=kl_coef, cliprange_value=cliprange_value)
    with validated():
        def agg_fn(x: Tensor) -> Tensor:
            return aggregate(x, mask, agg, num_tokens=num_tokens, num_seqs=num_seqs, max_length=max_length)

        losses, metrics = _policy_terms(
            batch, mask, agg_fn, surrogate=surrogate, clip_eps_low=clip_eps_low, clip_eps_high=clip_eps_high,
            clip_ratio_c=clip_ratio_c, log_ratio_clamp=log_ratio_clamp, ratio_level=ratio_level,
            entropy_coef=entropy_coef, kl_coef=kl_coef, kl=kl, sapo_temperature_pos=sapo_temperature_pos,
            sapo_temperature_neg=sapo_temperature_neg, vespo_k_pos=vespo_k_pos, vespo_lambda_pos=vespo_lambda_pos,
            vespo_k_neg=vespo_k_neg, vespo_lambda_neg=vespo_lambda_neg)
        if K.VALUE_PREDS in batch.keys():
            value_losses, value_metrics = _value_terms(batch, mask, agg_fn, vf_coef=vf_coef,
                                                       cliprange_value=cliprange_value)
            losses, metrics = {**losses, **value_losses}, {**metrics, **value_metrics}
        skip = (torch.zeros((), dtype=torch.bool, device=mask.device) if ratio_threshold is None
                else metrics["ratio_mean"] > ratio_threshold)
        losses = {k: torch.where(skip, torch.zeros_like(v), v) for k, v in losses.items()}
        loss = wide_sum(losses)  # terms near the largest value do not add to inf
        dtype = loss.dtype
        metrics = {**{k: v.detach() for k, v in losses.items()}, **metrics,
                   "skipped_ratio_threshold": skip.to(dtype)}
        # cast saturating: a diagnostic past the dtype's range (a KL of log-probs near ±3e38) is its largest value
        return loss, TensorDict({k: saturate(v.detach(), dtype) for k, v in metrics.items()}, batch_size=[])
