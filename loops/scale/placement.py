"""Placement on Ray (the ``rlcore[ray]`` extra): generator, reward scorer and learner as actors.

An online recipe (GRPO, RLOO, PPO, online DPO: ``async_learners.online_recipe``) split over three Ray
actors that call the plain functions of the single-process loop::

    generator  a copy of the policy    generate_or_play(rows, seed, policy_version)  (loops.online:
               (and the environment)   a rollout, or with an environment its episodes)
    scorer     reference, reward model, workers.compute_log_probs(model="ref"),
               reward function          workers.compute_rewards                       (loops.scale.workers)
    learner    the recipe's TrainState  async_learners.learn_off_policy on the scored rollout
               (policy, critic, AdamW)  (score_samples with the models it holds, then the
                                        recipe's own learn); then the policy's CPU state_dict
                                        goes to the generator through the object store
                                        (WeightPush)

The fold itself (``loops.recipe.run``: checkpoints, JSONL logs, evaluation, resume) runs inside
the learner, which holds the state it threads. For item ``t`` the learner submits
``scorer.score(generator.generate(rows_t, seed_t), rows_t)``: the rollout goes from the generator
to the scorer to the learner as an object reference, never through the driver. Ray runs the calls
one caller makes on one actor in the order they were made, so with ``max_lag = N`` the learner
submits item ``t + N`` right after pushing the weights of step ``t − 1``: a rollout is at most
``N`` updates old. ``N = 0`` is the synchronous recipe, ``N = 1`` overlaps the generation of
batch ``t+1`` with the update on batch ``t`` (as ``loops.scale.async_rl``).

Which models sit where: the scorer holds the reward model and adds the reference log-probs of
the rollout when the recipe scores them there (its ``Recipe.rollout_ref_logprobs``: GRPO with a KL
term, RLOO, PPO); a recipe whose ``learn`` runs the reference itself (``Recipe.learn_uses_ref``:
online DPO, whose pairs get theirs in ``learn``) keeps its reference in the learner. PPO's critic stays with the learner, which
computes the values with its current weights (``score_samples`` scores with the models the learner's state holds).

Weights: each push is checked (``ray.get``) just before the next one and at the end of the run
(:class:`WeightPush`), so an error in the generator's ``set_weights`` fails the learner's run
within one step instead of being lost.

Determinism: sampling seeds are drawn in item order from a copy of the learner's ``state.rng``,
and the learner replays that draw (``online.score_samples``), the draws the synchronous
``online.sample`` makes. With ``max_lag=0``, one minibatch per step (``update`` then never
shuffles with ``state.rng``) and the same threads per process, a placed run ends with the very
parameters as the recipe's ``train(config)`` (``loops.recipes.grpo``, ``loops.recipes.rloo``, ...).

Ray is imported inside the functions: this module imports without it and
:func:`require_ray` names the install (``pip install "rlcore[ray]"``).

References:
    Moritz et al., "Ray: A Distributed Framework for Emerging AI Applications",
    https://arxiv.org/abs/1712.05889; Noukhovitch et al., "Asynchronous RLHF",
    https://arxiv.org/abs/2410.18252
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, cast

import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn

from rlcore.loops.scale.async_learners import check_learner, learn_off_policy
from rlcore.loops.scale.async_rl import agent_settings, check_max_lag, episode_player
from rlcore.loops.checkpoint import resume
from rlcore.loops.collect import draw_seed
from rlcore.loops.dist import gathered, is_fsdp2, is_main, shard_source
from rlcore.loops.models import disable_dropout
from rlcore.loops.online import build_online_state, generate_kwargs, generate_or_play, prompt_source
from rlcore.loops.reward_fns import make_reward_fn, repeat_columns, repeat_prompts, reward_settings
from rlcore.loops.evaluate import evaluate_policy
from rlcore.loops.recipe import build_policy, load_splits, run, whole_copy
from rlcore.loops.state import TrainState, copy_generator
from rlcore.loops.tasks import task_dataset
from rlcore.loops.scale.workers import compute_log_probs, compute_rewards
from rlcore.seeding import set_seed

__all__ = ["RAY_INSTALL", "ROLES", "require_ray", "cpu_state_dict", "WeightPush", "GeneratorWorker",
           "ScorerWorker", "LearnerWorker", "placed_source", "train_placed"]

RAY_INSTALL = 'pip install "rlcore[ray]"'
ROLES = ("generator", "scorer", "learner")


def require_ray():
    """The ``ray`` module, or an ``ImportError`` saying how to install it."""
    try:
        import ray
    except ImportError as e:
        raise ImportError(f"rlcore.loops.scale.placement runs on Ray, which is not installed: {RAY_INSTALL}") from e
    return ray


def cpu_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s parameters and buffers as detached CPU tensors (what travels to the generator); an
    FSDP2 model's gathered one tensor at a time (a collective: every learner rank calls it)."""
    return {k: gathered(v).detach().to("cpu")
            for k, v in model.state_dict().items()}


