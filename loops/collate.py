"""Collation of tokenised rows into TensorDict batches (one collator per format, ``COLLATORS``),
padded batches over a dataset (``iterate_batches``) and first-fit packing (``pack_sequences``)."""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from datasets import Dataset
from tensordict import TensorDict

from rlcore import keys as K
from rlcore.checks import lookup
from rlcore.loops.models import pad_token_id

__all__ = ["row_tokens", "token_budget", "pad_sequences", "collate_prompts", "collate_sequences", "collate_preference", "collate_unpaired",
           "collate_mismatched", "COLLATORS", "collate", "iterate_batches", "pack_sequences"]


def pad_sequences(seqs: Sequence[Sequence[int]], *, side: str = "right", pad_value: int = 0
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad token lists to the longest: ids ``[B, T]`` long and mask ``[B, T]`` bool (True on tokens).

    >>> pad_sequences([[5], [6, 7]], side="left")
    (tensor([[0, 5],
            [6, 7]]), tensor([[False,  True],
            [ True,  True]]))
    """
    if side not in ("right", "left"):
        raise ValueError(f"side: expected 'right' or 'left', got {side!r}")
    width = max((len(s) for s in seqs), default=0)
    ids = torch.full((len(seqs), width), pad_value, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.bool)
    for i, s in enumerate(seqs):
        cols = slice(0, len(s)) if side == "right" else slice(width - len(s), width)
        ids[i, cols] = torch.as_tensor(list(s), dtype=torch.long)
        mask[i, cols] = True
    return ids, mask


def _as_columns(rows: Sequence[Mapping] | Mapping[str, Sequence]) -> Mapping[str, Sequence]:
    if isinstance(rows, Mapping):
        return rows
    return {k: [r[k] for r in rows] for k in rows[0]} if rows else {}


def _need(columns: Mapping, names: Sequence[str], where: str) -> None:
    missing = [n for n in names if n not in columns]
    if missing:
        raise KeyError(f"{where}: rows are missing {missing} (have {sorted(columns)}); "
                       "run tokenize_dataset / tokenize_example first")


def _sequence_batch(prompts: Sequence[list], completions: Sequence[list], pad_id: int,
                    completion_masks: Sequence[list] | None = None) -> TensorDict:
    ids, mask = pad_sequences([p + c for p, c in zip(prompts, completions)], pad_value=pad_id)
    if completion_masks is None:
        starts = torch.tensor([len(p) for p in prompts], dtype=torch.long)
        loss_mask = mask & (torch.arange(ids.shape[-1]) >= starts[:, None])
    else:  # the completion's own mask (assistant turns)
        loss_mask = pad_sequences([[0] * len(p) + [int(b) for b in m] for p, m in zip(prompts, completion_masks)],
                                  pad_value=0)[0].bool()
    return TensorDict({K.INPUT_IDS: ids, K.ATTENTION_MASK: mask, K.LOSS_MASK: loss_mask}, batch_size=[len(ids)])


def collate_prompts(rows, *, pad_id: int) -> TensorDict:
    """Prompts for generation: ``prompt_ids [B, P]`` left padded, ``prompt_mask [B, P]``."""
    cols = _as_columns(rows)
    _need(cols, ["prompt_ids"], "collate_prompts")
    ids, mask = pad_sequences(cols["prompt_ids"], side="left", pad_value=pad_id)
    return TensorDict({K.PROMPT_IDS: ids, K.PROMPT_MASK: mask}, batch_size=[len(ids)])


def collate_sequences(rows, *, pad_id: int) -> TensorDict:
    """SFT batch: ``input_ids`` (prompt + completion, right padded), ``attention_mask``,
    ``loss_mask`` (completion tokens, or where rows carry ``completion_mask``, the tokens it marks),
    all ``[B, T]`` with ``T`` the batch's longest row."""
    cols = _as_columns(rows)
    _need(cols, ["prompt_ids", "completion_ids"], "collate_sequences")
    return _sequence_batch(cols["prompt_ids"], cols["completion_ids"], pad_id, cols.get("completion_mask"))


def collate_preference(rows, *, pad_id: int) -> TensorDict:
    """Preference batch ``[B]`` with nested ``chosen`` / ``rejected`` sequence batches (each padded
    to its own longest); ``ref_logps [B]`` per side when the rows carry precomputed
    ``ref_chosen_logps`` / ``ref_rejected_logps``."""
    cols = _as_columns(rows)
    _need(cols, ["prompt_ids", "chosen_ids", "rejected_ids"], "collate_preference")
    sides = {}
    for side in (K.CHOSEN, K.REJECTED):
        td = _sequence_batch(cols["prompt_ids"], cols[f"{side}_ids"], pad_id)
        if f"ref_{side}_logps" in cols:
            td[K.REF_LOGPS] = torch.as_tensor(cols[f"ref_{side}_logps"], dtype=torch.float32)
        sides[side] = td
    return TensorDict(sides, batch_size=[len(cols["prompt_ids"])])


def collate_unpaired(rows, *, pad_id: int) -> TensorDict:
    """Unpaired (KTO) batch: the SFT layout plus ``labels [B]`` bool (True = desirable)."""
    cols = _as_columns(rows)
    _need(cols, ["prompt_ids", "completion_ids", "label"], "collate_unpaired")
    td = _sequence_batch(cols["prompt_ids"], cols["completion_ids"], pad_id)
    return td.update({K.LABELS: torch.as_tensor([bool(x) for x in cols["label"]], dtype=torch.bool)})


def collate_mismatched(rows, *, pad_id: int) -> TensorDict:
    """KTO's mismatched pairs: prompt ``i`` with the completion of row ``i − 1`` (cyclically),
    in the SFT layout. Their log-probs (``score_sequences``) give ``kl_logps`` / ``ref_kl_logps``,
    the batch estimate of the KL reference point. A batch of one pairs a row with itself.

    References:
        Ethayarajh et al., "KTO: Model Alignment as Prospect Theoretic Optimization",
        https://arxiv.org/abs/2402.01306
    """
    cols = _as_columns(rows)
    _need(cols, ["prompt_ids", "completion_ids"], "collate_mismatched")
    completions = list(cols["completion_ids"])
    return _sequence_batch(cols["prompt_ids"], completions[-1:] + completions[:-1], pad_id)


COLLATORS: dict[str, Callable[..., TensorDict]] = {
    "preference": collate_preference,
    "implicit_preference": collate_preference,
    "unpaired": collate_unpaired,
    "prompt_completion": collate_sequences,
    "conversational": collate_sequences,
    "language_modeling": collate_sequences,
    "prompt_only": collate_prompts,
}


def collate(format: str, rows, *, pad_id: int) -> TensorDict:
    """Collate tokenised rows (a list of row dicts or a dict of columns) with ``COLLATORS[format]``."""
    return lookup(COLLATORS, format, what="format")(rows, pad_id=pad_id)


def iterate_batches(dataset: Dataset, tokenizer, batch_size: int, *, format: str, shuffle: bool = False,
                    seed: int = 0, drop_last: bool = False) -> Iterator[TensorDict]:
    """Batches of a tokenised dataset as TensorDicts, each padded to its own longest row.

    ``shuffle`` permutes the rows with a ``random.Random(seed)`` of its own (no global RNG).
    """
    order = list(range(len(dataset)))
    if shuffle:
        random.Random(seed).shuffle(order)
    pad = pad_token_id(tokenizer)
    stop = len(order) - (len(order) % batch_size if drop_last else 0)
    for start in range(0, stop, batch_size):
        yield collate(format, dataset[order[start:start + batch_size]], pad_id=pad)


def pack_sequences(rows, seq_length: int, *, pad_id: int) -> TensorDict:
    """Pack short SFT examples into rows of ``seq_length`` tokens (first-fit decreasing).

    Each packed row holds whole examples one after another; an example longer than
    ``seq_length`` is cut to its first ``seq_length`` tokens. Besides the SFT keys it carries

    - ``segment_ids [N, L]`` long: 1, 2, … for the examples of the row, 0 on padding;
    - ``position_ids [N, L]`` long: restarting at 0 with each example (0 on padding).

    A Hugging Face model called with these ``position_ids`` and ``attention_mask=None`` attends
    within each example only (sdpa/eager/flash attention detect the restarts), so packing
    changes no log-prob: ``token_logprobs_from_model(model, input_ids, None,
    position_ids=position_ids)``.

    Args:
        rows: tokenised rows with ``prompt_ids`` and ``completion_ids`` (list of dicts or columns),
            and optionally ``completion_mask`` (the completion tokens that are targets).
    Returns:
        TensorDict ``[N]``: ``input_ids``, ``attention_mask``, ``loss_mask``, ``segment_ids``,
        ``position_ids``, all ``[N, seq_length]``.

    References:
        Krell et al., "Efficient Sequence Packing without Cross-contamination",
        https://arxiv.org/abs/2107.02027
    """
    cols = _as_columns(rows)
    _need(cols, ["prompt_ids", "completion_ids"], "pack_sequences")
    masks = cols.get("completion_mask") or [[True] * len(c) for c in cols["completion_ids"]]
    examples = [((list(p) + list(c))[:seq_length], ([False] * len(p) + [bool(b) for b in m])[:seq_length])
                for p, c, m in zip(cols["prompt_ids"], cols["completion_ids"], masks)]
    bins: list[list[int]] = []  # example indices per row
    room: list[int] = []
    for i in sorted(range(len(examples)), key=lambda i: -len(examples[i][0])):
        n = len(examples[i][0])
        j = next((j for j, r in enumerate(room) if r >= n), None)
        if j is None:
            j = len(bins)
            bins.append([])
            room.append(seq_length)
        bins[j].append(i)
        room[j] -= n
    shape = (len(bins), seq_length)
    out = {k: torch.zeros(shape, dtype=torch.long) for k in (K.SEGMENT_IDS, K.POSITION_IDS)}
    out[K.INPUT_IDS] = torch.full(shape, pad_id, dtype=torch.long)
    out[K.LOSS_MASK] = torch.zeros(shape, dtype=torch.bool)
    for r, members in enumerate(bins):
        start = 0
        for s, i in enumerate(sorted(members), start=1):
            ids, loss = examples[i]
            cols_ = slice(start, start + len(ids))
            out[K.INPUT_IDS][r, cols_] = torch.as_tensor(ids, dtype=torch.long)
            out[K.LOSS_MASK][r, cols_] = torch.as_tensor(loss, dtype=torch.bool)
            out[K.SEGMENT_IDS][r, cols_] = s
            out[K.POSITION_IDS][r, cols_] = torch.arange(len(ids))
            start += len(ids)
    out[K.ATTENTION_MASK] = out[K.SEGMENT_IDS] > 0
    return TensorDict(out, batch_size=[len(bins)])


def row_tokens(batch: TensorDict, *, packed: bool) -> torch.Tensor:
    """The tokens each row of a batch costs one forward: ``[B]`` long, the ``row_tokens`` of
    ``loops.update.update``'s token budget.

    ``packed`` (padding-free): the row's real tokens; otherwise the padded width it is computed at.
    Layouts: a sequence batch or a scored rollout (``attention_mask [B, T]``); preference pairs
    (``chosen`` and ``rejected``, both sides in one forward: padded, twice the wider side); an
    unscored rollout (``prompt_mask [B, P]`` and ``trajectory_mask`` or ``response_mask [B, R]``).
    """
    B = batch.batch_size[0]
    keys = batch.keys()
    if K.ATTENTION_MASK in keys:
        masks = [batch[K.ATTENTION_MASK]]
    elif K.CHOSEN in keys and K.REJECTED in keys:
        masks = [batch[side, K.ATTENTION_MASK] for side in (K.CHOSEN, K.REJECTED)]
        if not packed:
            return torch.full((B,), 2 * max(m.shape[-1] for m in masks), dtype=torch.long)
    elif K.PROMPT_MASK in keys:
        masks = [batch[K.PROMPT_MASK], batch[K.TRAJECTORY_MASK if K.TRAJECTORY_MASK in keys else K.RESPONSE_MASK]]
    else:
        raise KeyError(f"row_tokens: expected attention_mask, chosen/rejected or prompt_mask in the batch, got keys "
                       f"{sorted(map(str, keys))}")
    if packed:
        return sum(m.sum(-1) for m in masks).long()
    return torch.full((B,), sum(m.shape[-1] for m in masks), dtype=torch.long)


def token_budget(config: Any) -> dict[str, Any]:
    """``update``'s token-budget keywords from a config's ``PackingSettings`` (``max_tokens_per_micro_batch``
    and ``padding_free``): the budget and the rows' costs (:func:`row_tokens`), or ``{}`` without one."""
    budget = getattr(config, "max_tokens_per_micro_batch", None)
    if budget is None:
        return {}
    return {"max_tokens_per_micro_batch": budget,
            "row_tokens": functools.partial(row_tokens, packed=bool(getattr(config, "padding_free", False)))}

