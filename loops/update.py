"""The one impure step: backward, gradient clipping, the optimiser and the scheduler.

**This module mutates.** ``update`` writes the gradients and the parameters of the models in
``state`` and the internals of ``state.optimizer`` / ``state.scheduler``, in place, because an
optimiser step on a large model cannot copy its weights. Nothing else in rlcore does; every other
change travels in the returned ``TrainState``.

The loss-function contract
--------------------------
``loss_fn(state, micro_batch, **denominators) -> (loss, metrics)``

- ``state``: the current ``TrainState``, so the closure reaches the models
  (``state.model("policy")``) and the transform states (``state.transforms["kl"].coef``) and can
  compute log-probs, values or rewards through them (``rlcore.loops.score``) inside the
  gradient tape;
- ``micro_batch``: a TensorDict ``[b]``, a slice of the shuffled minibatch;
- ``denominators``: with ``mask_key`` set, ``num_tokens=`` and ``num_seqs=`` (0-d tensors, the
  valid tokens and non-empty rows of the whole *minibatch*, i.e. of the optimiser step), to pass
  on to the loss's aggregation (``rlcore.masked.aggregate``); with ``mask_key=None``, nothing;
- returns the scalar loss and a TensorDict (or mapping) of detached scalars.

Gradient accumulation equals the full-minibatch gradient either way:

- ``mask_key`` set: each micro-batch's loss is already a share of the step's loss (global
  denominators), and the shares are summed;
- ``mask_key=None``: the loss is taken to be a mean over the rows of its micro-batch (DPO, reward
  modelling) and is weighted by ``b / minibatch_rows``.

Data parallelism needs no change here or in the loss: under a ``torch.distributed`` process
group ``update`` all-reduces the denominators, the gradients, the guards and the metrics (see
``update`` and ``rlcore.loops.dist``).

A recipe's loss closure, for instance::

    def loss_fn(state, mb, **denominators):
        mb = with_policy_logprobs(state.model("policy"), mb)        # through the model, differentiable
        return ppo_loss(mb, clip_eps=0.2, **denominators)

    state, metrics = update(state, rollout, loss_fn, minibatch_size=64, micro_batch_size=16,
                            epochs=4, mask_key=keys.RESPONSE_MASK,
                            transform=chain(skip_nonfinite(), stop_on("early_stop"), clip_by_global_norm(1.0)))

Gradient transforms
-------------------
What happens between the backward passes and ``optimizer.step()`` is a chain of transforms, in
the manner of optax: each is a plain callable ``GradStep -> outcome | None`` that may act on the
gradients in place (``clip_by_global_norm``), veto the step with an outcome (``"skipped"``: the
gradients are dropped and the epochs go on; ``"stopped"``: dropped, and the epochs end) or raise
(``raise_nonfinite``). ``chain(*transforms)`` applies them in order and the first veto wins.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, cast

import torch
import torch.distributed as dist
from tensordict import TensorDict, TensorDictBase
from torch import nn

from rlcore.checks import NonFiniteError, check_mask
from rlcore.loops.dist.sync import (GradSync, OverlappedReduction, accumulation_context, grad_sync, is_dtensor,
                                    reduce_gradients,
                                    total_grad_norm)
from rlcore.loops.dist import all_reduce_sum
from rlcore.loops.state import TrainState, copy_generator

__all__ = ["update", "global_denominators", "token_micro_batches", "make_optimizer", "make_scheduler", "SCHEDULES", "linear_schedule",
           "cosine_schedule", "constant_schedule", "enable_gradient_checkpointing", "NONFINITE_MODES", "GradStep",
           "Transform", "OUTCOMES", "DEFAULT_TRANSFORM", "chain", "skip_nonfinite", "raise_nonfinite", "nonfinite",
           "stop_on", "clip_by_global_norm"]

NONFINITE_MODES = ("skip", "raise")
EARLY_STOP_CHECKS = ("minibatch", "epoch")
OUTCOMES = ("skipped", "stopped")
LossFn = Callable[..., tuple[torch.Tensor, Any]]


# --- optimiser and learning-rate schedules -----------------------------------------------------
def _param_groups(params: Any, weight_decay: float) -> list[dict]:
    if isinstance(params, (nn.Module, Mapping)):
        modules = [params] if isinstance(params, nn.Module) else list(params.values())
        seen, decay, no_decay = set(), [], []
        for module in modules:
            for p in module.parameters():
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    (decay if p.ndim >= 2 else no_decay).append(p)
        groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        return [g for g in groups if g["params"]]
    params = list(params)
    if params and isinstance(params[0], dict):
        return params
    return [{"params": [p for p in params if p.requires_grad], "weight_decay": weight_decay}]


def make_optimizer(params: nn.Module | Mapping[str, nn.Module] | Iterable, *, lr: float,
                   weight_decay: float = 0.0, betas: tuple[float, float] = (0.9, 0.999),
                   eps: float = 1e-8) -> torch.optim.AdamW:
    """AdamW over the trainable parameters (``requires_grad``) of ``params``.

    ``θ ← θ − lr·(m̂/(√v̂ + eps) + weight_decay·θ)`` (decoupled weight decay).

    Args:
        params: a module or a mapping of modules (parameters shared between them counted once;
            weight decay on matrices only, not on biases and norm scales, as in GPT-2 training),
            an iterable of parameters (one group), or a list of param-group dicts (as given).
        lr: learning rate (the peak, when a scheduler warms up).
        weight_decay, betas, eps: AdamW's (PyTorch defaults, weight decay 0 as in TRL).
    Returns:
        ``torch.optim.AdamW``.

    References: Loshchilov & Hutter, "Decoupled Weight Decay Regularization",
    https://arxiv.org/abs/1711.05101
    """
    groups = _param_groups(params, weight_decay)
    if not any(g["params"] for g in groups):
        raise ValueError("params: no trainable parameter (requires_grad=True) to optimise")
    return torch.optim.AdamW(groups, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps)


def _warmup(step: int, warmup_steps: int) -> float:
    return step / max(1, warmup_steps)


def linear_schedule(step: int, *, warmup_steps: int, total_steps: int) -> float:
    """LR multiplier: ``step/warmup`` during warm-up, then linear decay to 0 at ``total_steps``."""
    if step < warmup_steps:
        return _warmup(step, warmup_steps)
    return max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))


def cosine_schedule(step: int, *, warmup_steps: int, total_steps: int) -> float:
    """LR multiplier: warm-up, then ``½(1 + cos(π·progress))`` down to 0 at ``total_steps``.

    References: Loshchilov & Hutter, "SGDR: Stochastic Gradient Descent with Warm Restarts",
    https://arxiv.org/abs/1608.03983
    """
    if step < warmup_steps:
        return _warmup(step, warmup_steps)
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0))))


def constant_schedule(step: int, *, warmup_steps: int, total_steps: int) -> float:
    """LR multiplier: warm-up, then 1 (``total_steps`` is ignored)."""
    return _warmup(step, warmup_steps) if step < warmup_steps else 1.0


SCHEDULES: dict[str, Callable[..., float]] = {
    "linear": linear_schedule,
    "cosine": cosine_schedule,
    "constant": constant_schedule,
}


def make_scheduler(optimizer: torch.optim.Optimizer, *, total_steps: int | None = None, warmup_steps: int = 0,
                   kind: str = "linear") -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` scaling every group's peak ``lr`` by ``SCHEDULES[kind](optimizer_step)``.

    Counted in optimiser steps (``update`` steps it after every step taken, not after skipped
    ones). With warm-up the multiplier at step 0 is 0 (the first step does not move the
    weights), as in Hugging Face's schedules. Its state (a few numbers) checkpoints as JSON.

    Examples:
        >>> opt = make_optimizer(nn.Linear(2, 2), lr=1.0)
        >>> sched = make_scheduler(opt, total_steps=10, warmup_steps=2, kind="cosine")
        >>> [round(SCHEDULES["cosine"](s, warmup_steps=2, total_steps=10), 3) for s in (0, 1, 2, 6, 10)]
        [0.0, 0.5, 1.0, 0.5, 0.0]
    """
    try:
        schedule = SCHEDULES[kind]
    except KeyError:
        raise ValueError(f"kind: unknown schedule {kind!r}; valid: {sorted(SCHEDULES)}") from None
    if total_steps is None and kind != "constant":
        raise ValueError(f"total_steps: the {kind!r} schedule needs the number of optimiser steps")
    bound = functools.partial(schedule, warmup_steps=warmup_steps, total_steps=total_steps or 0)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, bound)


