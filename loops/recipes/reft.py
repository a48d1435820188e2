"""ReFT recipes: representation fine-tuning trained by the same fold, update and loss closures.

The policy is a frozen base model plus ``ReftInterventions`` and the optimiser sees only the
interventions' parameters. Every recipe's ``update`` loss closure becomes its ReFT version with
``with_interventions`` (the policy forwards run inside ``intervened(state, batch)``, at the
batch's ``INTERVENTION_LOCATIONS``); whatever runs outside is the base model itself, which is
therefore the reference policy for free (``"ref"`` is the same object: no copy).

- SFT (``reft_sft_step``): ``loops.recipes.sft.sft_loss_fn`` with the interventions on;
  state ``{"policy": base, "ref": base, "interventions": iv}`` (``init_reft_state``), so a
  checkpoint stores the interventions only.
- DPO (``reft_dpo_step``): reference log-probs from the base model (interventions off), then
  ``loops.recipes.dpo.preference_loss_fn`` with them on; the same state.
- GRPO / RLOO (``reft_grpo_step`` / ``reft_rloo_step`` with ``train_reft_online``): the policy is a
  ``ReftModel`` (``{"policy": ReftModel(base), "ref": base}``), so the online recipes' collection
  and evaluation generate with the interventions at the prompt positions (with a KV cache only the
  prompt is edited, ``rlcore.loops.reft_model``); each step is the recipe's own
  ``grpo.collect_groups`` then ``learn`` (``grpo.learn`` / ``rloo.learn``), with the rollout's
  locations added and the recipe's loss closure run inside ``intervened`` (``wrap_loss``).

``train_reft_sft(config)`` runs the SFT recipe from a ``ReftConfig`` (``configs/reft_sft.yaml`` via
``load_config``) with the scaffolding of ``rlcore.loops.recipe``.

References:
    Wu et al., "ReFT: Representation Finetuning for Language Models", https://arxiv.org/abs/2404.03592.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn

from rlcore import keys as K
from rlcore.algorithms.reft import trainable_parameters
from rlcore.loops.recipes.dpo import preference_loss_fn, with_reference
from rlcore.loops.tokenization import check_rows_fit, tokenize_dataset
from rlcore.loops.recipes import grpo, rloo
from rlcore.loops.models import pad_token_id
from rlcore.loops.online import build_online_state, train_online
from rlcore.loops.checkpoint import load_checkpoint
from rlcore.loops.recipe import (batch_source, build_policy, init_train_state, load_splits, policy_tokenizer,
                                 require_held_out, run)
from rlcore.loops.config import RunConfig
from rlcore.loops.config import autocast_dtype as recipe_autocast
from rlcore.loops.config import load_config as load_recipe_config
from rlcore.loops.reft_data import ReftSpec, collate_reft, with_intervention_locations
from rlcore.loops.reft_model import (ReftInterventions, ReftModel, intervention_dtype, make_interventions,
                                     with_interventions)
from rlcore.loops.recipes.sft import scoring_mask, sft_loss_fn
from rlcore.loops.settings import AT_LEAST_1, BELOW_1, AggregationSettings, Section, TruncationSettings, setting
from rlcore.loops.state import TrainState, advance, init_state
from rlcore.loops.tasks import task_dataset
from rlcore.loops.update import chain, clip_by_global_norm, make_optimizer, skip_nonfinite, update

__all__ = [
    "init_reft_state", "trainable_fraction", "reft_sft_step", "reft_dpo_step", "reft_grpo_step", "reft_rloo_step",
    "reft_online_models", "train_reft_online", "ReftConfig", "reft_spec", "load_config", "reft_eval_loss",
    "evaluate", "train_reft_sft", "checkpoint_state", "Config", "train",
    "ReftFields", "new_interventions",
]


def new_interventions(model: nn.Module, spec: ReftSpec, zero_init: bool, seed: int) -> ReftInterventions:
    """``make_interventions`` for ``model`` (its hidden size, dtype and device), seeded with ``seed``."""
    return make_interventions(spec, model.config.hidden_size, zero_init=zero_init,
                              generator=torch.Generator().manual_seed(seed), dtype=intervention_dtype(model),
                              device=next(model.parameters()).device)


def init_reft_state(model: nn.Module, spec: ReftSpec, *, lr: float, weight_decay: float = 0.0,
                    zero_init: bool = False, seed: int = 0) -> TrainState:
    """A ``TrainState`` ``{"policy": model, "ref": model, "interventions": iv}``, AdamW over ``iv`` only.

    ``model`` is frozen (``requires_grad_(False)``); the interventions are initialised from
    ``torch.Generator().manual_seed(seed)`` in ``intervention_dtype(model)``.
    """
    model.requires_grad_(False)
    interventions = new_interventions(model, spec, zero_init, seed)
    optimizer = make_optimizer(trainable_parameters(interventions.values()), lr=lr, weight_decay=weight_decay)
    return init_state({"policy": model, "ref": model, "interventions": interventions}, optimizer=optimizer, seed=seed)


def trainable_fraction(state: TrainState) -> tuple[int, int]:
    """``(trainable, total)`` parameter counts: the interventions' against base + interventions."""
    policy = state.model("policy")
    base, iv = (policy.model, policy.interventions) if isinstance(policy, ReftModel) else \
        (policy, state.model("interventions"))
    trainable = sum(p.numel() for p in trainable_parameters(iv.values()))
    return trainable, trainable + sum(p.numel() for p in base.parameters())