def _set_threads(threads: int | None) -> None:
    if threads:
        torch.set_num_threads(threads)


class WeightPush:
    """The learner's pushes of its weights to the generator actor, each checked one push later.

    ``push`` first waits for the previous push (``ray.get``: an error raised in the generator's
    ``set_weights`` is raised here, within one step), then submits the new one and keeps its
    ``ObjectRef``; ``wait`` waits for the last one (at the end of the run).
    """

    def __init__(self, ray, generator):
        self.ray, self.generator, self.pending = ray, generator, None

    def wait(self) -> float:
        """Wait for the pending push, if any (raising its error); the seconds waited."""
        start, pending, self.pending = time.time(), self.pending, None
        if pending is not None:
            self.ray.get(pending)
        return time.time() - start

    def push(self, model: nn.Module, version: int) -> float:
        """``wait``, then submit ``generator.set_weights(cpu_state_dict(model), version)``; the seconds waited."""
        waited = self.wait()
        self.pending = self.generator.set_weights.remote(self.ray.put(cpu_state_dict(model)), version)
        return waited


# --- the actors: thin holders of state calling the plain functions ----------------------------------
class GeneratorWorker:
    """Holds a copy of the policy (and the run's environment, if any); generates rollouts, or plays
    episodes, stamped with the version of its weights."""

    def __init__(self, config: Any, *, threads: int | None = None):
        _set_threads(threads)
        set_seed(config.seed)  # its global generators, as the async generator process's
        self.policy, self.tokenizer = build_policy(config)
        disable_dropout(self.policy)
        self.version = 0
        self.kwargs = generate_kwargs(config, max_prompt_length=config.max_prompt_length)
        self.env, self.turns = episode_player(agent_settings(config))  # resolved here, on the actor's node

    def set_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> int:
        """Load the learner's weights (a CPU ``state_dict``) as policy version ``version``."""
        self.policy.load_state_dict(state_dict)
        self.version = version
        return version

    def generate(self, rows: Mapping[str, Sequence], seed: int) -> TensorDict:
        """``G`` samples per prompt of ``rows`` with ``seed`` (``online.generate_or_play``: with an
        environment, ``G`` episodes per row); the rollout on the CPU."""
        return generate_or_play(self.policy, self.tokenizer, rows, seed=seed, policy_version=self.version,
                                generate=self.kwargs, env=self.env, turns=self.turns).to("cpu")


