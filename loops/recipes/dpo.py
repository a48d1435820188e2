"""Offline preference optimisation recipe: DPO and every pairwise / unpaired variant, by name.

``state, history = train(Config(loss_type="sigmoid"))``. ``loss_type`` is a key of
``rlcore.algorithms.preference.PREFERENCE_LOSSES``, one name per loss: the DPO family by TRL's
names (``"sigmoid"``, ``"ipo"``, ``"hinge"``, ...), ``"orpo"``, ``"simpo"``, ``"cpo"``, ``"kto"``.
``beta`` left at ``None`` keeps the loss's own default (SimPO's is 2, DPO's 0.1); the loss's
other hyper-parameters go in ``loss_kwargs`` (``{label_smoothing: 0.1}``, ``{rpo_alpha: 1.0}``,
...), each checked against the loss's signature (a ``ValueError`` names the loss's parameters).

One fold step, read top to bottom:

1. collect: a batch of preference pairs (``collate_preference``: nested ``chosen`` /
   ``rejected``), or for KTO the pairs unpaired into desirable / undesirable rows
   (``collate_unpaired``) with their mismatched pairs (``collate_mismatched``);
2. score: reference log-probs, from the frozen reference (``"ref"`` in the state,
   ``build_reference``: a copy of the initial policy, or ``ref_model``), or precomputed once over
   the dataset before training (``precompute_ref``: the reference is then not kept at all), or
   none for the reference-free losses (ORPO, SimPO, CPO, ``reference_free=True``); for KTO also
   the mismatched pairs' log-probs (``kl_logps``, no gradient) that estimate the reference point;
3. update: the loss on the policy's log-probs, chosen and rejected in one forward
   (``concatenated_forward``) inside the gradient tape.

``init_from`` starts the policy (and so the reference) from an SFT checkpoint. Evaluation on the
held-out pairs: the loss's metrics, among them ``rewards/accuracies`` (preference accuracy of
the implicit rewards) and ``rewards/margins``; for KTO, whose batches are unpaired, the
accuracy and margins of its implicit rewards ``β·(log π − log π_ref)`` on the pairs.

References:
    Rafailov et al., "Direct Preference Optimization: Your Language Model is Secretly a Reward
    Model", https://arxiv.org/abs/2305.18290; Ethayarajh et al., "KTO: Model Alignment as
    Prospect Theoretic Optimization", https://arxiv.org/abs/2402.01306
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import torch
from datasets import Dataset
from tensordict import TensorDict, TensorDictBase

from rlcore import keys as K
from rlcore.algorithms.dpo import dpo
from rlcore.algorithms.preference import PREFERENCE_LOSSES
from rlcore.loops.collate import collate_mismatched, collate_preference, collate_unpaired, iterate_batches, token_budget
from rlcore.loops.tokenization import PAIR_SIDES, check_rows_fit, preference_format, tokenize_dataset
from rlcore.loops.models import mix_into_reference, model_device, pad_token_id, position_ids_from_mask
from rlcore.loops.recipe import (batch_source, build_policy, build_reference, init_train_state, load_splits,
                                 mean_metrics, policy_tokenizer, require_held_out, run)
from rlcore.loops.config import RunConfig, autocast_dtype, try_loss
from rlcore.loops.score import MEAN_LOGIT, STAT_KEYS, TOP1, concatenated_forward, precompute_reference_logps, score_sequences
from rlcore.loops.settings import (ChunkSettings, DropoutSettings, LossTypeSettings, PackingSettings,
                                   PreferenceSettings, ReferenceSettings, Section, TruncationSettings, setting)
from rlcore.loops.state import TrainState, advance, batch_tokens
from rlcore.loops.tasks import preference_dataset
from rlcore.loops.update import chain, clip_by_global_norm, skip_nonfinite, update
from rlcore.checks import bind_keywords, lookup
from rlcore.testing import make_preference_batch

__all__ = ["Config", "REFERENCE_FREE", "UNPAIRED", "bind_loss", "needs_reference",
           "check_reference_sync", "sync_reference", "reference_models", "unpair", "with_reference",
           "pair_stat_metrics", "preference_loss_fn", "dpo_step", "kto_step", "evaluate", "train"]

REFERENCE_FREE = ("orpo", "simpo", "cpo")  # losses that read no reference log-probs
UNPAIRED = ("kto",)                        # losses on the unpaired layout


@dataclasses.dataclass(frozen=True)
class DPOSettings(Section):
    """The offline preference recipe's own settings."""

    truncation_mode: str = setting("keep_end", help="which end of a cut prompt is kept: keep_end | keep_start")
    precompute_ref: bool = setting(False, help="reference log-probs computed once before training, no ref model kept")


