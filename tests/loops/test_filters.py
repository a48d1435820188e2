"""Dynamic sampling (DAPO): uninformative groups dropped, the step refilled, deterministically."""

import dataclasses

import pytest
import torch

from rlcore import keys as K
from rlcore.loops import online
from rlcore.loops.filters import informative_groups, prompt_refill
from rlcore.loops.recipe import load_splits
from rlcore.loops.recipes import grpo, rloo
from rlcore.loops.tasks import task_dataset
from rlcore.testing import make_rollout
from tests.loops.online_helpers import TINY, digit_fraction


def test_informative_groups_are_those_whose_scores_differ():
    rollout = make_rollout(6, 3, group_size=2)
    rollout[K.SCORE] = torch.tensor([1.0, 1.0, 0.0, 0.5, 2.0, 2.0])
    assert informative_groups(rollout).tolist() == [False, False, True, True, False, False]
    rollout[K.GROUP_ID] = torch.tensor([7, 3, 7, 3, 9, 9])  # ids need not be sorted or dense
    rollout[K.SCORE] = torch.tensor([1.0, 0.5, 0.0, 0.5, 2.0, 2.0])
    assert informative_groups(rollout).tolist() == [True, False, True, False, False, False]


def test_refill_prompts_are_a_function_of_step_and_round():
    config = grpo.Config(**TINY, batch_size=3)
    train = load_splits(config, task_dataset)[0]
    draw = prompt_refill(train, config)
    assert draw(5, 1)["prompt"] == draw(5, 1)["prompt"] and len(draw(5, 1)["prompt"]) == 3
    assert draw(5, 1)["prompt"] != draw(5, 2)["prompt"] and set(draw(5, 1)) == set(train.column_names)


def _sometimes_tied(prompts, completions, **_):
    """Every sample of a prompt with an even first digit scores 0: its group carries no signal."""
    return [0.0 if p[0] in "02468" else s for p, s in zip(prompts, digit_fraction(prompts, completions))]


@pytest.mark.parametrize("recipe", [grpo, rloo])
def test_a_step_trains_only_on_informative_groups(monkeypatch, recipe):
    config = recipe.Config(**TINY, batch_size=4, num_samples=4, dynamic_sampling=True, max_sampling_rounds=4,
                           seed=3, task="add")
    state, tokenizer = online.build_online_state(config)
    train = load_splits(config, task_dataset)[0]
    rows = next(iter(online.prompt_source(train, config)(0)))
    seen = []
    learn = recipe.learn
    monkeypatch.setattr(recipe, "learn", lambda state, rollout, config, **kw: (seen.append(rollout),
                                                                              learn(state, rollout, config, **kw))[1])
    _, metrics = recipe.step(state, rows, config=config, tokenizer=tokenizer, reward_fn=_sometimes_tied,
                             refill=prompt_refill(train, config))
    batch = seen[0]
    assert informative_groups(batch).all() and batch.batch_size[0] % 4 == 0 and batch.batch_size[0] <= 16
    assert 1 <= metrics["rollout/sampling_rounds"] <= 4
    assert metrics["rollout/kept_groups"] == batch.batch_size[0] // 4
    assert metrics["rollout/dropped_groups"] >= 1  # the even-digit prompts' groups
    assert len(set(batch[K.GROUP_ID].tolist())) == batch.batch_size[0] // 4
    # without dynamic sampling the same step trains on every group, tied ones included
    seen.clear()
    recipe.step(state, rows, config=dataclasses.replace(config, dynamic_sampling=False), tokenizer=tokenizer,
                reward_fn=_sometimes_tied)
    assert seen[0].batch_size[0] == 16


def test_train_runs_with_dynamic_sampling_and_logs_the_counts():
    config = grpo.Config(**TINY, batch_size=2, num_samples=2, steps=2, dynamic_sampling=True)
    _, history = grpo.train(config, reward_fn=_sometimes_tied)
    assert all("rollout/sampling_rounds" in h for h in history)


def test_asynchronous_learners_refuse_dynamic_sampling():
    from rlcore.loops.config import check_config
    from rlcore.loops.scale.async_learners import check_learner
    with pytest.raises(ValueError, match="dynamic_sampling: refilling a step"):
        check_learner(grpo.Config(**TINY, dynamic_sampling=True), None)
    with pytest.raises(ValueError, match=r"max_sampling_rounds: .*>= 1"):
        check_config(grpo.Config(**TINY, max_sampling_rounds=0))