class ScorerWorker:
    """Holds the frozen reference (and reward model) and the reward function; also evaluates."""

    def __init__(self, config: Any, *, reward_fn: Callable | None = None, threads: int | None = None):
        _set_threads(threads)
        set_seed(config.seed)  # the reward function's global generators, as a run seeds its own
        state, self.tokenizer = build_online_state(config)  # policy (for evaluation), ref, reward
        self.reward_fn = make_reward_fn(config, reward_fn)  # built once: scoring and evaluation use it
        self.state = TrainState(models=state.models, reward_fn=self.reward_fn)
        self.config = config
        self.eval_ds = None
        self.reference_cache = None if getattr(config, "sync_ref_model", False) else {}  # a frozen reference

    def score(self, rollout: TensorDictBase, rows: Mapping[str, Sequence], *, reference: bool = True) -> TensorDict:
        """``ref_logprobs [B, R]`` (with ``reference``) then ``score [B]`` (reward model and/or function)."""
        c = self.config
        rollout = rollout.to(c.device)
        if reference:
            _, rollout = compute_log_probs(self.state, rollout, model="ref", temperature=c.temperature)
        _, rollout = compute_rewards(self.state, rollout, reward_fn=self.reward_fn, tokenizer=self.tokenizer,
                                     prompts=repeat_prompts(rows, c.num_samples),
                                     reward_columns=repeat_columns(rows, c.num_samples), **reward_settings(c))
        return rollout.to("cpu")

    def evaluate(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, float]:
        """``evaluate_policy`` of the learner's weights on the held-out split."""
        self.state.model("policy").load_state_dict(state_dict)
        if self.eval_ds is None:
            self.eval_ds = load_splits(self.config, task_dataset)[1]
        return evaluate_policy(self.state, self.config, tokenizer=self.tokenizer, dataset=self.eval_ds,
                               reference_cache=self.reference_cache)  # scores with self.state.reward_fn


def placed_source(generator, scorer, prompts: Callable[[int], Any], seeds: torch.Generator, *, max_lag: int,
                  reference: bool = True) -> Callable[[int], Iterator]:
    """A resumable fold source of ``(rows, scored rollout ref)``, at most ``max_lag`` items ahead.

    Before yielding item ``t`` it has submitted ``scorer.score(generator.generate(rows_i, seed_i),
    rows_i, reference=)`` for every ``i ≤ t + max_lag``, seeds drawn in item order from a copy of
    ``seeds`` (actor handles in, object references out: nothing waits here).
    """
    def start_at(start: int) -> Iterator:
        rng = copy_generator(seeds)
        rows_iter, pending, sent = iter(prompts(start)), {}, start
        for t in itertools.count(start):
            while sent <= t + max_lag:
                rows = next(rows_iter, None)
                if rows is None:
                    break
                rollout = generator.generate.remote(dict(rows), draw_seed(rng))
                pending[sent] = (rows, scorer.score.remote(rollout, rows, reference=reference))
                sent += 1
            if t not in pending:
                return
            yield pending.pop(t)
    return start_at


def _placed_step(state: TrainState, item: tuple, *, weights: WeightPush, config: Any, tokenizer,
                 is_clip: float | None) -> tuple[TrainState, TensorDict]:
    rows, ref = item
    start = time.time()
    rollout = weights.ray.get(ref)
    wait = time.time() - start
    state, metrics = learn_off_policy(state, rows, rollout.to(config.device), config=config, tokenizer=tokenizer,
                                      is_clip=is_clip)
    push_wait = weights.push(state.model("policy"), state.policy_version)
    return state, metrics.update({"placed/wait_s": torch.tensor(wait, dtype=torch.float64),
                                  "placed/push_wait_s": torch.tensor(push_wait, dtype=torch.float64)})