# --- steps -------------------------------------------------------------------------------------
def _device(state: TrainState) -> torch.device:
    return next(state.model("policy").parameters()).device


def reft_sft_step(state: TrainState, batch: TensorDictBase, *, agg: str = "token_mean", chunked: bool = True,
                  micro_batch_size: int | None = None, max_grad_norm: float | None = 1.0,
                  autocast_dtype: torch.dtype | None = None) -> tuple[TrainState, TensorDict]:
    """One ReFT SFT step (impure: it trains the interventions).

    ``loss = aggregate(−log p_Φ(x_t | x_<t), loss_mask, agg)``: ``loops.recipes.sft.sft_loss_fn`` on the
    ``scoring_mask`` of the batch, its forwards inside ``intervened``. Reads ``input_ids``,
    ``attention_mask``, ``loss_mask`` ``[B, T]`` and ``INTERVENTION_LOCATIONS [B, n]``.
    """
    batch = scoring_mask(batch.to(_device(state)))
    loss_fn = with_interventions(functools.partial(sft_loss_fn, agg=agg, chunked=chunked))
    state, metrics = update(state, batch, loss_fn, micro_batch_size=micro_batch_size, mask_key=K.LOSS_MASK,
                            autocast_dtype=autocast_dtype,
                            transform=chain(skip_nonfinite(),
                                            None if max_grad_norm is None else clip_by_global_norm(max_grad_norm)))
    return (advance(state, samples_seen=batch.batch_size[0], tokens_seen=batch.get(K.ATTENTION_MASK).sum()),
            metrics.rename_key_("num_tokens", "scored_tokens"))  # as sft_step: num_tokens is the cumulative count


def reft_dpo_step(state: TrainState, batch: TensorDictBase, *, loss: Callable, chunked: bool = True,
                  micro_batch_size: int | None = None, max_grad_norm: float | None = 1.0,
                  autocast_dtype: torch.dtype | None = None) -> tuple[TrainState, TensorDict]:
    """One ReFT preference step: reference log-probs from ``state.model("ref")`` (the base model,
    interventions off; skipped when the batch carries them), then ``update`` with
    ``preference_loss_fn`` inside ``intervened``. ``loss``: a bound pairwise loss, e.g.
    ``functools.partial(rlcore.algorithms.dpo.dpo, beta=0.1)`` or ``loops.recipes.dpo.bind_loss(config)``.
    Reads a preference batch with ``INTERVENTION_LOCATIONS`` on each side.
    """
    batch = with_reference(state, batch.to(_device(state)), chunked=chunked)
    loss_fn = with_interventions(functools.partial(preference_loss_fn, loss=loss, chunked=chunked))
    state, metrics = update(state, batch, loss_fn, micro_batch_size=micro_batch_size, autocast_dtype=autocast_dtype,
                            transform=chain(skip_nonfinite(),
                                            None if max_grad_norm is None else clip_by_global_norm(max_grad_norm)))
    return advance(state, samples_seen=batch.batch_size[0]), metrics


def _reft_online_step(recipe: ModuleType, state: TrainState, rows: dict, *, config: Any, tokenizer,
                      reward_fn, refill: Callable | None = None, reference: bool = True) -> tuple[TrainState, TensorDict]:
    """``recipe.step`` for a ``ReftModel`` policy: the rollout (with ``dynamic_sampling``, refilled as
    ``recipe.step`` does; with the reference's log-probs when ``reference``) gains its intervention
    locations and ``recipe.learn``'s loss runs inside ``intervened``."""
    state, rollout, counts = grpo.collect_groups(state, rows, config=config, tokenizer=tokenizer, reward_fn=reward_fn,
                                                 refill=refill, reference=reference)
    rollout = with_intervention_locations(rollout, state.model("policy").spec)
    state, metrics = recipe.learn(state, rollout, config, wrap_loss=with_interventions)
    return state, metrics.update(counts)


