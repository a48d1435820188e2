"""Evolving state as pure ``(init, update)`` pairs with typed states: KL-coefficient controllers
and running moments.

A state is a NamedTuple of tensors; an update returns a new state and never writes into the
old one, so a loop threads it explicitly (``state = update(state, ...)``), checkpoints it as a
plain tuple of tensors, and can replay it. Nothing calls ``.item()``.

:class:`StateTransform` is the pair as optax makes it: the hyper-parameters are bound when the
pair is made (``kl_controller("adaptive", coef=0.2, target=6.0, horizon=10000)``,
``running_moments()``; ``rlcore.algorithms.ddpo.prompt_stats``), so ``init()`` takes none and
``update(state, *observations)`` only what the step observed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import functools
from typing import Any

import torch

from rlcore.checks import check_divisor, check_float, check_mask, check_ndim, lookup
from rlcore.masked import masked_mean, masked_sum, saturate, seq_mean_token_mean, seq_mean_token_sum, wide

__all__ = [
    "StateTransform",
    "KLControllerState",
    "fixed_kl_init",
    "fixed_kl_update",
    "adaptive_kl_init",
    "adaptive_kl_update",
    "KL_CONTROLLERS",
    "kl_controller",
    "observed_kl",
    "KL_REDUCTIONS",
    "RunningMoments",
    "running_moments",
    "running_moments_init",
    "running_moments_update",
    "running_moments_merge",
    "running_moments_var",
    "running_moments_std",
]


class StateTransform(NamedTuple):
    """An ``(init, update)`` pair with its hyper-parameters bound: ``init() -> state`` and
    ``update(state, *observations) -> state``, both pure (optax's ``GradientTransformation`` shape).
    A NamedTuple, so ``init, update = transform`` unpacks it."""

    init: Callable[..., Any]
    update: Callable[..., Any]


# --- KL-coefficient controllers ----------------------------------------------------------------
class KLControllerState(NamedTuple):
    """State of a KL controller: ``coef`` is the penalty coefficient ``β``, a 0-d tensor."""

    coef: torch.Tensor


def _coef(coef: float | torch.Tensor) -> KLControllerState:
    # float64: the adaptive update multiplies β thousands of times.
    return KLControllerState(torch.as_tensor(coef, dtype=torch.float64).detach().clone())


def fixed_kl_init(coef: float | torch.Tensor = 0.2) -> KLControllerState:
    """A constant KL coefficient ``β = coef`` (0-d float64 tensor).

    >>> fixed_kl_init(0.1).coef
    tensor(0.1000, dtype=torch.float64)
    """
    return _coef(coef)


def fixed_kl_update(state: KLControllerState, observed_kl: torch.Tensor, n_steps: int | torch.Tensor,
                    **ignored) -> KLControllerState:
    """Return ``state`` unchanged: ``β`` stays fixed. Shares :func:`adaptive_kl_update`'s signature
    (its keywords, e.g. ``target``, are accepted and ignored) so both fit ``KL_CONTROLLERS``."""
    return state


def adaptive_kl_init(coef: float | torch.Tensor = 0.2) -> KLControllerState:
    """The adaptive controller's initial state ``β₀ = coef`` (0-d float64 tensor).

    References: Ziegler et al., "Fine-Tuning Language Models from Human Preferences",
    https://arxiv.org/abs/1909.08593
    """
    return _coef(coef)


def adaptive_kl_update(state: KLControllerState, observed_kl: torch.Tensor, n_steps: int | torch.Tensor,
                       *, target: float = 6.0, horizon: float = 10000) -> KLControllerState:
    """Proportional control of ``β`` towards a target KL (Ziegler et al. 2019).

    ``e = clip(KL/target − 1, −0.2, 0.2)``, ``β ← β·(1 + e·n_steps/horizon)``.

    Args:
        state: ``KLControllerState`` with ``coef []``.
        observed_kl: ``[]`` float, the current KL (see :func:`observed_kl` for which one).
        n_steps: samples since the last update (TRL: batch size × processes; verl: batch size).
        target: the KL to hold (both at least 1e-12: divisors).  horizon: sets the speed (``β`` moves by at most
            ``±20%·n_steps/horizon`` per update; keep ``n_steps < 5·horizon``: beyond, a KL
            below target drives ``β`` negative, as in the peers' identical update).
    Returns:
        A new ``KLControllerState`` (``coef`` in the state's dtype).

    Gradient: none (``observed_kl`` is detached).

    >>> s = adaptive_kl_update(adaptive_kl_init(0.2), torch.tensor(12.0), 256, target=6.0, horizon=10000)
    >>> s.coef  # error clipped to +0.2: 0.2·(1 + 0.2·256/10000)
    tensor(0.2010, dtype=torch.float64)

    References: Ziegler et al., "Fine-Tuning Language Models from Human Preferences",
    https://arxiv.org/abs/1909.08593 (Section 2.2)
    """
    check_divisor("target", target)  # >= 1e-12 (rlcore.checks.MIN_DIVISOR): KL/target and n/horizon stay finite
    check_divisor("horizon", horizon)
    coef = state.coef
    kl = torch.as_tensor(observed_kl).detach().to(device=coef.device, dtype=coef.dtype)
    error = torch.clamp(kl / target - 1, -0.2, 0.2)
    return KLControllerState(coef * (1 + error * n_steps / horizon))


KL_CONTROLLERS: dict[str, tuple[Callable[..., KLControllerState], Callable[..., KLControllerState]]] = {
    "fixed": (fixed_kl_init, fixed_kl_update),
    "adaptive": (adaptive_kl_init, adaptive_kl_update),
}


def kl_controller(name: str, *, coef: float | torch.Tensor = 0.2, target: float = 6.0,
                  horizon: float = 10000) -> StateTransform:
    """The controller registered as ``name`` in ``KL_CONTROLLERS``, its hyper-parameters bound:
    ``init() -> KLControllerState`` (``β₀ = coef``) and ``update(state, observed_kl, n_steps)``
    (``target`` and ``horizon``: see :func:`adaptive_kl_update`; the fixed controller ignores them).

    Raises ``ValueError`` listing the valid names for an unknown one.

    >>> init, update = kl_controller("adaptive", coef=0.2, target=6.0); update(init(), torch.tensor(6.0), 64).coef
    tensor(0.2000, dtype=torch.float64)
    """
    init, update = lookup(KL_CONTROLLERS, name, what="kl_controller")
    return StateTransform(functools.partial(init, coef), functools.partial(update, target=target, horizon=horizon))


#: Reductions of a per-token KL ``[..., T]`` to the controller's scalar, one signature.
#: Rows with an empty mask are not sequences and are left out of the mean over sequences.
KL_REDUCTIONS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "sequence_sum": seq_mean_token_sum,   # mean_b Σ_t kl (TRL)
    "token_mean": seq_mean_token_mean,    # mean_b (Σ_t kl / n_b)  (verl)
}


def observed_kl(kl: torch.Tensor, mask: torch.Tensor, *, reduce: str = "sequence_sum") -> torch.Tensor:
    """The "current KL" fed to a KL controller, reduced from per-token estimates.

    - ``"sequence_sum"``: ``mean_b Σ_t kl_{b,t}``, the KL of whole responses (TRL's legacy PPO;
      the right scale for ``target = 6`` nats of Ziegler et al.);
    - ``"token_mean"``: ``mean_b (Σ_t kl_{b,t} / n_b)``, the per-token KL averaged over
      sequences (verl; a per-token ``target`` then). Not the global token mean.

    The mean runs over rows with at least one valid token (verl also counts empty rows as 0).

    Args:
        kl: ``[..., T]`` float, per-token KL (e.g. the ``kl`` of ``compute_rewards``).
        mask: ``[..., T]`` bool.
        reduce: ``"sequence_sum" | "token_mean"``.
    Returns:
        ``[]`` detached, dtype of ``kl``; 0 when every row is empty.

    >>> kl = torch.tensor([[1.0, 2.0, 9.0], [3.0, 9.0, 9.0]]); m = torch.tensor([[1, 1, 0], [1, 0, 0]]).bool()
    >>> observed_kl(kl, m), observed_kl(kl, m, reduce="token_mean")
    (tensor(3.), tensor(2.2500))
    """
    check_ndim("kl", kl, min_ndim=1, layout="[..., T]")
    check_mask("mask", mask, like=kl, like_name="kl")
    return lookup(KL_REDUCTIONS, reduce, what="reduce")(kl.detach(), mask)


# --- running moments ---------------------------------------------------------------------------
class RunningMoments(NamedTuple):
    """Count, mean and sum of squared deviations ``M2 = Σ(x − mean)²`` of every value seen.

    ``count`` is a 0-d int64 tensor (exact); ``mean`` and ``m2`` are 0-d floats (float64 by
    default). Variance: :func:`running_moments_var`; std: :func:`running_moments_std`.
    """

    count: torch.Tensor  # type: ignore[assignment]  # the field shadows tuple.count
    mean: torch.Tensor
    m2: torch.Tensor


def running_moments(*, dtype: torch.dtype = torch.float64, device: torch.device | str | None = None) -> StateTransform:
    """Running moments as a :class:`StateTransform`: ``init() -> RunningMoments`` (empty, in
    ``dtype`` on ``device``) and ``update(state, x, mask=None)`` (:func:`running_moments_update`).

    >>> init, update = running_moments(); update(init(), torch.tensor([1.0, 3.0])).mean
    tensor(2., dtype=torch.float64)
    """
    return StateTransform(functools.partial(running_moments_init, dtype, device), running_moments_update)


def running_moments_init(dtype: torch.dtype = torch.float64,
                         device: torch.device | str | None = None) -> RunningMoments:
    """Empty moments: count 0, mean 0, M2 0 (statistics kept in ``dtype``, float64 by default)."""
    zero = torch.zeros((), dtype=dtype, device=device)
    return RunningMoments(torch.zeros((), dtype=torch.int64, device=device), zero, zero.clone())


def running_moments_merge(a: RunningMoments, b: RunningMoments) -> RunningMoments:
    """Merge the moments of two disjoint sets of values (Chan et al.'s parallel formula).

    ``n = n_a + n_b``, ``δ = μ_b − μ_a``, ``μ = μ_a + δ·n_b/n``, ``M2 = M2_a + M2_b + δ²·n_a·n_b/n``.
    Exact in exact arithmetic, hence associative and commutative up to rounding: shards or
    ranks can each summarise their values and merge in any order. Merging with empty moments
    returns the other operand's statistics.

    Args:
        a, b: ``RunningMoments`` (b is cast to a's dtype and device).
    Returns:
        ``RunningMoments``.

    References: T. Chan, G. Golub, R. LeVeque, "Updating Formulae and a Pairwise Algorithm for
    Computing Sample Variances" (1979), https://doi.org/10.1007/978-3-642-51461-6_3
    """
    dtype, device = a.mean.dtype, a.mean.device
    nb_int = b.count.to(device)
    mean_b, m2_b = wide(b.mean.to(device)), wide(b.m2.to(device))
    count = a.count + nb_int
    na, nb, n = wide(a.count), wide(nb_int), wide(count).clamp(min=1)
    delta = mean_b - wide(a.mean)  # float64, cast back saturating: moments near the range's edge stay finite
    mean = wide(a.mean) + delta * (nb / n)
    m2 = wide(a.m2) + m2_b + delta.square() * (na * nb / n)
    return RunningMoments(count, saturate(mean, dtype), saturate(m2, dtype))


def running_moments_update(state: RunningMoments, x: torch.Tensor,
                           mask: torch.Tensor | None = None) -> RunningMoments:
    """Fold a batch of values into the running moments: ``merge(state, moments(x[mask]))``.

    The batch's own moments are taken in two passes in the state's dtype (mean, then
    ``Σ(x − mean)²``), then merged exactly with :func:`running_moments_merge`, so the result
    is the same (up to rounding) whatever the batching of the stream.

    Args:
        state: ``RunningMoments``.
        x: ``[...]`` float, any shape (e.g. scores ``[B]`` or per-token rewards ``[B, T]``).
        mask: ``[...]`` bool, which values count (all when ``None``); others may hold anything.
    Returns:
        A new ``RunningMoments``. Gradient: none (``x`` is detached).

    >>> s = running_moments_update(running_moments_init(), torch.tensor([1.0, 2.0, 3.0, 4.0]))
    >>> s.count, s.mean, running_moments_std(s)
    (tensor(4), tensor(2.5000, dtype=torch.float64), tensor(1.2910, dtype=torch.float64))
    """
    check_float("x", x)
    if mask is None:
        mask = torch.ones_like(x, dtype=torch.bool)
    check_mask("mask", mask, like=x, like_name="x")
    xs = x.detach().to(device=state.mean.device, dtype=state.mean.dtype)
    mask = mask.to(xs.device)
    mean = masked_mean(xs, mask)
    batch = RunningMoments(mask.sum(), mean, masked_sum((xs - mean).square(), mask))
    return running_moments_merge(state, batch)


def running_moments_var(state: RunningMoments, *, unbiased: bool = True) -> torch.Tensor:
    """Variance of every value seen: ``M2/(n − 1)`` (``M2/n`` when ``unbiased=False``).

    Below two values (one when biased) the variance is 0, as ``rlcore.masked.masked_var``.
    Returns ``[]`` in the state's dtype.
    """
    n = state.count - 1 if unbiased else state.count
    return state.m2 / n.clamp(min=1).to(state.m2.dtype)


def running_moments_std(state: RunningMoments, *, unbiased: bool = True) -> torch.Tensor:
    """Standard deviation ``sqrt(running_moments_var(state))`` (unbiased by default, as TRL).

    Returns ``[]`` in the state's dtype; 0 below two values.
    """
    return running_moments_var(state, unbiased=unbiased).clamp(min=0).sqrt()
