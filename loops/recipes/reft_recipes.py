"""ReFT recipes from a config: GRPO, RLOO, DPO and reward modelling of interventions on a frozen model.

Each is the recipe of ``rlcore.loops`` it names, with the intervention fields of
``loops.recipes.reft.ReftFields`` added to that recipe's ``Config`` and its loss closure run inside
``intervened`` (``loops.reft_model``):

- ``GRPO`` / ``RLOO`` (``rlcore train reft_grpo`` / ``reft_rloo``): ``train_reft_online`` with the
  policy a ``ReftModel`` and the base model the reference;
- ``DPO`` (``reft_dpo``): ``reft_dpo_step`` on pairs with intervention locations, the base model as
  the reference (no copy), any pairwise loss of ``rlcore.algorithms.preference.PREFERENCE_LOSSES``;
- ``REWARD`` (``reft_reward``, pyreft's reward example): ``loops.recipes.reward.reward_step`` with the
  interventions at the pairs' prompt positions and the classifier's score head trained with them.

Each is a ``Recipe`` of ``loops.recipes.RECIPES`` (its ``Config``, ``train``, ``evaluate`` and
``checkpoint_state`` here). ``zero_init`` (default on) starts the interventions as the
identity, so the policy starts as its reference.

References:
    Wu et al., "ReFT: Representation Finetuning for Language Models", https://arxiv.org/abs/2404.03592.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any
from pathlib import Path

import torch
from tensordict import TensorDict
from torch import nn

from rlcore.loops.recipes import dpo, grpo, reward, rloo
from rlcore.loops.checkpoint import load_checkpoint
from rlcore.loops.recipes.dpo import preference_loss_fn, with_reference
from rlcore.loops.models import pad_token_id
from rlcore.loops.online import build_online_state
from rlcore.loops.recipe import (batch_source, build_policy, init_train_state, load_splits, mean_metrics,
                                 policy_tokenizer, require_held_out, run)
from rlcore.loops.config import autocast_dtype
from rlcore.loops.recipes.reft import (ReftFields, new_interventions, reft_dpo_step, reft_grpo_step, reft_online_models,
                                       reft_rloo_step, reft_spec, train_reft_online)
from rlcore.loops.reft_data import collate_reft, with_intervention_locations
from rlcore.loops.reft_model import with_interventions
from rlcore.loops.state import TrainState
from rlcore.loops.tasks import preference_dataset
from rlcore.loops.tokenization import PAIR_SIDES, check_rows_fit

__all__ = ["ReftGrpoConfig", "ReftRlooConfig", "ReftDpoConfig", "ReftRewardConfig", "train_reft_policy_gradient",
           "online_checkpoint_state", "train_reft_dpo", "evaluate_reft_dpo", "dpo_checkpoint_state",
           "train_reft_reward", "evaluate_reft_reward", "reward_checkpoint_state"]


# --- configs -----------------------------------------------------------------------------------
def single_turn(config: grpo.Config | rloo.Config) -> None:
    """Refuse an environment for a ReFT policy (its interventions sit at positions of the prompt, which
    a multi-turn episode's growing context would move from turn to turn) and the vLLM engine (it
    samples from the plain weights, without the interventions)."""
    if config.env is not None or config.tools:
        raise ValueError("env: a ReFT policy intervenes at its prompt's positions, which the growing context of a "
                         "multi-turn episode moves; the ReFT recipes train on single turns (unset env and tools)")
    if config.engine == "vllm":
        raise ValueError("engine: vLLM samples from the model's plain weights, without the ReFT interventions; use "
                         "engine loop or hf")


def padded(config: Any) -> None:
    """Refuse padding-free forwards and token budgets for a ReFT policy: its interventions are placed
    by each padded row's positions (``with_intervention_locations``), which packing would move."""
    for name in ("padding_free", "max_tokens_per_micro_batch"):
        if getattr(config, name, None):
            raise ValueError(f"{name}: a ReFT policy's interventions sit at positions of its padded rows; the ReFT "
                             f"recipes train on padded micro-batches of micro_batch_size rows (unset {name})")


@dataclasses.dataclass(frozen=True)
class ReftGrpoConfig(ReftFields, grpo.Config, defaults={"run_dir": "runs/reft_grpo"}):
    """GRPO with ReFT (``rlcore train reft_grpo``): ``loops.recipes.grpo.Config`` and ``ReftFields``."""

    def check(self) -> None:
        super().check()
        single_turn(self)
        padded(self)


@dataclasses.dataclass(frozen=True)
class ReftRlooConfig(ReftFields, rloo.Config, defaults={"run_dir": "runs/reft_rloo"}):
    """RLOO with ReFT (``rlcore train reft_rloo``): ``loops.recipes.rloo.Config`` and ``ReftFields``."""

    def check(self) -> None:
        super().check()
        single_turn(self)
        padded(self)