@dataclasses.dataclass(frozen=True)
class Config(DPOSettings, PreferenceSettings, ReferenceSettings, LossTypeSettings, PackingSettings, ChunkSettings,
             TruncationSettings, DropoutSettings, RunConfig, defaults={"lr": 5e-4, "run_dir": "runs/dpo"}):
    """The preference recipe's settings (``configs/dpo.yaml``): ``RunConfig``'s sections, the loss
    (``loss_type``: a key of ``PREFERENCE_LOSSES``; ``beta``, ``loss_kwargs``), the reference and
    the recipe's own (``DPOSettings``)."""

    def keyword_functions(self) -> dict[str, Callable]:
        """The loss ``loss_kwargs`` feeds, bound (``bind_loss``): ``check_config`` checks each keyword's
        name and type against it when the config is loaded."""
        return {"loss_kwargs": bind_loss(self)}

    def try_loss(self) -> None:
        """The bound loss once on a dummy batch (``try_bound_loss``): ``check_config`` runs it at load."""
        try_bound_loss(self)


# --- the loss ------------------------------------------------------------------------------------
def try_bound_loss(config) -> None:
    """Run ``bind_loss(config)`` once on a tiny dummy batch (two pairs; two unpaired rows for KTO), so
    the loss's own checks of its settings run at load, before any model is built (``loops.config.try_loss``):
    a ``ConfigError`` names the field, ``beta`` or ``loss_kwargs.<name>``."""
    if config.loss_type in UNPAIRED:
        logps = torch.tensor([-2.0, -3.0])
        batch = TensorDict({K.LOGPS: logps, K.REF_LOGPS: logps - 0.5, K.KL_LOGPS: logps, K.REF_KL_LOGPS: logps - 0.25,
                            K.LABELS: torch.tensor([True, False])}, batch_size=[2])
    else:
        batch = make_preference_batch(2, 6)
    fields = {"beta": "beta", **{str(k): f"loss_kwargs.{k}" for k in config.loss_kwargs}}
    try_loss(bind_loss(config), batch, fields=fields, where=f"loss_type {config.loss_type!r}")


def bind_loss(config: Config) -> Callable[[TensorDictBase], tuple[torch.Tensor, TensorDict]]:
    """``PREFERENCE_LOSSES[config.loss_type]`` with ``beta`` (when set) and ``loss_kwargs`` bound.

    Raises ``ValueError`` for an unknown ``loss_type`` (listing the valid ones), a keyword the loss
    does not take (naming the loss's parameters) or ``beta`` given twice.
    """
    fn = lookup(PREFERENCE_LOSSES, config.loss_type, what="loss_type")
    if "beta" in config.loss_kwargs:
        raise ValueError("loss_kwargs: beta is a field of its own (beta: ...), not a loss keyword")
    chosen = {**({"beta": config.beta} if config.beta is not None else {}), **config.loss_kwargs}
    return bind_keywords(fn, chosen, what="loss_kwargs", name=config.loss_type, positional=("batch", "loss_type"))


def needs_reference(config: Config) -> bool:
    """Whether the selected loss reads reference log-probs (not ORPO, SimPO, CPO, nor ``reference_free``)."""
    return config.loss_type not in REFERENCE_FREE and not config.loss_kwargs.get("reference_free", False)


