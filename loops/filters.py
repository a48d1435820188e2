"""Which samples of a rollout train: the unscored, the truncated, and the groups with no signal.

- :func:`exclude_unscored`: a sample a reward function had no opinion on (``None``) leaves the
  loss and its group's statistics;
- :func:`mask_truncated`: with ``mask_truncated_completions``, a response cut at the token budget
  leaves the loss (its score still counts in its group);
- dynamic sampling (DAPO): train only on groups whose scores differ, refilling with fresh prompts.

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

import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from datasets import Dataset
from tensordict import TensorDict, TensorDictBase

from rlcore import keys as K
from rlcore.loops.chunks import cat_rollouts
from rlcore.loops.dist import shard_batch
from rlcore.loops.dist.sync import all_ranks_ok

__all__ = ["exclude_unscored", "mask_truncated", "informative_groups", "prompt_refill", "refill_informative"]


def informative_groups(rollout: TensorDictBase) -> torch.Tensor:
    """``[B]`` bool: the rows of the groups (``group_id``) whose scores are not all equal."""
    score, group = rollout[K.SCORE], rollout[K.GROUP_ID]
    _, index = torch.unique(group, return_inverse=True)
    n = int(index.max()) + 1 if index.numel() else 0
    low = torch.full((n,), torch.inf, dtype=score.dtype, device=score.device).scatter_reduce(0, index, score, "amin")
    high = torch.full((n,), -torch.inf, dtype=score.dtype, device=score.device).scatter_reduce(0, index, score, "amax")
    return (high > low)[index]


def prompt_refill(dataset: Dataset, config: Any) -> Callable[[int, int], dict]:
    """``(step, round) -> rows``: ``config.batch_size`` prompts (all columns) drawn from ``dataset``
    with a generator seeded by ``(config.seed, step, round)``; on several ranks this rank's block of
    them (``loops.dist.shard_batch``: the blocks together are one process's draw)."""
    def draw(step: int, round_: int) -> dict:
        g = torch.Generator().manual_seed(zlib.crc32(f"{int(config.seed)}:{int(step)}:{int(round_)}".encode()))
        index = torch.randperm(len(dataset), generator=g)[:config.batch_size].tolist()
        return shard_batch(dataset[index])
    return draw


def refill_informative(state: Any, rows: Mapping[str, Sequence], collect: Callable[..., tuple[Any, TensorDict]], *,
                       refill: Callable[[int, int], Mapping[str, Sequence]], batch_size: int, num_samples: int,
                       max_rounds: int, pad_id: int,
                       lockstep: bool = False) -> tuple[Any, TensorDict, dict[str, torch.Tensor]]:
    """``collect(state, rows) -> (state, rollout)`` round after round, keeping the informative groups,
    until ``batch_size`` of them or ``max_rounds`` rounds: ``(state, rollout, counts)``. The kept
    groups are joined by ``loops.chunks.cat_rollouts`` (ids padded with ``pad_id``).

    ``lockstep`` (a sharded policy, whose every forward is a collective): the ranks go on while any
    of them lacks groups (one all-reduce per round); a rank that holds enough samples along, its
    round's state and rollout dropped, so it ends as it would alone.

    ``counts``: ``rollout/sampling_rounds``, ``rollout/dropped_groups`` (uninformative groups
    sampled and dropped) and ``rollout/kept_groups``.
    """
    kept, rounds, dropped, first = [], 0, 0, None
    step, done = int(state.step), False
    while True:
        if done:  # lockstep: another rank still samples, and every forward needs this one
            collect(state, rows)
        else:
            state, rollout = collect(state, rows)
            first = rollout if first is None else first
            rounds += 1
            useful = informative_groups(rollout)
            dropped += int((~useful).sum()) // num_samples
            if bool(useful.any()):
                kept.append(rollout[useful])
            done = sum(r.batch_size[0] for r in kept) // num_samples >= batch_size or rounds >= max_rounds
        if all_ranks_ok(done) if lockstep else done:
            break
        rows = refill(step, rounds)
    rollout = cat_rollouts(kept, pad_id=pad_id)[:batch_size * num_samples] if kept else first
    counts = {"rollout/sampling_rounds": torch.tensor(float(rounds)),
              "rollout/dropped_groups": torch.tensor(float(dropped)),
              "rollout/kept_groups": torch.tensor(float(rollout.batch_size[0] // num_samples if kept else 0))}
    return state, rollout, counts


def _with_response_mask(rollout: TensorDictBase, mask: torch.Tensor, **more: torch.Tensor) -> TensorDictBase:
    """A shallow copy with ``response_mask`` (and the stored sequences' ``attention_mask``, which
    follows it) replaced, and ``more`` keys set."""
    new = {K.RESPONSE_MASK: mask, **more}
    if K.ATTENTION_MASK in rollout.keys():  # a multi-turn rollout keeps attending to its whole trajectory
        attend = rollout[K.TRAJECTORY_MASK] if K.TRAJECTORY_MASK in rollout.keys() else mask
        new[K.ATTENTION_MASK] = torch.cat([rollout[K.PROMPT_MASK], attend], -1)
    return rollout.copy().update(new)


def exclude_unscored(rollout: TensorDictBase) -> TensorDictBase:
    """A rollout whose samples without a score (a reward function's ``None``: "no opinion") take no
    part in training: their ``response_mask`` is cleared (no token enters a loss), their ``score``
    is 0 and each gets a ``group_id`` of its own (out of its prompt's group statistics, and an
    advantage of 0 as a group of one). A shallow copy; the rollout itself when every sample is scored.

    ``rollout_metrics`` counts them (``rollout/unscored``: a sample always has at least one token, so
    an empty response mask marks one).
    """
    unscored = torch.isnan(rollout[K.SCORE])
    if not bool(unscored.any()):
        return rollout
    group = rollout[K.GROUP_ID]
    fresh = group.max() + 1 + torch.arange(group.shape[0], device=group.device)
    return _with_response_mask(rollout, rollout[K.RESPONSE_MASK] & ~unscored[:, None],
                               **{K.SCORE: torch.where(unscored, 0.0, rollout[K.SCORE]),
                                  K.GROUP_ID: torch.where(unscored, fresh, group)})


def mask_truncated(rollout: TensorDictBase) -> TensorDictBase:
    """A rollout whose truncated responses (``truncated``: the whole token budget used, no stop
    token) take no part in the loss: their ``response_mask`` is cleared (TRL's
    ``mask_truncated_completions``, DAPO's overlong filtering). A shallow copy; the rollout itself
    when it has no ``truncated`` key or none is truncated."""
    if K.TRUNCATED not in rollout.keys() or not bool(rollout[K.TRUNCATED].any()):
        return rollout
    return _with_response_mask(rollout, rollout[K.RESPONSE_MASK] & ~rollout[K.TRUNCATED][:, None])
