"""GRPO: G samples per prompt, group-relative advantages, a clipped policy loss, k3 KL in the loss.

One step reads top to bottom::

    collect   G = num_samples responses per prompt from the policy (loops.online.collect_rollout),
              scored by the task reward (or a reward model), with reference log-probs
    score     A_i = (r_i − μ_group)/(σ + eps) broadcast to the tokens
              (rlcore.baselines.with_grpo_advantage; scale="none" is Dr. GRPO, "batch" TRL's batch σ)
    update    POLICY_LOSSES[loss_type] (grpo / dr_grpo / dapo / gspo / cispo / ...), with
              kl_coef·k3(π‖π_ref) in the loss when kl_coef > 0, `epochs` passes of minibatches

The presets of ``rlcore.algorithms.policy_gradient`` carry their own clip ranges and aggregation;
``clip_eps_low`` / ``clip_eps_high`` override them only when set. ``max_length`` of Dr. GRPO's
constant normaliser is ``max_new_tokens``.

References:
    Shao et al., "DeepSeekMath" (GRPO), https://arxiv.org/abs/2402.03300
    Liu et al., "Understanding R1-Zero-Like Training: A Critical Perspective" (Dr. GRPO),
    https://arxiv.org/abs/2503.20783
    Yu et al., "DAPO", https://arxiv.org/abs/2503.14476; Zheng et al., "Group Sequence Policy
    Optimization", https://arxiv.org/abs/2507.18071; MiniMax-M1 (CISPO), https://arxiv.org/abs/2506.13585
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from tensordict import TensorDict, TensorDictBase

from rlcore.algorithms.policy_gradient import POLICY_LOSSES
from rlcore.baselines import with_grpo_advantage
from rlcore.checks import lookup
from rlcore.loops.online import OnlineConfig, collect_rollout, evaluate_policy, policy_update, train_online
from rlcore.loops.state import TrainState

__all__ = ["Config", "advantages", "step", "train", "evaluate", "grpo_loss_fn"]


@dataclasses.dataclass(frozen=True)
class Config(OnlineConfig):
    """GRPO recipe settings (shared fields: ``loops.online.OnlineConfig``)."""

    num_samples: int = 8             # G samples per prompt (TRL num_generations)
    loss_type: str = "grpo"          # a key of algorithms.policy_gradient.POLICY_LOSSES (TRL loss_type)
    clip_eps_low: float | None = None   # ε_low, None: the preset's (TRL epsilon)
    clip_eps_high: float | None = None  # ε_high, None: the preset's (TRL epsilon_high)
    kl_coef: float = 0.0             # β of the k3 KL in the loss (TRL beta)
    kl: str = "k3"                   # KL estimator in the loss (rlcore.kl.KL_ESTIMATORS)
    scale: str = "group"             # advantage σ: group | batch | none (TRL scale_rewards)
    eps: float = 1e-6                # added to σ (TRL uses 1e-4)
    run_dir: str | None = "runs/grpo"


def grpo_loss_fn(config: Any):
    """The loss of a GRPO update: ``POLICY_LOSSES[loss_type]`` bound to the config's keywords."""
    loss = lookup(POLICY_LOSSES, config.loss_type, what="loss_type")
    clip = {k: getattr(config, k) for k in ("clip_eps_low", "clip_eps_high") if getattr(config, k) is not None}
    return functools.partial(loss, kl_coef=config.kl_coef, kl=config.kl, max_length=config.max_new_tokens, **clip)


def advantages(rollout: TensorDictBase, config: Config) -> TensorDictBase:
    """Group-relative advantages of a scored rollout (``scale``, ``eps`` of ``config``)."""
    return with_grpo_advantage(rollout, scale=config.scale, eps=config.eps)


def step(state: TrainState, rows: dict, *, config: Config, tokenizer, reward_fn) -> tuple[TrainState, TensorDict]:
    """One GRPO step on a batch of prompts: collect → group advantages → update (impure: trains)."""
    state, rollout = collect_rollout(state, rows, config=config, tokenizer=tokenizer, reward_fn=reward_fn)
    return policy_update(state, advantages(rollout, config), grpo_loss_fn(config), config=config)


def evaluate(state: TrainState, config: Config) -> dict[str, float]:
    """Held-out reward, exact match (greedy) and KL to the reference: ``loops.online.evaluate_policy``."""
    return evaluate_policy(state, config)


def train(config: Config, *, reward_fn=None, callbacks=()) -> tuple[TrainState, list[dict[str, float]]]:
    """Train with GRPO from ``config``; ``reward_fn`` overrides the task reward. Returns ``(state, history)``."""
    grpo_loss_fn(config)  # an unknown loss_type fails before any model is built
    return train_online(config, step, reward_fn=reward_fn, name="grpo", callbacks=callbacks)