def enable_gradient_checkpointing(model: nn.Module) -> bool:
    """Turn on activation checkpointing where the model offers it (Hugging Face models).

    Trades compute for memory: activations are recomputed in the backward pass. Call once while
    setting up. Returns whether the model supported it.
    """
    # transformers 5.x names it activation_checkpointing_enable (the older name warns of its removal)
    enable = getattr(model, "activation_checkpointing_enable", None) or getattr(model, "gradient_checkpointing_enable", None)
    if enable is None:
        return False
    enable()
    return True


# --- gradient transforms --------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class GradStep:
    """One optimiser step's gradients as the transforms see them, before ``optimizer.step()``.

    Attributes:
        params: the parameters clipped, checked and zeroed (``update``'s ``params``), holding the
            step's summed gradients in ``.grad`` (over the ranks, under a process group).
        grad_norm: 0-d tensor, the global L2 norm of those gradients before any transform
            (``rlcore.loops.dist.total_grad_norm``, over every rank's shards).
        loss_finite: the loss of every micro-batch was finite, on every rank.
        grad_finite: ``grad_norm`` is finite.
        stop: the ``stop_on`` metric of the chain was true for some micro-batch on some rank
            (``False`` without a ``stop_on``).
        where: the step's place for messages (``"epoch 0, rows 0:64"``).
    """

    params: list[torch.Tensor]
    grad_norm: torch.Tensor
    loss_finite: bool
    grad_finite: bool
    stop: bool
    where: str


Transform = Callable[[GradStep], str | None]


@dataclasses.dataclass(frozen=True)
class _Chain:
    transforms: tuple[Transform, ...]

    def __call__(self, step: GradStep) -> str | None:
        for transform in self.transforms:
            outcome = transform(step)
            if outcome is not None:
                return outcome
        return None


