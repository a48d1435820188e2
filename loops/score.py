"""Scoring through models: per-token log-probs, values and rewards of rollouts and preference pairs.

Every forward here derives positions from the attention mask (``position_ids_from_mask``), so a
left padded and a right padded row give the same log-probs on real tokens, and builds no KV
cache. Log-probs go through ``rlcore.logprobs``: on the default ``chunked=True`` path the trunk's
hidden states meet the LM head's weight inside ``hidden_logprobs`` (vocabulary chunks, online
log-sum-exp), so the ``[B, T, V]`` logits never exist; ``chunked=False`` computes the logits of
the scored positions only (``logits_to_keep``) and reads them with ``token_logprobs``.

Alignment: a log-prob belongs to the token it scores. ``token_logprobs_from_model`` returns
``log p(x_{t+1} | x_{≤t})`` for the labels ``input_ids[:, 1:]`` (or for the last ``R`` tokens);
``concatenated_forward`` stores per-token log-probs aligned with ``input_ids`` (column ``t``
scores token ``t``; the first token of a sequence has none and holds 0).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn

from rlcore import keys as K
from rlcore.checks import check_mask, check_ndim, require_keys
from rlcore.kl import kl_full
from rlcore.logprobs import entropy_from_logits, sequence_logprobs, token_logprobs
from rlcore.lm_head import LogprobStats, hidden_logprobs
from rlcore.loops.dist import release_gathered
from rlcore.loops.lora import linear_weights
from rlcore.loops.models import (model_device, pack_rows, packed_trunk, position_ids_from_mask, reward_model_scores,
                                 trunk_hidden)
from rlcore.loops.reward_fns import as_completions, call_reward_terms, check_finite_scores

__all__ = ["token_logprobs_from_model", "packed_logprobs", "full_kl_from_models", "response_attention",
           "last_turn_ids", "sequences", "score_rollout", "score_sequences",
           "concatenated_forward", "precompute_reference_logps", "TOP1", "MEAN_LOGIT", "STAT_KEYS"]

# the per-token diagnostics ``score_sequences(..., with_stats=True)`` adds beside the log-probs
TOP1 = "top1"              # [B, T] bool: the token is the first argmax of the logits that predict it
MEAN_LOGIT = "mean_logit"  # [B, T] float: mean over the vocabulary of those logits (over τ)
STAT_KEYS = (K.ENTROPY, TOP1, MEAN_LOGIT)

_ROLLOUT_LAYOUT = {K.PROMPT_IDS: "[B, P] long (left padded)", K.PROMPT_MASK: "[B, P] bool",
                  K.RESPONSE_IDS: "[B, R] long (right padded)", K.RESPONSE_MASK: "[B, R] bool"}
_SIDE_LAYOUT = {K.INPUT_IDS: "[B, T] long", K.ATTENTION_MASK: "[B, T] bool", K.LOSS_MASK: "[B, T] bool"}


def _call(model: nn.Module, **kwargs):
    """``model(**kwargs)`` dropping the keywords a non-HF ``forward`` does not take."""
    params = inspect.signature(model.forward).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        kwargs = {k: v for k, v in kwargs.items() if k in params}
    return model(**kwargs)


def _on_model_device(model: nn.Module, fn: Callable[..., torch.Tensor], *tensors: torch.Tensor) -> torch.Tensor:
    """``fn(*tensors)`` with the tensors moved to ``model``'s device and the result moved back to
    theirs: a reference or reward model kept on another device (``ref_device``, ``reward_device``,
    e.g. the CPU beside a policy on the GPU) reads the rollout where it lives."""
    here, there = tensors[0].device, model_device(model)
    if there == here:
        return fn(*tensors)
    return fn(*(t.to(there) for t in tensors)).to(here)


def _head_params(model: nn.Module) -> dict:
    """The LM head of ``model`` as ``hidden_logprobs`` keywords (weight, bias, softcap, scale)."""
    head = model.get_output_embeddings()
    try:
        weight, bias = linear_weights(head)  # a peft-wrapped head: the map it applies now
    except TypeError as e:
        raise TypeError(f"model: the chunked path needs a linear LM head ({e}); use chunked=False") from None
    config = getattr(model, "config", None)
    scale = (getattr(config, "logit_scale", None) or 1.0) / (getattr(config, "logits_scaling", None) or 1.0)
    return dict(weight=weight, bias=bias, logit_scale=float(scale),
                softcap=getattr(config, "final_logit_softcapping", None))


def token_logprobs_from_model(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, *,
                              response_length: int | None = None, temperature: float = 1.0, chunked: bool = True,
                              position_ids: torch.Tensor | None = None, chunk_size: int = 4096,
                              with_entropy: bool = False, with_stats: bool = False
                              ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | LogprobStats:
    """Per-token log-probs of a sequence's own tokens through a causal LM, ``log softmax(z/τ)[x_{t+1}]``.

    ``lp[b, t] = log softmax(z_{b,t} / τ)[x_{b,t+1}]`` with ``z_{b,t}`` the logits after reading
    ``x_{b,≤t}`` (temperature applied as in sampling: logits divided by ``τ``). Positions are
    ``position_ids_from_mask(attention_mask)`` unless given, so left and right padding agree.

    Two paths, equal up to float rounding (and in gradient):
    - ``chunked=True`` (default): ``trunk_hidden`` then ``hidden_logprobs`` with the LM head's
      weight/bias (and the config's ``final_logit_softcapping`` / ``logit_scale``): no
      ``[B, T, V]`` logits. Needs a Hugging Face model with a linear head.
    - ``chunked=False``: the model's logits at the scored positions only (``logits_to_keep``),
      then ``token_logprobs`` (row-chunked, no float32 copy). Works with any causal LM whose
      output has ``.logits`` (e.g. ``rlcore.testing.MockLM``).

    Args:
        input_ids: ``[B, T]`` long.
        attention_mask: ``[B, T]`` bool, or ``None`` for rows without padding (packed rows with
            ``position_ids`` restarting per sequence: transformers then attends within each).
        response_length: ``R``: score only the last ``R`` tokens; default all but the first.
        temperature: ``τ > 0``, the sampling temperature.
        position_ids: ``[B, T]`` long, overrides the positions derived from the mask.
        chunk_size: vocabulary block of the chunked path.
        with_entropy: also the entropy ``H_t = −Σ_v p_v log p_v`` of ``p = softmax(z_t/τ)`` at the
            same positions, from the same pass over the vocabulary.
        with_stats: return a ``rlcore.lm_head.LogprobStats`` (log-probs, entropy, ``top1``: the
            label is the first argmax of ``z_t``, ``mean_logit``: ``mean_v z_{t,v}/τ``); on the
            chunked path from the same vocabulary pass, on the other from the logits already there.
    Returns:
        ``[B, T-1]`` (log-probs of ``input_ids[:, 1:]``) or ``[B, R]`` (of ``input_ids[:, -R:]``),
        float32 (float64 for a float64 model); with ``with_entropy``, ``(logprobs, entropy)`` of
        that shape. Values at padding positions are meaningless: mask them.

    References:
        Wijmans et al., "Cut Your Losses in Large-Vocabulary Language Models" (log-probs from
        hidden states without materialised logits), https://arxiv.org/abs/2411.09009

    Gradient: flows to the model's parameters (call under ``torch.no_grad()`` for old/ref
    log-probs).
    """
    check_ndim("input_ids", input_ids, ndim=2, layout="[B, T]")
    if attention_mask is not None:
        check_mask("attention_mask", attention_mask, like=input_ids, like_name="input_ids")
    T = input_ids.shape[1]
    n = T - 1 if response_length is None else int(response_length)
    if not 0 <= n < T:
        raise ValueError(f"response_length: expected 0 <= R < T = {T} (input_ids {list(input_ids.shape)}), "
                         f"got {n}")
    if position_ids is None:
        position_ids = (position_ids_from_mask(attention_mask) if attention_mask is not None
                        else torch.arange(T, device=input_ids.device).expand_as(input_ids))
    labels = input_ids[:, T - n:]
    if chunked:
        hidden = trunk_hidden(model, input_ids, attention_mask, position_ids=position_ids)[:, T - n - 1:T - 1]
        return hidden_logprobs(hidden, labels=labels, temperature=temperature, chunk_size=chunk_size,
                               with_entropy=with_entropy, with_stats=with_stats, **_head_params(model))
    mask = None if attention_mask is None else attention_mask.long()
    logits = _call(model, input_ids=input_ids, attention_mask=mask, position_ids=position_ids,
                   use_cache=False, logits_to_keep=n + 1).logits
    scored = logits[:, logits.shape[1] - n - 1:-1]
    lp = token_logprobs(scored, labels, temperature=temperature)
    if with_stats:
        return _logit_stats(scored, labels, lp, temperature)
    return (lp, entropy_from_logits(scored, temperature=temperature)) if with_entropy else lp


def _logit_stats(logits: torch.Tensor, labels: torch.Tensor, lp: torch.Tensor, temperature: float) -> LogprobStats:
    """``LogprobStats`` from logits that exist already (the ``chunked=False`` path): no float32 copy."""
    with torch.no_grad():
        top1 = logits.argmax(-1) == labels
        mean_logit = logits.mean(-1, dtype=lp.dtype) / temperature
    return LogprobStats(lp, entropy_from_logits(logits, temperature=temperature), top1, mean_logit)


@torch.no_grad()
def full_kl_from_models(policy: nn.Module, ref: nn.Module, rollout: TensorDictBase, *, temperature: float = 1.0,
                        rows_per_forward: int | None = None) -> torch.Tensor:
    """Exact per-token ``KL(π‖π_ref)`` over the vocabulary at each response position of a rollout:
    ``KL_j = Σ_v π(v | x_{<P+j}) (log π(v | ·) − log π_ref(v | ·))`` with both distributions
    ``softmax(z/τ)`` (``rlcore.kl.kl_full``), TRL's ``kl_penalty="full"``.

    Both models read ``[prompt | response]``; only the response positions' logits are kept
    (``logits_to_keep``), ``rows_per_forward`` rows at a time (``None``: all), so the memory is
    two ``[rows, R, V]`` logit blocks. Returns ``[B, R]`` float32 (float64 for float64 models),
    0 where ``response_mask`` is False. Gradient: none.
    """
    require_keys(rollout, list(_ROLLOUT_LAYOUT), where="full_kl_from_models", layouts=_ROLLOUT_LAYOUT)
    ids, mask = sequences(rollout)
    R, B = rollout[K.RESPONSE_IDS].shape[-1], ids.shape[0]
    step = rows_per_forward or B
    if step < 1:
        raise ValueError(f"rows_per_forward: expected a positive int or None, got {rows_per_forward!r}")
    position_ids = position_ids_from_mask(mask)

    def response_logits(model: nn.Module, rows: slice) -> torch.Tensor:
        def forward(i: torch.Tensor, m: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
            return _call(model, input_ids=i, attention_mask=m.long(), position_ids=p, use_cache=False,
                         logits_to_keep=R + 1).logits
        logits = _on_model_device(model, forward, ids[rows], mask[rows], position_ids[rows])
        return _at_least_fp32(logits[:, logits.shape[1] - R - 1:-1])

    chunks = [kl_full(response_logits(policy, slice(i, i + step)), response_logits(ref, slice(i, i + step)),
                      temperature=temperature) for i in range(0, B, step)]
    kl = torch.cat(chunks) if chunks else ids.new_zeros((0, R), dtype=torch.float32)
    for model in (policy, ref):
        release_gathered(model)  # FSDP2: no root held whole until the model's next forward
    return torch.where(rollout[K.RESPONSE_MASK], kl, torch.zeros((), dtype=kl.dtype, device=kl.device))


# --- rollouts --------------------------------------------------------------------------------
def response_attention(rollout: TensorDictBase) -> torch.Tensor:
    """What a rollout's model attends to in its response region ``[B, R]``: the ``trajectory_mask`` of a
    multi-turn rollout (the model's and the environment's tokens), else the ``response_mask``."""
    return rollout[K.TRAJECTORY_MASK] if K.TRAJECTORY_MASK in rollout.keys() else rollout[K.RESPONSE_MASK]


def last_turn_ids(rollout: TensorDictBase) -> list[list[int]]:
    """Each row's tokens of its last assistant turn (the answer a task reward grades): the
    ``response_mask`` tokens of the highest ``turn_ids``; a single-turn rollout's whole response."""
    mask = rollout[K.RESPONSE_MASK]
    ids = rollout[K.RESPONSE_IDS]
    if K.TURN_IDS not in rollout.keys():
        return [row[m].tolist() for row, m in zip(ids, mask)]
    turns = torch.where(mask, rollout[K.TURN_IDS], torch.full_like(rollout[K.TURN_IDS], -1))
    last = turns.max(-1, keepdim=True).values
    keep = mask & (turns == last)
    return [row[m].tolist() for row, m in zip(ids, keep)]


