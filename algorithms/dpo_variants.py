"""The pairwise variants of DPO: one kernel per loss, one registry (``DPO_LOSSES``).

Notation, per pair of the batch: ``ρ_w = log π(y_w|x) − log π_ref(y_w|x)`` (chosen log-ratio),
``ρ_l`` the same for the rejected completion, scores ``s = f(ρ)`` from an f-divergence
(``F_DIVERGENCES``; ``s = ρ`` for the default reverse KL), ``Δ = s_w − s_l``, ``n_w, n_l`` the
completion lengths, ``β`` the inverse temperature and ``ε`` the label-smoothing rate.

Every variant is a kernel with the one signature of ``DPO_LOSSES``::

    fn(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, *, beta, label_smoothing,
       divergence, alpha, chosen_lengths, rejected_lengths, discopop_tau) -> losses [B]

Args (the same for every entry):
    chosen_logps, rejected_logps: ``[B]`` float, summed completion log-probs under the policy.
    ref_chosen_logps, ref_rejected_logps: ``[B]`` float, the same under the reference (detached).
    beta: ``β``, at least 1e-12 (``rlcore.checks.MIN_DIVISOR``: IPO and SPPO divide by it).
    label_smoothing: ``ε`` (read by sigmoid, robust, exo_pair, aot, aot_unpaired).
    divergence, alpha: the f-divergence of the scores (``F_DIVERGENCES``) and its ``α``.
    chosen_lengths, rejected_lengths: ``[B]`` completion token counts (ipo, sigmoid_norm only).
    discopop_tau: ``τ`` of discopop.
Returns:
    ``[B]`` unreduced losses (the caller reduces; ``dpo`` takes the mean over pairs).
Gradient:
    flows into ``chosen_logps`` / ``rejected_logps``; the reference log-probs are detached.

Choices where the peers differ (each tested):
    - label smoothing: kept as the cDPO parameter of ``sigmoid`` (TRL ≤ 0.28, OpenRLHF); TRL 1.x
      dropped it. ``ε = 0`` is plain DPO.
    - IPO: two entries. ``ipo`` divides each score by its completion length (TRL 1.x, which
      reports the IPO authors confirmed this form); ``ipo_sum`` is the sum-based loss of Azar et
      al. (TRL ≤ 0.28, OpenRLHF).
    - f-divergence scores are ``f'(u)`` with ``u = π/π_ref``, written so that ``s(0) = 0``:
      ``1 − e^{−ρ}``, ``log 2 + logσ(ρ)``, ``(e^{(α−1)ρ} − 1)/(α−1)`` (as TRL 1.x). The constants
      cancel in ``Δ`` but not in the length-normalised ``ipo`` / ``sigmoid_norm``, where a policy
      equal to its reference must score 0. The exponents of ``forward_kl`` and ``alpha`` are capped
      at 80 (as TRL does for ``alpha``): past the cap the score is a huge finite constant without
      gradient, where TRL's uncapped ``forward_kl`` gives −inf and a NaN loss.
    - every kernel computes in float64 and casts its losses back saturating
      (``rlcore.masked.in_float64``): ``Δ`` of log-probs near ±3e38, or the square ``ipo`` /
      ``ipo_sum`` take of a huge score, is the dtype's largest value (loss and gradient), never
      inf or NaN (TRL: inf, or NaN).
    - nca_pair, bco_pair, sppo_hard, aot, aot_unpaired, apo_zero, apo_down act on per-side
      rewards ``βρ``; the f-DPO reparameterisation only holds for the difference ``Δ``, so they
      accept ``divergence="reverse_kl"`` only (``ValueError`` otherwise, as TRL 1.x).
    - hyper-parameters are checked by every kernel, named in the error: ``β > 0`` and finite (``β ≤ 0``
      trains toward the rejected completion, NaN gives NaN), ``ε`` in ``[0, 0.5]`` where it is
      cDPO's smoothing (past 0.5 the labels are mostly flipped), ``τ > 0``, a finite ``α``.
    - discopop evaluates ``w·e^{−x}`` as ``exp(logσ(x/τ) − x)``: the same value, but finite where
      ``σ(x/τ)`` underflows and ``e^{−x}`` overflows (the direct product gives ``0·∞ = NaN``).
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from rlcore.checks import check_divisor, check_float, check_number, check_same_shape, lookup
from rlcore.masked import in_float64

__all__ = [
    "F_DIVERGENCES",
    "smoothed_sigmoid_loss",
    "dpo_sigmoid",
    "dpo_hinge",
    "dpo_ipo",
    "dpo_ipo_sum",
    "dpo_robust",
    "dpo_exo_pair",
    "dpo_nca_pair",
    "dpo_bco_pair",
    "dpo_sppo_hard",
    "dpo_aot",
    "dpo_aot_unpaired",
    "dpo_apo_zero",
    "dpo_apo_down",
    "dpo_discopop",
    "dpo_sigmoid_norm",
    "DPO_LOSSES",
]

Tensor = torch.Tensor


# --- f-divergence scores s = f'(π/π_ref) as functions of ρ = log π − log π_ref ------------------
def _reverse_kl(logratio: Tensor, *, alpha: float = 0.5) -> Tensor:
    return logratio


_EXP_CAP = 80.0  # largest exponent kept (as TRL): e^80 is finite in float32


def _forward_kl(logratio: Tensor, *, alpha: float = 0.5) -> Tensor:
    # 1 − e^{−ρ}, the exponent capped as for ``alpha``: a very unlikely completion (ρ < −80) gets a
    # huge finite score (and no gradient) rather than −inf, whose difference Δ would be NaN.
    return -torch.expm1((-logratio).clamp(max=_EXP_CAP))


def _js(logratio: Tensor, *, alpha: float = 0.5) -> Tensor:
    return math.log(2.0) + F.logsigmoid(logratio)


def _alpha(logratio: Tensor, *, alpha: float = 0.5) -> Tensor:
    check_number("alpha", alpha)
    if abs(alpha - 1.0) < 1e-6:  # the limit α → 1 is the reverse KL
        return logratio
    t = ((alpha - 1.0) * logratio).to(torch.promote_types(logratio.dtype, torch.float32))
    return (torch.expm1(t.clamp(max=_EXP_CAP)) / (alpha - 1.0)).to(logratio.dtype)


F_DIVERGENCES: dict[str, Callable[..., Tensor]] = {
    "reverse_kl": _reverse_kl,
    "forward_kl": _forward_kl,
    "js": _js,
    "alpha": _alpha,
}


# --- shared pieces ------------------------------------------------------------------------------
def _variant(fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """A kernel of ``DPO_LOSSES``: ``β`` checked by name (every variant reads it), then computed in
    float64 (``rlcore.masked.in_float64``). The other hyper-parameters are checked where read."""
    beta_default = inspect.signature(fn).parameters["beta"].default
    wide_fn = in_float64(fn)

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Tensor:
        check_divisor("beta", kwargs.get("beta", beta_default))  # >= 1e-12: IPO's and SPPO's 1/(2β) stay finite
        return wide_fn(*args, **kwargs)
    return run


def _logratios(cw: Tensor, rw: Tensor, rcw: Tensor, rrw: Tensor) -> tuple[Tensor, Tensor]:
    for name, x in (("chosen_logps", cw), ("rejected_logps", rw), ("ref_chosen_logps", rcw),
                    ("ref_rejected_logps", rrw)):
        check_float(name, x)
    check_same_shape("chosen_logps", cw, rejected_logps=rw, ref_chosen_logps=rcw, ref_rejected_logps=rrw)
    return cw - rcw.detach(), rw - rrw.detach()


def _scores(cw, rw, rcw, rrw, divergence: str, alpha: float) -> tuple[Tensor, Tensor]:
    f = lookup(F_DIVERGENCES, divergence, what="divergence")
    lw, ll = _logratios(cw, rw, rcw, rrw)
    return f(lw, alpha=alpha), f(ll, alpha=alpha)


def _reverse_kl_only(cw, rw, rcw, rrw, divergence: str, variant: str) -> tuple[Tensor, Tensor]:
    if divergence != "reverse_kl":
        raise ValueError(f"divergence: {variant} acts on per-side rewards βρ, where the f-DPO "
                         f"reparameterisation does not hold; use 'reverse_kl', got {divergence!r}")
    return _logratios(cw, rw, rcw, rrw)


def _per_token(score: Tensor, lengths: Tensor | None, name: str, like: str) -> Tensor:
    if lengths is None:
        raise ValueError(f"{name}: required by the length-normalised variants (ipo, sigmoid_norm); "
                         f"pass the completion token counts [B]")
    check_same_shape(like, score, **{name: lengths})
    return score / lengths.to(score.dtype).clamp(min=1)


def smoothed_sigmoid_loss(logits: Tensor, *, label_smoothing: float = 0.0) -> Tensor:
    """Label-smoothed logistic loss of a preference logit: ``−(1−ε)·logσ(x) − ε·logσ(−x)``.

    ``ε`` is the assumed rate of flipped labels (conservative DPO); ``ε = 0`` is ``−logσ(x)``.

    Args:
        logits: ``[...]`` float, the preference logit ``x`` (e.g. ``βΔ``).
        label_smoothing: ``ε`` in ``[0, 0.5]`` (``ValueError`` otherwise: past 0.5 the loss prefers
            the other answer).
    Returns:
        ``[...]`` unreduced losses, differentiable in ``logits``.

    >>> smoothed_sigmoid_loss(torch.tensor([0.0, 2.0]), label_smoothing=0.1)
    tensor([0.6931, 0.3269])

    References:
        Mitchell, "A note on DPO with noisy preferences & relationship to IPO" (2023);
        Chowdhury et al., "Provably Robust DPO", https://arxiv.org/abs/2403.00409
    """
    check_float("logits", logits)
    check_number("label_smoothing", label_smoothing, low=0.0, high=0.5)
    return -(1.0 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)


# --- the variants (one signature; see the module docstring for the arguments) --------------------
@_variant
def dpo_sigmoid(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, *, beta=0.1,
                label_smoothing=0.0, divergence="reverse_kl", alpha=0.5, chosen_lengths=None,
                rejected_lengths=None, discopop_tau=0.05) -> Tensor:
    """DPO (with cDPO smoothing): ``−(1−ε)·logσ(βΔ) − ε·logσ(−βΔ)``; ``ε = 0`` is plain DPO.

    References: Rafailov et al., "Direct Preference Optimization", https://arxiv.org/abs/2305.18290;
    Wang et al., "Beyond Reverse KL" (f-DPO), https://arxiv.org/abs/2309.16240.
    """
    sw, sl = _scores(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, divergence, alpha)
    return smoothed_sigmoid_loss(beta * (sw - sl), label_smoothing=label_smoothing)


@_variant
def dpo_hinge(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, *, beta=0.1,
              label_smoothing=0.0, divergence="reverse_kl", alpha=0.5, chosen_lengths=None,
              rejected_lengths=None, discopop_tau=0.05) -> Tensor:
    """Hinge (SLiC-style) loss: ``relu(1 − βΔ)``.

    References: Zhao et al., "SLiC-HF", https://arxiv.org/abs/2305.10425.
    """
    sw, sl = _scores(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, divergence, alpha)
    return torch.relu(1.0 - beta * (sw - sl))


@_variant
def dpo_ipo(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, *, beta=0.1,
            label_smoothing=0.0, divergence="reverse_kl", alpha=0.5, chosen_lengths=None,
            rejected_lengths=None, discopop_tau=0.05) -> Tensor:
    """IPO, length-normalised: ``((s_w/n_w − s_l/n_l) − 1/(2β))²`` (``n`` clamped to ≥ 1).

    Minimised at a per-token margin of ``1/(2β)``. Needs ``chosen_lengths`` / ``rejected_lengths``.

    References: Azar et al., "A General Theoretical Paradigm to Understand Learning from Human
    Preferences", https://arxiv.org/abs/2310.12036 (Eq. 17; β plays the role of τ).
    """
    sw, sl = _scores(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, divergence, alpha)
    d = (_per_token(sw, chosen_lengths, "chosen_lengths", "chosen_logps")
         - _per_token(sl, rejected_lengths, "rejected_lengths", "rejected_logps"))
    return (d - 1.0 / (2.0 * beta)).square()


@_variant
def dpo_ipo_sum(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, *, beta=0.1,
                label_smoothing=0.0, divergence="reverse_kl", alpha=0.5, chosen_lengths=None,
                rejected_lengths=None, discopop_tau=0.05) -> Tensor:
    """IPO on summed log-ratios, as in the paper: ``(Δ − 1/(2β))²``, minimised at ``Δ = 1/(2β)``.

    References: Azar et al., https://arxiv.org/abs/2310.12036 (Eq. 17).
    """
    sw, sl = _scores(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, divergence, alpha)
    return ((sw - sl) - 1.0 / (2.0 * beta)).square()


@_variant
def dpo_robust(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, *, beta=0.1,
               label_smoothing=0.0, divergence="reverse_kl", alpha=0.5, chosen_lengths=None,
               rejected_lengths=None, discopop_tau=0.05) -> Tensor:
    """Robust DPO, unbiased under label noise ``ε``: ``(−(1−ε)·logσ(βΔ) + ε·logσ(−βΔ)) / (1 − 2ε)``.

    ``ε`` must lie in ``[0, 0.5)`` (``ValueError`` otherwise); ``ε = 0`` is plain DPO.

    References: Chowdhury et al., "Provably Robust DPO", https://arxiv.org/abs/2403.00409.
    """
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing: robust needs 0 <= ε < 0.5, got {label_smoothing}")
    sw, sl = _scores(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, divergence, alpha)
    x = beta * (sw - sl)
    eps = label_smoothing
    return (-(1.0 - eps) * F.logsigmoid(x) + eps * F.logsigmoid(-x)) / (1.0 - 2.0 * eps)


@_variant
def dpo_exo_pair(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, *, beta=0.1,
                 label_smoothing=0.0, divergence="reverse_kl", alpha=0.5, chosen_lengths=None,
                 rejected_lengths=None, discopop_tau=0.05) -> Tensor:
    """EXO, pairwise: ``KL(q ‖ p)`` with ``q = (σ(βΔ), σ(−βΔ))`` and ``p = (1−ε, ε)``.

    ``q_w(log q_w − log(1−ε)) + q_l(log q_l − log ε)``. ``ε`` must lie in ``(0, 1)``
    (``ValueError`` otherwise; the paper suggests 1e-3).

    References: Ji et al., "Towards Efficient Exact Optimization of Language Model Alignment",
    https://arxiv.org/abs/2402.00856 (Eq. 16).
    """
    if not 0.0 < label_smoothing < 1.0:
        raise ValueError(f"label_smoothing: exo_pair needs 0 < ε < 1 (e.g. 1e-3), got {label_smoothing}")
    sw, sl = _scores(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, divergence, alpha)
    x = beta * (sw - sl)
    log_qw, log_ql = F.logsigmoid(x), F.logsigmoid(-x)
    return (torch.sigmoid(x) * (log_qw - math.log1p(-label_smoothing))
            + torch.sigmoid(-x) * (log_ql - math.log(label_smoothing)))


@_variant
def dpo_nca_pair(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, *, beta=0.1,
                 label_smoothing=0.0, divergence="reverse_kl", alpha=0.5, chosen_lengths=None,
                 rejected_lengths=None, discopop_tau=0.05) -> Tensor:
    """NCA, pairwise: ``−logσ(βρ_w) − ½·logσ(−βρ_w) − ½·logσ(−βρ_l)``.

    References: Chen et al., "Noise Contrastive Alignment of Language Models with Explicit
    Rewards", https://arxiv.org/abs/2402.05369.
    """
    lw, ll = _reverse_kl_only(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps,
                              divergence, "nca_pair")
    return -F.logsigmoid(beta * lw) - 0.5 * F.logsigmoid(-beta * lw) - 0.5 * F.logsigmoid(-beta * ll)


@_variant
def dpo_bco_pair(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, *, beta=0.1,
                 label_smoothing=0.0, divergence="reverse_kl", alpha=0.5, chosen_lengths=None,
                 rejected_lengths=None, discopop_tau=0.05) -> Tensor:
    """BCO, pairwise: ``−logσ(βρ_w) − logσ(−βρ_l)``.

    Stateless: the paper's running-mean reward shift ``δ`` is left out (as TRL 1.x).

    References: Jung et al., "Binary Classifier Optimization for Large Language Model Alignment",
    https://arxiv.org/abs/2404.04656.
    """
    lw, ll = _reverse_kl_only(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps,
                              divergence, "bco_pair")
    return -F.logsigmoid(beta * lw) - F.logsigmoid(-beta * ll)


@_variant
def dpo_sppo_hard(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, *, beta=0.1,
                  label_smoothing=0.0, divergence="reverse_kl", alpha=0.5, chosen_lengths=None,
                  rejected_lengths=None, discopop_tau=0.05) -> Tensor:
    """SPPO with hard win probabilities (1 for the winner, 0 for the loser).

    ``(ρ_w − 1/(2β))² + (ρ_l + 1/(2β))²``.

    References: Wu et al., "Self-Play Preference Optimization for Language Model Alignment",
    https://arxiv.org/abs/2405.00675 (Eq. 4.7 with P ∈ {0, 1}).
    """
    lw, ll = _reverse_kl_only(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps,
                              divergence, "sppo_hard")
    half = 0.5 / beta
    return (lw - half).square() + (ll + half).square()


@_variant
def dpo_aot(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, *, beta=0.1,
            label_smoothing=0.0, divergence="reverse_kl", alpha=0.5, chosen_lengths=None,
            rejected_lengths=None, discopop_tau=0.05) -> Tensor:
    """AOT, paired: cDPO loss on ``δ = sort(lp_w − lp_l) − sort(ref_w − ref_l)``.

    Sorting is over the batch (the last dim), so entry ``b`` of the output pairs the ``b``-th
    smallest policy margin with the ``b``-th smallest reference margin, not pair ``b``: only the
    mean over the batch is meaningful.

    References: Melnyk et al., "Distributional Preference Alignment of LLMs via Optimal
    Transport", https://arxiv.org/abs/2406.05882.
    """
    _reverse_kl_only(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, divergence, "aot")
    policy = torch.sort(chosen_logps - rejected_logps, dim=-1).values
    ref = torch.sort((ref_chosen_logps - ref_rejected_logps).detach(), dim=-1).values
    return smoothed_sigmoid_loss(beta * (policy - ref), label_smoothing=label_smoothing)


@_variant
def dpo_aot_unpaired(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, *, beta=0.1,
                     label_smoothing=0.0, divergence="reverse_kl", alpha=0.5, chosen_lengths=None,
                     rejected_lengths=None, discopop_tau=0.05) -> Tensor:
    """AOT, unpaired: cDPO loss on ``δ = sort(ρ_w) − sort(ρ_l)`` (sorted over the batch).

    References: Melnyk et al., https://arxiv.org/abs/2406.05882.
    """
    lw, ll = _reverse_kl_only(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps,
                              divergence, "aot_unpaired")
    delta = torch.sort(lw, dim=-1).values - torch.sort(ll, dim=-1).values
    return smoothed_sigmoid_loss(beta * delta, label_smoothing=label_smoothing)


@_variant
def dpo_apo_zero(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, *, beta=0.1,
                 label_smoothing=0.0, divergence="reverse_kl", alpha=0.5, chosen_lengths=None,
                 rejected_lengths=None, discopop_tau=0.05) -> Tensor:
    """APO-zero (chosen outputs better than the model's): ``(1 − σ(βρ_w)) + σ(βρ_l)``.

    References: D'Oosterlinck et al., "Anchored Preference Optimization and Contrastive
    Revisions", https://arxiv.org/abs/2408.06266 (Eq. 7).
    """
    lw, ll = _reverse_kl_only(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps,
                              divergence, "apo_zero")
    return (1.0 - torch.sigmoid(beta * lw)) + torch.sigmoid(beta * ll)


@_variant
def dpo_apo_down(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, *, beta=0.1,
                 label_smoothing=0.0, divergence="reverse_kl", alpha=0.5, chosen_lengths=None,
                 rejected_lengths=None, discopop_tau=0.05) -> Tensor:
    """APO-down (chosen outputs worse than the model's): ``σ(βρ_w) + (1 − σ(β(ρ_w − ρ_l)))``.

    References: D'Oosterlinck et al., https://arxiv.org/abs/2408.06266 (Eq. 8).
    """
    lw, ll = _reverse_kl_only(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps,
                              divergence, "apo_down")
    return torch.sigmoid(beta * lw) + (1.0 - torch.sigmoid(beta * (lw - ll)))


@_variant
def dpo_discopop(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, *, beta=0.1,
                 label_smoothing=0.0, divergence="reverse_kl", alpha=0.5, chosen_lengths=None,
                 rejected_lengths=None, discopop_tau=0.05) -> Tensor:
    """DiscoPOP (log-ratio modulated): ``x = βΔ``, ``w = σ(x/τ)``, ``(1−w)·(−logσ(x)) + w·e^{−x}``.

    ``w·e^{−x}`` is computed as ``exp(logσ(x/τ) − x)`` (finite for any finite ``x``).

    References: Chris Lu et al., "Discovering Preference Optimization Algorithms with and for
    Large Language Models", https://arxiv.org/abs/2406.08414 (Eq. 5, τ = 0.05).
    """
    check_divisor("discopop_tau", discopop_tau)  # >= 1e-12: x/τ stays finite
    sw, sl = _scores(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, divergence, alpha)
    x = beta * (sw - sl)
    z = x / discopop_tau
    return torch.sigmoid(-z) * -F.logsigmoid(x) + torch.exp(F.logsigmoid(z) - x)


@_variant
def dpo_sigmoid_norm(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, *, beta=0.1,
                     label_smoothing=0.0, divergence="reverse_kl", alpha=0.5, chosen_lengths=None,
                     rejected_lengths=None, discopop_tau=0.05) -> Tensor:
    """Length-normalised DPO: ``−logσ(β(s_w/n_w − s_l/n_l))`` (``n`` clamped to ≥ 1; no smoothing).

    References: Rafailov et al., https://arxiv.org/abs/2305.18290 (with per-token scores).
    """
    sw, sl = _scores(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, divergence, alpha)
    d = (_per_token(sw, chosen_lengths, "chosen_lengths", "chosen_logps")
         - _per_token(sl, rejected_lengths, "rejected_lengths", "rejected_logps"))
    return -F.logsigmoid(beta * d)


DPO_LOSSES: dict[str, Callable[..., Tensor]] = {
    "sigmoid": dpo_sigmoid,
    "hinge": dpo_hinge,
    "ipo": dpo_ipo,
    "ipo_sum": dpo_ipo_sum,
    "robust": dpo_robust,
    "exo_pair": dpo_exo_pair,
    "nca_pair": dpo_nca_pair,
    "bco_pair": dpo_bco_pair,
    "sppo_hard": dpo_sppo_hard,
    "aot": dpo_aot,
    "aot_unpaired": dpo_aot_unpaired,
    "apo_zero": dpo_apo_zero,
    "apo_down": dpo_apo_down,
    "discopop": dpo_discopop,
    "sigmoid_norm": dpo_sigmoid_norm,
}
