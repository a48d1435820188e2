"""Collect: generate responses with one of ``loops.engines.ENGINES`` and return a TensorDict rollout.

The rollout layout is the one of ``rlcore.keys``: ``prompt_ids [B, P]`` left padded with
``prompt_mask``, ``response_ids [B, R]`` right padded with ``response_mask`` (True up to and
including the first stop token), ``old_logprobs [B, R]`` (the behaviour log-probs), and
``group_id [B]`` (the prompt each sample answers; ``B = P·G`` rows, prompt-major).

Behaviour log-probs, recorded from generation itself (no second forward) with
``loops.engines.BEHAVIOUR_LOGPROBS``:

- ``"tempered"`` (default): ``log softmax(z/τ)`` of the raw logits over the full vocabulary,
  whatever top-k / top-p did. It is the one definition the policy, old-policy and reference
  log-probs share (``loops.score`` recomputes exactly this, ``token_logprobs_from_model(...,
  temperature=τ)``), so an unchanged policy has KL 0 to its own copy and an importance ratio of 1
  for any top-k / top-p: truncation shapes sampling only, as in TRL and verl.
- ``"sampled"``: log-probs under the distribution the token was actually drawn from: the logits
  after every logits processor ``generate`` ran (temperature, the truncation and renormalisation
  of top-k / top-p, plus anything in the model's generation config such as a repetition penalty).
  With top-k / top-p it is larger than the tempered log-prob, so it must not be compared with
  recomputed or reference log-probs (the KL to an unchanged copy is then > 0).

Without top-k / top-p (the defaults here; ``generate``'s own default of top-k 50 is switched
off explicitly) the two agree, and both match a recomputation through ``loops.score`` up to the
rounding of the KV-cached forward. Recording costs ``generate`` keeping one ``[B, V]`` tensor per
step; at large ``B·R·V`` pass ``behaviour=None`` and recompute them with
``score_rollout(rollout, policy=model)`` instead.

Generation engines (``loops.engines.ENGINES``, one signature, chosen by name with ``engine=``),
separate from the sampling rule (``loops.engines.SAMPLERS``, chosen with ``sampler=``, which only
the decode loop takes):

- ``"hf"`` (``generate_rollout``'s default): Hugging Face ``generate``, every logits processor it
  offers (``generate_kwargs``);
- ``"loop"`` (the online recipes' default): ``sample_responses``, a decode loop over the model's
  own KV cache that prefills each prompt once for its ``G`` samples, draws with the sampler
  (inverse CDF by default: one uniform per row against the cumulative softmax, exact, ~4x cheaper
  on CPU than Gumbel-max's ``V`` uniforms per row, which are in turn ~4x cheaper than ``softmax`` +
  ``multinomial``, whose exponential draws over ``V`` dominate a small model's decode step) and
  reads both behaviour log-probs from the same logits, with no ``[B, V]`` copies kept. It supports temperature, top-k and top-p, greedy decoding and stop tokens; not
  ``generate_kwargs``;
- ``"vllm"``: a vLLM engine kept in step with the model's weights (``loops.vllm_engine``;
  optional), configured by ``engine_options``.

All engines give the same rollout layout and log-probs that match a recomputation through
``loops.score``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn

from rlcore import keys as K
from rlcore.checks import check_mask, lookup, require_keys
from rlcore.loops.collate import collate_prompts
from rlcore.loops.engines import BEHAVIOUR_LOGPROBS, ENGINES, SAMPLERS, ContextCache
from rlcore.loops.models import model_device, pad_token_id
from rlcore.loops.score import score_rollout
from rlcore.loops.tokenization import check_context, model_context, tokenize_example

__all__ = ["generate_rollout", "draw_seed", "response_budget", "response_mask_from_ids", "left_align",
           "check_length_range", "uniform_length_sampler"]


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


def check_length_range(length_range: Sequence[int]) -> tuple[int, int]:
    """``(low, high)`` of a response-length range ``[low, high)``, or a ``ValueError`` naming
    ``length_sampler`` unless ``1 ≤ low < high`` are ints."""
    if (len(length_range) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in length_range)
            or not 1 <= length_range[0] < length_range[1]):
        raise ValueError(f"length_sampler: expected [low, high) with 1 <= low < high (ints), got {list(length_range)}")
    return int(length_range[0]), int(length_range[1])


def uniform_length_sampler(low: int, high: int, *, seed: int = 0) -> Callable[[], int]:
    """A ``length_sampler``: each call draws ``max_new_tokens`` uniformly from ``[low, high)``,
    from its own generator (``seed``), never the global RNG."""
    g = torch.Generator().manual_seed(seed)
    return lambda: int(torch.randint(low, high, (), generator=g))


# --- the sampling loop -----------------------------------------------------------------------------


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


# --- engines: (model, batch, *, ...) -> (response_ids [B, R], behaviour log-probs [B, R] or None) ---------


def _check_context(model: nn.Module, prompt_mask: torch.Tensor, max_new_tokens: int) -> None:
    """Refuse prompts that, with the response budget, run past the model's context
    (``loops.tokenization.check_context``)."""
    longest = int(prompt_mask.sum(-1).max()) if prompt_mask.numel() else 0
    room = max((model_context(model) or 0) - max_new_tokens, 0)
    check_context(model, longest + max_new_tokens,
                  f"prompts: the longest has {longest} tokens, which with max_new_tokens={max_new_tokens}",
                  f"set max_prompt_length <= {room} to keep each prompt's last tokens, or lower max_new_tokens")


def response_budget(max_new_tokens: int, length_sampler: Callable[[], int] | tuple[int, int] | None,
                    seed: int | None) -> int:
    """A call's response budget: ``max_new_tokens``, or drawn by ``length_sampler``: a callable
    ``() -> int``, or ``(low, high)``: uniform on ``[low, high)`` from a generator seeded with the
    call's sampling ``seed`` (the same seed, the same budget; unseeded without one)."""
    if isinstance(length_sampler, (tuple, list)):
        low, high = check_length_range(length_sampler)
        draw = torch.Generator().manual_seed(seed) if seed is not None else None
        return int(torch.randint(low, high, (), generator=draw))
    return max_new_tokens if length_sampler is None else int(length_sampler())


