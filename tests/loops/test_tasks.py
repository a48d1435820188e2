"""Built-in tasks: answers are right, splits are disjoint, rewards and near misses behave."""

import pytest

from rlcore.loops.tasks import (BUILTIN_TASKS, answer_reward, exact_match, get_task, preference_dataset, task_dataset,
                                task_reward)


@pytest.mark.parametrize("name", sorted(BUILTIN_TASKS))
def test_answers_are_correct_and_splits_disjoint(name):
    train = task_dataset(name, 200, seed=0)
    held = task_dataset(name, 50, seed=1, split="eval")
    assert len(train) == 200 and len(held) == 50
    assert not set(train["prompt"]) & set(held["prompt"])
    for prompt, answer in zip(train["prompt"], train["answer"]):
        if name == "add":
            a, b = prompt[:-1].split("+")
            assert answer == str(int(a) + int(b))
        elif name == "sort":
            assert answer == "".join(sorted(prompt[5:-1]))
        else:
            assert answer == prompt[4:-1][::-1]
    assert task_dataset(name, 20, seed=3)["prompt"] == task_dataset(name, 20, seed=3)["prompt"]


def test_rewards():
    assert exact_match([" 19", "18"], ["19", "19"]) == [1.0, 0.0]
    assert answer_reward(["19", "18", "", "1"], ["19", "19", "19", "19"]) == [1.0, 0.25, 0.0, 0.25]
    fn = task_reward("add")
    assert fn(["1+1="], ["2"], answer=["2"]) == [1.0]


@pytest.mark.parametrize("name", sorted(BUILTIN_TASKS))
def test_preference_pairs_are_near_misses(name):
    ds = preference_dataset(name, 100, seed=0)
    assert all(c != r for c, r in zip(ds["chosen"], ds["rejected"]))
    assert all(answer_reward([r], [c])[0] < 1.0 for c, r in zip(ds["chosen"], ds["rejected"]))


def test_unknown_task_lists_valid_names():
    with pytest.raises(ValueError, match=r"unknown 'mul'; valid: \['add', 'reverse', 'sort'\]"):
        get_task("mul")
    with pytest.raises(ValueError, match="split"):
        task_dataset("add", 3, split="test")