def sequences(rollout: TensorDictBase) -> tuple[torch.Tensor, torch.Tensor]:
    """A rollout as model input: ``[prompt (left padded) | response (right padded)]`` ids and bool
    mask ``[B, P+R]``. ``score_rollout`` concatenates them once per step and stores them as
    ``input_ids`` / ``attention_mask``; every later forward of the step (the policy's log-probs in
    each micro-batch, the critic, the full KL) reads those. A rollout not yet scored gets the
    concatenation; a multi-turn rollout attends to the environment's tokens too (``trajectory_mask``,
    ``response_attention``), while its ``response_mask`` keeps to the model's."""
    if K.INPUT_IDS in rollout.keys():
        return rollout[K.INPUT_IDS], rollout[K.ATTENTION_MASK]
    return (torch.cat([rollout[K.PROMPT_IDS], rollout[K.RESPONSE_IDS]], -1),
            torch.cat([rollout[K.PROMPT_MASK], response_attention(rollout)], -1))


def _at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float64 else x.float()


def _reward_model_name(model: nn.Module) -> str:
    """``reward model <its path or name>`` for error messages (``reward model`` when it has none)."""
    where = getattr(getattr(model, "config", None), "_name_or_path", "") or ""
    return f"reward model {where}".strip()


def _reward_model_id(model: nn.Module) -> str:
    """A reward model's name in the metrics (``rewards/<name>/mean``): the last part of its path, as
    TRL names one (``reward_model`` when it has none)."""
    where = str(getattr(getattr(model, "config", None), "_name_or_path", "") or "").rstrip("/")
    return where.rsplit("/", 1)[-1] or "reward_model"


