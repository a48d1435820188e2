"""async_rl and async_learners: the off-policy correction kernels, the learners, and the generator
process against the synchronous recipes.

The loop tests start the generator with ``start_method="forkserver"``: the server imports
rlcore.loops once per test session, every generator then forks from it in a fraction of a second.
"""

import contextlib
import importlib.util
import dataclasses
import inspect
import math
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore import keys as K
from rlcore.loops.recipes import RECIPES, by_config, grpo, online_dpo, ppo, rloo, sft
from rlcore.loops.scale import async_rl
from rlcore.loops.scale.async_learners import (check_learner, importance_correction, learn_off_policy,
                                               off_policy_metrics, online_recipe, truncated_importance_weights,
                                               with_importance_correction)
from rlcore.loops.scale.async_rl import check_max_lag, train_async
from rlcore.loops.checkpoint import list_checkpoints, load_checkpoint
from rlcore.loops.recipes.reft_recipes import ReftGrpoConfig
from rlcore.testing import assert_padding_invariant, assert_pure, make_rollout, right_padded_mask
from tests.loops.online_helpers import flat_models

METHOD = "forkserver"


# --- kernels ------------------------------------------------------------------------------------
def reference_weights(prox, behav, mask, clip, level):
    """Plain loops over rows and tokens."""
    B, T = prox.shape
    out = torch.zeros(B, T, dtype=prox.dtype)
    for b in range(B):
        valid = [t for t in range(T) if mask[b, t]]
        total = sum(float(prox[b, t] - behav[b, t]) for t in valid)
        for t in valid:
            log_w = {"token": float(prox[b, t] - behav[b, t]), "sequence": total / len(valid),
                     "sequence_sum": total}[level]
            out[b, t] = min(math.exp(log_w), clip)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("level", ["token", "sequence", "sequence_sum"])
def test_truncated_weights_match_the_reference(level, dtype):
    g = torch.Generator().manual_seed(0)
    prox, behav = (-torch.rand(4, 6, generator=g, dtype=torch.float64) * 2).to(dtype), \
        (-torch.rand(4, 6, generator=g, dtype=torch.float64) * 2).to(dtype)
    mask = right_padded_mask(torch.tensor([6, 3, 1, 0]), 6)
    for clip in (0.5, 1.0, 3.0):
        got = assert_pure(truncated_importance_weights, prox, behav, mask, clip=clip, level=level)
        tol = 1e-12 if dtype == torch.float64 else 1e-5
        torch.testing.assert_close(got, reference_weights(prox, behav, mask, clip, level).to(dtype), rtol=tol, atol=tol)
        assert got.dtype == dtype and (got[~mask] == 0).all() and (got <= clip).all()


def test_truncated_weights_golden_and_no_overflow():
    prox, behav = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-2.0, -1.0]])
    m = torch.ones(1, 2, dtype=torch.bool)
    torch.testing.assert_close(truncated_importance_weights(prox, behav, m, clip=2.0),
                               torch.tensor([[2.0, math.exp(-1.0)]]))
    far = truncated_importance_weights(torch.zeros(1, 3), torch.full((1, 3), -400.0), torch.ones(1, 3, dtype=torch.bool),
                                       clip=5.0, level="sequence_sum")  # exp(1200) would overflow
    torch.testing.assert_close(far, torch.full((1, 3), 5.0))


def test_truncated_weights_ignore_padding_and_have_no_gradient():
    batch = make_rollout(5, 6, 3, empty_rows=1, generator=torch.Generator().manual_seed(1))

    def fn(b):
        return truncated_importance_weights(b[K.LOGPROBS], b[K.OLD_LOGPROBS], b[K.RESPONSE_MASK], clip=2.0)

    assert_padding_invariant(fn, batch, fill=float("nan"))
    prox = batch[K.LOGPROBS].clone().requires_grad_()
    assert not truncated_importance_weights(prox, batch[K.OLD_LOGPROBS], batch[K.RESPONSE_MASK]).requires_grad


