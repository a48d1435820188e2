"""Outcome advantage estimators with baselines: RLOO, GRPO (and Dr. GRPO), REINFORCE++, ReMax.

Groups (the samples drawn for one prompt) come in one of two forms, and every estimator takes both:

- a grouped view: ``scores [..., G]``, the last dimension holds the ``G`` samples of one prompt;
- flat scores ``[B]`` with ``group_id [B]`` long: any integer labels, in any order, groups of any
  sizes. Segment statistics use a sort (to relabel ids densely) and ``index_add`` (static shapes,
  no Python loop over samples or groups, no ``.item()``); the grouped view is the faster path. On
  CUDA, ``index_add`` sums with atomics: turn on ``torch.use_deterministic_algorithms`` for
  bitwise-reproducible results.

Singleton groups (``G = 1``, or a label that appears once) get advantage 0 from RLOO and GRPO: no
baseline can be formed from the other samples. Peers differ here: TRL's GRPO gives 0 as well,
verl gives the raw score (mean 0, std 1 for a singleton), TRL's RLOO divides by zero.

Sequence-level advantages are ``[B]`` (or ``[..., G]``); :func:`broadcast_to_tokens` spreads them
over the response tokens. All outputs are detached: advantages are targets, not graph nodes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from tensordict import TensorDictBase

from rlcore import keys as K
from rlcore.checks import check_float, check_leaves, check_mask, check_ndim, check_same_shape, lookup
from rlcore.masked import masked_sum, masked_whiten, saturate, wide
from rlcore.returns import _check_gamma_lam, discounted_returns, with_gae

__all__ = [
    "rloo_advantage",
    "grpo_advantage",
    "dr_grpo_advantage",
    "GRPO_SCALES",
    "reinforce_pp_advantage",
    "reinforce_pp_baseline_advantage",
    "remax_advantage",
    "broadcast_to_tokens",
    "group_mean",
    "with_rloo_advantage",
    "with_grpo_advantage",
    "with_dr_grpo_advantage",
    "with_reinforce_pp_advantage",
    "with_remax_advantage",
    "opo_advantage",
    "with_opo_advantage",
    "ADVANTAGE_ESTIMATORS",
]


# --- group statistics ------------------------------------------------------------------------
def _dense_ids(group_id: torch.Tensor) -> torch.Tensor:
    """Relabel arbitrary group ids ``[B]`` to ``0 … n_groups − 1`` (< B) with static shapes."""
    sorted_ids, order = torch.sort(group_id)
    starts = torch.cat([torch.ones_like(sorted_ids[:1], dtype=torch.bool), sorted_ids[1:] != sorted_ids[:-1]])
    return torch.empty_like(group_id, dtype=torch.long).scatter(0, order, starts.cumsum(0) - 1)


def _grouping(scores: torch.Tensor, group_id: torch.Tensor | None
              ) -> tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor]:
    """``(group_sum, count)``: ``group_sum(x)`` gives each element the sum of ``x`` over its group
    (broadcastable to ``scores``: ``[..., 1]`` in the grouped view, so arithmetic on it stays per
    group); ``count`` is the group size, broadcastable to ``scores``."""
    if group_id is None:
        check_ndim("scores", scores, min_ndim=1, layout="[..., G]")
        count = torch.tensor(scores.shape[-1], dtype=scores.dtype, device=scores.device)
        return (lambda x: x.sum(-1, keepdim=True)), count
    check_ndim("scores", scores, ndim=1, layout="[B] (flat scores with group_id)")
    check_ndim("group_id", group_id, ndim=1, layout="[B]")
    check_same_shape("scores", scores, group_id=group_id)
    if group_id.is_floating_point() or group_id.dtype == torch.bool:
        raise TypeError(f"group_id: expected an integer tensor, got dtype {group_id.dtype}")
    ids = _dense_ids(group_id)

    def group_sum(x: torch.Tensor) -> torch.Tensor:  # segment sum, gathered back to each element
        return torch.zeros_like(x).index_add(0, ids, x).index_select(0, ids)

    return group_sum, group_sum(torch.ones_like(scores))


def _centre(scores: torch.Tensor, group_id: torch.Tensor | None
            ) -> tuple[torch.Tensor, torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """``(r − μ_g, count, group_sum)`` for each element of ``scores``."""
    group_sum, count = _grouping(scores, group_id)
    return scores - group_sum(scores) / count, count, group_sum


def _scores(scores: torch.Tensor) -> torch.Tensor:
    """Scores for the group statistics, in float64 (``rlcore.masked.wide``): sums and squares of
    scores anywhere in float32's or bfloat16's range stay finite."""
    check_float("scores", scores)
    return wide(scores.detach())


def group_mean(scores: torch.Tensor, *, group_id: torch.Tensor | None = None) -> torch.Tensor:
    """Mean score of each element's group, shaped like ``scores``.

    Args:
        scores: ``[..., G]`` float (grouped view) or ``[B]`` with ``group_id``.
        group_id: ``[B]`` integer labels, or ``None`` for the grouped view.
    Returns:
        ``[..., G]`` or ``[B]``; detached.

    >>> group_mean(torch.tensor([1.0, 2.0, 5.0]), group_id=torch.tensor([7, 3, 7]))
    tensor([3., 2., 3.])
    """
    s = _scores(scores)
    group_sum, count = _grouping(s, group_id)
    return saturate((group_sum(s) / count).expand_as(s).contiguous(), scores.dtype)


# --- RLOO ------------------------------------------------------------------------------------
def rloo_advantage(scores: torch.Tensor, *, group_id: torch.Tensor | None = None) -> torch.Tensor:
    """REINFORCE leave-one-out: ``A_i = r_i − mean_{j≠i} r_j = G/(G−1)·(r_i − mean_j r_j)``.

    Args:
        scores: ``[..., G]`` float (grouped view) or ``[B]`` float with ``group_id``.
        group_id: ``[B]`` integer labels of the prompt of each sample, or ``None``.
    Returns:
        ``[..., G]`` / ``[B]``, detached. Sums to 0 over each group; 0 for singleton groups.

    >>> rloo_advantage(torch.tensor([[1.0, 2.0, 6.0]]))
    tensor([[-3.0000, -1.5000,  4.5000]])

    References:
        Ahmadian et al., "Back to Basics: Revisiting REINFORCE Style Optimization for Learning
        from Human Feedback in LLMs", https://arxiv.org/abs/2402.14740
    """
    centred, count, _ = _centre(_scores(scores), group_id)
    return saturate(centred * (count / (count - 1).clamp(min=1)), scores.dtype)


# --- GRPO ------------------------------------------------------------------------------------
def _divide(centred: torch.Tensor, var: torch.Tensor, eps: float) -> torch.Tensor:
    # σ + eps = 0 only when var = 0, and then every centred score is 0: keep it 0, not 0/0.
    sd = var.sqrt() + eps
    return centred / torch.where(sd > 0, sd, torch.ones((), dtype=sd.dtype, device=sd.device))


def _scale_group(scores: torch.Tensor, centred: torch.Tensor, count: torch.Tensor, group_sum: Callable,
                 eps: float) -> torch.Tensor:
    var = group_sum(centred.square()) / (count - 1).clamp(min=1)  # unbiased; 0 for a singleton
    return _divide(centred, var, eps)


def _scale_batch(scores: torch.Tensor, centred: torch.Tensor, count: torch.Tensor, group_sum: Callable,
                 eps: float) -> torch.Tensor:
    var = (scores - scores.mean()).square().sum() / max(scores.numel() - 1, 1)  # unbiased, all scores
    return _divide(centred, var, eps)


def _scale_none(scores: torch.Tensor, centred: torch.Tensor, count: torch.Tensor, group_sum: Callable,
                eps: float) -> torch.Tensor:
    return centred


# (scores, centred scores, group sizes, group-sum function, eps) -> advantages
GRPO_SCALES: dict[str, Callable[..., torch.Tensor]] = {
    "group": _scale_group,  # σ of the prompt's group (GRPO)
    "batch": _scale_batch,  # σ over the whole batch (Understanding R1-Zero; TRL scale_rewards="batch")
    "none": _scale_none,    # no division (Dr. GRPO)
}


def grpo_advantage(scores: torch.Tensor, *, group_id: torch.Tensor | None = None, scale: str = "group",
                   eps: float = 1e-6) -> torch.Tensor:
    """Group-relative advantage: ``A_i = (r_i − μ_g)/(σ + eps)``.

    ``μ_g`` is the mean score of the sample's group; ``σ`` is the unbiased standard deviation of
    the group (``scale="group"``), of the whole batch (``"batch"``), or no division at all
    (``"none"``, Dr. GRPO). ``eps`` is added to ``σ``, not to the variance (verl's 1e-6; TRL uses
    1e-4). A group whose scores are all equal, and any singleton group, gets 0.

    Args:
        scores: ``[..., G]`` float (grouped view) or ``[B]`` float with ``group_id``.
        group_id: ``[B]`` integer labels, or ``None`` for the grouped view.
        scale: ``"group"`` | ``"batch"`` | ``"none"`` (see ``GRPO_SCALES``).
        eps: added to ``σ``, finite and ``≥ 0`` (a negative one could divide by zero).
    Returns:
        ``[..., G]`` / ``[B]``, detached.

    >>> grpo_advantage(torch.tensor([[1.0, 3.0]]), eps=0.0)
    tensor([[-0.7071,  0.7071]])

    References:
        Shao et al., "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language
        Models", https://arxiv.org/abs/2402.03300; Liu et al., "Understanding R1-Zero-Like
        Training: A Critical Perspective" (Dr. GRPO), https://arxiv.org/abs/2503.20783
    """
    rescale = lookup(GRPO_SCALES, scale, what="scale")
    if not (isinstance(eps, (int, float)) and 0 <= eps < float("inf")):
        raise ValueError(f"eps: expected a finite number >= 0 (added to σ), got {eps!r}")
    s = _scores(scores)
    centred, count, group_sum = _centre(s, group_id)
    return saturate(rescale(s, centred, count, group_sum, eps), scores.dtype)


dr_grpo_advantage = functools.partial(grpo_advantage, scale="none")
dr_grpo_advantage.__doc__ = """Dr. GRPO: ``A_i = r_i − μ_g``, GRPO without the division by ``σ``.

