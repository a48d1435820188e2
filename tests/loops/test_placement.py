"""placement: the Ray actors against the synchronous recipes; importable and explicit without Ray.

The Ray tests share one local instance (2 CPUs, no dashboard) per module and are skipped where
``ray`` is not installed; each placed run starts three actor processes (a few seconds of imports).
"""

import dataclasses
import importlib
import sys
import threading
import time

import pytest
import torch

from rlcore.loops.recipes import RECIPES, grpo, online_dpo, ppo, rloo, sft
from rlcore.loops.scale import placement
from rlcore.loops.scale.placement import RAY_INSTALL, ROLES, require_ray, train_placed

# A reward that varies between samples of a random tiny model (a lambda: Ray pickles it by value).
LENGTH_REWARD = lambda prompts, completions, **_: [float(len(c)) for c in completions]  # noqa: E731

TINY = dict(hidden_size=32, num_layers=2, num_heads=2, batch_size=2, num_samples=2, max_new_tokens=6, num_train=16,
            num_eval=4, eval_batch_size=4, run_dir=None, lr=1e-2)


def policy_params(state):
    return {k: v.detach().clone() for k, v in state.model("policy").state_dict().items()}


# --- without Ray -------------------------------------------------------------------------------------
def test_module_imports_without_ray_and_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError
    monkeypatch.setattr(sys.modules["rlcore.loops.scale"], "placement", placement)  # restored after the re-import
    monkeypatch.delitem(sys.modules, "rlcore.loops.scale.placement")
    fresh = importlib.import_module("rlcore.loops.scale.placement")  # no top-level `import ray`
    assert fresh is not placement and fresh.RAY_INSTALL == 'pip install "rlcore[ray]"'
    with pytest.raises(ImportError, match=r'pip install "rlcore\[ray\]"'):
        fresh.require_ray()
    with pytest.raises(ImportError, match=r'not installed: pip install "rlcore\[ray\]"'):
        fresh.train_placed(grpo.Config(**TINY, steps=1))