def chain(*transforms: Transform | None) -> Transform:
    """The transforms applied in order; the first veto (an outcome other than ``None``) wins.

    ``None`` entries are left out, so an optional transform reads
    ``clip_by_global_norm(m) if m is not None else None``.

    Examples:
        >>> step = GradStep(params=[], grad_norm=torch.tensor(0.0), loss_finite=True, grad_finite=True,
        ...                 stop=True, where="epoch 0")
        >>> chain(skip_nonfinite(), stop_on("early_stop"), lambda s: "skipped")(step)
        'stopped'
    """
    for i, transform in enumerate(transforms):
        if transform is not None and not callable(transform):
            raise TypeError(f"transforms[{i}]: expected a callable GradStep -> outcome | None, got {transform!r}")
    chained = _Chain(tuple(t for t in transforms if t is not None))
    clips = [t for t in _flat(chained) if isinstance(t, _ClipByGlobalNorm)]
    if len(clips) > 1:  # each scales by the norm before any transform: two would compound
        raise ValueError(f"transforms: more than one clip_by_global_norm in the chain ({clips}); keep one")
    return chained


def _skip_nonfinite(step: GradStep) -> str | None:
    return None if step.loss_finite and step.grad_finite else "skipped"


def _raise_nonfinite(step: GradStep) -> str | None:
    if step.loss_finite and step.grad_finite:
        return None
    raise NonFiniteError(f"update: non-finite {'gradient' if step.loss_finite else 'loss'} at {step.where} "
                         f"(grad norm {float(step.grad_norm)}); the step was not taken, weights and "
                         f"optimiser state are unchanged")


def skip_nonfinite() -> Transform:
    """A non-finite loss (any micro-batch, any rank) or gradient norm skips the step: gradients are
    dropped, weights, optimiser and scheduler are left exactly as they were, and the step is
    counted in ``state.skipped_steps``."""
    return _skip_nonfinite


def raise_nonfinite() -> Transform:
    """A non-finite loss or gradient norm raises ``NonFiniteError`` (naming the step); the
    gradients are dropped and weights, optimiser and scheduler left as they were."""
    return _raise_nonfinite


def nonfinite(mode: str = "skip") -> Transform:
    """``skip_nonfinite()`` for ``mode="skip"``, ``raise_nonfinite()`` for ``"raise"``."""
    if mode not in NONFINITE_MODES:
        raise ValueError(f"mode: unknown non-finite mode {mode!r}; valid: {list(NONFINITE_MODES)}")
    return skip_nonfinite() if mode == "skip" else raise_nonfinite()


@dataclasses.dataclass(frozen=True)
class _StopOn:
    key: str
    when: str

    def __call__(self, step: GradStep) -> str | None:
        return "stopped" if self.when == "minibatch" and step.stop else None


def stop_on(key: str = "early_stop", *, when: str = "minibatch") -> Transform:
    """End the epochs on a true ``key`` metric from ``loss_fn`` (PPO's target KL).

    ``update`` reads the metric as the flag ``GradStep.stop`` (true if any micro-batch's value is
    true on any rank; the metric itself is not reported) and:

    - ``when="minibatch"``: a flagged step is vetoed (``"stopped"``: its gradients are dropped) and
      the epochs end at once;
    - ``when="epoch"`` (legacy TRL's PPO): no step is vetoed; the flag of each epoch's last
      minibatch is read after its step (taken or skipped), and a true one skips the remaining
      epochs (every step of the epoch is kept).

    A chain holds at most one ``stop_on``.
    """
    if not isinstance(key, str) or not key:
        raise ValueError(f"key: expected a metric name (a non-empty str), got {key!r}")
    if when not in EARLY_STOP_CHECKS:
        raise ValueError(f"when: unknown {when!r}; valid: {list(EARLY_STOP_CHECKS)}")
    return _StopOn(key, when)


def clip_by_global_norm(max_norm: float) -> Transform:
    """``g ← g·min(1, max_norm/(‖g‖₂ + 1e-6))`` in place, with ``‖g‖₂`` = ``GradStep.grad_norm``.

    Never vetoes. Leave it out of the chain not to clip (``None`` is refused). A chain holds at
    most one: each clip scales by the norm from before any transform.
    """
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm > 0:
        raise ValueError(f"max_norm: expected a number > 0 (leave clip_by_global_norm out of the chain not "
                         f"to clip), got {max_norm!r}")
    return _ClipByGlobalNorm(float(max_norm))


@dataclasses.dataclass(frozen=True)
class _ClipByGlobalNorm:
    max_norm: float

    def __call__(self, step: GradStep) -> str | None:
        sharded = [p for p in step.params if is_dtensor(p)]  # FSDP2 shards beside whole parameters (a head):
        for group in (sharded, [p for p in step.params if not is_dtensor(p)]):  # torch's foreach ops take one kind
            if group:
                torch.nn.utils.clip_grads_with_norm_(group, self.max_norm, step.grad_norm)
        return None


def _flat(transform: Transform) -> list[Transform]:
    return [t for inner in transform.transforms for t in _flat(inner)] if isinstance(transform, _Chain) \
        else [transform]


