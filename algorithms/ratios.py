"""Importance ratios of the policy being trained against the one that sampled, ``[..., T]`` in and out::

    importance_log_ratio   log ρ at a level of RATIO_LEVELS, optionally clamped
    engine_importance_weights  the trainer's policy against a generation engine's (vLLM) numerics
    token_log_ratio        lp_t − old_t (PPO)
    sequence_log_ratio     the sequence's mean log-ratio on every token, gradient ∇lp_t (GSPO)
    sequence_sum_log_ratio the sequence's summed log-ratio on every token, full gradient (TRL's RLOO)

Every result is 0 outside the mask (ratio 1), so padding never reaches ``exp``. The losses of
``algorithms.ppo`` and ``algorithms.policy_gradient`` and the asynchronous learners' importance
correction (``loops.scale.async_learners``) read them.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from rlcore.checks import check_float, check_mask, check_number, check_same_shape, lookup
from rlcore.masked import masked_mean, masked_sum, saturate, zero_outside

__all__ = ["importance_log_ratio", "token_log_ratio", "sequence_log_ratio", "sequence_sum_log_ratio", "RATIO_LEVELS",
           "ENGINE_IS_MODES", "engine_importance_weights"]

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


ENGINE_IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def engine_importance_weights(trainer_logprobs: Tensor, engine_logprobs: Tensor, mask: Tensor, *,
                              mode: str = "sequence_mask", clip_min: float | None = None,
                              clip_max: float | None = 3.0) -> Tensor:
    """Importance weights correcting for a generation engine whose log-probs differ from the trainer's.

    An engine such as vLLM samples with other kernels and precision than the trainer's forward, so
    its behaviour policy ``π_e`` is not quite the trainer's ``π_t`` at the same weights. With
    ``d_t = log π_t − log π_e`` on the response tokens (0 where the engine gave NaN):

    - ``token_*``: ``w_t = exp(d_t)``; ``sequence_*``: ``w = exp(Σ_t d_t)`` on every token of the row;
    - ``*_truncate``: ``w ← clamp(w, C_min, C_max)``; ``*_mask``: ``w ← 0`` outside ``[C_min, C_max]``
      (a bound left ``None`` is open).

    TRL's ``vllm_importance_sampling_*`` (default ``sequence_mask`` with ``C_max = 3``): the weight
    multiplies the policy surrogate, and the clipped ratio is taken against ``π_t``.

    Args:
        trainer_logprobs: ``[..., T]`` float, the trainer's log-probs of the sampled tokens (no grad).
        engine_logprobs: ``[..., T]`` float, the engine's.
        mask: ``[..., T]`` bool, the response tokens.
        mode: one of ``ENGINE_IS_MODES``.  clip_min, clip_max: the bounds (``C_min < C_max``).
    Returns:
        ``[..., T]`` weights ``≥ 0``, 0 outside ``mask``, detached, in ``trainer_logprobs``' dtype
        (an unbounded weight past its range saturates at the dtype's largest finite value).

    >>> t, e = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]])
    >>> engine_importance_weights(t, e, torch.tensor([[True, True]]), mode="token_truncate", clip_max=1.5)
    tensor([[1.5000, 0.3679]])
    >>> engine_importance_weights(t, e, torch.tensor([[True, True]]), mode="sequence_mask")
    tensor([[0.6065, 0.6065]])

    References:
        Yao et al., "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training" (truncated
        importance sampling against the inference engine), https://fengyao.notion.site/off-policy-rl
    """
    check_float("trainer_logprobs", trainer_logprobs)
    check_same_shape("trainer_logprobs", trainer_logprobs, engine_logprobs=engine_logprobs)
    check_mask("mask", mask, like=trainer_logprobs, like_name="trainer_logprobs")
    lookup(dict.fromkeys(ENGINE_IS_MODES), mode, what="mode")
    for name, bound in (("clip_min", clip_min), ("clip_max", clip_max)):
        if bound is not None:
            check_number(name, bound, low=0.0, allow_inf=True)
    if clip_min is not None and clip_max is not None and not clip_min < clip_max:
        raise ValueError(f"clip_min: expected C_min < C_max = {clip_max}, got {clip_min}")
    diff = torch.nan_to_num((trainer_logprobs.detach() - engine_logprobs.detach()).double(), nan=0.0)
    diff = zero_outside(diff, mask)
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True).expand_as(diff)
    w = torch.exp(diff.clamp(max=700.0))  # float64: exp(700) is finite
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    if mode.endswith("truncate"):
        w = w.clamp(min=low, max=high)
    else:
        w = torch.where((w < low) | (w > high), torch.zeros((), dtype=w.dtype), w)
    return saturate(zero_outside(w, mask), trainer_logprobs.dtype)  # an unbounded weight saturates, never inf