def test_truncated_weights_bad_input():
    x, m = torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(TypeError, match="mask: expected a torch.bool mask"):
        truncated_importance_weights(x, x, m.float())
    with pytest.raises(ValueError, match=r"behaviour_logprobs: expected shape \[2, 3\].*got \[2, 4\]"):
        truncated_importance_weights(x, torch.zeros(2, 4), m)
    with pytest.raises(ValueError, match="clip: expected C > 0"):
        truncated_importance_weights(x, x, m, clip=0.0)
    with pytest.raises(ValueError, match="level"):
        truncated_importance_weights(x, x, m, level="bogus")


@settings(max_examples=30, deadline=None)
@given(st.floats(-3, 3), st.floats(0.1, 4.0))
def test_on_policy_weights_are_one_and_correction_is_identity(shift, clip):
    """prox = behaviour: w = min(1, C); with C ≥ 1 the corrected rollout equals the input."""
    batch = make_rollout(4, 5, 3, generator=torch.Generator().manual_seed(2)).update(
        {K.ADVANTAGES: torch.full((4, 5), shift)})
    out = assert_pure(with_importance_correction, batch, batch[K.OLD_LOGPROBS], clip=clip)
    mask = batch[K.RESPONSE_MASK]
    expected = torch.where(mask, torch.full((4, 5), shift * min(1.0, clip)), 0.0)
    torch.testing.assert_close(out[K.ADVANTAGES], expected)
    torch.testing.assert_close(out[K.OLD_LOGPROBS], batch[K.OLD_LOGPROBS])


def test_correction_weights_advantages_and_recentres_the_ratio():
    batch = make_rollout(3, 4, 2, generator=torch.Generator().manual_seed(3))
    batch = batch.update({K.ADVANTAGES: torch.ones(3, 4)})
    prox = batch[K.OLD_LOGPROBS] + 0.3
    out = with_importance_correction(batch, prox, clip=1.2, level="token")
    mask = batch[K.RESPONSE_MASK]
    torch.testing.assert_close(out[K.ADVANTAGES], torch.where(mask, torch.tensor(min(math.exp(0.3), 1.2)), 0.0))
    assert torch.equal(out[K.OLD_LOGPROBS], prox)


def test_off_policy_metrics_golden():
    batch = make_rollout(2, 3, 2, generator=torch.Generator().manual_seed(4))
    batch = batch.update({K.RESPONSE_MASK: torch.tensor([[True, True, False], [True, False, False]]),
                          K.OLD_LOGPROBS: torch.tensor([[-1.0, -2.0, 9.0], [-3.0, 9.0, 9.0]]),
                          K.POLICY_VERSION: torch.tensor([4, 5])})
    prox = torch.tensor([[-1.5, -1.0, 0.0], [-2.0, 0.0, 0.0]])
    m = off_policy_metrics(batch, prox, learner_version=6)
    assert float(m["async/staleness"]) == 1.5 and float(m["async/staleness_max"]) == 2.0
    assert float(m["async/logprob_gap"]) == pytest.approx((0.5 - 1.0 - 1.0) / 3)
    assert float(m["async/logprob_abs_gap"]) == pytest.approx((0.5 + 1.0 + 1.0) / 3)


@pytest.mark.parametrize("recipe", [grpo, rloo, ppo, online_dpo])
def test_the_learner_is_the_table_entry_of_its_config(recipe):
    """One code path: the learner runs the recipe's own ``learn``, found in the recipe table by the
    config's type; no recipe is named anywhere else."""
    entry = RECIPES[recipe.__name__.rsplit(".", 1)[-1]]
    assert (entry.config, entry.learn, entry.build_state) == (recipe.Config, recipe.learn, recipe.build_state)
    assert online_recipe(recipe.Config()) is entry and check_learner(recipe.Config(), None) is entry
    assert by_config(recipe.Config) is entry


def test_only_the_online_recipes_learn():
    assert sorted(name for name, r in RECIPES.items() if r.learn is not None) == ["grpo", "online_dpo", "ppo", "rloo"]
    for name, r in RECIPES.items():
        if r.learn is None:
            with pytest.raises(TypeError, match=r"config: expected the Config of an online recipe"):
                online_recipe(r.config())


