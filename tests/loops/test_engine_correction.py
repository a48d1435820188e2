"""The correction for a generation engine with numerics of its own (``engine: vllm``): TRL's
``vllm_importance_sampling_*`` weights against their formula, and the step's correction (the clip's old
policy the trainer's own, the surrogate weighted)."""

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore import keys as K
from rlcore.algorithms.ratios import ENGINE_IS_MODES, engine_importance_weights
from rlcore.loops.config import ConfigError, load_config
from rlcore.loops.online import engine_correction, with_policy_logprobs
from rlcore.loops.recipes import grpo, ppo, rloo
from tests.loops.online_helpers import TINY, collect_rollout

MASK = torch.tensor([[True, True, True, False], [True, False, False, False]])


def written_out(trainer, engine, mask, mode, low, high):
    """The weights as TRL's trainer defines them, row by row in Python floats."""
    out = []
    for t_row, e_row, m_row in zip(trainer.tolist(), engine.tolist(), mask.tolist()):
        d = [0.0 if math.isnan(t - e) else t - e for t, e in zip(t_row, e_row)]
        d = [x if m else 0.0 for x, m in zip(d, m_row)]
        ratios = [math.exp(sum(d))] * len(d) if mode.startswith("sequence") else [math.exp(x) for x in d]
        lo, hi = -math.inf if low is None else low, math.inf if high is None else high
        if mode.endswith("truncate"):
            ratios = [min(max(r, lo), hi) for r in ratios]
        else:
            ratios = [0.0 if (r < lo or r > hi) else r for r in ratios]
        out.append([r if m else 0.0 for r, m in zip(ratios, m_row)])
    return torch.tensor(out, dtype=torch.float64)


@settings(max_examples=80, deadline=None)
@given(mode=st.sampled_from(ENGINE_IS_MODES), low=st.sampled_from([None, 0.5, 0.9]),
       high=st.sampled_from([None, 1.1, 3.0]),
       t=st.lists(st.floats(-5, 0), min_size=8, max_size=8), e=st.lists(st.floats(-5, 0), min_size=8, max_size=8))
def test_engine_weights_are_trls_formula(mode, low, high, t, e):
    trainer = torch.tensor(t, dtype=torch.float64).view(2, 4)
    engine = torch.tensor(e, dtype=torch.float64).view(2, 4)
    w = engine_importance_weights(trainer, engine, MASK, mode=mode, clip_min=low, clip_max=high)
    torch.testing.assert_close(w, written_out(trainer, engine, MASK, mode, low, high), rtol=1e-12, atol=0)
    assert (w >= 0).all() and (w[~MASK] == 0).all()


def test_a_token_the_engine_could_not_score_has_ratio_one():
    trainer, engine = torch.tensor([[-1.0, -2.0]]), torch.tensor([[float("nan"), -2.5]])
    w = engine_importance_weights(trainer, engine, torch.tensor([[True, True]]), mode="token_truncate")
    torch.testing.assert_close(w, torch.tensor([[1.0, math.exp(0.5)]]))


def test_bad_modes_and_bounds_are_refused():
    t = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="mode: unknown 'sequence'"):
        engine_importance_weights(t, t, t.bool(), mode="sequence")
    with pytest.raises(ValueError, match="clip_min: expected C_min < C_max"):
        engine_importance_weights(t, t, t.bool(), clip_min=2.0, clip_max=1.0)
    for overrides, field in (({"vllm_importance_sampling_mode": "tis"}, "vllm_importance_sampling_mode"),
                             ({"vllm_importance_sampling_clip_min": 3.0}, "vllm_importance_sampling_clip_min"),
                             ({"vllm_importance_sampling_clip_max": 0.0}, "vllm_importance_sampling_clip_max")):
        for recipe in (grpo, rloo, ppo):
            with pytest.raises((ConfigError, ValueError), match=field):
                load_config(recipe.Config, overrides={**overrides, "run_dir": None})
    assert load_config(grpo.Config, overrides={"vllm_importance_sampling_cap": 2.0,
                                               "run_dir": None}).vllm_importance_sampling_clip_max == 2.0


