"""Direct preference optimisation (DPO): the loss of a batch of pairs and its pieces.

``dpo_loss`` (per-pair losses of a variant of ``algorithms.dpo_variants.DPO_LOSSES`` and the
implicit rewards ``β(log π − log π_ref)``), ``chosen_nll`` (RPO's NLL term), ``preference_metrics``,
``completion_lengths`` and ``dpo(batch)``, the TensorDict loss the DPO recipe trains with.

Where the peers differ: the NLL term (RPO here, CPO and ORPO in ``preference``) is the token mean
over all chosen completion tokens of the batch, ``−Σ lp_w / Σ n_w`` (TRL's cross-entropy), not the
mean of per-sequence means; the two agree when completions have equal lengths.
"""

from __future__ import annotations

from typing import cast

import torch
from tensordict import TensorDict, TensorDictBase

from rlcore import keys as K
from rlcore.algorithms.dpo_variants import DPO_LOSSES
from rlcore.checks import (check_float, check_leaves, check_mask, check_ndim, check_number, check_same_shape, lookup,
                           require_keys)
from rlcore.masked import saturate, wide, wide_mean, wide_sum

__all__ = ["dpo_loss", "dpo", "chosen_nll", "preference_metrics", "completion_lengths"]

Tensor = torch.Tensor


def dpo_loss(chosen_logps: Tensor, rejected_logps: Tensor, ref_chosen_logps: Tensor | None,
             ref_rejected_logps: Tensor | None, *, beta: float = 0.1, loss_type: str = "sigmoid",
             label_smoothing: float = 0.0, reference_free: bool = False, divergence: str = "reverse_kl",
             alpha: float = 0.5, chosen_lengths: Tensor | None = None,
             rejected_lengths: Tensor | None = None,
             discopop_tau: float = 0.05) -> tuple[Tensor, Tensor, Tensor]:
    """Per-pair DPO-family losses and the implicit rewards ``β·(log π − log π_ref)``.

    ``losses = DPO_LOSSES[loss_type](...)``; with the default ``sigmoid``,
    ``ℓ = −(1−ε)·logσ(β(ρ_w − ρ_l)) − ε·logσ(−β(ρ_w − ρ_l))``. The formulas of every variant and
    the choices made where the peers differ are in this module's docstring.

    Args:
        chosen_logps, rejected_logps: ``[B]`` float, summed completion log-probs (differentiable).
        ref_chosen_logps, ref_rejected_logps: ``[B]`` float, under the reference; may be ``None``
            when ``reference_free``.
        beta: ``β > 0``, the inverse temperature (strength of the implicit KL constraint); ``β ≤ 0``
            or NaN is refused (``ValueError``), as every hyper-parameter out of its range.
        loss_type: a key of ``DPO_LOSSES``.
        label_smoothing: ``ε`` (cDPO for sigmoid; robust, exo_pair, aot*).
        reference_free: use ``π_ref ≡ 1`` (reference log-probs 0) in the losses and the rewards.
        divergence, alpha: f-divergence of the scores (``F_DIVERGENCES``) and the ``α`` of ``alpha``.
        chosen_lengths, rejected_lengths: ``[B]`` completion lengths, for ipo and sigmoid_norm.
        discopop_tau: ``τ`` of discopop.
    Returns:
        ``(losses [B], chosen_rewards [B], rejected_rewards [B])``; rewards are ``β·ρ`` detached.

    >>> lw, ll = torch.tensor([-5.0]), torch.tensor([-7.0])
    >>> dpo_loss(lw, ll, torch.tensor([-6.0]), torch.tensor([-6.0]), beta=0.5)
    (tensor([0.3133]), tensor([0.5000]), tensor([-0.5000]))

    Gradient: flows into ``chosen_logps`` / ``rejected_logps`` only; reference log-probs are
    detached, and so are the rewards.

    References:
        Rafailov et al., "Direct Preference Optimization: Your Language Model is Secretly a Reward
        Model", https://arxiv.org/abs/2305.18290; the variants' papers are cited on each kernel.
    """
    fn = lookup(DPO_LOSSES, loss_type, what="loss_type")
    if reference_free:
        check_float("chosen_logps", chosen_logps)
        ref_chosen_logps = torch.zeros_like(chosen_logps)
        ref_rejected_logps = torch.zeros_like(chosen_logps)
    losses = fn(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, beta=beta,
                label_smoothing=label_smoothing, divergence=divergence, alpha=alpha,
                chosen_lengths=chosen_lengths, rejected_lengths=rejected_lengths, discopop_tau=discopop_tau)
    chosen_rewards = saturate(beta * (wide(chosen_logps) - wide(cast(Tensor, ref_chosen_logps))).detach(),
                              chosen_logps.dtype)
    rejected_rewards = saturate(beta * (wide(rejected_logps) - wide(cast(Tensor, ref_rejected_logps))).detach(),
                                rejected_logps.dtype)
    return losses, chosen_rewards, rejected_rewards


