"""The learner's half of asynchronous off-policy RLHF: the recipes' hooks on a generated rollout.

A synchronous online recipe's ``step`` is ``collect_rollout → prepare → optimise``
(``loops.online.online_step``). The asynchronous loops (``loops.async_rl``'s generator process,
``loops.placement``'s Ray actors) generate elsewhere and hand the rollout to :func:`learn`, which
runs the rest of that step with the recipe's own hooks (:class:`Learner`, ``LEARNERS``):
``loops.online.score_collected`` (scores, the seed draw, the counters), then :func:`learn_scored`
(the learner's log-probs, ``prepare``, the optional importance correction, ``optimise``).

Off-policy correction (``is_clip = C``): with ``π_prox`` the learner's policy before the update
(one no-grad forward) and ``π_b`` the generator's (the behaviour log-probs), the loss's ratio is
taken against ``π_prox`` and the advantages are weighted by ``w = min(π_prox/π_b, C)``, detached:
the decoupled PPO objective with a truncated importance weight, at the level of the loss's
ratio: per token for PPO and token-ratio GRPO presets, the sequence's mean for GSPO, the
sequence's sum for RLOO (``Learner.level``). PPO's value loss is not reweighted (its values and
returns come from the learner's critic). Online DPO has no ratio (the DPO loss is an offline
objective on pairs, off-policy by construction): ``is_clip`` is rejected with a ``ValueError``.
``is_clip=None`` keeps the behaviour log-probs as the loss's ``old_logprobs`` (the clipped ratio
then absorbs the lag, as in the paper).

Metrics: ``async/staleness`` (mean ``version_learner − version_rollout``), ``async/staleness_max``,
``async/logprob_gap`` (``mean_t(log π_b − log π_prox)``, a k1 estimate of ``KL(π_b ‖ π_prox)``),
``async/logprob_abs_gap``, and with ``is_clip`` ``async/is_weight`` and ``async/is_truncated``.

References:
    Noukhovitch et al., "Asynchronous RLHF: Faster and More Efficient Off-Policy RL for Language
    Models", https://arxiv.org/abs/2410.18252; Espeholt et al., "IMPALA" (truncated importance
    weights), https://arxiv.org/abs/1802.01561; Hilton et al., "Batch size-invariance for policy
    optimization" (decoupled PPO objective), https://arxiv.org/abs/2110.00641
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from rlcore import keys as K
from rlcore.algorithms.ppo import importance_log_ratio
from rlcore.checks import check_mask, check_same_shape, lookup
from rlcore.loops import grpo, online_dpo, ppo, rloo
from rlcore.loops.online import rollout_metrics, score_collected, with_policy_logprobs
from rlcore.loops.state import TrainState
from rlcore.masked import masked_mean

__all__ = ["truncated_importance_weights", "with_importance_correction", "off_policy_metrics", "Learner", "LEARNERS",
           "check_learner", "learn", "learn_scored"]


# --- off-policy correction (pure) ------------------------------------------------------------------
def truncated_importance_weights(proximal_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor,
                                 mask: torch.Tensor, *, clip: float = 1.0, level: str = "token") -> torch.Tensor:
    """Truncated importance weights of the learner's policy against the behaviour policy.

    ``w = min(exp(log ρ), C)`` with ``log ρ = importance_log_ratio(prox, behaviour, level)``:
    ``log π_prox − log π_b`` per token (``"token"``), or the sequence's mean (``"sequence"``) or
    sum (``"sequence_sum"``) on every token; clamped in log space, so ``exp`` never overflows.

    Args:
        proximal_logprobs: ``[..., T]`` float, the learner's log-probs before the update.
        behaviour_logprobs: ``[..., T]`` float, the generator's (``old_logprobs`` of a rollout).
        mask: ``[..., T]`` bool.  clip: ``C > 0`` (IMPALA's ``ρ̄``; 1 by default).
        level: a key of ``algorithms.ppo.RATIO_LEVELS``.
    Returns:
        ``[..., T]`` weights in ``[0, C]``, 0 outside ``mask``, detached.

    >>> prox, b = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-2.0, -1.0]])
    >>> truncated_importance_weights(prox, b, torch.tensor([[True, True]]), clip=2.0)
    tensor([[2.0000, 0.3679]])

    References: Espeholt et al., "IMPALA", https://arxiv.org/abs/1802.01561

    Gradient: none (both inputs are detached).
    """
    if not clip > 0:
        raise ValueError(f"clip: expected C > 0, got {clip}")
    check_same_shape("proximal_logprobs", proximal_logprobs, behaviour_logprobs=behaviour_logprobs)
    check_mask("mask", mask, like=proximal_logprobs, like_name="proximal_logprobs")
    log_w = importance_log_ratio(proximal_logprobs.detach(), behaviour_logprobs.detach(), mask, level=level)
    w = torch.exp(log_w.clamp(max=math.log(clip))).clamp(max=clip)  # exp(log C) may round above C
    return torch.where(mask, w, torch.zeros((), dtype=w.dtype, device=w.device))


def with_importance_correction(rollout: TensorDictBase, proximal_logprobs: torch.Tensor, *, clip: float = 1.0,
                               level: str = "token") -> TensorDictBase:
    """A copy of a scored rollout for the decoupled objective: ``advantages ← w·advantages``,
    ``old_logprobs ← proximal_logprobs`` (the clip is then around the learner's policy), with
    ``w = truncated_importance_weights(prox, old_logprobs, response_mask, clip=, level=)``."""
    w = truncated_importance_weights(proximal_logprobs, rollout[K.OLD_LOGPROBS], rollout[K.RESPONSE_MASK],
                                     clip=clip, level=level)
    return rollout.copy().update({K.ADVANTAGES: rollout[K.ADVANTAGES] * w.to(rollout[K.ADVANTAGES].dtype),
                                  K.OLD_LOGPROBS: proximal_logprobs.detach()})


def off_policy_metrics(rollout: TensorDictBase, proximal_logprobs: torch.Tensor,
                       learner_version: int) -> dict[str, torch.Tensor]:
    """Staleness and the behaviour-vs-learner gap of a rollout (detached scalars, no sync).

    ``staleness = learner_version − policy_version`` (mean and max over rows);
    ``logprob_gap = mean_{valid t}(log π_b − log π_prox)`` and its absolute version.
    """
    mask = rollout[K.RESPONSE_MASK]
    diff = rollout[K.OLD_LOGPROBS].detach() - proximal_logprobs.detach()
    stale = (learner_version - rollout[K.POLICY_VERSION]).to(torch.float64)
    return {"async/staleness": stale.mean(), "async/staleness_max": stale.max(),
            "async/logprob_gap": masked_mean(diff, mask), "async/logprob_abs_gap": masked_mean(diff.abs(), mask)}


# --- what the learner does with a generated rollout ------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Learner:
    """The algorithm-specific half of an online step, after generation: the recipe's own hooks.

    A synchronous recipe's ``step`` is ``collect_rollout(**score_options) → prepare → optimise``;
    :func:`learn` runs the same hooks on a rollout that the generator process produced.

    Attributes:
        config: the recipe's ``Config`` class (:func:`check_learner` checks the config is one).
        build_state: ``config -> (state, tokenizer)``, validating the config first (the recipe's
            models: a PPO state holds its critic and KL controller).
        score_options: ``(state, config) -> dict`` of ``collect_rollout``'s scoring options
            (``value_fn`` of the state's critic, ``reference=False``).
        prepare: ``(state, rollout, config) -> (state, batch, info)``: from the scored rollout to
            what the loss reads (advantages, GAE, preference pairs), and its metrics.
        optimise: ``(state, batch, config) -> (state, metrics)``: the update (impure).
        level: ``config -> str``, the level of the loss's importance ratio
            (``algorithms.ppo.RATIO_LEVELS``) for ``is_clip``, whose ``batch`` keeps the rollout's
            rows; ``None``: the loss has no ratio and ``is_clip`` is rejected.
    """

    config: type
    build_state: Callable[[Any], tuple[TrainState, Any]]
    score_options: Callable[[TrainState, Any], dict]
    prepare: Callable[[TrainState, TensorDictBase, Any], tuple[TrainState, TensorDictBase, dict]]
    optimise: Callable[[TrainState, TensorDictBase, Any], tuple[TrainState, TensorDict]]
    level: Callable[[Any], str] | None


def _recipe_learner(recipe: ModuleType, level: Callable[[Any], str] | None) -> Learner:
    return Learner(config=recipe.Config, build_state=recipe.build_state, score_options=recipe.score_options,
                   prepare=recipe.prepare, optimise=recipe.optimise, level=level)


def _grpo_level(config: Any) -> str:  # the signature sees through nested partials (a preset keeps its own)
    return inspect.signature(grpo.grpo_loss_fn(config)).parameters["ratio_level"].default


LEARNERS: dict[str, Learner] = {
    "grpo": _recipe_learner(grpo, level=_grpo_level),                     # the preset's ratio level
    "rloo": _recipe_learner(rloo, level=lambda config: "sequence_sum"),   # exp(Σ_t lp − Σ_t old)
    "ppo": _recipe_learner(ppo, level=lambda config: "token"),            # ppo_loss's token ratio
    "online_dpo": _recipe_learner(online_dpo, level=None),                # no ratio: is_clip rejected
}


def _check_ratio(learner: Learner, is_clip: float | None, *, who: str = "this learner's loss") -> None:
    if is_clip is not None and learner.level is None:
        raise ValueError(f"is_clip: {who} has no importance ratio to correct (its loss is an offline objective on "
                         "pairs); pass is_clip=None")


def check_learner(algorithm: str, config: Any, is_clip: float | None) -> Learner:
    """``LEARNERS[algorithm]``, after checking that ``config`` is its recipe's ``Config`` and that
    ``is_clip`` suits its loss (``None``, or ``C > 0`` for a loss with an importance ratio).

    Raises:
        ValueError: an unknown ``algorithm`` (listing ``LEARNERS``); ``is_clip`` for a loss with
            no ratio (online DPO), or not ``> 0``.
        TypeError: ``config`` of another recipe.
    """
    learner = lookup(LEARNERS, algorithm, what="algorithm")
    if not isinstance(config, learner.config):
        raise TypeError(f"config: algorithm {algorithm!r} needs a {learner.config.__module__}.Config, "
                        f"got {type(config).__module__}.{type(config).__qualname__}")
    _check_ratio(learner, is_clip, who=repr(algorithm))
    if is_clip is not None and not is_clip > 0:
        raise ValueError(f"is_clip: expected C > 0 or None for {algorithm!r}, got {is_clip}")
    return learner


def learn(state: TrainState, rows: Mapping[str, Sequence], rollout: TensorDictBase, *, config: Any, tokenizer,
          reward_fn, learner: Learner, is_clip: float | None = None) -> tuple[TrainState, TensorDict]:
    """Score a generated rollout and update on it, exactly as the synchronous recipe does after
    generating (impure: trains the policy).

    ``loops.online.score_collected`` with the learner's current models (reference, reward, the
    critic's values: ``learner.score_options``), which also replays the seed draw and advances
    the counters, then :func:`learn_scored`.

    Args:
        rows: the prompt batch (``P`` rows of columns) the rollout was sampled from.
        rollout: ``[B = P·G]`` from ``generate_rollout``, sampled with the seed that
            ``loops.collect.draw_seed`` draws from ``state.rng``.
        learner: an entry of ``LEARNERS``.  is_clip: see :func:`learn_scored`.
    Returns:
        ``(state, metrics)`` as the recipe's ``step``, plus the ``async/*`` metrics.
    """
    _check_ratio(learner, is_clip)
    state, rollout = score_collected(state, rows, rollout, config=config, tokenizer=tokenizer, reward_fn=reward_fn,
                                     **learner.score_options(state, config))
    return learn_scored(state, rollout, config=config, learner=learner, is_clip=is_clip)


def learn_scored(state: TrainState, rollout: TensorDictBase, *, config: Any, learner: Learner,
                 is_clip: float | None = None) -> tuple[TrainState, TensorDict]:
    """Update on a scored rollout as the synchronous recipe does (impure: trains the policy).

    The learner's own log-probs ``π_prox`` (one no-grad forward: the ``async/*`` metrics and the
    optional correction), ``learner.prepare``, then ``learner.optimise``. With ``is_clip`` the
    prepared batch's advantages are weighted and its ``old_logprobs`` replaced
    (:func:`with_importance_correction` at ``learner.level``); the ``rollout/*`` metrics stay those
    of the behaviour rollout.

    Args:
        state: as ``loops.online.score_collected`` returned it (seed draw and counters done).
        rollout: ``[B]`` with everything ``learner.prepare`` reads (``score``, and
            ``ref_logprobs`` / ``values`` as ``learner.score_options`` asks).
        is_clip: ``C > 0`` of the truncated importance weight, or ``None`` (off).
    Returns:
        ``(state, metrics)``: ``optimise``'s metrics with ``prepare``'s and the ``async/*`` ones.
    """
    _check_ratio(learner, is_clip)
    with torch.no_grad():
        prox = with_policy_logprobs(state.model("policy"), rollout, temperature=config.temperature)[K.LOGPROBS]
    stats = off_policy_metrics(rollout, prox, state.policy_version)
    state, batch, info = learner.prepare(state, rollout, config)
    if is_clip is not None:
        level, mask = learner.level(config), batch[K.RESPONSE_MASK]
        w = truncated_importance_weights(prox, batch[K.OLD_LOGPROBS], mask, clip=is_clip, level=level)
        stats["async/is_weight"] = masked_mean(w, mask)
        stats["async/is_truncated"] = masked_mean((w >= is_clip).to(torch.float64), mask)
        batch = with_importance_correction(batch, prox, clip=is_clip, level=level)
        info = {**rollout_metrics(rollout), **info}
    state, metrics = learner.optimise(state, batch, config)
    return state, metrics.update(info).update(stats)
