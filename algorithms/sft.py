"""Supervised fine-tuning: the token negative log-likelihood and the helpers of packed batches.

The loss reads per-token log-probs already computed (``keys.LOGPROBS``), so any way of computing
them plugs in: ``log_softmax`` of full logits, a selective gather, or a chunked pass over hidden
states that never materialises ``[B, T, V]`` logits. Which tokens count (completion only,
assistant turns only) is decided upstream and arrives as ``keys.LOSS_MASK``.

Packing puts several short examples in one row. ``segment_ids [B, T]`` numbers the examples of
a row (any integers; ``-1`` marks padding); a *segment* is a maximal run of equal ids.
``packed_position_ids`` restarts positions at every segment and ``segment_causal_mask`` lets a
token attend only to earlier tokens of its own segment, so a packed row computes exactly what
the separate sequences would.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict, TensorDictBase

from rlcore import keys as K
from rlcore.checks import check_float, check_mask, check_ndim, check_same_shape, lookup, require_keys
from rlcore.masked import AGGREGATIONS, aggregate, masked_mean

__all__ = [
    "sft_token_nll",
    "sft_loss",
    "shift_for_causal_lm",
    "packed_position_ids",
    "segment_causal_mask",
]


def sft_token_nll(logprobs: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Per-token negative log-likelihood ``ℓ_t = −log p(y_t | y_<t)`` on the loss mask, 0 elsewhere.

    Args:
        logprobs: ``[..., T]`` float, log-probability of each target token.
        loss_mask: ``[..., T]`` bool, True on the tokens the loss scores.
    Returns:
        ``[..., T]`` unreduced losses; 0 (not NaN) outside the mask whatever ``logprobs`` holds there.

    >>> sft_token_nll(torch.tensor([[-1.0, -2.0, float("nan")]]), torch.tensor([[True, True, False]]))
    tensor([[1., 2., 0.]])

    Gradient: ``∂ℓ_t/∂logprobs_t = −1`` on the mask, 0 elsewhere (no NaN leaks from padding).
    """
    check_float("logprobs", logprobs)
    check_mask("loss_mask", loss_mask, like=logprobs, like_name="logprobs")
    return torch.where(loss_mask, -logprobs, torch.zeros((), dtype=logprobs.dtype, device=logprobs.device))


def sft_loss(batch: TensorDictBase, *, agg: str = "token_mean", num_tokens=None,
             num_seqs=None) -> tuple[torch.Tensor, TensorDict]:
    """Supervised fine-tuning loss: the NLL of the target tokens, aggregated over the loss mask.

    ``loss = aggregate(−logprobs, loss_mask, agg)``: with ``token_mean`` every scored token weighs
    the same (``Σ ℓ / N_tok``); with ``seq_mean_token_mean`` every sequence weighs the same
    (``mean_i (Σ_t ℓ / n_i)``). Pass the global ``num_tokens`` / ``num_seqs`` of the optimiser step
    when the step is split over micro-batches or ranks (see ``rlcore.masked.aggregate``).

    Reads ``keys.LOGPROBS`` ``[B, T]`` float (log-probs of the tokens scored, aligned with the mask;
    use ``shift_for_causal_lm`` to align next-token targets) and ``keys.LOSS_MASK`` ``[B, T]`` bool.

    Args:
        batch: TensorDict ``[B]`` with the two keys above.
        agg: one of ``rlcore.masked.AGGREGATIONS``.
        num_tokens, num_seqs: global denominators, forwarded to ``aggregate``.
    Returns:
        ``(loss, metrics)``: ``loss`` ``[]``; ``metrics`` a TensorDict of detached scalars:
        ``loss_nll`` (= loss), ``num_tokens`` (scored tokens in this batch), and ``perplexity``
        ``= exp(token-mean NLL of this batch)``. Perplexity is always the per-token one (it is
        ``exp(loss)`` for the default ``token_mean`` without global denominators; for other modes
        or global counts ``exp(loss)`` would not be a perplexity). It is ``+inf`` once the mean NLL
        passes the exponent range of the dtype (≈ 88.7 nats in float32): a metric, not the loss.

    >>> b = TensorDict({"logprobs": torch.tensor([[-1.0, -3.0]]), "loss_mask": torch.tensor([[True, True]])}, [1])
    >>> loss, m = sft_loss(b); loss, m["perplexity"]
    (tensor(2.), tensor(7.3891))

    References:
        Radford et al., "Improving Language Understanding by Generative Pre-Training" (2018);
        Ouyang et al., "Training language models to follow instructions with human feedback",
        https://arxiv.org/abs/2203.02155 (supervised fine-tuning stage).
    Gradient: through ``logprobs`` only; metrics are detached.
    """
    require_keys(batch, [K.LOGPROBS, K.LOSS_MASK], where="sft_loss",
                 layouts={K.LOGPROBS: "[B, T] float", K.LOSS_MASK: "[B, T] bool"})
    lookup(AGGREGATIONS, agg, what="agg")
    logprobs, mask = batch.get(K.LOGPROBS), batch.get(K.LOSS_MASK)
    check_ndim(K.LOGPROBS, logprobs, min_ndim=1, layout="[B, T]")
    nll = sft_token_nll(logprobs, mask)
    loss = aggregate(nll, mask, agg, num_tokens=num_tokens, num_seqs=num_seqs)
    token_nll = masked_mean(nll.detach(), mask)
    metrics = TensorDict({
        "loss_nll": loss.detach(),
        "num_tokens": mask.sum(),
        "perplexity": token_nll.exp(),
    }, batch_size=[])
    return loss, metrics


