"""PPO for language models (Ziegler et al. 2019; TRL's PPOTrainer): KL in the reward, GAE, K epochs.

One step reads top to bottom::

    collect   one response per prompt (num_samples) from the policy, scored by the task reward (or a
              reward model), with reference log-probs and the critic's values (loops.online.collect_rollout)
    score     score ← process_scores(score) with running moments (scale / normalize / clip), then
              r_t = −β·KL_t (+ score on the last token) with β from the KL controller
              (rlcore.rewards.with_rewards), optionally whitened (whiten_rewards), then GAE and
              advantages whitened over the rollout (rlcore.returns.with_gae, `whiten`)
    update    `epochs` passes of shuffled minibatches of ppo_loss (clipped surrogate + vf_coef·clipped
              value loss, ratio_threshold), stopped early when the policy KL passes 1.5·target_kl
    state     the KL controller sees the rollout's KL (mean_b Σ_t KL_t over `B` samples, TRL's choice)

The critic (``value_model``): ``"shared"``, a ``ValueHead`` on the policy's trunk (one trunk forward
gives logits and values; the value loss trains the trunk too, TRL's legacy layout), or
``"separate"``, a token-classification model of the same architecture (TRL 1.x's layout).

Every PPO option of TRL's ``PPOConfig`` that still matters is a field, named after the keyword it
feeds; the TRL name is in each field's comment. Not offered: ``kl_penalty="full"`` (needs the full
logits: ``rlcore.kl.kl_full``), ``compare_steps``, ``forward_batch_size`` (``micro_batch_size``).

References:
    Ziegler et al., "Fine-Tuning Language Models from Human Preferences", https://arxiv.org/abs/1909.08593
    Schulman et al., "Proximal Policy Optimization Algorithms", https://arxiv.org/abs/1707.06347
    Huang et al., "The N+ Implementation Details of RLHF with PPO", https://arxiv.org/abs/2403.17031
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn

from rlcore import keys as K
from rlcore.algorithms.ppo import early_stop, ppo_loss
from rlcore.checks import lookup
from rlcore.logprobs import token_logprobs
from rlcore.loops.models import ValueHead, policy_and_values, token_values
from rlcore.loops.online import OnlineConfig, collect_rollout, evaluate_policy, rollout_metrics, train_online, \
    update_sizes, with_policy_logprobs
from rlcore.loops.recipe import build_policy
from rlcore.loops.state import TrainState, with_transforms
from rlcore.loops.update import update
from rlcore.masked import masked_whiten
from rlcore.returns import with_gae
from rlcore.rewards import process_scores, with_rewards
from rlcore.transforms import kl_controller, observed_kl, running_moments_init, running_moments_update

__all__ = ["Config", "Critic", "CRITICS", "step", "train", "evaluate", "ppo_loss_fn", "value_fn"]


@dataclasses.dataclass(frozen=True)
class Config(OnlineConfig):
    """PPO recipe settings (shared fields: ``loops.online.OnlineConfig``); TRL ``PPOConfig`` names in comments."""

    value_model: str = "shared"      # critic: "shared" ValueHead on the policy trunk | "separate" model (CRITICS)
    kl_coef: float = 0.2             # initial β of the KL penalty in the reward (TRL init_kl_coef)
    kl_controller: str = "adaptive"  # "adaptive" | "fixed" (TRL adap_kl_ctrl=True/False)
    target: float = 6.0              # adaptive controller's target KL, nats per response (TRL target)
    horizon: float = 10000.0         # adaptive controller's horizon (TRL horizon)
    kl: str = "k1"                   # per-token KL estimator in the reward: k1 | abs | k2 (TRL kl_penalty kl|abs|mse)
    gamma: float = 1.0               # discount (TRL gamma)
    lam: float = 0.95                # GAE λ (TRL lam)
    whiten_rewards: bool = False     # scale per-token rewards by their std before GAE (TRL whiten_rewards)
    whiten: bool = True              # whiten the advantages over the rollout's tokens (TRL: always)
    clip_eps_low: float = 0.2        # ε_low of the ratio clip (TRL cliprange)
    clip_eps_high: float = 0.2       # ε_high of the ratio clip (TRL cliprange)
    cliprange_value: float | None = 0.2  # value clip around the rollout's values (TRL cliprange_value)
    vf_coef: float = 0.1             # value-loss weight (TRL vf_coef)
    epochs: int = 4                  # passes over each rollout (TRL ppo_epochs)
    ratio_threshold: float | None = 10.0  # skip a minibatch whose mean ratio exceeds this (TRL ratio_threshold)
    early_stopping: bool = False     # stop the epochs when the policy KL > 1.5·target_kl (TRL early_stopping)
    target_kl: float = 1.0           # the early-stopping KL (TRL target_kl)
    scale: bool = False              # score / running std (TRL use_score_scaling)
    normalize: bool = False          # (score − running mean) / running std (TRL use_score_norm)
    clip: float | None = None        # clamp processed scores to ±clip (TRL score_clip)
    run_dir: str | None = "runs/ppo"


# --- the critic ----------------------------------------------------------------------------------
class Critic(NamedTuple):
    """One critic layout: how to build it, its values at collect time, the training forward."""

    build: Callable[[nn.Module, Any], nn.Module]   # (policy, config) -> state.models["value"]
    values: Callable[[TrainState], Callable]       # state -> (input_ids, attention_mask) -> [B, T]
    forward: Callable[..., TensorDictBase]         # (state, batch, ids, mask, temperature) -> logprobs, value_preds


def _response(x: torch.Tensor, batch: TensorDictBase) -> torch.Tensor:
    """The response columns ``[B, R]`` of a ``[B, P+R(+1)]`` quantity read at the position before each token."""
    P, R = batch[K.PROMPT_IDS].shape[-1], batch[K.RESPONSE_IDS].shape[-1]
    return x[:, P - 1:P - 1 + R]


def _shared_head(policy: nn.Module, config: Any) -> nn.Module:
    return ValueHead(policy.config.hidden_size, seed=config.seed).to(next(policy.parameters()).device)


def _shared_values(state: TrainState) -> Callable:
    return functools.partial(token_values, state.model("policy"), head=state.model("value"))


def _shared_forward(state, batch, ids, mask, temperature):
    logits, values = policy_and_values(state.model("policy"), state.model("value"), ids, mask)  # one trunk pass
    lp = token_logprobs(_response(logits, batch), batch[K.RESPONSE_IDS], temperature=temperature)
    return batch.copy().update({K.LOGPROBS: lp, K.VALUE_PREDS: _response(values, batch)})


def _separate_model(policy: nn.Module, config: Any) -> nn.Module:
    return build_policy(config, task="value")[0]


def _separate_values(state: TrainState) -> Callable:
    return functools.partial(token_values, state.model("value"))


def _separate_forward(state, batch, ids, mask, temperature):
    batch = with_policy_logprobs(state.model("policy"), batch, temperature=temperature)
    return batch.update({K.VALUE_PREDS: _response(token_values(state.model("value"), ids, mask), batch)})


CRITICS: dict[str, Critic] = {
    "shared": Critic(_shared_head, _shared_values, _shared_forward),          # ValueHead on the trunk (TRL legacy)
    "separate": Critic(_separate_model, _separate_values, _separate_forward),  # token classifier (TRL 1.x)
}


def value_fn(state: TrainState, config: Config) -> Callable:
    """``(input_ids, attention_mask) -> values [B, T]`` of the state's critic (``loops.models.token_values``)."""
    return lookup(CRITICS, config.value_model, what="value_model").values(state)


