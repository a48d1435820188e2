"""PPO recipe (loops/recipes/ppo.py): raises a learnable reward, KL controller and score moments as state,
early stopping, ratio threshold, both critics, exact resume, YAML."""

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from rlcore.loops.recipes import ppo
from rlcore.loops.fold import stop_when
from rlcore.loops.models import ValueHead
from rlcore.loops.online import build_online_state
from rlcore.loops.evaluate import evaluate_policy
from rlcore.loops.config import load_config
from rlcore.transforms import KLControllerState, RunningMoments
from tests.loops.online_helpers import TINY, digit_fraction

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "ppo.yaml"


def params(module):
    return [p.detach().clone() for p in module.parameters()]


def test_ppo_raises_the_reward():
    # λ = 1 (Monte-Carlo advantages) and a heavier value loss: less dependence on the untrained critic
    config = ppo.Config(**TINY, steps=12, batch_size=8, num_samples=4, lr=5e-3, kl_coef=0.05, lam=1.0, vf_coef=0.5)
    before = evaluate_policy(build_online_state(config)[0], config, reward_fn=digit_fraction)
    state, history = ppo.train(config, reward_fn=digit_fraction)
    after = evaluate_policy(state, config, reward_fn=digit_fraction)
    assert state.optimizer_steps == 12 * 4  # 4 epochs, one minibatch each
    assert isinstance(state.model("value"), ValueHead)
    assert after["sampled_reward"] > before["sampled_reward"] + 0.15, (before, after)
    first, last = (sum(h["rollout/score"] for h in part) / 4 for part in (history[:4], history[-4:]))
    assert last > first + 0.1, [h["rollout/score"] for h in history]
    assert history[-1]["explained_variance"] > history[0]["explained_variance"]  # the critic learns too


def test_separate_critic_trains():
    config = ppo.Config(**TINY, steps=2, batch_size=4, num_samples=2, lr=1e-3, value_model="separate")
    state, _ = build_online_state(config, extra_models=lambda p: {"value": ppo.CRITICS["separate"].build(p, config)},
                                  trainable=("policy", "value"))
    critic = state.model("value")
    assert type(critic).__name__.endswith("ForTokenClassification")
    before = params(critic)
    state, history = ppo.train(config, reward_fn=digit_fraction)
    assert not all(torch.equal(a, b) for a, b in zip(before, params(state.model("value"))))
    assert all(math.isfinite(h["loss_value"]) and h["loss_value"] > 0 for h in history)


def test_kl_controller_and_score_moments_are_state():
    B, h = 4 * 2, 100.0
    config = ppo.Config(**TINY, steps=2, batch_size=4, num_samples=2, lr=1e-3, kl_coef=0.2, target=1e6, horizon=h)
    state, history = ppo.train(config, reward_fn=digit_fraction)
    kl = state.transforms["kl"]
    assert isinstance(kl, KLControllerState)
    # observed KL ≪ target: the error is clipped at −0.2 every step, β ← β·(1 − 0.2·B/horizon)
    assert float(kl.coef) == pytest.approx(0.2 * (1 - 0.2 * B / h) ** 2, rel=1e-12)
    assert [r["kl_coef"] for r in history] == pytest.approx([0.2, 0.2 * (1 - 0.2 * B / h)], rel=1e-12)
    moments = state.transforms["score_moments"]
    assert isinstance(moments, RunningMoments) and int(moments.count) == 2 * B
    assert float(moments.mean) == pytest.approx(sum(r["rollout/score"] for r in history) / 2, abs=1e-6)
    fixed, fixed_history = ppo.train(dataclasses.replace(config, kl_controller="fixed"), reward_fn=digit_fraction)
    assert float(fixed.transforms["kl"].coef) == pytest.approx(0.2)
    assert fixed_history[1]["kl_coef"] == pytest.approx(0.2)


def test_score_processing_uses_running_moments():
    config = ppo.Config(**TINY, steps=2, batch_size=4, num_samples=2, lr=1e-3, normalize=True)
    _, history = ppo.train(config, reward_fn=digit_fraction)
    assert abs(history[0]["rollout/score_processed"]) < 1e-5  # first batch: centred on its own mean
    assert history[0]["rollout/score"] > 0
    _, clipped = ppo.train(dataclasses.replace(config, normalize=False, clip=0.01), reward_fn=digit_fraction)
    assert 0 < clipped[0]["rollout/score_processed"] <= 0.01 + 1e-7 < clipped[0]["rollout/score"]


