"""Asynchronous off-policy RLHF: generation in its own process, at most ``N`` updates behind.

The learner (this process) and a generator process run concurrently::

    learner   item t: rollout_t from the queue -> score (reference, reward, the critic's values)
              -> the recipe's learn (advantages, GAE or preference pairs; the update)
              -> push the weights (version t+1) into shared memory
    generator item i: wait until the learner has finished ≥ i − N steps -> copy the newest weights
              -> generate_rollout (behaviour log-probs, POLICY_VERSION stamped) -> the queue

So rollout ``t`` comes from a policy at most ``N`` updates old (``max_lag``). ``N = 0`` is the
synchronous loop (the generator waits for every update; same seeds, same parameters as the
recipe's own ``step``, minibatch shuffling included); ``N = 1`` overlaps the generation of
batch ``t+1`` with the update on batch ``t``, the setting of Noukhovitch et al.

The learner's side lives in ``loops.scale.async_learners``: :func:`~rlcore.loops.scale.async_learners.learn_off_policy`
runs on the generator's rollout what the synchronous ``step`` runs after generating (scoring, then
the recipe's own ``learn``), so sync and async share one code path; everything after generation runs on the learner's current
models (PPO's values from its current critic, never a stale one). ``is_clip`` switches on the
truncated importance correction described there.

Metrics per step: those of ``learn_off_policy`` (``async/staleness``, ``async/logprob_gap``, ...), and
``async/wait_s`` (learner idle, waiting for a rollout), ``async/generate_s``, ``async/overlap_s``
(the rollout's generation time that overlapped learner steps).

References:
    Noukhovitch et al., "Asynchronous RLHF: Faster and More Efficient Off-Policy RL for Language
    Models", https://arxiv.org/abs/2410.18252
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import itertools
import multiprocessing
import queue
import signal
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn

from rlcore.loops.scale.async_learners import check_learner, learn_off_policy
from rlcore.loops.checkpoint import resume
from rlcore.loops.collect import draw_seed
from rlcore.loops.dist import gathered, process_context, shard_source
from rlcore.loops.recipes.dpo import reference_models
from rlcore.loops.envs import resolve_env
from rlcore.loops.online import check_prompt_data, check_prompt_lengths, generate_kwargs, generate_or_play, prompt_source
from rlcore.loops.reward_fns import make_reward_fn
from rlcore.loops.evaluate import evaluate_policy
from rlcore.loops.recipe import load_splits, run, whole_copy
from rlcore.loops.state import TrainState, copy_generator
from rlcore.loops.tasks import task_dataset
from rlcore.seeding import set_seed

__all__ = ["check_max_lag", "GeneratorHandle", "generator_process", "push_weights", "rollout_source", "train_async"]


def check_max_lag(max_lag: int) -> None:
    """Raise ``ValueError`` unless ``max_lag`` is an ``int ≥ 0`` (not a bool)."""
    if not isinstance(max_lag, int) or isinstance(max_lag, bool) or max_lag < 0:
        raise ValueError(f"max_lag: expected an int ≥ 0, got {max_lag!r}")


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
    """``src``'s weights into ``dst`` (a whole copy), name by name; an FSDP2 ``src``'s gathered one
    tensor at a time (a collective: every rank calls it, in the same order)."""
    with torch.no_grad():
        for (name, d), (theirs, s) in zip(dst.state_dict().items(), src.state_dict().items(), strict=True):
            if name != theirs:
                raise ValueError(f"the generator's copy holds {name!r} where the policy holds {theirs!r}")
            d.copy_(gathered(s))


def _generator_device(device: str | torch.device) -> torch.device:
    """Where the generator process puts its copy: ``device``, a bare ``cuda`` being this rank's GPU
    (``torch.cuda.current_device()``, which ``init_distributed`` set to ``LOCAL_RANK``), so the ranks'
    generators do not all land on GPU 0."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _generator_main(weights, cond, steps_done, version, requests, results, stop, max_lag, tokenizer,
                    generate_kwargs, device, threads, seed, episodes=None) -> None:
    """The generator's loop: request -> wait for fresh-enough weights -> generate (or play episodes) -> result."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the learner's to handle: it stops us
    torch.set_num_threads(threads)
    set_seed(seed)  # Python, NumPy and torch's global generators, as the learner's run seeds its own
    parent = multiprocessing.parent_process()  # None only if started oddly: then never "orphaned"

    def orphaned() -> bool:
        return parent is not None and not parent.is_alive()

    try:
        policy = copy.deepcopy(weights).to(device)
        local_steps = local_version = -1
        make_env, turns = episode_player(episodes)
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
                while not cond.wait_for(lambda: steps_done.value >= index - max_lag or stop.is_set(),  # noqa: B023
                                        timeout=0.5):
                    if orphaned():
                        break
                if stop.is_set() or orphaned():
                    break
                if steps_done.value != local_steps:
                    _copy_weights(policy, weights)
                    local_steps, local_version = steps_done.value, version.value
            start = time.time()
            rollout = generate_or_play(policy, tokenizer, rows, seed=seed, policy_version=local_version,
                                       generate=generate_kwargs, env=make_env, turns=turns)
            results.put((index, rollout.to("cpu"), (start, time.time())))
    except BaseException:  # noqa: BLE001 -- reported to the learner, which raises it
        results.put(("error", traceback.format_exc(), None))  # flushed before the process exits
        return
    results.cancel_join_thread()  # stopping: rollouts nobody will read are dropped, exit at once


def agent_settings(config: Any) -> dict[str, Any] | None:
    """The plain settings a generator process plays episodes with (``None``: no ``env`` nor ``tools``):
    names, not objects, so they cross to a spawned process and the environment is resolved there."""
    if getattr(config, "env", None) is None and not getattr(config, "tools", ()):
        return None
    return {"env": config.env, "tools": tuple(config.tools), "tool_format": config.tool_format,
            "max_turns": config.max_turns, "max_episode_tokens": config.max_episode_tokens,
            "reuse_context": config.reuse_context}


def episode_player(episodes: Mapping[str, Any] | None) -> tuple[Any, dict[str, Any] | None]:
    """``(env factory, turns)`` for ``online.generate_or_play`` from :func:`agent_settings`' plain
    settings, the environment resolved here (in the generator's process or actor); ``(None, None)``
    without an environment."""
    if episodes is None:
        return None, None
    return (resolve_env(episodes["env"], episodes["tools"], tool_format=episodes["tool_format"]),
            {k: episodes[k] for k in ("max_turns", "max_episode_tokens", "reuse_context")})


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
                      start_method: str = "spawn", threads: int | None = None,
                      seed: int = 0, episodes: Mapping[str, Any] | None = None) -> Iterator[GeneratorHandle]:
    """Run a generator process for the duration of the ``with`` block; always stop it on exit.

    On exit (normal, exception or ``KeyboardInterrupt``) the generator is told to stop, joined,
    terminated then killed if it lingers: no orphan is left. The generator ignores SIGINT and
    exits by itself if the learner dies.

    Args:
        policy: the learner's policy; a CPU copy in shared memory carries the weights (whole: an
            FSDP2 policy's shards gathered one tensor at a time, on every rank for its own generator).
        max_lag: ``N ≥ 0``.  steps_done, version: the learner's position (``state.step``,
            ``state.policy_version``) whose weights are published first.
        generate_kwargs: for ``generate_rollout`` (``max_new_tokens``, ``temperature``,
            ``num_samples``...).  device: where the generator's copy runs.
        start_method: ``"spawn"`` (safe with CUDA), ``"forkserver"`` (children fork from a server
            that imported ``rlcore.loops`` once: fast from the second process on), or ``"fork"``
            (only before the learner has run multi-threaded work: a fork after OpenMP ran can
            deadlock).
        threads: the generator's ``torch.set_num_threads`` (default: the learner's).
        seed: the generator process's global generators (``set_seed``: Python, NumPy, torch); each
            rollout's sampling has its own seed from the learner.
        episodes: multi-turn episodes instead of single responses: the config's ``env``, ``tools``,
            ``tool_format``, ``max_turns``, ``max_episode_tokens`` and ``reuse_context`` (``agent_settings``), the
            environment resolved in the generator process (``loops.envs.resolve_env``).
    """
    check_max_lag(max_lag)
    ctx = process_context(start_method, preload=("rlcore.loops",))
    weights = whole_copy(policy, "cpu").share_memory()
    cond, stop = ctx.Condition(), ctx.Event()
    steps, ver = ctx.Value("q", steps_done), ctx.Value("q", version)
    requests, results = ctx.Queue(), ctx.Queue(maxsize=max_lag + 1)
    proc = ctx.Process(target=_generator_main, daemon=True, name="rlcore-generator",
                       args=(weights, cond, steps, ver, requests, results, stop, max_lag, tokenizer,
                             dict(generate_kwargs), str(device), threads or torch.get_num_threads(), seed,
                             None if episodes is None else dict(episodes)))
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
                draw_seed(rng)
            while sent <= t + handle.max_lag:
                rows = next(rows_iter, None)
                if rows is None:
                    break
                pending[sent] = rows
                handle.requests.put((sent, rows, draw_seed(rng)))
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
                is_clip: float | None) -> tuple[TrainState, TensorDict]:
    start = time.time()
    rows, rollout, timing = item
    state, metrics = learn_off_policy(state, rows, rollout.to(config.device), config=config, tokenizer=tokenizer,
                                      reward_fn=reward_fn, is_clip=is_clip)
    push_weights(handle, state.model("policy"), steps_done=state.step + 1, version=state.policy_version)
    handle.learner_rng = state.rng
    handle.learner_spans.append((start, time.time()))
    return state, metrics.update({k: torch.tensor(v, dtype=torch.float64) for k, v in timing.items()})


def train_async(config: Any, *, max_lag: int = 1, is_clip: float | None = None, reward_fn=None,
                callbacks: Sequence[Callable] = (), start_method: str = "spawn",
                generator_device: str | None = None,
                generator_threads: int | None = None) -> tuple[TrainState, list[dict[str, float]]]:
    """Train an online recipe asynchronously: generation in its own process, ``max_lag`` updates behind.

    The run is the recipe's (its own state builder, e.g. PPO's critic and KL controller; the
    data, evaluation, checkpoints, logs and resume of ``loops.online.train_online``), with the
    step split between the generator (``generate_rollout`` on a copy of the policy) and the
    learner (``loops.scale.async_learners.learn_off_policy``: scoring, then the recipe's ``learn``).

    Args:
        config: the recipe's ``Config`` (``loops.recipes.grpo`` / ``rloo`` / ``ppo`` / ``online_dpo``): its type
            names the recipe in ``loops.recipes.RECIPES`` (``async_learners.online_recipe``).
        max_lag: ``N``: rollouts come from a policy at most ``N`` updates old; 0 is synchronous.
        is_clip: ``C > 0`` of the truncated importance correction, or ``None`` (off); a
            ``ValueError`` for a learner whose loss has no ratio (online DPO).
        start_method, generator_device, generator_threads: the generator process's (see
            :func:`generator_process`; device default ``config.device``, threads default the
            learner's). On a CPU, give the two processes disjoint cores (e.g. 1 + 1 on 2 cores):
            oversubscribed, they slow each other down more than the overlap gains.
    Returns:
        ``(state, history)`` as the recipe's ``train``; history rows carry the ``async/*`` metrics.
    """
    recipe = check_learner(config, is_clip)
    check_max_lag(max_lag)
    state, tokenizer = recipe.build_state(config)
    if config.run_dir and config.resume:  # resume before the generator copies the weights
        state = resume(config.run_dir, state)
    train_ds, eval_ds = load_splits(config, task_dataset)
    reward = make_reward_fn(config, reward_fn)
    episodes = agent_settings(config)
    env = episode_player(episodes)[0]
    state = dataclasses.replace(state, reward_fn=reward, env=env)  # built once: training and evaluation use them
    check_prompt_data(reward, train=train_ds, held_out=eval_ds)
    check_prompt_lengths(config, tokenizer, state.model("policy"), train=train_ds, held_out=eval_ds)
    with generator_process(state.model("policy"), tokenizer, max_lag=max_lag, steps_done=state.step,
                           version=state.policy_version,
                           generate_kwargs=generate_kwargs(config, max_prompt_length=config.max_prompt_length),
                           start_method=start_method, device=_generator_device(generator_device or config.device),
                           threads=generator_threads, seed=config.seed, episodes=episodes) as handle:
        step = functools.partial(_async_step, handle=handle, config=config, tokenizer=tokenizer, reward_fn=reward,
                                 is_clip=is_clip)
        eval_fn = functools.partial(evaluate_policy, config=config, tokenizer=tokenizer, dataset=eval_ds,
                                    reference_cache=None if getattr(config, "sync_ref_model", False) else {})
        # each rank's generator samples for its own block of every batch's prompts
        source = rollout_source(handle, shard_source(prompt_source(train_ds, config)), state.rng)
        return run(step, state, source, config=config, num_steps=config.steps, restored=bool(config.resume),
                   eval_fn=eval_fn, name=f"async-{recipe.name}", callbacks=callbacks,
                   save_models=reference_models(config), sharded=True)
