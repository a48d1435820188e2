"""Critic-free policy-gradient losses: RLOO, GRPO (Dr. GRPO, DAPO, BNPO), GSPO, LUSPO, REINFORCE++, ReMax,
CISPO, SAPO, VESPO.

They are one loss, the PPO surrogate without a value term, fed by different advantage
estimators and differing only in a handful of keywords:

==============  ===============  ===========  ====================  ==============================
entry           ratio level      ε_lo / ε_hi  aggregation           notes
==============  ===============  ===========  ====================  ==============================
vanilla         token            0.2 / 0.2    token_mean            ``policy_loss`` itself
grpo            token            0.2 / 0.2    seq_mean_token_mean   k3 KL in the loss, β=0 default
dr_grpo         token            0.2 / 0.2    seq_sum_norm          pass ``max_length``
dapo            token            0.2 / 0.28   token_mean            clip-higher
gspo            sequence         3e-4 / 4e-4  seq_mean_token_mean   length-normalised seq. ratio
rloo            sequence_sum     0.2 / 0.2    seq_mean_token_mean   ratio ``exp(Σ lp − Σ old)``
reinforce_pp    token            0.2 / 0.2    token_mean
remax           token            0.2 / 0.2    token_mean
cispo           token            1.0 / 4.0    token_mean            clipped, detached IS weight
bnpo            token            0.2 / 0.2    local_token_mean      the micro-batch's tokens (TRL)
luspo           sequence         0.2 / 0.2    seq_mean_token_sum    GSPO × the response length
sapo            token            (no clip)    seq_mean_token_mean   soft gate, τ± = 1 / 1.05
vespo           token            (no clip)    token_mean            Gamma weight of the seq. ratio
==============  ===============  ===========  ====================  ==============================

Every entry of ``POLICY_LOSSES`` has the signature ``(batch, **hyper) -> (loss, metrics)``; the
presets are ``functools.partial`` of ``policy_loss``, so any keyword can still be overridden.

Where the peers differ: the ``seq_*`` aggregations count only sequences with at least one valid
token (``rlcore.masked``), while TRL's ``grpo`` / ``dr_grpo`` / ``sapo`` / ``luspo`` divide by the
whole batch size; the two agree unless a response is empty. TRL's RLOO averages ``ℓ_i`` over sequences: ``rloo``
gives exactly that (value and gradient) through the ``sequence_sum`` ratio level.

Where the rest comes from:
- **advantages** (``advantages [B, R]``) are computed before the loss by ``rlcore.baselines``
  (``rloo``, ``grpo``, ``dr_grpo``, ``reinforce_pp``, ``remax`` estimators) or
  ``rlcore.returns`` (GAE, discounted returns); the loss never recomputes them.
- **KL to the reference** goes either in the reward (``rlcore.rewards.compute_rewards``: k1 per
  token, before the advantages, as RLOO, REINFORCE++ and PPO do) or in the loss (``kl_coef`` and
  ``kl`` here, as GRPO does). Both are explicit; neither is on by default.

References:
    Shao et al., "DeepSeekMath" (GRPO), https://arxiv.org/abs/2402.03300
    Liu et al., "Understanding R1-Zero-Like Training: A Critical Perspective" (Dr. GRPO),
    https://arxiv.org/abs/2503.20783
    Yu et al., "DAPO: An Open-Source LLM Reinforcement Learning System at Scale",
    https://arxiv.org/abs/2503.14476
    Zheng et al., "Group Sequence Policy Optimization", https://arxiv.org/abs/2507.18071
    Ahmadian et al., "Back to Basics: Revisiting REINFORCE Style Optimization for Learning from
    Human Feedback in LLMs" (RLOO), https://arxiv.org/abs/2402.14740
    Hu, "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language Models",
    https://arxiv.org/abs/2501.03262
    Li et al., "ReMax: A Simple, Effective, and Efficient Reinforcement Learning Method for
    Aligning Large Language Models", https://arxiv.org/abs/2310.10505
    MiniMax, "MiniMax-M1" (CISPO), https://arxiv.org/abs/2506.13585
    "Soft Adaptive Policy Optimization" (SAPO), https://arxiv.org/abs/2511.20347
    "Length-Unbiased Sequence Policy Optimization" (LUSPO), https://arxiv.org/abs/2602.05261
    "VESPO: Variational Sequence-Level Soft Policy Optimization", https://arxiv.org/abs/2602.10693
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from tensordict import TensorDict, TensorDictBase

from rlcore.algorithms.ppo import ppo_loss
from rlcore import keys as K

__all__ = [
    "policy_loss",
    "grpo_loss",
    "dr_grpo_loss",
    "dapo_loss",
    "gspo_loss",
    "rloo_loss",
    "reinforce_pp_loss",
    "remax_loss",
    "cispo_loss",
    "bnpo_loss",
    "luspo_loss",
    "sapo_loss",
    "vespo_loss",
    "POLICY_LOSSES",
    "POLICY_RATIO_LEVELS",
]


def policy_loss(batch: TensorDictBase, *, surrogate: str = "clip", clip_eps_low: float = 0.2,
                clip_eps_high: float = 0.2, clip_ratio_c: float | None = None,
                log_ratio_clamp: float | None = None, ratio_level: str = "token",
                entropy_coef: float = 0.0, kl_coef: float = 0.0, kl: str = "k3", agg: str = "token_mean",
                num_tokens=None, num_seqs=None, max_length=None,
                ratio_threshold: float | None = None, sapo_temperature_pos: float = 1.0,
                sapo_temperature_neg: float = 1.05, vespo_k_pos: float = 2.0, vespo_lambda_pos: float = 3.0,
                vespo_k_neg: float = 3.0, vespo_lambda_neg: float = 2.0) -> tuple[torch.Tensor, TensorDict]:
    """The clipped policy surrogate with no value term: ``ppo_loss`` on a batch without a critic.

    ``loss = agg(ℓ_pg) − entropy_coef·agg(H) + kl_coef·agg(KL(π_θ‖π_ref))``, with
    ``ℓ_pg = max(−Aρ, −A·clip(ρ, 1−ε_lo, 1+ε_hi))`` (or CISPO's ``−sg(clip(ρ))·A·lp``, SAPO's
    ``−A·(4/τ)·σ(τ(ρ−1))``, VESPO's ``−sg(φ(w))·A·lp``: ``algorithms.ppo.SURROGATES``).
    ``value_preds``, if the batch has it, is ignored.

    Args:
        batch: TensorDict ``[B]``: ``logprobs``, ``old_logprobs``, ``advantages`` ``[B, R]``
            float, ``response_mask`` ``[B, R]`` bool; ``ref_logprobs`` when ``kl_coef != 0``;
            ``entropy`` when ``entropy_coef != 0``.
        Every keyword: as ``algorithms.ppo.ppo_loss``.
    Returns:
        ``(loss [], metrics)``; ``loss_policy + loss_entropy + loss_kl == loss``.

    With a single update per batch (``old_logprobs == logprobs``, ratio 1) the gradient is
    REINFORCE's, ``−agg(A·∇lp)``.

    >>> from rlcore.testing import make_rollout
    >>> batch = make_rollout(4, 5).update({"advantages": torch.ones(4, 5)})
    >>> loss, metrics = policy_loss(batch)
    >>> sorted(k for k in metrics.keys() if k.startswith("loss_"))
    ['loss_entropy', 'loss_kl', 'loss_policy']

    References: Schulman et al., "Proximal Policy Optimization Algorithms",
    https://arxiv.org/abs/1707.06347
    Gradient: through ``logprobs`` (and ``entropy``); everything else is detached.
    """
    return ppo_loss(batch.exclude(K.VALUE_PREDS), surrogate=surrogate, clip_eps_low=clip_eps_low,
                    clip_eps_high=clip_eps_high, clip_ratio_c=clip_ratio_c, log_ratio_clamp=log_ratio_clamp,
                    ratio_level=ratio_level, entropy_coef=entropy_coef, kl_coef=kl_coef, kl=kl, agg=agg,
                    num_tokens=num_tokens, num_seqs=num_seqs, max_length=max_length,
                    ratio_threshold=ratio_threshold, sapo_temperature_pos=sapo_temperature_pos,
                    sapo_temperature_neg=sapo_temperature_neg, vespo_k_pos=vespo_k_pos,
                    vespo_lambda_pos=vespo_lambda_pos, vespo_k_neg=vespo_k_neg, vespo_lambda_neg=vespo_lambda_neg)


def _preset(doc: str, **defaults) -> Callable[..., tuple[torch.Tensor, TensorDict]]:
    loss = functools.partial(policy_loss, **defaults)
    loss.__doc__ = doc
    return loss


grpo_loss = _preset(
    "GRPO (Shao et al. 2024, https://arxiv.org/abs/2402.03300): token ratio, ε = 0.2, per-sequence "
    "token means averaged over sequences (seq_mean_token_mean); k3 KL in the loss when kl_coef > 0 "
    "(0 by default, as TRL). Advantages: rlcore.baselines' grpo estimator.",
    ratio_level="token", clip_eps_low=0.2, clip_eps_high=0.2, agg="seq_mean_token_mean", kl="k3",
    kl_coef=0.0)

dr_grpo_loss = _preset(
    "Dr. GRPO (Liu et al. 2025, https://arxiv.org/abs/2503.20783): GRPO with the constant "
    "normaliser Σ_iΣ_t m·ℓ / (N_seq·L) (seq_sum_norm). Pass max_length=L, the generation limit: "
    "left None, L is the padded width and the loss depends on padding.",
    ratio_level="token", clip_eps_low=0.2, clip_eps_high=0.2, agg="seq_sum_norm", kl="k3", kl_coef=0.0)

dapo_loss = _preset(
    "DAPO (Yu et al. 2025, https://arxiv.org/abs/2503.14476): clip-higher ε_lo = 0.2, ε_hi = 0.28 "
    "and token-level normalisation (token_mean; pass num_tokens for the whole step).",
    ratio_level="token", clip_eps_low=0.2, clip_eps_high=0.28, agg="token_mean")

gspo_loss = _preset(
    "GSPO (Zheng et al. 2025, https://arxiv.org/abs/2507.18071): sequence-level ratio "
    "exp(mean_t(lp − old)) with per-token gradients (ratio_level='sequence'), the paper's clip "
    "range ε_lo = 3e-4, ε_hi = 4e-4, seq_mean_token_mean.",
    ratio_level="sequence", clip_eps_low=3e-4, clip_eps_high=4e-4, agg="seq_mean_token_mean")

rloo_loss = _preset(
    "RLOO as TRL's (Ahmadian et al. 2024, https://arxiv.org/abs/2402.14740): sequence-level "
    "ratio exp(Σ_t lp − Σ_t old), the exp of the SUM (ratio_level='sequence_sum'), ε = 0.2; with "
    "seq_mean_token_mean the loss is mean_i max(−A_iρ_i, −A_i·clip(ρ_i)) in value and gradient. "
    "Advantages: rlcore.baselines' rloo estimator; KL in the reward (rlcore.rewards).",
    ratio_level="sequence_sum", clip_eps_low=0.2, clip_eps_high=0.2, agg="seq_mean_token_mean")

reinforce_pp_loss = _preset(
    "REINFORCE++ (Hu 2025, https://arxiv.org/abs/2501.03262): token-level PPO clip, ε = 0.2, "
    "token_mean, fed by globally whitened advantages (rlcore.baselines' reinforce_pp estimator); "
    "KL goes in the reward (rlcore.rewards).",
    ratio_level="token", clip_eps_low=0.2, clip_eps_high=0.2, agg="token_mean")

remax_loss = _preset(
    "ReMax (Li et al. 2023, https://arxiv.org/abs/2310.10505): REINFORCE with the greedy "
    "response's reward as baseline (rlcore.baselines' remax estimator). One update per batch "
    "makes the ratio 1 and the gradient REINFORCE's; the clip (ε = 0.2, token_mean, as verl) only "
    "matters for further epochs.",
    ratio_level="token", clip_eps_low=0.2, clip_eps_high=0.2, agg="token_mean")

cispo_loss = _preset(
    "CISPO (MiniMax-M1, https://arxiv.org/abs/2506.13585): −sg(clip(ρ, 1−ε_lo, 1+ε_hi))·A·lp, "
    "no lower bound (ε_lo = 1) and ρ capped at 5 (ε_hi = 4, ScaleRL's ε_max), token_mean. The "
    "clipped weight is detached (as TRL and verl; torchrl does not).",
    surrogate="cispo", ratio_level="token", clip_eps_low=1.0, clip_eps_high=4.0, agg="token_mean")

bnpo_loss = _preset(
    "BNPO as TRL's loss_type='bnpo': the token-level clip (ε = 0.2 both sides, TRL's epsilon) "
    "normalised by the valid tokens of the local (micro-)batch, not of the step (local_token_mean; "
    "DAPO's token-level normalisation, https://arxiv.org/abs/2503.14476, taken per micro-batch). "
    "Within a step, each micro-batch weighs its share of the step's non-empty responses where TRL "
    "divides by the number of accumulation steps: the same when the micro-batches are equal. With one "
    "micro-batch per step it is token_mean, and TRL's grpo when each micro-batch holds one response.",
    ratio_level="token", clip_eps_low=0.2, clip_eps_high=0.2, agg="local_token_mean")

luspo_loss = _preset(
    "LUSPO (Length-Unbiased Sequence Policy Optimization, https://arxiv.org/abs/2602.05261), as "
    "TRL's loss_type='luspo': GSPO's sequence ratio s_i = exp(mean_t(lp − old)) clipped, each "
    "sequence's loss scaled by its length: mean_i |y_i|·max(−A_i s_i, −A_i clip(s_i)) "
    "(seq_mean_token_sum). ε = 0.2 both sides (TRL's epsilon; GSPO's 3e-4 / 4e-4 can be passed). The "
    "sequence level is bound here, as the paper and TRL's documentation require; TRL's own "
    "importance_sampling_level default is 'token' (pass ratio_level='token' for that).",
    ratio_level="sequence", clip_eps_low=0.2, clip_eps_high=0.2, agg="seq_mean_token_sum")

sapo_loss = _preset(
    "SAPO (Soft Adaptive Policy Optimization, https://arxiv.org/abs/2511.20347), as TRL's "
    "loss_type='sapo': a soft gate in place of the clip, −A·(4/τ)·σ(τ(ρ − 1)) per token with "
    "τ = sapo_temperature_pos (1.0) where A > 0 and sapo_temperature_neg (1.05) elsewhere, TRL's "
    "defaults; token ratio; GRPO's seq_mean_token_mean. clip_eps_* are not read.",
    surrogate="sapo", ratio_level="token", agg="seq_mean_token_mean", sapo_temperature_pos=1.0,
    sapo_temperature_neg=1.05)

vespo_loss = _preset(
    "VESPO (https://arxiv.org/abs/2602.10693), as TRL's loss_type='vespo': −sg(φ(w))·A·lp per token, "
    "w = exp(Σ_t log ρ_t) the sequence's ratio (log w clamped to [log 1e-8, 20]), "
    "φ(w) = e^λ·w^k·e^{−λw} with (k, λ) = (2, 3) where A ≥ 0 and (3, 2) where A < 0 (TRL's "
    "vespo_k_* / vespo_lambda_* defaults); token_mean over the step's tokens (as TRL's dapo). Reads "
    "token-level ratios (ratio_level='token'). TRL also folds vLLM's sampler ratio into w; here the "
    "behaviour policy is old_logprobs. clip_eps_* are not read.",
    surrogate="vespo", ratio_level="token", agg="token_mean", vespo_k_pos=2.0, vespo_lambda_pos=3.0,
    vespo_k_neg=3.0, vespo_lambda_neg=2.0)

# One signature for every entry: (batch, **hyper) -> (loss, metrics).
POLICY_LOSSES: dict[str, Callable[..., tuple[torch.Tensor, TensorDict]]] = {
    "vanilla": policy_loss,
    "grpo": grpo_loss,
    "dr_grpo": dr_grpo_loss,
    "dapo": dapo_loss,
    "gspo": gspo_loss,
    "rloo": rloo_loss,
    "reinforce_pp": reinforce_pp_loss,
    "remax": remax_loss,
    "cispo": cispo_loss,
    "bnpo": bnpo_loss,
    "luspo": luspo_loss,
    "sapo": sapo_loss,
    "vespo": vespo_loss,
}

# The importance ratio's level each entry binds (``ratio_level``, a key of ``algorithms.ratios.RATIO_LEVELS``;
# ``vanilla``: ``policy_loss``'s default), for code that weights at the loss's level outside it (the
# asynchronous learners' truncated importance correction).
POLICY_RATIO_LEVELS: dict[str, str] = {
    "vanilla": "token",
    "grpo": "token",
    "dr_grpo": "token",
    "dapo": "token",
    "gspo": "sequence",
    "rloo": "sequence_sum",
    "reinforce_pp": "token",
    "remax": "token",
    "cispo": "token",
    "bnpo": "token",
    "luspo": "sequence",
    "sapo": "token",
    "vespo": "token",
}
