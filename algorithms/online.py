"""Online preference pairs: from ``G`` scored samples per prompt, the best against the worst.

Online DPO samples completions from the current policy, scores them (a reward model or a
judge) and trains any DPO-family loss on the pairs so formed. ``best_worst_pairs`` picks the
pairs, vectorised over prompts; ``online_preference_batch`` turns a scored rollout into a
preference batch (``chosen`` / ``rejected`` sub-TensorDicts) that ``rlcore.algorithms.dpo``
and every entry of ``PREFERENCE_LOSSES`` read.

Ties: a group whose best score equals its worst (every sample scored the same, a lone sample,
an empty group, or a NaN score) carries no preference, and is flagged invalid; the TensorDict
helper drops it. (TRL's online DPO keeps ties, taking the first sample as chosen.)
"""

from __future__ import annotations

import torch
from tensordict import TensorDict, TensorDictBase

from rlcore import keys as K
from rlcore.checks import check_float, check_mask, check_ndim, check_same_shape, require_keys
from rlcore.masked import masked_sum

__all__ = ["best_worst_pairs", "online_preference_batch"]

Tensor = torch.Tensor


def best_worst_pairs(scores: Tensor, group_id: Tensor | None = None, *,
                     num_groups: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Per prompt, the index of its best-scored and its worst-scored sample, and whether they differ.

    ``chosen_p = argmax_{i ∈ p} s_i``, ``rejected_p = argmin_{i ∈ p} s_i`` (first index on ties),
    ``valid_p = max_{i ∈ p} s_i > min_{i ∈ p} s_i``.

    Two layouts:
        - ``scores [P, G]`` (``group_id`` None): prompt ``p`` owns row ``p``; indices are flat,
          ``p·G + g``, into the ``[B = P·G]`` rollout.
        - ``scores [B]`` with ``group_id [B]`` long in ``[0, num_groups)``: segment reductions,
          any order and group sizes. ``P' = num_groups``, or ``B`` when ``None`` (then ids must
          be below ``B``; the shape stays static); groups with no sample are invalid.

    Args:
        scores: ``[P, G]`` or ``[B]`` float, sequence-level scores.
        group_id: ``[B]`` long, the prompt of each sample (with 1-d scores only).
        num_groups: number of groups ``P'`` for the segment layout.
    Returns:
        ``(chosen_index [P'], rejected_index [P'], valid [P'] bool)``; indices of invalid groups
        are in range but meaningless.

    >>> best_worst_pairs(torch.tensor([[0.1, 0.9, 0.5], [1.0, 1.0, 1.0]]))
    (tensor([1, 3]), tensor([0, 3]), tensor([ True, False]))

    References:
        Guo et al., "Direct Language Model Alignment from Online AI Feedback",
        https://arxiv.org/abs/2402.04792.
    """
    check_float("scores", scores)
    if group_id is None:
        check_ndim("scores", scores, ndim=2, layout="[P, G] (or [B] with group_id)")
        offset = torch.arange(scores.shape[0], device=scores.device) * scores.shape[1]
        valid = scores.amax(-1) > scores.amin(-1)
        return offset + scores.argmax(-1), offset + scores.argmin(-1), valid
    check_ndim("scores", scores, ndim=1, layout="[B] (with group_id [B])")
    check_same_shape("scores", scores, group_id=group_id)
    if group_id.is_floating_point() or group_id.dtype == torch.bool:
        raise TypeError(f"group_id: expected an integer tensor, got dtype {group_id.dtype}")
    B = scores.shape[0]
    P = B if num_groups is None else num_groups
    idx = torch.arange(B, device=scores.device)

    def first(extreme: Tensor) -> Tensor:  # smallest index reaching the group's extreme
        hit = torch.where(scores == extreme[group_id], idx, B)
        return torch.full((P,), B, device=scores.device).scatter_reduce(0, group_id, hit, "amin")

    hi = scores.new_full((P,), -torch.inf).scatter_reduce(0, group_id, scores, "amax", include_self=False)
    lo = scores.new_full((P,), torch.inf).scatter_reduce(0, group_id, scores, "amin", include_self=False)
    top = max(B - 1, 0)
    return first(hi).clamp(max=top), first(lo).clamp(max=top), hi > lo


def _side(rollout: TensorDictBase, index: Tensor) -> TensorDict:
    r = rollout[index]
    prompt_mask, response_mask = r.get(K.PROMPT_MASK), r.get(K.RESPONSE_MASK)
    # a multi-turn episode attends to the environment's tokens too; its loss keeps to the model's
    attend = r.get(K.TRAJECTORY_MASK) if K.TRAJECTORY_MASK in r.keys() else response_mask
    side = {
        K.INPUT_IDS: torch.cat([r.get(K.PROMPT_IDS), r.get(K.RESPONSE_IDS)], dim=-1),
        K.ATTENTION_MASK: torch.cat([prompt_mask, attend], dim=-1),
        K.LOSS_MASK: torch.cat([torch.zeros_like(prompt_mask), response_mask], dim=-1),
        K.SCORE: r.get(K.SCORE),
    }
    for per_token, summed in ((K.LOGPROBS, K.LOGPS), (K.REF_LOGPROBS, K.REF_LOGPS)):
        if per_token in r.keys():
            side[summed] = masked_sum(r.get(per_token), response_mask, dim=-1)
    return TensorDict(side, batch_size=index.shape)


def online_preference_batch(rollout: TensorDictBase, *, num_groups: int | None = None,
                            keep_ties: bool = False) -> TensorDict:
    """A preference batch from a scored rollout: per prompt, its best sample against its worst.

    Reads ``prompt_ids`` / ``prompt_mask`` ``[B, P]`` (left padded), ``response_ids`` /
    ``response_mask`` ``[B, R]`` (right padded), ``score [B]``, ``group_id [B]``; and, when
    present, ``logprobs`` / ``ref_logprobs`` ``[B, R]`` and a multi-turn episode's ``trajectory_mask``
    ``[B, R]`` (every token it attends to, the environment's included).

    Each side holds ``input_ids = [prompt | response]`` ``[P', P+R]``, ``attention_mask`` (the prompt
    mask and the trajectory mask, else the response mask), ``loss_mask`` (the model's response tokens), ``score [P']``, and ``logps`` / ``ref_logps``
    ``[P']`` (masked sums of the per-token log-probs) when the rollout has them. Groups without
    a preference (ties, see ``best_worst_pairs``) are dropped, so ``P'`` depends on the data:
    this adapter belongs at the loop boundary, not inside a compiled step.

    Args:
        rollout: TensorDict ``[B]`` with the keys above.
        num_groups: number of prompts (default: ``B``, an upper bound).
        keep_ties: keep every group, a tied one as its first best against its first worst sample (a
            rank of a sharded run with no preference of its own runs one at weight zero).
    Returns:
        TensorDict ``[P']`` with ``chosen`` and ``rejected`` sub-TensorDicts; a new object, the
        rollout is not modified.

    References:
        Guo et al., https://arxiv.org/abs/2402.04792.
    """
    keys = [K.PROMPT_IDS, K.PROMPT_MASK, K.RESPONSE_IDS, K.RESPONSE_MASK, K.SCORE, K.GROUP_ID]
    require_keys(rollout, keys, where="online_preference_batch")
    for ids, mask in ((K.PROMPT_IDS, K.PROMPT_MASK), (K.RESPONSE_IDS, K.RESPONSE_MASK)):
        check_ndim(ids, rollout.get(ids), ndim=rollout.batch_dims + 1, layout="[B, P] / [B, R]")
        check_mask(mask, rollout.get(mask), like=rollout.get(ids), like_name=ids)
    for key in (K.LOGPROBS, K.REF_LOGPROBS, K.TRAJECTORY_MASK):
        if key in rollout.keys():
            check_same_shape(K.RESPONSE_MASK, rollout.get(K.RESPONSE_MASK), **{key: rollout.get(key)})
    chosen, rejected, valid = best_worst_pairs(rollout.get(K.SCORE), rollout.get(K.GROUP_ID),
                                               num_groups=num_groups)
    if not keep_ties:
        chosen, rejected = chosen[valid], rejected[valid]
    sub = rollout.select(*keys, K.LOGPROBS, K.REF_LOGPROBS, K.TRAJECTORY_MASK, strict=False)
    return TensorDict({K.CHOSEN: _side(sub, chosen), K.REJECTED: _side(sub, rejected)},
                      batch_size=chosen.shape)