def ppo_loss_fn(state: TrainState, batch: TensorDictBase, *, config: Config,
                **denominators) -> tuple[torch.Tensor, Any]:
    """The ``update`` loss of PPO: ``ppo_loss`` on log-probs and values through the models, plus the
    ``early_stop`` flag (``approx_kl_k1 > 1.5·target_kl``) when ``early_stopping``."""
    ids = torch.cat([batch[K.PROMPT_IDS], batch[K.RESPONSE_IDS]], -1)
    mask = torch.cat([batch[K.PROMPT_MASK], batch[K.RESPONSE_MASK]], -1)
    critic = lookup(CRITICS, config.value_model, what="value_model")
    batch = critic.forward(state, batch, ids, mask, config.temperature)  # logprobs, value_preds: differentiable
    loss, metrics = ppo_loss(batch, clip_eps_low=config.clip_eps_low, clip_eps_high=config.clip_eps_high,
                             vf_coef=config.vf_coef, cliprange_value=config.cliprange_value,
                             ratio_threshold=config.ratio_threshold, **denominators)
    if config.early_stopping:
        metrics = metrics.copy().update({"early_stop": early_stop(metrics["approx_kl_k1"], target_kl=config.target_kl)})
    return loss, metrics


# --- the step ------------------------------------------------------------------------------------
def step(state: TrainState, rows: dict, *, config: Config, tokenizer, reward_fn) -> tuple[TrainState, TensorDict]:
    """One PPO step on a batch of prompts: collect → rewards → GAE → K epochs of updates (impure)."""
    state, rollout = collect_rollout(state, rows, config=config, tokenizer=tokenizer, reward_fn=reward_fn,
                                     value_fn=value_fn(state, config))
    info = rollout_metrics(rollout)
    moments = running_moments_update(state.transforms["score_moments"], rollout[K.SCORE])
    score = process_scores(rollout[K.SCORE], moments, scale=config.scale, normalize=config.normalize, clip=config.clip)
    kl_state = state.transforms["kl"]
    rollout = with_rewards(rollout.copy().update({K.SCORE: score}), kl_coef=kl_state.coef, kl=config.kl)
    mask = rollout[K.RESPONSE_MASK]
    if config.whiten_rewards:
        rollout = rollout.update({K.REWARDS: masked_whiten(rollout[K.REWARDS], mask, shift_mean=False)})
    rollout = with_gae(rollout, gamma=config.gamma, lam=config.lam, whiten=config.whiten)
    state, metrics = update(state, rollout, functools.partial(ppo_loss_fn, config=config),
                            **update_sizes(config, rollout.batch_size[0]), epochs=config.epochs,
                            mask_key=K.RESPONSE_MASK, max_grad_norm=config.max_grad_norm)
    kl_update = kl_controller(config.kl_controller)[1]
    new_kl = kl_update(kl_state, observed_kl(rollout[K.KL], mask), rollout.batch_size[0], target=config.target,
                       horizon=config.horizon)
    state = with_transforms(state, kl=new_kl, score_moments=moments)
    return state, metrics.update({**info, "kl_coef": kl_state.coef, "rollout/score_processed": score.mean()})


def evaluate(state: TrainState, config: Config) -> dict[str, float]:
    """Held-out reward, exact match (greedy) and KL to the reference: ``loops.online.evaluate_policy``."""
    return evaluate_policy(state, config)


def train(config: Config, *, reward_fn=None, callbacks=()) -> tuple[TrainState, list[dict[str, float]]]:
    """Train with PPO from ``config``; ``reward_fn`` overrides the task reward. Returns ``(state, history)``."""
    critic = lookup(CRITICS, config.value_model, what="value_model")
    kl_init = kl_controller(config.kl_controller)[0]
    transforms = {"kl": kl_init(config.kl_coef), "score_moments": running_moments_init()}
    return train_online(config, step, reward_fn=reward_fn, name="ppo", callbacks=callbacks,
                        extra_models=lambda policy: {"value": critic.build(policy, config)},
                        trainable=("policy", "value"), transforms=transforms)
