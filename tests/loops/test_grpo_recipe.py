"""GRPO recipe (loops/recipes/grpo.py): raises a learnable reward, loss presets by name, config, YAML."""

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from rlcore import keys as K
from rlcore.loops.recipes import grpo
from rlcore.loops.logging import read_jsonl
from rlcore.loops import online
from rlcore.loops.online import build_online_state
from rlcore.loops.filters import mask_truncated
from rlcore.loops.evaluate import evaluate_policy
from rlcore.loops.config import load_config
from tests.loops.online_helpers import TINY, digit_fraction, step_and_trained_batch

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "grpo.yaml"


def test_grpo_raises_the_reward():
    config = grpo.Config(**TINY, steps=12, batch_size=8, num_samples=4, lr=1e-2)
    before = evaluate_policy(build_online_state(config)[0], config, reward_fn=digit_fraction)
    state, history = grpo.train(config, reward_fn=digit_fraction)
    after = evaluate_policy(state, config, reward_fn=digit_fraction)
    assert len(history) == 12 and state.step == 12 and state.optimizer_steps == 12
    assert after["sampled_reward"] > before["sampled_reward"] + 0.15, (before, after)
    first, last = (sum(h["rollout/score"] for h in part) / 3 for part in (history[:3], history[-3:]))
    assert last > first + 0.1, [h["rollout/score"] for h in history]
    assert after["kl_ref"] > before["kl_ref"]  # it moved away from the reference


@pytest.mark.parametrize("loss_type", ["dr_grpo", "dapo", "gspo", "cispo", "bnpo", "luspo", "sapo", "vespo"])
def test_presets_run_by_name(loss_type):
    config = grpo.Config(**TINY, steps=2, batch_size=2, num_samples=3, lr=1e-3, loss_type=loss_type)
    state, history = grpo.train(config, reward_fn=digit_fraction)
    assert state.optimizer_steps == 2
    assert all(math.isfinite(h["loss"]) for h in history)


def test_kl_in_the_loss_when_kl_coef_is_positive():
    config = grpo.Config(**TINY, steps=2, batch_size=2, num_samples=3, lr=1e-2, kl_coef=0.5)
    _, history = grpo.train(config, reward_fn=digit_fraction)
    assert history[0]["loss_kl"] == pytest.approx(0.0, abs=1e-5)  # on-policy: π = π_ref at the first step
    assert history[1]["loss_kl"] > 0 and history[1]["kl_ref"] > 0
    assert history[1]["loss"] == pytest.approx(history[1]["loss_policy"] + history[1]["loss_kl"], abs=1e-6)
    _, no_kl = grpo.train(dataclasses.replace(config, kl_coef=0.0), reward_fn=digit_fraction)
    assert all(h["loss_kl"] == 0.0 for h in no_kl)


def test_grpo_loss_fn_binds_config():
    loss = grpo.grpo_loss_fn(grpo.Config(loss_type="gspo", kl_coef=0.1, max_new_tokens=12))
    assert loss.keywords == {"kl_coef": 0.1, "kl": "k3", "max_length": 12}  # the preset's clip range stays
    loss = grpo.grpo_loss_fn(grpo.Config(loss_type="dapo", clip_eps_high=0.3))
    assert loss.keywords["clip_eps_high"] == 0.3 and "clip_eps_low" not in loss.keywords


def test_unknown_loss_type_fails_before_building():
    with pytest.raises(ValueError, match=r"loss_type: unknown 'ppo'; valid: .*'grpo'"):
        grpo.train(grpo.Config(**TINY, loss_type="ppo"))


@pytest.mark.parametrize("scale", ["group", "none"])
def test_advantages_are_group_relative(monkeypatch, scale):
    config = grpo.Config(**TINY, steps=1, batch_size=3, num_samples=4, lr=1e-3,
                         advantage_kwargs={"scale": scale, "eps": 0.0})
    state, metrics, batch = step_and_trained_batch(grpo, config, monkeypatch)
    scores = batch[K.SCORE].view(3, 4).double()
    expected = scores - scores.mean(-1, keepdim=True)  # Dr. GRPO: r − μ_group
    if scale == "group":  # GRPO: divided by the group's unbiased σ (0 where the group ties)
        sd = scores.std(-1, keepdim=True)
        expected = torch.where(sd > 0, expected / sd.clamp(min=1e-30), 0.0)
    mask = batch[K.RESPONSE_MASK]
    for i, a in enumerate(expected.reshape(-1).float()):
        torch.testing.assert_close(batch[K.ADVANTAGES][i][mask[i]], a.expand(int(mask[i].sum())))
    assert state.optimizer_steps == 1 and math.isfinite(float(metrics["loss"]))


