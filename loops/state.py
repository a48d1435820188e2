"""The loop state: one frozen dataclass threaded through ``fold``, replaced, never mutated.

``TrainState`` holds everything a run needs to continue exactly where it stopped: the models,
the optimiser and its learning-rate scheduler, the transform states (KL controller, running
moments: typed NamedTuples of tensors), the counters, and a ``torch.Generator`` for the loop's
own randomness (shuffling minibatches).

Who changes what:

- ``fold`` owns ``step`` (how many items it has consumed from its source; a resumed fold skips
  exactly that many);
- ``update`` owns ``optimizer_steps``, ``skipped_steps``, ``policy_version`` and ``rng``, and is
  the only code that mutates anything in place (the models' parameters and the optimiser /
  scheduler internals), because an optimiser step on a large model cannot copy its weights;
- the recipe's step function owns ``samples_seen``, ``episodes``, ``tokens_seen`` (through
  :func:`advance`) and ``transforms`` (through :func:`with_transforms`).

Everything else is replaced with ``dataclasses.replace``: an old state value stays valid as a
record of its counters, generator and transform states.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from rlcore import keys as K

__all__ = ["TrainState", "COUNTERS", "init_state", "advance", "batch_tokens", "with_transforms", "copy_generator"]

COUNTERS = ("step", "optimizer_steps", "samples_seen", "episodes", "tokens_seen", "policy_version",
            "skipped_steps")


@dataclasses.dataclass(frozen=True, eq=False)
class TrainState:
    """Everything a training run carries from one step to the next.

    Attributes:
        models: name -> ``nn.Module`` (``"policy"``, ``"ref"``, ``"value"``, ``"reward"``...).
            Only ``update`` changes their parameters.
        optimizer: a ``torch.optim.Optimizer`` over the trainable parameters, or ``None``.
        scheduler: a ``torch.optim.lr_scheduler.LRScheduler`` of ``optimizer``, or ``None``.
        transforms: name -> typed state of an ``(init, update)`` pair (e.g. ``"kl"`` ->
            ``KLControllerState``, ``"score_moments"`` -> ``RunningMoments``), NamedTuples or frozen
            dataclasses of tensors and numbers; replaced, never written into.
        rng: ``torch.Generator`` for the loop's randomness (minibatch shuffling); ``update``
            returns a state with an advanced copy and leaves the old generator untouched.
        step: items consumed by ``fold`` (one per step of the loop); the resume position.
        optimizer_steps: optimiser steps taken by ``update`` (skipped steps not included).
        samples_seen, episodes, tokens_seen: data counters kept by the recipe (:func:`advance`).
        policy_version: how many ``update`` calls changed the weights; stamps rollouts for
            asynchronous (off-policy) RLHF.
        skipped_steps: optimiser steps skipped by the non-finite guard of ``update``.
        reward_fn: the run's reward function as built once from what training was given
            (``loops.reward_fns.make_reward_fn``: the functions and weights of the config and of
            ``train(..., reward_fn=)``), which evaluation scores with, exactly as training does;
            ``None``: none given (a reward model alone, or a state built outside ``train``). Not
            checkpointed: a resumed run builds it again.
        env: the run's environment factory (``loops.envs``), with which the online recipes sample
            multi-turn episodes (``loops.episodes``); ``None``: single-turn rollouts. Not
            checkpointed, as ``reward_fn``.
    """

    models: Mapping[str, nn.Module] = dataclasses.field(default_factory=dict)
    optimizer: torch.optim.Optimizer | None = None
    scheduler: Any = None
    transforms: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    rng: torch.Generator | None = None
    step: int = 0
    optimizer_steps: int = 0
    samples_seen: int = 0
    episodes: int = 0
    tokens_seen: int = 0
    policy_version: int = 0
    skipped_steps: int = 0
    reward_fn: Any = None
    env: Any = None

    def model(self, name: str = "policy") -> nn.Module:
        """``self.models[name]``; a ``KeyError`` listing the model names otherwise."""
        try:
            return self.models[name]
        except KeyError:
            raise KeyError(f"model {name!r} is not in the state; it has {sorted(self.models)}") from None


def init_state(models: Mapping[str, nn.Module] | nn.Module, *, optimizer: torch.optim.Optimizer | None = None,
               scheduler: Any = None, transforms: Mapping[str, Any] | None = None, seed: int = 0,
               device: str | torch.device = "cpu") -> TrainState:
    """A fresh ``TrainState`` with zeroed counters and a generator seeded with ``seed``.

    A single module is stored as ``{"policy": module}``.

    >>> s = init_state(nn.Linear(2, 1), seed=3); sorted(s.models), s.step, s.rng.initial_seed()
    (['policy'], 0, 3)
    """
    if isinstance(models, nn.Module):
        models = {"policy": models}
    return TrainState(models=dict(models), optimizer=optimizer, scheduler=scheduler,
                      transforms=dict(transforms or {}),
                      rng=torch.Generator(device=device).manual_seed(seed))


def advance(state: TrainState, **increments: int) -> TrainState:
    """A copy of ``state`` with the named counters incremented.

    ``advance(state, samples_seen=B, episodes=B, tokens_seen=n)``. Unknown names raise ``ValueError``
    listing the counters. Increments may be ints or 0-d integer tensors (read once, here).

    >>> advance(TrainState(), samples_seen=8, tokens_seen=40).tokens_seen
    40
    """
    unknown = sorted(set(increments) - set(COUNTERS))
    if unknown:
        raise ValueError(f"advance: unknown counters {unknown}; valid: {list(COUNTERS)}")
    return dataclasses.replace(state, **{k: getattr(state, k) + int(v) for k, v in increments.items()})


def batch_tokens(batch: Any) -> torch.Tensor:
    """The real tokens of a sequence batch, for ``tokens_seen`` (TRL's ``num_tokens``): ``Σ
    attention_mask``, over both sides of a preference pair batch (prompt + chosen and prompt +
    rejected, as TRL counts a pair).

    >>> from tensordict import TensorDict
    >>> side = TensorDict({"attention_mask": torch.tensor([[1, 1, 0]])}, batch_size=[1])
    >>> int(batch_tokens(TensorDict({"chosen": side, "rejected": side}, batch_size=[1])))
    4
    """
    if K.CHOSEN in batch.keys():
        return batch[K.CHOSEN][K.ATTENTION_MASK].sum() + batch[K.REJECTED][K.ATTENTION_MASK].sum()
    return batch[K.ATTENTION_MASK].sum()


def with_transforms(state: TrainState, **states: Any) -> TrainState:
    """A copy of ``state`` whose ``transforms`` has the given entries replaced (a new dict).

    >>> s = with_transforms(TrainState(), kl=(torch.tensor(0.1),)); list(s.transforms)
    ['kl']
    """
    return dataclasses.replace(state, transforms={**state.transforms, **states})


def copy_generator(generator: torch.Generator) -> torch.Generator:
    """A new ``torch.Generator`` on the same device in the same state (the original is untouched)."""
    g = torch.Generator(device=generator.device)
    g.set_state(generator.get_state())
    return g
