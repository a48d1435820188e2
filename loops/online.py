"""The pieces shared by the online recipes (PPO, RLOO, GRPO, online DPO): prompts → rollout → scores.

Every online recipe's ``step`` is written out in its module: ``sample → score_samples → (rewards,
advantages) → update(state, batch, loss_fn)``, the loss closure written where it is used. What
differs is the middle (KL in the reward or in the loss, GAE or a group baseline, preference pairs)
and the loss; the pieces that are the same live here, each taking the section it needs:

- :class:`OnlineConfig`: the sections every online recipe has (``loops.settings``: model, data,
  optimiser, run, reference, rewards, generation, rollout updates); a recipe's ``Config`` adds its
  algorithm's (still flat: one ``--flag`` per field);
- :func:`build_online_state`: policy + frozen reference (+ frozen reward model, + the recipe's own
  models such as a critic), AdamW, schedule, transform states;
- :func:`prompt_source`: a resumable stream of prompt batches (dicts of dataset columns);
- :func:`sample`: the step's one seed draw from ``state.rng`` (``loops.collect.draw_seed``) and ``G``
  samples per prompt from the policy (:func:`generate_kwargs` of a generation section);
- :func:`score_samples`: reference log-probs, optional values, the reward (functions and / or a
  reward model) with the generation section's penalties, and the counters (a rollout generated
  elsewhere: :func:`replay_seed_draw` first);
- :func:`with_policy_logprobs`: the policy's log-probs of a batch's responses, the first line of
  every policy-gradient loss closure;
- :func:`advantage_fn`: the estimator a config names, its keywords checked;
- ``loops.evaluate.evaluate_policy``: held-out mean reward and exact match (greedy) and KL to the
  reference (sampled);
- :func:`train_online`: build, wire :func:`rlcore.loops.recipe.run`, return ``(state, history)``.

Randomness: generation draws its seed from a copy of ``state.rng`` that the returned state
carries on (the input state's generator is untouched), so a resumed run samples exactly the
responses of an uninterrupted one. Evaluation uses a fixed seed and never touches ``state.rng``
or the global RNG, so evaluating does not change training.

Rewards: ``reward_fn`` (a Python function called as TRL calls one, every argument by keyword:
``fn(prompts=, completions=, completion_ids=, trainer_state=, **columns) -> scores``, described in
``loops.reward_fns``; by default ``loops.tasks.task_reward(config.task)``, which reads the
``answer`` column) or, with
``config.reward_model``, a sequence-classification reward model sharing the policy's tokenizer
(``loops.models.reward_model_scores``); with both, their sum. Each reward function call may take
``config.reward_timeout`` seconds; a NaN or infinite score from either source is refused naming
the rows, or with ``nonfinite_rewards: drop`` leaves training as an unscored sample
(``loops.reward_fns.check_finite_scores``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from datasets import Dataset
from tensordict import TensorDict, TensorDictBase
from torch import nn

from rlcore import keys as K
from rlcore.algorithms.ratios import ENGINE_IS_MODES, engine_importance_weights
from rlcore.baselines import ADVANTAGE_ESTIMATORS
from rlcore.checks import bind_keywords, lookup
from rlcore.kl import KL_ALIASES, KL_ESTIMATORS, kl_estimate
from rlcore.loops.chunks import generate_in_chunks
from rlcore.loops.collect import draw_seed
from rlcore.loops.data import row_origin
from rlcore.loops.envs import EnvFactory, resolve_env
from rlcore.loops.episodes import sample_episodes
from rlcore.loops.config import RunConfig, autocast_dtype, loading_kwargs
from rlcore.loops.settings import (AgentSettings, GenerationSettings, PackingSettings, ReferenceSettings,
                                   RewardSettings, RolloutSettings)
from rlcore.loops.filters import exclude_unscored, prompt_refill
from rlcore.loops.tokenization import check_context, check_text, model_context, text_window, tokenize_example
from rlcore.loops.evaluate import evaluate_policy
from rlcore.loops.models import ValueHead, disable_dropout, load_model, token_values
from rlcore.loops.recipe import batch_source, build_policy, build_reference, init_train_state, load_splits, run
from rlcore.loops.reward_fns import (RewardFn, make_reward_fn, missing_eos_penalty, repeat_columns, repeat_prompts,
                                     reward_columns, reward_settings, trainer_state)
from rlcore.loops.score import packed_logprobs, score_rollout, sequences, token_logprobs_from_model
from rlcore.loops.state import TrainState, advance, copy_generator, with_transforms
from rlcore.loops.tasks import task_dataset
from rlcore.masked import masked_mean, zero_outside
from rlcore.rewards import soft_overlong_penalty
from rlcore.transforms import observed_kl

__all__ = ["OnlineConfig", "Correction", "ESTIMATOR_NEEDS", "check_kl_name", "runnable_estimators", "advantage_fn",
           "check_prompt_data", "check_prompt_lengths", "build_online_state", "prompt_source", "update_sizes",
           "generate_kwargs", "episode_kwargs", "generate_or_play", "sample", "replay_seed_draw", "critic_values",
           "score_samples", "with_policy_logprobs", "check_engine_correction", "engine_correction", "rollout_metrics", "group_metrics", "length_metrics", "reward_term_metrics", "LIVE", "train_online"]

# the asynchronous learners' importance correction: a batch with advantages -> (the batch the loss sees, metrics)
Correction = Callable[[TensorDictBase], tuple[TensorDictBase, dict]]


@dataclasses.dataclass(frozen=True)
class OnlineConfig(RolloutSettings, PackingSettings, AgentSettings, GenerationSettings, RewardSettings,
                   ReferenceSettings, RunConfig, defaults={"batch_size": 8, "lr": 1e-5}):
    """The sections every online recipe has beyond ``RunConfig``'s: the reference, the rewards,
    generation and how a rollout is learned from (``loops.settings``); ``batch_size`` counts prompts
    (the rollout has ``batch_size × num_samples`` rows). A recipe's ``Config`` adds its algorithm's."""

    def __post_init__(self):
        super().__post_init__()  # a single name given to a tuple field is a one-item tuple (coerce_tuples)
        self.check()  # a Config that exists is one the recipe can run

    def check(self) -> None:
        """Raise on a setting the recipe cannot run, naming the field, before any model is built
        (run when the config is made); a recipe's ``Config`` adds its own checks here."""


