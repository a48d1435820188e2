"""Online DPO: G ≥ 2 samples per prompt, judged, best against worst, any DPO-family loss.

One step reads top to bottom::

    collect   G = num_samples responses per prompt from the current policy
              (loops.online.collect_rollout), scored by the task reward or a reward model (the judge)
    score     per prompt its best-scored sample as `chosen`, its worst as `rejected`
              (algorithms.online.online_preference_batch; prompts whose samples all tie are dropped),
              then the reference log-probs of both sides (frozen copy of the initial policy,
              loops.dpo.with_reference)
    update    the selected loss (loops.dpo.LOSSES: sigmoid, ipo, hinge, ... of algorithms.dpo, and
              the reference-free simpo / orpo / cpo) on the policy's log-probs of the pairs

Choices: the pairs' log-probs (policy and reference) are of the policy itself, at temperature 1,
whatever the sampling ``temperature`` (DPO's implicit reward is ``β·log π/π_ref`` of the policy
being trained; sampling hotter only explores). A step whose prompts all tie has no pair and takes
no optimiser step (``rollout/pairs`` = 0 in its metrics). KTO (unpaired) is not offered.

References:
    Guo et al., "Direct Language Model Alignment from Online AI Feedback",
    https://arxiv.org/abs/2402.04792; Rafailov et al., "Direct Preference Optimization",
    https://arxiv.org/abs/2305.18290
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from tensordict import TensorDict

from rlcore import keys as K
from rlcore.algorithms.online import online_preference_batch
from rlcore.loops.dpo import UNPAIRED, bind_loss, needs_reference, preference_loss_fn, with_reference
from rlcore.loops.online import OnlineConfig, collect_rollout, evaluate_policy, rollout_metrics, train_online, \
    update_sizes
from rlcore.loops.state import TrainState
from rlcore.loops.update import update

__all__ = ["Config", "step", "train", "evaluate"]


@dataclasses.dataclass(frozen=True)
class Config(OnlineConfig):
    """Online DPO recipe settings (shared fields: ``loops.online.OnlineConfig``). Loss
    hyper-parameters left at ``None`` keep the selected loss's own default (``loops.dpo.bind_loss``)."""

    num_samples: int = 2             # G ≥ 2 samples per prompt (TRL num_generations: 2)
    loss_type: str = "sigmoid"       # a key of loops.dpo.LOSSES but kto (TRL loss_type)
    beta: float | None = None        # β (None: the loss's default, 0.1 for the DPO family; TRL beta)
    label_smoothing: float | None = None   # ε (cDPO sigmoid, robust, exo_pair, aot; simpo, cpo)
    reference_free: bool | None = None     # DPO family: π_ref ≡ 1
    divergence: str | None = None    # DPO family: f-divergence of the scores (algorithms.dpo.F_DIVERGENCES)
    alpha: float | None = None       # f-divergence α; AlphaPO α for simpo / cpo
    discopop_tau: float | None = None  # discopop τ
    rpo_alpha: float | None = None   # weight of the chosen NLL (RPO)
    gamma: float | None = None       # simpo target margin
    cpo_alpha: float | None = None   # simpo / cpo: weight of the chosen NLL
    desirable_weight: float | None = None    # kto only (not offered online); kept for bind_loss
    undesirable_weight: float | None = None  # kto only (not offered online); kept for bind_loss
    chunked: bool = True             # pairs' log-probs from hidden states in vocabulary chunks
    run_dir: str | None = "runs/online_dpo"


def step(state: TrainState, rows: dict, *, config: Config, tokenizer, reward_fn) -> tuple[TrainState, TensorDict]:
    """One online DPO step on a batch of prompts: collect → best/worst pairs → update (impure)."""
    state, rollout = collect_rollout(state, rows, config=config, tokenizer=tokenizer, reward_fn=reward_fn,
                                     reference=False)
    pairs = online_preference_batch(rollout, num_groups=len(rows["prompt"]))
    info = {**rollout_metrics(rollout), "rollout/pairs": torch.tensor(float(pairs.batch_size[0]))}
    if pairs.batch_size[0] == 0:  # every prompt tied: nothing to prefer, no optimiser step
        return state, TensorDict(info, batch_size=[])
    if needs_reference(config):
        pairs = with_reference(state, pairs, chunked=config.chunked)
    info.update({"rollout/score_chosen": pairs[K.CHOSEN, K.SCORE].mean(),
                 "rollout/score_rejected": pairs[K.REJECTED, K.SCORE].mean()})
    loss_fn = functools.partial(preference_loss_fn, loss=bind_loss(config), chunked=config.chunked)
    state, metrics = update(state, pairs, loss_fn, **update_sizes(config, pairs.batch_size[0]), epochs=config.epochs,
                            max_grad_norm=config.max_grad_norm)
    return state, metrics.update(info)


def evaluate(state: TrainState, config: Config) -> dict[str, float]:
    """Held-out reward, exact match (greedy) and KL to the reference: ``loops.online.evaluate_policy``."""
    return evaluate_policy(state, config)


def train(config: Config, *, reward_fn=None, callbacks=()) -> tuple[TrainState, list[dict[str, float]]]:
    """Train with online DPO from ``config``; ``reward_fn`` overrides the task reward (the judge).
    Returns ``(state, history)``."""
    if config.loss_type in UNPAIRED:
        raise ValueError(f"loss_type: {config.loss_type!r} trains on unpaired rows; online DPO forms pairs "
                         "(choose a pairwise loss of loops.dpo.LOSSES)")
    if config.num_samples < 2:
        raise ValueError(f"num_samples: online DPO pairs samples of one prompt, so it needs at least 2, "
                         f"got {config.num_samples}")
    bind_loss(config)  # an unknown loss_type or a misplaced hyper-parameter fails before any model is built
    return train_online(config, step, reward_fn=reward_fn, name="online_dpo", callbacks=callbacks,
                        rows_per_step=config.batch_size)
