"""Held-out evaluation of an online recipe's policy: greedy reward, exact match and length, win rate
against the reference, sampled reward and KL to the reference (:func:`evaluate_policy`)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset

from rlcore import keys as K
from rlcore.kl import kl_estimate
from rlcore.loops.collect import generate_rollout
from rlcore.loops.fold import to_floats
from rlcore.loops.recipe import load_splits, policy_tokenizer, require_held_out
from rlcore.loops.reward_fns import RewardFn, make_reward_fn, repeat_columns, reward_settings, trainer_state
from rlcore.loops.envs import resolve_env
from rlcore.loops.episodes import sample_episodes
from rlcore.loops.score import last_turn_ids, score_rollout
from rlcore.loops.state import TrainState
from rlcore.loops.tasks import exact_match, task_dataset
from rlcore.masked import masked_sum

__all__ = ["evaluate_policy"]


def _exact_match_reward(prompts, completions, *, answer, **_):
    return exact_match(completions, answer)


def _evaluate_rows(state: TrainState, rows: Mapping[str, Sequence], config: Any, *, tokenizer, reward_fn,
                   seed: int, reference_scores: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Per-prompt ``[b]`` evaluation quantities of one chunk of held-out rows (``reference_scores``:
    the reference's greedy scores of this chunk when already known; ``_reference_scores`` in the result)."""
    prompts = list(rows["prompt"])
    columns = {**repeat_columns(rows, 1), "trainer_state": trainer_state(state.step, getattr(config, "steps", None))}
    policy = state.model("policy")
    gen = dict(max_new_tokens=config.max_new_tokens, max_prompt_length=config.max_prompt_length, seed=seed,
               engine=config.engine, sampler=config.sampler, engine_options=config.engine_options,
               stop_token_ids=tuple(getattr(config, "stop_token_ids", ())))
    env = state.env if state.env is not None else resolve_env(getattr(config, "env", None), getattr(config, "tools", ()),
                                                              tool_format=getattr(config, "tool_format", "qwen"))
    scoring = dict(reward_fn=reward_fn, reward_model=state.models.get("reward"), tokenizer=tokenizer,
                   prompts=prompts, reward_columns=columns, **reward_settings(config))

    def generate(model, **kw):  # a response per prompt, or with the run's environment an episode (loops.episodes)
        if env is None:
            return generate_rollout(model, tokenizer, prompts, **gen, **kw)
        return sample_episodes(model, tokenizer, rows, env, max_turns=config.max_turns,
                               max_episode_tokens=config.max_episode_tokens,
                               reuse_context=getattr(config, "reuse_context", True),
                               **{k: v for k, v in {**gen, **kw}.items() if k != "behaviour"})

    greedy = generate(policy, do_sample=False, behaviour=None)
    reward, ref_reward = score_rollout(greedy, **scoring)[K.SCORE], reference_scores
    if ref_reward is None:
        reference = generate(state.model("ref"), do_sample=False,
                             behaviour=None).to(greedy.device)  # a reference on ref_device answers there
        ref_reward = score_rollout(reference, **scoring)[K.SCORE]
    texts = tokenizer.batch_decode(last_turn_ids(greedy), skip_special_tokens=True)
    out = {"reward": reward, "response_length": greedy[K.RESPONSE_MASK].sum(-1).float(), "_completions": texts,
           "_reference_scores": ref_reward,
           # win-rate against the reference policy, greedy both: 1 per win, ½ per tie; NaN (left out) unscored
           "win_rate": torch.where(reward.isnan() | ref_reward.isnan(), math.nan,
                                   (reward > ref_reward).float() + 0.5 * (reward == ref_reward).float())}
    if "answer" in columns:
        out["exact_match"] = score_rollout(greedy, reward_fn=_exact_match_reward, tokenizer=tokenizer,
                                           reward_columns={"answer": columns["answer"]}, with_env_reward=False)[K.SCORE]
    sampled = generate(policy, temperature=config.temperature, top_k=config.top_k, top_p=config.top_p)
    sampled = score_rollout(sampled, ref=state.model("ref"), temperature=config.temperature, **scoring)
    kl = kl_estimate(sampled[K.OLD_LOGPROBS], sampled[K.REF_LOGPROBS], "k1")
    out["sampled_reward"] = sampled[K.SCORE]
    out["kl_ref"] = masked_sum(kl, sampled[K.RESPONSE_MASK], dim=-1)
    return out


