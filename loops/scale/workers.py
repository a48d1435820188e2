"""The four operations a placement system dispatches, as plain functions of ``(state, batch)``.

An RLHF pipeline spread over machines (an actor framework such as Ray, a job queue, RPC) moves
batches between workers that each hold some of the models and run one of four operations, the
ones ROLL's pipeline dispatches:

- :func:`compute_log_probs`: per-token log-probs of the responses under a model (the policy's,
  recomputed by the learner, or the reference's);
- :func:`compute_values`: per-token values from a critic;
- :func:`compute_rewards`: sequence scores from a reward model and/or a reward function;
- :func:`train_step`: one ``update`` (the only one that changes weights).

Each is ``op(state, batch, **options) -> (state, batch | metrics)`` over a ``TrainState`` holding
the models the worker hosts, a thin wrapper over ``loops.score`` / ``loops.update``; bind the
options with ``functools.partial`` and any host can call it. ``WORKER_OPS`` names them. The
scoring operations return the state unchanged and a new batch (the input is never written into).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tensordict import TensorDict, TensorDictBase
from torch import nn

from rlcore.loops.models import token_values
from rlcore.loops.score import score_rollout
from rlcore.loops.state import TrainState
from rlcore.loops.update import update

__all__ = ["compute_log_probs", "compute_values", "compute_rewards", "train_step", "WORKER_OPS"]


def compute_log_probs(state: TrainState, batch: TensorDictBase, *, model: str = "policy", temperature: float = 1.0,
                      chunked: bool = True) -> tuple[TrainState, TensorDict]:
    """Add ``old_logprobs [B, R]`` (``model="policy"``) or ``ref_logprobs [B, R]`` (any other model,
    e.g. ``"ref"``): ``log softmax(z/τ)[response token]`` through ``state.models[model]``, no grad.

    Args:
        batch: a rollout ``[B]`` (``prompt_ids``/``prompt_mask`` ``[B, P]``, ``response_ids``/
            ``response_mask`` ``[B, R]``).
    Returns:
        ``(state, batch')``: the state as it was, a shallow copy of the rollout with the key.
    """
    role = {"policy": state.model(model)} if model == "policy" else {"ref": state.model(model)}
    return state, score_rollout(batch, temperature=temperature, chunked=chunked, **role)


def compute_values(state: TrainState, batch: TensorDictBase, *, model: str = "value",
                   head: nn.Module | None = None) -> tuple[TrainState, TensorDict]:
    """Add ``values [B, R]``: ``V(x_{≤P-1+j})`` for each response token ``j`` from the critic
    ``state.models[model]`` (a one-label token classifier, or a trunk with ``head``), no grad."""
    value_fn = functools.partial(token_values, state.model(model), head=head)
    return state, score_rollout(batch, value_fn=value_fn)


def compute_rewards(state: TrainState, batch: TensorDictBase, *, reward_fn: Callable | None = None, tokenizer=None,
                    reward_columns: Mapping[str, Sequence] | None = None, model: str = "reward",
                    reward_timeout: float | None = None, nonfinite_rewards: str = "raise",
                    prompts: Sequence | None = None) -> tuple[TrainState, TensorDict]:
    """Add ``score [B]``: the reward model ``state.models[model]`` (when the state has it) plus
    ``reward_fn`` (when given) called as ``score_rollout`` calls it (``prompts``: the data's, one per
    row; ``None``: decoded); ``reward_timeout`` and ``nonfinite_rewards`` as in ``score_rollout``."""
    reward_model = state.models.get(model)
    if reward_model is None and reward_fn is None:
        raise ValueError(f"compute_rewards: no reward model {model!r} in the state (it has {sorted(state.models)}) "
                         "and no reward_fn")
    return state, score_rollout(batch, reward_fn=reward_fn, reward_model=reward_model, tokenizer=tokenizer,
                                reward_columns=reward_columns, reward_timeout=reward_timeout,
                                nonfinite_rewards=nonfinite_rewards, prompts=prompts)


def train_step(state: TrainState, batch: TensorDictBase, *, loss_fn: Callable[..., tuple],
               **update_kwargs: Any) -> tuple[TrainState, TensorDict]:
    """``loops.update.update(state, batch, loss_fn, **update_kwargs)``: ``(state', metrics)``.

    Impure like ``update``: trains the models of ``state`` in place (under ``torch.distributed``
    the data-parallel ranks of a training worker group synchronise inside ``update``).
    """
    return update(state, batch, loss_fn, **update_kwargs)


WORKER_OPS: dict[str, Callable[..., tuple[TrainState, Any]]] = {
    "train_step": train_step,
    "compute_log_probs": compute_log_probs,
    "compute_values": compute_values,
    "compute_rewards": compute_rewards,
}
