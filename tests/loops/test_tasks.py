"""Built-in tasks: answers are right, splits are disjoint, rewards and near misses behave."""

import pytest

from rlcore.loops.tasks import (BUILTIN_TASKS, answer_reward, exact_match, get_task, preference_dataset, task_dataset,
                                task_reward)


# Each task's answer written out independently of loops.tasks, from the prompt's text alone.
SOLVE = {
    "add": lambda p: str(sum(int(x) for x in p[:-1].split("+"))),
    "sub": lambda p: str(int(p[:-1].split("-")[0]) - int(p[:-1].split("-")[1])),
    "mul": lambda p: str(int(p[:-1].split("*")[0]) * int(p[:-1].split("*")[1])),
    "sort": lambda p: "".join(sorted(p[len("sort "):-1])),
    "reverse": lambda p: p[len("rev "):-1][::-1],
    "count": lambda p: str(p.split()[2][:-1].count(p.split()[1])),
    "max": lambda p: str(max(int(x) for x in p[len("max "):-1].split())),
    "parity": lambda p: ["even", "odd"][p[len("parity "):-1].count("1") % 2],
    "radd": lambda p: str(sum(int(x) for x in p[len("radd "):-1].split("+")))[::-1],
}


def test_the_battery_has_every_kind_of_task():
    assert len(BUILTIN_TASKS) >= 8 and set(SOLVE) == set(BUILTIN_TASKS)
    assert {n for n, t in BUILTIN_TASKS.items() if not t.partial_credit} == {"count", "max", "parity"}
    sub = task_dataset("sub", 200)
    assert any(int(p[:-1].split("-")[0][-1]) < int(p[:-1].split("-")[1][-1]) for p in sub["prompt"])  # borrows
    assert all(not a.startswith("-") for a in sub["answer"])
    assert set(task_dataset("parity", 50)["answer"]) == {"odd", "even"}


@pytest.mark.parametrize("name", sorted(BUILTIN_TASKS))
def test_answers_are_correct_and_splits_disjoint(name):
    train = task_dataset(name, 200, seed=0)
    held = task_dataset(name, 50, seed=1, split="eval")
    assert len(train) == 200 and len(held) == 50
    assert not set(train["prompt"]) & set(held["prompt"])
    for prompt, answer in zip(train["prompt"], train["answer"]):
        assert answer == SOLVE[name](prompt), (prompt, answer)
    assert task_dataset(name, 20, seed=3)["prompt"] == task_dataset(name, 20, seed=3)["prompt"]


def test_rewards():
    assert exact_match([" 19", "18"], ["19", "19"]) == [1.0, 0.0]
    assert answer_reward(["19", "18", "", "1"], ["19", "19", "19", "19"]) == [1.0, 0.25, 0.0, 0.25]
    fn = task_reward("add")
    assert fn(["1+1="], ["2"], answer=["2"]) == [1.0]
    assert task_reward("radd")(["radd 9+9="], ["18"], answer=["81"]) == [0.0]   # partial credit: 0 positions
    assert task_reward("radd")(["radd 9+9="], ["88"], answer=["81"]) == [0.25]
    assert task_reward("max")(["max 10 20 31:"], ["30"], answer=["31"]) == [0.0]  # 0/1: no partial credit


@pytest.mark.parametrize("name", sorted(BUILTIN_TASKS))
def test_preference_pairs_are_near_misses(name):
    ds = preference_dataset(name, 100, seed=0)
    assert all(c != r for c, r in zip(ds["chosen"], ds["rejected"]))
    assert all(answer_reward([r], [c])[0] < 1.0 for c, r in zip(ds["chosen"], ds["rejected"]))


def test_unknown_task_lists_valid_names():
    with pytest.raises(ValueError, match=r"unknown 'div'; valid: \['add', 'count', 'max', .*'sub'\]"):
        get_task("div")
    with pytest.raises(ValueError, match="split"):
        task_dataset("add", 3, split="test")