def chosen_nll(chosen_logps: Tensor, chosen_lengths: Tensor) -> Tensor:
    """Token-mean negative log-likelihood of the chosen completions: ``−Σ_b lp_b / Σ_b n_b``.

    The cross-entropy over every chosen completion token of the batch (TRL's RPO / CPO / ORPO
    term, computed from summed log-probs). Empty completions add nothing; all empty gives 0.

    Args:
        chosen_logps: ``[B]`` float, summed completion log-probs.
        chosen_lengths: ``[B]`` completion token counts (int or float).
    Returns:
        ``[]``, differentiable in ``chosen_logps``.

    >>> chosen_nll(torch.tensor([-2.0, -4.0]), torch.tensor([1, 2]))
    tensor(2.)
    """
    check_float("chosen_logps", chosen_logps)
    check_same_shape("chosen_logps", chosen_logps, chosen_lengths=chosen_lengths)
    return saturate(-wide(chosen_logps).sum() / chosen_lengths.sum().clamp(min=1), chosen_logps.dtype)


def preference_metrics(chosen_rewards: Tensor, rejected_rewards: Tensor, chosen_logps: Tensor,
                       rejected_logps: Tensor) -> dict[str, Tensor]:
    """The diagnostics every pairwise loss logs, as detached scalars.

    ``rewards/chosen``, ``rewards/rejected`` (means), ``rewards/margins`` (mean of ``r_w − r_l``),
    ``rewards/accuracies`` (fraction of pairs with ``r_w > r_l``), ``logps/chosen``,
    ``logps/rejected`` (means).

    Args:
        chosen_rewards, rejected_rewards, chosen_logps, rejected_logps: ``[B]`` float.
    Returns:
        A dict of ``[]`` detached tensors (merged into a loss's metrics TensorDict).
    """
    check_same_shape("chosen_rewards", chosen_rewards, rejected_rewards=rejected_rewards,
                     chosen_logps=chosen_logps, rejected_logps=rejected_logps)
    rw, rl = chosen_rewards.detach(), rejected_rewards.detach()
    return {
        "rewards/chosen": wide_mean(rw),
        "rewards/rejected": wide_mean(rl),
        "rewards/margins": saturate((wide(rw) - wide(rl)).mean(), rw.dtype),
        "rewards/accuracies": (rw > rl).to(rw.dtype).mean(),
        "logps/chosen": wide_mean(chosen_logps.detach()),
        "logps/rejected": wide_mean(rejected_logps.detach()),
    }


_SIDES = ((K.CHOSEN, K.LOGPS), (K.REJECTED, K.LOGPS), (K.CHOSEN, K.LOSS_MASK), (K.REJECTED, K.LOSS_MASK))
_REFS = ((K.CHOSEN, K.REF_LOGPS), (K.REJECTED, K.REF_LOGPS))
_LAYOUTS = {(s, k): ("[B, T] bool" if k == K.LOSS_MASK else "[B] float") for s, k in _SIDES + _REFS}