def evaluate_policy(state: TrainState, config: Any, *, tokenizer=None, dataset: Dataset | None = None,
                    reward_fn: RewardFn | None = None,
                    reference_cache: dict[int, torch.Tensor] | None = None) -> dict[str, float]:
    """Held-out metrics, means over the prompts (those the reward function scored, for the rewards):
    ``reward``, ``exact_match`` and ``response_length``
    of greedy responses; ``win_rate`` of those against the reference policy's greedy responses
    (judged by the same reward; a tie counts ½); ``sampled_reward`` and ``kl_ref`` of one sampled
    response per prompt.

    With an environment (the state's, ``train``'s; else the config's ``env`` / ``tools``), every
    response is an episode (``loops.episodes``): the rewards include the environment's, exact match
    grades the last assistant turn alone, and ``kl_ref`` sums over the model's tokens.

    ``kl_ref = mean_b Σ_t (log π − log π_ref)`` (k1 of whole responses sampled at
    ``config.temperature``, both log-probs at that temperature). ``exact_match`` needs an ``answer``
    column (omitted otherwise). Prompts go ``config.eval_batch_size`` at a time; chunk ``i`` samples
    with the fixed seed ``config.seed + i`` (not ``state.rng``, not the global RNG), so evaluating
    never changes training and the same state always gets the same numbers. With ``run_dir`` and
    ``log_completions = n``, the first ``n`` prompts, their greedy completions and rewards are
    appended to ``run_dir/completions.jsonl``.

    Args:
        dataset: the held-out split (default: ``load_splits(config, task_dataset)[1]``). A config that
            holds nothing out (``num_eval`` 0, no ``eval_dataset``) or an empty split is refused
            (``ValueError``).
        tokenizer: as in training (default from ``config``).
        reward_fn: the reward as ``train`` takes it (``make_reward_fn(config, reward_fn)``: with the
            config's ``reward_funcs`` and ``reward_weights``). ``None``: the one the state carries
            (``state.reward_fn``: what ``train`` built, so ``evaluate(state, config)`` on its
            returned state scores exactly as training did), else the config's own.
        reference_cache: a dict kept across the evaluations of one run whose reference is frozen
            (``train_online`` passes one unless TR-DPO moves the reference): the reference's
            greedy scores of each chunk are computed at the first evaluation only (its answers
            are the same every time: greedy, fixed weights). ``None``: computed every time.
    Returns:
        ``dict[str, float]``.
    """
    if dataset is None:
        require_held_out(config)
        dataset = load_splits(config, task_dataset)[1]
    if len(dataset) == 0:
        raise ValueError("evaluate: the held-out split is empty (num_eval 0 holds nothing out); give eval_dataset "
                         "or num_eval > 0")
    tokenizer = tokenizer if tokenizer is not None else policy_tokenizer(config)
    carried = getattr(state, "reward_fn", None)
    reward_fn = make_reward_fn(config, reward_fn) if reward_fn is not None or carried is None else carried
    n, size = len(dataset), config.eval_batch_size
    cache = {} if reference_cache is None else reference_cache
    chunks = [_evaluate_rows(state, dataset[i:i + size], config, tokenizer=tokenizer, reward_fn=reward_fn,
                             seed=config.seed + i // size, reference_scores=cache.get(i)) for i in range(0, n, size)]
    for i, chunk in zip(range(0, n, size), chunks):
        cache[i] = chunk.pop("_reference_scores")
    texts = [t for c in chunks for t in c.pop("_completions")]
    if config.run_dir and getattr(config, "log_completions", 0) > 0:
        _write_completions(Path(config.run_dir), state.step, dataset, texts, torch.cat([c["reward"] for c in chunks]),
                           config.log_completions)
    # nanmean: a prompt the reward function had no opinion on (None) is left out of the reward means
    return to_floats({k: torch.cat([c[k] for c in chunks]).float().nanmean() for k in chunks[0]})


def _write_completions(run_dir: Path, step: int, dataset: Dataset, completions: Sequence[str], rewards: torch.Tensor,
                       n: int) -> None:
    """Append the first ``n`` held-out prompts, their greedy completions and rewards (``null``: no opinion)
    to ``run_dir/completions.jsonl``, one line each, stamped with the step."""
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "completions.jsonl", "a", encoding="utf-8") as f:
        for i in range(min(n, len(completions))):
            reward = float(rewards[i])
            f.write(json.dumps({"step": step, "prompt": dataset[i]["prompt"], "completion": completions[i],
                                "reward": reward if math.isfinite(reward) else None}) + "\n")