# --- building -----------------------------------------------------------------------------------


def _row(data: Dataset, i: int, split: str) -> str:
    """``dataset: <file>, line <n>`` for a row read from a file (``loops.data.row_origin``), else
    ``dataset: the <split> split, row <i>``."""
    return f"dataset: {row_origin(data, i) or f'the {split} split, row {i}'}"


def check_prompt_data(reward: RewardFn | None, **splits: Dataset) -> None:
    """Fail before training when a prompt dataset cannot feed the run: every split needs a ``prompt``
    column, and the columns the reward function reads (``reward_columns``: ``answer`` for the
    built-in task reward), and every prompt must be non-empty text or a conversation
    (``loops.tokenization.check_text``). A null in a column the reward function requires (a
    parameter without a default, e.g. the task reward's ``answer``) is refused too: it would be
    graded as a wrong answer; give the parameter a default to take rows without one. The error
    names the split, its columns and what is missing, or the row (its file and line when read from
    a file) and what it holds."""
    needed = reward_columns(reward) if reward is not None else ()
    wanted = ("prompt", *needed)
    reader = getattr(reward, "__name__", "the reward function")
    for where, data in splits.items():
        missing = [c for c in wanted if c not in data.column_names]
        if missing:
            raise ValueError(f"dataset: the {where} split has columns {data.column_names} but the run needs {missing} "
                             f"('prompt' to generate from; the others are read by {reader}); add them, or pass a "
                             "reward function (reward_funcs) or a reward_model that needs no answer")
        for i, prompt in enumerate(data["prompt"]):
            check_text("prompt", prompt, _row(data, i, where))
            if not prompt:
                raise ValueError(f"{_row(data, i, where)}: empty prompt (generation needs at least one prompt token)")
        for column in needed:
            for i, value in enumerate(data[column]):
                if value is None:
                    raise ValueError(f"{_row(data, i, where)}: column {column!r} is null, and {reader} requires it "
                                     "(a row without it would be graded as wrong); fill it or drop the row")


def check_prompt_lengths(config: Any, tokenizer, model: nn.Module, **splits: Dataset) -> None:
    """Refuse, before the first step, a prompt that with the response budget (``max_new_tokens``, or
    the longest ``length_sampler`` draw) runs past ``model``'s context (``max_position_embeddings``),
    once cut to ``max_prompt_length``: the error names the split, the row and the lengths. Each
    prompt is tokenised through ``text_window`` (memory bounded by the context, whatever its size)."""
    context = model_context(model)
    if context is None:
        return
    sampler = getattr(config, "length_sampler", None)
    budget = max(config.max_new_tokens, sampler[1] - 1 if sampler else 0)
    room = context - budget
    if room < 1:
        raise ValueError(f"max_new_tokens: a response budget of {budget} tokens leaves no room for a prompt in the "
                         f"model's context of {context} (max_position_embeddings)")
    for where, data in splits.items():
        for i, prompt in enumerate(data["prompt"]):
            ids = tokenize_example({"prompt": text_window(prompt, tokenizer, context, "keep_end")}, tokenizer,
                                   format="prompt_only", max_prompt_length=config.max_prompt_length,
                                   where=_row(data, i, where))["prompt_ids"]
            check_context(model, len(ids) + budget, f"{_row(data, i, where)}: its prompt has {len(ids)} tokens, "
                          f"which with a response budget of {budget}",
                          f"set max_prompt_length <= {room} to keep each prompt's last tokens, or drop the row")