def test_a_new_estimator_needs_no_loop_edit(monkeypatch):
    """``advantage: opo`` (an entry of ``rlcore.baselines.ADVANTAGE_ESTIMATORS``, nothing else): the
    step trains on r − Σ l·r / Σ l per group, l the response lengths."""
    config = grpo.Config(**TINY, steps=1, batch_size=3, num_samples=4, lr=1e-3, advantage="opo")
    state, metrics, batch = step_and_trained_batch(grpo, config, monkeypatch)
    mask = batch[K.RESPONSE_MASK]
    r, n = batch[K.SCORE].view(3, 4).double(), mask.sum(-1).view(3, 4).double()
    expected = (r - (n * r).sum(-1, keepdim=True) / n.sum(-1, keepdim=True)).reshape(-1).float()
    for i, a in enumerate(expected):
        torch.testing.assert_close(batch[K.ADVANTAGES][i][mask[i]], a.expand(int(mask[i].sum())))
    assert state.optimizer_steps == 1 and math.isfinite(float(metrics["loss"]))


def test_the_advantage_estimator_is_chosen_by_name():
    """``advantage: dr_grpo`` is ``grpo`` with ``{scale: none}``: the same training, bit for bit; an
    unknown estimator or keyword is refused before any model is built."""
    config = grpo.Config(**TINY, steps=2, batch_size=2, num_samples=4, lr=1e-2)
    runs = [grpo.train(dataclasses.replace(config, **kw), reward_fn=digit_fraction)[0]
            for kw in ({"advantage": "dr_grpo"}, {"advantage_kwargs": {"scale": "none"}}, {})]
    named, keyword, default = ([p.detach().clone() for p in s.model("policy").parameters()] for s in runs)
    assert all(torch.equal(a, b) for a, b in zip(named, keyword))
    assert not all(torch.equal(a, b) for a, b in zip(named, default))  # σ-scaling changes the update
    with pytest.raises(ValueError, match=r"advantage: unknown 'a2c'"):
        grpo.train(dataclasses.replace(config, advantage="a2c"))
    with pytest.raises(ValueError, match=r"advantage_kwargs: 'grpo' takes no \['lam'\]"):
        grpo.train(dataclasses.replace(config, advantage_kwargs={"lam": 0.9}))
    with pytest.raises(ValueError, match=r"advantage_kwargs: expected a mapping"):
        grpo.train(dataclasses.replace(config, advantage_kwargs=["scale"]))


def test_yaml_config_loads_and_runs(tmp_path):
    config = load_config(grpo.Config, CONFIG, {"steps": 2, "run_dir": str(tmp_path), "save_every": 2,
                                                "eval_every": 2, "num_eval": 4, "batch_size": 2})
    assert config.loss_type == "grpo" and config.num_samples == 4
    state, history = grpo.train(config)
    assert state.step == 2 and "eval/reward" in history[-1] and "eval/exact_match" in history[-1]
    assert (tmp_path / "checkpoint-2" / "manifest.json").is_file()
    assert len(read_jsonl(tmp_path / "metrics.jsonl")) == 2
    with pytest.raises(ValueError, match="unknown keys"):
        load_config(grpo.Config, CONFIG, {"no_such_field": 1})


def test_evaluate_entry_point():
    config = grpo.Config(**{**TINY, "num_eval": 4}, steps=1)
    state, _ = build_online_state(config)
    out = grpo.evaluate(state, config)
    assert {"reward", "exact_match", "kl_ref"} <= set(out) and out["reward"] >= 0.0
    assert torch.equal(state.rng.get_state(), build_online_state(config)[0].rng.get_state())


def test_soft_overlong_punishment_shapes_the_score():
    """The score a step trains on is the reward plus DAPO's length penalty (written out here)."""
    from tests.loops.online_helpers import collect_rollout
    config = grpo.Config(**TINY, batch_size=2, num_samples=4, overlong_buffer=3, overlong_penalty_factor=0.5)
    state, tokenizer = online.build_online_state(config)
    rows = {"prompt": ["12+3=", "4+5="], "answer": ["15", "9"]}
    _, shaped = collect_rollout(state, rows, config=config, tokenizer=tokenizer, reward_fn=digit_fraction)
    _, plain = collect_rollout(state, rows, config=dataclasses.replace(config, overlong_buffer=None),
                               tokenizer=tokenizer, reward_fn=digit_fraction)
    lengths = plain[K.RESPONSE_MASK].sum(-1).tolist()
    expected = [min(0.0, (8 - 3 - n) / 3) * 0.5 for n in lengths]
    assert (shaped[K.SCORE] - plain[K.SCORE]).tolist() == pytest.approx(expected)
    with pytest.raises(ValueError, match=r"overlong_buffer: expected at most max_new_tokens=8, got 9"):
        grpo.train(dataclasses.replace(config, overlong_buffer=9))