def _decode(tokenizer, ids: torch.Tensor, mask: torch.Tensor) -> list[str]:
    return tokenizer.batch_decode([row[m].tolist() for row, m in zip(ids, mask)], skip_special_tokens=True)


def score_rollout(rollout: TensorDictBase, *, policy: nn.Module | None = None, ref: nn.Module | None = None,
                  value_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                  reward_fn: Callable | None = None, reward_model: nn.Module | None = None, tokenizer=None,
                  reward_columns: Mapping[str, Sequence] | None = None, temperature: float = 1.0,
                  chunked: bool = True, rows_per_forward: int | None = None, reward_timeout: float | None = None,
                  nonfinite_rewards: str = "raise", prompts: Sequence | None = None,
                  with_env_reward: bool = True) -> TensorDict:
    """Add log-probs, values and scores to a rollout: one no-grad forward per model given
    (``rows_per_forward`` rows at a time, ``None``: all).

    The forward input is the rollout layout concatenated, ``[prompt (left padded) | response
    (right padded)]`` ``[B, P+R]`` with its mask (:func:`sequences`; the result carries them as
    ``input_ids`` / ``attention_mask`` for the step's later forwards); token quantities are sliced
    to the response:

    - ``old_logprobs [B, R]`` with ``policy`` (recomputed by the learner: pass ``policy=None`` to
      keep the behaviour log-probs recorded by ``collect``);
    - ``ref_logprobs [B, R]`` with ``ref``, at the same ``temperature``;
    - ``values [B, R]`` with ``value_fn(input_ids [B, T], attention_mask [B, T]) -> [B, T]``
      (e.g. ``functools.partial(token_values, critic)``), read at the position before each
      response token: ``values[:, j] = V(x_{≤P-1+j})``, the state in which token ``j`` was sampled;
    - ``score [B]``: ``reward_model_scores(reward_model, ...)`` (the model must share the
      policy's tokenizer) plus, with ``reward_fn``, ``reward_fn(prompts=, completions=,
      completion_ids=, **reward_columns)``, every argument by keyword as TRL passes them
      (``loops.reward_fns``): ``prompts`` as given (the data's: text, or message lists), else the
      prompt ids decoded; ``completions`` the response ids decoded with ``tokenizer`` (special
      tokens skipped), each as ``[{"role": "assistant", "content": text}]`` when the prompts are
      conversations (``as_completions``); ``completion_ids`` each response's ids up to and
      including its stop token (lists of ints); a multi-turn episode's completion is its last
      assistant turn (``last_turn_ids``), and ``trajectories`` is every episode's whole decoded text,
      the environment's turns included (a single-turn response's own text). With both,
      the score is their sum (use ``combine_rewards`` for weights). A reward function's ``None``
      gives NaN ("no opinion"). Scores from either source pass one check
      (``loops.reward_fns.check_finite_scores``): a NaN or infinite score is a ``ValueError``
      naming the reward function or model and the rows (``nonfinite_rewards="raise"``) or NaN,
      like ``None`` (``"drop"``); a reward function's call may take ``reward_timeout`` seconds
      (``None``: no limit) before a ``TimeoutError`` names it;
    - ``reward_terms``, beside ``score``: a TensorDict ``[B]`` of each source's own unweighted scores
      by name (every function of a ``combine_rewards`` or the one function,
      ``loops.reward_fns.call_reward_terms``; the reward model under the last part of its path),
      NaN where it had no opinion: the per-function reward metrics read it.

    Token quantities are 0 where ``response_mask`` is False.

    Args:
        rollout: TensorDict ``[B]`` with ``prompt_ids``, ``prompt_mask``, ``response_ids``,
            ``response_mask``.
        temperature: the sampling temperature ``τ`` (log-probs of ``softmax(logits/τ)``).
        prompts: ``B`` prompts as the data holds them, one per row (``loops.reward_fns.repeat_prompts``),
            which the reward function receives; ``None``: the prompt ids decoded.
        reward_columns: the other keywords the reward function receives: the dataset's columns, one
            value per row (``loops.reward_fns.repeat_columns``), and ``trainer_state`` when known.
        with_env_reward: a multi-turn rollout's ``env_reward`` (``loops.episodes``) joins the score (as
            ``reward_terms["env"]``); ``False`` scores the answers alone (exact match).
    Returns:
        A shallow copy of ``rollout`` with the new keys; the input is not modified. Every prompt
        needs at least one real token (its last one predicts the first response token).

    References:
        Ziegler et al., "Fine-Tuning Language Models from Human Preferences",
        https://arxiv.org/abs/1909.08593; Ouyang et al., "Training language models to follow
        instructions with human feedback", https://arxiv.org/abs/2203.02155

    Gradient: none (everything is computed under ``torch.no_grad()``).
    """
    require_keys(rollout, list(_ROLLOUT_LAYOUT), where="score_rollout", layouts=_ROLLOUT_LAYOUT)
    prompt_mask, response_mask = rollout[K.PROMPT_MASK], rollout[K.RESPONSE_MASK]
    check_mask(K.PROMPT_MASK, prompt_mask, like=rollout[K.PROMPT_IDS], like_name=K.PROMPT_IDS)
    check_mask(K.RESPONSE_MASK, response_mask, like=rollout[K.RESPONSE_IDS], like_name=K.RESPONSE_IDS)
    if reward_fn is not None and tokenizer is None:
        raise ValueError("tokenizer: reward_fn scores decoded text, so score_rollout needs the tokenizer")
    ids, mask = sequences(rollout)
    P, R = prompt_mask.shape[-1], response_mask.shape[-1]
    if rows_per_forward is not None and (isinstance(rows_per_forward, bool) or not isinstance(rows_per_forward, int)
                                         or rows_per_forward < 1):
        raise ValueError(f"rows_per_forward: expected a positive int or None, got {rows_per_forward!r}")

    def response_only(x: torch.Tensor) -> torch.Tensor:
        return torch.where(response_mask, x, torch.zeros((), dtype=x.dtype, device=x.device))

    def by_rows(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        step = rows_per_forward or ids.shape[0]
        if step >= ids.shape[0]:
            return fn(ids, mask)
        return torch.cat([fn(ids[i:i + step], mask[i:i + step]) for i in range(0, ids.shape[0], step)])

    new: dict = {K.INPUT_IDS: ids, K.ATTENTION_MASK: mask}
    with torch.no_grad():
        for key, model in ((K.OLD_LOGPROBS, policy), (K.REF_LOGPROBS, ref)):
            if model is not None:
                new[key] = response_only(by_rows(lambda i, m, model=model: _on_model_device(
                    model, lambda i, m: token_logprobs_from_model(model, i, m, response_length=R,
                                                                  temperature=temperature, chunked=chunked), i, m)))
                release_gathered(model)  # FSDP2: the root is not held whole until the model's next forward
        if value_fn is not None:
            new[K.VALUES] = response_only(_at_least_fp32(by_rows(value_fn)[:, P - 1:P - 1 + R]))
        scores, terms = [], {}
        if reward_model is not None:
            from_model = _at_least_fp32(by_rows(lambda i, m: _on_model_device(
                reward_model, lambda i, m: reward_model_scores(reward_model, i, m), i, m)))
            release_gathered(reward_model)
            scores.append(check_finite_scores(from_model, _reward_model_name(reward_model),
                                              nonfinite_rewards=nonfinite_rewards))
            terms[_reward_model_id(reward_model)] = scores[-1]
        if reward_fn is not None:
            if prompts is None:
                prompts = _decode(tokenizer, rollout[K.PROMPT_IDS], prompt_mask)
            elif len(prompts) != rollout.batch_size[0]:
                raise ValueError(f"prompts: expected one per rollout row ({rollout.batch_size[0]}), got {len(prompts)}")
            completion_ids = last_turn_ids(rollout)  # a multi-turn episode's answer: its last assistant turn
            completions = as_completions(prompts, tokenizer.batch_decode(completion_ids, skip_special_tokens=True))
            columns = {**(reward_columns or {}), "completion_ids": completion_ids,  # the whole episode's text:
                       "trajectories": _decode(tokenizer, rollout[K.RESPONSE_IDS], response_attention(rollout))}
            total, by_fn = call_reward_terms(reward_fn, list(prompts), completions, reward_timeout=reward_timeout,
                                             nonfinite_rewards=nonfinite_rewards, **columns)
            scores.append(total.to(ids.device))
            terms.update({name: v.to(ids.device) for name, v in by_fn.items() if name not in terms})
        if K.ENV_REWARD in rollout.keys() and with_env_reward:  # the environment's rewards of the episode
            scores.append(check_finite_scores(_at_least_fp32(rollout[K.ENV_REWARD]), "the environment",
                                              nonfinite_rewards=nonfinite_rewards))
            terms["env"] = scores[-1]
        if scores:
            new[K.SCORE] = torch.stack(scores).sum(0)
            new[K.REWARD_TERMS] = TensorDict(terms, batch_size=rollout.batch_size, device=rollout.device)
    return rollout.copy().update(new)


# --- preference pairs ------------------------------------------------------------------------
def _pad_to(x: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, width - x.shape[-1]))


