"""Collect: generate responses with Hugging Face ``generate`` and return a TensorDict rollout.

The rollout layout is the one of ``rlcore.keys``: ``prompt_ids [B, P]`` left padded with
``prompt_mask``, ``response_ids [B, R]`` right padded with ``response_mask`` (True up to and
including the first stop token), ``old_logprobs [B, R]`` (the behaviour log-probs), and
``group_id [B]`` (the prompt each sample answers; ``B = P·G`` rows, prompt-major).

Behaviour log-probs, recorded from generation itself (no second forward) with
``BEHAVIOUR_LOGPROBS``:

- ``"sampled"`` (default): log-probs under the distribution the token was actually drawn
  from: the model's logits after every logits processor ``generate`` ran (temperature, and the
  truncation and renormalisation of top-k / top-p, plus anything in the model's generation
  config such as a repetition penalty). This is the correct behaviour policy for importance
  ratios; with top-k/top-p it is larger than the tempered full-vocabulary log-prob, so a
  learner that recomputes ``log softmax(z/τ)`` does not get a ratio of exactly 1 on-policy.
- ``"tempered"``: ``log softmax(z/τ)`` of the raw logits, the quantity ``score`` recomputes
  (``token_logprobs_from_model(..., temperature=τ)``), whatever top-k / top-p did.

Without top-k / top-p (the defaults here; ``generate``'s own default of top-k 50 is switched
off explicitly) the two agree, and both match a recomputation through ``loops.score`` up to the
rounding of the KV-cached forward. Recording costs ``generate`` keeping one ``[B, V]`` tensor per
step; at large ``B·R·V`` pass ``behaviour=None`` and recompute them with
``score_rollout(rollout, policy=model)`` instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn

from rlcore import keys as K
from rlcore.checks import check_mask, require_keys
from rlcore.logprobs import token_logprobs
from rlcore.loops.data import collate_prompts, tokenize_example
from rlcore.loops.models import pad_token_id

__all__ = ["generate_rollout", "BEHAVIOUR_LOGPROBS", "response_mask_from_ids", "left_align", "uniform_length_sampler"]


def response_mask_from_ids(response_ids: torch.Tensor, stop_token_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """True up to and including the first stop token of each row, False after it.

    ``m_t = 1[no stop token at any s < t]``; a row without a stop token is True throughout
    (a truncated generation). Pad ids are never consulted, so pad == eos is fine.

    Args:
        response_ids: ``[B, R]`` long.  stop_token_ids: the EOS / stop ids.
    Returns:
        ``[B, R]`` bool.

    >>> response_mask_from_ids(torch.tensor([[5, 2, 2, 7], [5, 6, 7, 8]]), [2])
    tensor([[ True,  True, False, False],
            [ True,  True,  True,  True]])
    """
    stops = torch.as_tensor(stop_token_ids, device=response_ids.device).reshape(-1)
    is_stop = torch.isin(response_ids, stops).long()
    return (is_stop.cumsum(-1) - is_stop) == 0


def left_align(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Move each row's real tokens to the right end (left padding), keeping their order.

    A stable sort of the mask per row: a no-op on left-padded input; right-padded prompts become
    left padded, as generation needs.

    Args:
        ids: ``[B, P]``.  mask: ``[B, P]`` bool.
    Returns:
        ``(ids, mask)``, both ``[B, P]``, new tensors.
    """
    check_mask("prompt_mask", mask, like=ids, like_name="prompt_ids")
    order = torch.sort(mask.to(torch.uint8), dim=-1, stable=True).indices
    return ids.gather(-1, order), mask.gather(-1, order)


def uniform_length_sampler(low: int, high: int, *, seed: int = 0) -> Callable[[], int]:
    """A ``length_sampler``: each call draws ``max_new_tokens`` uniformly from ``[low, high)``,
    from its own generator (``seed``), never the global RNG."""
    g = torch.Generator().manual_seed(seed)
    return lambda: int(torch.randint(low, high, (), generator=g))


