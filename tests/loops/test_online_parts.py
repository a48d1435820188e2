"""The pieces shared by the online recipes (loops/online.py): collect, score, losses, evaluation."""

import dataclasses

import pytest
import torch
from tensordict import TensorDict

from rlcore import keys as K
from rlcore.algorithms.policy_gradient import grpo_loss
from rlcore.loops.chunks import generate_in_chunks
from rlcore.loops.recipes import by_config, grpo, online_dpo, ppo, rloo
from rlcore.loops.collect import draw_seed
from rlcore.loops.models import ValueHead
from rlcore.loops.online import (OnlineConfig, build_online_state, generate_kwargs, prompt_source, replay_seed_draw,
                                 rollout_metrics, score_samples, with_policy_logprobs)
from rlcore.loops.reward_fns import make_reward_fn, repeat_columns
from rlcore.loops.evaluate import evaluate_policy
from rlcore.loops.state import copy_generator
from rlcore.loops.recipe import load_splits
from rlcore.loops.score import token_logprobs_from_model
from rlcore.loops.tasks import task_dataset
from rlcore.testing import assert_pure
from tests.loops.online_helpers import collect_rollout, digit_fraction, flat_models

TINY = dict(hidden_size=32, num_layers=1, num_heads=4, num_train=32, num_eval=6, max_new_tokens=6, batch_size=4,
            num_samples=3, lr=1e-2)


@pytest.fixture(scope="module")
def setup():
    config = OnlineConfig(**TINY)
    state, tokenizer = build_online_state(config)
    rows = next(iter(prompt_source(load_splits(config, task_dataset)[0], config)(0)))
    return config, state, tokenizer, rows


def test_build_online_state_models_and_optimizer(setup):
    config, state, _, _ = setup
    assert sorted(state.models) == ["policy", "ref"]
    assert not any(p.requires_grad for p in state.model("ref").parameters())
    optimised = {id(p) for g in state.optimizer.param_groups for p in g["params"]}
    assert optimised == {id(p) for p in state.model("policy").parameters()}
    for a, b in zip(state.model("policy").parameters(), state.model("ref").parameters()):
        assert torch.equal(a, b) and a.data_ptr() != b.data_ptr()  # a copy, not shared weights


def test_repeat_columns_is_prompt_major():
    rows = {"prompt": ["a", "b"], "answer": ["1", "2"], "completion": ["1", "2"], "level": [3, 4]}
    out = assert_pure(repeat_columns, rows, 3)
    assert out == {"answer": ["1", "1", "1", "2", "2", "2"], "level": [3, 3, 3, 4, 4, 4]}