def _scored_logprobs(model, ids, mask, position_ids, scored, *, temperature, chunked,
                     with_stats=False) -> torch.Tensor | LogprobStats:
    """Log-probs aligned with ``ids [B, T]`` (column ``t`` scores token ``t``), 0 where not ``scored``
    (with ``with_stats``: a ``LogprobStats`` of such ``[B, T]`` tensors, 0 / False where not scored).

    On the chunked path the LM head runs on the scored positions only: their hidden states are
    gathered (``[N, H]``, ``N`` = scored tokens) before ``hidden_logprobs``, so prompt tokens cost
    the trunk but not the ``H × V`` head, in forward and backward.
    """
    if not chunked:
        out = token_logprobs_from_model(model, ids, mask, position_ids=position_ids, temperature=temperature,
                                        chunked=False, with_stats=with_stats)

        def align(x):
            x = torch.cat([x.new_zeros(x.shape[0], 1), x], -1)
            return torch.where(scored, x, torch.zeros((), dtype=x.dtype, device=x.device))

        return LogprobStats(*map(align, out)) if with_stats else align(out)
    hidden = trunk_hidden(model, ids, mask, position_ids=position_ids)
    target = scored[:, 1:]
    out = hidden_logprobs(hidden[:, :-1][target], labels=ids[:, 1:][target], temperature=temperature,
                          with_stats=with_stats, **_head_params(model))
    where = torch.cat([torch.zeros_like(scored[:, :1]), target], -1)

    def scatter(x):
        return torch.zeros(ids.shape, dtype=x.dtype, device=x.device).masked_scatter(where, x)

    return LogprobStats(*map(scatter, out)) if with_stats else scatter(out)