def test_ratio_levels_for_is_clip():
    level = {name: RECIPES[name].ratio_level for name in ("ppo", "rloo", "grpo", "online_dpo")}
    assert level["ppo"](ppo.Config()) == "token"
    assert level["rloo"](rloo.Config()) == "sequence_sum"
    assert level["grpo"](grpo.Config()) == "token"
    assert level["grpo"](grpo.Config(loss_type="gspo")) == "sequence"
    assert level["grpo"](grpo.Config(loss_type="rloo")) == "sequence_sum"
    assert level["grpo"](grpo.Config(loss_type="gspo", importance_sampling_level="token")) == "token"
    assert level["online_dpo"] is None
    for loss_type in grpo.POLICY_LOSSES:  # the level the bound loss computes its ratio at
        for chosen in (None, "token", "sequence"):
            config = grpo.Config(loss_type=loss_type, importance_sampling_level=chosen)
            bound = inspect.signature(grpo.grpo_loss_fn(config)).parameters["ratio_level"].default
            assert level["grpo"](config) == bound, (loss_type, chosen)


def test_bad_arguments_fail_before_any_process(monkeypatch):
    monkeypatch.setattr(async_rl, "generator_process", None)  # reaching it would raise TypeError
    with pytest.raises(ValueError, match=r"is_clip: 'online_dpo' has no importance ratio"):
        train_async(online_dpo.Config(), is_clip=2.0)
    with pytest.raises(ValueError, match=r"is_clip: expected C > 0"):
        train_async(ppo.Config(), is_clip=0.0)
    with pytest.raises(TypeError, match=r"config: expected the Config of an online recipe .* got "
                                        r"rlcore.loops.recipes.sft.Config"):
        train_async(sft.Config())
    with pytest.raises(TypeError, match=r"got rlcore.loops.recipes.reft_recipes.ReftGrpoConfig"):  # not grpo's learn
        train_async(ReftGrpoConfig())
    with pytest.raises(ValueError, match="value_model: unknown 'tied'"):  # the recipe's own checks
        train_async(ppo.Config(value_model="tied"))
    with pytest.raises(ValueError, match="num_samples: online DPO"):
        train_async(online_dpo.Config(num_samples=1))
    with pytest.raises(ValueError, match=r"max_lag: expected an int ≥ 0, got -1"):
        train_async(grpo.Config(), max_lag=-1)
    with pytest.raises(ValueError, match="is_clip: 'online_dpo' has no importance ratio"):  # before scoring
        learn_off_policy(None, {}, None, config=online_dpo.Config(), is_clip=1.0)


def test_check_learner_and_max_lag_errors_name_the_argument():
    with pytest.raises(TypeError, match=r"config: expected the Config of an online recipe"):
        check_learner(object(), None)
    with pytest.raises(ValueError, match=r"is_clip: 'online_dpo' has no importance ratio to correct"):
        check_learner(online_dpo.Config(), 1.0)
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match=r"is_clip: expected C > 0 or None, got"):
            check_learner(rloo.Config(), bad)
    for bad in (-1, 1.0, True, None):
        with pytest.raises(ValueError, match=r"max_lag: expected an int ≥ 0, got"):
            check_max_lag(bad)
    assert check_max_lag(0) is None and check_max_lag(3) is None