def check_reference_sync(config) -> None:
    """Refuse ``sync_ref_model`` where there is no reference model to move: a reference-free loss,
    reference log-probs computed once before training (``precompute_ref``), or the base under a
    LoRA policy (``use_peft`` without a ``ref_model``)."""
    if not getattr(config, "sync_ref_model", False):
        return
    if not needs_reference(config):
        raise ValueError(f"sync_ref_model: loss_type {config.loss_type!r} (reference_free="
                         f"{config.loss_kwargs.get('reference_free', False)}) reads no reference, so there is none "
                         "to sync")
    if getattr(config, "precompute_ref", False):
        raise ValueError("sync_ref_model: the reference log-probs are computed once before training with "
                         "precompute_ref=True, so a moving reference cannot be used; set one of the two to false")
    if getattr(config, "use_peft", False) and not getattr(config, "ref_model", None):
        raise ValueError("sync_ref_model: the reference of a LoRA policy is its base with the adapter off, shared "
                         "with the policy, so it cannot move apart; give a ref_model, or set use_peft false")


def sync_reference(state: TrainState, config) -> TrainState:
    """TR-DPO's reference update after a step, in place: when ``sync_ref_model`` is set and the step
    that has just trained is the ``ref_model_sync_steps``-th (``state.step + 1`` a multiple),
    ``θ_ref ← α·θ + (1 − α)·θ_ref`` with ``α = ref_model_mixup_alpha`` (``mix_into_reference``).
    The moving reference is saved in every checkpoint (``reference_models``)."""
    if getattr(config, "sync_ref_model", False) and (state.step + 1) % config.ref_model_sync_steps == 0:
        mix_into_reference(state.model("ref"), state.model("policy"), config.ref_model_mixup_alpha)
    return state


def reference_models(config) -> tuple[str, ...] | None:
    """The models a checkpoint keeps besides the trainable ones: the reference when it moves."""
    return ("ref",) if getattr(config, "sync_ref_model", False) else None


# --- score and update ----------------------------------------------------------------------------
def with_reference(state: TrainState, batch: TensorDictBase, *, chunked: bool = True,
                   packed: bool = False) -> TensorDictBase:
    """``batch`` with reference log-probs from ``state``'s ``"ref"`` model (no gradient), unless it
    carries them already (precomputed) or the state has no reference (reference-free losses).
    Preference batches get ``(side, ref_logps)``, unpaired ones ``ref_logps``; ``packed``: padding-free."""
    paired = K.CHOSEN in batch.keys()
    present = (K.CHOSEN, K.REF_LOGPS) if paired else K.REF_LOGPS
    if "ref" not in state.models or present in batch.keys(include_nested=True):
        return batch
    scorer, ref = concatenated_forward if paired else score_sequences, state.model("ref")
    here, there = batch.device, model_device(ref)
    if here is None or there == here:
        return scorer(ref, batch, chunked=chunked, packed=packed, reference=True)
    return scorer(ref, batch.to(there), chunked=chunked, packed=packed, reference=True).to(here)  # a reference on ref_device


def _scored_mask(side: TensorDictBase) -> torch.Tensor:
    """The tokens ``score_sequences`` scores: ``loss_mask ∧ attention_mask ∧ position > 0``."""
    mask = side[K.ATTENTION_MASK]
    return side[K.LOSS_MASK] & mask & (position_ids_from_mask(mask) > 0)


def pair_stat_metrics(scored: TensorDictBase) -> dict[str, torch.Tensor]:
    """TRL DPO's token diagnostics of a scored pair batch (``concatenated_forward(..., with_stats=True)``),
    each a mean over scored completion tokens ``n`` (0 when there are none), detached:

    - ``entropy``: ``Σ H_t / n`` over the tokens of both sides;
    - ``logits/chosen``, ``logits/rejected``: ``Σ_t mean_v z_{t,v} / n_side`` (the logits over ``τ``
      averaged over the vocabulary, then over the side's tokens);
    - ``mean_token_accuracy``: ``Σ_t 1[argmax_v z_{t,v} = x_t] / n_chosen``, chosen side only.
    """
    def total(side, key):
        mask = _scored_mask(scored[side])
        x = scored[side, key].detach()
        zero = torch.zeros((), dtype=torch.float64, device=x.device)
        return torch.where(mask, x.to(torch.float64), zero).sum(), mask.sum().to(torch.float64)

    dtype = scored[K.CHOSEN, K.ENTROPY].dtype
    (hc, nc), (hr, nr) = total(K.CHOSEN, K.ENTROPY), total(K.REJECTED, K.ENTROPY)
    (lc, _), (lr, _) = total(K.CHOSEN, MEAN_LOGIT), total(K.REJECTED, MEAN_LOGIT)
    top1, _ = total(K.CHOSEN, TOP1)
    out = {"entropy": (hc + hr) / (nc + nr).clamp(min=1), "logits/chosen": lc / nc.clamp(min=1),
           "logits/rejected": lr / nr.clamp(min=1), "mean_token_accuracy": top1 / nc.clamp(min=1)}
    return {k: v.to(dtype) for k, v in out.items()}