@pytest.mark.parametrize("mode", ENGINE_IS_MODES)
def test_the_step_correction_takes_the_clip_against_the_trainer_and_weights_the_surrogate(mode):
    config = grpo.Config(**TINY, num_samples=2, batch_size=2, vllm_importance_sampling_mode=mode,
                         vllm_importance_sampling_clip_max=1.05)
    state, tokenizer = grpo.build_state(config)
    rows = {"prompt": ["1+1=", "2+2="], "answer": ["2", "4"]}
    _, rollout = collect_rollout(state, rows, config=config, tokenizer=tokenizer, reward_fn=lambda **kw: [1.0] * 4)
    assert engine_correction(state, rollout, config) is None  # the loop engine samples with the trainer's numerics
    noise = 0.05 * torch.randn(rollout[K.OLD_LOGPROBS].shape, generator=torch.Generator().manual_seed(0))
    engine_rollout = rollout.copy().update({K.OLD_LOGPROBS: rollout[K.OLD_LOGPROBS] + noise})  # as if from vLLM
    vllm = dataclasses.replace(config, engine="vllm")
    correct = engine_correction(state, engine_rollout, vllm)
    advantages = torch.randn(rollout[K.RESPONSE_MASK].shape, generator=torch.Generator().manual_seed(1))
    batch, stats = correct(engine_rollout.copy().update({K.ADVANTAGES: advantages}))
    with torch.no_grad():
        trainer = with_policy_logprobs(state.model("policy"), rollout)[K.LOGPROBS]
    mask = rollout[K.RESPONSE_MASK]
    torch.testing.assert_close(batch[K.OLD_LOGPROBS][mask], trainer[mask])
    w = written_out(trainer.double(), engine_rollout[K.OLD_LOGPROBS].double(), mask, mode, None, 1.05)
    torch.testing.assert_close(batch[K.ADVANTAGES][mask], (advantages * w.float())[mask])
    d = (trainer - engine_rollout[K.OLD_LOGPROBS])[mask].double()
    assert float(stats["sampling/sampling_logp_difference/max"]) == pytest.approx(float(d.abs().max()))
    assert float(stats["sampling/engine_kl"]) == pytest.approx(float((d.exp() - 1 - d).mean()), rel=1e-6)
    assert 0 <= float(stats["sampling/importance_sampling_ratio/min"]) <= float(
        stats["sampling/importance_sampling_ratio/max"])
    off = dataclasses.replace(vllm, vllm_importance_sampling_correction=False)
    assert engine_correction(state, engine_rollout, off) is None


def _engine_rollout(config, noise=0.05):
    """A rollout sampled by the loop engine, its behaviour log-probs shifted as another engine's would be."""
    config = dataclasses.replace(config, engine="loop")
    state, tokenizer = grpo.build_state(config)
    rows = {"prompt": ["1+1=", "2+2="], "answer": ["2", "4"]}
    _, rollout = collect_rollout(state, rows, config=config, tokenizer=tokenizer, reward_fn=lambda **kw: [1.0] * 4)
    shift = noise * torch.randn(rollout[K.OLD_LOGPROBS].shape, generator=torch.Generator().manual_seed(0))
    return state, rollout.copy().update({K.OLD_LOGPROBS: rollout[K.OLD_LOGPROBS] + shift})


def test_under_bf16_the_clip_starts_at_a_ratio_of_one():
    """The trainer's log-probs are taken as the loss takes them (autocast, padding-free): with the same
    rows in one forward, as here, an unchanged policy's first ratio is exactly 1 (another batching,
    ``forward_batch_size``, moves it by float rounding only)."""
    config = grpo.Config(**TINY, num_samples=2, batch_size=2, mixed_precision="bf16", padding_free=True,
                         engine="vllm")
    state, rollout = _engine_rollout(config)
    batch, _ = engine_correction(state, rollout, config)(rollout.copy().update(
        {K.ADVANTAGES: torch.ones(rollout[K.RESPONSE_MASK].shape)}))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        lp = with_policy_logprobs(state.model("policy"), batch, packed=True)[K.LOGPROBS]
    mask = batch[K.RESPONSE_MASK]
    torch.testing.assert_close(lp[mask], batch[K.OLD_LOGPROBS][mask], rtol=0, atol=0)


def test_tokens_the_engine_could_not_score_leave_the_statistics():
    config = grpo.Config(**TINY, num_samples=2, batch_size=2, engine="vllm")
    state, rollout = _engine_rollout(config, noise=0.0)
    with torch.no_grad():
        trainer = with_policy_logprobs(state.model("policy"), rollout)[K.LOGPROBS]
    mask = rollout[K.RESPONSE_MASK]
    engine = torch.where(mask, trainer - 0.1, trainer)
    first = mask.nonzero()[0]
    engine[first[0], first[1]] = float("nan")
    rollout = rollout.copy().update({K.OLD_LOGPROBS: engine, K.ADVANTAGES: torch.ones(mask.shape)})
    _, stats = engine_correction(state, rollout, config)(rollout)
    assert float(stats["sampling/sampling_logp_difference/mean"]) == pytest.approx(0.1, rel=1e-5)
    assert float(stats["sampling/engine_kl"]) == pytest.approx(math.exp(0.1) - 1 - 0.1, rel=1e-4)


def test_what_the_correction_does_not_cover_is_refused():
    from rlcore.loops.recipes.reft_recipes import ReftGrpoConfig

    with pytest.raises(ValueError, match="VESPO takes the engine's ratio inside its gamma weights"):
        grpo.Config(engine="vllm", loss_type="vespo")
    grpo.Config(engine="vllm", loss_type="vespo", vllm_importance_sampling_correction=False)
    with pytest.raises(ValueError, match="engine: vLLM samples from the model's plain weights"):
        ReftGrpoConfig(engine="vllm")
    # TRL's null cap leaves the bound as it is
    config = load_config(grpo.Config, overrides={"vllm_importance_sampling_cap": None, "run_dir": None})
    assert config.vllm_importance_sampling_clip_max == 3.0
