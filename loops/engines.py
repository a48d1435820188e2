"""Generation engines and sampling rules: what turns prompts into responses.

- ``ENGINES`` (one signature, chosen by name with ``engine=``): ``"hf"`` Hugging Face ``generate``,
  ``"loop"`` the KV-cache decode loop (:func:`sample_responses`), ``"vllm``" a vLLM engine;
- ``SAMPLERS`` (the loop's sampling rule, ``sampler=``): inverse-CDF (the default), Gumbel-max and
  multinomial draws, after temperature and top-k / top-p truncation (:func:`truncate_logits`);
- ``BEHAVIOUR_LOGPROBS``: which log-probs of the sampling distribution a rollout records.

``loops.collect.generate_rollout`` assembles a rollout around them."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from tensordict import TensorDict
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from rlcore import keys as K
from rlcore.checks import check_mask, lookup
from rlcore.logprobs import token_logprobs
from rlcore.loops.collate import pad_sequences
from rlcore.loops.dist import all_reduce_sum, sharded_root
from rlcore.loops.models import cache_keyword, model_device, position_ids_from_mask

__all__ = ["BEHAVIOUR_LOGPROBS", "multinomial_sample", "gumbel_max_sample", "inverse_cdf_sample", "SAMPLERS",
           "truncate_logits", "sample_responses", "ContextCache", "carries_context", "ENGINES"]


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


def multinomial_sample(logits: torch.Tensor, *, generator: torch.Generator | None = None) -> torch.Tensor:
    """One draw per row from ``softmax(logits)`` with ``torch.multinomial`` (what ``generate`` does).

    ``y_b ~ Categorical(softmax(z_b))``. On CPU ``multinomial`` draws ``V`` exponentials per row,
    which makes it the slowest sampler here; it is the reference the others are tested against.

    Args:
        logits: ``[B, V]`` float (already divided by the temperature, truncated entries ``−inf``).
        generator: the randomness (``None``: torch's global RNG).
    Returns:
        ``[B]`` long.
    """
    return torch.multinomial(logits.softmax(-1), 1, generator=generator)[:, 0]


def gumbel_max_sample(logits: torch.Tensor, *, generator: torch.Generator | None = None) -> torch.Tensor:
    """One draw per row from ``softmax(logits)`` by the Gumbel-max trick.

    ``y_b = argmax_v (z_{b,v} + g_{b,v})``, ``g = −log(−log u)``, ``u ~ U[0, 1)`` i.i.d.: an exact
    draw from ``softmax(z_b)`` (Gumbel 1954; Maddison et al. 2014) from ``V`` uniforms, one
    ``argmax`` and no normalisation. Entries at ``−inf`` are never drawn; a uniform of exactly 0
    (probability 2⁻²⁴ per entry in float32) gives ``g = −inf`` and removes that entry from that draw.

    Args:
        logits: ``[B, V]`` float (already divided by the temperature, truncated entries ``−inf``).
        generator: the randomness (``None``: torch's global RNG).
    Returns:
        ``[B]`` long.

    >>> gumbel_max_sample(torch.tensor([[0.0, -float("inf")]])).tolist()
    [0]

    References:
        Maddison, Tarlow & Minka, "A* Sampling", https://arxiv.org/abs/1411.0030 (the Gumbel-max
        trick); Gumbel, "Statistical theory of extreme values" (1954).
    """
    noise = torch.rand(logits.shape, generator=generator, dtype=logits.dtype, device=logits.device)
    return (logits - noise.log_().neg_().log_()).argmax(-1)


def inverse_cdf_sample(logits: torch.Tensor, *, generator: torch.Generator | None = None) -> torch.Tensor:
    """One draw per row from ``softmax(logits)`` by inverting its cumulative distribution.

    ``w = exp(z_b − max z_b)``, ``c_v = Σ_{u ≤ v} w_u`` (accumulated in float64), and
    ``y_b = min {v : c_v > U·c_V}`` with one ``U ~ U[0, 1)`` (float32) per row: an exact draw from
    ``softmax(z_b)`` up to the float32 rounding of ``w``, as ``torch.multinomial``'s. It needs one
    uniform per row instead of Gumbel-max's ``V`` (the generator dominates Gumbel-max's cost on
    CPU: ~4× slower at ``[8, 32000]``). Entries at ``−inf`` have ``w = 0`` and are never drawn
    (``U·c_V < c_V`` strictly, since ``U ≤ 1 − 2⁻²⁴`` and ``c_V`` is float64).

    Args:
        logits: ``[B, V]`` float (already divided by the temperature, truncated entries ``−inf``).
        generator: the randomness (``None``: torch's global RNG).
    Returns:
        ``[B]`` long.

    >>> inverse_cdf_sample(torch.tensor([[-float("inf"), 0.0, -float("inf")]])).tolist()
    [1]

    References:
        Devroye, "Non-Uniform Random Variate Generation" (1986), ch. III.2 (the inversion method).
    """
    top = logits.amax(-1, keepdim=True)
    cdf = (logits - top).exp_().cumsum(-1, dtype=torch.float64)
    u = torch.rand(logits.shape[:-1] + (1,), generator=generator, dtype=torch.float32, device=logits.device)
    return torch.searchsorted(cdf, u * cdf[..., -1:], right=True)[..., 0]


SAMPLERS: dict[str, Callable[..., torch.Tensor]] = {
    "multinomial": multinomial_sample,
    "gumbel": gumbel_max_sample,
    "inverse_cdf": inverse_cdf_sample,
}


def truncate_logits(logits: torch.Tensor, *, top_k: int | None = None, top_p: float | None = None) -> torch.Tensor:
    """Logits with the entries outside the top-k, then outside the nucleus ``top_p``, set to ``−inf``.

    Top-k keeps ``z_v ≥ z_(k)`` (the k-th largest; ties kept). Top-p keeps the smallest set of
    largest entries whose probability reaches ``top_p``: sorted ascending, an entry is removed when
    the cumulative probability up to and including it is ``≤ 1 − top_p``; the largest is always
    kept. The order and rules of Hugging Face's ``TopKLogitsWarper`` / ``TopPLogitsWarper``.

    Args:
        logits: ``[B, V]`` float (after the temperature).
        top_k: ``k ≥ 1`` or ``None`` / 0 (off).  top_p: ``0 < p ≤ 1`` or ``None`` (off).
    Returns:
        ``[B, V]``, a new tensor (or ``logits`` itself when both are off).

    >>> truncate_logits(torch.tensor([[1.0, 3.0, 2.0]]), top_k=2).tolist()
    [[-inf, 3.0, 2.0]]

    References:
        Fan et al., "Hierarchical Neural Story Generation", https://arxiv.org/abs/1805.04833;
        Holtzman et al., "The Curious Case of Neural Text Degeneration", https://arxiv.org/abs/1904.09751
    """
    lowest = torch.full((), -float("inf"), dtype=logits.dtype, device=logits.device)
    if top_k:
        kth = logits.topk(min(int(top_k), logits.shape[-1]), dim=-1).values[..., -1:]
        logits = torch.where(logits < kth, lowest, logits)
    if top_p is not None and top_p < 1.0:
        ascending, order = logits.sort(dim=-1)
        drop = ascending.softmax(-1).cumsum(-1) <= 1 - top_p
        drop[..., -1] = False  # a fresh tensor: the largest entry always stays
        logits = torch.where(drop.scatter(-1, order, drop), lowest, logits)
    return logits


def _prefill(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, num_samples: int):
    """One forward over the ``P`` prompts; the KV cache and last logits repeated to ``B = P·G`` rows.

    A model with ``prompt_kwargs(mask)`` (``ReftModel``: its intervention locations) gets those
    keywords in this forward only: decoding steps come after the prompt.
    """
    cache = DynamicCache(config=model.config)
    position = position_ids_from_mask(mask)
    extra = model.prompt_kwargs(mask) if callable(getattr(model, "prompt_kwargs", None)) else {}
    logits = model(input_ids=ids, attention_mask=mask.long(), position_ids=position, use_cache=True, logits_to_keep=1,
                   **{cache_keyword(model): cache}, **extra).logits[:, -1]
    cache.batch_repeat_interleave(num_samples)
    rep = lambda x: x.repeat_interleave(num_samples, dim=0)  # noqa: E731
    return cache, rep(logits), rep(mask.long()), rep(position[:, -1])


class ContextCache:
    """The keys and values of one sequence's first tokens, kept from one call of the ``"loop"`` engine
    to the next (a multi-turn episode's context: each turn only appends to it).

    ``ids`` are the tokens the cache encodes and ``layers`` one ``(keys, values)`` pair per layer,
    ``[heads, len(ids), head_dim]``. A call that gets the cache with a prompt row prefills only what
    follows ``ids`` in that row, when the row's real tokens start with ``ids`` (otherwise the whole
    row, as without a cache), and leaves in it the row's prompt and response as far as the model
    read them (the last token drawn is never read). The logits equal a prefill of the whole row up
    to float rounding (another summation order). An empty cache fills on its first call.

    The keys and values are those of the weights that computed them: after the weights change,
    start from empty caches (``sample_episodes`` keeps its caches for one call only). During a
    call the cache is empty (its tensors are in the call's batch), so a call that fails leaves it
    empty, never half written.
    """

    __slots__ = ("ids", "layers")

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __len__(self) -> int:
        return len(self.ids)


def carries_context(model: nn.Module) -> bool:
    """Whether ``model``'s decoding can start from a ``ContextCache``: every layer of its KV cache a
    plain full-attention one (no sliding window), and no prompt-position edits (``prompt_kwargs``)."""
    config = getattr(model, "config", None)
    if config is None or callable(getattr(model, "prompt_kwargs", None)):
        return False
    return all(type(layer) is DynamicLayer for layer in DynamicCache(config=config).layers)


def _prefill_continued(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, past: Sequence[ContextCache]):
    """``_prefill`` (one sample per row) that reads only what follows each row's ``past[b].ids``.

    Every row reads the same number ``S`` of tokens, its last ``S`` (``S`` the longest part some row
    has not cached: a row with less new text reads some of its cached tokens again), after its
    cached keys and values right aligned in ``[P, heads, T, d]``: row ``b`` is laid out
    ``[pad | cached | read]`` with no gap, as in a left-padded prefill of the whole row, which
    models that measure distances in columns (ALiBi, local attention windows) need; positions count
    real tokens only. At least a row's last token is read again (its logits start the decoding).
    The caches are emptied: their tensors now live in the batch's cache.
    """
    rows = [ids[b][mask[b]].tolist() for b in range(ids.shape[0])]
    cached = [min(len(c), len(r) - 1) if c.layers and r[:len(c)] == c.ids else 0 for c, r in zip(past, rows)]
    read = max(len(r) - n for r, n in zip(rows, cached))
    reused = [max(len(r) - read, 0) for r in rows]  # <= cached: len(r) - cached <= read
    T = max(reused)
    if T == 0:
        for c in past:
            c.ids, c.layers = [], []
        return _prefill(model, ids, mask, 1)
    cache = DynamicCache(config=model.config)
    past_mask = torch.zeros(len(rows), T, dtype=torch.bool, device=ids.device)
    for b, n in enumerate(reused):
        past_mask[b, T - n:] = True
    first = next(c for c, n in zip(past, reused) if n)
    for index, pair in enumerate(first.layers):
        kv = [x.new_zeros(len(rows), x.shape[0], T, x.shape[-1]) for x in pair]
        for b, n in enumerate(reused):
            for j in (0, 1):
                if n:
                    kv[j][b, :, T - n:] = past[b].layers[index][j][:, :n]
        cache.update(kv[0], kv[1], index)
    for c in past:
        c.ids, c.layers = [], []
    rest, rest_mask = (x.to(ids.device) for x in pad_sequences([r[n:] for r, n in zip(rows, reused)], side="left"))
    attention = torch.cat([past_mask, rest_mask], -1)
    position = position_ids_from_mask(attention)[:, T:]
    logits = model(input_ids=rest, attention_mask=attention.long(), position_ids=position, use_cache=True,
                   logits_to_keep=1, **{cache_keyword(model): cache}).logits[:, -1]
    return cache, logits, attention.long(), position[:, -1]


def _keep_context(past: Sequence[ContextCache], cache: DynamicCache, prefix: torch.Tensor, ids: torch.Tensor,
                  mask: torch.Tensor, fed: list[torch.Tensor], live: list[torch.Tensor]) -> None:
    """Each row's real columns of ``cache`` into ``past[b]``: those of ``prefix`` (the prefill's
    attention mask), then the tokens fed back at the decode steps (``fed[k]``) before the row
    stopped (``live[k]``)."""
    live_m = (torch.stack(live, -1) if live else mask.new_zeros(mask.shape[0], 0)).cpu()
    tokens = (torch.stack(fed, -1) if fed else ids.new_zeros(ids.shape[0], 0)).cpu()
    keep = torch.cat([prefix.bool().cpu(), live_m], -1)  # on the host: one copy, no sync per row
    prompt_ids, prompt_mask = ids.cpu(), mask.cpu()
    for b, entry in enumerate(past):
        columns = keep[b].nonzero().squeeze(1).to(cache.layers[0].keys.device)
        layers = [(layer.keys[b].index_select(1, columns), layer.values[b].index_select(1, columns))
                  for layer in cache.layers]
        entry.ids, entry.layers = prompt_ids[b][prompt_mask[b]].tolist() + tokens[b][live_m[b]].tolist(), layers


class _PreallocatedLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys and values live in buffers with room for ``capacity`` positions.

    ``update`` writes the new positions in place and returns views of the filled part, instead of
    concatenating the whole cache at every step (a copy of ``[B, heads, T, d]`` per layer and
    step); past ``capacity`` it grows by concatenation like its parent.
    """

    def __init__(self, layer: DynamicLayer, capacity: int):
        super().__init__()
        keys, values = layer.keys, layer.values
        self.device, self.is_initialized, self.length = keys.device, True, keys.shape[-2]
        shape = (*keys.shape[:-2], max(capacity, self.length), keys.shape[-1])
        self.key_buffer, self.value_buffer = keys.new_empty(shape), values.new_empty(shape[:-1] + values.shape[-1:])
        self.key_buffer[..., :self.length, :] = keys
        self.value_buffer[..., :self.length, :] = values
        self.keys, self.values = keys, values

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        end = self.length + key_states.shape[-2]
        if end > self.key_buffer.shape[-2]:
            self.key_buffer = torch.cat([self.key_buffer, torch.zeros_like(self.key_buffer)], -2)
            self.value_buffer = torch.cat([self.value_buffer, torch.zeros_like(self.value_buffer)], -2)
            return self.update(key_states, value_states)
        self.key_buffer[..., self.length:end, :] = key_states
        self.value_buffer[..., self.length:end, :] = value_states
        self.length = end
        self.keys, self.values = self.key_buffer[..., :end, :], self.value_buffer[..., :end, :]
        return self.keys, self.values


def _preallocate(cache: DynamicCache, capacity: int) -> DynamicCache:
    """``cache`` with its plain (full-attention, filled) layers moved into preallocated layers."""
    cache.layers = [_PreallocatedLayer(layer, capacity) if type(layer) is DynamicLayer and layer.is_initialized
                    and layer.keys.numel() else layer for layer in cache.layers]
    return cache


# Causal LMs whose logits are ``lm_head(last hidden state)``, a bias-free linear map and nothing after it
_PLAIN_HEADS = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"})


def _decode_forward(model: nn.Module) -> Callable[..., torch.Tensor]:
    """The decode step's forward: ``(ids [B, 1], attention [B, T], position [B, 1], cache) -> logits [B, V]``.

    For a causal LM of ``_PLAIN_HEADS`` (a LoRA ``PeftModel`` is unwrapped to it: its adapters live
    in the trunk's layers) whose head is a plain ``nn.Linear``, the trunk runs alone and the head is
    applied here; in float32 on CPU as ``(W hᵀ)ᵀ``, which MKL runs 2–3× faster than ``h Wᵀ`` at a few
    rows (``[8, 256] × [32000, 256]``: 2.0 ms against 5.8 ms on an AVX-512 EPYC; the head is the
    largest matmul of a small model's step). Same products, another summation order: logits agree
    with the model's forward to float32 rounding. Any other model runs its own forward.
    """
    inner = model
    peft_config = getattr(model, "active_peft_config", None)
    if callable(getattr(model, "get_base_model", None)) and not getattr(peft_config, "is_prompt_learning", True):
        inner = model.get_base_model()
    plain = type(inner).__name__ in _PLAIN_HEADS and sharded_root(model) is None  # FSDP2: the root's forward gathers
    head = inner.get_output_embeddings() if plain else None
    if type(head) is not nn.Linear or head.bias is not None:
        keyword = cache_keyword(model)
        return lambda ids, attention, position, cache: model(
            input_ids=ids, attention_mask=attention, position_ids=position, use_cache=True,
            **{keyword: cache}).logits[:, -1]
    trunk, weight, keyword = inner.get_decoder(), head.weight, cache_keyword(inner.get_decoder())

    def forward(ids, attention, position, cache):
        h = trunk(input_ids=ids, attention_mask=attention, position_ids=position, use_cache=True,
                  **{keyword: cache}).last_hidden_state[:, -1]
        if weight.dtype == torch.float32 and weight.device.type == "cpu":
            return (weight @ h.T).T.contiguous()
        return F.linear(h, weight)
    return forward


def _draw(logits: torch.Tensor, *, pick: Callable | None, temperature: float, top_k: int | None,
          top_p: float | None, generator: torch.Generator | None):
    """``(token [B], sampled log-prob [B], tempered log-prob [B])`` of one decode step."""
    z = logits.float() if temperature == 1.0 else logits.float() / temperature
    truncated = z if pick is None else truncate_logits(z, top_k=top_k, top_p=top_p)
    token = z.argmax(-1) if pick is None else pick(truncated, generator=generator)
    z_y = z.gather(-1, token[:, None])[:, 0]
    tempered = z_y - z.logsumexp(-1)
    sampled = tempered if truncated is z else z_y - truncated.logsumexp(-1)
    return token, sampled, tempered


@torch.no_grad()
def sample_responses(model: nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, *,
                     max_new_tokens: int, stop_token_ids: Sequence[int], pad_token_id: int, num_samples: int = 1,
                     temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                     sampler: str | None = "inverse_cdf", generator: torch.Generator | None = None,
                     past: Sequence[ContextCache] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Decode ``G`` responses per prompt over the model's KV cache, drawing with ``SAMPLERS[sampler]``.

    Each prompt is prefilled once and its cache repeated for its ``G`` samples. Step ``t``:
    ``z = logits/τ`` (float32), ``y_t = sampler(truncate_logits(z))`` (``argmax z`` at ``τ = 1``
    when ``sampler`` is None: greedy), then the token is fed back with position ``p + 1``. A row
    that has emitted a stop token gets ``pad_token_id`` afterwards; the loop ends when every row
    has stopped or after ``max_new_tokens`` steps.

    Args:
        model: a Hugging Face causal LM (a KV cache, ``logits_to_keep``), dropout off.
        prompt_ids: ``[P, L]`` long, left padded.  prompt_mask: ``[P, L]`` bool, ≥ 1 True per row.
        max_new_tokens: the budget.  stop_token_ids: ids that end a response (EOS included).
        num_samples: ``G``; rows are prompt-major (``B = P·G``).
        temperature, top_k, top_p: as ``generate_rollout`` (ignored when greedy).
        sampler: a key of ``SAMPLERS``, or ``None`` for greedy decoding.
        generator: the sampling randomness (``None``: torch's global RNG).
        past: one ``ContextCache`` per prompt (``G = 1``): each row's prefill reads only what follows
            its cached tokens, and the cache keeps the row's prompt and response afterwards
            (``carries_context(model)`` must hold).
    Returns:
        ``(response_ids [B, R], sampled [B, R], tempered [B, R])``, ``R ≤ max_new_tokens`` the steps
        run: the tokens, their log-probs under the distribution drawn from (after truncation) and
        under ``softmax(z/τ)``, float32 (values after a row's stop token are meaningless: mask them).

    Gradient: none (``torch.no_grad()``).
    """
    pick = None if sampler is None else lookup(SAMPLERS, sampler, what="sampler")
    tau = temperature if pick is not None else 1.0
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected >= 1, got {max_new_tokens}")
    check_mask("prompt_mask", prompt_mask, like=prompt_ids, like_name="prompt_ids")
    if past is not None:
        if num_samples != 1 or len(past) != prompt_ids.shape[0]:
            raise ValueError(f"past: expected one ContextCache per prompt and num_samples=1, got {len(past)} for "
                             f"{prompt_ids.shape[0]} prompts and num_samples={num_samples}")
        if not carries_context(model):
            raise ValueError(f"past: {type(model).__name__}'s decoding cannot start from a kept context (a sliding-"
                             "window layer or prompt-position edits); call without past")
        cache, logits, attention, position = _prefill_continued(model, prompt_ids, prompt_mask, past)
    else:
        cache, logits, attention, position = _prefill(model, prompt_ids, prompt_mask, num_samples)
    prefix = attention
    cache = _preallocate(cache, attention.shape[-1] + max_new_tokens)
    forward = _decode_forward(model)
    lockstep = sharded_root(model) is not None
    stops = torch.as_tensor(list(stop_token_ids), device=prompt_ids.device)
    done = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
    tokens, sampled, tempered, live = [], [], [], []
    for step in range(max_new_tokens):
        token, lp_s, lp_t = _draw(logits, pick=pick, temperature=tau, top_k=top_k, top_p=top_p, generator=generator)
        live.append(~done)
        token = torch.where(done, pad_token_id, token)
        tokens.append(token)
        sampled.append(lp_s)
        tempered.append(lp_t)
        done = done | torch.isin(token, stops)
        finished = bool(done.all())  # one host sync per step, as generate's criteria
        if lockstep:  # FSDP2: every forward is a collective, so no rank stops before all are done
            finished = bool(all_reduce_sum(torch.tensor([float(not finished)], device=done.device)).item() == 0)
        if step + 1 == max_new_tokens or finished:
            break
        attention = torch.cat([attention, attention.new_ones(attention.shape[0], 1)], -1)
        position = position + 1
        logits = forward(token[:, None], attention, position[:, None], cache)
    if past is not None:  # every token drawn but the last was read
        _keep_context(past, cache, prefix, prompt_ids, prompt_mask, tokens[:-1], live[:-1])
    return tuple(torch.stack(x, -1) for x in (tokens, sampled, tempered))


def _engine_hf(model: nn.Module, batch: TensorDict, *, behaviour: str | None, max_new_tokens: int, num_samples: int,
               stops: list[int], pad: int, greedy: bool, temperature: float, top_k: int | None, top_p: float | None,
               seed: int | None, sampler: str, options: Mapping[str, Any]):
    """Hugging Face ``generate`` (its sampling draws from the global RNG, which ``generate_rollout``
    seeds inside ``fork_rng``); ``options``: ``generate_kwargs`` and ``use_cache``. On an FSDP2 model
    transformers sets ``synced_gpus`` itself: a rank whose rows are done keeps stepping until every
    rank's are (tested in ``tests/loops/test_fsdp_recipes.py``)."""
    record = None if behaviour is None else BEHAVIOUR_LOGPROBS[behaviour]
    # Sampling settings are passed only when sampling (greedy decoding warns about them).
    sampling = dict(temperature=temperature, top_k=0 if top_k is None else top_k,
                    top_p=1.0 if top_p is None else top_p) if not greedy else {}
    out = model.generate(
        input_ids=batch[K.PROMPT_IDS], attention_mask=batch[K.PROMPT_MASK].long(), max_new_tokens=max_new_tokens,
        do_sample=not greedy, **sampling, num_return_sequences=num_samples, eos_token_id=stops,
        pad_token_id=pad, return_dict_in_generate=True, output_scores=record is _sampled_logprobs,
        output_logits=record is _tempered_logprobs, **options)
    response = out.sequences[:, batch[K.PROMPT_IDS].shape[-1]:]
    return response, None if record is None else record(out, response, 1.0 if greedy else temperature)


def _engine_loop(model: nn.Module, batch: TensorDict, *, behaviour: str | None, max_new_tokens: int, num_samples: int,
                 stops: list[int], pad: int, greedy: bool, temperature: float, top_k: int | None, top_p: float | None,
                 seed: int | None, sampler: str, options: Mapping[str, Any]):
    """``sample_responses`` with the ``sampler`` rule (greedy: argmax), drawing from its own generator
    seeded with ``seed``; both behaviour log-probs come from the same logits. ``options``: ``past``,
    one ``ContextCache`` per prompt."""
    g = None if seed is None else torch.Generator(model_device(model)).manual_seed(seed)
    response, *lps = sample_responses(model, batch[K.PROMPT_IDS], batch[K.PROMPT_MASK],
                                      max_new_tokens=max_new_tokens, stop_token_ids=stops, pad_token_id=pad,
                                      num_samples=num_samples, temperature=temperature, top_k=top_k,
                                      top_p=top_p, sampler=None if greedy else sampler, generator=g,
                                      past=options.get("past"))
    return response, None if behaviour is None else dict(zip(("sampled", "tempered"), lps))[behaviour]


def _engine_vllm(model: nn.Module, batch: TensorDict, *, behaviour: str | None, max_new_tokens: int, num_samples: int,
                 stops: list[int], pad: int, greedy: bool, temperature: float, top_k: int | None, top_p: float | None,
                 seed: int | None, sampler: str, options: Mapping[str, Any]):
    """A vLLM engine for ``model`` (``options``: ``vllm.LLM`` keywords). It records the truncated
    distribution's log-probs ("sampled"); "tempered" ones under top-k / top-p are left to one forward
    of the policy (``None`` here)."""
    from rlcore.loops.vllm_engine import engine_for, vllm_generate
    response, old = vllm_generate(engine_for(model, options), batch[K.PROMPT_IDS], batch[K.PROMPT_MASK],
                                  max_new_tokens=max_new_tokens, stop_token_ids=stops, pad_token_id=pad,
                                  num_samples=num_samples, temperature=temperature, top_k=top_k, top_p=top_p,
                                  greedy=greedy, seed=seed)
    truncating = bool(top_k) or (top_p is not None and top_p < 1.0)
    return response, None if behaviour is None or (behaviour == "tempered" and not greedy and truncating) else old


ENGINES: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor | None]]] = {
    "hf": _engine_hf,      # Hugging Face generate: every logits processor (generate_kwargs)
    "loop": _engine_loop,  # the KV-cache decode loop with a SAMPLERS rule: the fast one
    "vllm": _engine_vllm,  # a vLLM engine (loops.vllm_engine; the vllm extra)
}
