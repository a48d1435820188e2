"""Bounded memory: a rollout generated in chunks of rows, and the pieces that join them.

A rollout of ``B = P·G`` rows sampled in one call holds a KV cache of ``B`` rows at once; with
``generation_batch_size`` (TRL's name) the online recipes sample ``rows_per_call`` rows at a
time instead (:func:`generate_in_chunks`) and join the pieces (:func:`cat_rollouts`), so the
peak is that of one chunk. The scoring forwards take their own row bound
(``score_rollout(rows_per_forward=)``, the recipes' ``forward_batch_size``).

Chunk ``k`` samples with its own seed (``chunk_seed``: chunk 0 keeps the call's seed), so a
rollout in one chunk is exactly the unchunked one, and a chunked rollout is a different draw of
the same distribution, as reproducible as the unchunked one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn

from rlcore import keys as K
from rlcore.loops.collect import _prompts, draw_seed, generate_rollout, response_budget
from rlcore.loops.models import pad_token_id

__all__ = ["generate_in_chunks", "cat_rollouts", "chunk_seed"]

_PROMPT_KEYS = (K.PROMPT_IDS, K.PROMPT_MASK)  # left padded: joined by padding on the left
_SEQUENCE_KEYS = (K.INPUT_IDS, K.ATTENTION_MASK)  # [prompt | response]: rebuilt from the joined halves


def chunk_seed(seed: int | None, k: int) -> int | None:
    """The sampling seed of chunk ``k`` of a call seeded with ``seed``: ``seed`` itself for chunk 0,
    then steps of the golden-ratio constant modulo ``2**62`` (``None`` stays ``None``)."""
    return None if seed is None else (seed + k * 0x9E3779B97F4A7C15) % 2**62


def _pad(x: torch.Tensor, width: int, *, left: bool, value: Any) -> torch.Tensor:
    if x.shape[-1] == width:
        return x
    fill = torch.full((*x.shape[:-1], width - x.shape[-1]), value, dtype=x.dtype, device=x.device)
    return torch.cat([fill, x] if left else [x, fill], -1)


def cat_rollouts(parts: Sequence[TensorDictBase], *, pad_id: int) -> TensorDict:
    """Rollouts sampled apart joined row-wise into one, as if sampled together: prompts left padded
    to the widest prompt, token quantities ``[b, R_i]`` right padded to the longest response (ids
    with ``pad_id``, masks False, log-probs and the rest 0), ``group_id`` renumbered so the groups
    of part ``i`` follow those of the parts before it, and the stored ``[prompt | response]``
    sequences of a scored rollout (``input_ids``, ``attention_mask``) rebuilt from the joined halves."""
    if not parts:
        raise ValueError("parts: expected at least one rollout")
    keys = set(parts[0].keys())
    for i, part in enumerate(parts):
        if set(part.keys()) != keys:
            raise ValueError(f"parts[{i}]: keys {sorted(part.keys())} differ from parts[0]'s {sorted(keys)}")
    out, groups = {}, 0
    offsets = []
    for part in parts:
        offsets.append(groups)
        if K.GROUP_ID in keys and part.batch_size[0]:
            groups += int(part[K.GROUP_ID].max()) + 1
    for key in parts[0].keys():
        if key in _SEQUENCE_KEYS:
            continue
        tensors = [p[key] for p in parts]
        if key == K.GROUP_ID:
            tensors = [t + off for t, off in zip(tensors, offsets)]
        elif tensors[0].ndim == 2:
            width = max(t.shape[-1] for t in tensors)
            value = pad_id if key in (K.PROMPT_IDS, K.RESPONSE_IDS) else 0
            tensors = [_pad(t, width, left=key in _PROMPT_KEYS, value=value) for t in tensors]
        out[key] = torch.cat(tensors, 0)
    if K.INPUT_IDS in keys:
        out[K.INPUT_IDS] = torch.cat([out[K.PROMPT_IDS], out[K.RESPONSE_IDS]], -1)
    if K.ATTENTION_MASK in keys:
        attend = out[K.TRAJECTORY_MASK] if K.TRAJECTORY_MASK in out else out[K.RESPONSE_MASK]  # loops.episodes
        out[K.ATTENTION_MASK] = torch.cat([out[K.PROMPT_MASK], attend], -1)
    return TensorDict(out, batch_size=[sum(p.batch_size[0] for p in parts)], device=parts[0].device)


def generate_in_chunks(model: nn.Module, tokenizer, prompts, *, rows_per_call: int | None = None,
                       num_samples: int = 1, seed: int | None = None, generator: torch.Generator | None = None,
                       max_new_tokens: int = 64, length_sampler: Callable[[], int] | tuple[int, int] | None = None,
                       max_prompt_length: int | None = None, **kwargs: Any) -> TensorDict:
    """``generate_rollout`` of ``G = num_samples`` responses per prompt, ``rows_per_call`` rollout
    rows (``rows_per_call / G`` prompts) per call.

    The prompts are tokenised once; every chunk samples with the same response budget (drawn
    once, from the call's seed, when ``length_sampler`` is given) and its own seed
    (``chunk_seed``); the chunks are joined by ``cat_rollouts``. ``rows_per_call=None`` (or at
    least ``P·G``) is one ``generate_rollout`` call. Other keywords go to ``generate_rollout``.

    Raises ``ValueError`` when ``rows_per_call`` is not a positive multiple of ``G``.
    """
    G = num_samples
    P = len(prompts) if not isinstance(prompts, TensorDictBase) else prompts.batch_size[0]
    common = dict(num_samples=G, max_prompt_length=max_prompt_length, **kwargs)
    if rows_per_call is None or rows_per_call >= P * G:
        return generate_rollout(model, tokenizer, prompts, seed=seed, generator=generator,
                                max_new_tokens=max_new_tokens, length_sampler=length_sampler, **common)
    if isinstance(rows_per_call, bool) or not isinstance(rows_per_call, int) or rows_per_call < G \
            or rows_per_call % G:
        raise ValueError(f"generation_batch_size: expected a positive multiple of num_samples={G} (rows of whole "
                         f"groups per call), got {rows_per_call!r}")
    if generator is not None:
        seed = draw_seed(generator)
    budget = response_budget(max_new_tokens, length_sampler, seed)
    pad = pad_token_id(tokenizer)
    batch = _prompts(prompts, tokenizer, pad, max_prompt_length)
    per_call = rows_per_call // G
    parts = [generate_rollout(model, tokenizer, batch[start:start + per_call], seed=chunk_seed(seed, k),
                              max_new_tokens=budget, **common)
             for k, start in enumerate(range(0, P, per_call))]
    return cat_rollouts(parts, pad_id=pad)