def preference_loss_fn(state: TrainState, batch: TensorDictBase, *, loss: Callable, chunked: bool = True,
                       packed: bool = False, with_stats: bool = False) -> tuple[torch.Tensor, TensorDict]:
    """``loss`` of the policy's log-probs on a (micro-)batch: the ``loss_fn`` of ``update``.

    Pairs go through ``concatenated_forward`` (chosen and rejected rows in one forward), unpaired
    rows through ``score_sequences``. With ``with_stats`` (pairs only), the metrics also hold
    ``pair_stat_metrics`` (``entropy``, ``logits/chosen``, ``logits/rejected``,
    ``mean_token_accuracy``), from the same pass over the vocabulary as the log-probs. ``packed``:
    padding-free forwards (``loops.score.packed_logprobs``).
    Gradient: to the policy's parameters.
    """
    if K.CHOSEN not in batch.keys():
        return loss(score_sequences(state.model("policy"), batch, chunked=chunked, packed=packed))
    scored = concatenated_forward(state.model("policy"), batch, chunked=chunked, packed=packed, with_stats=with_stats)
    if not with_stats:
        return loss(scored)
    value, metrics = loss(scored.exclude(*((s, k) for s in (K.CHOSEN, K.REJECTED) for k in STAT_KEYS)))
    return value, metrics.update(pair_stat_metrics(scored))


def _packed(config: Config | None) -> bool:
    return bool(config is not None and config.padding_free)


def _update(state, batch, *, loss, chunked, micro_batch_size, max_grad_norm, config):
    rows = batch.batch_size[0]
    loss_fn = functools.partial(preference_loss_fn, loss=loss, chunked=chunked, packed=_packed(config),
                                with_stats=True)
    state, metrics = update(state, batch, loss_fn, micro_batch_size=min(micro_batch_size or rows, rows),
                            **token_budget(config),
                            autocast_dtype=autocast_dtype(config) if config is not None else None,
                            transform=chain(skip_nonfinite(),
                                            None if max_grad_norm is None else clip_by_global_norm(max_grad_norm)))
    return advance(state, samples_seen=rows, tokens_seen=batch_tokens(batch)), metrics


def dpo_step(state: TrainState, batch: TensorDictBase, *, loss: Callable, chunked: bool = True,
             micro_batch_size: int | None = None, max_grad_norm: float | None = 1.0,
             config: Config | None = None) -> tuple[TrainState, TensorDict]:
    """One step on a preference batch (impure: it trains): reference log-probs, then one
    optimiser step of ``loss`` (pairs are micro-batched as rows, the loss being a mean over pairs),
    then the reference's TR-DPO update when ``config`` asks for it (``sync_reference``)."""
    batch = batch.to(next(state.model("policy").parameters()).device)
    batch = with_reference(state, batch, chunked=chunked, packed=_packed(config))
    state, metrics = _update(state, batch, loss=loss, chunked=chunked, micro_batch_size=micro_batch_size,
                             max_grad_norm=max_grad_norm, config=config)
    return sync_reference(state, config), metrics