def packed_logprobs(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, scored: torch.Tensor, *,
                    temperature: float = 1.0, chunked: bool = True,
                    with_stats: bool = False) -> torch.Tensor | LogprobStats:
    """Padding-free log-probs: the real tokens of ``ids [B, T]`` (``mask``) packed into rows as long
    as the longest sequence (``loops.models.pack_rows``: positions restarting at 0 with each
    sequence), so padded positions cost neither the trunk nor the head.

    ``lp[b, t] = log softmax(z_{b,t−1}/τ)[ids[b, t]]`` where ``scored & mask`` and ``t`` is not the
    row's first real token, 0 elsewhere (aligned with ``ids``, as ``_scored_logprobs``): the values
    of the padded forward up to float rounding, for rows whose real tokens are contiguous. The
    state predicting a token sits just before it in its packed row. Attention stays within each
    sequence where transformers reads the restarting ``position_ids`` (its masking utilities:
    sdpa, eager, flex; flash attention's varlen path); see :func:`score_sequences` for the models
    that do not.

    Returns:
        ``[B, T]`` float32 (a ``LogprobStats`` of such with ``with_stats``).
    Gradient: flows to the model's parameters.
    """
    check_mask("attention_mask", mask, like=ids, like_name="input_ids")
    where = scored & mask & (position_ids_from_mask(mask) > 0)
    packing = pack_rows(ids, mask)
    src = packing.dest[where[mask]] - 1  # the packed position that reads the token before
    labels = ids[where]
    if chunked:
        hidden = packed_trunk(model, packing)[src]
        out = hidden_logprobs(hidden, labels=labels, temperature=temperature, with_stats=with_stats,
                              **_head_params(model))
    else:
        logits = _call(model, input_ids=packing.input_ids, position_ids=packing.position_ids, use_cache=False).logits
        picked = logits.reshape(-1, logits.shape[-1])[src]
        lp = token_logprobs(picked, labels, temperature=temperature)
        out = _logit_stats(picked, labels, lp, temperature) if with_stats else lp

    def scatter(x: torch.Tensor) -> torch.Tensor:
        return torch.zeros(ids.shape, dtype=x.dtype, device=x.device).masked_scatter(where, x)

    return LogprobStats(*map(scatter, out)) if with_stats else scatter(out)