def draw_seed(generator: torch.Generator) -> int:
    """One sampling seed from ``generator`` (advancing it): ``randint(0, 2**62)`` on its device, the
    draw ``generate_rollout(generator=...)`` makes. Item ``i``'s seed in every online loop."""
    return int(torch.randint(0, 2**62, (), generator=generator, device=generator.device))


def generate_rollout(model: nn.Module, tokenizer, prompts, *, max_new_tokens: int = 64, temperature: float = 1.0,
                     top_k: int | None = None, top_p: float | None = None, num_samples: int = 1,
                     length_sampler: Callable[[], int] | tuple[int, int] | None = None, eos_token_id: int | Sequence[int] | None = None,
                     stop_token_ids: Sequence[int] = (), do_sample: bool = True, seed: int | None = None,
                     generator: torch.Generator | None = None, behaviour: str | None = "tempered",
                     max_prompt_length: int | None = None, policy_version: int | None = None,
                     use_cache: bool = True, engine: str = "hf", sampler: str = "inverse_cdf",
                     engine_options: Mapping[str, Any] | None = None,
                     context_caches: Sequence[ContextCache] | None = None, **generate_kwargs) -> TensorDict:
    """Sample ``G = num_samples`` responses per prompt (KV cache) into a rollout.

    Prompts are tokenised (conversations through the chat template) and left padded; a prompt
    TensorDict is re-aligned to left padding. ``ENGINES[engine]`` generates: ``"hf"`` the model's
    ``generate`` (each prompt expanded to ``G`` rows by ``num_return_sequences``), ``"loop"``
    ``sample_responses`` (each prompt prefilled once for its ``G`` samples, drawn with
    ``SAMPLERS[sampler]``), ``"vllm"`` a vLLM engine. Generation stops at ``eos_token_id`` (default
    the tokenizer's) or any of ``stop_token_ids``.

    Args:
        model: a Hugging Face causal LM (dropout should be off: ``disable_dropout`` or ``eval()``).
        prompts: ``list[str]``, ``list`` of conversations, or a TensorDict ``[P]`` with
            ``prompt_ids`` / ``prompt_mask``.
        max_new_tokens: response budget; ``length_sampler`` overrides it per call: a callable
            ``() -> int`` (e.g. ``uniform_length_sampler``), or ``(low, high)``: drawn uniformly
            from ``[low, high)`` by a generator seeded with the call's sampling seed, so the same
            seed always gives the same budget (TRL's ``LengthSampler``).
        temperature: ``τ > 0``.  top_k, top_p: truncation (None = off, whatever the model's
            generation config says).
        num_samples: ``G`` samples per prompt.
        do_sample: False for greedy decoding (behaviour log-probs then score the logits as
            processed for greedy, i.e. at temperature 1).
        seed, generator: sampling randomness. ``generate`` draws from torch's global RNG, so it
            runs inside ``torch.random.fork_rng`` seeded with ``seed`` (or a seed drawn from
            ``generator``): the caller's global RNG is left as it was (the sampling loop draws from
            its own generator seeded the same way). With neither, the global RNG is used (and advanced).
        behaviour: which behaviour log-probs to record (``BEHAVIOUR_LOGPROBS``), or ``None`` for
            none (no ``old_logprobs``; recompute them with ``score_rollout``).
        max_prompt_length: keep the last tokens of longer text prompts (default: no limit).
        policy_version: stamped on every row as ``policy_version [B]`` when given.
        engine: a key of ``ENGINES``: ``"hf"``, ``"loop"`` (the fast one), or ``"vllm"`` (a vLLM
            engine for ``model``, ``loops.vllm_engine``; ``vllm`` installed), which records
            the truncated distribution's log-probs; with top-k / top-p and ``behaviour="tempered"``
            the log-probs then come from one forward of ``model``.
        sampler: the ``"loop"`` engine's sampling rule, a key of ``SAMPLERS`` (``"inverse_cdf"``).
        engine_options: ``vllm.LLM`` keywords for ``engine="vllm"`` (``engine_for``).
        context_caches: ``engine="loop"`` with ``num_samples=1``: one ``ContextCache`` per prompt,
            which the prefill continues (only the tokens after a row's cached ones are read) and
            which keeps the row's prompt and response for the next call (a multi-turn episode).
        generate_kwargs: passed to ``generate`` (e.g. ``repetition_penalty``, ``min_new_tokens``),
            and ``use_cache``: the ``"hf"`` engine's only.
    Returns:
        TensorDict ``[B = P·G]`` on the model's device: ``prompt_ids``, ``prompt_mask`` ``[B, P]``,
        ``response_ids``, ``response_mask``, ``old_logprobs`` ``[B, R]`` (float32, 0 after the
        stop token), ``group_id [B]`` (``g`` for the rows of prompt ``g``), ``truncated [B]`` (True
        where the response used the whole budget with no stop token) and ``policy_version``.
        ``R`` is the longest response of the batch (at most ``max_new_tokens``).

    References:
        Fan et al., "Hierarchical Neural Story Generation" (top-k), https://arxiv.org/abs/1805.04833;
        Holtzman et al., "The Curious Case of Neural Text Degeneration" (top-p),
        https://arxiv.org/abs/1904.09751; Ziegler et al., "Fine-Tuning Language Models from Human
        Preferences" (rollouts with a length sampler), https://arxiv.org/abs/1909.08593.

    Gradient: none (generation runs under ``torch.no_grad()``).
    """
    if behaviour is not None and behaviour not in BEHAVIOUR_LOGPROBS:
        raise ValueError(f"behaviour: unknown {behaviour!r}; valid: {sorted(BEHAVIOUR_LOGPROBS)} or None")
    if not temperature > 0:
        raise ValueError(f"temperature: expected > 0, got {temperature} (use do_sample=False for greedy)")
    run = lookup(ENGINES, engine, what="engine")
    lookup(SAMPLERS, sampler, what="sampler")
    if engine_options and engine != "vllm":
        raise ValueError(f"engine_options: only for engine='vllm', got engine={engine!r}")
    if engine == "vllm" and callable(getattr(model, "prompt_kwargs", None)):
        raise ValueError(f"engine='vllm': {type(model).__name__} edits its forwards (prompt_kwargs), which a vLLM "
                         "engine cannot run; use engine='loop' or 'hf'")
    if context_caches is not None and (engine != "loop" or num_samples != 1):
        raise ValueError(f"context_caches: only for engine='loop' with num_samples=1, got engine={engine!r}, "
                         f"num_samples={num_samples}")
    if engine != "hf" and (generate_kwargs or not use_cache):
        raise ValueError(f"engine={engine!r}: takes no generate_kwargs and always uses the KV cache (got "
                         f"{sorted(generate_kwargs) + ([] if use_cache else ['use_cache=False'])}); use engine='hf'")
    pad = pad_token_id(tokenizer)
    eos = tokenizer.eos_token_id if eos_token_id is None else eos_token_id
    stops = [*([] if eos is None else torch.as_tensor(eos).reshape(-1).tolist()), *stop_token_ids]
    if not stops:
        raise ValueError("eos_token_id: the tokenizer has no eos token; pass eos_token_id or stop_token_ids")
    device = model_device(model)
    batch = _prompts(prompts, tokenizer, pad, max_prompt_length).to(device)
    if generator is not None:
        seed = draw_seed(generator)
    if isinstance(length_sampler, (tuple, list)):
        _check_context(model, batch[K.PROMPT_MASK], check_length_range(length_sampler)[1] - 1)  # every draw fits
    max_new_tokens = response_budget(max_new_tokens, length_sampler, seed)
    _check_context(model, batch[K.PROMPT_MASK], max_new_tokens)
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, enabled=seed is not None), torch.no_grad():
        if seed is not None:
            torch.manual_seed(seed)
        options = {**generate_kwargs, "use_cache": use_cache} if engine == "hf" else dict(engine_options or {})
        if context_caches is not None:
            options["past"] = context_caches
        response, old = run(model, batch, behaviour=behaviour, max_new_tokens=max_new_tokens, num_samples=num_samples,
                            stops=stops, pad=pad, greedy=not do_sample, temperature=temperature, top_k=top_k,
                            top_p=top_p, seed=seed, sampler=sampler, options=options)
        mask = response_mask_from_ids(response, stops)
        stopped = (torch.isin(response, torch.as_tensor(stops, device=response.device).reshape(-1)) & mask).any(-1)
        new = {K.RESPONSE_IDS: response, K.RESPONSE_MASK: mask, K.TRUNCATED: ~stopped,
               K.GROUP_ID: torch.arange(batch.batch_size[0], device=device).repeat_interleave(num_samples)}
        if old is not None:
            old = old.float()
            new[K.OLD_LOGPROBS] = torch.where(mask, old, torch.zeros((), dtype=old.dtype, device=old.device))
    rows = response.shape[0]
    rollout = batch.apply(lambda x: x.repeat_interleave(num_samples, dim=0), batch_size=[rows]).update(new)
    if behaviour is not None and old is None:  # an engine that could not record them: one forward of the policy
        rollout = score_rollout(rollout, policy=model, temperature=temperature)
    if policy_version is not None:
        rollout[K.POLICY_VERSION] = torch.full((rows,), policy_version, dtype=torch.long, device=device)
    return rollout
