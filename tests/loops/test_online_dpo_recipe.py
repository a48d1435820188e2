"""Online DPO recipe (loops/recipes/online_dpo.py): raises a learnable reward, pairs from the judge, a
reward model as judge, ties, config checks, YAML."""

import math
from pathlib import Path

import pytest
import torch

from rlcore import keys as K
from rlcore.loops.recipes import online_dpo
from rlcore.loops.models import build_reward_model, build_tokenizer
from rlcore.loops.online import build_online_state, prompt_source
from rlcore.loops.evaluate import evaluate_policy
from rlcore.loops.recipe import load_splits
from rlcore.loops.config import load_config
from rlcore.loops.tasks import task_dataset
from tests.loops.online_helpers import TINY, digit_fraction, updated_batches

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "online_dpo.yaml"


def params(module):
    return [p.detach().clone() for p in module.parameters()]


def test_online_dpo_raises_the_reward():
    config = online_dpo.Config(**TINY, steps=12, batch_size=8, num_samples=4, lr=1e-2)
    before = evaluate_policy(build_online_state(config)[0], config, reward_fn=digit_fraction)
    state, history = online_dpo.train(config, reward_fn=digit_fraction)
    after = evaluate_policy(state, config, reward_fn=digit_fraction)
    assert after["sampled_reward"] > before["sampled_reward"] + 0.15, (before, after)
    first, last = (sum(h["rollout/score"] for h in part) / 4 for part in (history[:4], history[-4:]))
    assert last > first + 0.05, [h["rollout/score"] for h in history]
    assert all(h["rollout/score_chosen"] > h["rollout/score_rejected"] for h in history)
    assert history[-1]["rewards/margins"] > 0 and history[0]["loss_dpo"] == pytest.approx(math.log(2), abs=1e-3)


def test_pairs_are_best_against_worst_with_reference_logps(monkeypatch):
    config = online_dpo.Config(**TINY, steps=1, batch_size=3, num_samples=4, lr=1e-3)
    state, tokenizer = build_online_state(config)
    rows = next(iter(prompt_source(load_splits(config, task_dataset)[0], config)(0)))
    seen = updated_batches(online_dpo, monkeypatch)  # the pairs online_dpo.learn trains on
    # the judge scores by position in the group: sample g of each prompt gets g, so the last
    # sample is chosen and the first rejected
    ranks = lambda prompts, completions, **_: [float(i % 4) for i in range(len(completions))]  # noqa: E731
    new, metrics = online_dpo.step(state, rows, config=config, tokenizer=tokenizer, reward_fn=ranks)
    pairs = seen[0]
    assert pairs.batch_size == torch.Size([3]) and float(metrics["rollout/pairs"]) == 3
    assert torch.equal(pairs[K.CHOSEN, K.SCORE], torch.full((3,), 3.0))
    assert torch.equal(pairs[K.REJECTED, K.SCORE], torch.zeros(3))
    # reference log-probs of both sides; the policy is its reference at the first step: loss log 2
    for side in (K.CHOSEN, K.REJECTED):
        assert (pairs[side, K.REF_LOGPS] < 0).all()
    assert float(metrics["loss_dpo"]) == pytest.approx(math.log(2), abs=1e-4)
    assert float(metrics["rewards/margins"]) == pytest.approx(0.0, abs=1e-4)
    assert new.policy_version == 1


def test_all_ties_take_no_step():
    config = online_dpo.Config(**TINY, steps=2, batch_size=2, num_samples=2, lr=1e-2)
    initial = params(build_online_state(config)[0].model("policy"))
    flat = lambda prompts, completions, **_: [0.5] * len(completions)  # noqa: E731
    state, history = online_dpo.train(config, reward_fn=flat)
    assert [h["rollout/pairs"] for h in history] == [0.0, 0.0] and "loss" not in history[0]
    assert state.optimizer_steps == 0 and state.policy_version == 0 and state.samples_seen == 2 * 2 * 2
    assert all(torch.equal(a, b) for a, b in zip(initial, params(state.model("policy"))))