def kto_step(state: TrainState, item: tuple[TensorDictBase, TensorDictBase], *, loss: Callable, chunked: bool = True,
             micro_batch_size: int | None = None, max_grad_norm: float | None = 1.0,
             config: Config | None = None) -> tuple[TrainState, TensorDict]:
    """One KTO step on ``(unpaired batch, mismatched batch)`` (impure: it trains).

    The mismatched pairs are scored once for the whole batch, by the policy (``kl_logps``) and the
    reference (``ref_kl_logps``), without gradient (KTO detaches its reference point ``z``), so
    ``z`` is the batch's estimate whatever the micro-batching.
    """
    device = next(state.model("policy").parameters()).device
    batch, mismatched = (x.to(device) for x in item)
    with torch.no_grad():
        packed = _packed(config)
        kl = score_sequences(state.model("policy"), mismatched, chunked=chunked, packed=packed).get(K.LOGPS)
        ref_kl = score_sequences(state.model("ref"), mismatched, chunked=chunked, packed=packed,
                                 reference=True).get(K.REF_LOGPS)
    batch = with_reference(state, batch, chunked=chunked, packed=packed).copy().update({K.KL_LOGPS: kl, K.REF_KL_LOGPS: ref_kl})
    state, metrics = _update(state, batch, loss=loss, chunked=chunked, micro_batch_size=micro_batch_size,
                             max_grad_norm=max_grad_norm, config=config)
    return sync_reference(state, config), metrics


# --- data ----------------------------------------------------------------------------------------
def unpair(data: Dataset) -> Dataset:
    """Tokenised pairs → unpaired rows: each pair gives a desirable row (the chosen completion,
    ``label=True``) and an undesirable one (the rejected, ``label=False``), pairs' rows first then
    the rejected ones (``batch_source`` shuffles)."""
    cols = data.select_columns(["prompt_ids", "chosen_ids", "rejected_ids"])[:]
    n = len(data)
    return Dataset.from_dict({"prompt_ids": cols["prompt_ids"] * 2,
                              "completion_ids": cols["chosen_ids"] + cols["rejected_ids"],
                              "label": [True] * n + [False] * n})


def _collate_kto(rows: dict, *, pad_id: int) -> tuple[TensorDict, TensorDict]:
    return collate_unpaired(rows, pad_id=pad_id), collate_mismatched(rows, pad_id=pad_id)


def _with_ref_columns(data: Dataset, model, tokenizer, config: Config) -> Dataset:
    """The dataset with ``ref_chosen_logps`` / ``ref_rejected_logps`` columns scored by ``model``
    (an empty held-out split, ``num_eval`` 0, as it is: nothing to score)."""
    if len(data) == 0:
        return data
    device = next(model.parameters()).device
    batches = (b.to(device) for b in iterate_batches(data, tokenizer, config.eval_batch_size, format="preference"))
    ref = precompute_reference_logps(model, batches, chunked=config.chunked, packed=config.padding_free).cpu()
    data = data.add_column("ref_chosen_logps", ref.get((K.CHOSEN, K.REF_LOGPS)).tolist())
    return data.add_column("ref_rejected_logps", ref.get((K.REJECTED, K.REF_LOGPS)).tolist())


def _prepare(data: Dataset, tokenizer, config: Config) -> Dataset:
    if config.truncation_mode not in ("keep_end", "keep_start"):
        raise ValueError(f"truncation_mode: expected 'keep_end' or 'keep_start', got {config.truncation_mode!r}")
    # TRL's rule: the prompt is cut only when prompt + the longer answer exceed max_length, then the answers
    return tokenize_dataset(data, tokenizer, format=preference_format(data.column_names), max_length=config.max_length,
                            max_prompt_length=config.max_prompt_length, prompt_truncation=config.truncation_mode,
                            prompt_cut="if_too_long")


