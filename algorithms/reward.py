"""Reward modelling from pairwise preferences: the Bradley–Terry loss.

A reward model scores each completion with one scalar ``r``; under Bradley–Terry the chosen one
wins with probability ``σ(r_w − r_l)``, and the loss is its negative log-likelihood. An optional
margin ``m`` asks for ``r_w − r_l > m`` (Llama 2), and a centring term ``c·mean((r_w + r_l)²)``
keeps rewards near zero (a reward model's offset is otherwise free).
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from tensordict import TensorDict, TensorDictBase

from rlcore import keys as K
from rlcore.checks import check_float, check_same_shape, require_keys
from rlcore.masked import saturate, wide, wide_mean, wide_sum

__all__ = ["bradley_terry_loss", "reward_loss"]

Tensor = torch.Tensor


def bradley_terry_loss(chosen_rewards: Tensor, rejected_rewards: Tensor, *,
                       margin: Tensor | float | None = None) -> Tensor:
    """Pairwise Bradley–Terry loss: ``−logσ(r_w − r_l − m)`` (``m = 0`` without a margin).

    Args:
        chosen_rewards, rejected_rewards: ``[B]`` float, scalar rewards of each completion.
        margin: ``[B]`` float or a scalar, the required reward gap (``None`` = 0).
    Returns:
        ``[B]`` unreduced losses, differentiable in both rewards.

    >>> bradley_terry_loss(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 0.0]))
    tensor([0.3133, 0.6931])

    References:
        Bradley & Terry, "Rank Analysis of Incomplete Block Designs" (1952); Ouyang et al.,
        "Training language models to follow instructions with human feedback",
        https://arxiv.org/abs/2203.02155; Touvron et al., "Llama 2" (margin),
        https://arxiv.org/abs/2307.09288.
    """
    check_float("chosen_rewards", chosen_rewards)
    check_float("rejected_rewards", rejected_rewards)
    check_same_shape("chosen_rewards", chosen_rewards, rejected_rewards=rejected_rewards,
                     margin=margin if isinstance(margin, Tensor) else None)
    diff = wide(chosen_rewards) - wide(rejected_rewards)  # float64, cast back saturating
    if margin is not None:
        diff = diff - (wide(margin) if isinstance(margin, Tensor) else margin)
    return saturate(-F.logsigmoid(diff), chosen_rewards.dtype)


def reward_loss(batch: TensorDictBase, *, margin_key=None,
                center_rewards_coefficient: float | None = None) -> tuple[Tensor, TensorDict]:
    """Reward-model loss of a preference batch: ``mean_b BT_b`` (+ ``c·mean_b (r_w + r_l)²``).

    Reads ``(chosen, reward)`` and ``(rejected, reward)`` ``[B]`` float (the model's scalar
    outputs, differentiable) and, when ``margin_key`` is given, ``batch[margin_key] [B]`` float.

    Args:
        batch: preference TensorDict ``[B]``.
        margin_key: key of a per-pair margin (e.g. from preference strength), or ``None``.
        center_rewards_coefficient: ``c`` of the centring term; ``None`` leaves it out.
    Returns:
        ``(loss [], metrics)``: ``loss_bt`` (+ ``loss_center``), summing to the loss;
        ``accuracy`` (fraction with ``r_w > r_l``), ``margin`` (mean ``r_w − r_l``),
        ``rewards/chosen``, ``rewards/rejected`` (means). All detached.

    >>> one = lambda r: {"reward": torch.tensor([r])}
    >>> b = TensorDict({"chosen": one(1.0), "rejected": one(0.0)}, batch_size=[1])
    >>> reward_loss(b)[0]
    tensor(0.3133)

    References:
        Ouyang et al., https://arxiv.org/abs/2203.02155; Eisenstein et al., "Helping or Herding?
        Reward Model Ensembles Mitigate but do not Eliminate Reward Hacking" (centring),
        https://arxiv.org/abs/2312.09244.
    """
    keys = [(K.CHOSEN, K.REWARD), (K.REJECTED, K.REWARD)] + ([margin_key] if margin_key is not None else [])
    require_keys(batch, keys, where="reward_loss", layouts=dict.fromkeys(keys, "[B] float"))
    rw, rl = batch.get(keys[0]), batch.get(keys[1])
    margin = batch.get(margin_key) if margin_key is not None else None
    parts = {"loss_bt": wide_mean(bradley_terry_loss(rw, rl, margin=margin))}
    if center_rewards_coefficient is not None:
        parts["loss_center"] = saturate(center_rewards_coefficient * (wide(rw) + wide(rl)).square().mean(), rw.dtype)
    dw, dl = rw.detach(), rl.detach()
    metrics = {k: v.detach() for k, v in parts.items()} | {
        "accuracy": (dw > dl).to(dw.dtype).mean(), "margin": saturate((wide(dw) - wide(dl)).mean(), dw.dtype),
        "rewards/chosen": wide_mean(dw), "rewards/rejected": wide_mean(dl)}
    return wide_sum(parts), TensorDict(metrics, batch_size=[])