@dataclasses.dataclass(frozen=True)
class ReftDpoConfig(ReftFields, dpo.Config, defaults={"run_dir": "runs/reft_dpo"}):
    """DPO with ReFT (``rlcore train reft_dpo``): ``loops.recipes.dpo.Config`` and ``ReftFields``; pairwise
    losses (KTO's unpaired rows are not offered), the base model as the reference."""

    def __post_init__(self):
        super().__post_init__()
        padded(self)


@dataclasses.dataclass(frozen=True)
class ReftRewardConfig(ReftFields, reward.Config, defaults={"run_dir": "runs/reft_reward"}):
    """Reward modelling with ReFT (``rlcore train reft_reward``, pyreft's reward example):
    ``loops.recipes.reward.Config`` and ``ReftFields``. The interventions edit the pairs' prompt positions
    and the model's score head trains with them; the rest of the model is frozen."""

    def __post_init__(self):
        super().__post_init__()
        padded(self)


# --- the recipes ---------------------------------------------------------------------------------
_ONLINE_STEPS = {ReftGrpoConfig: reft_grpo_step, ReftRlooConfig: reft_rloo_step}


def train_reft_policy_gradient(config: ReftGrpoConfig | ReftRlooConfig, *, reward_fn=None,
                               callbacks: Sequence[Callable] = ()) -> tuple[TrainState, list[dict[str, float]]]:
    """GRPO (``ReftGrpoConfig``) or RLOO (``ReftRlooConfig``) with ReFT: ``train_reft_online`` with the
    recipe's step, the config's spec and ``zero_init``. Returns ``(state, history)``."""
    step = _ONLINE_STEPS[type(config)]
    return train_reft_online(config, step, reft_spec(config), zero_init=config.zero_init, reward_fn=reward_fn,
                             callbacks=callbacks)


def online_checkpoint_state(config: ReftGrpoConfig | ReftRlooConfig, path: str | Path) -> TrainState:
    """The state of a ReFT GRPO / RLOO checkpoint: ``ReftModel(base)`` with the saved interventions,
    the base model as the reference."""
    state, _ = build_online_state(config, extra_models=reft_online_models(reft_spec(config), seed=config.seed))
    return load_checkpoint(path, state, restore_global_rng=False)


def _reft_dpo_setup(config: ReftDpoConfig):
    """(state, train pairs, held-out pairs, tokenizer, loss) of ReFT DPO."""
    loss = dpo.bind_loss(config)
    if config.loss_type in dpo.UNPAIRED:
        raise ValueError(f"loss_type: {config.loss_type!r} trains on unpaired rows; ReFT DPO takes pairwise losses")
    if config.sync_ref_model:
        raise ValueError("sync_ref_model: the ReFT reference is the frozen base model itself; it cannot move")
    tokenizer = policy_tokenizer(config)  # the data is read and checked before any model is built
    train, held_out = (dpo._prepare(d, tokenizer, config) for d in load_splits(config, preference_dataset))
    model, tokenizer = build_policy(config)
    check_rows_fit(model, PAIR_SIDES, "max_length", train=train, held_out=held_out)
    model.requires_grad_(False)
    models = {"policy": model, "interventions": new_interventions(model, reft_spec(config), config.zero_init,
                                                                   config.seed)}
    if dpo.needs_reference(config) and config.precompute_ref:  # the base model scores once, before training
        train, held_out = (dpo._with_ref_columns(d, model, tokenizer, config) for d in (train, held_out))
    elif dpo.needs_reference(config):
        models["ref"] = model  # the base model, interventions off: no copy
    state = init_train_state(models, config, trainable=("interventions",))
    return state, train, held_out, tokenizer, loss


def _dpo_collate(tokenizer, config: ReftDpoConfig) -> Callable[[dict], TensorDict]:
    return functools.partial(collate_reft, "preference", pad_id=pad_token_id(tokenizer), spec=reft_spec(config))


@torch.no_grad()
def _reft_dpo_eval(state: TrainState, data, tokenizer, config: ReftDpoConfig, loss: Callable) -> dict[str, float]:
    collate_fn, device = _dpo_collate(tokenizer, config), next(state.model("policy").parameters()).device
    loss_fn = with_interventions(functools.partial(preference_loss_fn, loss=loss, chunked=config.chunked))

    def results():
        for i in range(0, len(data), config.eval_batch_size):
            batch = with_reference(state, collate_fn(data[i:i + config.eval_batch_size]).to(device),
                                   chunked=config.chunked)
            yield batch.batch_size[0], loss_fn(state, batch)[1]

    return mean_metrics(results())