def _stop_rule(transform: Transform) -> _StopOn | None:
    if isinstance(transform, _StopOn):
        return transform
    inner = transform.transforms if isinstance(transform, _Chain) else ()
    rules = [r for t in inner if (r := _stop_rule(t)) is not None]
    if len(rules) > 1:
        raise ValueError(f"transform: more than one stop_on in the chain ({rules}); keep one")
    return rules[0] if rules else None


DEFAULT_TRANSFORM = chain(skip_nonfinite(), clip_by_global_norm(1.0))  # update's default


# --- update ---------------------------------------------------------------------------------
def _counts(batch: TensorDictBase, mask_key: Any) -> torch.Tensor:
    mask = batch.get(mask_key)
    check_mask(f"batch[{mask_key!r}]", mask)
    return torch.stack([mask.sum(), mask.any(dim=-1).sum()])


def global_denominators(batch: TensorDictBase, mask_key: Any) -> dict[str, torch.Tensor]:
    """The denominators of one optimiser step: ``num_tokens = Σ mask``, ``num_seqs`` = non-empty rows.

    Both are 0-d integer tensors clamped to at least 1, the conventions of
    ``rlcore.masked.aggregate``. Under a process group of ``W > 1`` ranks (``rlcore.loops.dist``)
    the counts are summed over the ranks (one all-reduce, no host synchronisation): each rank's
    loss is then its share of the loss of the global batch. ``mask_key=None`` gives ``{}``.

    Args:
        batch: TensorDict ``[B]`` holding ``mask_key`` ``[B, ..., T]`` bool.
    """
    if mask_key is None:
        return {}
    num_tokens, num_seqs = all_reduce_sum(_counts(batch, mask_key)).clamp(min=1).unbind()
    return {"num_tokens": num_tokens, "num_seqs": num_seqs}


def _sizes(batch: TensorDictBase, minibatch_size: int | None, micro_batch_size: int | None,
           epochs: int) -> tuple[int, int, int]:
    if not isinstance(batch, TensorDictBase) or len(batch.batch_size) < 1:
        raise ValueError(f"batch: expected a TensorDict with batch_size [B], got "
                         f"{getattr(batch, 'batch_size', type(batch).__name__)}")
    n = batch.batch_size[0]
    mb = n if minibatch_size is None else minibatch_size
    micro = mb if micro_batch_size is None else micro_batch_size
    if not isinstance(mb, int) or not 1 <= mb <= n:
        raise ValueError(f"minibatch_size: expected an int in [1, {n}] (the batch has {n} rows), got {mb!r}")
    if not isinstance(micro, int) or not 1 <= micro <= mb:
        raise ValueError(f"micro_batch_size: expected an int in [1, {mb}] (minibatch_size), got {micro!r}")
    if not isinstance(epochs, int) or epochs < 1:
        raise ValueError(f"epochs: expected a positive int, got {epochs!r}")
    return n, mb, micro


def _plan(n: int, mb: int, sync: GradSync | None, *, counted: bool = True) -> list[int]:
    """The rows of each minibatch of an epoch summed over the ranks (host ints, agreed up front); a
    rank whose rows are not ``counted`` adds none.

    The ranks take as many optimiser steps as the rank with the most minibatches (an all-reduce of
    the counts): a rank whose rows run out sooner runs its last row again at weight zero in the
    steps left, so that every step's collectives meet (the forwards per step are agreed step by
    step, ``_micro_batches``).
    """
    rows = [min(mb, n - s) for s in range(0, n, mb)]
    if sync is None:
        return rows
    steps = torch.tensor([len(rows)], dtype=torch.int64, device=sync.device)
    dist.all_reduce(steps, op=dist.ReduceOp.MAX)
    local = torch.zeros(int(steps.item()), dtype=torch.int64)
    if counted:
        local[:len(rows)] = torch.tensor(rows, dtype=torch.int64)
    return cast(list[int], all_reduce_sum(local.to(sync.device)).cpu().tolist())


def token_micro_batches(tokens: torch.Tensor, *, budget: int, max_rows: int) -> list[torch.Tensor]:
    """Row indices of the micro-batches of a minibatch under a token budget (verl's dynamic batch size).

    Rows are taken in order; a micro-batch closes when the next row would take its tokens past
    ``budget`` or its rows past ``max_rows``. A row of more than ``budget`` tokens is a micro-batch
    of its own. For a loss normalised by the minibatch's denominators (``num_tokens`` /
    ``num_seqs``) or a mean over rows, the partition changes how much one forward holds, not the
    step's gradient; a loss normalised per micro-batch (``agg="local_token_mean"``: BNPO, TRL's
    per-device mean) changes with any partition, as it does with ``micro_batch_size``.

    Args:
        tokens: ``[n]`` the tokens each row costs a forward (real tokens when packed, the padded
            width otherwise).
    Returns:
        A list of ``[b_i]`` long index tensors covering ``0..n-1`` in order.

    Examples:
        >>> [g.tolist() for g in token_micro_batches(torch.tensor([3, 4, 2, 9, 1]), budget=8, max_rows=4)]
        [[0, 1], [2], [3], [4]]
    """
    groups, current, used = [], [], 0
    for i, t in enumerate(tokens.tolist()):
        if current and (used + t > budget or len(current) >= max_rows):
            groups.append(current)
            current, used = [], 0
        current.append(i)
        used += t
    if current:
        groups.append(current)
    return [torch.tensor(g, dtype=torch.long) for g in groups]


