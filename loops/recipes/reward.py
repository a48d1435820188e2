"""Reward-modelling recipe: a Bradley–Terry reward model from preference pairs.

``state, history = train(Config())``. The model is a one-label sequence classifier
(``AutoModelForSequenceClassification``: ``build_policy(config, task="reward")``), its score read
at the last real token of each sequence from the mask (``reward_model_scores``), never from pad
ids. One fold step, read top to bottom:

1. collect: a batch of preference pairs (``collate_preference``), plus the per-pair margin column
   ``margin_key`` when it is set;
2. score: inside the gradient tape, chosen and rejected sequences through the model in one
   forward of ``2B`` rows (both sides padded to one width);
3. update: ``reward_loss`` (``rlcore.algorithms.reward``): ``−logσ(r_w − r_l − m)`` averaged over
   pairs, plus ``center_rewards_coefficient · mean((r_w + r_l)²)`` when set.

Evaluation on the held-out pairs: preference ``accuracy`` (fraction with ``r_w > r_l``), the mean
``margin``, the loss and the mean rewards.

References:
    Ouyang et al., "Training language models to follow instructions with human feedback",
    https://arxiv.org/abs/2203.02155; Touvron et al., "Llama 2" (margin),
    https://arxiv.org/abs/2307.09288; Eisenstein et al., "Helping or Herding?" (centring),
    https://arxiv.org/abs/2312.09244
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import torch
from datasets import Dataset
from tensordict import TensorDict, TensorDictBase

from rlcore import keys as K
from rlcore.algorithms.reward import reward_loss
from rlcore.loops.collate import collate_preference, token_budget
from rlcore.loops.data import check_number_column
from rlcore.loops.tokenization import PAIR_SIDES, check_rows_fit, preference_format, tokenize_dataset
from rlcore.loops.models import pad_token_id, reward_model_scores
from rlcore.loops.recipe import (batch_source, build_policy, init_train_state, load_splits, mean_metrics,
                                 policy_tokenizer, require_held_out, run)
from rlcore.loops.config import RunConfig, autocast_dtype
from rlcore.loops.settings import AT_LEAST_0, DropoutSettings, PackingSettings, Section, TruncationSettings, setting
from rlcore.loops.state import TrainState, advance, batch_tokens
from rlcore.loops.tasks import preference_dataset
from rlcore.loops.update import chain, clip_by_global_norm, skip_nonfinite, update

__all__ = ["MODEL_TASK", "Config", "collate_pairs", "with_rewards", "reward_loss_fn", "reward_step", "evaluate", "train"]


MODEL_TASK = "reward"  # the policy is a one-label sequence classifier (loops.models.TASKS)


@dataclasses.dataclass(frozen=True)
class RewardLossSettings(Section):
    """The pairwise reward loss's settings (``algorithms.reward.reward_loss``)."""

    margin_key: str | None = setting(None, help="dataset column of per-pair margins m (Llama 2); None: no margin")
    center_rewards_coefficient: float | None = setting(None, help="c of c·mean((r_w + r_l)²); None: no centring",
                                                       range=AT_LEAST_0)


@dataclasses.dataclass(frozen=True)
class Config(RewardLossSettings, PackingSettings, TruncationSettings, DropoutSettings, RunConfig,
             defaults={"disable_dropout": False, "run_dir": "runs/reward"}):
    """The reward-modelling recipe's settings (``configs/reward.yaml``): ``RunConfig``'s sections and the
    loss's; dropout stays on as in TRL's trainer."""


# --- data ----------------------------------------------------------------------------------------
def collate_pairs(rows: dict, *, pad_id: int, margin_key: str | None = None) -> TensorDict:
    """``collate_preference`` plus the column ``margin_key`` as a ``[B]`` float32 entry of that name."""
    batch = collate_preference(rows, pad_id=pad_id)
    if margin_key is None:
        return batch
    if margin_key not in rows:
        raise KeyError(f"margin_key: the rows have no column {margin_key!r} (have {sorted(rows)})")
    return batch.update({margin_key: torch.as_tensor(rows[margin_key], dtype=torch.float32)})