def build_online_state(config: Any, *, extra_models: Callable[[nn.Module], Mapping[str, nn.Module]] | None = None,
                       trainable: Sequence[str] = ("policy",), transforms: Mapping[str, Any] | None = None,
                       rows_per_step: int | None = None) -> tuple[TrainState, Any]:
    """``(state, tokenizer)``: policy, frozen reference copy, optional frozen reward model, extra models.

    ``state.models``: ``policy`` (``build_policy(config)``), ``ref`` (``build_reference``: a copy of the policy, or ``ref_model``,
    frozen, rebuilt rather than checkpointed), ``reward`` when ``config.reward_model`` (loaded
    with ``load_model(task="reward")``, frozen) and ``extra_models(policy)`` (e.g. a critic);
    dropout off in all of them (``disable_dropout``: a loaded model may have it on).
    AdamW over the ``trainable`` models; the schedule spans ``steps × epochs × ⌈rows/minibatch⌉``
    optimiser steps with ``rows = rows_per_step`` (default ``batch_size × num_samples``).
    """
    policy, tokenizer = build_policy(config)
    models = {"policy": policy, "ref": build_reference(config, policy)}
    if config.reward_model:
        loading = {k: v for k, v in loading_kwargs(config).items() if k != "revision"}  # the revision is `model`'s
        models["reward"] = load_model(config.reward_model, task="reward", **loading).to(
            config.reward_device or config.device).eval()
        models["reward"].requires_grad_(False)
        if models["reward"].config.pad_token_id is None:  # its own forward pools by pad id (a sharded one runs it)
            models["reward"].config.pad_token_id = tokenizer.pad_token_id
    models.update(extra_models(policy) if extra_models is not None else {})
    for model in models.values():
        disable_dropout(model)  # RL needs the same log-probs in collect, score and update
    rows = rows_per_step or config.batch_size * config.num_samples
    sizes = update_sizes(rows, minibatch_size=config.minibatch_size, micro_batch_size=config.micro_batch_size)
    per_step = config.epochs * math.ceil(rows / sizes["minibatch_size"])
    state = init_train_state(models, config, trainable=trainable, total_steps=config.steps * per_step)
    return with_transforms(state, **(transforms or {})), tokenizer


def prompt_source(dataset: Dataset, config: Any) -> Callable[[int], Any]:
    """A resumable fold source of prompt batches: dicts of columns (``prompt``, ``answer``, ...)
    of ``config.batch_size`` rows, reshuffled every epoch with ``config.seed``."""
    return batch_source(dataset, config.batch_size, dict, seed=config.seed)


def update_sizes(rows: int, *, minibatch_size: int | None, micro_batch_size: int | None) -> dict[str, int]:
    """``minibatch_size`` / ``micro_batch_size`` for ``update`` on ``rows`` rows: the given ones capped
    at ``rows`` (``None``: all rows), so a short rollout (few pairs, a small last batch) still fits."""
    minibatch = min(minibatch_size or rows, rows)
    return {"minibatch_size": minibatch, "micro_batch_size": min(micro_batch_size or minibatch, minibatch)}


# --- collect and score ---------------------------------------------------------------------------
def generate_kwargs(generation: GenerationSettings, *, max_prompt_length: int | None) -> dict[str, Any]:
    """The sampling keywords of ``generate_in_chunks`` for a generation section (everything but prompts,
    seed and version): ``max_new_tokens``, ``temperature``, ``top_k``, ``top_p``, ``num_samples``,
    ``engine``, ``sampler``, ``engine_options``, ``stop_token_ids``, ``length_sampler``, ``rows_per_call``
    (``generation_batch_size``), and the data's ``max_prompt_length``. The synchronous recipes
    (:func:`sample`), the generator process of ``loops.scale.async_rl`` and the generator actor of
    ``loops.scale.placement`` all sample with these."""
    g = generation
    return dict(max_new_tokens=g.max_new_tokens, temperature=g.temperature, top_k=g.top_k, top_p=g.top_p,
                num_samples=g.num_samples, max_prompt_length=max_prompt_length, engine=g.engine, sampler=g.sampler,
                engine_options=g.engine_options, stop_token_ids=tuple(g.stop_token_ids),
                length_sampler=g.length_sampler, rows_per_call=g.generation_batch_size)


def sample(state: TrainState, rows: Mapping[str, Sequence], *, generation: GenerationSettings, tokenizer,
           max_prompt_length: int | None, agent: AgentSettings | None,
           num_samples: int | None = None) -> tuple[TrainState, TensorDict]:
    """``G`` responses (or, with an environment, episodes) per prompt from the state's policy:
    ``(state, rollout)``.

    The step's one seed draw (``draw_seed`` on a copy of ``state.rng``, which the returned state
    carries on), then ``generate_in_chunks(policy, ..., seed=)`` with :func:`generate_kwargs`; with
    ``state.env`` (the run's environment factory) ``loops.episodes.sample_episodes`` instead, each
    turn sampled as generation samples a response, for ``agent.max_turns`` turns and
    ``agent.max_episode_tokens`` tokens. Behaviour log-probs (``old_logprobs``) come from generation itself.

    Args:
        rows: ``P`` rows of columns with ``prompt`` (text or conversations; an environment's
            ``reset`` reads the whole row).
        max_prompt_length: the data's (``None``: no limit).  agent: the multi-turn settings
            (``max_turns``, ``max_episode_tokens``, ``reuse_context``) the state's environment is played with.
        num_samples: ``G`` (default ``generation.num_samples``).
    Returns:
        The state with its generator advanced, and the unscored rollout ``[B = P·G]`` (``loops.collect``,
        ``loops.episodes``).
    """
    rng = copy_generator(state.rng)
    seed = draw_seed(rng)
    kwargs = generate_kwargs(generation, max_prompt_length=max_prompt_length)
    if num_samples is not None:
        kwargs["num_samples"] = num_samples
    turns = dict(max_turns=agent.max_turns, max_episode_tokens=agent.max_episode_tokens,
                 reuse_context=agent.reuse_context) if agent else {}
    rollout = generate_or_play(state.model("policy"), tokenizer, rows, seed=seed, policy_version=state.policy_version,
                               generate=kwargs, env=state.env, turns=turns)
    return dataclasses.replace(state, rng=rng), rollout