def test_learn_off_policy_is_score_samples_then_the_recipes_learn():
    """``learn_off_policy`` = ``online.score_samples`` then ``ppo.learn`` with the importance correction
    of the learner's own log-probs at PPO's ratio level."""
    from rlcore.loops.chunks import generate_in_chunks
    from rlcore.loops.collect import draw_seed
    from rlcore.loops.online import generate_kwargs, replay_seed_draw, score_samples, with_policy_logprobs
    from rlcore.loops.state import copy_generator

    config = ppo.Config(**TINY, num_samples=2, steps=1, lr=1e-2)
    rows = {"prompt": ["1+2=", "3+4="], "answer": ["3", "7"]}
    results = []
    for split in (False, True):
        torch.manual_seed(0)
        state, tokenizer = ppo.build_state(config)
        rollout = generate_in_chunks(state.model("policy"), tokenizer, rows["prompt"],
                                     **generate_kwargs(config, max_prompt_length=config.max_prompt_length),
                                     seed=draw_seed(copy_generator(state.rng)), policy_version=0)
        if split:
            state, scored = score_samples(replay_seed_draw(state), rows, rollout, generation=config, rewards=config,
                                            total_steps=config.steps, tokenizer=tokenizer,
                                            reward_fn=digits)
            with torch.no_grad():
                prox = with_policy_logprobs(state.model("policy"), scored)[K.LOGPROBS]
            stats = off_policy_metrics(scored, prox, state.policy_version)
            state, metrics = ppo.learn(state, scored, config,
                                       correction=importance_correction(prox, clip=2.0, level="token"))
            results.append((state, metrics.update(stats)))
        else:
            results.append(learn_off_policy(state, rows, rollout, config=config, tokenizer=tokenizer, reward_fn=digits,
                                            is_clip=2.0))
    (a, ma), (b, mb) = results
    assert torch.equal(flat_models(a), flat_models(b)) and torch.equal(a.rng.get_state(), b.rng.get_state())
    assert (a.samples_seen, a.tokens_seen, a.policy_version) == (b.samples_seen, b.tokens_seen, b.policy_version)
    assert set(ma.keys()) == set(mb.keys()) and all(torch.equal(ma[k], mb[k]) for k in ma.keys())
    assert "async/is_weight" in ma.keys() and "kl_coef" in ma.keys()  # correction on, learn's metrics kept


# --- the loop ---------------------------------------------------------------------------------------
def digits(prompts, completions, **_):
    """Reward: the fraction of digits in the completion (a random tiny model starts near 0.1)."""
    return [sum(c.isdigit() for c in x) / max(1, len(x)) for x in completions]


TINY = dict(hidden_size=16, num_layers=1, num_heads=2, max_new_tokens=6, batch_size=2, num_train=32,
            num_eval=4, run_dir=None, log_every=0)


def flat(state):
    return torch.cat([p.detach().reshape(-1) for p in state.model().parameters()])


NO_LAG_CASES = [(grpo, {}), (rloo, {}), (grpo, {"minibatch_size": 4, "epochs": 2}),  # shuffled minibatches
                (ppo, {}), (ppo, {"value_model": "separate", "minibatch_size": 4}), (online_dpo, {}),
                # LoRA policies: the generator's copy carries the adapter, the reference is the adapter off
                (grpo, {"use_peft": True, "lora_r": 4, "lora_modules_to_save": ("lm_head",)}),
                (ppo, {"use_peft": True, "lora_r": 4})]


@pytest.mark.parametrize("recipe, extra", NO_LAG_CASES, ids=lambda x: x.__name__.rsplit(".", 1)[-1]
                         if hasattr(x, "__name__") else ",".join(f"{k}={v}" for k, v in x.items()) or "default")
def test_no_lag_reproduces_the_synchronous_recipe(recipe, extra):
    """N = 0: same seeds, same rollouts, same parameters (critic included), same transform states
    and the same metrics as the recipe's own synchronous step."""
    config = recipe.Config(**TINY, num_samples=4, steps=3, lr=1e-2, **extra)
    sync_state, sync_hist = recipe.train(config, reward_fn=digits)
    state, hist = train_async(config, max_lag=0, reward_fn=digits,
                              start_method=METHOD)
    assert torch.equal(flat_models(state), flat_models(sync_state))
    assert (state.step, state.policy_version, state.samples_seen, state.tokens_seen, state.optimizer_steps) == \
        (sync_state.step, sync_state.policy_version, sync_state.samples_seen, sync_state.tokens_seen,
         sync_state.optimizer_steps)
    assert torch.equal(state.rng.get_state(), sync_state.rng.get_state())
    assert str(state.transforms) == str(sync_state.transforms)  # PPO: KL controller, score moments
    assert [{k: v for k, v in h.items() if not k.startswith("async/")} for h in hist] == sync_hist
    assert all(h["async/staleness_max"] == 0 and abs(h["async/logprob_gap"]) < 1e-4 for h in hist)
    assert not torch.equal(flat(state), flat(recipe.train(dataclasses.replace(config, steps=2), reward_fn=digits)[0]))


