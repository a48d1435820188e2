"""RLOO: G samples per prompt, k1 KL summed into the reward, leave-one-out baseline, sequence ratio.

One step reads top to bottom (TRL's RLOO trainer)::

    collect   G = num_samples responses per prompt (loops.online.collect_rollout), scored by the
              task reward (or a reward model), with reference log-probs
    score     r_t = −β·(old_t − ref_t) on every token + score on the last one
              (rlcore.rewards.with_rewards, k1), so Σ_t r_t = score − β·Σ_t k1;
              A_i = R_i − mean_{j≠i} R_j (rlcore.baselines.with_rloo_advantage)
    update    ρ_i = exp(Σ_t lp − Σ_t old), mean_i max(−A_iρ_i, −A_i·clip(ρ_i, 1−ε_lo, 1+ε_hi))
              (algorithms.policy_gradient.rloo_loss), `epochs` passes of minibatches

References:
    Ahmadian et al., "Back to Basics: Revisiting REINFORCE Style Optimization for Learning from
    Human Feedback in LLMs", https://arxiv.org/abs/2402.14740
    Kool et al., "Buy 4 REINFORCE Samples, Get a Baseline for Free!",
    https://openreview.net/forum?id=r1lgTGL5DE
"""

from __future__ import annotations

import dataclasses
import functools

from tensordict import TensorDict, TensorDictBase

from rlcore.algorithms.policy_gradient import rloo_loss
from rlcore.baselines import with_rloo_advantage
from rlcore.loops.online import OnlineConfig, collect_rollout, evaluate_policy, policy_update, train_online
from rlcore.loops.state import TrainState
from rlcore.rewards import with_rewards

__all__ = ["Config", "advantages", "rloo_loss_fn", "step", "train", "evaluate"]


@dataclasses.dataclass(frozen=True)
class Config(OnlineConfig):
    """RLOO recipe settings (shared fields: ``loops.online.OnlineConfig``)."""

    num_samples: int = 2             # G ≥ 2 samples per prompt, the leave-one-out group (TRL num_generations)
    kl_coef: float = 0.05            # β of the k1 KL penalty in the reward (TRL beta)
    kl: str = "k1"                   # KL estimator in the reward (rlcore.kl.KL_ESTIMATORS; TRL: k1)
    clip_eps_low: float = 0.2        # ε_low of the sequence-ratio clip (TRL epsilon / cliprange)
    clip_eps_high: float = 0.2       # ε_high (TRL epsilon_high)
    run_dir: str | None = "runs/rloo"


def advantages(rollout: TensorDictBase, config: Config) -> TensorDictBase:
    """KL-penalised rewards (k1 summed into the score, as TRL's RLOO) and leave-one-out advantages."""
    return with_rloo_advantage(with_rewards(rollout, kl_coef=config.kl_coef, kl=config.kl))


def rloo_loss_fn(config: Config):
    """``rloo_loss`` (sequence-level ratio) with the config's clip range bound."""
    return functools.partial(rloo_loss, clip_eps_low=config.clip_eps_low, clip_eps_high=config.clip_eps_high)


def step(state: TrainState, rows: dict, *, config: Config, tokenizer, reward_fn) -> tuple[TrainState, TensorDict]:
    """One RLOO step on a batch of prompts: collect → KL-penalised rewards → LOO advantages → update."""
    state, rollout = collect_rollout(state, rows, config=config, tokenizer=tokenizer, reward_fn=reward_fn)
    return policy_update(state, advantages(rollout, config), rloo_loss_fn(config), config=config)


def evaluate(state: TrainState, config: Config) -> dict[str, float]:
    """Held-out reward, exact match (greedy) and KL to the reference: ``loops.online.evaluate_policy``."""
    return evaluate_policy(state, config)


def train(config: Config, *, reward_fn=None, callbacks=()) -> tuple[TrainState, list[dict[str, float]]]:
    """Train with RLOO from ``config``; ``reward_fn`` overrides the task reward. Returns ``(state, history)``."""
    if config.num_samples < 2:
        raise ValueError(f"num_samples: RLOO needs at least 2 samples per prompt (a leave-one-out baseline), "
                         f"got {config.num_samples}")
    return train_online(config, step, reward_fn=reward_fn, name="rloo", callbacks=callbacks)