def test_bad_arguments_fail_before_any_actor_starts(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # nothing below may reach Ray
    config = grpo.Config(**TINY, steps=1)
    with pytest.raises(TypeError, match=r"config: expected the Config of an online recipe .* got "
                                        r"rlcore.loops.recipes.sft.Config"):
        train_placed(sft.Config(steps=1))
    with pytest.raises(ValueError, match=r"max_lag: expected an int ≥ 0, got -1"):
        train_placed(config, max_lag=-1)
    with pytest.raises(ValueError, match=r"is_clip: expected C > 0 or None, got 0"):
        train_placed(config, is_clip=0)
    with pytest.raises(ValueError, match=r"is_clip: 'online_dpo' has no importance ratio"):
        train_placed(online_dpo.Config(**TINY, steps=1), is_clip=1.0)
    with pytest.raises(ValueError, match=r"num_cpus: expected a number or a mapping of every role"):
        train_placed(config, num_cpus={"learner": 1})
    with pytest.raises(ValueError, match=r"num_gpus: expected a number or a mapping of every role \['generator', "
                                          r"'scorer', 'learner'\], got keys \['gpu'\]"):
        train_placed(config, num_gpus={"gpu": 1})
    assert ROLES == ("generator", "scorer", "learner") and RAY_INSTALL == 'pip install "rlcore[ray]"'


def test_require_ray_returns_the_module_when_installed():
    ray = pytest.importorskip("ray")
    assert require_ray() is ray


class FakeMethod:
    def __init__(self, name, calls):
        self.name, self.calls = name, calls

    def remote(self, *args, **kwargs):
        self.calls.append((self.name, args, kwargs))
        return (self.name, len(self.calls) - 1)  # stands for an object reference


class FakeActor:
    def __init__(self, calls, *methods):
        for m in methods:
            setattr(self, m, FakeMethod(m, calls))


@pytest.mark.parametrize("max_lag", [0, 1, 2])
def test_placed_source_submits_at_most_max_lag_items_ahead_with_the_recipe_seeds(max_lag):
    calls = []
    generator, scorer = FakeActor(calls, "generate"), FakeActor(calls, "score")
    prompts = lambda start: ({"prompt": [f"p{i}"]} for i in range(start, 5))  # noqa: E731
    seeds = torch.Generator().manual_seed(7)
    before = seeds.get_state()
    items = placement.placed_source(generator, scorer, prompts, seeds, max_lag=max_lag, reference=False)(0)
    expected = torch.Generator().manual_seed(7)
    for t in range(5):
        rows, ref = next(items)
        submitted = [c for c in calls if c[0] == "generate"]
        assert rows == {"prompt": [f"p{t}"]} and len(submitted) == min(t + 1 + max_lag, 5)
        assert ref[0] == "score" and calls[ref[1]][2] == {"reference": False}
        assert submitted[t][1] == ({"prompt": [f"p{t}"]}, int(torch.randint(0, 2**62, (), generator=expected)))
    assert next(items, None) is None and torch.equal(seeds.get_state(), before)  # the input generator untouched


@pytest.mark.parametrize("recipe", [grpo, ppo, online_dpo], ids=["grpo", "ppo", "online_dpo"])
def test_learn_after_the_scorer_equals_learn_with_every_model(one_thread, recipe):
    """scorer.score, then learn_off_policy on the learner's lean state (its own models: PPO's critic,
    online DPO's reference) = learn_off_policy with every model in one state."""
    from rlcore.loops.scale.async_learners import learn_off_policy
    from rlcore.loops.collect import generate_rollout

    config = recipe.Config(**TINY, steps=1)
    rows = {"prompt": ["1+2=", "3+4="], "answer": ["3", "7"]}
    full, tokenizer = recipe.build_state(config)
    rollout = generate_rollout(full.model("policy"), tokenizer, rows["prompt"], max_new_tokens=6, num_samples=2,
                               seed=3, policy_version=0, engine=config.engine,
                               sampler=config.sampler)
    want_state, want = learn_off_policy(full, rows, rollout, config=config, tokenizer=tokenizer,
                                        reward_fn=LENGTH_REWARD)
    lean, _ = recipe.build_state(config)
    entry = RECIPES[recipe.__name__.rsplit(".", 1)[-1]]
    reference = entry.rollout_ref_logprobs(config)
    kept = sorted(k for k in lean.models if k != "reward" and not (k == "ref" and not entry.learn_uses_ref))
    lean = dataclasses.replace(lean, models={k: lean.models[k] for k in kept})
    scored = placement.ScorerWorker(config, reward_fn=LENGTH_REWARD).score(rollout, rows, reference=reference)
    got_state, got = assert_pure_state(learn_off_policy, lean, rows, scored, config=config, tokenizer=tokenizer)
    assert sorted(got_state.models) == kept and got_state.policy_version == want_state.policy_version == 1
    for (key, a), b in zip(policy_params(got_state).items(), policy_params(want_state).values()):
        assert torch.equal(a, b), key
    assert torch.equal(got_state.rng.get_state(), want_state.rng.get_state())
    assert (got_state.samples_seen, got_state.tokens_seen) == (want_state.samples_seen, want_state.tokens_seen)
    assert str(got_state.transforms) == str(want_state.transforms)  # PPO: KL controller, score moments
    assert set(got.keys()) == set(want.keys())
    for key, value in want.items():
        assert torch.equal(got[key], value), key


class FakeRay:
    """``put`` / ``get`` of object references that are plain values, or exceptions to raise."""

    def __init__(self):
        self.got = []

    def put(self, value):
        return ("put", value)

    def get(self, ref):
        self.got.append(ref)
        if isinstance(ref, BaseException):
            raise ref
        return ref


class FailingWeights:
    """A generator handle whose ``set_weights`` of ``fail_from`` on returns a failed reference."""

    def __init__(self, fail_from):
        self.fail_from, self.calls = fail_from, []
        self.set_weights = self

    def remote(self, state_dict, version):
        self.calls.append(version)
        return RuntimeError(f"set_weights {version} failed") if version >= self.fail_from else version


def test_weight_push_checks_each_push_before_the_next_and_at_the_end():
    ray, generator, model = FakeRay(), FailingWeights(fail_from=2), torch.nn.Linear(2, 1)
    push = placement.WeightPush(ray, generator)
    assert push.wait() >= 0 and ray.got == []  # nothing pending
    push.push(model, 0)
    push.push(model, 1)
    assert ray.got == [0] and generator.calls == [0, 1]  # push 0 checked before push 1 went out
    push.push(model, 2)  # push 1 is fine; push 2 fails in the "generator"
    with pytest.raises(RuntimeError, match="set_weights 2 failed"):
        push.push(model, 3)  # surfaces before the next push is submitted
    assert generator.calls == [0, 1, 2]
    push = placement.WeightPush(ray, FailingWeights(fail_from=0))
    push.push(model, 0)
    with pytest.raises(RuntimeError, match="set_weights 0 failed"):
        push.wait()  # the end of the run
    assert push.wait() >= 0  # checked once: nothing pending any more


def assert_pure_state(fn, state, *args, **kwargs):
    """``fn(state, ...)`` leaves the input state's models mapping and generator as they were."""
    models, rng = dict(state.models), state.rng.get_state()
    out = fn(state, *args, **kwargs)
    assert dict(state.models) == models and torch.equal(state.rng.get_state(), rng)
    return out


# --- on a local Ray instance ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ray_local():
    ray = pytest.importorskip("ray")
    start = time.time()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    print(f"ray.init: {time.time() - start:.1f} s")
    yield ray
    ray.shutdown()


def rlcore_actors(ray):
    return [a for a in ray.util.list_named_actors() if a.startswith("rlcore-")]


def assert_no_actors_left(ray, timeout=10.0):
    deadline = time.time() + timeout
    while rlcore_actors(ray) and time.time() < deadline:
        time.sleep(0.1)
    assert rlcore_actors(ray) == []


@pytest.fixture
def one_thread():
    """The actors run single-threaded (threads=1): so does the synchronous reference, for bitwise equality."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("lora", [{}, {"use_peft": True, "lora_r": 4}], ids=["full", "lora"])
def test_lag_0_reproduces_the_synchronous_recipe(ray_local, one_thread, lora):
    # seed 1: groups of unequal lengths in both steps, so the weights move (seed 0's samples all tie)
    config = grpo.Config(**TINY, **lora, steps=2, eval_every=2, seed=1)
    state, history = train_placed(config, max_lag=0, reward_fn=LENGTH_REWARD, threads=1)
    sync_state, sync_history = grpo.train(config, reward_fn=LENGTH_REWARD)
    placed, sync = policy_params(state), policy_params(sync_state)
    assert any(not torch.equal(a, b) for a, b in zip(sync.values(), policy_params(grpo.build_state(config)[0]).values()))
    for name in sync:  # the same parameters, bit for bit
        assert torch.equal(placed[name], sync[name]), name
    for counter in ("step", "optimizer_steps", "samples_seen", "episodes", "tokens_seen", "policy_version"):
        assert getattr(state, counter) == getattr(sync_state, counter), counter
    assert torch.equal(state.rng.get_state(), sync_state.rng.get_state())
    assert "ref" not in state.models  # the reference lives in the scorer
    for row, sync_row in zip(history, sync_history):
        assert row["async/staleness_max"] == 0.0 and row["placed/wait_s"] >= 0
        assert {k: row[k] for k in sync_row} == sync_row  # losses, rollout and eval metrics alike
    assert "eval/reward" in history[-1]
    assert_no_actors_left(ray_local)


def test_lag_1_is_one_version_stale_and_leaves_no_actors(ray_local):
    config = rloo.Config(**TINY, steps=3)
    state, history = train_placed(config, max_lag=1, reward_fn=LENGTH_REWARD,
                                  num_cpus={"generator": 0.5, "scorer": 0.25, "learner": 0.5})
    assert state.step == 3 and state.policy_version == 3
    # item 0 is generated by version 0; item t ≥ 1 was submitted before the push of step t - 1
    assert [row["async/staleness_max"] for row in history] == [0.0, 1.0, 1.0]
    assert [row["async/staleness"] for row in history] == [0.0, 1.0, 1.0]
    assert all(torch.isfinite(torch.tensor(row["loss"])) for row in history)
    assert_no_actors_left(ray_local)


def test_an_error_after_placing_the_actors_kills_them(ray_local, monkeypatch):
    lock = threading.Lock()  # a callback that cannot travel to the learner: train.remote() raises
    killed, kill = [], ray_local.kill
    monkeypatch.setattr(ray_local, "kill", lambda actor, **kw: (killed.append(actor), kill(actor, **kw)))

    def callback(state, metrics):
        with lock:
            return None

    with pytest.raises(TypeError, match="lock"):
        train_placed(grpo.Config(**TINY, steps=1), callbacks=[callback])
    assert len(killed) == len(ROLES)  # all three were placed, then killed
    assert_no_actors_left(ray_local)


def test_a_failed_weight_push_fails_the_run_within_a_step_and_leaves_no_actors(ray_local, tmp_path, monkeypatch):
    class RefusingGenerator(placement.GeneratorWorker):  # defined here: Ray ships it by value
        def set_weights(self, state_dict, version):
            if version >= 1:  # the first push after an update
                raise RuntimeError(f"generator refused weights of version {version}")
            return super().set_weights(state_dict, version)

    monkeypatch.setattr(placement, "GeneratorWorker", RefusingGenerator)
    config = grpo.Config(**{**TINY, "run_dir": str(tmp_path)}, steps=4)
    with pytest.raises(RuntimeError, match="generator refused weights of version 1"):
        train_placed(config, max_lag=1, reward_fn=LENGTH_REWARD)
    # the push after step 0 failed; step 1 checks it before its own push: steps 0 and 1 ran, 1 was not logged
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 1
    assert_no_actors_left(ray_local)


def _sync_ranks(out_dir):
    """The synchronous recipe on 2 gloo ranks: what 2 placed learners at max_lag 0 must reproduce."""
    from rlcore.loops.dist import dist_info
    from tests.loops.conftest import write_rank

    torch.set_num_threads(1)
    state, history = grpo.train(grpo.Config(**TWO_LEARNERS), reward_fn=LENGTH_REWARD)
    write_rank(out_dir, dist_info().rank, {"history": history}, policy_params(state))


TWO_LEARNERS = dict(TINY, batch_size=4, steps=2, eval_every=0, seed=1, kl_coef=0.1)


def test_two_learner_ranks_train_as_the_synchronous_recipe_on_two_ranks(ray_local, tmp_path):
    """Two learner actors in one gloo group, each with its own generator and scorer and half of every batch:
    with strategy none and fsdp2 (the learners' policy sharded, the generators' copies gathered) the run ends
    as the synchronous recipe on two torchrun ranks."""
    from tests.loops.conftest import run_ranks

    (sync_info, sync), _ = run_ranks(_sync_ranks, tmp_path)
    cpus = {"generator": 0.25, "scorer": 0.25, "learner": 0.25}  # six actors on the instance's 2 CPUs
    for strategy in ("none", "fsdp2"):
        state, history = train_placed(grpo.Config(**TWO_LEARNERS, strategy=strategy), max_lag=0, learners=2,
                                      reward_fn=LENGTH_REWARD, threads=1, num_cpus=cpus)
        placed = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in policy_params(state).items()}
        assert placed.keys() == sync.keys()
        for name in sync:
            torch.testing.assert_close(placed[name], sync[name], rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
        for row, sync_row in zip(history, sync_info["history"], strict=True):
            for key in ("loss", "rollout/reward_mean", "kl"):
                if key in sync_row:
                    assert row[key] == pytest.approx(sync_row[key], rel=1e-5, abs=1e-6), key
        assert_no_actors_left(ray_local)


def test_learners_must_divide_the_batch(monkeypatch):
    monkeypatch.setattr(placement, "require_ray", lambda: pytest.fail("no actor may start"))
    with pytest.raises(ValueError, match="batch_size: each of the 3 learners takes an equal block"):
        train_placed(grpo.Config(**TINY, steps=1), learners=3)
    with pytest.raises(ValueError, match="learners: expected a positive int, got 0"):
        train_placed(grpo.Config(**TINY, steps=1), learners=0)