def completion_lengths(batch: TensorDictBase, side: str) -> Tensor:
    """``[B]`` long: the completion token count of one side (``loss_mask.sum(-1)``)."""
    require_keys(batch, [(side, K.LOSS_MASK)], where="completion_lengths", layouts={(side, K.LOSS_MASK): "[B, T] bool"})
    mask = batch.get((side, K.LOSS_MASK))
    check_mask(f"{side}.{K.LOSS_MASK}", mask)
    check_ndim(f"{side}.{K.LOSS_MASK}", mask, ndim=2, layout="[B, T]")
    return mask.sum(-1)


def dpo(batch: TensorDictBase, *, beta: float = 0.1, loss_type: str = "sigmoid",
        label_smoothing: float = 0.0, reference_free: bool = False, divergence: str = "reverse_kl",
        alpha: float = 0.5, discopop_tau: float = 0.05,
        rpo_alpha: float | None = None) -> tuple[Tensor, TensorDict]:
    """DPO-family loss of a preference batch: ``mean_b ℓ_b`` (+ ``rpo_alpha · NLL(chosen)``).

    ``ℓ = dpo_loss(...)`` with lengths from ``loss_mask.sum(-1)``; RPO adds the token-mean NLL
    of the chosen completions (``chosen_nll``).

    Reads ``chosen`` / ``rejected`` sub-TensorDicts: ``logps [B]``, ``ref_logps [B]`` (not read
    when ``reference_free``), ``loss_mask [B, T] bool``.

    Args:
        batch: preference TensorDict ``[B]``.
        beta, loss_type, label_smoothing, reference_free, divergence, alpha, discopop_tau: as
            ``dpo_loss``.
        rpo_alpha: weight of the chosen NLL (RPO); ``None`` leaves it out.
    Returns:
        ``(loss [], metrics)``; metrics: ``loss_dpo`` (+ ``loss_rpo``), whose sum is the loss, and
        ``preference_metrics`` (``rewards/*``, ``logps/*``). All detached.

    >>> from rlcore.testing import make_preference_batch
    >>> loss, metrics = dpo(make_preference_batch(4), beta=0.1)
    >>> loss.shape, "rewards/margins" in metrics.keys()
    (torch.Size([]), True)

    References:
        Rafailov et al., https://arxiv.org/abs/2305.18290; Pang et al., "Iterative Reasoning
        Preference Optimization" (RPO), https://arxiv.org/abs/2404.19733.
    """
    if rpo_alpha is not None:
        check_number("rpo_alpha", rpo_alpha, low=0.0)
    require_keys(batch, _SIDES + (() if reference_free else _REFS), where="dpo", layouts=_LAYOUTS)
    check_leaves(batch, where="dpo", sequences=_SIDES[:2] + (() if reference_free else _REFS))  # naming the keys
    cw, rw = batch.get((K.CHOSEN, K.LOGPS)), batch.get((K.REJECTED, K.LOGPS))
    refs = (None, None) if reference_free else (batch.get(_REFS[0]), batch.get(_REFS[1]))
    nw, nl = completion_lengths(batch, K.CHOSEN), completion_lengths(batch, K.REJECTED)
    losses, rew_w, rew_l = dpo_loss(cw, rw, *refs, beta=beta, loss_type=loss_type,
                                    label_smoothing=label_smoothing, reference_free=reference_free,
                                    divergence=divergence, alpha=alpha, chosen_lengths=nw,
                                    rejected_lengths=nl, discopop_tau=discopop_tau)
    parts = {"loss_dpo": wide_mean(losses)}
    if rpo_alpha is not None:
        parts["loss_rpo"] = saturate(rpo_alpha * wide(chosen_nll(cw, nw)), cw.dtype)
    loss = wide_sum(parts)
    metrics = {k: v.detach() for k, v in parts.items()} | preference_metrics(rew_w, rew_l, cw, rw)
    return loss, TensorDict(metrics, batch_size=[])
