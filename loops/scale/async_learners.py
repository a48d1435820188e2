"""The learner's half of asynchronous off-policy RLHF: a recipe's ``learn`` on a generated rollout.

A synchronous online recipe's ``step`` is ``sample → score_samples → learn``. The asynchronous loops
(``loops.scale.async_rl``'s generator process, ``loops.scale.placement``'s Ray actors) generate elsewhere and
hand the rollout to :func:`learn_off_policy`: the seed draw replayed, ``loops.online.score_samples``
(the scores the learner's state holds models for, the counters), then the recipe's own ``learn``
(:func:`online_recipe`: the entry of ``loops.recipes.RECIPES`` whose ``Config`` the config is) with
the optional importance correction.

Off-policy correction (``is_clip = C``): with ``π_prox`` the learner's policy before the update
(one no-grad forward) and ``π_b`` the generator's (the behaviour log-probs), the loss's ratio is
taken against ``π_prox`` and the advantages are weighted by ``w = min(π_prox/π_b, C)``, detached:
the decoupled PPO objective with a truncated importance weight, at the level of the loss's
ratio (the recipe's ``ratio_level`` of the config): per token for PPO and token-ratio GRPO presets, the
sequence's mean for GSPO, the sequence's sum for RLOO. PPO's value loss is not reweighted (its
values and returns come from the learner's critic). Online DPO has no ratio (the DPO loss is an
offline objective on pairs, off-policy by construction): ``is_clip`` is rejected with a
``ValueError``. ``is_clip=None`` keeps the behaviour log-probs as the loss's ``old_logprobs``
(the clipped ratio then absorbs the lag, as in the paper).

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

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from rlcore import keys as K
from rlcore.algorithms.ratios import importance_log_ratio
from rlcore.checks import check_mask, check_same_shape
from rlcore.loops.online import Correction, replay_seed_draw, score_samples, with_policy_logprobs
from rlcore.loops.recipes import RECIPES, Recipe, by_config
from rlcore.loops.state import TrainState
from rlcore.masked import masked_mean

__all__ = ["truncated_importance_weights", "with_importance_correction", "off_policy_metrics", "online_recipe",
           "check_learner", "importance_correction", "learn_off_policy"]


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
        level: a key of ``algorithms.ratios.RATIO_LEVELS``.
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
def online_recipe(config: Any) -> Recipe:
    """The recipe of ``loops.recipes.RECIPES`` whose ``Config`` is ``config``'s type (``by_config``),
    which must have a ``learn`` and a ``build_state`` (``grpo``, ``rloo``, ``ppo``, ``online_dpo``).
    A subclass is not its parent's recipe (the ReFT recipes' configs: their entries have no ``learn``).

    Raises:
        TypeError: ``config`` is the Config of no recipe with a ``learn``.
    """
    recipe = by_config(type(config))
    if recipe is not None and recipe.learn is not None and recipe.build_state is not None:
        return recipe
    online = [r.name for r in RECIPES.values() if r.learn is not None]
    raise TypeError(f"config: expected the Config of an online recipe (a recipe with a learn: {', '.join(online)}), "
                    f"got {type(config).__module__}.{type(config).__qualname__}")


def check_learner(config: Any, is_clip: float | None) -> Recipe:
    """:func:`online_recipe` of ``config``, after checking that ``is_clip`` suits its loss: ``None``, or
    ``C > 0`` for a loss with an importance ratio (the recipe's ``ratio_level`` not ``None``).

    Raises:
        TypeError: ``config`` of no online recipe.
        ValueError: ``is_clip`` for a loss with no ratio (online DPO), or not ``> 0``; a config
            with ``dynamic_sampling``.
    """
    recipe = online_recipe(config)
    if getattr(config, "dynamic_sampling", False):
        raise ValueError("dynamic_sampling: refilling a step with fresh prompts is a synchronous loop's; the "
                         "asynchronous and Ray learners train on the rollouts their actors send (set it false)")
    if is_clip is not None and recipe.ratio_level is None:
        raise ValueError(f"is_clip: {recipe.name!r} has no importance ratio to correct (its "
                         "loss is an offline objective on pairs); pass is_clip=None")
    if is_clip is not None and not is_clip > 0:
        raise ValueError(f"is_clip: expected C > 0 or None, got {is_clip}")
    if is_clip is not None:
        recipe.ratio_level(config)  # a loss with no declared level is named now, before any model is built
    return recipe


def importance_correction(proximal_logprobs: torch.Tensor, *, clip: float, level: str) -> Correction:
    """The ``correction`` a recipe's ``learn`` applies to its batch once the advantages are in:
    :func:`with_importance_correction` at ``level``, with ``async/is_weight`` (mean weight) and
    ``async/is_truncated`` (the fraction at ``C``) as its metrics."""
    def correct(batch: TensorDictBase) -> tuple[TensorDictBase, dict[str, torch.Tensor]]:
        mask = batch[K.RESPONSE_MASK]
        w = truncated_importance_weights(proximal_logprobs, batch[K.OLD_LOGPROBS], mask, clip=clip, level=level)
        stats = {"async/is_weight": masked_mean(w, mask),
                 "async/is_truncated": masked_mean((w >= clip).to(torch.float64), mask)}
        return with_importance_correction(batch, proximal_logprobs, clip=clip, level=level), stats
    return correct


def learn_off_policy(state: TrainState, rows: Mapping[str, Sequence], rollout: TensorDictBase, *, config: Any,
                     tokenizer=None, reward_fn=None, is_clip: float | None = None) -> tuple[TrainState, TensorDict]:
    """Score a generated rollout and update on it with the recipe's ``learn``, exactly as the
    synchronous recipe does after generating (impure: trains the policy).

    ``loops.online.replay_seed_draw`` (the draw the generator sampled with), then
    ``loops.online.score_samples`` with the learner's current models (reference, reward model,
    the critic's values: those the state holds; the Ray learner's state holds no reference or
    reward model, the scorer added theirs) and the counters; the learner's own log-probs ``π_prox`` (one no-grad forward: the ``async/*``
    metrics); then the recipe's ``learn`` (:func:`online_recipe`), with :func:`importance_correction` at
    its ``ratio_level(config)`` when ``is_clip`` is set.

    Args:
        rows: the prompt batch (``P`` rows of columns) the rollout was sampled from.
        rollout: ``[B = P·G]`` from ``generate_rollout``, sampled with the seed that
            ``loops.collect.draw_seed`` draws from ``state.rng``.
        tokenizer, reward_fn: as the recipe's step (``None`` where the rollout is already scored).
        is_clip: ``C > 0`` of the truncated importance weight, or ``None`` (off).
    Returns:
        ``(state, metrics)`` as the recipe's ``step``, plus the ``async/*`` metrics.
    """
    recipe = check_learner(config, is_clip)
    state, rollout = score_samples(replay_seed_draw(state), rows, rollout, generation=config, rewards=config,
                                   tokenizer=tokenizer, reward_fn=reward_fn, total_steps=config.steps,
                                   reference=recipe.rollout_ref_logprobs(config))
    with torch.no_grad():
        prox = with_policy_logprobs(state.model("policy"), rollout, temperature=config.temperature)[K.LOGPROBS]
    stats = off_policy_metrics(rollout, prox, state.policy_version)
    if is_clip is None or recipe.ratio_level is None:  # (check_learner refused is_clip for a loss with no ratio)
        state, metrics = recipe.learn(state, rollout, config)
    else:
        correction = importance_correction(prox, clip=is_clip, level=recipe.ratio_level(config))
        state, metrics = recipe.learn(state, rollout, config, correction=correction)
    return state, metrics.update(stats)