def shift_for_causal_lm(input_ids: torch.Tensor, mask: torch.Tensor, *,
                        attention_mask: torch.Tensor | None = None,
                        segment_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token targets aligned with ``logits[..., :-1, :]``: ``labels_t = input_ids_{t+1}``.

    ``label_mask_t = mask_{t+1} ∧ attention_mask_t ∧ (segment_{t+1} = segment_t)``: a target counts
    if it is scored (``mask``: the loss mask, or the attention mask for plain language modelling),
    if the token that predicts it is real (``attention_mask``, when given: with left padding the
    first real token is not predicted from a pad), and if both lie in the same packed segment
    (``segment_ids``, when given: the first token of an example is not predicted from the end of
    the previous one).

    Args:
        input_ids: ``[..., T]`` long.
        mask: ``[..., T]`` bool, True on the tokens to predict.
        attention_mask: ``[..., T]`` bool, True on real tokens (optional).
        segment_ids: ``[..., T]`` integer segment of each token, ``-1`` on padding (optional).
    Returns:
        ``(labels [..., T-1] long, label_mask [..., T-1] bool)``. ``labels`` holds the raw ids
        everywhere (no ``-100`` sentinel): ``label_mask`` says which count.

    >>> ids = torch.tensor([[5, 6, 7, 0]]); m = torch.tensor([[False, True, True, False]])
    >>> shift_for_causal_lm(ids, m)
    (tensor([[6, 7, 0]]), tensor([[ True,  True, False]]))
    """
    check_ndim("input_ids", input_ids, min_ndim=1, layout="[..., T]")
    check_mask("mask", mask, like=input_ids, like_name="input_ids")
    label_mask = mask[..., 1:]
    if attention_mask is not None:
        check_mask("attention_mask", attention_mask, like=input_ids, like_name="input_ids")
        label_mask = label_mask & attention_mask[..., :-1]
    if segment_ids is not None:
        check_same_shape("input_ids", input_ids, segment_ids=segment_ids)
        label_mask = label_mask & (segment_ids[..., 1:] == segment_ids[..., :-1])
    return input_ids[..., 1:], label_mask


def _segment_runs(segment_ids: torch.Tensor, attention_mask: torch.Tensor | None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(valid [..., T], starts [..., T], run index [..., T]) of the maximal runs of equal ids."""
    check_ndim("segment_ids", segment_ids, min_ndim=1, layout="[..., T]")
    if segment_ids.is_floating_point() or segment_ids.dtype == torch.bool:
        raise TypeError(f"segment_ids: expected an integer tensor, got dtype {segment_ids.dtype} "
                        f"with shape {list(segment_ids.shape)}")
    valid = segment_ids >= 0
    if attention_mask is not None:
        check_mask("attention_mask", attention_mask, like=segment_ids, like_name="segment_ids")
        valid = valid & attention_mask
    first = torch.ones_like(valid[..., :1])
    changed = torch.cat([first, segment_ids[..., 1:] != segment_ids[..., :-1]], dim=-1)
    prev_valid = torch.cat([~first, valid[..., :-1]], dim=-1)
    starts = valid & (changed | ~prev_valid)
    return valid, starts, starts.long().cumsum(dim=-1)


def packed_position_ids(segment_ids: torch.Tensor, *,
                        attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Position ids that restart at 0 at the start of every packed segment.

    ``pos_t = t − s(t)`` where ``s(t)`` is the first index of the segment holding ``t``; a segment
    is a maximal run of equal non-negative ids. Padding (id ``-1``, or ``attention_mask`` False)
    gets position 0.

    Args:
        segment_ids: ``[..., T]`` integer, segment of each token, ``-1`` on padding.
        attention_mask: ``[..., T]`` bool, True on real tokens (optional).
    Returns:
        ``[..., T]`` long.

    >>> packed_position_ids(torch.tensor([[0, 0, 0, 1, 1, -1]]))
    tensor([[0, 1, 2, 0, 1, 0]])
    """
    valid, starts, _ = _segment_runs(segment_ids, attention_mask)
    t = torch.arange(segment_ids.shape[-1], device=segment_ids.device).expand_as(segment_ids)
    last_start = torch.where(starts, t, torch.zeros_like(t)).cummax(dim=-1).values
    return torch.where(valid, t - last_start, torch.zeros_like(t))


def segment_causal_mask(segment_ids: torch.Tensor, *,
                        attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Block-diagonal causal attention mask of a packed batch, ``[B, 1, T, T]`` bool (True = attend).

    ``M[b, 0, i, j] = valid_i ∧ valid_j ∧ (j ≤ i) ∧ (run_i = run_j)``: query ``i`` sees key ``j`` when
    both are real tokens of the same segment (a maximal run of equal ids) and ``j`` is not in the
    future. Padding (id ``-1``, or ``attention_mask`` False) attends nowhere and is attended by
    nobody: its row is all False. Some attention kernels return NaN for an all-False row; those
    rows are padding, to be excluded from the loss by its mask.

    Args:
        segment_ids: ``[B, T]`` integer, ``-1`` on padding.
        attention_mask: ``[B, T]`` bool (optional).
    Returns:
        ``[B, 1, T, T]`` bool, for models that accept a 4-D attention mask.

    >>> segment_causal_mask(torch.tensor([[0, 0, 1]]))[0, 0].int()
    tensor([[1, 0, 0],
            [1, 1, 0],
            [0, 0, 1]], dtype=torch.int32)
    """
    check_ndim("segment_ids", segment_ids, ndim=2, layout="[B, T]")
    valid, _, run = _segment_runs(segment_ids, attention_mask)
    T = segment_ids.shape[-1]
    causal = torch.ones(T, T, dtype=torch.bool, device=segment_ids.device).tril()
    same = run[:, :, None] == run[:, None, :]
    both = valid[:, :, None] & valid[:, None, :]
    return (same & both & causal)[:, None]
