"""SFT recipe: supervised fine-tuning on prompt/completion pairs, ``state, history = train(Config())``.

One fold step, read top to bottom:

1. collect: a batch of tokenised examples (``batch_source`` over the train split), right padded
   (``collate``) or, with ``packing``, packed first-fit into rows of ``max_length`` tokens
   (``pack_sequences``: ``position_ids`` restart with each example, which keeps the examples
   from attending to each other);
2. score: the loss mask becomes the tokens that are scored: completion tokens that have a
   predecessor in their own example (``position > 0``), so the global token count of ``update``
   is the count the loss divides by;
3. update: ``sft_loss`` (``rlcore.algorithms.sft``) of the per-token log-probs computed through
   ``loops.score`` inside the gradient tape (the chunked hidden-state path by default: no
   ``[B, T, V]`` logits), micro-batched with global denominators.

Evaluation on the held-out split: the token-mean NLL (``loss``) and the exact-match accuracy of
greedy generations against the ``answer`` column (the ``completion`` column if there is none).

References:
    Ouyang et al., "Training language models to follow instructions with human feedback"
    (supervised fine-tuning stage), https://arxiv.org/abs/2203.02155; Krell et al., "Efficient
    Sequence Packing without Cross-contamination", https://arxiv.org/abs/2107.02027
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import torch
from tensordict import TensorDict, TensorDictBase

from rlcore import keys as K
from rlcore.algorithms.sft import sft_loss
from rlcore.loops.collect import generate_rollout
from rlcore.loops.collate import collate_sequences, pack_sequences
from rlcore.loops.tokenization import check_context, check_rows_fit, model_context, tokenize_dataset
from rlcore.loops.fold import to_floats
from rlcore.loops.models import pad_token_id, position_ids_from_mask
from rlcore.loops.recipe import (batch_source, build_policy, init_train_state, load_splits, policy_tokenizer,
                                 require_held_out, run)
from rlcore.loops.config import RunConfig, autocast_dtype
from rlcore.loops.score import STAT_KEYS, TOP1, score_sequences, token_logprobs_from_model
from rlcore.masked import masked_mean
from rlcore.loops.settings import (AggregationSettings, BudgetSettings, ChunkSettings, DropoutSettings, Section,
                                   TruncationSettings, setting)
from rlcore.loops.state import TrainState, advance
from rlcore.loops.tasks import exact_match, task_dataset
from rlcore.loops.update import chain, clip_by_global_norm, skip_nonfinite, update

__all__ = ["Config", "scoring_mask", "token_stat_metrics", "sft_loss_fn", "sft_step", "check_lengths", "evaluate", "train"]


@dataclasses.dataclass(frozen=True)
class SFTSettings(Section):
    """How SFT rows are made and which tokens are scored (``loops.tokenization.tokenize_dataset``)."""

    packing: bool = setting(False, help="pack examples into rows of max_length (pack_sequences)")
    dataset_text_field: str = setting("text", help="the column of plain text to model")
    completion_only_loss: bool = setting(True, help="loss on completion tokens only; False: on the prompt too")
    assistant_only_loss: bool = setting(False, help="conversations: loss on every assistant turn, not only the last")


@dataclasses.dataclass(frozen=True)
class Config(SFTSettings, AggregationSettings, ChunkSettings, BudgetSettings, TruncationSettings, DropoutSettings,
             RunConfig, defaults={"disable_dropout": False, "max_new_tokens": 8, "run_dir": "runs/sft"}):
    """The SFT recipe's settings (``configs/sft.yaml``): ``RunConfig``'s sections and SFT's own; the
    token budget is the greedy evaluation's (exact match), dropout stays on as in TRL's trainer."""


# --- score and update --------------------------------------------------------------------------
def scoring_mask(batch: TensorDictBase) -> TensorDictBase:
    """A copy of ``batch`` whose ``loss_mask`` keeps only tokens with a predecessor in their example.

    ``loss_mask ∧ attention_mask ∧ position > 0``, positions from ``position_ids`` (packed rows)
    or from the attention mask: the first token of an example is never predicted (from padding
    or from the previous packed example).
    """
    mask = batch.get(K.ATTENTION_MASK)
    pos = batch.get(K.POSITION_IDS) if K.POSITION_IDS in batch.keys() else position_ids_from_mask(mask)
    return batch.copy().update({K.LOSS_MASK: batch.get(K.LOSS_MASK) & mask & (pos > 0)})


def _policy_logprobs(model, batch: TensorDictBase, *, chunked: bool, with_stats: bool = False) -> dict[str, torch.Tensor]:
    """``{logprobs: [B, T]}`` aligned with ``input_ids`` (column ``t`` scores token ``t``); with
    ``with_stats`` also ``entropy``, ``top1`` and ``mean_logit`` ``[B, T]`` from the same pass over
    the vocabulary (``loops.score.score_sequences``)."""
    if K.POSITION_IDS not in batch.keys():
        scored = score_sequences(model, batch, chunked=chunked, with_stats=with_stats)
        return {k: scored.get(k) for k in (K.LOGPROBS, *(STAT_KEYS if with_stats else ()))}
    out = token_logprobs_from_model(model, batch.get(K.INPUT_IDS), None, position_ids=batch.get(K.POSITION_IDS),
                                    chunked=chunked, with_stats=with_stats)  # packed: attention restarts with the positions
    parts = out if with_stats else (out,)
    keys = (K.LOGPROBS, *(STAT_KEYS if with_stats else ()))
    return {k: torch.cat([x.new_zeros(x.shape[0], 1), x], -1) for k, x in zip(keys, parts)}


def token_stat_metrics(stats: dict[str, torch.Tensor], mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """TRL's ``entropy`` and ``mean_token_accuracy`` over the scored tokens ``mask [B, T]``, detached.

    ``entropy = Σ_mask H_t / Σ mask`` (the policy's token entropy) and ``mean_token_accuracy =
    Σ_mask 1[argmax_v z_{t,v} = x_t] / Σ mask`` (ties: the first index); 0 for an empty mask.
    """
    return {"entropy": masked_mean(stats[K.ENTROPY].detach(), mask),
            "mean_token_accuracy": masked_mean(stats[TOP1].to(stats[K.ENTROPY].dtype), mask)}


def sft_loss_fn(state: TrainState, batch: TensorDictBase, *, agg: str = "token_mean", chunked: bool = True,
                num_tokens=None, num_seqs=None, with_stats: bool = True) -> tuple[torch.Tensor, TensorDict]:
    """``sft_loss`` of ``state``'s policy on a (micro-)batch: the ``loss_fn`` of ``update``.

    ``loss = aggregate(−log p(x_t | x_<t), loss_mask, agg)`` with the global denominators of the
    optimiser step. Reads ``input_ids``, ``attention_mask``, ``loss_mask`` ``[B, T]`` (and
    ``position_ids`` for packed rows); ``loss_mask`` must already be a ``scoring_mask``.
    With ``with_stats``, the metrics also hold ``entropy`` and ``mean_token_accuracy`` over the
    loss mask (``token_stat_metrics``), from the same pass over the vocabulary as the log-probs.
    Gradient: to the policy's parameters.
    """
    out = _policy_logprobs(state.model("policy"), batch, chunked=chunked, with_stats=with_stats)
    mask = batch.get(K.LOSS_MASK)
    scored = TensorDict({K.LOGPROBS: out[K.LOGPROBS], K.LOSS_MASK: mask}, batch_size=batch.batch_size)
    loss, metrics = sft_loss(scored, agg=agg, num_tokens=num_tokens, num_seqs=num_seqs)
    return loss, metrics.update(token_stat_metrics(out, mask)) if with_stats else metrics


def sft_step(state: TrainState, batch: TensorDictBase, *, agg: str = "token_mean", chunked: bool = True,
             micro_batch_size: int | None = None, max_grad_norm: float | None = 1.0,
             examples: int | None = None, autocast_dtype: torch.dtype | None = None) -> tuple[TrainState, TensorDict]:
    """One SFT step (impure: it trains): score the mask, one optimiser step on the whole batch.

    ``examples``: examples in the batch for ``samples_seen`` (default its rows; packed rows hold
    several). ``autocast_dtype``: as ``update``'s (``mixed_precision``).
    """
    device = next(state.model("policy").parameters()).device
    batch = scoring_mask(batch.to(device))
    rows = batch.batch_size[0]
    loss_fn = functools.partial(sft_loss_fn, agg=agg, chunked=chunked)
    state, metrics = update(state, batch, loss_fn, micro_batch_size=min(micro_batch_size or rows, rows),
                            autocast_dtype=autocast_dtype,
                            mask_key=K.LOSS_MASK,
                            transform=chain(skip_nonfinite(),
                                            None if max_grad_norm is None else clip_by_global_norm(max_grad_norm)))
    state = advance(state, samples_seen=examples or rows, tokens_seen=batch.get(K.ATTENTION_MASK).sum())
    # the loss's num_tokens (the step's scored tokens, per micro-batch) is logged as scored_tokens: num_tokens is
    # TRL's cumulative count of every token seen (state.tokens_seen, loops.logging.trl_names)
    return state, metrics.rename_key_("num_tokens", "scored_tokens")


# --- data --------------------------------------------------------------------------------------
def _prepare(data, tokenizer, config: Config, formatting_func: Callable[[dict], str | dict] | None = None):
    field = config.dataset_text_field
    if field != "text":
        if field not in data.column_names:
            raise ValueError(f"dataset_text_field: no column {field!r} in the dataset (columns {data.column_names})")
        data = data.rename_column(field, "text") if "text" not in data.column_names else \
            data.remove_columns("text").rename_column(field, "text")
    if config.assistant_only_loss and not config.completion_only_loss:
        raise ValueError("assistant_only_loss: scores the assistant turns only, while completion_only_loss=False "
                         "scores every token; set one of the two")
    return tokenize_dataset(data, tokenizer, max_length=config.max_length, max_prompt_length=config.max_prompt_length,
                            assistant_only_loss=config.assistant_only_loss, formatting_func=formatting_func)


def _whole_sequence_loss(batch: TensorDict) -> TensorDict:
    """``completion_only_loss=False``: every real token is a target (the first has no predictor, ``sft_step`` drops it)."""
    return batch.update({K.LOSS_MASK: batch[K.ATTENTION_MASK].clone()})


def _collate_fn(data, tokenizer, config: Config) -> Callable[[dict], TensorDict]:
    pad = pad_token_id(tokenizer)
    if config.packing:
        if config.max_length is None:
            raise ValueError("max_length: packing needs the row length (set max_length)")
        make = functools.partial(pack_sequences, seq_length=config.max_length, pad_id=pad)
    else:
        make = functools.partial(collate_sequences, pad_id=pad)
    return make if config.completion_only_loss else lambda rows: _whole_sequence_loss(make(rows))


def check_lengths(model, config: Config, **splits) -> None:
    """Refuse, before the first step, rows (or packed rows of ``max_length``) longer than the model's
    context (``loops.tokenization.check_context``), naming ``max_length``."""
    if config.packing and config.max_length is not None:
        check_context(model, config.max_length, f"max_length: packed rows of {config.max_length} tokens",
                      f"set max_length <= {model_context(model)}")
    check_rows_fit(model, [("prompt_ids", "completion_ids")], "max_length", **splits)


# --- evaluation --------------------------------------------------------------------------------
@torch.no_grad()
def _evaluate(state: TrainState, data, tokenizer, config: Config) -> dict[str, float]:
    model, pad = state.model("policy"), pad_token_id(tokenizer)
    device = next(model.parameters()).device
    n = len(data)
    batches = [scoring_mask(collate_sequences(data[i:i + config.eval_batch_size], pad_id=pad).to(device))
               for i in range(0, n, config.eval_batch_size)]
    total = sum(b.get(K.LOSS_MASK).sum() for b in batches)
    # token mean over the whole split: each batch's share with the split's token count as denominator
    loss = sum(sft_loss_fn(state, b, agg="token_mean", chunked=config.chunked, num_tokens=total, with_stats=False)[0]
               for b in batches)
    out = {"loss": loss, "perplexity": loss.exp()}
    column = next((c for c in ("answer", "completion") if c in data.column_names), None)
    answers = None if column is None else list(data[column])
    if "prompt" in data.column_names and answers is not None and all(isinstance(a, str) for a in answers):
        completions = []
        for i in range(0, n, config.eval_batch_size):
            prompts = list(data["prompt"][i:i + config.eval_batch_size])
            rollout = generate_rollout(model, tokenizer, prompts, do_sample=False, max_new_tokens=config.max_new_tokens,
                                       behaviour=None)
            completions += tokenizer.batch_decode([r[m].tolist() for r, m in zip(rollout.get(K.RESPONSE_IDS),
                                                                                 rollout.get(K.RESPONSE_MASK))],
                                                  skip_special_tokens=True)
        out["exact_match"] = torch.tensor(exact_match(completions, answers)).mean()
    return to_floats(out)


def evaluate(state: TrainState, config: Config, *,
             formatting_func: Callable[[dict], str | dict] | None = None) -> dict[str, float]:
    """Held-out ``loss`` (token-mean NLL of the completions), ``perplexity`` and ``exact_match``
    (greedy generations of ``max_new_tokens`` against the answers) of ``state``'s policy."""
    tokenizer = policy_tokenizer(config)
    require_held_out(config)
    _, held_out = load_splits(config, task_dataset)
    return _evaluate(state, _prepare(held_out, tokenizer, config, formatting_func), tokenizer, config)


# --- the recipe --------------------------------------------------------------------------------
def train(config: Config, *, formatting_func: Callable[[dict], str | dict] | None = None,
          callbacks: Sequence[Callable] = ()) -> tuple[TrainState, list[dict[str, float]]]:
    """Run (or, with ``resume``, continue) SFT: ``(state, history)``; ``callbacks`` run first each step.

    ``formatting_func(row) -> text | row`` (TRL's ``formatting_func``) turns each dataset row into
    the text to model (a string: loss on all of it) or into a row of a known format (e.g.
    ``{"prompt": ..., "completion": ...}``), before tokenisation, for both splits.
    """
    tokenizer = policy_tokenizer(config)  # the data is read and checked before any model is built
    train_data, held_out = (_prepare(d, tokenizer, config, formatting_func)
                            for d in load_splits(config, task_dataset))
    model, tokenizer = build_policy(config)
    check_lengths(model, config, train=train_data, held_out=held_out)
    state = init_train_state({"policy": model}, config)
    source = batch_source(train_data, config.batch_size, _collate_fn(train_data, tokenizer, config), seed=config.seed)
    step = functools.partial(sft_step, agg=config.agg, chunked=config.chunked, micro_batch_size=config.micro_batch_size,
                             max_grad_norm=config.max_grad_norm, examples=config.batch_size,
                             autocast_dtype=autocast_dtype(config))
    eval_fn = functools.partial(_evaluate, data=held_out, tokenizer=tokenizer, config=config)
    return run(step, state, source, config=config, num_steps=config.steps, eval_fn=eval_fn, name="sft",
               callbacks=callbacks, tokenizer=tokenizer)