def test_early_stopping_stops_the_epochs():
    """TRL 0.7's rule by default: the KL is checked after each epoch (its steps kept); ``minibatch`` is stricter."""
    base = ppo.Config(**TINY, steps=1, batch_size=4, num_samples=2, epochs=3, minibatch_size=4, lr=1e-3,
                      early_stopping=True)
    always = dataclasses.replace(base, target_kl=-1.0)  # approx KL > −1.5 always
    state, history = ppo.train(always, reward_fn=digit_fraction)  # the first epoch's 2 steps, then stop
    assert history[0]["early_stop"] == 1.0 and state.optimizer_steps == 2 and state.policy_version == 1
    state, history = ppo.train(dataclasses.replace(always, early_stopping_check="minibatch"), reward_fn=digit_fraction)
    assert history[0]["early_stop"] == 1.0 and state.optimizer_steps == 0 and state.policy_version == 0
    never = dataclasses.replace(base, target_kl=1e9)
    state, history = ppo.train(never, reward_fn=digit_fraction)
    assert history[0]["early_stop"] == 0.0 and state.optimizer_steps == 3 * 2
    with pytest.raises(ValueError, match=r"early_stopping_check: unknown 'step'; valid: \['epoch', 'minibatch'\]"):
        ppo.train(dataclasses.replace(base, early_stopping_check="step"))


def test_ratio_threshold_skips_every_minibatch():
    config = ppo.Config(**TINY, steps=1, batch_size=4, num_samples=2, lr=1e-2, ratio_threshold=0.0)
    initial = params(build_online_state(config)[0].model("policy"))
    state, history = ppo.train(config, reward_fn=digit_fraction)
    assert history[0]["skipped_ratio_threshold"] == 1.0 and history[0]["loss"] == 0.0
    assert all(torch.equal(a, b) for a, b in zip(initial, params(state.model("policy"))))


def test_resume_is_exact(tmp_path):
    config = ppo.Config(**{**TINY, "num_train": 32}, steps=4, batch_size=4, num_samples=2, lr=1e-2, epochs=2,
                        minibatch_size=4, normalize=True, target=0.01, horizon=50.0, save_every=2,
                        keep_last=None, log_every=100)
    straight, straight_history = ppo.train(dataclasses.replace(config, run_dir=str(tmp_path / "a")),
                                           reward_fn=digit_fraction)
    interrupted = dataclasses.replace(config, run_dir=str(tmp_path / "b"))
    first, _ = ppo.train(interrupted, reward_fn=digit_fraction, callbacks=[stop_when(lambda s, m: s.step == 2)])
    assert first.step == 2 and (tmp_path / "b" / "checkpoint-2").is_dir()
    resumed, resumed_history = ppo.train(dataclasses.replace(interrupted, resume=True), reward_fn=digit_fraction)
    assert resumed.step == 4 and len(resumed_history) == 2
    assert resumed_history == straight_history[2:]
    for name in ("policy", "value"):
        for a, b in zip(straight.model(name).parameters(), resumed.model(name).parameters()):
            assert torch.equal(a, b)
    for key in ("kl", "score_moments"):
        for a, b in zip(straight.transforms[key], resumed.transforms[key]):
            assert torch.equal(a, b)
    assert torch.equal(straight.rng.get_state(), resumed.rng.get_state())
    assert (straight.samples_seen, straight.optimizer_steps) == (resumed.samples_seen, resumed.optimizer_steps)


def test_unknown_names_raise():
    with pytest.raises(ValueError, match=r"value_model: unknown 'tied'; valid: \['separate', 'shared'\]"):
        ppo.train(ppo.Config(**TINY, value_model="tied"))
    with pytest.raises(ValueError, match="valid"):
        ppo.train(ppo.Config(**TINY, kl_controller="pid"))


def test_yaml_config_loads_and_runs(tmp_path):
    config = load_config(ppo.Config, CONFIG, {"steps": 2, "run_dir": str(tmp_path), "save_every": 2,
                                               "eval_every": 2, "num_eval": 4, "batch_size": 2})
    assert config.kl_controller == "adaptive" and config.epochs == 4 and config.clip is None
    state, history = ppo.train(config)
    assert state.step == 2 and "eval/kl_ref" in history[-1]
    stored = sorted(p.name for p in (tmp_path / "checkpoint-2" / "models").iterdir())
    assert stored == ["policy", "value"]  # the frozen reference is rebuilt, not stored