def train_reft_dpo(config: ReftDpoConfig, *, callbacks: Sequence[Callable] = ()
                   ) -> tuple[TrainState, list[dict[str, float]]]:
    """DPO-family preference optimisation of ReFT interventions on a frozen model, from a config:
    ``run(reft_dpo_step, ...)`` with evaluation (``rewards/accuracies``, margins, the loss) of the
    held-out pairs with the interventions on. The reference is the base model. ``(state, history)``."""
    state, train, held_out, tokenizer, loss = _reft_dpo_setup(config)
    source = batch_source(train, config.batch_size, _dpo_collate(tokenizer, config), seed=config.seed)
    step = functools.partial(reft_dpo_step, loss=loss, chunked=config.chunked, micro_batch_size=config.micro_batch_size,
                             max_grad_norm=config.max_grad_norm, autocast_dtype=autocast_dtype(config))
    eval_fn = functools.partial(_reft_dpo_eval, data=held_out, tokenizer=tokenizer, config=config, loss=loss)
    return run(step, state, source, config=config, num_steps=config.steps, eval_fn=eval_fn, name="reft_dpo",
               callbacks=callbacks, tokenizer=tokenizer)


def evaluate_reft_dpo(state: TrainState, config: ReftDpoConfig) -> dict[str, float]:
    """Held-out preference metrics of ``state``'s interventions (as during ``train_reft_dpo``)."""
    require_held_out(config)
    _, _, held_out, tokenizer, loss = _reft_dpo_setup(config)
    return _reft_dpo_eval(state, held_out, tokenizer, config, loss)


def dpo_checkpoint_state(config: ReftDpoConfig, path: str | Path) -> TrainState:
    """The state of a ReFT DPO checkpoint: the base model with the saved interventions."""
    state = _reft_dpo_setup(config)[0]
    return load_checkpoint(path, state, restore_global_rng=False)


def _score_head(model: nn.Module) -> nn.Module:
    head = getattr(model, "score", None)
    if not isinstance(head, nn.Module):
        raise ValueError(f"model: ReFT reward modelling trains the sequence classifier's score head, and "
                         f"{type(model).__name__} has no `score` module")
    return head


def _reft_reward_setup(config: ReftRewardConfig):
    """(state, train pairs, held-out pairs, tokenizer, collate) of ReFT reward modelling."""
    tokenizer = policy_tokenizer(config)  # the data is read and checked before any model is built
    train, held_out = (reward._prepare(d, tokenizer, config) for d in load_splits(config, preference_dataset))
    if not any(train["prompt_ids"]):
        raise ValueError("dataset: the interventions edit prompt positions, and these pairs have no prompt "
                         "(pre-tokenised input_ids_chosen / input_ids_rejected); give prompt / chosen / rejected text")
    model, tokenizer = build_policy(config, task=reward.MODEL_TASK)  # a sequence classifier
    check_rows_fit(model, PAIR_SIDES, "max_length", train=train, held_out=held_out)
    model.requires_grad_(False)
    _score_head(model).requires_grad_(True)
    spec = reft_spec(config)
    state = init_train_state({"policy": model, "interventions": new_interventions(model, spec, config.zero_init,
                                                                                   config.seed)},
                             config, trainable=("policy", "interventions"))

    def collate(rows: dict) -> TensorDict:
        return with_intervention_locations(reward.collate_pairs(rows, pad_id=pad_token_id(tokenizer),
                                                                margin_key=config.margin_key), spec)
    return state, train, held_out, tokenizer, collate


def train_reft_reward(config: ReftRewardConfig, *, callbacks: Sequence[Callable] = ()
                      ) -> tuple[TrainState, list[dict[str, float]]]:
    """Reward modelling of ReFT interventions (and the score head) on a frozen sequence classifier:
    ``loops.recipes.reward.reward_step`` with its loss inside ``intervened``. ``(state, history)``."""
    state, train, held_out, tokenizer, collate = _reft_reward_setup(config)
    step = functools.partial(reward.reward_step, margin_key=config.margin_key,
                             center_rewards_coefficient=config.center_rewards_coefficient,
                             micro_batch_size=config.micro_batch_size, max_grad_norm=config.max_grad_norm,
                             wrap_loss=with_interventions, autocast_dtype=autocast_dtype(config))
    eval_fn = functools.partial(reward._evaluate, data=held_out, tokenizer=tokenizer, config=config, collate=collate,
                                wrap_loss=with_interventions)
    return run(step, state, batch_source(train, config.batch_size, collate, seed=config.seed), config=config,
               num_steps=config.steps, eval_fn=eval_fn, name="reft_reward", callbacks=callbacks, tokenizer=tokenizer)


def evaluate_reft_reward(state: TrainState, config: ReftRewardConfig) -> dict[str, float]:
    """Held-out ``accuracy``, ``margin`` and ``loss`` of ``state``'s ReFT reward model."""
    require_held_out(config)
    _, _, held_out, tokenizer, collate = _reft_reward_setup(config)
    return reward._evaluate(state, held_out, tokenizer, config, collate=collate, wrap_loss=with_interventions)


def reward_checkpoint_state(config: ReftRewardConfig, path: str | Path) -> TrainState:
    """The state of a ReFT reward checkpoint: the model (its trained head) and the interventions."""
    return load_checkpoint(path, _reft_reward_setup(config)[0], restore_global_rng=False)

