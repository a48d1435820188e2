"""Preference losses beyond DPO: ORPO, SimPO, CPO (with AlphaPO rewards), KTO; and the registry
``PREFERENCE_LOSSES`` of every TensorDict-level preference loss, ``(batch, **hyper) -> (loss, metrics)``,
one name each: the DPO family by TRL's ``loss_type`` (``sigmoid``, ``ipo``, ``hinge``, ...: the
keys of ``rlcore.algorithms.dpo_variants.DPO_LOSSES``), then ``orpo``, ``simpo``, ``cpo`` and ``kto``.

ORPO, SimPO and CPO need no reference model; KTO is unpaired (one completion per row, labelled
desirable or not). Log-prob inputs are summed over completion tokens (``keys.LOGPS``); the
length-averaged forms divide by the completion length ``n = loss_mask.sum(-1)`` (clamped ≥ 1).

Choices where the peers differ:
    - the NLL term of ORPO and CPO is the token-mean NLL of the chosen *completions*
      (``chosen_nll``), as the ORPO paper's ``L_SFT``; TRL's ORPO also counts prompt tokens.
    - ``odds_ratio_loss`` works in float32 at least (as TRL) and returns the input dtype.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from tensordict import TensorDict, TensorDictBase

from rlcore import keys as K
from rlcore.algorithms.dpo import chosen_nll, completion_lengths, dpo, preference_metrics
from rlcore.algorithms.dpo_variants import DPO_LOSSES, smoothed_sigmoid_loss
from rlcore.checks import check_float, check_leaves, check_mask, check_number, check_same_shape, require_keys
from rlcore.masked import masked_mean, saturate, wide, wide_mean, wide_sum

__all__ = [
    "log1mexp",
    "odds_ratio_loss",
    "orpo",
    "alphapo_reward",
    "simpo_loss",
    "simpo",
    "cpo_loss",
    "cpo",
    "kto_loss",
    "kto",
    "PREFERENCE_LOSSES",
]

Tensor = torch.Tensor
_LN2 = math.log(2.0)


def log1mexp(x: Tensor) -> Tensor:
    """``log(1 − e^x)`` for ``x ≤ 0``, accurate everywhere.

    ``log(−expm1(x))`` for ``x > −ln 2`` (where ``1 − e^x`` cancels) and ``log1p(−e^x)`` below.
    Each branch only ever sees inputs of its own range, so neither value nor gradient of the
    branch not taken can be ``inf`` / ``NaN``.

    Args:
        x: ``[...]`` float, ``≤ 0`` (a log-probability).
    Returns:
        ``[...]``; ``−inf`` at ``x = 0``, ``NaN`` for ``x > 0``.

    >>> log1mexp(torch.tensor([-1e-10, -50.0], dtype=torch.float64))
    tensor([-2.3026e+01, -1.9287e-22], dtype=torch.float64)

    References:
        Mächler, "Accurately Computing log(1 − exp(−|a|))" (2012), the Rmpfr package vignette.
    """
    check_float("x", x)
    near = x > -_LN2
    return torch.where(near, torch.log(-torch.expm1(torch.where(near, x, -1.0))),
                       torch.log1p(-torch.exp(torch.where(near, -1.0, x))))


def odds_ratio_loss(chosen_logps_avg: Tensor, rejected_logps_avg: Tensor, *,
                    beta: float = 0.1) -> tuple[Tensor, Tensor]:
    """ORPO's odds-ratio term: ``−β·logσ(log odds(y_w) − log odds(y_l))``.

    ``log odds(y) = p̄ − log(1 − e^{p̄})`` with ``p̄`` the length-averaged log-prob, so
    ``log_odds = (p̄_w − p̄_l) − (log1mexp(p̄_w) − log1mexp(p̄_l))``.

    Args:
        chosen_logps_avg, rejected_logps_avg: ``[B]`` float, mean token log-probs (``< 0``).
        beta: ``λ`` of the paper, the weight of the odds-ratio term.
    Returns:
        ``(losses [B], log_odds [B])`` in the input dtype (computed in float32 at least). An average
        log-prob of exactly 0 (every token certain: it happens in float32) is taken as the largest
        negative normal number, so the odds stay finite (``log_odds ≈ 87``) and carry no gradient;
        TRL's form gives ``inf − inf = NaN`` there.

    >>> odds_ratio_loss(torch.tensor([-0.5]), torch.tensor([-2.0]), beta=1.0)
    (tensor([0.0967]), tensor([2.2873]))

    Gradient: through both inputs; ``log_odds`` is returned differentiable (detach to log it).

    References:
        Hong et al., "ORPO: Monolithic Preference Optimization without Reference Model",
        https://arxiv.org/abs/2403.07691 (Eqs. 4-7).
    """
    check_float("chosen_logps_avg", chosen_logps_avg)
    check_same_shape("chosen_logps_avg", chosen_logps_avg, rejected_logps_avg=rejected_logps_avg)
    check_number("beta", beta, low=0.0)  # λ < 0 would reward the rejected answer's odds
    dtype = chosen_logps_avg.dtype
    # float64 (rlcore.masked.wide), cast back saturating: log-probs anywhere in the range
    top = -torch.finfo(torch.float32).tiny  # p̄ = 0 (probability 1) has infinite odds: the closest normal number
    lw = wide(chosen_logps_avg).clamp(max=top)
    ll = wide(rejected_logps_avg).clamp(max=top)
    log_odds = (lw - ll) - (log1mexp(lw) - log1mexp(ll))
    return saturate(-beta * F.logsigmoid(log_odds), dtype), saturate(log_odds, dtype)


def _sides(batch: TensorDictBase, where: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    keys = [(K.CHOSEN, K.LOGPS), (K.REJECTED, K.LOGPS), (K.CHOSEN, K.LOSS_MASK), (K.REJECTED, K.LOSS_MASK)]
    require_keys(batch, keys, where=where, layouts={k: "[B]" if k[1] == K.LOGPS else "[B, T] bool" for k in keys})
    check_leaves(batch, where=where, sequences=keys[:2])  # each error names its batch key
    return (batch.get(keys[0]), batch.get(keys[1]), completion_lengths(batch, K.CHOSEN),
            completion_lengths(batch, K.REJECTED))


def _avg(logps: Tensor, lengths: Tensor) -> Tensor:
    return logps / lengths.clamp(min=1).to(logps.dtype)


def orpo(batch: TensorDictBase, *, beta: float = 0.1) -> tuple[Tensor, TensorDict]:
    """ORPO loss of a preference batch: ``NLL(chosen) + mean_b odds_ratio_loss_b``.

    Reads ``chosen`` / ``rejected``: ``logps [B]`` (summed) and ``loss_mask [B, T] bool``. A pair
    with an empty completion (whose odds are undefined) is left out of the mean, and gets no
    gradient from the odds-ratio term.

    Args:
        batch: preference TensorDict ``[B]`` (no reference log-probs needed).
        beta: ``λ``, the weight of the odds-ratio term (paper: 0.1).
    Returns:
        ``(loss [], metrics)``: ``loss_nll + loss_or``; metrics also hold ``rewards/*`` (``β·p̄``),
        ``logps/*`` (``p̄``), ``log_odds_ratio`` (mean ``logσ(log_odds)``), ``log_odds_chosen``
        (mean ``log_odds``). All detached.

    References:
        Hong et al., https://arxiv.org/abs/2403.07691.
    """
    cw, rw, nw, nl = _sides(batch, "orpo")
    aw, al = _avg(cw, nw), _avg(rw, nl)
    valid = (nw > 0) & (nl > 0)  # an empty completion has no odds: the pair is left out
    losses, log_odds = odds_ratio_loss(torch.where(valid, aw, -1.0), torch.where(valid, al, -2.0), beta=beta)
    parts = {"loss_nll": chosen_nll(cw, nw), "loss_or": masked_mean(losses, valid)}
    lo = log_odds.detach()
    metrics = ({k: v.detach() for k, v in parts.items()} | preference_metrics(beta * aw, beta * al, aw, al)
               | {"log_odds_ratio": masked_mean(F.logsigmoid(lo), valid), "log_odds_chosen": masked_mean(lo, valid)})
    return wide_sum(parts), TensorDict(metrics, batch_size=[])


def alphapo_reward(logps: Tensor, *, alpha: float = 0.0) -> Tensor:
    """AlphaPO reward shape: ``(1 − p^{−α})/α = −expm1(−α·lp)/α``, ``p = e^{lp}`` (``lp`` itself at α = 0).

    Args:
        logps: ``[...]`` float (average log-probs for SimPO, sums for CPO).
        alpha: ``α``; 0 gives the log-prob itself (the limit), ``α > 0`` flattens low rewards.
    Returns:
        ``[...]``, differentiable. The exponent ``−α·lp`` is capped at 80 (11 for fp16): below
        ``lp = −80/α`` the reward is the finite constant ``−expm1(80)/α`` without gradient, where
        the uncapped form overflows to −inf (and a margin of two such rewards is NaN).

    >>> alphapo_reward(torch.tensor([-1.0]), alpha=0.0), alphapo_reward(torch.tensor([-1.0]), alpha=0.5)
    (tensor([-1.]), tensor([-1.2974]))

    References:
        Gupta et al., "AlphaPO: Reward Shape Matters for LLM Alignment", https://arxiv.org/abs/2501.03884.
    """
    check_float("logps", logps)
    check_number("alpha", alpha)
    if alpha == 0.0:
        return logps
    cap = 11.0 if logps.dtype == torch.float16 else 80.0  # e^cap stays finite, as the f-divergences of DPO
    return -torch.expm1((-alpha * logps).clamp(max=cap)) / alpha


def _margin_loss(lw: Tensor, ll: Tensor, beta: float, gamma: float, label_smoothing: float,
                 alpha: float) -> Tensor:
    check_same_shape("chosen", lw, rejected=ll)
    check_number("beta", beta, low=0.0, low_open=True)  # β ≤ 0 prefers the rejected answer
    check_number("gamma", gamma)
    # in float64, cast back saturating (rlcore.masked.saturate): log-probs anywhere in the range
    x = beta * (alphapo_reward(wide(lw), alpha=alpha) - alphapo_reward(wide(ll), alpha=alpha)) - gamma
    return saturate(smoothed_sigmoid_loss(x, label_smoothing=label_smoothing), lw.dtype)


def simpo_loss(chosen_logps_avg: Tensor, rejected_logps_avg: Tensor, *, beta: float = 2.0,
               gamma: float = 1.0, label_smoothing: float = 0.0, alpha: float = 0.0) -> Tensor:
    """SimPO: ``−logσ(β(p̄_w − p̄_l) − γ)`` on length-averaged log-probs, without a reference.

    With ``label_smoothing`` ``ε`` the cDPO form ``−(1−ε)logσ(x) − ε logσ(−x)``; with AlphaPO's
    ``alpha`` the rewards ``p̄`` become ``alphapo_reward(p̄, alpha)``.

    Args:
        chosen_logps_avg, rejected_logps_avg: ``[B]`` float, mean token log-probs.
        beta: reward scale (paper: 2.0-2.5).  gamma: target margin ``γ`` (paper: ``γ/β ≈ 0.5``).
        label_smoothing: ``ε``.  alpha: AlphaPO ``α`` (0 = SimPO).
    Returns:
        ``[B]`` unreduced losses.

    >>> simpo_loss(torch.tensor([-1.0]), torch.tensor([-1.5]), beta=2.0, gamma=1.0)
    tensor([0.6931])

    References:
        Meng et al., "SimPO: Simple Preference Optimization with a Reference-Free Reward",
        https://arxiv.org/abs/2405.14734; AlphaPO, https://arxiv.org/abs/2501.03884.
    """
    check_float("chosen_logps_avg", chosen_logps_avg)
    check_float("rejected_logps_avg", rejected_logps_avg)
    check_same_shape("chosen_logps_avg", chosen_logps_avg, rejected_logps_avg=rejected_logps_avg)
    return _margin_loss(chosen_logps_avg, rejected_logps_avg, beta, gamma, label_smoothing, alpha)


def cpo_loss(chosen_logps: Tensor, rejected_logps: Tensor, *, beta: float = 0.1,
             label_smoothing: float = 0.0, alpha: float = 0.0) -> Tensor:
    """CPO's preference term: ``−logσ(β(lp_w − lp_l))`` on summed log-probs, without a reference.

    Label smoothing and AlphaPO rewards as ``simpo_loss``; the NLL term is added by ``cpo``.

    Args:
        chosen_logps, rejected_logps: ``[B]`` float, summed completion log-probs.
        beta: ``β`` (paper: 0.1).  label_smoothing: ``ε``.  alpha: AlphaPO ``α``.
    Returns:
        ``[B]`` unreduced losses.

    References:
        Xu et al., "Contrastive Preference Optimization", https://arxiv.org/abs/2401.08417 (Eq. 3).
    """
    check_float("chosen_logps", chosen_logps)
    check_float("rejected_logps", rejected_logps)
    check_same_shape("chosen_logps", chosen_logps, rejected_logps=rejected_logps)
    return _margin_loss(chosen_logps, rejected_logps, beta, 0.0, label_smoothing, alpha)


def _ref_free_loss(batch, where, kernel, averaged: bool, beta: float, alpha: float, cpo_alpha: float,
                    **hyper) -> tuple[Tensor, TensorDict]:
    check_number("cpo_alpha", cpo_alpha, low=0.0)
    cw, rw, nw, nl = _sides(batch, where)
    lw, ll = (_avg(cw, nw), _avg(rw, nl)) if averaged else (cw, rw)
    parts = {f"loss_{where}": wide_mean(kernel(lw, ll, beta=beta, alpha=alpha, **hyper))}
    if cpo_alpha != 0.0:
        parts["loss_nll"] = saturate(cpo_alpha * wide(chosen_nll(cw, nw)), cw.dtype)
    rewards = tuple(saturate(beta * wide(alphapo_reward(x, alpha=alpha)), x.dtype) for x in (lw, ll))
    metrics = {k: v.detach() for k, v in parts.items()} | preference_metrics(*rewards, lw, ll)
    return wide_sum(parts), TensorDict(metrics, batch_size=[])


def simpo(batch: TensorDictBase, *, beta: float = 2.0, gamma: float = 1.0, label_smoothing: float = 0.0,
          alpha: float = 0.0, cpo_alpha: float = 0.0) -> tuple[Tensor, TensorDict]:
    """SimPO (AlphaPO with ``alpha ≠ 0``; CPO-SimPO with ``cpo_alpha > 0``) on a preference batch.

    ``loss = mean_b simpo_loss_b + cpo_alpha · NLL(chosen)``. Reads ``chosen`` / ``rejected``
    ``logps [B]`` and ``loss_mask [B, T] bool`` (for the lengths).

    Returns:
        ``(loss [], metrics)``: ``loss_simpo`` (+ ``loss_nll``), ``rewards/*`` (``β·r(p̄)``),
        ``logps/*`` (``p̄``), detached.

    References:
        Meng et al., https://arxiv.org/abs/2405.14734.
    """
    return _ref_free_loss(batch, "simpo", simpo_loss, True, beta, alpha, cpo_alpha, gamma=gamma,
                           label_smoothing=label_smoothing)


def cpo(batch: TensorDictBase, *, beta: float = 0.1, label_smoothing: float = 0.0, alpha: float = 0.0,
        cpo_alpha: float = 1.0) -> tuple[Tensor, TensorDict]:
    """CPO on a preference batch: ``mean_b cpo_loss_b + cpo_alpha · NLL(chosen)``.

    Reads ``chosen`` / ``rejected`` ``logps [B]`` and ``loss_mask [B, T] bool``.

    Returns:
        ``(loss [], metrics)``: ``loss_cpo`` (+ ``loss_nll`` unless ``cpo_alpha = 0``),
        ``rewards/*`` (``β·r(lp)``), ``logps/*``, detached.

    References:
        Xu et al., https://arxiv.org/abs/2401.08417.
    """
    return _ref_free_loss(batch, "cpo", cpo_loss, False, beta, alpha, cpo_alpha,
                           label_smoothing=label_smoothing)


def kto_loss(logps: Tensor, ref_logps: Tensor, kl_logps: Tensor, ref_kl_logps: Tensor, labels: Tensor, *,
             beta: float = 0.1, desirable_weight: float = 1.0,
             undesirable_weight: float = 1.0) -> tuple[Tensor, Tensor]:
    """KTO, per example: ``λ_D·(1 − σ(β(ρ − z)))`` if desirable, ``λ_U·(1 − σ(β(z − ρ)))`` if not.

    ``ρ = lp − lp_ref``; the reference point ``z = max(0, mean(kl_logps − ref_kl_logps))`` is a
    batch estimate of ``KL(π ‖ π_ref)`` from mismatched (prompt, completion) pairs.

    Args:
        logps, ref_logps: ``[B]`` float, summed completion log-probs (policy, reference).
        kl_logps, ref_kl_logps: ``[B']`` float, the same for the mismatched pairs.
        labels: ``[B]`` bool, True for desirable completions.
        beta: ``β``.  desirable_weight, undesirable_weight: ``λ_D``, ``λ_U``.
    Returns:
        ``(losses [B], z [])``.

    Gradient: through ``logps`` only; ``z`` and the reference log-probs are detached.

    >>> kto_loss(torch.tensor([-1.0, -1.0]), torch.tensor([-2.0, -2.0]), torch.tensor([-3.0]),
    ...          torch.tensor([-3.0]), torch.tensor([True, False]), beta=1.0)
    (tensor([0.2689, 0.7311]), tensor(0.))

    References:
        Ethayarajh et al., "KTO: Model Alignment as Prospect Theoretic Optimization",
        https://arxiv.org/abs/2402.01306 (Eq. 7).
    """
    check_float("logps", logps)
    check_same_shape("logps", logps, ref_logps=ref_logps)
    check_mask("labels", labels, like=logps, like_name="logps")
    check_float("kl_logps", kl_logps)
    check_same_shape("kl_logps", kl_logps, ref_kl_logps=ref_kl_logps)
    check_number("beta", beta, low=0.0, low_open=True)
    check_number("desirable_weight", desirable_weight, low=0.0, low_open=True)
    check_number("undesirable_weight", undesirable_weight, low=0.0, low_open=True)
    # in float64, cast back saturating (rlcore.masked.saturate): log-probs anywhere in the range
    z = (wide(kl_logps) - wide(ref_kl_logps)).detach().mean().clamp(min=0)
    rho = wide(logps) - wide(ref_logps.detach())
    desirable = desirable_weight * torch.sigmoid(beta * (z - rho))  # 1 − σ(β(ρ − z))
    undesirable = undesirable_weight * torch.sigmoid(beta * (rho - z))  # 1 − σ(β(z − ρ))
    return saturate(torch.where(labels, desirable, undesirable), logps.dtype), saturate(z, logps.dtype)


def kto(batch: TensorDictBase, *, beta: float = 0.1, desirable_weight: float = 1.0,
        undesirable_weight: float = 1.0) -> tuple[Tensor, TensorDict]:
    """KTO loss of an unpaired batch: ``mean_b kto_loss_b``.

    Reads (flat, batch ``[B]``): ``logps``, ``ref_logps``, ``kl_logps``, ``ref_kl_logps`` ``[B]``
    float and ``labels [B] bool``.

    Returns:
        ``(loss [], metrics)``: ``loss_kto``; ``kl`` (``z``); ``rewards/chosen``,
        ``rewards/rejected`` (mean ``βρ`` over desirable / undesirable rows, 0 if none),
        ``rewards/margins``, ``logps/chosen``, ``logps/rejected``. All detached.

    References:
        Ethayarajh et al., https://arxiv.org/abs/2402.01306.
    """
    keys = [K.LOGPS, K.REF_LOGPS, K.KL_LOGPS, K.REF_KL_LOGPS, K.LABELS]
    require_keys(batch, keys, where="kto", layouts={k: "[B] bool" if k == K.LABELS else "[B] float" for k in keys})
    lp, ref, labels = batch.get(K.LOGPS), batch.get(K.REF_LOGPS), batch.get(K.LABELS)
    losses, z = kto_loss(lp, ref, batch.get(K.KL_LOGPS), batch.get(K.REF_KL_LOGPS), labels, beta=beta,
                         desirable_weight=desirable_weight, undesirable_weight=undesirable_weight)
    loss = wide_mean(losses)
    rewards, lpd = saturate(beta * (wide(lp) - wide(ref)).detach(), lp.dtype), lp.detach()
    metrics = {"loss_kto": loss.detach(), "kl": z,
               "rewards/chosen": masked_mean(rewards, labels), "rewards/rejected": masked_mean(rewards, ~labels),
               "logps/chosen": masked_mean(lpd, labels), "logps/rejected": masked_mean(lpd, ~labels)}
    metrics["rewards/margins"] = saturate(wide(metrics["rewards/chosen"]) - wide(metrics["rewards/rejected"]),
                                          lp.dtype)
    return loss, TensorDict(metrics, batch_size=[])


PREFERENCE_LOSSES: dict[str, Callable[..., tuple[Tensor, TensorDict]]] = {
    **{name: partial(dpo, loss_type=name) for name in DPO_LOSSES},  # the DPO family, by TRL's loss_type
    "exo_pair": partial(dpo, loss_type="exo_pair", label_smoothing=1e-3),  # EXO needs ε > 0
    "orpo": orpo,
    "simpo": simpo,
    "cpo": cpo,
    "kto": kto,
}