def reft_grpo_step(state: TrainState, rows: dict, *, config: Any, tokenizer, reward_fn,
                   refill: Callable | None = None) -> tuple[TrainState, TensorDict]:
    """``loops.recipes.grpo.step`` for a ``ReftModel`` policy: collect (intervened generation, base reference),
    then ``grpo.learn`` (group advantages, the update of the interventions inside ``intervened``)."""
    return _reft_online_step(grpo, state, rows, config=config, tokenizer=tokenizer, reward_fn=reward_fn, refill=refill,
                             reference=grpo.rollout_ref_logprobs(config))


def reft_rloo_step(state: TrainState, rows: dict, *, config: Any, tokenizer, reward_fn,
                   refill: Callable | None = None) -> tuple[TrainState, TensorDict]:
    """``loops.recipes.rloo.step`` for a ``ReftModel`` policy: ``rloo.learn`` (KL-penalised rewards against
    the base model, leave-one-out advantages, the update inside ``intervened``)."""
    return _reft_online_step(rloo, state, rows, config=config, tokenizer=tokenizer, reward_fn=reward_fn, refill=refill)


def reft_online_models(spec: ReftSpec, *, zero_init: bool = False, seed: int = 0) -> Callable[[nn.Module], dict]:
    """``extra_models`` of ``loops.online.build_online_state``: ``{"policy": ReftModel(base), "ref": base}``."""
    def models(policy: nn.Module) -> dict[str, nn.Module]:
        return {"policy": ReftModel(policy, interventions=new_interventions(policy, spec, zero_init, seed)),
                "ref": policy}
    return models


def train_reft_online(config: Any, step: Callable, spec: ReftSpec, *, zero_init: bool = False, reward_fn=None,
                      callbacks: Sequence[Callable] = ()) -> tuple[TrainState, list[dict[str, float]]]:
    """GRPO / RLOO with ReFT: ``train_online(config, step)`` (``step``: ``reft_grpo_step`` or
    ``reft_rloo_step``, ``config``: ``loops.recipes.grpo.Config`` / ``loops.recipes.rloo.Config``) with the
    policy wrapped in a ``ReftModel`` and the base model as the reference.

    ``build_online_state`` still makes (and drops) a copy of the policy for its default reference.
    """
    build = functools.partial(build_online_state,
                              extra_models=reft_online_models(spec, zero_init=zero_init, seed=config.seed))
    return train_online(config, build, step, reward_fn=reward_fn, name=f"reft_{step.__name__.split('_')[1]}",
                        callbacks=callbacks)


# --- configs -----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ReftFields(Section):
    """The intervention section of every ReFT recipe's config: the ``ReftSpec`` fields (``layers`` …
    ``blocks``, read by ``reft_spec``) and ``zero_init`` (the interventions start as the identity, so
    the policy starts as its base model; the paper draws ``W, b`` at random)."""

    layers: tuple[int, ...] = setting((0, 1), help="decoder blocks intervened on")
    component: str = setting("block_output", help="block_output | block_input (REFT_COMPONENTS)")
    positions: str = setting("f3+l3", help="prompt positions: f3+l3 = the first 3 and last 3 tokens")
    rank: int = setting(4, help="r, the rank of the subspace", range=AT_LEAST_1)
    share_weights: bool = setting(False, help="one intervention for all positions of a layer")
    dropout: float = setting(0.0, help="dropout on the edited state", range=BELOW_1)
    variant: str = setting("loreft", help="loreft | noreft | direft | nodireft | consreft | lobireft "
                                          "(REFT_INTERVENTIONS)")
    act: str = setting("identity", help="activation of W h + b (REFT_ACTIVATIONS)")
    blocks: str | None = setting(None, help="dotted path of the block list; None: found automatically")
    zero_init: bool = setting(True, help="interventions start as the identity (the policy as its base; the paper "
                                         "draws W, b at random)")


@dataclasses.dataclass(frozen=True)
class ReftConfig(ReftFields, AggregationSettings, TruncationSettings, RunConfig,
                 defaults={"layers": (1, 2), "zero_init": False, "num_layers": 4, "task": "sort", "num_eval": 32,
                           "lr": 4e-3, "batch_size": 8, "steps": 60, "keep_last": None}):
    """Every setting of ``train_reft_sft`` (the keys of ``configs/reft_sft.yaml``): ``RunConfig``'s
    sections (some with other defaults), the intervention section ``ReftFields`` and the loss's."""


def reft_spec(config: Any) -> ReftSpec:
    """The ``ReftSpec`` made of a config's spec fields. Refuses ``gradient_checkpointing``: the
    checkpointed blocks of a frozen model would pass no gradient to the interventions' hooks."""
    if getattr(config, "gradient_checkpointing", False):
        raise ValueError("gradient_checkpointing: ReFT trains interventions on a frozen model, whose checkpointed "
                         "blocks would recompute without them in the backward pass; leave it off")
    return ReftSpec(**{f.name: getattr(config, f.name) for f in dataclasses.fields(ReftSpec)})