# --- score and update ----------------------------------------------------------------------------
def with_rewards(model, batch: TensorDictBase, *, packed: bool = False) -> TensorDictBase:
    """A copy of ``batch`` with ``(chosen, reward)`` and ``(rejected, reward)`` ``[B]``: the model's
    scores at each sequence's last real token, both sides in one forward of ``2B`` rows (``packed``:
    padding-free, one row of their real tokens; ``loops.models.reward_model_scores``).
    Gradient: to the model's parameters (call under ``torch.no_grad()`` to evaluate)."""
    sides = (K.CHOSEN, K.REJECTED)
    width = max(batch.get((s, K.INPUT_IDS)).shape[-1] for s in sides)
    ids = torch.cat([_pad_right(batch.get((s, K.INPUT_IDS)), width) for s in sides])
    mask = torch.cat([_pad_right(batch.get((s, K.ATTENTION_MASK)), width) for s in sides])
    chosen, rejected = reward_model_scores(model, ids, mask, packed=packed).float().chunk(2)
    out = batch.copy()
    out[K.CHOSEN] = batch.get(K.CHOSEN).copy().update({K.REWARD: chosen})
    out[K.REJECTED] = batch.get(K.REJECTED).copy().update({K.REWARD: rejected})
    return out


def _pad_right(x: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, width - x.shape[-1]))


def reward_loss_fn(state: TrainState, batch: TensorDictBase, *, margin_key: str | None = None,
                   center_rewards_coefficient: float | None = None,
                   packed: bool = False) -> tuple[torch.Tensor, TensorDict]:
    """``reward_loss`` of ``state``'s reward model (``"policy"``) on a (micro-)batch of pairs: the
    ``loss_fn`` of ``update`` (a mean over pairs). Gradient: to the model's parameters."""
    scored = with_rewards(state.model("policy"), batch, packed=packed)
    return reward_loss(scored, margin_key=margin_key, center_rewards_coefficient=center_rewards_coefficient)


def reward_step(state: TrainState, batch: TensorDictBase, *, margin_key: str | None = None,
                center_rewards_coefficient: float | None = None, micro_batch_size: int | None = None,
                max_grad_norm: float | None = 1.0, wrap_loss: Callable[[Callable], Callable] | None = None,
                autocast_dtype: torch.dtype | None = None, packing: PackingSettings | None = None
                ) -> tuple[TrainState, TensorDict]:
    """One reward-modelling step (impure: it trains): one optimiser step on the batch's pairs.
    ``wrap_loss`` wraps the loss closure (``loops.reft_model.with_interventions``: the ReFT version);
    ``autocast_dtype`` as ``update``'s (``mixed_precision``); ``packing``: padding-free forwards and
    the token budget of the micro-batches."""
    batch = batch.to(next(state.model("policy").parameters()).device)
    rows = batch.batch_size[0]
    loss_fn = functools.partial(reward_loss_fn, margin_key=margin_key,
                                center_rewards_coefficient=center_rewards_coefficient,
                                packed=bool(packing and packing.padding_free))
    loss_fn = wrap_loss(loss_fn) if wrap_loss is not None else loss_fn
    state, metrics = update(state, batch, loss_fn, micro_batch_size=min(micro_batch_size or rows, rows),
                            **token_budget(packing),
                            autocast_dtype=autocast_dtype,
                            transform=chain(skip_nonfinite(),
                                            None if max_grad_norm is None else clip_by_global_norm(max_grad_norm)))
    return advance(state, samples_seen=rows, tokens_seen=batch_tokens(batch)), metrics


# --- evaluation ----------------------------------------------------------------------------------
def _prepare(data: Dataset, tokenizer, config: Config) -> Dataset:
    if config.margin_key is not None:  # NaN / inf margins refused at load, naming file, line and column
        check_number_column(data, config.margin_key, field="margin_key")
    if "input_ids_chosen" in data.column_names:
        return _pretokenised(data, config.max_length)
    return tokenize_dataset(data, tokenizer, format=preference_format(data.column_names),
                            max_length=config.max_length, max_prompt_length=config.max_prompt_length)


