"""Tests for benchmarks/learning.py: the wall-clock budget, the report's arithmetic and verdicts,
the sampled preference pairs, and one tiny job end to end (SFT, two recipes, TRL)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import harness as H  # noqa: E402

L = H.load(ROOT / "benchmarks" / "learning.py")


class Clock:
    """A fake ``time.perf_counter``: each read returns the current time; ``advance`` moves it."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_budget_counts_training_time_only_and_evaluates_at_the_marks(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(L.time, "perf_counter", clock)
    calls = []

    def evaluate(model):  # evaluation takes 5 s of the clock, which the budget must not count
        calls.append(model)
        clock.now += 5.0
        return {"exact_match": len(calls) / 10, "reward": 0.0}

    budget = L.Budget(10.0, 3.0, evaluate, model=lambda state: "policy")
    budget.on_start(None)
    stops = []
    for step in range(1, 100):
        clock.now += 1.0  # one training step: 1 s
        stops.append(budget.tick(None, step))
        if stops[-1]:
            break
    assert step == 10 and stops[-1] and not any(stops[:-1])  # 10 steps of 1 s, evaluation excluded
    assert [p["seconds"] for p in budget.curve] == [3.0, 6.0, 9.0, 10.0]
    assert [p["step"] for p in budget.curve] == [3, 6, 9, 10] and calls == ["policy"] * 4