def score_sequences(model: nn.Module, batch: TensorDictBase, *, temperature: float = 1.0, chunked: bool = True,
                    packed: bool = False, reference: bool = False, with_stats: bool = False) -> TensorDict:
    """Per-token and summed completion log-probs of a sequence batch (SFT, KTO, one preference side).

    ``logprobs[b, t] = log softmax(z_{b,t-1}/τ)[x_{b,t}]`` on ``loss_mask & (t is not the first
    real token)``, 0 elsewhere (aligned with ``input_ids``: column ``t`` scores token ``t``), and
    ``logps[b] = Σ_t logprobs[b, t]`` (``sequence_logprobs``). With ``packed=True`` all real
    tokens go into a single row (``[1, N]``, no padding computed), positions restarting at 0
    with each sequence.

    Packing limitation: the packed row relies on transformers detecting the restarting
    ``position_ids`` (attention_mask=None) to keep sequences from attending to each other; this
    holds for models whose masks come from transformers' masking utilities (Llama, GPT-2, most
    current decoders, sdpa/eager/flex) and for flash attention. Models with their own attention
    masking (custom code, ``MockLM``) would silently attend across sequences: use
    ``packed=False`` for them.

    Args:
        batch: TensorDict ``[B]`` with ``input_ids``, ``attention_mask`` and ``loss_mask``
            ``[B, T]`` (any padding side).
        reference: write ``ref_logps`` / ``ref_logprobs`` (computed under ``torch.no_grad()``)
            instead of ``logps`` / ``logprobs``.
        with_stats: also write, from the same pass over the vocabulary, ``entropy [B, T]`` (the
            policy's token entropy, with gradient), ``top1 [B, T]`` bool (the token is the first
            argmax of the logits predicting it) and ``mean_logit [B, T]`` (those logits' mean over
            the vocabulary, over ``τ``), aligned as ``logprobs``, 0 / False where not scored.
    Returns:
        A shallow copy of ``batch`` with ``logps [B]`` and ``logprobs [B, T]`` (or the ``ref_``
        keys), float32.

    References:
        Krell et al., "Efficient Sequence Packing without Cross-contamination",
        https://arxiv.org/abs/2107.02027

    Gradient: flows to the model's parameters unless ``reference``.
    """
    require_keys(batch, list(_SIDE_LAYOUT), where="score_sequences", layouts=_SIDE_LAYOUT)
    ids, mask, loss = (batch[k] for k in _SIDE_LAYOUT)
    check_mask(K.ATTENTION_MASK, mask, like=ids, like_name=K.INPUT_IDS)
    check_mask(K.LOSS_MASK, loss, like=ids, like_name=K.INPUT_IDS)
    kw = dict(temperature=temperature, chunked=chunked, with_stats=with_stats)
    pos = position_ids_from_mask(mask)
    scored = loss & mask & (pos > 0)
    with torch.set_grad_enabled(torch.is_grad_enabled() and not reference):
        if packed:  # one row of all real tokens, positions restarting with each sequence
            out = packed_logprobs(model, ids, mask, scored, **kw)
        else:
            out = _scored_logprobs(model, ids, mask, pos, scored, **kw)
        lp = out.logprobs if isinstance(out, LogprobStats) else out
        logps = sequence_logprobs(lp, scored)
    if reference:
        release_gathered(model)  # FSDP2: a frozen model's root is not held whole until its next forward
    seq_key, tok_key = (K.REF_LOGPS, K.REF_LOGPROBS) if reference else (K.LOGPS, K.LOGPROBS)
    stats = dict(zip(STAT_KEYS, out[1:])) if isinstance(out, LogprobStats) else {}
    return batch.copy().update({seq_key: logps, tok_key: lp, **stats})