def test_reward_model_as_judge(tmp_path):
    reward_model = build_reward_model("llama", tokenizer=build_tokenizer(), hidden_size=32, num_layers=1,
                                      num_heads=4, seed=3)
    reward_model.save_pretrained(tmp_path / "rm")
    config = online_dpo.Config(**{**TINY, "run_dir": str(tmp_path / "run")}, steps=2, batch_size=2, num_samples=3,
                               lr=1e-3, reward_model=str(tmp_path / "rm"), save_every=2)
    state, history = online_dpo.train(config)
    judge = state.model("reward")
    assert not any(p.requires_grad for p in judge.parameters())
    assert history[0]["rollout/pairs"] == 2 and all(math.isfinite(h["loss"]) for h in history)
    assert history[0]["rollout/score_chosen"] > history[0]["rollout/score_rejected"]
    stored = sorted(p.name for p in (tmp_path / "run" / "checkpoint-2" / "models").iterdir())
    assert stored == ["policy"]  # the frozen judge and reference are not checkpointed


@pytest.mark.parametrize("loss_type", ["ipo", "hinge", "simpo"])
def test_other_pairwise_losses(loss_type):
    config = online_dpo.Config(**TINY, steps=1, batch_size=2, num_samples=3, lr=1e-3, loss_type=loss_type)
    state, history = online_dpo.train(config, reward_fn=digit_fraction)
    assert state.optimizer_steps == 1 and math.isfinite(history[0]["loss"])


def test_config_errors_fail_before_building():
    with pytest.raises(ValueError, match="unpaired"):
        online_dpo.train(online_dpo.Config(**TINY, loss_type="kto"))
    with pytest.raises(ValueError, match="at least 2"):
        online_dpo.train(online_dpo.Config(**TINY, num_samples=1))
    with pytest.raises(ValueError, match="loss_type: unknown 'nope'"):
        online_dpo.train(online_dpo.Config(**TINY, loss_type="nope"))
    with pytest.raises(ValueError, match=r"loss_kwargs: 'sigmoid' takes no \['gamma'\]"):
        online_dpo.train(online_dpo.Config(**TINY, loss_type="sigmoid", loss_kwargs={"gamma": 1.0}))


def test_yaml_config_loads_and_runs(tmp_path):
    config = load_config(online_dpo.Config, CONFIG, {"steps": 2, "run_dir": str(tmp_path), "save_every": 2,
                                                      "eval_every": 2, "num_eval": 4, "batch_size": 2})
    assert config.loss_type == "sigmoid" and config.beta == 0.1 and config.reward_model is None
    state, history = online_dpo.train(config)
    assert state.step == 2 and "eval/reward" in history[-1]


def test_sync_ref_model_moves_the_reference_and_checkpoints_it(tmp_path):
    config = online_dpo.Config(**{**TINY, "run_dir": str(tmp_path)}, steps=2, batch_size=4, num_samples=4, lr=1e-2,
                               sync_ref_model=True, ref_model_sync_steps=2, ref_model_mixup_alpha=1.0)
    initial, _ = build_online_state(config)
    state, history = online_dpo.train(config)
    assert sum(h["rollout/pairs"] for h in history) > 0
    moved = [not torch.equal(a, b) for a, b in zip(state.model("policy").parameters(),
                                                   initial.model("policy").parameters())]
    assert any(moved)
    # α = 1 after step 2: the reference is the trained policy itself
    assert all(torch.equal(a, b) for a, b in zip(state.model("ref").parameters(), state.model("policy").parameters()))
    assert (tmp_path / "checkpoint-2" / "models" / "ref").is_dir()
    with pytest.raises(ValueError, match=r"sync_ref_model: loss_type 'simpo'"):
        online_dpo.Config(loss_type="simpo", sync_ref_model=True)