# --- evaluation ----------------------------------------------------------------------------------
@torch.no_grad()
def _evaluate(state: TrainState, data: Dataset, tokenizer, config: Config, loss: Callable) -> dict[str, float]:
    """Row-weighted means of the eval loss's metrics over the held-out pairs."""
    paired = config.loss_type not in UNPAIRED
    # KTO trains on unpaired rows; on pairs its implicit rewards β·ρ are DPO's, scored as DPO does
    eval_loss = loss if paired else functools.partial(dpo, beta=config.beta if config.beta is not None else 0.1)
    device = next(state.model("policy").parameters()).device

    def results():
        for batch in iterate_batches(data, tokenizer, config.eval_batch_size, format="preference"):
            batch = with_reference(state, batch.to(device), chunked=config.chunked, packed=config.padding_free)
            _, metrics = preference_loss_fn(state, batch, loss=eval_loss, chunked=config.chunked,
                                            packed=config.padding_free, with_stats=True)
            yield batch.batch_size[0], {k: v for k, v in metrics.items() if paired or not k.startswith("loss")}

    return mean_metrics(results())


def _setup(config: Config):
    """(state, train data, held-out data, tokenizer, loss) for ``train`` and ``evaluate``."""
    loss = bind_loss(config)
    check_reference_sync(config)
    if config.precompute_ref and config.loss_type in UNPAIRED:
        raise ValueError("precompute_ref: KTO's reference point scores pairs mismatched within each batch, which "
                         "cannot be computed ahead; use the frozen reference (precompute_ref=False)")
    tokenizer = policy_tokenizer(config)  # the data is read and checked before any model is built
    train_data, held_out = (_prepare(d, tokenizer, config) for d in load_splits(config, preference_dataset))
    model, tokenizer = build_policy(config)
    check_rows_fit(model, PAIR_SIDES, "max_length", train=train_data, held_out=held_out)
    models = {"policy": model}
    if needs_reference(config) and config.precompute_ref:  # the untrained policy (or ref_model) is the reference
        ref = build_reference(config, model) if config.ref_model else model
        train_data, held_out = (_with_ref_columns(d, ref, tokenizer, config) for d in (train_data, held_out))
    elif needs_reference(config):
        models["ref"] = build_reference(config, model)
    return init_train_state(models, config), train_data, held_out, tokenizer, loss


def evaluate(state: TrainState, config: Config) -> dict[str, float]:
    """Held-out metrics of ``state``'s policy: ``rewards/accuracies``, ``rewards/margins``, the
    loss (paired losses), ``rewards/chosen`` / ``rewards/rejected``, ``logps/*``.

    With ``precompute_ref`` the reference log-probs are recomputed from a fresh policy built from
    the config (the reference of the run)."""
    require_held_out(config)
    tokenizer, loss = policy_tokenizer(config), bind_loss(config)
    _, held_out = load_splits(config, preference_dataset)
    held_out = _prepare(held_out, tokenizer, config)
    if needs_reference(config) and "ref" not in state.models:
        fresh = build_policy(config)[0]
        held_out = _with_ref_columns(held_out, build_reference(config, fresh) if config.ref_model else fresh,
                                     tokenizer, config)
    return _evaluate(state, held_out, tokenizer, config, loss)


# --- the recipe ----------------------------------------------------------------------------------
def train(config: Config, *, callbacks: Sequence[Callable] = ()) -> tuple[TrainState, list[dict[str, float]]]:
    """Run (or, with ``resume``, continue) preference optimisation: ``(state, history)``."""
    state, train_data, held_out, tokenizer, loss = _setup(config)
    pad = pad_token_id(tokenizer)
    if config.loss_type in UNPAIRED:
        step_fn, train_data, collate_fn = kto_step, unpair(train_data), functools.partial(_collate_kto, pad_id=pad)
    else:
        step_fn, collate_fn = dpo_step, functools.partial(collate_preference, pad_id=pad)
    source = batch_source(train_data, config.batch_size, collate_fn, seed=config.seed)
    step = functools.partial(step_fn, loss=loss, chunked=config.chunked, micro_batch_size=config.micro_batch_size,
                             max_grad_norm=config.max_grad_norm, config=config)
    eval_fn = functools.partial(_evaluate, data=held_out, tokenizer=tokenizer, config=config, loss=loss)
    return run(step, state, source, config=config, num_steps=config.steps, eval_fn=eval_fn, name="dpo",
               callbacks=callbacks, tokenizer=tokenizer, save_models=reference_models(config))