def concatenated_forward(model: nn.Module, pair_batch: TensorDictBase, *, temperature: float = 1.0,
                         chunked: bool = True, packed: bool = False, reference: bool = False,
                         with_stats: bool = False) -> TensorDict:
    """Chosen and rejected sequences in ONE forward; per-side sequence log-probs and token log-probs.

    The two sides are right padded to a common length, concatenated on dim 0 (``[2B, T]``) and
    scored by ``score_sequences`` (with ``packed=True``: one row of all real tokens), then split
    back: per side, ``logprobs[b, t] = log p(x_{b,t} | x_{b,<t})`` on the scored completion
    tokens (0 elsewhere) and ``logps[b] = Σ_t logprobs[b, t]``.

    Args:
        pair_batch: TensorDict ``[B]`` with ``chosen`` and ``rejected`` sub-TensorDicts holding
            ``input_ids [B, T_s]``, ``attention_mask [B, T_s]`` and ``loss_mask [B, T_s]``
            (``T_s`` may differ per side; any padding side).
        reference: write ``ref_logps`` / ``ref_logprobs`` (computed under ``torch.no_grad()``)
            instead of ``logps`` / ``logprobs``.
        with_stats: also ``entropy``, ``top1`` and ``mean_logit`` ``[B, T_s]`` on each side
            (``score_sequences``).
    Returns:
        A shallow copy of ``pair_batch`` with, on each side, ``logps [B]`` and ``logprobs
        [B, T_s]`` (or ``ref_logps`` / ``ref_logprobs``).

    References:
        Rafailov et al., "Direct Preference Optimization", https://arxiv.org/abs/2305.18290;
        Krell et al., "Efficient Sequence Packing without Cross-contamination",
        https://arxiv.org/abs/2107.02027

    Gradient: flows to the model's parameters unless ``reference``.
    """
    sides = (K.CHOSEN, K.REJECTED)
    require_keys(pair_batch, [(s, k) for s in sides for k in _SIDE_LAYOUT], where="concatenated_forward",
                 layouts={(s, k): v for s in sides for k, v in _SIDE_LAYOUT.items()})
    for s in sides:
        for key in (K.ATTENTION_MASK, K.LOSS_MASK):
            check_mask(f"{s}.{key}", pair_batch[s, key], like=pair_batch[s, K.INPUT_IDS], like_name=f"{s}.input_ids")
    widths = [pair_batch[s, K.INPUT_IDS].shape[-1] for s in sides]
    B = pair_batch.batch_size[0]
    flat = TensorDict({k: torch.cat([_pad_to(pair_batch[s, k], max(widths)) for s in sides]) for k in _SIDE_LAYOUT},
                      batch_size=[2 * B])
    scored = score_sequences(model, flat, temperature=temperature, chunked=chunked, packed=packed, reference=reference,
                             with_stats=with_stats)
    seq_key, tok_key = (K.REF_LOGPS, K.REF_LOGPROBS) if reference else (K.LOGPS, K.LOGPROBS)
    token_keys = (tok_key, *(STAT_KEYS if with_stats else ()))
    out = pair_batch.copy()
    for i, (s, w) in enumerate(zip(sides, widths)):
        rows = slice(i * B, (i + 1) * B)
        out[s] = pair_batch[s].copy().update({seq_key: scored[seq_key][rows],
                                              **{k: scored[k][rows, :w] for k in token_keys}})
    return out