class LearnerWorker:
    """Holds the ``TrainState`` (policy, optimiser, schedule, counters, rng) and runs the fold; one
    rank of the learners' process group when there are several (:meth:`join` first)."""

    def __init__(self, config: Any, *, is_clip: float | None = None, threads: int | None = None):
        _set_threads(threads)
        self.config, self.is_clip = config, is_clip
        self.recipe = check_learner(config, is_clip)
        self.state: TrainState | None = None

    def rendezvous(self) -> tuple[str, int]:
        """``(address, port)`` of this actor's node and a port free on it: rank 0's, for the group."""
        import socket

        from rlcore.loops.dist import free_port

        return socket.gethostbyname(socket.gethostname()), free_port()

    def join(self, rank: int = 0, world_size: int = 1, address: str | None = None, port: int | None = None) -> int:
        """Join the learners' process group as ``rank`` of ``world_size`` (the ``torchrun`` variables,
        ``LOCAL_RANK`` 0: an actor sees only the GPUs Ray gave it), then build the state (sharded as
        ``config.strategy`` says) and resume it. Every learner calls it at once."""
        if world_size > 1:
            from rlcore.loops.dist import init_distributed

            os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0",
                              LOCAL_WORLD_SIZE="1", MASTER_ADDR=str(address), MASTER_PORT=str(port))
            init_distributed()
        config = self.config
        state, self.tokenizer = self.recipe.build_state(config)
        if config.run_dir and config.resume:  # before the first weights go to the generator
            state = resume(config.run_dir, state)
        # the scorer holds the reward model, and the reference unless learn needs it here
        self.reference = self.recipe.rollout_ref_logprobs(config)
        moved = ("reward",) if self.recipe.learn_uses_ref else ("reward", "ref")
        self.state = dataclasses.replace(state, models={k: v for k, v in state.models.items() if k not in moved})
        return rank

    def train(self, generator, scorer, *, max_lag: int,
              callbacks: Sequence[Callable] = ()) -> tuple[TrainState, list[dict[str, float]]]:
        """``run`` over the prompt batches, each step on the scored rollout of its item."""
        ray = require_ray()
        config, state = self.config, self.state
        if state is None:
            raise RuntimeError("LearnerWorker.train: call join() first (it builds the state)")
        weights = WeightPush(ray, generator)
        weights.push(state.model("policy"), state.policy_version)
        weights.wait()  # the first weights are in place before any generation
        step = functools.partial(_placed_step, weights=weights, config=config, tokenizer=self.tokenizer,
                                 is_clip=self.is_clip)
        # each learner rank's generator samples for its own block of every batch's prompts
        prompts = shard_source(prompt_source(load_splits(config, task_dataset)[0], config))
        source = placed_source(generator, scorer, prompts, state.rng, max_lag=max_lag, reference=self.reference)

        def eval_fn(s: TrainState) -> dict[str, float]:
            return ray.get(scorer.evaluate.remote(cpu_state_dict(s.model("policy"))))

        self.state, history = run(step, state, source, config=config, restored=bool(config.resume),
                                  num_steps=config.steps, eval_fn=eval_fn, name=f"placed-{self.recipe.name}",
                                  callbacks=callbacks, sharded=True)
        weights.wait()  # the last push: its error fails the run too
        return self._returned(), history

    def _returned(self) -> TrainState | None:
        """The state the driver gets: this learner's, or with sharded learners rank 0's with each
        FSDP2 model gathered whole onto the CPU (``whole_copy``: a collective, every rank calls it) and
        no optimiser or schedule (their state stays sharded in the learners and their checkpoints);
        ``None`` on the other ranks."""
        state = cast(TrainState, self.state)
        if not any(is_fsdp2(m) for m in state.models.values()):
            return state if is_main() else None
        models = {name: whole_copy(m, "cpu") if is_fsdp2(m) else m for name, m in state.models.items()}
        return dataclasses.replace(state, models=models, optimizer=None, scheduler=None) if is_main() else None


# --- the driver -------------------------------------------------------------------------------------
def _per_role(value: float | Mapping[str, float], name: str) -> dict[str, float]:
    if not isinstance(value, Mapping):
        return dict.fromkeys(ROLES, value)
    if set(value) != set(ROLES):
        raise ValueError(f"{name}: expected a number or a mapping of every role {list(ROLES)}, got keys "
                         f"{sorted(value)}")
    return dict(value)


