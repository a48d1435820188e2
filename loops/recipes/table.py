"""The recipe table: one :class:`Recipe` value per trainer, ``RECIPES`` by name, :func:`by_config` by ``Config`` type.

A ``Recipe`` holds, as fields, everything code above the recipes needs of one: the command line
(``loops.cli``: its ``Config``, ``train``, ``evaluate``, how a checkpoint becomes a state, the
model task of its policy) and the orchestration (``loops.scale``: ``build_state`` and the ``learn``
that the asynchronous and Ray learners run on a rollout, the level of its loss's importance ratio,
where the reference scores). Nothing finds a recipe's behaviour any other way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from rlcore.loops.recipes import (ddpo, dpo, grpo, online_dpo, ppo, reft, reft_recipes, reward, rloo,
                                  sft)
from rlcore.loops.state import TrainState

__all__ = ["Recipe", "RECIPES", "by_config"]


def _with_reference(config: Any) -> bool:
    return True


def _no_reference(config: Any) -> bool:
    return False


@dataclasses.dataclass(frozen=True)
class Recipe:
    """One trainer, as the command line and the orchestration run it."""

    name: str                        # rlcore train NAME
    doc: str                         # one line, as `rlcore recipes` lists it
    config: type                     # its Config dataclass
    train: Callable[..., tuple[TrainState, list[dict[str, float]]]]  # train(config, *, callbacks=()) -> (state, history)
    evaluate: Callable[..., dict[str, float]]  # evaluate(state, config) -> held-out metrics
    build_state: Callable[..., Any] | None = None  # config -> the run's state (an online recipe's: (state, tokenizer))
    step: Callable[..., tuple[TrainState, Any]] | None = None  # step(state, item, *, config, ...) -> (state, metrics)
    # learn(state, rollout, config, [correction=]) on a scored rollout: what the asynchronous and Ray learners
    # run; None: the recipe does not run asynchronously
    learn: Callable[..., tuple[TrainState, Any]] | None = None
    # (config, checkpoint path) -> its state, for a recipe whose state is no language-model policy;
    # None: `rlcore eval` builds the policy from the checkpoint and `rlcore export` writes it
    checkpoint_state: Callable[[Any, str | Path], TrainState] | None = None
    model_task: str = "causal_lm"    # the task of its policy model (loops.models.TASKS)
    # config -> the level of the loss's importance ratio (algorithms.ratios.RATIO_LEVELS), which the
    # asynchronous correction weights at; None: no ratio (is_clip is refused)
    ratio_level: Callable[[Any], str] | None = None
    advantage_inputs: tuple[str, ...] = ()  # the learner batch's keys an advantage estimator may read
    # config -> whether scoring a rollout adds the reference's log-probs (loops.online.score_samples)
    rollout_ref_logprobs: Callable[[Any], bool] = _with_reference
    learn_uses_ref: bool = False     # learn runs the reference itself (the Ray learner keeps it)


def _summary(module: ModuleType) -> str:
    return (module.__doc__ or "").strip().splitlines()[0]


RECIPES: dict[str, Recipe] = {r.name: r for r in [
    Recipe("sft", _summary(sft), sft.Config, sft.train, sft.evaluate, step=sft.sft_step),
    Recipe("reward", _summary(reward), reward.Config, reward.train, reward.evaluate, step=reward.reward_step,
           model_task=reward.MODEL_TASK),
    Recipe("dpo", _summary(dpo), dpo.Config, dpo.train, dpo.evaluate, step=dpo.dpo_step),
    Recipe("ppo", _summary(ppo), ppo.Config, ppo.train, ppo.evaluate, build_state=ppo.build_state, step=ppo.step,
           learn=ppo.learn, ratio_level=ppo.ratio_level),
    Recipe("rloo", _summary(rloo), rloo.Config, rloo.train, rloo.evaluate, build_state=rloo.build_state,
           step=rloo.step, learn=rloo.learn, ratio_level=rloo.ratio_level, advantage_inputs=rloo.ADVANTAGE_INPUTS),
    Recipe("grpo", _summary(grpo), grpo.Config, grpo.train, grpo.evaluate, build_state=grpo.build_state,
           step=grpo.step, learn=grpo.learn, ratio_level=grpo.ratio_level, advantage_inputs=grpo.ADVANTAGE_INPUTS,
           rollout_ref_logprobs=grpo.rollout_ref_logprobs),
    Recipe("online_dpo", _summary(online_dpo), online_dpo.Config, online_dpo.train, online_dpo.evaluate,
           build_state=online_dpo.build_state, step=online_dpo.step, learn=online_dpo.learn,
           rollout_ref_logprobs=_no_reference, learn_uses_ref=True),
    Recipe("ddpo", _summary(ddpo), ddpo.Config, ddpo.train, ddpo.evaluate, build_state=ddpo.build_state,
           step=ddpo.step, checkpoint_state=ddpo.checkpoint_state),
    Recipe("reft", _summary(reft), reft.ReftConfig, reft.train_reft_sft, reft.evaluate, step=reft.reft_sft_step,
           checkpoint_state=reft.checkpoint_state),
    Recipe("reft_grpo", "GRPO of ReFT interventions on a frozen model (the base model is the reference).",
           reft_recipes.ReftGrpoConfig, reft_recipes.train_reft_policy_gradient, grpo.evaluate,
           step=reft.reft_grpo_step, checkpoint_state=reft_recipes.online_checkpoint_state,
           advantage_inputs=grpo.ADVANTAGE_INPUTS, rollout_ref_logprobs=grpo.rollout_ref_logprobs),
    Recipe("reft_rloo", "RLOO of ReFT interventions on a frozen model (the base model is the reference).",
           reft_recipes.ReftRlooConfig, reft_recipes.train_reft_policy_gradient, rloo.evaluate,
           step=reft.reft_rloo_step, checkpoint_state=reft_recipes.online_checkpoint_state,
           advantage_inputs=rloo.ADVANTAGE_INPUTS),
    Recipe("reft_dpo", "DPO-family preference optimisation of ReFT interventions on a frozen model.",
           reft_recipes.ReftDpoConfig, reft_recipes.train_reft_dpo, reft_recipes.evaluate_reft_dpo,
           step=reft.reft_dpo_step, checkpoint_state=reft_recipes.dpo_checkpoint_state),
    Recipe("reft_reward", "Reward modelling with ReFT interventions and the score head of a frozen classifier.",
           reft_recipes.ReftRewardConfig, reft_recipes.train_reft_reward, reft_recipes.evaluate_reft_reward,
           step=reward.reward_step, checkpoint_state=reft_recipes.reward_checkpoint_state,
           model_task=reward.MODEL_TASK),
]}

def by_config(config_type: type) -> Recipe | None:
    """The recipe of ``RECIPES`` whose ``Config`` is ``config_type`` (each belongs to one), read from
    the table as it is now, so an entry a user adds is found too; ``None`` for no recipe's."""
    return next((r for r in RECIPES.values() if r.config is config_type), None)