def test_dapo_config_trains():
    config = load_config(grpo.Config, CONFIG.parent / "dapo.yaml", {"steps": 2, "run_dir": None, "eval_every": 0})
    assert (config.loss_type, config.overlong_buffer, config.kl_coef, config.dynamic_sampling) == ("dapo", 4, 0.0, True)
    _, history = grpo.train(config)
    assert len(history) == 2 and all(math.isfinite(h["loss"]) for h in history)
    assert all(1 <= h["rollout/sampling_rounds"] <= 3 for h in history)


def test_truncated_responses_are_flagged_and_can_leave_the_loss(monkeypatch):
    """``truncated`` marks the responses that used the whole budget with no stop token; with
    ``mask_truncated_completions`` their tokens leave the loss after the advantages were taken
    (the group statistics still count them), and the metrics report the fraction."""
    stops = list(range(3, 15))  # several stop tokens: some responses stop within the 3-token budget, some do not
    config = grpo.Config(**{**TINY, "max_new_tokens": 3}, batch_size=2, num_samples=8, seed=1, stop_token_ids=stops)
    _, plain_metrics, plain = step_and_trained_batch(grpo, config, monkeypatch)
    mask, truncated = plain[K.RESPONSE_MASK], plain[K.TRUNCATED]
    assert truncated.any() and (~truncated).any(), truncated
    assert (mask[truncated].sum(-1) == 3).all()
    # a stopped response's last token in the mask is its stop token
    assert all(int(row[m][-1]) in [*stops, 2] for row, m in zip(plain[K.RESPONSE_IDS][~truncated], mask[~truncated]))
    assert float(plain_metrics["rollout/truncated"]) == pytest.approx(truncated.float().mean().item())
    _, _, masked = step_and_trained_batch(grpo, dataclasses.replace(config, mask_truncated_completions=True),
                                          monkeypatch)
    torch.testing.assert_close(masked[K.ADVANTAGES], plain[K.ADVANTAGES], rtol=0, atol=0)  # taken before
    assert torch.equal(masked[K.RESPONSE_MASK], mask & ~truncated[:, None])
    assert torch.equal(masked[K.ATTENTION_MASK], torch.cat([masked[K.PROMPT_MASK], masked[K.RESPONSE_MASK]], -1))
    unflagged = plain.exclude(K.TRUNCATED)
    assert mask_truncated(unflagged) is unflagged


def test_no_reference_forward_without_a_kl_term(monkeypatch):
    """kl_coef = 0: scoring skips the reference (TRL's beta = 0); with a KL term it runs, and is logged."""
    import rlcore.loops.online as online

    calls = []
    real = online.score_rollout
    monkeypatch.setattr(online, "score_rollout", lambda *a, **k: calls.append(k["ref"] is not None) or real(*a, **k))
    _, off = grpo.train(grpo.Config(**TINY, steps=1, num_samples=2, kl_coef=0.0), reward_fn=digit_fraction)
    _, on = grpo.train(grpo.Config(**TINY, steps=1, num_samples=2, kl_coef=0.1), reward_fn=digit_fraction)
    assert calls == [False, True]
    assert "rollout/kl_ref" not in off[0] and "rollout/kl_ref" in on[0]


@pytest.mark.parametrize("advantage", ["remax", "gae", "reinforce_pp"])
def test_an_estimator_grpo_cannot_feed_is_refused_when_the_config_is_made(advantage):
    """GRPO's rollout holds scores, not token rewards, values or a greedy baseline."""
    with pytest.raises(ValueError, match=rf"advantage: the grpo recipe cannot run '{advantage}'.*choose one of "
                                         r"\['dr_grpo', 'grpo', 'opo', 'rloo'\]"):
        grpo.Config(**TINY, advantage=advantage)


def test_one_sample_per_prompt_is_refused():
    with pytest.raises(ValueError, match=r"num_samples: the 'grpo' advantage compares the samples of one prompt"):
        grpo.Config(**TINY, num_samples=1)