# One [B, V] step at a time: no stacked [B, R, V] copy of what generate already holds.
def _sampled_logprobs(out, response_ids: torch.Tensor, temperature: float) -> torch.Tensor:
    # the processed scores: already divided by τ and truncated/renormalised by top-k/top-p
    return torch.stack([token_logprobs(s, response_ids[:, t]) for t, s in enumerate(out.scores)], -1)


def _tempered_logprobs(out, response_ids: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.stack([token_logprobs(z, response_ids[:, t], temperature=temperature)
                        for t, z in enumerate(out.logits)], -1)


BEHAVIOUR_LOGPROBS: dict[str, Callable[..., torch.Tensor]] = {
    "sampled": _sampled_logprobs,
    "tempered": _tempered_logprobs,
}


def _prompts(prompts, tokenizer, pad: int, max_prompt_length: int | None) -> TensorDict:
    if isinstance(prompts, TensorDictBase):
        require_keys(prompts, [K.PROMPT_IDS, K.PROMPT_MASK], where="generate_rollout",
                     layouts={K.PROMPT_IDS: "[B, P] long", K.PROMPT_MASK: "[B, P] bool"})
        ids, mask = left_align(prompts[K.PROMPT_IDS], prompts[K.PROMPT_MASK])
        return TensorDict({K.PROMPT_IDS: ids, K.PROMPT_MASK: mask}, batch_size=[ids.shape[0]])
    if isinstance(prompts, str) or not isinstance(prompts, Sequence):
        raise TypeError(f"prompts: expected a list of strings / conversations or a TensorDict with "
                        f"{K.PROMPT_IDS!r} and {K.PROMPT_MASK!r}, got {type(prompts).__name__}")
    rows = [tokenize_example({"prompt": p}, tokenizer, format="prompt_only", max_prompt_length=max_prompt_length,
                             where=f"prompt {i}") for i, p in enumerate(prompts)]
    empty = [i for i, r in enumerate(rows) if not r["prompt_ids"]]
    if empty:
        raise ValueError(f"prompts: prompts {empty} encode to no token; a response needs a context "
                         "(add a BOS token or a chat template)")
    return collate_prompts(rows, pad_id=pad)


def generate_rollout(model: nn.Module, tokenizer, prompts, *, max_new_tokens: int = 64, temperature: float = 1.0,
                     top_k: int | None = None, top_p: float | None = None, num_samples: int = 1,
                     length_sampler: Callable[[], int] | None = None, eos_token_id: int | Sequence[int] | None = None,
                     stop_token_ids: Sequence[int] = (), do_sample: bool = True, seed: int | None = None,
                     generator: torch.Generator | None = None, behaviour: str | None = "sampled",
                     max_prompt_length: int | None = None, policy_version: int | None = None,
                     use_cache: bool = True, **generate_kwargs) -> TensorDict:
    """Sample ``G = num_samples`` responses per prompt with ``model.generate`` (KV cache) into a rollout.

    Prompts are tokenised (conversations through the chat template) and left padded; a prompt
    TensorDict is re-aligned to left padding. Each prompt is prefilled once and expanded to ``G``
    samples by ``num_return_sequences``. Generation stops at ``eos_token_id`` (default the
    tokenizer's) or any of ``stop_token_ids``.

    Args:
        model: a Hugging Face causal LM (dropout should be off: ``disable_dropout`` or ``eval()``).
        prompts: ``list[str]``, ``list`` of conversations, or a TensorDict ``[P]`` with
            ``prompt_ids`` / ``prompt_mask``.
        max_new_tokens: response budget; ``length_sampler()`` overrides it per call.
        temperature: ``τ > 0``.  top_k, top_p: truncation (None = off, whatever the model's
            generation config says).
        num_samples: ``G`` samples per prompt.
        do_sample: False for greedy decoding (behaviour log-probs then score the logits as
            processed for greedy, i.e. at temperature 1).
        seed, generator: sampling randomness. ``generate`` draws from torch's global RNG, so it
            runs inside ``torch.random.fork_rng`` seeded with ``seed`` (or a seed drawn from
            ``generator``): the caller's global RNG is left as it was. With neither, the global
            RNG is used (and advanced).
        behaviour: which behaviour log-probs to record (``BEHAVIOUR_LOGPROBS``), or ``None`` for
            none (no ``old_logprobs``; recompute them with ``score_rollout``).
        max_prompt_length: keep the last tokens of longer text prompts (default: no limit).
        policy_version: stamped on every row as ``policy_version [B]`` when given.
        generate_kwargs: passed to ``generate`` (e.g. ``repetition_penalty``, ``min_new_tokens``).
    Returns:
        TensorDict ``[B = P·G]`` on the model's device: ``prompt_ids``, ``prompt_mask`` ``[B, P]``,
        ``response_ids``, ``response_mask``, ``old_logprobs`` ``[B, R]`` (float32, 0 after the
        stop token), ``group_id [B]`` (``g`` for the rows of prompt ``g``), and ``policy_version``.
        ``R`` is the longest response of the batch (at most ``max_new_tokens``).

    References:
        Fan et al., "Hierarchical Neural Story Generation" (top-k), https://arxiv.org/abs/1805.04833;
        Holtzman et al., "The Curious Case of Neural Text Degeneration" (top-p),
        https://arxiv.org/abs/1904.09751; Ziegler et al., "Fine-Tuning Language Models from Human
        Preferences" (rollouts with a length sampler), https://arxiv.org/abs/1909.08593.

    Gradient: none (generation runs under ``torch.no_grad()``).
    """
    try:
        record = None if behaviour is None else BEHAVIOUR_LOGPROBS[behaviour]
    except KeyError:
        raise ValueError(f"behaviour: unknown {behaviour!r}; valid: {sorted(BEHAVIOUR_LOGPROBS)} "
                         "or None") from None
    if not temperature > 0:
        raise ValueError(f"temperature: expected > 0, got {temperature} (use do_sample=False for greedy)")
    pad = pad_token_id(tokenizer)
    eos = tokenizer.eos_token_id if eos_token_id is None else eos_token_id
    stops = [*([] if eos is None else torch.as_tensor(eos).reshape(-1).tolist()), *stop_token_ids]
    if not stops:
        raise ValueError("eos_token_id: the tokenizer has no eos token; pass eos_token_id or stop_token_ids")
    device = next(model.parameters()).device
    batch = _prompts(prompts, tokenizer, pad, max_prompt_length).to(device)
    if length_sampler is not None:
        max_new_tokens = int(length_sampler())
    if generator is not None:
        seed = int(torch.randint(0, 2**62, (), generator=generator, device=generator.device))
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, enabled=seed is not None), torch.no_grad():
        if seed is not None:
            torch.manual_seed(seed)
        # Sampling settings are passed only when sampling (greedy decoding warns about them).
        sampling = dict(temperature=temperature, top_k=0 if top_k is None else top_k,
                        top_p=1.0 if top_p is None else top_p) if do_sample else {}
        out = model.generate(
            input_ids=batch[K.PROMPT_IDS], attention_mask=batch[K.PROMPT_MASK].long(), max_new_tokens=max_new_tokens,
            do_sample=do_sample, **sampling, num_return_sequences=num_samples, eos_token_id=stops,
            pad_token_id=pad, use_cache=use_cache, return_dict_in_generate=True,
            output_scores=behaviour == "sampled", output_logits=behaviour == "tempered", **generate_kwargs)
        response = out.sequences[:, batch[K.PROMPT_IDS].shape[-1]:]
        mask = response_mask_from_ids(response, stops)
        new = {K.RESPONSE_IDS: response, K.RESPONSE_MASK: mask,
               K.GROUP_ID: torch.arange(batch.batch_size[0], device=device).repeat_interleave(num_samples)}
        if record is not None:
            old = record(out, response, temperature).float()
            new[K.OLD_LOGPROBS] = torch.where(mask, old, torch.zeros((), dtype=old.dtype, device=old.device))
    rows = response.shape[0]
    rollout = batch.apply(lambda x: x.repeat_interleave(num_samples, dim=0), batch_size=[rows]).update(new)
    if policy_version is not None:
        rollout[K.POLICY_VERSION] = torch.full((rows,), policy_version, dtype=torch.long, device=device)
    return rollout