def precompute_reference_logps(ref_model: nn.Module, batches: Iterable[TensorDictBase], *,
                               temperature: float = 1.0, chunked: bool = True, packed: bool = False) -> TensorDict:
    """Reference sequence log-probs of a whole preference dataset, for DPO with precomputed refs.

    Runs ``concatenated_forward(ref_model, batch, reference=True)`` over ``batches`` (in order,
    under ``torch.no_grad()``) and concatenates the results: the reference model is then not
    needed during training.

    Args:
        batches: preference batches (``collate_preference``), in dataset order.

    Returns:
        TensorDict ``[N]`` with ``(chosen, ref_logps)`` and ``(rejected, ref_logps)`` ``[N]``, in
        the order of ``batches``. Store them with the dataset (iterated unshuffled) as columns
        ``ref_chosen_logps`` / ``ref_rejected_logps``, which ``collate_preference`` reads back::

            batches = iterate_batches(ds, tok, 8, format="preference")
            ref = precompute_reference_logps(ref_model, batches)
            ds = ds.add_column("ref_chosen_logps", ref["chosen", "ref_logps"].tolist())
            ds = ds.add_column("ref_rejected_logps", ref["rejected", "ref_logps"].tolist())
    """
    parts = []
    with torch.no_grad():
        for batch in batches:
            scored = concatenated_forward(ref_model, batch, temperature=temperature, chunked=chunked,
                                          packed=packed, reference=True)
            parts.append(scored.select((K.CHOSEN, K.REF_LOGPS), (K.REJECTED, K.REF_LOGPS)))
    if not parts:
        raise ValueError("batches: empty; nothing to score")
    return torch.cat(parts)
