"""Dynamic sampling (DAPO): train only on groups whose scores differ, refilling with fresh prompts.

A group whose ``G`` samples all score the same has advantage 0 for the group-relative estimators
(GRPO, Dr. GRPO, RLOO): it adds tokens to the loss's denominators and nothing to its gradient.
With ``dynamic_sampling`` a step drops such groups and samples more prompts until it holds
``batch_size`` informative groups, or ``max_sampling_rounds`` generations were spent. The step
then trains on what it holds; with no informative group at all, it trains on its first
round as sampled, which changes nothing but the counters.

The extra prompts of round ``k`` of step ``s`` are drawn from the training set with a generator
seeded by ``(seed, s, k)``, apart from the run's prompt stream, so a resumed run draws the same.

References:
    Yu et al., "DAPO: An Open-Source LLM Reinforcement Learning System at Scale" (dynamic
    sampling), https://arxiv.org/abs/2503.14476
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from datasets import Dataset
from tensordict import TensorDict, TensorDictBase

from rlcore import keys as K

__all__ = ["informative_groups", "concat_rollouts", "prompt_refill", "refill_informative", "collect_groups"]

_PROMPT_KEYS = (K.PROMPT_IDS, K.PROMPT_MASK)
_SEQUENCE_KEYS = (K.INPUT_IDS, K.ATTENTION_MASK)


def informative_groups(rollout: TensorDictBase) -> torch.Tensor:
    """``[B]`` bool: the rows of the groups (``group_id``) whose scores are not all equal."""
    score, group = rollout[K.SCORE], rollout[K.GROUP_ID]
    _, index = torch.unique(group, return_inverse=True)
    n = int(index.max()) + 1 if index.numel() else 0
    low = torch.full((n,), torch.inf, dtype=score.dtype, device=score.device).scatter_reduce(0, index, score, "amin")
    high = torch.full((n,), -torch.inf, dtype=score.dtype, device=score.device).scatter_reduce(0, index, score, "amax")
    return (high > low)[index]


def concat_rollouts(rollouts: Sequence[TensorDictBase]) -> TensorDict:
    """One rollout of several: prompts left padded and token keys right padded to common widths,
    ``group_id`` renumbered so that groups of different rollouts stay apart, the stored
    ``[prompt | response]`` sequences rebuilt."""
    P = max(r[K.PROMPT_IDS].shape[-1] for r in rollouts)
    R = max(r[K.RESPONSE_IDS].shape[-1] for r in rollouts)
    parts, offset = [], 0
    for r in rollouts:
        out = {}
        for key in r.keys():
            x = r[key]
            if key in _SEQUENCE_KEYS:
                continue
            if key in _PROMPT_KEYS:
                x = torch.nn.functional.pad(x, (P - x.shape[-1], 0))
            elif x.ndim == 2:
                x = torch.nn.functional.pad(x, (0, R - x.shape[-1]))
            out[key] = x
        out[K.GROUP_ID] = r[K.GROUP_ID] + offset
        offset += int(r[K.GROUP_ID].max()) + 1 if r.batch_size[0] else 0
        parts.append(TensorDict(out, batch_size=r.batch_size))
    rollout = torch.cat(parts)
    if any(K.INPUT_IDS in r.keys() for r in rollouts):
        rollout[K.INPUT_IDS] = torch.cat([rollout[K.PROMPT_IDS], rollout[K.RESPONSE_IDS]], -1)
        rollout[K.ATTENTION_MASK] = torch.cat([rollout[K.PROMPT_MASK], rollout[K.RESPONSE_MASK]], -1)
    return rollout


def prompt_refill(dataset: Dataset, config: Any) -> Callable[[int, int], dict]:
    """``(step, round) -> rows``: ``config.batch_size`` prompts (all columns) drawn from ``dataset``
    with a generator seeded by ``(config.seed, step, round)``."""
    def draw(step: int, round_: int) -> dict:
        g = torch.Generator().manual_seed(hash((int(config.seed), int(step), int(round_))) % 2**63)
        index = torch.randperm(len(dataset), generator=g)[:config.batch_size].tolist()
        return dataset[index]
    return draw


def refill_informative(state: Any, rows: Mapping[str, Sequence], collect: Callable[..., tuple[Any, TensorDict]], *,
                       refill: Callable[[int, int], Mapping[str, Sequence]], batch_size: int, num_samples: int,
                       max_rounds: int) -> tuple[Any, TensorDict, dict[str, torch.Tensor]]:
    """``collect(state, rows) -> (state, rollout)`` round after round, keeping the informative groups,
    until ``batch_size`` of them or ``max_rounds`` rounds: ``(state, rollout, counts)``.

    ``counts``: ``rollout/sampling_rounds``, ``rollout/dropped_groups`` (uninformative groups
    sampled and dropped) and ``rollout/kept_groups``.
    """
    kept, rounds, dropped, first = [], 0, 0, None
    step = int(state.step)
    while True:
        state, rollout = collect(state, rows)
        first = rollout if first is None else first
        rounds += 1
        useful = informative_groups(rollout)
        dropped += int((~useful).sum()) // num_samples
        if bool(useful.any()):
            kept.append(rollout[useful])
        held = sum(r.batch_size[0] for r in kept) // num_samples
        if held >= batch_size or rounds >= max_rounds:
            break
        rows = refill(step, rounds)
    rollout = concat_rollouts(kept)[:batch_size * num_samples] if kept else first
    counts = {"rollout/sampling_rounds": torch.tensor(float(rounds)),
              "rollout/dropped_groups": torch.tensor(float(dropped)),
              "rollout/kept_groups": torch.tensor(float(rollout.batch_size[0] // num_samples if kept else 0))}
    return state, rollout, counts


def collect_groups(state: Any, rows: Mapping[str, Sequence], collect: Callable[..., tuple[Any, TensorDict]], *,
                   config: Any, refill: Callable[[int, int], Mapping[str, Sequence]] | None = None
                   ) -> tuple[Any, TensorDict, dict[str, torch.Tensor]]:
    """A group recipe's collection: ``collect(state, rows)``, or with the config's
    ``dynamic_sampling`` (and a ``refill``) :func:`refill_informative`. ``(state, rollout, counts)``."""
    if refill is None or not getattr(config, "dynamic_sampling", False):
        state, rollout = collect(state, rows)
        return state, rollout, {}
    return refill_informative(state, rows, collect, refill=refill, batch_size=config.batch_size,
                              num_samples=config.num_samples, max_rounds=config.max_sampling_rounds)