``functools.partial(grpo_advantage, scale="none")``; see :func:`grpo_advantage`.

References:
    Liu et al., "Understanding R1-Zero-Like Training: A Critical Perspective",
    https://arxiv.org/abs/2503.20783
"""


# --- OPO ---------------------------------------------------------------------------------------
def opo_advantage(scores: torch.Tensor, lengths: torch.Tensor, *,
                  group_id: torch.Tensor | None = None) -> torch.Tensor:
    """Optimal-baseline advantage: ``A_i = r_i − b_g`` with the length-weighted group mean
    ``b_g = Σ_{j∈g} l_j·r_j / Σ_{j∈g} l_j``.

    With a sequence's policy-gradient norm growing with its length ``l``, ``b_g`` is the baseline
    of least variance (OPO). A group whose lengths sum to 0 takes the plain mean; a singleton's
    baseline is its own score, so its advantage is 0 (verl's ``opo`` estimator uses ``b = 0``
    for singletons instead).

    Args:
        scores: ``[..., G]`` float (grouped view) or ``[B]`` float with ``group_id``.
        lengths: ``l ≥ 0``, the response lengths in tokens, shaped like ``scores``.
        group_id: ``[B]`` integer labels, or ``None`` for the grouped view.
    Returns:
        ``[..., G]`` / ``[B]``, detached. ``Σ_j l_j·A_j = 0`` over each group.

    >>> opo_advantage(torch.tensor([[1.0, 0.0]]), torch.tensor([[3.0, 1.0]]))
    tensor([[ 0.2500, -0.7500]])

    References:
        Hao et al., "On-Policy RL with Optimal Reward Baseline", https://arxiv.org/abs/2505.23585
    """
    s = _scores(scores)
    check_same_shape("scores", scores, lengths=lengths)
    l = lengths.detach().to(s.dtype)  # noqa: E741 -- the paper's l
    group_sum, count = _grouping(s, group_id)
    total = group_sum(l)
    weighted = group_sum(l * s) / torch.where(total > 0, total, torch.ones_like(total))
    return saturate(s - torch.where(total > 0, weighted, group_sum(s) / count), scores.dtype)


# --- token-level estimators ------------------------------------------------------------------
def broadcast_to_tokens(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Spread a sequence-level value over its valid tokens: ``out[..., t] = A[...]·[mask_t]``.

    Args:
        advantages: ``[...]`` float, one value per sequence (``[B]``).
        mask: ``[..., T]`` bool.
    Returns:
        ``[..., T]``, 0 where the mask is False (an empty row is all 0).

    >>> broadcast_to_tokens(torch.tensor([2.0, -1.0]), torch.tensor([[True, False], [True, True]]))
    tensor([[ 2.,  0.],
            [-1., -1.]])
    """
    check_float("advantages", advantages)
    check_mask("mask", mask)
    if mask.ndim == 0 or mask.shape[:-1] != advantages.shape:
        raise ValueError(f"mask: expected shape [{', '.join(map(str, advantages.shape))}, T] (the shape "
                         f"of advantages plus a time dim), got [{', '.join(map(str, mask.shape))}]")
    return torch.where(mask, advantages[..., None], torch.zeros((), dtype=advantages.dtype,
                                                                device=advantages.device))