def test_one_step_lag_overlaps_and_still_learns():
    config = grpo.Config(**TINY, num_samples=4, steps=24, lr=1e-2)
    state, hist = train_async(config, max_lag=1, is_clip=2.0, reward_fn=digits, start_method=METHOD)
    assert state.step == 24 and state.policy_version == 24
    assert sum(h["async/overlap_s"] for h in hist) > 0  # generation of t+1 ran during the update on t
    assert all(h["async/staleness_max"] <= 1 for h in hist) and hist[-1]["async/staleness"] == 1
    assert all(0 < h["async/is_weight"] <= 2 for h in hist)
    scores = [h["rollout/score"] for h in hist]
    assert sum(scores[-6:]) / 6 > sum(scores[:6]) / 6 + 0.05, scores


@pytest.mark.parametrize("recipe, is_clip", [(ppo, 2.0), (ppo, None), (online_dpo, None)],
                         ids=["ppo-is_clip", "ppo", "online_dpo"])
def test_one_step_lag_records_staleness_and_versions(recipe, is_clip, monkeypatch):
    """N = 1: rollout t comes from version t − 1 or t (0 for the first), as the metrics say."""
    seen, real_learn = [], async_rl.learn_off_policy  # the name train_async's step calls

    def recording_learn(state, rows, rollout, **kwargs):
        seen.append((state.policy_version, rollout[K.POLICY_VERSION].unique().tolist()))
        return real_learn(state, rows, rollout, **kwargs)

    monkeypatch.setattr(async_rl, "learn_off_policy", recording_learn)
    config = recipe.Config(**TINY, num_samples=2, steps=5, lr=1e-2)
    state, hist = train_async(config, max_lag=1, is_clip=is_clip,
                              reward_fn=digits, start_method=METHOD)
    assert state.step == 5 and len(seen) == 5 and seen[0] == (0, [0])
    for (learner_version, (rollout_version,)), h in zip(seen, hist):
        assert 0 <= learner_version - rollout_version <= 1
        assert h["async/staleness"] == h["async/staleness_max"] == learner_version - rollout_version
    assert all(h["async/staleness_max"] <= 1 for h in hist) and any(h["async/staleness"] == 1 for h in hist)
    if is_clip is None:
        assert not any(k.startswith("async/is_") for k in hist[-1])
    else:
        assert all(0 < h["async/is_weight"] <= is_clip and 0 <= h["async/is_truncated"] <= 1 for h in hist)
        assert hist[0]["async/is_weight"] == pytest.approx(1.0, abs=1e-3)  # on-policy at the first step


def test_correction_keeps_the_behaviour_rollout_metrics(monkeypatch):
    """With is_clip the loss sees old_logprobs = π_prox, the logged rollout/kl_ref stays π_b's."""
    config = grpo.Config(**TINY, num_samples=2, steps=1, lr=1e-2, kl_coef=0.1)
    _, sync_hist = grpo.train(config, reward_fn=digits)
    _, hist = train_async(config, max_lag=0, is_clip=1.0, reward_fn=digits, start_method=METHOD)
    assert hist[0]["rollout/kl_ref"] == sync_hist[0]["rollout/kl_ref"]


@contextlib.contextmanager
def recorded_generator(monkeypatch):
    handles = []
    original = async_rl.generator_process

    @contextlib.contextmanager
    def recording(*args, **kwargs):
        with original(*args, **kwargs) as handle:
            handles.append(handle)
            yield handle

    monkeypatch.setattr(async_rl, "generator_process", recording)
    yield handles


def assert_stopped(handle):
    assert not handle.process.is_alive() and handle.process.exitcode is not None
    with pytest.raises(ProcessLookupError):
        os.kill(handle.process.pid, 0)  # gone, and reaped: not an orphan, not a zombie


