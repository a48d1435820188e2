"""Importance ratios of the policy being trained against the one that sampled, ``[..., T]`` in and out::

    importance_log_ratio   log ρ at a level of RATIO_LEVELS, optionally clamped
    token_log_ratio        lp_t − old_t (PPO)
    sequence_log_ratio     the sequence's mean log-ratio on every token, gradient ∇lp_t (GSPO)
    sequence_sum_log_ratio the sequence's summed log-ratio on every token, full gradient (TRL's RLOO)

Every result is 0 outside the mask (ratio 1), so padding never reaches ``exp``. The losses of
``algorithms.ppo`` and ``algorithms.policy_gradient`` and the asynchronous learners' importance
correction (``loops.scale.async_learners``) read them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rlcore.checks import check_float, check_mask, check_number, check_same_shape, lookup
from rlcore.masked import masked_mean, masked_sum, zero_outside

__all__ = ["importance_log_ratio", "token_log_ratio", "sequence_log_ratio", "sequence_sum_log_ratio", "RATIO_LEVELS"]

Tensor = torch.Tensor


def _check_ratio_inputs(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> None:
    check_float("logprobs", logprobs)
    check_same_shape("logprobs", logprobs, old_logprobs=old_logprobs)
    check_mask("mask", mask, like=logprobs, like_name="logprobs")


def token_log_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
    """``log ρ_t = lp_t − old_t`` per token, 0 outside ``mask`` (PPO)."""
    _check_ratio_inputs(logprobs, old_logprobs, mask)
    return zero_outside(logprobs - old_logprobs.detach(), mask)


def sequence_log_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
    """GSPO: ``log s_t = lp_t − sg(lp_t) + sg(mean_t(lp − old))``, 0 outside ``mask``.

    Each token's value is the sequence's length-normalised log-ratio and its gradient is
    ``∇lp_t``. With a sequence-level advantage (the same ``A_i`` on every token, as GRPO/GSPO
    estimators give) and any aggregation mode (all weigh the tokens of one sequence equally),
    the aggregated loss has exactly the value and gradient of the sequence-level objective.
    """
    _check_ratio_inputs(logprobs, old_logprobs, mask)
    mean = masked_mean(logprobs.detach() - old_logprobs.detach(), mask, dim=-1, keepdim=True)
    return zero_outside(logprobs - logprobs.detach() + mean, mask)


def sequence_sum_log_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
    """RLOO (TRL): ``S = Σ_t (lp_t − old_t)`` broadcast to every token, with its full gradient.

    Every token carries the same function ``S`` of the whole sequence, so under
    ``seq_mean_token_mean`` the loss is ``mean_i ℓ(S_i)`` in value and gradient, TRL's
    sequence-level RLOO loss. The ratio is ``exp`` of the *sum* (not the mean, unlike GSPO).
    """
    _check_ratio_inputs(logprobs, old_logprobs, mask)
    total = masked_sum(logprobs - old_logprobs.detach(), mask, dim=-1, keepdim=True)
    return zero_outside(total.expand_as(logprobs), mask)


RATIO_LEVELS: dict[str, Callable[[Tensor, Tensor, Tensor], Tensor]] = {
    "token": token_log_ratio,
    "sequence": sequence_log_ratio,
    "sequence_sum": sequence_sum_log_ratio,
}


def importance_log_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor, *, level: str = "token",
                         clamp: float | None = None) -> Tensor:
    """Log importance ratio ``log ρ = log π_θ − log π_old``, per token or per sequence.

    - ``"token"``: ``lp_t − old_t`` (PPO).
    - ``"sequence"``: ``lp_t − sg(lp_t) + sg(Σ_t m(lp − old) / Σ_t m)`` (GSPO).
    - ``"sequence_sum"``: ``Σ_t m(lp − old)`` on every token, full gradient (TRL's RLOO).

    With ``clamp = c`` the result is clamped to ``[−c, c]`` (verl uses 20 for tokens); a clamped
    token has no gradient.

    Args:
        logprobs: ``[..., T]`` float, current policy, differentiable.
        old_logprobs: ``[..., T]`` float, behaviour policy (detached).
        mask: ``[..., T]`` bool, True on response tokens.
        level: a key of ``RATIO_LEVELS``.  clamp: ``None`` or a positive float (``ValueError`` otherwise).
    Returns:
        ``[..., T]`` log-ratio, 0 outside ``mask`` (ratio 1), so padding never reaches ``exp``.

    >>> lp, old = torch.tensor([[-1.0, -2.0, 0.0]]), torch.tensor([[-1.5, -1.5, 9.0]])
    >>> m = torch.tensor([[True, True, False]])
    >>> importance_log_ratio(lp, old, m), importance_log_ratio(lp, old, m, level="sequence_sum")
    (tensor([[ 0.5000, -0.5000,  0.0000]]), tensor([[0., 0., 0.]]))

    References:
        Schulman et al., "Proximal Policy Optimization Algorithms", https://arxiv.org/abs/1707.06347
        Zheng et al., "Group Sequence Policy Optimization", https://arxiv.org/abs/2507.18071
        Ahmadian et al., "Back to Basics: Revisiting REINFORCE Style Optimization for Learning
        from Human Feedback in LLMs" (RLOO), https://arxiv.org/abs/2402.14740
    """
    check_float("logprobs", logprobs)
    check_same_shape("logprobs", logprobs, old_logprobs=old_logprobs)
    check_mask("mask", mask, like=logprobs, like_name="logprobs")
    log_ratio = lookup(RATIO_LEVELS, level, what="level")(logprobs, old_logprobs, mask)
    if clamp is not None:
        check_number("clamp", clamp, low=0.0, low_open=True, allow_inf=True)  # a negative one empties the range
        log_ratio = log_ratio.clamp(-clamp, clamp)
    return log_ratio