def reinforce_pp_advantage(rewards: torch.Tensor, mask: torch.Tensor, *, gamma: float = 1.0,
                           group_id: torch.Tensor | None = None, group_baseline: bool = False,
                           eps: float = 1e-8) -> torch.Tensor:
    """REINFORCE++: discounted token returns, whitened over every valid token of the batch.

    ``G_t = Σ_{s≥t valid} γ^{n_s − n_t} r_s`` (:func:`rlcore.returns.discounted_returns`), then
    ``A = (G − μ)/sqrt(σ² + eps)`` with ``μ, σ²`` (unbiased) over all valid tokens.
    With ``group_baseline=True`` (REINFORCE++-baseline) the group mean ``b_i`` of the sequence
    scores ``s_j = Σ_t m·r_t`` is subtracted first: ``A = whiten(G_t − b_i)``. When the reward
    sits on the last token and ``γ = 1`` (``G_t = s_i`` for every token) this is verl's
    ``whiten(broadcast(s_i − b_i))``; with per-token rewards (a KL penalty folded in) each token
    keeps its own return-to-go, as OpenRLHF's ``reinforce_baseline`` does.

    Args:
        rewards: ``[..., T]`` float per-token rewards (``[..., G, T]`` for a grouped baseline
            without ``group_id``).
        mask: ``[..., T]`` bool.
        gamma: discount.  eps: added to the variance in the whitening.
        group_id: ``[B]`` labels (rewards ``[B, T]``), used only with ``group_baseline``.
        group_baseline: subtract the group mean of the sequence scores.
    Returns:
        ``[..., T]``, detached, 0 where the mask is False.

    References:
        Hu, "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language Models",
        https://arxiv.org/abs/2501.03262
    """
    check_float("rewards", rewards)
    r = wide(rewards.detach())  # float64: returns and statistics of rewards near the range's edge stay finite
    returns = discounted_returns(r, mask, gamma=gamma)
    if group_baseline:
        check_ndim("rewards", rewards, min_ndim=2, layout="[..., G, T] or [B, T] with group_id")
        returns = returns - group_mean(masked_sum(r, mask, dim=-1), group_id=group_id)[..., None]
    return saturate(masked_whiten(returns, mask, eps=eps), rewards.dtype)