def test_collect_rollout_layout_rng_and_counters(setup):
    config, state, tokenizer, rows = setup
    seen = {}

    def reward(prompts, completions, *, answer, **_):
        seen["answer"], seen["prompts"] = list(answer), list(prompts)
        return digit_fraction(prompts, completions)

    rng_before = state.rng.get_state()
    new, rollout = collect_rollout(state, rows, config=config, tokenizer=tokenizer, reward_fn=reward)
    P, G = len(rows["prompt"]), config.num_samples
    assert rollout.batch_size == torch.Size([P * G])
    for key in (K.PROMPT_IDS, K.RESPONSE_IDS, K.OLD_LOGPROBS, K.REF_LOGPROBS, K.SCORE, K.GROUP_ID):
        assert key in rollout.keys()
    assert torch.equal(rollout[K.GROUP_ID], torch.arange(P).repeat_interleave(G))
    # the reward sees every sample's own prompt and answer (prompt-major repetition)
    assert seen["answer"] == [a for a in rows["answer"] for _ in range(G)]
    assert seen["prompts"] == [p for p in rows["prompt"] for _ in range(G)]
    # the input state's generator is untouched; the new one advanced
    assert torch.equal(state.rng.get_state(), rng_before)
    assert not torch.equal(new.rng.get_state(), rng_before)
    assert (new.samples_seen, new.episodes) == (P * G, P * G)
    assert new.tokens_seen == int(rollout[K.PROMPT_MASK].sum() + rollout[K.RESPONSE_MASK].sum())  # TRL's num_tokens
    # the same state samples the same responses (generation is seeded from state.rng)
    _, again = collect_rollout(state, rows, config=config, tokenizer=tokenizer, reward_fn=reward)
    assert torch.equal(again[K.RESPONSE_IDS], rollout[K.RESPONSE_IDS])
    # reference log-probs match a recomputation; behaviour log-probs match the policy (= reference)
    ids = torch.cat([rollout[K.PROMPT_IDS], rollout[K.RESPONSE_IDS]], -1)
    mask = torch.cat([rollout[K.PROMPT_MASK], rollout[K.RESPONSE_MASK]], -1)
    R = rollout[K.RESPONSE_IDS].shape[1]
    ref = token_logprobs_from_model(state.model("ref"), ids, mask, response_length=R)
    m = rollout[K.RESPONSE_MASK]
    torch.testing.assert_close(rollout[K.REF_LOGPROBS][m], ref[m])
    torch.testing.assert_close(rollout[K.OLD_LOGPROBS][m], ref[m], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(rollout[K.SCORE], torch.tensor(digit_fraction(None, [
        tokenizer.decode(r[k].tolist(), skip_special_tokens=True) for r, k in zip(rollout[K.RESPONSE_IDS], m)])))


def test_collect_rollout_without_reference(setup):
    config, state, tokenizer, rows = setup
    _, rollout = collect_rollout(state, rows, config=online_dpo.Config(**TINY), tokenizer=tokenizer,
                                 reward_fn=digit_fraction, num_samples=2, reference=False)
    assert K.REF_LOGPROBS not in rollout.keys() and rollout.batch_size == torch.Size([2 * len(rows["prompt"])])
    assert "rollout/kl_ref" not in rollout_metrics(rollout)


def test_generate_kwargs_and_draw_seed():
    config = OnlineConfig(max_new_tokens=5, temperature=0.7, top_k=3, top_p=0.9, num_samples=4, max_prompt_length=9,
                          engine="hf", stop_token_ids=(7,), length_sampler=(2, 4))
    assert generate_kwargs(config, max_prompt_length=config.max_prompt_length) == dict(
        max_new_tokens=5, temperature=0.7, top_k=3, top_p=0.9, num_samples=4, max_prompt_length=9, engine="hf",
        sampler="inverse_cdf", engine_options={}, stop_token_ids=(7,), length_sampler=(2, 4), rows_per_call=None)
    g, expected = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    seeds = [draw_seed(g) for _ in range(3)]
    assert seeds == [int(torch.randint(0, 2**62, (), generator=expected)) for _ in range(3)]
    assert len(set(seeds)) == 3 and all(0 <= x < 2**62 for x in seeds)
    assert torch.equal(g.get_state(), expected.get_state())  # one draw each, like generate_rollout(generator=)


def test_collect_rollout_is_generation_then_score_samples(setup):
    """The split the asynchronous loops use: a rollout sampled elsewhere with ``draw_seed(state.rng)``,
    then ``replay_seed_draw`` and ``score_samples``, gives the rollout and state of
    ``collect_rollout`` exactly; ``score_samples`` itself leaves the generator alone."""
    config, state, tokenizer, rows = setup
    want_state, want = collect_rollout(state, rows, config=config, tokenizer=tokenizer, reward_fn=digit_fraction)
    generated = generate_in_chunks(state.model("policy"), tokenizer, list(rows["prompt"]),
                                   **generate_kwargs(config, max_prompt_length=config.max_prompt_length),
                                   generator=copy_generator(state.rng), policy_version=state.policy_version)
    unreplayed, _ = score_samples(state, rows, generated, generation=config, rewards=config, total_steps=config.steps,
                                  tokenizer=tokenizer, reward_fn=digit_fraction)
    assert torch.equal(unreplayed.rng.get_state(), state.rng.get_state())
    before = state.rng.get_state()
    replayed = replay_seed_draw(state)
    assert torch.equal(state.rng.get_state(), before) and not torch.equal(replayed.rng.get_state(), before)
    got_state, got = assert_pure(score_samples, replayed, rows, generated, generation=config, rewards=config,
                                 total_steps=config.steps, tokenizer=tokenizer, reward_fn=digit_fraction)
    leaves = dict(include_nested=True, leaves_only=True)  # reward_terms holds one [B] entry per reward function
    assert set(got.keys(**leaves)) == set(want.keys(**leaves))
    for key in want.keys(**leaves):
        assert torch.equal(got[key], want[key]), key
    assert torch.equal(got_state.rng.get_state(), want_state.rng.get_state())
    for counter in ("samples_seen", "episodes", "tokens_seen", "step", "policy_version"):
        assert getattr(got_state, counter) == getattr(want_state, counter), counter
    assert K.SCORE not in generated.keys() and K.REF_LOGPROBS not in generated.keys()  # the input is not modified


def test_score_samples_scores_with_the_models_the_state_holds(setup):
    """A reference adds ``ref_logprobs``, a critic ``values``, a reward model or function ``score``; a
    state without them (the Ray learner's) scores only what it holds."""
    config, state, tokenizer, rows = setup
    seen = {}

    def reward(prompts, completions, *, answer, **_):
        seen["answer"] = list(answer)
        return [0.5] * len(completions)

    generated = generate_in_chunks(state.model("policy"), tokenizer, list(rows["prompt"]),
                                   **{**generate_kwargs(config, max_prompt_length=config.max_prompt_length),
                                      "num_samples": 2}, seed=1)
    head = ValueHead(state.model("policy").config.hidden_size)
    with torch.no_grad():  # V = 0·h + 1: values of one on every response token
        head.summary.weight.zero_()
        head.summary.bias.fill_(1.0)
    lean = dataclasses.replace(state, models={"policy": state.model("policy"), "value": head})
    new, scored = score_samples(lean, rows, generated, generation=config, rewards=config, total_steps=config.steps,
                                tokenizer=tokenizer, reward_fn=reward,
                                  num_samples=2)
    assert K.REF_LOGPROBS not in scored.keys() and seen["answer"] == [a for a in rows["answer"] for _ in range(2)]
    m = scored[K.RESPONSE_MASK]
    assert torch.equal(scored[K.VALUES], m.float()) and torch.equal(scored[K.SCORE], torch.full((len(m),), 0.5))
    assert new.samples_seen == state.samples_seen + len(m)
    # no reward function and no reward model: the rollout's score (from a scorer elsewhere) is kept
    _, kept = score_samples(lean, rows, scored, generation=config, rewards=config, total_steps=config.steps,
                            tokenizer=None, reward_fn=None, num_samples=2)
    assert torch.equal(kept[K.SCORE], scored[K.SCORE])
    # with a reference, ref_logprobs; unless the recipe scores none (online DPO: reference=False)
    _, with_ref = score_samples(state, rows, generated, generation=config, rewards=config, total_steps=config.steps,
                                tokenizer=tokenizer, reward_fn=reward,
                                  num_samples=2)
    assert K.REF_LOGPROBS in with_ref.keys() and K.VALUES not in with_ref.keys()
    _, without = score_samples(state, rows, generated, generation=config, rewards=config, total_steps=config.steps,
                               tokenizer=tokenizer,
                                 reward_fn=reward, num_samples=2, reference=False)
    assert K.REF_LOGPROBS not in without.keys()


@pytest.mark.parametrize("recipe", [grpo, rloo, ppo, online_dpo])
def test_each_step_is_collect_then_learn(recipe):
    """A recipe's ``step`` is ``collect_rollout`` (with the reference its table entry scores with) then its
    ``learn``, nothing else: the same parameters, generator state, counters and metrics, bit for bit."""
    config = recipe.Config(**{**TINY, "num_samples": 2})
    reference = by_config(recipe.Config).rollout_ref_logprobs(config)
    rows = {"prompt": ["1+2=", "3+4="], "answer": ["3", "7"]}
    results = []
    for split in (False, True):
        torch.manual_seed(0)
        state, tokenizer = recipe.build_state(config)
        if split:
            state, rollout = collect_rollout(state, rows, config=config, tokenizer=tokenizer, reward_fn=digit_fraction,
                                             reference=reference)
            results.append(recipe.learn(state, rollout, config))
        else:
            results.append(recipe.step(state, rows, config=config, tokenizer=tokenizer, reward_fn=digit_fraction))
    (a, ma), (b, mb) = results
    assert torch.equal(flat_models(a), flat_models(b)) and torch.equal(a.rng.get_state(), b.rng.get_state())
    assert (a.samples_seen, a.tokens_seen, a.policy_version) == (b.samples_seen, b.tokens_seen, b.policy_version)
    assert set(ma.keys()) == set(mb.keys()) and all(torch.equal(ma[k], mb[k]) for k in ma.keys())
    assert {"rollout/score", "rollout/length"} <= set(ma.keys())


def test_policy_logprobs_and_loss_closure(setup):
    config, state, tokenizer, rows = setup
    _, rollout = collect_rollout(state, rows, config=config, tokenizer=tokenizer, reward_fn=digit_fraction)
    rollout = rollout.update({K.ADVANTAGES: torch.ones_like(rollout[K.OLD_LOGPROBS])})
    out = with_policy_logprobs(state.model("policy"), rollout)
    assert K.LOGPROBS not in rollout.keys() and out[K.LOGPROBS].requires_grad
    m = rollout[K.RESPONSE_MASK]
    torch.testing.assert_close(out[K.LOGPROBS][m], rollout[K.OLD_LOGPROBS][m], atol=1e-4, rtol=1e-4)
    loss, metrics = grpo_loss(with_policy_logprobs(state.model("policy"), rollout))
    loss.backward()
    grads = [p.grad for p in state.model("policy").parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    state.optimizer.zero_grad(set_to_none=True)
    assert float(metrics["ratio_mean"]) == pytest.approx(1.0, abs=1e-4)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_loss_forward_reports_the_policy_entropy(setup, temperature):
    """with_entropy: the entropy metric is mean_{b,t} −Σ_v p log p of softmax(z/τ) at the response
    positions, written out from the full logits; the loss and its gradient are those without it."""
    config, state, tokenizer, rows = setup
    _, rollout = collect_rollout(state, rows, config=config, tokenizer=tokenizer, reward_fn=digit_fraction)
    rollout = rollout.update({K.ADVANTAGES: torch.linspace(-1, 1, rollout.batch_size[0])[:, None].expand_as(
        rollout[K.OLD_LOGPROBS]).contiguous()})
    policy = state.model("policy")
    runs = []
    for with_entropy in (False, True):
        loss, metrics = grpo_loss(with_policy_logprobs(policy, rollout, temperature=temperature,
                                                       with_entropy=with_entropy))
        loss.backward()
        runs.append((loss.detach(), metrics, [p.grad.clone() for p in policy.parameters()]))
        state.optimizer.zero_grad(set_to_none=True)
    (loss0, m0, g0), (loss1, m1, g1) = runs
    assert "entropy" not in m0.keys()
    torch.testing.assert_close(loss1, loss0, rtol=1e-6, atol=1e-7)
    for a, b in zip(g0, g1):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)
    P, R = rollout[K.PROMPT_IDS].shape[-1], rollout[K.RESPONSE_IDS].shape[-1]
    ids = torch.cat([rollout[K.PROMPT_IDS], rollout[K.RESPONSE_IDS]], -1)
    mask = torch.cat([rollout[K.PROMPT_MASK], rollout[K.RESPONSE_MASK]], -1)
    with torch.no_grad():
        pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
        logits = policy(input_ids=ids, attention_mask=mask.long(), position_ids=pos).logits[:, P - 1:P - 1 + R]
        logp = (logits.double() / temperature).log_softmax(-1)
        h = -(logp.exp() * logp).sum(-1)
    m = rollout[K.RESPONSE_MASK]
    assert float(m1["entropy"]) == pytest.approx(float(h[m].mean()), rel=1e-5)


def test_rollout_metrics_values():
    mask = torch.tensor([[True, True, False], [True, False, False]])
    rollout = {K.RESPONSE_MASK: mask, K.SCORE: torch.tensor([1.0, 3.0]),
               K.OLD_LOGPROBS: torch.tensor([[-1.0, -2.0, 0.0], [-1.0, 0.0, 0.0]]),
               K.REF_LOGPROBS: torch.tensor([[-2.0, -2.5, 9.0], [-0.5, 0.0, 0.0]])}
    out = assert_pure(rollout_metrics, TensorDict(rollout, batch_size=[2]))
    assert float(out["rollout/score"]) == 2.0
    assert float(out["rollout/score_std"]) == pytest.approx(2 ** 0.5)
    assert float(out["rollout/length"]) == 1.5
    assert float(out["rollout/kl_ref"]) == pytest.approx(((1.0 + 0.5) + (-0.5)) / 2)  # mean_b Σ_t (old − ref)


def test_evaluate_is_deterministic_and_leaves_rng_alone(setup):
    config, state, tokenizer, _ = setup
    global_before, loop_before = torch.get_rng_state(), state.rng.get_state()
    first = evaluate_policy(state, dataclasses.replace(config, eval_batch_size=3), tokenizer=tokenizer,
                            reward_fn=digit_fraction)
    assert torch.equal(torch.get_rng_state(), global_before) and torch.equal(state.rng.get_state(), loop_before)
    assert set(first) == {"reward", "response_length", "exact_match", "win_rate", "sampled_reward", "kl_ref"}
    assert all(isinstance(v, float) for v in first.values())
    assert first == evaluate_policy(state, dataclasses.replace(config, eval_batch_size=3), tokenizer=tokenizer,
                                    reward_fn=digit_fraction)
    assert abs(first["kl_ref"]) < 1e-4  # the untrained policy is its reference
    assert 0.0 <= first["exact_match"] <= 1.0


def test_the_frozen_reference_answers_once_per_run(setup, monkeypatch):
    """With a reference cache the reference's greedy answers are generated at the first evaluation
    only, and every evaluation gives the numbers an uncached one gives."""
    from rlcore.loops import evaluate as evaluation
    config, state, tokenizer, _ = setup
    config = dataclasses.replace(config, eval_batch_size=4)
    calls, real = [], evaluation.generate_rollout

    def counting(model, *args, **kwargs):
        calls.append(model is state.model("ref"))
        return real(model, *args, **kwargs)

    monkeypatch.setattr(evaluation, "generate_rollout", counting)
    cache = {}
    first = evaluate_policy(state, config, tokenizer=tokenizer, reward_fn=digit_fraction, reference_cache=cache)
    by_reference = sum(calls)
    calls.clear()
    again = evaluate_policy(state, config, tokenizer=tokenizer, reward_fn=digit_fraction, reference_cache=cache)
    assert by_reference == 2 and sum(calls) == 0 and len(calls) == 4  # 6 held-out prompts, 4 per chunk: 2 chunks
    uncached = evaluate_policy(state, config, tokenizer=tokenizer, reward_fn=digit_fraction)
    assert first == again == uncached and sorted(cache) == [0, 4]


def test_make_reward_fn_defaults():
    assert make_reward_fn(OnlineConfig(task="add"))(["1+1="], ["2"], answer=["2"]) == [1.0]
    assert make_reward_fn(OnlineConfig(reward_model="some/dir")) is None
    assert make_reward_fn(OnlineConfig(), digit_fraction) is digit_fraction
    with pytest.raises(ValueError, match="valid"):
        make_reward_fn(OnlineConfig(task="nope"))


def test_win_rate_against_the_reference_is_one_half_before_training(setup):
    config, state, tokenizer, _ = setup
    held_out = load_splits(config, task_dataset)[1]
    out = evaluate_policy(state, config, tokenizer=tokenizer, dataset=held_out, reward_fn=digit_fraction)
    assert out["win_rate"] == 0.5 and abs(out["kl_ref"]) < 1e-5  # the policy is its own reference: all ties


def test_length_sampler_from_the_config_sets_each_steps_budget(setup):
    """Each step's budget comes from its sampling seed, so the async generator and resume draw the same."""
    import dataclasses
    from rlcore.loops.collect import draw_seed
    from rlcore.loops.config import check_config
    from rlcore.loops.state import copy_generator
    config, state, tokenizer, rows = setup
    config = dataclasses.replace(config, length_sampler=(1, 4), max_new_tokens=30)
    for _ in range(4):
        seed = draw_seed(copy_generator(state.rng))
        budget = int(torch.randint(1, 4, (), generator=torch.Generator().manual_seed(seed)))
        state, rollout = collect_rollout(state, rows, config=config, tokenizer=tokenizer, reward_fn=digit_fraction)
        assert rollout[K.RESPONSE_IDS].shape[1] <= budget
        assert int(rollout[K.RESPONSE_MASK].sum(-1).max()) <= budget
    with pytest.raises(ValueError, match=r"length_sampler: expected \[low, high\) with 1 <= low < high \(ints\), "
                                         r"got \[5, 3\]"):
        check_config(dataclasses.replace(config, length_sampler=(5, 3)))