@pytest.mark.parametrize("recipe, error", [(grpo, RuntimeError), (grpo, KeyboardInterrupt), (ppo, KeyboardInterrupt),
                                           (online_dpo, RuntimeError)],
                         ids=["grpo-RuntimeError", "grpo-KeyboardInterrupt", "ppo-KeyboardInterrupt",
                              "online_dpo-RuntimeError"])
def test_interrupted_learner_leaves_no_process_and_no_partial_checkpoint(tmp_path, monkeypatch, recipe, error):
    config = recipe.Config(**{**TINY, "run_dir": str(tmp_path)}, num_samples=2, steps=8, lr=1e-2, save_every=2)

    def fail_at_step_3(state, metrics):
        if state.step == 3:
            raise error("learner interrupted")

    with recorded_generator(monkeypatch) as handles, pytest.raises(error, match="learner interrupted"):
        train_async(config, max_lag=1, reward_fn=digits,
                    callbacks=[fail_at_step_3], start_method=METHOD)
    assert len(handles) == 1
    assert_stopped(handles[0])
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2", "metrics.jsonl"]  # no .tmp-*
    restored = load_checkpoint(tmp_path / "checkpoint-2", recipe.build_state(config)[0])
    # online DPO: a step whose pairs all tie has no update, so its version may stay at 0 (it does with
    # the inverse-CDF sampler's draws on this tiny model)
    assert restored.step == 2 and (0 if recipe is online_dpo else 1) <= restored.policy_version <= 2


def test_interrupt_during_a_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    from rlcore.loops import checkpoint
    config = grpo.Config(**{**TINY, "run_dir": str(tmp_path)}, num_samples=2, steps=6, lr=1e-2, save_every=2)
    real, calls = checkpoint._write_manifest, []

    def interrupted(root):
        calls.append(root)
        if len(calls) == 2:
            raise KeyboardInterrupt("during the save of checkpoint-4")
        real(root)

    monkeypatch.setattr(checkpoint, "_write_manifest", interrupted)
    with recorded_generator(monkeypatch) as handles, pytest.raises(KeyboardInterrupt):
        train_async(config, max_lag=1, reward_fn=digits, start_method=METHOD)
    assert_stopped(handles[0])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2", "metrics.jsonl"]


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="needs an engine that fails in the child")
def test_generator_failure_is_raised_in_the_learner(monkeypatch):
    # a config checked at load can still fail where it runs: engine="vllm" without vLLM raises in the child
    config = grpo.Config(**TINY, num_samples=2, steps=3, engine="vllm")
    with recorded_generator(monkeypatch) as handles, pytest.raises(RuntimeError, match="generator process failed"):
        train_async(config, max_lag=1, reward_fn=digits, start_method=METHOD)
    assert_stopped(handles[0])


def test_a_recipe_added_to_the_table_is_found_and_an_undeclared_loss_is_named_before_models(monkeypatch):
    """``by_config`` reads the table as it is; a loss with no declared ratio level is refused by
    ``check_learner`` when ``is_clip`` needs the level, before anything is built."""
    import dataclasses as dc
    import functools

    from rlcore.algorithms.policy_gradient import POLICY_LOSSES
    from rlcore.loops.scale.async_learners import check_learner

    @dc.dataclass(frozen=True)
    class MyConfig(grpo.Config):
        pass

    monkeypatch.setitem(RECIPES, "my_grpo", dc.replace(RECIPES["grpo"], name="my_grpo", config=MyConfig))
    assert by_config(MyConfig).name == "my_grpo" and check_learner(MyConfig(), None).name == "my_grpo"
    monkeypatch.setitem(POLICY_LOSSES, "my_gspo", functools.partial(POLICY_LOSSES["gspo"]))
    config = grpo.Config(loss_type="my_gspo", run_dir=None)
    assert check_learner(config, None).name == "grpo"
    with pytest.raises(ValueError, match="loss_type: 'my_gspo' declares no ratio level.*POLICY_RATIO_LEVELS"):
        check_learner(config, 2.0)
    assert check_learner(dc.replace(config, importance_sampling_level="sequence"), 2.0).name == "grpo"
