"""RLOO recipe (loops/recipes/rloo.py): raises a learnable reward, KL in the reward, config checks, YAML."""

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from rlcore import keys as K
from rlcore.baselines import rloo_advantage
from rlcore.loops.recipes import rloo
from rlcore.loops.online import build_online_state
from rlcore.loops.evaluate import evaluate_policy
from rlcore.loops.config import load_config
from tests.loops.online_helpers import TINY, digit_fraction, step_and_trained_batch

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "rloo.yaml"


def test_rloo_raises_the_reward():
    config = rloo.Config(**TINY, steps=12, batch_size=8, num_samples=4, lr=1e-2)
    before = evaluate_policy(build_online_state(config)[0], config, reward_fn=digit_fraction)
    state, history = rloo.train(config, reward_fn=digit_fraction)
    after = evaluate_policy(state, config, reward_fn=digit_fraction)
    assert state.optimizer_steps == 12 and state.samples_seen == 12 * 8 * 4
    assert after["sampled_reward"] > before["sampled_reward"] + 0.15, (before, after)
    first, last = (sum(h["rollout/score"] for h in part) / 3 for part in (history[:3], history[-3:]))
    assert last > first + 0.1, [h["rollout/score"] for h in history]


@pytest.mark.parametrize("advantage", ["rloo", "grpo"])
def test_kl_penalty_is_in_the_reward_and_advantages_are_leave_one_out(monkeypatch, advantage):
    """The default estimator is leave-one-out; ``advantage: grpo`` puts GRPO's (r − μ)/(σ + eps) on the
    same KL-penalised sequence rewards, with no other change to the step."""
    config = rloo.Config(**TINY, steps=1, batch_size=3, num_samples=3, lr=1e-3, kl_coef=0.5, advantage=advantage,
                         advantage_kwargs={"eps": 0.0} if advantage == "grpo" else {})
    state, metrics, batch = step_and_trained_batch(rloo, config, monkeypatch)
    mask = batch[K.RESPONSE_MASK]
    kl = torch.where(mask, batch[K.OLD_LOGPROBS] - batch[K.REF_LOGPROBS], 0.0).sum(-1)
    sequence_reward = batch[K.SCORE] - 0.5 * kl  # TRL: r = score − β·Σ_t k1
    torch.testing.assert_close(torch.where(mask, batch[K.REWARDS], 0.0).sum(-1), sequence_reward)
    r = sequence_reward.view(3, 3).double()
    sd = r.std(-1, keepdim=True)  # written out: the group's unbiased σ, 0 advantage where the group ties
    grpo = torch.where(sd > 0, (r - r.mean(-1, keepdim=True)) / sd.clamp(min=1e-30), 0.0).float()
    expected = (rloo_advantage(sequence_reward.view(3, 3)) if advantage == "rloo" else grpo).reshape(-1)
    for i in range(9):  # the same advantage on every token of a response
        torch.testing.assert_close(batch[K.ADVANTAGES][i][mask[i]], expected[i].expand(int(mask[i].sum())))
    assert state.policy_version == 1 and math.isfinite(float(metrics["loss"]))


def test_needs_two_samples_per_prompt():
    with pytest.raises(ValueError, match="num_samples: RLOO needs at least 2"):
        rloo.train(rloo.Config(**TINY, num_samples=1))
    with pytest.raises(ValueError, match=r"advantage: unknown 'a2c'; valid: \['dr_grpo', 'gae'"):
        rloo.train(rloo.Config(**TINY, advantage="a2c"))
    with pytest.raises(ValueError, match=r"advantage_kwargs: 'rloo' takes no \['scale'\]; its parameters: "
                                         r"\['group_size'\]"):
        rloo.train(rloo.Config(**TINY, advantage_kwargs={"scale": "batch"}))


def test_yaml_config_loads_and_runs(tmp_path):
    config = load_config(rloo.Config, CONFIG, {"steps": 2, "run_dir": str(tmp_path), "save_every": 2,
                                                "eval_every": 2, "num_eval": 4, "batch_size": 2})
    assert config.kl_coef == 0.05 and config.num_samples == 4
    state, history = rloo.train(config)
    assert state.step == 2 and "eval/sampled_reward" in history[-1]
    assert (tmp_path / "checkpoint-2" / "manifest.json").is_file()


def test_minibatches_and_epochs():
    config = rloo.Config(**TINY, steps=1, batch_size=4, num_samples=2, epochs=2, minibatch_size=3,
                         micro_batch_size=2, lr=1e-3)
    state, history = rloo.train(config, reward_fn=digit_fraction)
    assert state.optimizer_steps == 2 * 3  # ⌈8 / 3⌉ minibatches per epoch
    state, _ = rloo.train(dataclasses.replace(config, minibatch_size=100), reward_fn=digit_fraction)  # capped
    assert state.optimizer_steps == 2


@pytest.mark.parametrize("kwargs,message", [
    ({"advantage": "remax"}, r"advantage: the rloo recipe cannot run 'remax': it reads baseline_score"),
    ({"advantage": "gae"}, r"advantage: the rloo recipe cannot run 'gae': it reads values"),
    ({"kl": "full"}, r"kl: expected one of .*got 'full'"),
])
def test_a_setting_rloo_cannot_run_is_refused_when_the_config_is_made(kwargs, message):
    with pytest.raises(ValueError, match=message):
        rloo.Config(**TINY, **kwargs)


def test_reinforce_pp_runs_on_rloo_token_rewards():
    state, history = rloo.train(rloo.Config(**TINY, steps=1, batch_size=2, advantage="reinforce_pp"),
                                reward_fn=digit_fraction)
    assert state.step == 1 and math.isfinite(history[-1]["loss"])