class _Again(torch.Tensor):
    """Row indices run again at weight zero: a forward and backward that only keeps an FSDP2 step's
    collectives in step with a rank that runs more micro-batches (its gradients and metrics count
    nothing)."""


def _split_to(groups: list[torch.Tensor], count: int) -> list[torch.Tensor]:
    """``groups`` cut (the largest in rows first, in halves) until there are ``count`` of them, and
    when no group has two rows left, its last row run again at weight zero (:class:`_Again`): FSDP2's
    ranks must run as many forwards per step."""
    groups = list(groups)
    while len(groups) < count:
        i = max(range(len(groups)), key=lambda j: len(groups[j]))
        if len(groups[i]) < 2:
            groups += [groups[-1][-1:].as_subclass(_Again)] * (count - len(groups))
            break
        half = len(groups[i]) // 2
        groups[i:i + 1] = [groups[i][:half], groups[i][half:]]
    return groups


def _micro_batches(minibatch: TensorDictBase, micro_batch_size: int, *, budget: int | None,
                   row_tokens: Callable[[TensorDictBase], torch.Tensor] | None,
                   sync: GradSync | None) -> list[torch.Tensor]:
    """The row indices of each forward of a minibatch: ``micro_batch_size`` rows, or cut by a token
    budget; under FSDP2 the ranks agree on the largest count (one all-reduce) and the others cut
    theirs to it (:func:`_split_to`)."""
    n = minibatch.batch_size[0]
    if budget is None:
        groups = list(torch.arange(n).split(micro_batch_size))
    else:
        if row_tokens is None:
            raise ValueError("row_tokens: a token budget (max_tokens_per_micro_batch) needs the tokens each row costs")
        tokens = torch.as_tensor(row_tokens(minibatch)).reshape(-1)
        if tokens.numel() != n:
            raise ValueError(f"row_tokens: expected one count per row ({n}), got shape {list(tokens.shape)}")
        groups = token_micro_batches(tokens, budget=budget, max_rows=micro_batch_size)
    if sync is not None and sync.lockstep:
        count = torch.tensor(float(len(groups)), device=sync.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        groups = _split_to(groups, int(count.item()))
    return groups


def _named(metrics: Any) -> Iterable[tuple[str, torch.Tensor]]:
    if isinstance(metrics, TensorDictBase):
        metrics = metrics.items(include_nested=True, leaves_only=True)
    else:
        metrics = metrics.items()
    for k, v in metrics:
        yield ("/".join(k) if isinstance(k, tuple) else k), torch.as_tensor(v).detach()


def _accumulate(state: TrainState, minibatch: TensorDictBase, loss_fn: LossFn, *, groups: list,
                rows: int, mask_key: Any, autocast_dtype: torch.dtype | None, device_type: str,
                early_stop_key: str | None, sync: GradSync | None,
                counted: bool = True, overlap: OverlappedReduction | None = None
                ) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """Forward/backward over the micro-batches (``groups``: row indices) of one minibatch;
    gradients add up in ``.grad``.

    ``rows``: the minibatch's counted rows over every rank; each micro-batch's share of the step is
    ``b / rows``, so the ranks' weighted sums add up to the global minibatch's. A group run again
    (:class:`_Again`), or any group of a rank whose rows are not ``counted``, weighs zero. With
    ``overlap``, the last micro-batch's backward sends the gradients as it makes them.
    """
    denominators = global_denominators(minibatch if counted else minibatch[:0], mask_key)
    scale = 1.0 if sync is None else sync.loss_scale
    sums: dict[str, torch.Tensor] = {}
    finite = stop = None  # 0-d bool tensors on the loss's device: no synchronisation here
    for k, group in enumerate(groups):
        micro = minibatch[group.as_subclass(torch.Tensor)]
        share = micro.batch_size[0] / max(rows, 1) if counted and not isinstance(group, _Again) else 0.0
        loss_weight = (1.0 if denominators else share) if share else 0.0
        last = k == len(groups) - 1
        with accumulation_context(sync, last=last):  # DDP no_sync but on the last
            with torch.autocast(device_type, dtype=autocast_dtype or torch.bfloat16,
                                enabled=autocast_dtype is not None):
                loss, metrics = loss_fn(state, micro, **denominators)
            with overlap.armed() if overlap is not None and last else contextlib.nullcontext():
                (loss if loss_weight * scale == 1.0 else loss * (loss_weight * scale)).backward()
        ok = torch.isfinite(loss.detach())
        finite = ok if finite is None else finite & ok
        stop = torch.zeros_like(ok) if stop is None else stop
        for name, value in [("loss", loss.detach()), *((k, v) for k, v in _named(metrics) if k != "loss")]:
            if name == early_stop_key:  # a forward at weight zero has no say
                stop = stop | (value.to(stop.device).bool().any() & bool(share))
                continue
            w = loss_weight if name.startswith("loss") else share
            sums[name] = sums.get(name, 0.0) + w * value.to(torch.float64)
    if overlap is not None:
        overlap.finish()
    return sums, finite, stop


def _synchronise(sums: dict[str, torch.Tensor], finite: torch.Tensor, stop: torch.Tensor,
                 sync: GradSync | None, overlap: OverlappedReduction | None = None
                 ) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """One all-reduce of the step's metric sums, flags and gradient presence; then the gradients
    (the buckets ``overlap`` sent during the backward, unless a gradient changed after its bucket
    was sent on some rank: then reduced again from ``.grad``).

    Metric sums are already weighted by global shares, so their sum over ranks is the global
    value; a non-finite loss or an early stop on any rank holds for all of them.
    """
    if sync is None:
        return sums, finite, stop
    names = sorted(sums)
    signature = zlib.crc32("\x00".join(names).encode()) % (1 << 24)
    present = [p.grad is not None for p in sync.manual]
    head = [float(len(names)), float(signature), float(len(names)) ** 2, float(signature) ** 2]
    values = [torch.as_tensor(sums[k]).to(sync.device, torch.float64).reshape(()) for k in names]
    late = torch.tensor(float(overlap is not None and overlap.late), dtype=torch.float64, device=sync.device)
    flags = torch.stack([(~finite).to(sync.device, torch.float64), stop.to(sync.device, torch.float64), late])
    buf = torch.cat([torch.tensor(head + [float(x) for x in present], dtype=torch.float64, device=sync.device),
                     flags, torch.stack(values) if values else flags[:0]])
    dist.all_reduce(buf)
    k = 4 + len(present)
    host = buf[:k + 3].tolist()  # the step's synchronisation point under NCCL (one small transfer)
    W = sync.world_size
    if host[0] ** 2 != host[2] * W or host[1] ** 2 != host[3] * W:
        raise ValueError(f"update: the ranks report different metric names (this rank: {names}); every rank "
                         "must run the same loss_fn")
    if overlap is not None and host[k + 2] == 0:
        overlap.apply(host[4:k])
    else:
        if overlap is not None:
            overlap.release()  # before the second reduction: one copy of the gradients at a time
        reduce_gradients(sync, host[4:k])
    bad, halt = buf[k], buf[k + 1]
    reduced = dict(zip(names, buf[k + 3:].unbind()))
    return reduced, (bad == 0).to(finite.device), (halt > 0).to(stop.device)


def _zero_grads(params: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> None:
    optimizer.zero_grad(set_to_none=True)
    for p in params:
        p.grad = None


def _optimizer_step(state: TrainState, params: list[torch.Tensor], finite: torch.Tensor, stop: torch.Tensor, *,
                    transform: Transform, where: str) -> tuple[str, torch.Tensor, bool]:
    """Run the transforms, then step, or leave everything untouched on a veto or an error.

    Returns ``(outcome, grad_norm, stop)``: ``"taken"``, ``"skipped"`` or ``"stopped"``, the norm
    before the transforms, and the step's early-stop flag on the host.
    """
    norm = total_grad_norm([p.grad for p in params if p.grad is not None]).to(finite.device)
    loss_ok, norm_ok, halt = torch.stack([finite, torch.isfinite(norm), stop]).tolist()  # the one sync of a step
    step = GradStep(params=params, grad_norm=norm, loss_finite=bool(loss_ok), grad_finite=bool(norm_ok),
                    stop=bool(halt), where=where)
    try:
        outcome = transform(step)
    except BaseException:
        _zero_grads(params, state.optimizer)
        raise
    if outcome is not None:
        _zero_grads(params, state.optimizer)
        if outcome not in OUTCOMES:
            raise ValueError(f"transform: returned {outcome!r} at {where}; expected None or one of {list(OUTCOMES)}")
        return outcome, norm, step.stop
    state.optimizer.step()
    if state.scheduler is not None:
        state.scheduler.step()
    _zero_grads(params, state.optimizer)
    return "taken", norm, step.stop


def _mean(steps: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    names = dict.fromkeys(k for s in steps for k in s)
    return {k: torch.stack([s[k].to(torch.float64) for s in steps if k in s]).mean() for k in names}


@contextlib.contextmanager
def training_mode(models: Iterable[nn.Module], trained: Iterable[torch.Tensor]) -> Iterator[None]:
    """The models holding a trained parameter in ``train()`` mode inside the block, every mode restored after.

    A model's dropout is then active while it learns, as in TRL's trainers, and off for the
    forwards outside ``update`` (collection, scoring, evaluation). Recipes that must score the same
    tokens identically in and out of ``update`` (the RL recipes) set dropout to 0 instead
    (``loops.models.disable_dropout``).
    """
    ids = {id(p) for p in trained}
    learning = [m for m in models if any(id(p) in ids for p in m.parameters())]
    modes = [(module, module.training) for model in learning for module in model.modules()]
    for model in learning:
        model.train()
    try:
        yield
    finally:
        for module, mode in modes:
            module.training = mode


def update(state: TrainState, batch: TensorDictBase, loss_fn: LossFn, *, minibatch_size: int | None = None,
           micro_batch_size: int | None = None, epochs: int = 1, mask_key: Any = None,
           params: Iterable[torch.Tensor] | None = None, autocast_dtype: torch.dtype | None = None,
           shuffle: bool = True, max_tokens_per_micro_batch: int | None = None,
           row_tokens: Callable[[TensorDictBase], torch.Tensor] | None = None,
           transform: Transform = DEFAULT_TRANSFORM, counted: bool = True) -> tuple[TrainState, TensorDict]:
    """Optimise ``loss_fn`` on ``batch``: ``epochs`` passes of shuffled minibatches (impure).

    Per epoch the rows are permuted with ``state.rng`` (when there is more than one minibatch and
    ``shuffle``) and cut into minibatches of ``minibatch_size`` rows, one optimiser step each,
    every row seen once per epoch (the last minibatch is smaller when the sizes do not divide).
    A minibatch is cut into micro-batches of ``micro_batch_size`` rows whose gradients accumulate
    (``grad_accum = ceil(minibatch_size / micro_batch_size)``, derived); see the module doc for the
    loss contract that makes accumulation equal the full-minibatch gradient. Then the global
    gradient norm ``‖g‖₂`` is computed once, ``transform`` runs on a ``GradStep`` (the default
    skips non-finite steps, then ``g ← g·min(1, 1.0/(‖g‖₂ + 1e-6))``), and unless it vetoes,
    ``optimizer.step()``, ``scheduler.step()``.

    Guards (the transforms, see the module doc):
        ``skip_nonfinite()``: a non-finite loss (any micro-batch) or gradient norm skips the step:
        gradients are dropped, weights, optimiser and scheduler are left exactly as they were, and
        the step is counted in ``state.skipped_steps``; ``raise_nonfinite()`` raises
        ``NonFiniteError`` instead. ``stop_on(key, when=)``: a true ``key`` metric from ``loss_fn``
        (PPO's target KL) ends the epochs loop: with ``when="minibatch"`` any minibatch's flag
        drops that step's gradients and stops at once; with ``"epoch"`` (legacy TRL's PPO) the
        flag of each epoch's last minibatch is read after its step, and a true one skips the
        remaining epochs (every step of the epoch is kept). A transform that raises leaves the
        gradients dropped and the weights, optimiser and scheduler as they were.

    Distributed (a process group of ``W > 1`` ranks, ``rlcore.loops.dist``): ``batch`` is this
    rank's share of the global batch and ``minibatch_size`` / ``micro_batch_size`` count this
    rank's rows (DDP's per-device sizes; the ranks' shares may differ by a few rows). The token /
    sequence / row counts of each minibatch are summed over the ranks before its losses, so each
    rank's loss is its share of the global minibatch's loss; gradients are summed across ranks once
    per step (unwrapped models; DDP / FSDP2 models reduce their own, averaging, so the loss is
    multiplied by ``W`` before ``backward`` and the manual reduction averages too), never during
    accumulation (DDP ``no_sync``, FSDP2 ``set_requires_gradient_sync(False)``); the loss metrics
    are summed and the others averaged by rows across ranks; a non-finite loss or an early stop
    on any rank holds for all. The result on ``W`` ranks is the result of one process on the
    concatenated batch (up to float summation order). The ranks take as many steps per epoch as
    the rank with the most minibatches; a rank whose rows run out runs its last row again at weight
    zero in the steps left (its rows count for nothing there). Under FSDP2 every
    forward is a collective: the ranks agree on each step's number of micro-batches (the largest),
    a rank with fewer cuts its own in halves, and one with fewer rows than that runs its last row
    again at weight zero.

    Args:
        state: ``TrainState`` with ``optimizer`` (and optionally ``scheduler``, ``rng``).
        batch: TensorDict ``[B]``; never written into.
        loss_fn: ``(state, micro_batch, **denominators) -> (loss [], metrics)``.
        minibatch_size: rows per optimiser step (default ``B``: one step per epoch).
        micro_batch_size: rows per forward/backward (default ``minibatch_size``).
        epochs: passes over ``batch`` (PPO's K epochs).
        mask_key: key of the ``[B, ..., T]`` bool mask the global denominators count, or ``None``.
        params: what is clipped, checked and zeroed (default: every parameter of the optimiser).
        autocast_dtype: e.g. ``torch.bfloat16``: forward and loss under ``torch.autocast`` on the
            parameters' device type; backward outside it. ``None``: no autocast.
        shuffle: permute rows each epoch (needs ``state.rng``).
        max_tokens_per_micro_batch: a token budget per forward instead of a fixed row count
            (verl's dynamic batch size): each minibatch's rows, in order, are cut into micro-batches
            of at most this many tokens (``token_micro_batches``; a longer row alone) and at most
            ``micro_batch_size`` rows. ``None``: micro-batches of ``micro_batch_size`` rows. Under
            FSDP2 the ranks agree on the count per step (the largest micro-batches are halved).
        row_tokens: with a budget, ``minibatch -> [b]`` the tokens each row costs a forward
            (``loops.collate.row_tokens``).
        transform: ``GradStep -> outcome | None``, usually a ``chain`` of ``skip_nonfinite()`` or
            ``raise_nonfinite()``, ``stop_on(...)`` and ``clip_by_global_norm(max_norm)``, applied
            in that order (non-finite check, early stop, clip); the default ``DEFAULT_TRANSFORM`` is
            ``chain(skip_nonfinite(), clip_by_global_norm(1.0))`` (no early stop).
        counted: ``False``: this rank's rows weigh nothing (in the loss, the denominators and the
            metrics); it runs them only so that an FSDP2 step's collectives meet (a rank with no
            data of its own this step, such as online DPO's when every one of its prompts tied).
    Returns:
        ``(state, metrics)``: ``state`` with the advanced generator copy as ``rng`` and
        ``optimizer_steps``, ``skipped_steps``, ``policy_version`` (+1 if any step was taken)
        updated; ``metrics`` (TensorDict of 0-d float64 tensors): the loss and ``loss_fn``'s
        metrics combined over micro-batches (``loss*`` keys summed as shares of the step with
        ``mask_key``, everything else weighted by rows) and averaged over the steps run, plus
        ``grad_norm`` (mean, before clipping), ``lr`` (of the last step taken), ``optimizer_steps``,
        ``skipped_steps``, ``early_stop`` (1.0 if the loop was stopped).

    Gradient: only ``loss`` is differentiated; metrics are detached.
    """
    if state.optimizer is None:
        raise ValueError("state.optimizer: update needs an optimiser (see make_optimizer)")
    if not callable(transform):
        raise TypeError(f"transform: expected a callable GradStep -> outcome | None (see chain), got {transform!r}")
    rule = _stop_rule(transform)
    per_epoch = rule is not None and rule.when == "epoch"
    n, mb, micro = _sizes(batch, minibatch_size, micro_batch_size, epochs)
    params = [p for g in state.optimizer.param_groups for p in g["params"]] if params is None else list(params)
    shuffled = shuffle and mb < n
    if shuffled and state.rng is None:
        raise ValueError("state.rng: shuffling minibatches needs a torch.Generator (init_state(seed=...))")
    rng = copy_generator(state.rng) if shuffled else state.rng
    device_type = params[0].device.type if params else "cpu"
    trained = [p for g in state.optimizer.param_groups for p in g["params"]]
    sync = grad_sync(state.models.values(), list({id(p): p for p in [*trained, *params]}.values()))
    if max_tokens_per_micro_batch is not None and (isinstance(max_tokens_per_micro_batch, bool) or not isinstance(
            max_tokens_per_micro_batch, int) or max_tokens_per_micro_batch < 1):
        raise ValueError(f"max_tokens_per_micro_batch: expected a positive int or None, got "
                         f"{max_tokens_per_micro_batch!r}")
    rows = _plan(n, mb, sync, counted=counted)
    steps, counts, lr = [], dict.fromkeys(("taken", "skipped", "stopped"), 0), None
    _zero_grads(params, state.optimizer)
    with training_mode(state.models.values(), trained):  # dropout as the model defines it
        for epoch in range(epochs):
            order = torch.randperm(n, generator=rng) if shuffled else torch.arange(n)
            for k in range(len(rows)):
                start = k * mb
                own = start < n  # else this rank's rows are done: its last row again, at weight zero
                minibatch = batch[order[start:start + mb]] if own else batch[order[-1:]]
                where = f"epoch {epoch}, rows {start}:{start + mb}" if own else f"epoch {epoch}, step {k}"
                groups = _micro_batches(minibatch, micro, budget=max_tokens_per_micro_batch, row_tokens=row_tokens,
                                        sync=sync)
                overlap = OverlappedReduction(sync) if sync is not None and sync.overlap else None
                sums, finite, stop = _accumulate(
                    state, minibatch, loss_fn, groups=groups, rows=rows[k],
                    mask_key=mask_key, autocast_dtype=autocast_dtype, device_type=device_type,
                    early_stop_key=None if rule is None else rule.key, sync=sync, counted=counted and own,
                    overlap=overlap)
                sums, finite, stop = _synchronise(sums, finite, stop, sync, overlap)
                step_lr = state.optimizer.param_groups[0]["lr"]
                outcome, norm, flagged = _optimizer_step(state, params, finite, stop, transform=transform,
                                                         where=where)
                counts[outcome] += 1
                lr = step_lr if outcome == "taken" else lr
                steps.append({**sums, "grad_norm": norm.detach()})
                if outcome == "stopped":
                    break
            if counts["stopped"] or (per_epoch and flagged):  # the epoch's last minibatch decides
                halted = True
                break
        else:
            halted = False
    new_state = dataclasses.replace(
        state, rng=rng, optimizer_steps=state.optimizer_steps + counts["taken"],
        skipped_steps=state.skipped_steps + counts["skipped"],
        policy_version=state.policy_version + (counts["taken"] > 0))
    f64 = functools.partial(torch.tensor, dtype=torch.float64)
    metrics = {**_mean(steps), "lr": f64(state.optimizer.param_groups[0]["lr"] if lr is None else lr),
               "optimizer_steps": f64(counts["taken"]), "skipped_steps": f64(counts["skipped"]),
               "early_stop": f64(float(halted))}
    return new_state, TensorDict(metrics, batch_size=[])