def generate_or_play(policy: nn.Module, tokenizer, rows: Mapping[str, Sequence], *, seed: int, policy_version: int,
                     generate: Mapping[str, Any], env: Callable | None = None,
                     turns: Mapping[str, Any] | None = None) -> TensorDict:
    """The rollout of ``rows`` with ``seed``: ``generate_in_chunks`` of their prompts with
    :func:`generate_kwargs` ``generate``, or with an environment factory ``env`` its episodes
    (``loops.episodes.sample_episodes``, with ``turns``: ``max_turns``, ``max_episode_tokens``). What
    the synchronous :func:`sample`, the async generator process and the Ray generator actor each run."""
    if env is None:
        return generate_in_chunks(policy, tokenizer, list(rows["prompt"]), **generate, seed=seed,
                                  policy_version=policy_version)
    return sample_episodes(policy, tokenizer, rows, env, seed=seed, policy_version=policy_version,
                           **episode_kwargs(generate), **(turns or {}))


def episode_kwargs(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """:func:`generate_kwargs` as ``loops.episodes.sample_episodes`` takes them: one budget per turn (a
    ``length_sampler`` draw is not made per turn), every episode in one call (no ``rows_per_call``)."""
    return {k: v for k, v in kwargs.items() if k not in ("length_sampler", "rows_per_call")}


def replay_seed_draw(state: TrainState) -> TrainState:
    """``state`` with its generator past one ``draw_seed``: the draw a rollout generated elsewhere
    (``loops.scale.async_rl``'s generator process, ``loops.scale.placement``'s actor) was sampled
    with, so the learner's state goes on as the synchronous :func:`sample` leaves it."""
    rng = copy_generator(state.rng)
    draw_seed(rng)
    return dataclasses.replace(state, rng=rng)


def critic_values(state: TrainState) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """``(input_ids, attention_mask) -> values [B, T]`` of the state's critic ``models["value"]``: a
    ``ValueHead`` on the policy's trunk, or a model of its own (``loops.models.token_values``);
    ``None`` when the state holds no critic."""
    value = state.models.get("value")
    if value is None:
        return None
    if isinstance(value, ValueHead):
        return functools.partial(token_values, state.model("policy"), head=value)
    return functools.partial(token_values, value)


def score_samples(state: TrainState, rows: Mapping[str, Sequence], rollout: TensorDictBase, *,
                  generation: GenerationSettings, rewards: RewardSettings, tokenizer, reward_fn: RewardFn | None,
                  total_steps: int | None, num_samples: int | None = None,
                  reference: bool = True) -> tuple[TrainState, TensorDict]:
    """Score a rollout sampled from ``rows`` and advance the state's counters past those samples.

    ``score_rollout`` with the models the state holds: ``ref_logprobs`` from ``models["ref"]``
    (with ``reference``), ``values`` from a critic (:func:`critic_values`) and ``score`` from the reward
    (``reward_fn`` called as TRL calls one: the batch's prompts as the data holds them, the
    completions in the same shape, their ids, the other dataset columns repeated per sample and a
    ``trainer_state`` at ``state.step`` of ``total_steps``; plus ``models["reward"]``, with the
    ``rewards`` section's timeout and non-finite rule); then the generation section's penalties
    (``missing_eos_penalty``, the soft ``overlong_buffer``) and the counters. The seed draw is the
    caller's: :func:`sample` draws it; a learner scoring a rollout generated elsewhere
    (``loops.scale.async_rl``, ``loops.scale.placement``) first replays it (:func:`replay_seed_draw`),
    and is then left exactly as the synchronous step leaves it. A learner whose state holds no
    reference or reward model (the Ray scorer added those) scores only what it holds.

    Args:
        rows: the prompt batch the rollout was sampled from (``P`` rows of columns).
        rollout: ``[B = P·G]`` from :func:`sample`.
        generation: the temperature of the log-probs, the token budget and stop tokens of the penalties,
            ``forward_batch_size`` rows per no-grad forward.
        reward_fn: ``None`` with no ``state.models["reward"]`` keeps the rollout's ``score`` (if any).
        num_samples: ``G`` (default ``generation.num_samples``).
        reference: whether to add the reference's ``ref_logprobs`` (when the state holds ``models["ref"]``).
    Returns:
        ``(state, rollout)``: the state with ``samples_seen``, ``episodes`` (``+B``) and
        ``tokens_seen`` (``+Σ prompt_mask + Σ response_mask``: prompt and completion tokens, as
        TRL's ``num_tokens`` counts them) advanced (the input state is untouched); a shallow
        copy of the rollout with the scores.
    """
    g = generation
    ref = state.models.get("ref") if reference else None
    G = g.num_samples if num_samples is None else num_samples
    rollout = score_rollout(rollout, ref=ref, value_fn=critic_values(state),
                            reward_fn=reward_fn, reward_model=state.models.get("reward"), tokenizer=tokenizer,
                            prompts=repeat_prompts(rows, G), temperature=g.temperature,
                            reward_columns={**repeat_columns(rows, G),
                                            "trainer_state": trainer_state(state.step, total_steps)},
                            rows_per_forward=g.forward_batch_size, **reward_settings(rewards))
    if g.missing_eos_penalty:  # a response cut at max_new_tokens, with no stop token, loses the penalty
        stops = [tokenizer.eos_token_id, *g.stop_token_ids]
        rollout[K.SCORE] = missing_eos_penalty(rollout[K.SCORE], rollout[K.RESPONSE_IDS], rollout[K.RESPONSE_MASK],
                                               eos_token_id=stops, penalty=g.missing_eos_penalty)
    if g.overlong_buffer:  # DAPO: a response running into the budget is worse, before it is cut
        rollout[K.SCORE] = rollout[K.SCORE] + soft_overlong_penalty(
            rollout[K.RESPONSE_MASK], max_length=g.max_new_tokens, buffer=g.overlong_buffer,
            factor=g.overlong_penalty_factor).to(rollout[K.SCORE])
    tokens = rollout[K.PROMPT_MASK].sum() + rollout[K.RESPONSE_MASK].sum()  # as TRL's num_tokens: prompt + completion
    rollout = exclude_unscored(rollout)
    B = rollout.batch_size[0]
    return advance(state, samples_seen=B, episodes=B, tokens_seen=tokens), rollout


# What an estimator of ``ADVANTAGE_ESTIMATORS`` reads beyond every rollout's ``score`` and
# ``response_mask``, and where it comes from: a recipe whose learner batch (its ``Recipe.advantage_inputs``)
# lacks one cannot run that estimator.
ESTIMATOR_NEEDS: dict[str, dict[str, str]] = {
    "gae": {K.REWARDS: "rewards [B, R] (per-token rewards)",
            K.VALUES: "values [B, R] (a critic's, which only the PPO recipe trains)"},
    "reinforce_pp": {K.REWARDS: "rewards [B, R] (per-token rewards with the KL folded in, as RLOO's)"},
    "remax": {K.REWARDS: "rewards [B, R] (per-token rewards)",
              K.BASELINE_SCORE: "baseline_score [B] (the score of a greedy response per prompt, which no recipe "
                                "generates)"},
}


def check_kl_name(config: Any, *, full: bool = False) -> None:
    """Refuse a ``kl`` that names no estimator of ``rlcore.kl`` (``KL_ESTIMATORS``, ``KL_ALIASES``;
    ``"full"``, the exact KL over the vocabulary, only where the recipe computes it: ``full``)."""
    valid = [*KL_ESTIMATORS, *KL_ALIASES, *(["full"] if full else [])]
    if config.kl not in valid:
        hint = "" if full or config.kl != "full" else " ('full' needs the vocabulary-wide KL, which only the PPO recipe computes)"
        raise ValueError(f"kl: expected one of {valid}, got {config.kl!r}{hint}")


def runnable_estimators(inputs: Sequence[str]) -> list[str]:
    """The keys of ``ADVANTAGE_ESTIMATORS`` whose inputs (``ESTIMATOR_NEEDS``) a learner batch holding
    the keys ``inputs`` (a recipe's ``advantage_inputs``) feeds."""
    held = set(inputs)
    return sorted(name for name in ADVANTAGE_ESTIMATORS if set(ESTIMATOR_NEEDS.get(name, {})) <= held)


def advantage_fn(config: Any, *, inputs: Sequence[str], recipe: str) -> Callable[[TensorDictBase], TensorDictBase]:
    """The estimator a policy-gradient recipe's config selects: ``ADVANTAGE_ESTIMATORS[config.advantage]``
    (``rlcore.baselines``) with ``config.advantage_kwargs`` bound, each keyword checked against its
    signature (``rlcore.checks.bind_keywords``). Scored rollout → rollout + ``advantages``, ``returns``.
    ``inputs``: the keys the recipe's learner batch holds (its ``advantage_inputs``); ``recipe``: its
    name, for the errors.

    Raises ``ValueError`` for an estimator the recipe cannot feed (``runnable_estimators``), naming
    the recipe, the estimator and what its batch lacks, and for ``group_size`` in ``advantage_kwargs``
    (the rollout's groups are fixed by ``num_samples``)."""
    estimator = lookup(ADVANTAGE_ESTIMATORS, config.advantage, what="advantage")
    if "group_size" in config.advantage_kwargs:
        raise ValueError(f"advantage_kwargs.group_size: the rollout's groups are its prompts' samples (num_samples="
                         f"{config.num_samples}, by group_id), not a setting; got {config.advantage_kwargs['group_size']!r}")
    held = set(inputs)
    missing = [what for key, what in ESTIMATOR_NEEDS.get(config.advantage, {}).items() if key not in held]
    if missing:
        raise ValueError(f"advantage: the {recipe} recipe cannot run {config.advantage!r}: it reads "
                         f"{' and '.join(missing)}, which the {recipe} recipe's rollout does not hold; choose one "
                         f"of {runnable_estimators(inputs)}")
    return bind_keywords(estimator, config.advantage_kwargs, what="advantage_kwargs", name=config.advantage)


def with_policy_logprobs(model: nn.Module, batch: TensorDictBase, *, temperature: float = 1.0,
                         with_entropy: bool = False, packed: bool = False) -> TensorDictBase:
    """A shallow copy of a rollout with the policy's ``logprobs [B, R]`` of its own responses
    (and, with ``with_entropy``, its token ``entropy [B, R]`` from the same pass, detached: it is
    logged, never trained).

    ``lp[b, j] = log softmax(z_{b, P−1+j}/τ)[response_ids[b, j]]``, ``z`` the logits of
    ``[prompt | response]`` (``loops.score.sequences``; ``loops.score.token_logprobs_from_model``,
    chunked: no ``[B, T, V]``).

    Args:
        model: the causal LM being trained.
        batch: rollout ``[B]`` with ``prompt_ids`` / ``prompt_mask`` ``[B, P]`` and ``response_ids`` /
            ``response_mask`` ``[B, R]``.
        temperature: ``τ``, the sampling temperature (the behaviour log-probs use the same).
        packed: padding-free (``padding_free``): the rows' real tokens in one row with positions
            restarting per sequence (``loops.score.packed_logprobs``), the head run on the
            ``response_mask`` tokens only; values 0 outside ``response_mask``. Equal to the
            padded forward up to float rounding (Hugging Face models).
    Returns:
        A shallow copy of ``batch`` with ``logprobs [B, R]`` (meaningless where ``response_mask`` is
        False); ``batch`` is not modified.

    Gradient: flows to ``model``'s parameters.
    """
    ids, mask = sequences(batch)
    if packed:
        response = batch[K.RESPONSE_MASK]
        scored = torch.cat([torch.zeros_like(mask[:, :mask.shape[1] - response.shape[1]]), response], -1)
        out = packed_logprobs(model, ids, mask, scored, temperature=temperature, with_stats=with_entropy)
        width = response.shape[1]
        if with_entropy:
            return batch.copy().update({K.LOGPROBS: out.logprobs[:, -width:], K.ENTROPY: out.entropy[:, -width:].detach()})
        return batch.copy().update({K.LOGPROBS: out[:, -width:]})
    out = token_logprobs_from_model(model, ids, mask, response_length=batch[K.RESPONSE_IDS].shape[-1],
                                    temperature=temperature, with_entropy=with_entropy)
    if with_entropy:
        return batch.copy().update({K.LOGPROBS: out[0], K.ENTROPY: out[1].detach()})
    return batch.copy().update({K.LOGPROBS: out})


def check_engine_correction(config: Any) -> None:
    """Refuse, at load, a ``vllm_importance_sampling_mode`` not in ``ENGINE_IS_MODES``, bounds with
    ``clip_min ≥ clip_max`` (the fields of ``EngineCorrectionSettings``), and the correction on with
    VESPO on the vLLM engine (TRL folds it into VESPO's weights instead)."""
    lookup(dict.fromkeys(ENGINE_IS_MODES), config.vllm_importance_sampling_mode, what="vllm_importance_sampling_mode")
    if (config.engine == "vllm" and config.vllm_importance_sampling_correction
            and getattr(config, "loss_type", None) == "vespo"):
        raise ValueError("vllm_importance_sampling_correction: VESPO takes the engine's ratio inside its gamma weights, "
                         "which is not offered; with loss_type vespo and engine vllm set it false")
    low, high = config.vllm_importance_sampling_clip_min, config.vllm_importance_sampling_clip_max
    if low is not None and high is not None and not low < high:
        raise ValueError(f"vllm_importance_sampling_clip_min: expected below vllm_importance_sampling_clip_max "
                         f"({high}), got {low}")


def engine_correction(state: TrainState, rollout: TensorDictBase, config: Any) -> Correction | None:
    """The synchronous step's correction for a generation engine with numerics of its own (``engine:
    vllm``), as TRL's ``vllm_importance_sampling_correction``; ``None`` for the other engines or
    with the correction off.

    The trainer's log-probs ``π_t`` of the rollout's responses (no-grad forwards of the policy before
    the update, ``forward_batch_size`` rows each, under the update's autocast and ``padding_free``, so
    an unchanged policy's first ratio is 1 up to the rounding of another batching) become the loss's
    ``old_logprobs``, so its clipped ratio is taken against the
    trainer's own policy, and the advantages are weighted by ``w =
    algorithms.ratios.engine_importance_weights(π_t, π_engine)`` (the engine's log-probs are the
    rollout's ``old_logprobs``; ``w ≥ 0`` scales the surrogate as it scales ``A``) with the config's
    ``vllm_importance_sampling_mode``, ``_clip_min`` and ``_clip_max``. Metrics, TRL's names:
    ``sampling/sampling_logp_difference/mean|max`` (``|log π_t − log π_e|`` over tokens),
    ``sampling/importance_sampling_ratio/min|mean|max`` (over tokens, or sequences in the
    ``sequence_*`` modes), and ``sampling/engine_kl``: ``mean_t[(ρ − 1) − log ρ]``, ``ρ = π_t/π_e``,
    the k3 estimate of KL(π_e ‖ π_t) per token; the log-prob statistics leave out tokens the engine
    could not score (NaN; their weight is 1).
    """
    if config.engine != "vllm" or not getattr(config, "vllm_importance_sampling_correction", False):
        return None
    policy, n = state.model("policy"), rollout.batch_size[0]
    rows, dtype = config.forward_batch_size or n, autocast_dtype(config)
    device_type = next(policy.parameters()).device.type
    with torch.no_grad(), torch.autocast(device_type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        trainer = torch.cat([with_policy_logprobs(policy, rollout[i:i + rows], temperature=config.temperature,
                                                  packed=config.padding_free)[K.LOGPROBS] for i in range(0, n, rows)])
    mode = config.vllm_importance_sampling_mode

    def correct(batch: TensorDictBase) -> tuple[TensorDictBase, dict]:
        mask, engine = batch[K.RESPONSE_MASK], batch[K.OLD_LOGPROBS]
        w = engine_importance_weights(trainer, engine, mask, mode=mode, clip_min=config.vllm_importance_sampling_clip_min,
                                      clip_max=config.vllm_importance_sampling_clip_max)
        scored = mask & ~torch.isnan(engine)  # a token the engine could not score is no evidence of divergence
        diff = torch.nan_to_num(trainer - engine, nan=0.0).double()
        present = mask.any(-1)
        per = w[:, :1][present] if mode.startswith("sequence") else w[mask]  # a sequence's weight sits on each token
        per = per.double() if per.numel() else torch.zeros(1, dtype=torch.float64)
        log_rho = zero_outside(diff, scored)
        k3 = zero_outside(torch.expm1(log_rho.clamp(max=50.0)) - log_rho, scored)
        stats = {"sampling/sampling_logp_difference/mean": masked_mean(diff.abs(), scored),
                 "sampling/sampling_logp_difference/max": zero_outside(diff.abs(), scored).max(),
                 "sampling/importance_sampling_ratio/min": per.min(),
                 "sampling/importance_sampling_ratio/mean": per.mean(),
                 "sampling/importance_sampling_ratio/max": per.max(),
                 "sampling/engine_kl": masked_mean(k3, scored)}
        weighted = batch[K.ADVANTAGES] * w.to(batch[K.ADVANTAGES].dtype)
        return batch.copy().update({K.ADVANTAGES: weighted, K.OLD_LOGPROBS: trainer}), stats
    return correct


def rollout_metrics(rollout: TensorDictBase) -> dict[str, torch.Tensor]:
    """Detached scalars describing a scored rollout (docs/metrics.md explains each):

    - ``rollout/score`` (mean), ``rollout/score_std``, ``rollout/length`` (mean response tokens) over
      the scored samples, ``rollout/unscored`` (samples a reward function had no opinion on, when
      any), ``rollout/truncated`` (the fraction of responses that used the whole token budget with
      no stop token) and, with reference log-probs, ``rollout/kl_ref`` (``mean_b Σ_t (old − ref)``:
      k1 of whole responses under the sampling policy, ``rlcore.transforms.observed_kl``);
    - under TRL's names, :func:`group_metrics` (``frac_reward_zero_std``), :func:`length_metrics`
      (``completions/...``) and :func:`reward_term_metrics` (``rewards/<name>/mean|std``).
    """
    mask = rollout[K.RESPONSE_MASK]
    scored = mask.any(-1)  # exclude_unscored empties the mask of a sample with no score
    score = rollout[K.SCORE].detach()[scored]
    out = {"rollout/score": score.mean() if score.numel() else torch.zeros(()),
           "rollout/score_std": score.std() if score.numel() > 1 else torch.zeros(()),
           "rollout/length": mask[scored].sum(-1).to(score.dtype).mean() if score.numel() else torch.zeros(())}
    if not bool(scored.all()):
        out["rollout/unscored"] = (~scored).sum().to(score.dtype)
    if K.TRUNCATED in rollout.keys():  # responses cut at the token budget (DAPO's "clip ratio")
        out["rollout/truncated"] = rollout[K.TRUNCATED].to(score.dtype).mean() if len(rollout[K.TRUNCATED]) \
            else torch.zeros(())
    if K.REF_LOGPROBS in rollout.keys():
        out["rollout/kl_ref"] = observed_kl(kl_estimate(rollout[K.OLD_LOGPROBS], rollout[K.REF_LOGPROBS], "k1"), mask)
    if K.GROUP_ID in rollout.keys():
        out.update(group_metrics(rollout[K.SCORE].detach(), rollout[K.GROUP_ID], scored))
    out.update(length_metrics(mask, rollout.get(K.TRUNCATED, None), scored))
    if K.REWARD_TERMS in rollout.keys():
        out.update(reward_term_metrics(rollout[K.REWARD_TERMS]))
    if K.TURNS in rollout.keys():  # multi-turn episodes (loops.episodes)
        out["rollout/turns"] = rollout[K.TURNS][scored].to(score.dtype).mean() if score.numel() else torch.zeros(())
        trajectory = rollout[K.TRAJECTORY_MASK][scored]
        out["rollout/env_tokens"] = (trajectory & ~mask[scored]).sum(-1).to(score.dtype).mean() \
            if score.numel() else torch.zeros(())
    return out


def group_metrics(score: torch.Tensor, group_id: torch.Tensor, scored: torch.Tensor) -> dict[str, torch.Tensor]:
    """``frac_reward_zero_std`` (TRL's name): the fraction of prompt groups whose scored samples all
    have the same score (zero std: every group-relative advantage of the group is 0).

    Args:
        score: ``[B]`` float.  group_id: ``[B]`` long, the prompt of each sample.
        scored: ``[B]`` bool, the samples with a score (the others take no part).
    Returns:
        ``{"frac_reward_zero_std": []}``, 0 when no sample is scored.

    >>> group_metrics(torch.tensor([1., 1., 0., 1.]), torch.tensor([0, 0, 1, 1]), torch.ones(4, dtype=torch.bool))
    {'frac_reward_zero_std': tensor(0.5000)}
    """
    if not bool(scored.any()):
        return {"frac_reward_zero_std": torch.zeros(())}
    groups, index = torch.unique(group_id[scored], return_inverse=True)
    s = score[scored].to(torch.float64)
    high = s.new_full((len(groups),), -math.inf).scatter_reduce(0, index, s, "amax")
    low = s.new_full((len(groups),), math.inf).scatter_reduce(0, index, s, "amin")
    return {"frac_reward_zero_std": (high == low).to(score.dtype).mean()}


def length_metrics(mask: torch.Tensor, truncated: torch.Tensor | None, scored: torch.Tensor) -> dict[str, torch.Tensor]:
    """TRL's completion-length statistics over the scored samples, in tokens: ``completions/mean_length``,
    ``/min_length``, ``/max_length``; ``completions/clipped_ratio`` (the fraction cut at the token
    budget with no stop token, ``truncated``) and ``completions/mean_terminated_length``,
    ``/min_terminated_length``, ``/max_terminated_length`` over the others (0 when none ended).

    Args:
        mask: ``response_mask [B, R]`` bool.  truncated: ``[B]`` bool or ``None`` (none truncated).
        scored: ``[B]`` bool.
    """
    lengths = mask[scored].sum(-1).to(torch.float32)
    cut = torch.zeros_like(lengths, dtype=torch.bool) if truncated is None else truncated[scored].bool()
    ended = lengths[~cut] if bool((~cut).any()) else lengths.new_zeros(1)
    lengths = lengths if lengths.numel() else lengths.new_zeros(1)
    return {"completions/mean_length": lengths.mean(), "completions/min_length": lengths.min(),
            "completions/max_length": lengths.max(),
            "completions/clipped_ratio": cut.to(torch.float32).mean() if cut.numel() else torch.zeros(()),
            "completions/mean_terminated_length": ended.mean(), "completions/min_terminated_length": ended.min(),
            "completions/max_terminated_length": ended.max()}


def reward_term_metrics(terms: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``rewards/<name>/mean`` and ``rewards/<name>/std`` (TRL's names) of each reward source's own
    unweighted scores ``[B]`` (``reward_terms``, ``loops.score.score_rollout``), over the samples it
    scored (NaN: no opinion); the std is the sample std (0 below two scores), the mean NaN when it
    scored none.

    >>> reward_term_metrics({"correct": torch.tensor([1.0, 0.0, float("nan")])})["rewards/correct/mean"].item()
    0.5
    """
    out = {}
    for name, x in terms.items():
        x = x.detach().to(torch.float64)
        valid = ~torch.isnan(x)
        n = valid.sum()
        mean = torch.where(valid, x, 0.0).sum() / n
        var = torch.where(valid, (x - mean) ** 2, 0.0).sum() / (n - 1).clamp(min=1)
        out[f"rewards/{name}/mean"] = mean
        out[f"rewards/{name}/std"] = var.sqrt()
    return out


# --- the run -------------------------------------------------------------------------------------
# The live line of an online run: what the policy earns and how far it moved, not only loss terms
# (a group-normalised policy-gradient loss is ≈ 0 by design). Held-out values keep their last reading.
LIVE = ("rollout/score", "eval/reward", "eval/exact_match", "rollout/kl_ref", "rollout/truncated", "entropy",
        "clipfrac_low", "clipfrac_high", "loss")


def train_online(config: Any, build_state: Callable[[Any], tuple[TrainState, Any]],
                 step: Callable[..., tuple[TrainState, Any]], *, reward_fn: RewardFn | None = None,
                 env: EnvFactory | None = None, name: str | None = None, callbacks: Sequence[Callable] = (),
                 save_models: Sequence[str] | None = None) -> tuple[TrainState, list[dict[str, float]]]:
    """Run an online recipe: ``run(step, state, prompt_source(train), eval_fn=evaluate_policy)``.

    The data are loaded and checked first, then ``build_state(config) -> (state, tokenizer)`` (the
    recipe's: it checks the config, then builds its models). The reward (``make_reward_fn(config,
    reward_fn)``: functions and weights) is built once and kept in the state (``state.reward_fn``):
    the step scores with it and evaluation (during the run, and ``evaluate(state, config)`` on the
    returned state) scores with it too; ``step(state, rows, *, config,
    tokenizer, reward_fn) -> (state, metrics)`` is the recipe's step, bound here with
    ``functools.partial``. The environment of multi-turn episodes (``env``, a factory, else the
    config's ``env`` / ``tools``: ``loops.envs.resolve_env``) is kept in the state too
    (``state.env``), so the step and evaluation both play episodes with it.
    ``callbacks`` run first after each step (``run``'s extra callbacks);
    ``save_models`` names the frozen models a checkpoint keeps too (``run``).

    Returns:
        ``(state, history)`` of ``rlcore.loops.recipe.run`` (checkpoints, logs and resume from
        the config's run fields).
    """
    train_ds, eval_ds = load_splits(config, task_dataset)
    reward = make_reward_fn(config, reward_fn)
    check_prompt_data(reward, train=train_ds, held_out=eval_ds)  # before any model is built
    state, tokenizer = build_state(config)
    make_env = env if env is not None else resolve_env(config.env, config.tools, tool_format=config.tool_format)
    state = dataclasses.replace(state, reward_fn=reward, env=make_env)  # built once: training and evaluation use them
    check_prompt_lengths(config, tokenizer, state.model("policy"), train=train_ds, held_out=eval_ds)
    refill = {"refill": prompt_refill(train_ds, config)} if getattr(config, "dynamic_sampling", False) else {}
    bound = functools.partial(step, config=config, tokenizer=tokenizer, reward_fn=reward, **refill)
    frozen = not getattr(config, "sync_ref_model", False)  # TR-DPO moves the reference: its answers change
    eval_fn = functools.partial(evaluate_policy, config=config, tokenizer=tokenizer, dataset=eval_ds,
                                reference_cache={} if frozen else None)  # scores with state.reward_fn
    return run(bound, state, prompt_source(train_ds, config), config=config, num_steps=config.steps,
               eval_fn=eval_fn, name=name, callbacks=callbacks, tokenizer=tokenizer,
               save_models=save_models, live=LIVE)
