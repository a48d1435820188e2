"""Asynchronous off-policy RLHF: generation in its own process, at most ``N`` updates behind.

The learner (this process) and a generator process run concurrently::

    learner   item t: rollout_t from the queue -> score (reference, reward, the critic's values)
              -> prepare (advantages, GAE or preference pairs) -> update
              -> push the weights (version t+1) into shared memory
    generator item i: wait until the learner has finished ≥ i − N steps -> copy the newest weights
              -> generate_rollout (behaviour log-probs, POLICY_VERSION stamped) -> the queue

So rollout ``t`` comes from a policy at most ``N`` updates old (``max_lag``). ``N = 0`` is the
synchronous loop (the generator waits for every update; same seeds, same parameters as the
recipe's own ``step``, minibatch shuffling included); ``N = 1`` overlaps the generation of
batch ``t+1`` with the update on batch ``t``, the setting of Noukhovitch et al.

Algorithms (``LEARNERS``): ``"grpo"``, ``"rloo"``, ``"ppo"``, ``"online_dpo"``. Each is its
recipe's own hooks (:class:`Learner`): the synchronous ``step`` is ``collect_rollout →
prepare → optimise`` and the learner runs the same ``prepare`` and ``optimise`` on the
generator's rollout, so sync and async share one code path. Everything after generation runs
on the learner's current models: PPO's values come from its current critic (never a stale
one), its KL controller and score moments advance once per rollout; online DPO's pairs are
ranked by the judge and get reference log-probs as in the recipe.

Transport: the learner sends prompt batches with their sampling seeds on a request queue and
receives rollouts (TensorDicts in shared memory) on a results queue bounded at ``N + 1``; the
weights travel through a shared-memory copy of the policy guarded by a condition variable. A
``multiprocessing`` queue rather than torchrl's ``ReplayBuffer``: the learner needs each rollout
exactly once, in item order, with blocking back-pressure across processes; a replay buffer
samples (at random) from an in-process storage and would break the ``N = 0`` equivalence.

Off-policy correction (``is_clip = C``): with ``π_prox`` the learner's policy before the update
(one no-grad forward) and ``π_b`` the generator's (the behaviour log-probs), the loss's ratio is
taken against ``π_prox`` and the advantages are weighted by ``w = min(π_prox/π_b, C)``, detached:
the decoupled PPO objective with a truncated importance weight, at the level of the loss's
ratio: per token for PPO and token-ratio GRPO presets, the sequence's mean for GSPO, the
sequence's sum for RLOO (``Learner.level``). PPO's value loss is not reweighted (its values and
returns come from the learner's critic). Online DPO has no ratio (the DPO loss is an offline
objective on pairs, off-policy by construction): ``is_clip`` is rejected with a ``ValueError``.
``is_clip=None`` keeps the behaviour log-probs as the loss's ``old_logprobs`` (the clipped ratio
then absorbs the lag, as in the paper).

Metrics per step: ``async/staleness`` (mean ``version_learner − version_rollout``),
``async/staleness_max``, ``async/logprob_gap`` (``mean_t(log π_b − log π_prox)``, a k1 estimate of
``KL(π_b ‖ π_prox)``), ``async/logprob_abs_gap``, ``async/wait_s`` (learner idle, waiting for a
rollout), ``async/generate_s``, ``async/overlap_s`` (the rollout's generation time that overlapped
learner steps), and with ``is_clip`` ``async/is_weight`` and ``async/is_truncated``.

References:
    Noukhovitch et al., "Asynchronous RLHF: Faster and More Efficient Off-Policy RL for Language
    Models", https://arxiv.org/abs/2410.18252; Espeholt et al., "IMPALA" (truncated importance
    weights), https://arxiv.org/abs/1802.01561; Hilton et al., "Batch size-invariance for policy
    optimization" (decoupled PPO objective), https://arxiv.org/abs/2110.00641
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import inspect
import itertools
import math
import multiprocessing
import queue
import signal
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import ModuleType
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn

from rlcore import keys as K
from rlcore.algorithms.ppo import importance_log_ratio
from rlcore.checks import check_mask, check_same_shape, lookup
from rlcore.loops.checkpoint import resume
from rlcore.loops.collect import generate_rollout
from rlcore.loops.distributed import process_context
from rlcore.loops import grpo, online_dpo, ppo, rloo
from rlcore.loops.online import (evaluate_policy, make_reward_fn, prompt_source, repeat_columns, rollout_metrics,
                                 with_policy_logprobs)
from rlcore.loops.recipe import load_splits, run
from rlcore.loops.score import score_rollout
from rlcore.loops.state import TrainState, advance, copy_generator
from rlcore.loops.tasks import task_dataset
from rlcore.masked import masked_mean

__all__ = ["truncated_importance_weights", "with_importance_correction", "off_policy_metrics", "Learner", "LEARNERS",
           "learn", "GeneratorHandle", "generator_process", "push_weights", "rollout_source", "train_async"]


# --- off-policy correction (pure) ------------------------------------------------------------------
def truncated_importance_weights(proximal_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor,
                                 mask: torch.Tensor, *, clip: float = 1.0, level: str = "token") -> torch.Tensor:
    """Truncated importance weights of the learner's policy against the behaviour policy.

    ``w = min(exp(log ρ), C)`` with ``log ρ = importance_log_ratio(prox, behaviour, level)``:
    ``log π_prox − log π_b`` per token (``"token"``), or the sequence's mean (``"sequence"``) or
    sum (``"sequence_sum"``) on every token; clamped in log space, so ``exp`` never overflows.

    Args:
        proximal_logprobs: ``[..., T]`` float, the learner's log-probs before the update.
        behaviour_logprobs: ``[..., T]`` float, the generator's (``old_logprobs`` of a rollout).
        mask: ``[..., T]`` bool.  clip: ``C > 0`` (IMPALA's ``ρ̄``; 1 by default).
        level: a key of ``algorithms.ppo.RATIO_LEVELS``.
    Returns:
        ``[..., T]`` weights in ``[0, C]``, 0 outside ``mask``, detached.

    >>> prox, b = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-2.0, -1.0]])
    >>> truncated_importance_weights(prox, b, torch.tensor([[True, True]]), clip=2.0)
    tensor([[2.0000, 0.3679]])

    References: Espeholt et al., "IMPALA", https://arxiv.org/abs/1802.01561

    Gradient: none (both inputs are detached).
    """
    if not clip > 0:
        raise ValueError(f"clip: expected C > 0, got {clip}")
    check_same_shape("proximal_logprobs", proximal_logprobs, behaviour_logprobs=behaviour_logprobs)
    check_mask("mask", mask, like=proximal_logprobs, like_name="proximal_logprobs")
    log_w = importance_log_ratio(proximal_logprobs.detach(), behaviour_logprobs.detach(), mask, level=level)
    w = torch.exp(log_w.clamp(max=math.log(clip))).clamp(max=clip)  # exp(log C) may round above C
    return torch.where(mask, w, torch.zeros((), dtype=w.dtype, device=w.device))


def with_importance_correction(rollout: TensorDictBase, proximal_logprobs: torch.Tensor, *, clip: float = 1.0,
                               level: str = "token") -> TensorDictBase:
    """A copy of a scored rollout for the decoupled objective: ``advantages ← w·advantages``,
    ``old_logprobs ← proximal_logprobs`` (the clip is then around the learner's policy), with
    ``w = truncated_importance_weights(prox, old_logprobs, response_mask, clip=, level=)``."""
    w = truncated_importance_weights(proximal_logprobs, rollout[K.OLD_LOGPROBS], rollout[K.RESPONSE_MASK],
                                     clip=clip, level=level)
    return rollout.copy().update({K.ADVANTAGES: rollout[K.ADVANTAGES] * w.to(rollout[K.ADVANTAGES].dtype),
                                  K.OLD_LOGPROBS: proximal_logprobs.detach()})


def off_policy_metrics(rollout: TensorDictBase, proximal_logprobs: torch.Tensor,
                       learner_version: int) -> dict[str, torch.Tensor]:
    """Staleness and the behaviour-vs-learner gap of a rollout (detached scalars, no sync).

    ``staleness = learner_version − policy_version`` (mean and max over rows);
    ``logprob_gap = mean_{valid t}(log π_b − log π_prox)`` and its absolute version.
    """
    mask = rollout[K.RESPONSE_MASK]
    diff = rollout[K.OLD_LOGPROBS].detach() - proximal_logprobs.detach()
    stale = (learner_version - rollout[K.POLICY_VERSION]).to(torch.float64)
    return {"async/staleness": stale.mean(), "async/staleness_max": stale.max(),
            "async/logprob_gap": masked_mean(diff, mask), "async/logprob_abs_gap": masked_mean(diff.abs(), mask)}


# --- what the learner does with a generated rollout ------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Learner:
    """The algorithm-specific half of an online step, after generation: the recipe's own hooks.

    A synchronous recipe's ``step`` is ``collect_rollout(**score_options) → prepare → optimise``;
    :func:`learn` runs the same hooks on a rollout that the generator process produced.

    Attributes:
        config: the recipe's ``Config`` class (``train_async`` checks the config is one).
        build_state: ``config -> (state, tokenizer)``, validating the config first (the recipe's
            models: a PPO state holds its critic and KL controller).
        score_options: ``(state, config) -> dict`` of ``collect_rollout``'s scoring options
            (``value_fn`` of the state's critic, ``reference=False``).
        prepare: ``(state, rollout, config) -> (state, batch, info)``: from the scored rollout to
            what the loss reads (advantages, GAE, preference pairs), and its metrics.
        optimise: ``(state, batch, config) -> (state, metrics)``: the update (impure).
        level: ``config -> str``, the level of the loss's importance ratio
            (``algorithms.ppo.RATIO_LEVELS``) for ``is_clip``, whose ``batch`` keeps the rollout's
            rows; ``None``: the loss has no ratio and ``is_clip`` is rejected.
    """

    config: type
    build_state: Callable[[Any], tuple[TrainState, Any]]
    score_options: Callable[[TrainState, Any], dict]
    prepare: Callable[[TrainState, TensorDictBase, Any], tuple[TrainState, TensorDictBase, dict]]
    optimise: Callable[[TrainState, TensorDictBase, Any], tuple[TrainState, TensorDict]]
    level: Callable[[Any], str] | None


def _recipe_learner(recipe: ModuleType, level: Callable[[Any], str] | None) -> Learner:
    return Learner(config=recipe.Config, build_state=recipe.build_state, score_options=recipe.score_options,
                   prepare=recipe.prepare, optimise=recipe.optimise, level=level)


def _grpo_level(config: Any) -> str:  # the signature sees through nested partials (a preset keeps its own)
    return inspect.signature(grpo.grpo_loss_fn(config)).parameters["ratio_level"].default


LEARNERS: dict[str, Learner] = {
    "grpo": _recipe_learner(grpo, level=_grpo_level),                     # the preset's ratio level
    "rloo": _recipe_learner(rloo, level=lambda config: "sequence_sum"),   # exp(Σ_t lp − Σ_t old)
    "ppo": _recipe_learner(ppo, level=lambda config: "token"),            # ppo_loss's token ratio
    "online_dpo": _recipe_learner(online_dpo, level=None),                # no ratio: is_clip rejected
}


def _score(state: TrainState, rows: Mapping[str, Sequence], rollout: TensorDictBase, *, config: Any, tokenizer,
           reward_fn, value_fn=None, reference: bool = True) -> tuple[TrainState, TensorDictBase]:
    """``collect_rollout`` after its generation: scores, the one draw it makes from ``state.rng``, counters."""
    rollout = score_rollout(rollout, ref=state.model("ref") if reference else None, value_fn=value_fn,
                            reward_fn=reward_fn, reward_model=state.models.get("reward"), tokenizer=tokenizer,
                            reward_columns=repeat_columns(rows, config.num_samples), temperature=config.temperature)
    rng = copy_generator(state.rng)
    torch.randint(0, 2**62, (), generator=rng)  # the seed draw of the synchronous collect_rollout
    B = rollout.batch_size[0]
    state = advance(dataclasses.replace(state, rng=rng), samples_seen=B, episodes=B,
                    tokens_seen=rollout[K.RESPONSE_MASK].sum())
    return state, rollout


def learn(state: TrainState, rows: Mapping[str, Sequence], rollout: TensorDictBase, *, config: Any, tokenizer,
          reward_fn, learner: Learner, is_clip: float | None = None) -> tuple[TrainState, TensorDict]:
    """Score a generated rollout and update on it, exactly as the synchronous recipe does after
    generating: scores with the learner's current models (reference, reward, the critic's values:
    ``learner.score_options``), the counters and the one draw ``collect_rollout`` makes from
    ``state.rng``, the learner's own log-probs (metrics and the optional correction),
    ``learner.prepare``, ``learner.optimise``. Impure (trains the policy).

    With ``is_clip`` the prepared batch's advantages are weighted and its ``old_logprobs``
    replaced (:func:`with_importance_correction` at ``learner.level``); the ``rollout/*`` metrics
    stay those of the behaviour rollout.
    """
    if is_clip is not None and learner.level is None:
        raise ValueError("is_clip: this learner's loss has no importance ratio to correct; pass is_clip=None")
    state, rollout = _score(state, rows, rollout, config=config, tokenizer=tokenizer, reward_fn=reward_fn,
                            **learner.score_options(state, config))
    with torch.no_grad():
        prox = with_policy_logprobs(state.model("policy"), rollout, temperature=config.temperature)[K.LOGPROBS]
    stats = off_policy_metrics(rollout, prox, state.policy_version)
    state, batch, info = learner.prepare(state, rollout, config)
    if is_clip is not None:
        level, mask = learner.level(config), batch[K.RESPONSE_MASK]
        w = truncated_importance_weights(prox, batch[K.OLD_LOGPROBS], mask, clip=is_clip, level=level)
        stats["async/is_weight"] = masked_mean(w, mask)
        stats["async/is_truncated"] = masked_mean((w >= is_clip).to(torch.float64), mask)
        batch = with_importance_correction(batch, prox, clip=is_clip, level=level)
        info = {**rollout_metrics(rollout), **info}
    state, metrics = learner.optimise(state, batch, config)
    return state, metrics.update(info).update(stats)


# --- the generator process ----------------------------------------------------------------------------
@dataclasses.dataclass(eq=False)
class GeneratorHandle:
    """The learner's side of a running generator process (a resource: use ``generator_process``).

    ``process``, the two queues, the shared-memory ``weights`` module with its ``cond``ition and
    the published counters ``steps_done`` / ``version``; ``learner_spans`` and ``generator_spans``
    record ``(start, end)`` wall-clock times for the overlap metric; ``learner_rng`` is the
    learner's ``state.rng`` after its latest step (the seeds of later requests come from it).
    """

    process: Any
    requests: Any
    results: Any
    weights: nn.Module
    cond: Any
    steps_done: Any
    version: Any
    stop: Any
    max_lag: int
    learner_spans: list = dataclasses.field(default_factory=list)
    generator_spans: list = dataclasses.field(default_factory=list)
    learner_rng: torch.Generator | None = None


def _copy_weights(dst: nn.Module, src: nn.Module) -> None:
    with torch.no_grad():
        for d, s in zip(dst.state_dict().values(), src.state_dict().values()):
            d.copy_(s)


def _generator_main(weights, cond, steps_done, version, requests, results, stop, max_lag, tokenizer,
                    generate_kwargs, device, threads) -> None:
    """The generator's loop: request -> wait for fresh-enough weights -> generate -> result."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the learner's to handle: it stops us
    torch.set_num_threads(threads)
    parent = multiprocessing.parent_process()  # None only if started oddly: then never "orphaned"

    def orphaned() -> bool:
        return parent is not None and not parent.is_alive()

    try:
        policy = copy.deepcopy(weights).to(device)
        local_steps = local_version = -1
        while not stop.is_set():
            try:
                req = requests.get(timeout=0.5)
            except queue.Empty:
                if orphaned():  # the learner died without stopping us
                    break
                continue
            if req is None:
                break
            index, rows, seed = req
            with cond:
                while not cond.wait_for(lambda: steps_done.value >= index - max_lag or stop.is_set(), timeout=0.5):
                    if orphaned():
                        break
                if stop.is_set() or orphaned():
                    break
                if steps_done.value != local_steps:
                    _copy_weights(policy, weights)
                    local_steps, local_version = steps_done.value, version.value
            start = time.time()
            rollout = generate_rollout(policy, tokenizer, list(rows["prompt"]), seed=seed,
                                       policy_version=local_version, **generate_kwargs)
            results.put((index, rollout.to("cpu"), (start, time.time())))
    except BaseException:  # noqa: BLE001 -- reported to the learner, which raises it
        results.put(("error", traceback.format_exc(), None))  # flushed before the process exits
        return
    results.cancel_join_thread()  # stopping: rollouts nobody will read are dropped, exit at once


def push_weights(handle: GeneratorHandle, policy: nn.Module, *, steps_done: int, version: int) -> None:
    """Publish the learner's weights after ``steps_done`` steps (the generator may now produce
    items up to ``steps_done + max_lag``). Copies into shared memory under the condition lock."""
    with handle.cond:
        _copy_weights(handle.weights, policy)
        handle.steps_done.value, handle.version.value = steps_done, version
        handle.cond.notify_all()


@contextlib.contextmanager
def generator_process(policy: nn.Module, tokenizer, *, max_lag: int, steps_done: int, version: int,
                      generate_kwargs: Mapping[str, Any], device: str | torch.device = "cpu",
                      start_method: str = "spawn", threads: int | None = None) -> Iterator[GeneratorHandle]:
    """Run a generator process for the duration of the ``with`` block; always stop it on exit.

    On exit (normal, exception or ``KeyboardInterrupt``) the generator is told to stop, joined,
    terminated then killed if it lingers: no orphan is left. The generator ignores SIGINT and
    exits by itself if the learner dies.

    Args:
        policy: the learner's policy; a CPU copy in shared memory carries the weights.
        max_lag: ``N ≥ 0``.  steps_done, version: the learner's position (``state.step``,
            ``state.policy_version``) whose weights are published first.
        generate_kwargs: for ``generate_rollout`` (``max_new_tokens``, ``temperature``,
            ``num_samples``...).  device: where the generator's copy runs.
        start_method: ``"spawn"`` (safe with CUDA), ``"forkserver"`` (children fork from a server
            that imported ``rlcore.loops`` once: fast from the second process on), or ``"fork"``
            (only before the learner has run multi-threaded work: a fork after OpenMP ran can
            deadlock).
        threads: the generator's ``torch.set_num_threads`` (default: the learner's).
    """
    if not isinstance(max_lag, int) or max_lag < 0:
        raise ValueError(f"max_lag: expected an int ≥ 0, got {max_lag!r}")
    ctx = process_context(start_method)
    weights = copy.deepcopy(policy).to("cpu").share_memory()
    cond, stop = ctx.Condition(), ctx.Event()
    steps, ver = ctx.Value("q", steps_done), ctx.Value("q", version)
    requests, results = ctx.Queue(), ctx.Queue(maxsize=max_lag + 1)
    proc = ctx.Process(target=_generator_main, daemon=True, name="rlcore-generator",
                       args=(weights, cond, steps, ver, requests, results, stop, max_lag, tokenizer,
                             dict(generate_kwargs), str(device), threads or torch.get_num_threads()))
    proc.start()
    handle = GeneratorHandle(proc, requests, results, weights, cond, steps, ver, stop, max_lag)
    try:
        yield handle
    finally:
        stop.set()
        with contextlib.suppress(Exception):
            requests.put(None)
            with cond:
                cond.notify_all()
        proc.join(timeout=10)
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
            proc.join()
        for q in (requests, results):
            q.cancel_join_thread()
            q.close()


def _receive(handle: GeneratorHandle, index: int) -> tuple[TensorDictBase, tuple[float, float]]:
    while True:
        try:
            got, rollout, span = handle.results.get(timeout=0.5)
            break
        except queue.Empty:
            if not handle.process.is_alive() and handle.results.empty():
                raise RuntimeError(f"generator process exited (code {handle.process.exitcode}) before item "
                                   f"{index}") from None
    if got == "error":
        raise RuntimeError(f"generator process failed:\n{rollout}")
    if got != index:
        raise RuntimeError(f"generator: expected item {index}, got {got}")
    return rollout, span


def _overlap(span: tuple[float, float], spans: Sequence[tuple[float, float]]) -> float:
    return sum(max(0.0, min(span[1], b) - max(span[0], a)) for a, b in spans)


def rollout_source(handle: GeneratorHandle, source: Callable[[int], Any], seeds: torch.Generator) -> Callable:
    """A resumable fold source of ``(rows, rollout, timing)`` items produced by the generator.

    Before yielding item ``t`` it has requested items up to ``t + max_lag``, then blocks until
    rollout ``t`` arrives. Seeds: item ``i`` requested before step ``t`` gets the ``(i − t + 1)``-th
    draw from a copy of the learner's generator at the start of step ``t`` (``seeds`` for the
    first step, then ``handle.learner_rng``): the draw the synchronous recipe makes at step ``t``
    for ``i = t``, so ``N = 0`` samples what it samples even when ``update`` shuffles minibatches
    with ``state.rng``; without shuffling, item ``i`` gets the ``(i − start + 1)``-th draw of ``seeds``.
    """
    def start_at(start: int) -> Iterator:
        rows_iter, pending, sent = iter(source(start)), {}, start
        for t in itertools.count(start):
            rng = copy_generator(seeds if t == start or handle.learner_rng is None else handle.learner_rng)
            for _ in range(sent - t):  # the draws of the items t..sent-1, requested before
                torch.randint(0, 2**62, (), generator=rng)
            while sent <= t + handle.max_lag:
                rows = next(rows_iter, None)
                if rows is None:
                    break
                pending[sent] = rows
                handle.requests.put((sent, rows, int(torch.randint(0, 2**62, (), generator=rng))))
                sent += 1
            if t not in pending:
                return
            wait = time.time()
            rollout, span = _receive(handle, t)
            handle.generator_spans.append(span)
            timing = {"async/wait_s": time.time() - wait, "async/generate_s": span[1] - span[0],
                      "async/overlap_s": _overlap(span, handle.learner_spans)}
            yield pending.pop(t), rollout, timing
    return start_at


def _async_step(state: TrainState, item: tuple, *, handle: GeneratorHandle, config: Any, tokenizer, reward_fn,
                learner: Learner, is_clip: float | None) -> tuple[TrainState, TensorDict]:
    start = time.time()
    rows, rollout, timing = item
    state, metrics = learn(state, rows, rollout.to(config.device), config=config, tokenizer=tokenizer,
                           reward_fn=reward_fn, learner=learner, is_clip=is_clip)
    push_weights(handle, state.model("policy"), steps_done=state.step + 1, version=state.policy_version)
    handle.learner_rng = state.rng
    handle.learner_spans.append((start, time.time()))
    return state, metrics.update({k: torch.tensor(v, dtype=torch.float64) for k, v in timing.items()})


def train_async(config: Any, *, algorithm: str, max_lag: int = 1, is_clip: float | None = None, reward_fn=None,
                callbacks: Sequence[Callable] = (), start_method: str = "spawn",
                generator_device: str | None = None) -> tuple[TrainState, list[dict[str, float]]]:
    """Train an online recipe asynchronously: generation in its own process, ``max_lag`` updates behind.

    The run is the recipe's (its own state builder, e.g. PPO's critic and KL controller; the
    data, evaluation, checkpoints, logs and resume of ``loops.online.train_online``), with the
    step split between the generator (``generate_rollout`` on a copy of the policy) and the
    learner (:func:`learn` with the recipe's hooks, ``LEARNERS[algorithm]``).

    Args:
        config: the recipe's ``Config`` (``loops.grpo`` / ``rloo`` / ``ppo`` / ``online_dpo``).
        algorithm: a key of ``LEARNERS``.
        max_lag: ``N``: rollouts come from a policy at most ``N`` updates old; 0 is synchronous.
        is_clip: ``C > 0`` of the truncated importance correction, or ``None`` (off); a
            ``ValueError`` for a learner whose loss has no ratio (online DPO).
        start_method, generator_device: the generator process's (see :func:`generator_process`;
            device default ``config.device``).
    Returns:
        ``(state, history)`` as the recipe's ``train``; history rows carry the ``async/*`` metrics.
    """
    learner = lookup(LEARNERS, algorithm, what="algorithm")
    if not isinstance(config, learner.config):
        raise TypeError(f"config: algorithm {algorithm!r} needs a {learner.config.__module__}.Config, "
                        f"got {type(config).__module__}.{type(config).__qualname__}")
    if is_clip is not None and learner.level is None:
        raise ValueError(f"is_clip: {algorithm!r} has no importance ratio to correct (its loss is an offline "
                         "objective on pairs); pass is_clip=None")
    if is_clip is not None and not is_clip > 0:
        raise ValueError(f"is_clip: expected C > 0 or None, got {is_clip}")
    state, tokenizer = learner.build_state(config)
    if config.run_dir and config.resume:  # resume before the generator copies the weights
        state = resume(config.run_dir, state)
    train_ds, eval_ds = load_splits(config, task_dataset)
    reward = make_reward_fn(config, reward_fn)
    gen = dict(max_new_tokens=config.max_new_tokens, temperature=config.temperature, top_k=config.top_k,
               top_p=config.top_p, num_samples=config.num_samples, max_prompt_length=config.max_prompt_length,
               sampler=config.sampler)
    with generator_process(state.model("policy"), tokenizer, max_lag=max_lag, steps_done=state.step,
                           version=state.policy_version, generate_kwargs=gen, start_method=start_method,
                           device=generator_device or config.device) as handle:
        step = functools.partial(_async_step, handle=handle, config=config, tokenizer=tokenizer, reward_fn=reward,
                                 learner=learner, is_clip=is_clip)
        eval_fn = functools.partial(evaluate_policy, config=config, tokenizer=tokenizer, dataset=eval_ds,
                                    reward_fn=reward)
        source = rollout_source(handle, prompt_source(train_ds, config), state.rng)
        return run(step, state, source, config=dataclasses.replace(config, resume=False), num_steps=config.steps,
                   eval_fn=eval_fn, name=f"async-{algorithm}", callbacks=callbacks)