def _pretokenised(data: Dataset, max_length: int | None) -> Dataset:
    """TRL's pre-tokenised reward pairs (``input_ids_chosen`` / ``input_ids_rejected``, with optional
    ``attention_mask_*``): the real ids of each side as given (their start kept under ``max_length``),
    with an empty prompt."""
    missing = [c for c in ("input_ids_chosen", "input_ids_rejected") if c not in data.column_names]
    if missing:
        raise ValueError(f"dataset: pre-tokenised pairs need input_ids_chosen and input_ids_rejected, "
                         f"missing {missing}")

    def side(row: dict, name: str, index: int) -> list[int]:
        ids, mask = list(row[f"input_ids_{name}"]), row.get(f"attention_mask_{name}")
        if mask is not None:
            if len(mask) != len(ids):
                raise ValueError(f"row {index}: attention_mask_{name} has {len(mask)} entries, input_ids_{name} "
                                 f"{len(ids)}")
            ids = [t for t, m in zip(ids, mask) if m]
        if not ids:
            raise ValueError(f"row {index}: input_ids_{name} holds no token")
        return ids[:max_length] if max_length else ids

    def fn(row: dict, index: int) -> dict:
        return {"prompt_ids": [], "chosen_ids": side(row, "chosen", index),
                "rejected_ids": side(row, "rejected", index)}

    return data.map(fn, with_indices=True, keep_in_memory=True, load_from_cache_file=False)


@torch.no_grad()
def _evaluate(state: TrainState, data: Dataset, tokenizer, config: Config, *,
              collate: Callable[[dict], TensorDict] | None = None,
              wrap_loss: Callable[[Callable], Callable] | None = None) -> dict[str, float]:
    """Row-weighted means of ``reward_loss``'s metrics (``accuracy``, ``margin``, ``loss_bt``...);
    ``collate`` and ``wrap_loss`` as in training (the ReFT recipe's)."""
    device = next(state.model("policy").parameters()).device
    collate = collate or functools.partial(collate_pairs, pad_id=pad_token_id(tokenizer), margin_key=config.margin_key)
    loss_fn = wrap_loss(reward_loss_fn) if wrap_loss is not None else reward_loss_fn

    def results():
        for i in range(0, len(data), config.eval_batch_size):
            batch = collate(data[i:i + config.eval_batch_size]).to(device)
            loss, metrics = loss_fn(state, batch, margin_key=config.margin_key,
                                    center_rewards_coefficient=config.center_rewards_coefficient,
                                    packed=config.padding_free)
            yield batch.batch_size[0], {"loss": loss, **metrics.to_dict()}

    return mean_metrics(results())


def evaluate(state: TrainState, config: Config) -> dict[str, float]:
    """Held-out ``accuracy`` (fraction of pairs with ``r_w > r_l``), ``margin`` (mean
    ``r_w − r_l``), ``loss`` and the mean rewards of ``state``'s reward model."""
    require_held_out(config)
    tokenizer = policy_tokenizer(config)
    return _evaluate(state, _prepare(load_splits(config, preference_dataset)[1], tokenizer, config), tokenizer, config)


# --- the recipe ----------------------------------------------------------------------------------
def train(config: Config, *, callbacks: Sequence[Callable] = ()) -> tuple[TrainState, list[dict[str, float]]]:
    """Run (or, with ``resume``, continue) reward modelling: ``(state, history)``."""
    tokenizer = policy_tokenizer(config)  # the data is read and checked before any model is built
    train_data, held_out = (_prepare(d, tokenizer, config) for d in load_splits(config, preference_dataset))
    model, tokenizer = build_policy(config, task=MODEL_TASK)  # a reward model
    check_rows_fit(model, PAIR_SIDES, "max_length", train=train_data, held_out=held_out)
    state = init_train_state({"policy": model}, config)
    collate = functools.partial(collate_pairs, pad_id=pad_token_id(tokenizer), margin_key=config.margin_key)
    source = batch_source(train_data, config.batch_size, collate, seed=config.seed)
    step = functools.partial(reward_step, margin_key=config.margin_key,
                             center_rewards_coefficient=config.center_rewards_coefficient,
                             micro_batch_size=config.micro_batch_size, max_grad_norm=config.max_grad_norm,
                             autocast_dtype=autocast_dtype(config), packing=config)
    eval_fn = functools.partial(_evaluate, data=held_out, tokenizer=tokenizer, config=config)
    return run(step, state, source, config=config, num_steps=config.steps, eval_fn=eval_fn, name="reward",
               callbacks=callbacks, tokenizer=tokenizer)