reinforce_pp_baseline_advantage = functools.partial(reinforce_pp_advantage, group_baseline=True)
reinforce_pp_baseline_advantage.__doc__ = """REINFORCE++-baseline: ``whiten(G_t − mean_group(s))``.

``functools.partial(reinforce_pp_advantage, group_baseline=True)``; see
:func:`reinforce_pp_advantage`.
"""


def remax_advantage(rewards: torch.Tensor, baseline_scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """ReMax: reward-to-go minus the greedy rollout's score, ``A_t = Σ_{s≥t valid} r_s − b``.

    Args:
        rewards: ``[..., T]`` float per-token rewards of the sampled response.
        baseline_scores: ``[...]`` float, the score ``b`` of the greedy response to the same prompt.
        mask: ``[..., T]`` bool.
    Returns:
        ``[..., T]``, detached, 0 where the mask is False.

    >>> remax_advantage(torch.tensor([[0.0, 1.0]]), torch.tensor([0.25]), torch.tensor([[True, True]]))
    tensor([[0.7500, 0.7500]])

    References:
        Li et al., "ReMax: A Simple, Effective, and Efficient Reinforcement Learning Method for
        Aligning Large Language Models", https://arxiv.org/abs/2310.10505
    """
    check_float("baseline_scores", baseline_scores)
    if baseline_scores.shape != rewards.shape[:-1]:
        raise ValueError(f"baseline_scores: expected shape [{', '.join(map(str, rewards.shape[:-1]))}] (the shape "
                         f"of rewards without its time dim), got [{', '.join(map(str, baseline_scores.shape))}]")
    returns = discounted_returns(wide(rewards), mask, gamma=1.0)  # float64, cast back saturating
    return saturate(returns - broadcast_to_tokens(wide(baseline_scores.detach()), mask), rewards.dtype)


# --- TensorDict adapters ---------------------------------------------------------------------
def _sequence_scores(batch: TensorDictBase, where: str) -> torch.Tensor:
    """Masked sum of ``rewards`` over ``response_mask`` when present (KL folded in), else ``score``."""
    if K.REWARDS in batch.keys():
        check_leaves(batch, where=where, mask=K.RESPONSE_MASK, tokens=[K.REWARDS])
        return masked_sum(batch.get(K.REWARDS), batch.get(K.RESPONSE_MASK), dim=-1)
    check_leaves(batch, where=where, mask=K.RESPONSE_MASK, sequences=[K.SCORE])
    return batch.get(K.SCORE)


def _grouped(fn: Callable[..., torch.Tensor], xs: tuple[torch.Tensor, ...], batch: TensorDictBase,
             group_size: int | None, where: str, **hyper) -> torch.Tensor:
    """``fn(*xs, **hyper)`` with groups from ``group_size`` (consecutive rows), else ``group_id``,
    else the last batch dim of a ``[P, G]`` batch. Each of ``xs`` is ``[B, ...]``."""
    nd = batch.batch_dims
    if group_size is not None:
        B = batch.batch_size[-1] if nd else 0
        if not nd or group_size < 1 or B % group_size:
            raise ValueError(f"group_size: expected a positive divisor of the batch size {B}, "
                             f"got {group_size}")
        out = fn(*(x.unflatten(nd - 1, (B // group_size, group_size)) for x in xs), **hyper)
        return out.flatten(nd - 1, nd)
    if K.GROUP_ID in batch.keys():
        return fn(*xs, group_id=batch.get(K.GROUP_ID), **hyper)
    if nd >= 2:
        return fn(*xs, **hyper)
    raise KeyError(f"{where}: batch has no {K.GROUP_ID!r} [B]; pass group_size=G (consecutive rows form "
                   f"groups) or a [P, G] batch")


def _with_outcome(fn: Callable[..., torch.Tensor], batch: TensorDictBase, group_size: int | None,
                  where: str, **hyper) -> TensorDictBase:
    scores = _sequence_scores(batch, where)
    adv = broadcast_to_tokens(_grouped(fn, (scores,), batch, group_size, where, **hyper),
                              batch.get(K.RESPONSE_MASK))
    return batch.copy().update({K.ADVANTAGES: adv, K.RETURNS: adv.clone()})


def with_rloo_advantage(batch: TensorDictBase, *, group_size: int | None = None) -> TensorDictBase:
    """Add ``advantages`` = ``returns`` ``[B, R]``: :func:`rloo_advantage` of the sequence scores.

    ``s_i = Σ_t m·r_t`` (masked sum of ``rewards``) when ``rewards`` is present, so a KL penalty
    folded into per-token rewards counts (as TRL's RLOO); else ``s_i = score_i``. Then
    ``A_i = s_i − mean_{j≠i} s_j`` spread over the valid tokens; ``returns`` equals it (no critic).

    Args:
        batch: TensorDict ``[B]`` (or ``[P, G]``) with ``response_mask`` ``[B, R]`` bool and
            ``rewards`` ``[B, R]`` or ``score`` ``[B]`` float; ``group_id`` ``[B]`` long unless
            ``group_size`` is given or the batch is ``[P, G]``.
        group_size: ``G``: consecutive rows ``g·G … g·G + G − 1`` form a group.
    Returns:
        A shallow copy of ``batch`` with ``advantages`` and ``returns`` ``[B, R]``, 0 where the
        mask is False; ``batch`` itself is not modified. Detached.
    """
    return _with_outcome(rloo_advantage, batch, group_size, "with_rloo_advantage")


def with_grpo_advantage(batch: TensorDictBase, *, scale: str = "group", eps: float = 1e-6,
                        group_size: int | None = None) -> TensorDictBase:
    """Add ``advantages`` = ``returns`` ``[B, R]``: :func:`grpo_advantage` of the sequence scores.

    ``A_i = (s_i − μ_g)/(σ + eps)`` spread over the valid tokens. Args and Returns as in
    :func:`with_rloo_advantage`, plus ``scale`` and ``eps`` of :func:`grpo_advantage`.
    """
    return _with_outcome(grpo_advantage, batch, group_size, "with_grpo_advantage", scale=scale, eps=eps)


def with_dr_grpo_advantage(batch: TensorDictBase, *, group_size: int | None = None) -> TensorDictBase:
    """Add ``advantages`` = ``returns`` ``[B, R]``: Dr. GRPO, ``A_i = s_i − μ_g`` over the tokens.

    Args and Returns as in :func:`with_rloo_advantage`.
    """
    return _with_outcome(grpo_advantage, batch, group_size, "with_dr_grpo_advantage", scale="none")


def with_opo_advantage(batch: TensorDictBase, *, group_size: int | None = None) -> TensorDictBase:
    """Add ``advantages`` = ``returns`` ``[B, R]``: :func:`opo_advantage` of the sequence scores,
    weighted by the response lengths ``Σ_t response_mask``. Args and Returns as in
    :func:`with_rloo_advantage`."""
    where = "with_opo_advantage"
    scores = _sequence_scores(batch, where)
    mask = batch.get(K.RESPONSE_MASK)
    lengths = mask.sum(-1).to(scores.dtype)
    adv = broadcast_to_tokens(_grouped(opo_advantage, (scores, lengths), batch, group_size, where), mask)
    return batch.copy().update({K.ADVANTAGES: adv, K.RETURNS: adv.clone()})


def with_reinforce_pp_advantage(batch: TensorDictBase, *, gamma: float = 1.0, group_baseline: bool = False,
                                eps: float = 1e-8, group_size: int | None = None) -> TensorDictBase:
    """Add REINFORCE++ ``advantages`` and the discounted reward-to-go as ``returns``, ``[B, R]``.

    ``advantages = whiten(G_t [− b_i])`` (:func:`reinforce_pp_advantage`), ``returns = G_t``.

    Args:
        batch: TensorDict ``[B]`` with ``rewards`` ``[B, R]`` float and ``response_mask``
            ``[B, R]`` bool; with ``group_baseline``, groups as in :func:`with_rloo_advantage`.
        gamma, group_baseline, eps: as in :func:`reinforce_pp_advantage`.
        group_size: consecutive rows form groups (``group_baseline`` only).
    Returns:
        A shallow copy of ``batch`` with ``advantages`` and ``returns`` ``[B, R]``, 0 where the
        mask is False; ``batch`` itself is not modified. Detached.
    """
    where = "with_reinforce_pp_advantage"
    check_leaves(batch, where=where, mask=K.RESPONSE_MASK, tokens=[K.REWARDS])
    _check_gamma_lam(gamma, 0.0)
    rewards, mask = batch.get(K.REWARDS), batch.get(K.RESPONSE_MASK)
    if group_baseline:
        adv = _grouped(reinforce_pp_baseline_advantage, (rewards, mask), batch, group_size, where,
                       gamma=gamma, eps=eps)
    else:
        adv = reinforce_pp_advantage(rewards, mask, gamma=gamma, eps=eps)
    return batch.copy().update({K.ADVANTAGES: adv, K.RETURNS: discounted_returns(rewards, mask, gamma=gamma)})


def with_remax_advantage(batch: TensorDictBase) -> TensorDictBase:
    """Add ReMax ``advantages`` and the reward-to-go as ``returns``, both ``[B, R]``.

    ``advantages_t = Σ_{s≥t} r_s − b`` (:func:`remax_advantage`), ``returns_t = Σ_{s≥t} r_s``.

    Args:
        batch: TensorDict ``[B]`` with ``rewards`` ``[B, R]`` float, ``baseline_score`` ``[B]``
            float (the greedy response's score) and ``response_mask`` ``[B, R]`` bool.
    Returns:
        A shallow copy of ``batch`` with ``advantages`` and ``returns`` ``[B, R]``, 0 where the
        mask is False; ``batch`` itself is not modified. Detached.
    """
    check_leaves(batch, where="with_remax_advantage", mask=K.RESPONSE_MASK, tokens=[K.REWARDS],
                 sequences=[K.BASELINE_SCORE])
    rewards, mask = batch.get(K.REWARDS), batch.get(K.RESPONSE_MASK)
    adv = remax_advantage(rewards, batch.get(K.BASELINE_SCORE), mask)
    return batch.copy().update({K.ADVANTAGES: adv, K.RETURNS: discounted_returns(rewards, mask)})


# --- the registry ------------------------------------------------------------------------------
# The advantage estimators a recipe selects by name (``advantage:`` in a config, with keywords in
# ``advantage_kwargs``): ``(batch, **hyper) -> batch`` adding ``advantages`` and ``returns``
# ``[B, R]``. A new estimator is a function in this module and one line here; no loop changes.
ADVANTAGE_ESTIMATORS: dict[str, Callable[..., TensorDictBase]] = {
    "gae": with_gae,                          # rlcore.returns: needs values (a critic)
    "rloo": with_rloo_advantage,
    "grpo": with_grpo_advantage,
    "dr_grpo": with_dr_grpo_advantage,
    "opo": with_opo_advantage,                # response-length-weighted group baseline
    "reinforce_pp": with_reinforce_pp_advantage,  # needs token rewards (KL in the reward: RLOO)
    "remax": with_remax_advantage,            # needs baseline_score (a greedy rollout's score)
}