def load_config(path: str | Path | None = None, **overrides: Any) -> ReftConfig:
    """``rlcore.loops.config.load_config(ReftConfig, path, overrides)``: YAML, then overrides."""
    return load_recipe_config(ReftConfig, path, overrides)


def reft_eval_loss(state: TrainState, batches: Sequence[TensorDictBase]) -> dict[str, float]:
    """Token-mean NLL of the completions of ``batches`` with the interventions on (no gradient)."""
    scored = [scoring_mask(b.to(_device(state))) for b in batches]
    total = sum(b.get(K.LOSS_MASK).sum() for b in scored)
    loss_fn = with_interventions(sft_loss_fn)
    with torch.no_grad():
        loss = sum(loss_fn(state, b, num_tokens=total)[0] for b in scored)
    return {"loss": float(loss)}


def _collate_fn(tokenizer, spec: ReftSpec) -> Callable[[dict], TensorDict]:
    return functools.partial(collate_reft, "prompt_completion", pad_id=pad_token_id(tokenizer), spec=spec)


def _eval_batches(held_out, tokenizer, config: ReftConfig) -> list[TensorDict]:
    collate_fn = _collate_fn(tokenizer, reft_spec(config))
    return [collate_fn(held_out[i:i + config.batch_size]) for i in range(0, len(held_out), config.batch_size)]


def evaluate(state: TrainState, config: ReftConfig) -> dict[str, float]:
    """Held-out ``loss`` of ``state``'s ReFT policy (``reft_eval_loss`` on the config's held-out split)."""
    require_held_out(config)
    _, held_out = load_splits(config, task_dataset)
    tokenizer = policy_tokenizer(config)
    held_out = tokenize_dataset(held_out, tokenizer, max_length=config.max_length)
    return reft_eval_loss(state, _eval_batches(held_out, tokenizer, config))


def train_reft_sft(config: ReftConfig, *, model: nn.Module | None = None, tokenizer=None,
                   callbacks: Sequence[Callable] = ()) -> tuple[TrainState, list[dict[str, float]]]:
    """ReFT SFT from a config: ``run(reft_sft_step, state, batches)`` with the recipe callbacks.

    The policy (``build_policy``, or ``model`` with ``tokenizer``) is frozen; the optimiser (and
    a checkpoint) holds the interventions only. Evaluation every ``eval_every`` steps is
    ``reft_eval_loss`` on the held-out split. Returns ``(state, history)``.
    """
    splits = load_splits(config, task_dataset)  # read and checked before any model is built
    if model is None or tokenizer is None:
        model, tokenizer = build_policy(config)
    model.requires_grad_(False)
    spec = reft_spec(config)
    interventions = new_interventions(model, spec, config.zero_init, config.seed)
    state = init_train_state({"policy": model, "ref": model, "interventions": interventions}, config,
                             trainable=("interventions",))
    train, held_out = (tokenize_dataset(d, tokenizer, max_length=config.max_length) for d in splits)
    check_rows_fit(model, [("prompt_ids", "completion_ids")], "max_length", train=train, held_out=held_out)
    eval_batches = _eval_batches(held_out, tokenizer, config)
    step = functools.partial(reft_sft_step, agg=config.agg, micro_batch_size=config.micro_batch_size,
                             max_grad_norm=config.max_grad_norm, autocast_dtype=recipe_autocast(config))
    source = batch_source(train, config.batch_size, _collate_fn(tokenizer, spec), seed=config.seed)
    return run(step, state, source, config=config, num_steps=config.steps, name="reft_sft",
               eval_fn=lambda s: reft_eval_loss(s, eval_batches), callbacks=callbacks, tokenizer=tokenizer)


def checkpoint_state(config: ReftConfig, path: str | Path) -> TrainState:
    """The ReFT ``TrainState`` of checkpoint ``path``: the base policy with the saved interventions."""
    model, _ = build_policy(config)
    model.requires_grad_(False)
    interventions = new_interventions(model, reft_spec(config), config.zero_init, config.seed)
    state = init_train_state({"policy": model, "ref": model, "interventions": interventions}, config,
                             trainable=("interventions",))
    return load_checkpoint(path, state, restore_global_rng=False)


# This module is the SFT recipe ("reft" in ``loops.recipes.RECIPES``), with a recipe module's names;
# loops.recipes.reft_recipes holds GRPO, RLOO, DPO and reward modelling.
Config = ReftConfig
train = train_reft_sft