@pytest.mark.parametrize("kl", ["abs", "k2"])
def test_the_kl_controller_sees_the_k1_kl_whatever_the_reward_estimator(kl, monkeypatch):
    """TRL feeds its controller mean_b Σ_t (logprob − ref) however kl_penalty shapes the reward."""
    from rlcore.transforms import StateTransform
    seen = []
    real = ppo.kl_controller

    def spy(name, **hyper):
        init, update = real(name, **hyper)
        return StateTransform(init, lambda state, current, n: seen.append(float(current)) or update(state, current, n))
    monkeypatch.setattr(ppo, "kl_controller", spy)
    config = ppo.Config(**TINY, steps=3, batch_size=4, num_samples=2, lr=5e-2, kl=kl)
    _, history = ppo.train(config, reward_fn=digit_fraction)
    assert seen == pytest.approx([h["rollout/kl_ref"] for h in history], abs=1e-6)
    assert any(abs(value) > 1e-3 for value in seen[1:])  # the policy moved: an estimator mix-up would show


# --- kl: full, the exact KL over the vocabulary (TRL kl_penalty="full") ---------------------------
def _moved_state_and_rollout(config):
    from tests.loops.online_helpers import collect_rollout
    from rlcore.loops.recipe import load_splits
    from rlcore.loops.tasks import task_dataset
    state, tokenizer = ppo.build_state(config)
    with torch.no_grad():  # the policy away from its reference
        for p in state.model("policy").parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    rows = load_splits(config, task_dataset)[0][:3]
    return collect_rollout(state, rows, config=config, tokenizer=tokenizer, reward_fn=digit_fraction)


def test_full_kl_is_the_vocabulary_sum_at_each_response_token():
    from rlcore import keys as K
    from rlcore.loops.score import full_kl_from_models
    config = ppo.Config(**TINY, batch_size=3, temperature=0.7)
    state, rollout = _moved_state_and_rollout(config)
    kl = full_kl_from_models(state.model("policy"), state.model("ref"), rollout, temperature=0.7)
    # written out: both models' full logits, softmax at τ, Σ_v π (log π − log π_ref) before each response token
    ids = torch.cat([rollout[K.PROMPT_IDS], rollout[K.RESPONSE_IDS]], -1)
    mask = torch.cat([rollout[K.PROMPT_MASK], rollout[K.RESPONSE_MASK]], -1)
    P, R = rollout[K.PROMPT_IDS].shape[1], rollout[K.RESPONSE_IDS].shape[1]
    with torch.no_grad():
        pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
        logp, logq = (torch.log_softmax(m(input_ids=ids, attention_mask=mask.long(), position_ids=pos).logits[
            :, P - 1:P - 1 + R].double() / 0.7, -1) for m in (state.model("policy"), state.model("ref")))
    want = (logp.exp() * (logp - logq)).sum(-1).where(rollout[K.RESPONSE_MASK], 0.0)
    torch.testing.assert_close(kl.double(), want, rtol=1e-4, atol=1e-6)
    assert (kl[rollout[K.RESPONSE_MASK]] > 0).all()
    chunked = full_kl_from_models(state.model("policy"), state.model("ref"), rollout, temperature=0.7,
                                  rows_per_forward=2)
    torch.testing.assert_close(chunked, kl, rtol=1e-5, atol=1e-6)
    same = full_kl_from_models(state.model("ref"), state.model("ref"), rollout, temperature=0.7)
    assert torch.count_nonzero(same) == 0


def test_kl_full_puts_the_exact_kl_in_the_reward():
    from rlcore import keys as K
    from rlcore.loops.score import full_kl_from_models
    config = ppo.Config(**TINY, batch_size=3, kl="full", kl_coef=0.3, micro_batch_size=2)
    state, rollout = _moved_state_and_rollout(config)
    _, prepared, info = ppo.rewards_and_advantages(state, rollout, config)
    mask = rollout[K.RESPONSE_MASK]
    full = full_kl_from_models(state.model("policy"), state.model("ref"), rollout)
    torch.testing.assert_close(prepared[K.KL], full)
    last = mask & ~torch.nn.functional.pad(mask[:, 1:], (0, 1), value=False)
    want = torch.where(mask, -0.3 * full + torch.where(last, prepared[K.SCORE][:, None], 0.0), 0.0)
    torch.testing.assert_close(prepared[K.REWARDS], want)
    history = ppo.train(dataclasses.replace(config, steps=2, lr=1e-2), reward_fn=digit_fraction)[1]
    assert all(math.isfinite(h["loss"]) for h in history)
    with pytest.raises(ValueError, match=r"kl: expected one of \[.*'full'\], got 'fulll'"):
        dataclasses.replace(config, kl="fulll")