def test_budget_with_time_spent_before_the_fold(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(L.time, "perf_counter", clock)
    budget = L.Budget(4.0, 2.0, lambda m: {"exact_match": 0.0, "reward": 0.0}, model=lambda state: None, spent=2.5)
    budget.on_start(None)
    clock.now += 1.0  # 3.5 s: the 2 s mark passed before any training, the next is at 4 s
    assert not budget.tick(None, 1) and budget.curve == []
    clock.now += 1.0
    assert budget.tick(None, 2) and [p["seconds"] for p in budget.curve] == [4.5]


def _run(points):
    return {"curve": [{"seconds": t, "step": i, "exact_match": x, "reward": x} for i, (t, x) in enumerate(points)],
            "steps": len(points)}


def test_mean_curve_counts_each_point_at_its_mark():
    a = _run([(0, 0.1), (6.05, 0.3), (12.1, 0.5), (12.2, 0.6)])  # the last: the budget's, at 12 s
    b = _run([(0, 0.3), (6.01, 0.3), (12.0, 0.3)])
    assert L.mean_curve([a], [0, 6, 12], 6) == pytest.approx([0.1, 0.3, 0.6])
    assert L.mean_curve([a, b], [0, 6, 12], 6) == pytest.approx([0.2, 0.3, 0.45])


def _result(task, seed, sft, runs):
    return {"task": task, "seed": seed, "sft": {"exact_match": sft, "seconds": 0.0},
            "runs": {name: _run([(0, sft), (30.1, after)]) for name, after in runs.items()}}


def test_battery_table_means_spread_and_verdicts():
    results = [_result("add", 0, 0.2, {"grpo": 0.5, "ppo": 0.3}), _result("add", 1, 0.4, {"grpo": 0.6, "ppo": 0.3}),
               _result("sort", 0, 0.1, {"grpo": 0.3, "ppo": 0.5}), _result("sort", 1, 0.3, {"grpo": 0.5, "ppo": 0.6})]
    text, summary = L.battery_table(results, ["grpo", "ppo"], 30)
    # grpo: add +0.3, +0.2 -> 0.25; sort +0.2, +0.2 -> 0.2; mean 0.225, seeds 0.25 and 0.2
    assert summary["grpo"]["mean_gain"] == pytest.approx(0.225)
    assert summary["grpo"]["per_seed"] == pytest.approx([0.25, 0.2]) and summary["grpo"]["met"]
    # ppo: add +0.1, −0.1 -> 0.0 ... sort +0.4, +0.3: mean 0.175, no task lost (add's mean is 0) -> missed
    assert summary["ppo"]["per_task"]["add"] == pytest.approx(0.0) and not summary["ppo"]["met"]
    assert "| grpo | +25.0 | +20.0 | **+22.5** | +20.0 … +25.0 | none | met |" in text
    lost = [_result("add", 0, 0.2, {"grpo": 0.9}), _result("sort", 0, 0.5, {"grpo": 0.45})]
    row = L.battery_table(lost, ["grpo"], 30)[1]["grpo"]
    assert row["mean_gain"] == pytest.approx(0.325) and row["lost"] == ["sort"] and not row["met"]


def test_a_longer_side_by_side_run_counts_at_the_battery_budget():
    run = _run([(0, 0.1), (30.2, 0.4), (36.1, 0.7), (60.0, 0.9)])
    assert L.final(run, 30) == 0.4 and L.final(run, 60) == 0.9 and L.final(_run([(0, 0.1), (20, 0.2)]), 30) == 0.2


def test_trl_table_verdicts():
    settings = {"eval_seconds": 6, "trl": {"seconds": 12, "tasks": ["add"], "pairs": {"grpo": "grpo"}}}

    def result(ours, theirs):
        return {"task": "add", "seed": 0, "runs": {"grpo": _run(ours), "trl_grpo": _run(theirs)}}
    fast = result([(0, 0.1), (6.1, 0.5), (12.1, 0.6)], [(0, 0.1), (6.1, 0.3), (12.1, 0.5)])
    text, out = L.trl_table([fast], settings)
    row = out["summary"]["add", "grpo"]
    assert row["ahead"] and row["reach"] == 6 and row["ratio"] == 0.5 and row["met"]
    assert "| add | grpo / TRL grpo | yes | 0.500 | 6 s | 0.50× | met |" in text
    slow = result([(0, 0.1), (6.1, 0.2), (12.1, 0.6)], [(0, 0.1), (6.1, 0.3), (12.1, 0.5)])
    row = L.trl_table([slow], settings)[1]["summary"]["add", "grpo"]
    assert not row["ahead"] and row["reach"] == 12 and not row["met"]


@pytest.fixture(scope="module")
def tiny_policy():
    from rlcore.loops.models import build_model, build_tokenizer

    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    return build_model("llama", tokenizer=tokenizer, hidden_size=16, num_layers=1, num_heads=2).eval(), tokenizer


def test_sampled_pairs_prefer_the_higher_reward(tiny_policy):
    from rlcore.loops.tasks import task_dataset

    def reward(prompts, completions, *, answer):  # distinct scores for an untrained policy's answers
        return [float(len(set(c))) + 0.01 * len(c) for c in completions]

    policy, tokenizer = tiny_policy
    data = task_dataset("reverse", 12, seed=0)
    pairs = L.sampled_pairs(policy, tokenizer, data, reward, num_samples=6, max_new_tokens=5, temperature=1.5, seed=0)
    assert len(pairs) >= 6 and {p["prompt"] for p in pairs} <= set(data["prompt"])
    for p in pairs:
        assert p["chosen"] and p["rejected"]
        chosen, rejected = reward([p["prompt"]] * 2, [p["chosen"], p["rejected"]], answer=["", ""])
        assert chosen > rejected


def test_one_job_end_to_end(tmp_path):
    """SFT, GRPO and offline DPO from sampled pairs, and TRL's GRPOTrainer, each for a second."""
    settings = L.load_settings()
    settings.update(model={"hidden_size": 16, "num_layers": 1, "num_heads": 2}, num_train=64, num_eval=16,
                    seconds=1.0, eval_seconds=0.5)
    settings["sft"].update(max_steps=4, check_every=2, probe=8, batch_size=8)
    settings["common"].update(batch_size=4)
    settings["recipes"]["grpo"]["num_samples"] = settings["recipes"]["dpo"]["num_samples"] = 4
    settings["trl"].update(tasks=["add"], seconds=1.0, pairs={"grpo": "grpo"})
    path, result = L._job((settings, "add", 0, tmp_path, ["grpo", "dpo"], True))
    assert json.loads(Path(path).read_text()) == json.loads(json.dumps(result))
    assert result["sft"]["steps"] in (2, 4) and 0 <= result["sft"]["exact_match"] <= 1
    assert set(result["runs"]) == {"grpo", "dpo", "trl_grpo"}
    for name, run in result["runs"].items():
        curve = run["curve"]
        assert curve[0]["seconds"] == 0 and curve[0]["exact_match"] == result["sft"]["exact_match"], name
        if run["steps"]:
            assert curve[-1]["seconds"] >= 1.0 and run["steps"] >= 1, name
    assert "entropy" in result["runs"]["grpo"]
