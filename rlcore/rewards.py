"""Per-token rewards for RLHF: a KL penalty on every response token plus the sequence score on
the last one, and score processing (scaling, normalisation, clipping) with running moments.

References:
    D. Ziegler et al., "Fine-Tuning Language Models from Human Preferences",
    https://arxiv.org/abs/1909.08593
    L. Ouyang et al., "Training language models to follow instructions with human feedback",
    https://arxiv.org/abs/2203.02155
"""

from __future__ import annotations

import torch
from tensordict import TensorDictBase

from rlcore import keys as K
from rlcore.checks import check_float, check_leaves, check_mask, check_ndim, check_number, check_same_shape, check_scalar
from rlcore.kl import kl_estimate
from rlcore.masked import saturate, wide
from rlcore.transforms import RunningMoments, running_moments_std

__all__ = ["compute_rewards", "process_scores", "with_rewards", "last_token_mask", "soft_overlong_penalty"]


def _zero(x: torch.Tensor) -> torch.Tensor:
    return torch.zeros((), dtype=x.dtype, device=x.device)


def last_token_mask(mask: torch.Tensor) -> torch.Tensor:
    """``[..., T]`` bool, True only at the last True position of each row of ``mask``.

    Works for any mask (right padded, left padded, with gaps), without Python loops: the last
    valid index is ``max_t {t : mask_t}``. Rows with an empty mask are all False.

    Args:
        mask: ``[..., T]`` bool.
    Returns:
        ``[..., T]`` bool, at most one True per row.

    >>> last_token_mask(torch.tensor([[True, False, True, False], [False, False, False, False]]))
    tensor([[False, False,  True, False],
            [False, False, False, False]])
    """
    check_mask("mask", mask)
    check_ndim("mask", mask, min_ndim=1, layout="[..., T]")
    t = torch.arange(mask.shape[-1], device=mask.device)
    last = torch.where(mask, t, -1).amax(dim=-1, keepdim=True) if mask.shape[-1] else t
    return mask & (t == last)