def train_placed(config: Any, *, max_lag: int = 0, is_clip: float | None = None,
                 reward_fn: Callable | None = None, callbacks: Sequence[Callable] = (),
                 num_cpus: float | Mapping[str, float] = 0.5, num_gpus: float | Mapping[str, float] = 0,
                 threads: int | None = None, address: str | None = None,
                 learners: int = 1) -> tuple[TrainState, list[dict[str, float]]]:
    """Train an online recipe with the generator, scorer and learner placed as Ray actors.

    Starts the three actors (named ``rlcore-<role>-<id>``), runs the learner's fold (see the
    module doc) and kills the actors on every exit, exception or not. Uses the running Ray
    instance, else starts one with ``ray.init(address=address)`` and shuts it down at the end.

    Args:
        config: the recipe's ``Config`` (``loops.recipes.grpo`` / ``rloo`` / ``ppo`` / ``online_dpo``); a relative
            ``run_dir`` is made absolute here (the learner writes it, on its node).
        max_lag: ``N ≥ 0``: rollouts come from a policy at most ``N`` updates old; 0 is synchronous.
        is_clip: ``C`` of the truncated importance correction (``async_learners.learn_off_policy``), or ``None``.
        reward_fn: overrides the task reward (runs in the scorer: it must pickle).
        callbacks: extra fold callbacks; they run in the learner (they must pickle).
        num_cpus, num_gpus: Ray resources per actor, one number or a mapping of every role in
            ``ROLES``. ``config.device`` is where each actor puts its models.
        threads: ``torch.set_num_threads`` in each actor (default: Ray's, from ``num_cpus``).
        address: for ``ray.init`` when Ray is not running (``"auto"``: join the local cluster).
        learners: learner ranks ``W``: ``W`` learner actors form one ``torch.distributed`` group
            (rank 0's node and a free port its rendezvous; gloo, or NCCL on GPUs), each with its
            own generator and scorer and its own block of every batch's prompts, as ``torchrun``
            ranks of the synchronous recipe; ``config.strategy`` places the learners' models
            (``fsdp2``: sharded over them; each generator and scorer holds whole copies, the
            weights pushed one gathered tensor at a time). ``batch_size`` a multiple of ``W``.
    Returns:
        ``(state, history)`` as the recipe's ``train``: the learner's final ``TrainState`` (policy,
        optimiser, counters; no reference; of sharded learners, rank 0's with the models gathered
        whole and no optimiser) and one row of metrics per step, with ``async/*``
        (staleness, behaviour-vs-learner gap), ``placed/wait_s`` (the learner waiting for a
        scored rollout) and ``placed/push_wait_s`` (waiting for the previous weight push).
    """
    check_learner(config, is_clip)
    check_max_lag(max_lag)
    if isinstance(learners, bool) or not isinstance(learners, int) or learners < 1:
        raise ValueError(f"learners: expected a positive int, got {learners!r}")
    if config.batch_size % learners:
        raise ValueError(f"batch_size: each of the {learners} learners takes an equal block of every batch's prompts; "
                         f"expected a multiple of {learners}, got {config.batch_size}")
    cpus, gpus = _per_role(num_cpus, "num_cpus"), _per_role(num_gpus, "num_gpus")
    ray = require_ray()
    if config.run_dir:
        config = dataclasses.replace(config, run_dir=os.path.abspath(config.run_dir))
    started = not ray.is_initialized()
    if started:
        ray.init(address=address)
    tag, actors = uuid.uuid4().hex[:8], []

    def place(cls: type, role: str, rank: int, *args, **kwargs):
        remote = ray.remote(num_cpus=cpus[role], num_gpus=gpus[role])(cls)
        name = f"rlcore-{role}-{tag}" + (f"-{rank}" if learners > 1 else "")
        actors.append(remote.options(name=name).remote(*args, threads=threads, **kwargs))
        return actors[-1]

    try:
        ranks = range(learners)
        generators = [place(GeneratorWorker, "generator", r, config) for r in ranks]
        scorers = [place(ScorerWorker, "scorer", r, config, reward_fn=reward_fn) for r in ranks]
        learner_actors = [place(LearnerWorker, "learner", r, config, is_clip=is_clip) for r in ranks]
        address, port = ray.get(learner_actors[0].rendezvous.remote()) if learners > 1 else (None, None)
        ray.get([a.join.remote(r, learners, address, port) for r, a in enumerate(learner_actors)])
        runs = [a.train.remote(g, s, max_lag=max_lag, callbacks=tuple(callbacks))
                for a, g, s in zip(learner_actors, generators, scorers)]
        return ray.get(runs)[0]  # rank 0's state and history (the ranks log the same metrics)
    finally:
        for actor in actors:
            ray.kill(actor, no_restart=True)
        if started:
            ray.shutdown()