def soft_overlong_penalty(response_mask: torch.Tensor, *, max_length: int, buffer: int,
                          factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment of each response, from its length ``L = Σ_t mask_t``:

    ``0`` for ``L ≤ L_max − L_buf``; ``factor·(L_max − L_buf − L)/L_buf`` (from 0 down to
    ``−factor``) for ``L_max − L_buf < L ≤ L_max``; ``−factor`` for ``L > L_max``. Added to the
    sequence score, it tells the policy that a response running into the budget is worse, before
    it is cut.

    Args:
        response_mask: ``[..., R]`` bool.
        max_length: ``L_max ≥ 1`` (the response budget).
        buffer: ``L_buf`` in ``[1, L_max]``, the length of the punished band.
        factor: ``≥ 0``, the penalty at ``L_max``.
    Returns:
        ``[...]`` float32, in ``[−factor, 0]``. Gradient: none (lengths are counts).

    >>> soft_overlong_penalty(torch.tensor([[True] * 2 + [False] * 2, [True] * 3 + [False], [True] * 4]),
    ...                       max_length=4, buffer=2)
    tensor([ 0.0000, -0.5000, -1.0000])

    Reference: Yu et al., "DAPO: An Open-Source LLM Reinforcement Learning System at Scale"
    (overlong reward shaping), https://arxiv.org/abs/2503.14476
    """
    check_mask("response_mask", response_mask)
    check_ndim("response_mask", response_mask, min_ndim=1, layout="[..., R]")
    for name, value, low in (("max_length", max_length, 1), ("buffer", buffer, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name}: expected an int >= {low}, got {value!r}")
    if buffer > max_length:
        raise ValueError(f"buffer: expected at most max_length={max_length}, got {buffer}")
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 <= factor < float("inf"):
        raise ValueError(f"factor: expected a finite float >= 0, got {factor!r}")
    length = response_mask.sum(-1).to(torch.float32)
    return ((max_length - buffer - length) / buffer).clamp(-1.0, 0.0) * factor


def compute_rewards(score: torch.Tensor, logprobs: torch.Tensor, ref_logprobs: torch.Tensor,
                    mask: torch.Tensor, *, kl_coef: float | torch.Tensor = 0.2, kl: str | torch.Tensor = "k1",
                    clamp: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token rewards ``r_t = −β·KL_t + 1[t = last valid]·score`` (0 outside the mask).

    ``KL_t = kl_estimate(logprobs, ref_logprobs, kl, clamp=clamp)`` on the sampled tokens. The
    score is added at the **last valid token** of each row (right padded, left padded or gapped
    masks alike). A row whose mask is empty gets all-zero rewards: its score has no token to
    sit on and is dropped. This is TRL's legacy PPO ``compute_rewards`` with ``kl_penalty`` in
    ``kl | abs | mse``; its ``full`` penalty is ``kl`` given as the tensor of exact per-token KLs
    (``rlcore.kl.kl_full`` of the two models' logits). TRL leaves ``−β·KL`` at padded positions
    (zeroed later by its GAE); ours is 0.

    Args:
        score: ``[...]`` float, one scalar per sequence (reward model or function).
        logprobs: ``[..., T]`` float, log-probs of the sampled tokens under the behaviour policy
            (``old_logprobs`` of a rollout).
        ref_logprobs: ``[..., T]`` float, the same under the reference policy.
        mask: ``[..., T]`` bool, True on response tokens.
        kl_coef: ``β ≥ 0``, finite: a float or a 0-d float tensor (e.g. ``KLControllerState.coef``);
            any other shape is refused (a ``[T]`` tensor would weigh each token differently). A
            tensor's value is read (one synchronisation) outside ``torch.compile``.
        kl: estimator name, see ``rlcore.kl.KL_ESTIMATORS`` (``k1`` as TRL and verl), or the
            per-token KL values themselves, ``[..., T]`` float (then ``clamp`` is not applied).
        clamp: optional bound ``> 0`` on the log-ratio before the estimator.
    Returns:
        ``rewards [..., T]`` and ``kl [..., T]`` (the per-token estimate, 0 outside the mask),
        both in the dtype of ``logprobs``.

    Raises:
        ValueError: ``kl_coef`` of another shape, negative or not finite; ``clamp`` not ``> 0``
            (``rlcore.kl``).

    Gradient: none; every input is detached (rewards are data for the policy gradient).

    >>> m = torch.tensor([[True, True, False]]); lp = torch.tensor([[-1.0, -1.0, -9.0]])
    >>> compute_rewards(torch.tensor([2.0]), lp, lp - 0.5, m, kl_coef=0.2)[0]
    tensor([[-0.1000,  1.9000,  0.0000]])

    References: Ziegler et al., https://arxiv.org/abs/1909.08593 (Eq. 2);
    Ouyang et al., https://arxiv.org/abs/2203.02155
    """
    check_float("logprobs", logprobs)
    check_ndim("logprobs", logprobs, min_ndim=1, layout="[..., T]")
    check_mask("mask", mask, like=logprobs, like_name="logprobs")
    check_float("score", score)
    if score.shape != logprobs.shape[:-1]:
        raise ValueError(f"score: expected shape {list(logprobs.shape[:-1])} (logprobs [..., T] "
                         f"without T), got {list(score.shape)}")
    check_scalar("kl_coef", kl_coef, read=True, low=0.0)
    if isinstance(kl, torch.Tensor):
        check_float("kl", kl)
        check_same_shape("logprobs", logprobs, kl=kl)
        per_token = kl.detach().to(logprobs.dtype)
    else:
        per_token = kl_estimate(logprobs.detach(), ref_logprobs.detach(), kl, clamp=clamp)
    coef = kl_coef.detach() if isinstance(kl_coef, torch.Tensor) else kl_coef
    placed = torch.where(last_token_mask(mask), score.detach().to(per_token.dtype)[..., None],
                         _zero(per_token))
    # float64, cast back saturating: a large β times a KL near the range's edge stays finite
    penalty = (wide(coef) if isinstance(coef, torch.Tensor) else coef) * wide(per_token)
    rewards = saturate(torch.where(mask, wide(placed) - penalty, 0.0), per_token.dtype)
    return rewards, torch.where(mask, per_token, _zero(per_token))


def process_scores(scores: torch.Tensor, moments: RunningMoments, *, scale: bool = False,
                   normalize: bool = False, clip: float | None = None, eps: float = 1e-8) -> torch.Tensor:
    """Scale, normalise and clip sequence scores with running statistics held in ``moments``.

    - ``normalize``: ``(score − μ)/(σ + eps)`` (takes precedence over ``scale``);
    - ``scale`` (alone): ``score/(σ + eps)``;
    - ``clip``: then ``clamp(score, −clip, clip)``.

    ``μ`` and ``σ`` (unbiased) come from ``moments``, which the **caller updates first** with
    this batch, ``moments = running_moments_update(moments, scores)``, then calls this
    function: TRL's legacy PPO step order (update, then use). While ``moments`` has seen fewer
    than two values, ``σ`` is taken as 1 (no spread known yet). TRL uses ``eps`` = machine
    epsilon of the score dtype and needs its ``use_score_scaling`` for ``use_score_norm`` to act;
    here ``eps`` is a parameter and each flag acts alone.

    Args:
        scores: ``[...]`` float (typically ``[B]``).
        moments: a ``RunningMoments`` state (see ``rlcore.transforms``).
        scale, normalize: booleans, as above.  clip: optional bound ``≥ 0``.  eps: added to ``σ``, ``≥ 0``.
    Returns:
        ``[...]``, dtype of ``scores`` (statistics are cast to it, as TRL).

    Gradient: flows to ``scores`` as written; the statistics are detached.

    >>> from rlcore.transforms import running_moments_init, running_moments_update
    >>> s = torch.tensor([1.0, 3.0]); mom = running_moments_update(running_moments_init(), s)
    >>> process_scores(s, mom, normalize=True, clip=0.5)
    tensor([-0.5000,  0.5000])

    References: Ziegler et al., https://arxiv.org/abs/1909.08593 (reward normalisation)
    """
    check_float("scores", scores)
    if clip is not None:
        check_number("clip", clip, low=0.0, allow_inf=True)  # a negative bound empties the range
    check_number("eps", eps, low=0.0)
    std = running_moments_std(moments).detach()
    std = torch.where(moments.count > 1, std, torch.ones_like(std)).to(scores.dtype)
    mean = moments.mean.detach().to(scores.dtype)
    if normalize:  # in float64, cast back saturating: a score near the range's edge stays finite
        scores = saturate((wide(scores) - wide(mean)) / (wide(std) + eps), scores.dtype)
    elif scale:
        scores = saturate(wide(scores) / (wide(std) + eps), scores.dtype)
    return scores if clip is None else scores.clamp(-clip, clip)


def with_rewards(batch: TensorDictBase, *, kl_coef: float | torch.Tensor = 0.2, kl: str = "k1",
                 clamp: float | None = None) -> TensorDictBase:
    """Add per-token ``rewards`` and ``kl`` ``[B, R]`` to a scored rollout (a shallow copy).

    Reads ``score [B]``, ``old_logprobs [B, R]`` (the behaviour policy that sampled: at scoring
    time it is the policy whose KL to the reference is penalised), ``ref_logprobs [B, R]`` and
    ``response_mask [B, R]``; see :func:`compute_rewards`. ``kl="full"`` penalises the exact
    KL over the vocabulary recorded in ``full_kl [B, R]`` (``loops.score.full_kl_from_models``).
    """
    check_leaves(batch, where="with_rewards" if kl != "full" else "with_rewards(kl='full')",
                 mask=K.RESPONSE_MASK, tokens=[K.OLD_LOGPROBS, K.REF_LOGPROBS] + ([K.FULL_KL] if kl == "full" else []),
                 sequences=[K.SCORE])
    rewards, per_token = compute_rewards(batch[K.SCORE], batch[K.OLD_LOGPROBS], batch[K.REF_LOGPROBS],
                                         batch[K.RESPONSE_MASK], kl_coef=kl_coef,
                                         kl=batch[K.FULL_KL] if kl == "full" else kl, clamp=clamp)
    return batch.copy().update({K.REWARDS: rewards, K.KL: per_token})
