"""TRL's reward functions run unchanged: conversational and standard data, GRPO and RLOO, and
evaluation scores with exactly the reward training used."""

import json
import textwrap

import pytest
import torch
from transformers import TrainerState
from trl.rewards import get_soft_overlong_punishment, think_format_reward

from rlcore import keys as K
from rlcore.loops.collect import generate_rollout
from rlcore.loops.data import load_source
from rlcore.loops.evaluate import evaluate_policy
from rlcore.loops.online import build_online_state, score_samples
from rlcore.loops.recipes import grpo, rloo
from tests.loops.online_helpers import TINY

RECIPES = {"grpo": grpo, "rloo": rloo}
SMALL = {**TINY, "num_train": 8, "num_eval": 4, "eval_batch_size": 4}


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def conversational(tmp_path):
    return write_jsonl(tmp_path / "chat.jsonl", [
        {"prompt": [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": f"What is {i}+1?"}],
         "solution": str(i + 1)} for i in range(12)])


def standard(tmp_path):
    return write_jsonl(tmp_path / "plain.jsonl", [{"prompt": f"What is {i}+1? ", "solution": str(i + 1)}
                                                  for i in range(12)])


# The examples of TRL's GRPOTrainer documentation, as written there.
def reward_len_conversational(completions, **kwargs):
    return [-abs(20 - len(completion[0]["content"])) for completion in completions]


def reward_len_standard(completions, **kwargs):
    return [-abs(20 - len(completion)) for completion in completions]


class Spy:
    """A reward function recording every keyword it receives (it scores 0)."""

    __name__ = "spy"

    def __init__(self):
        self.calls = []

    def __call__(self, prompts, completions, completion_ids, trainer_state, **kwargs):
        self.calls.append(dict(prompts=prompts, completions=completions, completion_ids=completion_ids,
                               trainer_state=trainer_state, **kwargs))
        return [0.0] * len(completions)


@pytest.mark.parametrize("recipe", ["grpo", "rloo"])
def test_trl_reward_functions_run_unchanged_on_conversational_data(recipe, tmp_path, tokenizer):
    data = conversational(tmp_path)
    spy = Spy()
    config = RECIPES[recipe].Config(**SMALL, dataset=data, steps=2, batch_size=2, num_samples=2, eval_every=2)
    funcs = [think_format_reward, reward_len_conversational, get_soft_overlong_punishment(8, 4), spy]
    state, history = RECIPES[recipe].train(config, reward_fn=funcs)
    assert state.step == 2 and "eval/reward" in history[-1]
    prompts = {json.dumps(r["prompt"]) for r in load_source(data)}
    for call in spy.calls:  # training's calls and evaluation's alike
        assert all(json.dumps(p) in prompts for p in call["prompts"])  # the data's message lists
        assert all(p[0]["role"] == "system" and p[1]["role"] == "user" for p in call["prompts"])
        for completion, ids in zip(call["completions"], call["completion_ids"]):
            assert isinstance(completion, list) and len(completion) == 1
            assert completion[0]["role"] == "assistant"
            assert completion[0]["content"] == tokenizer.decode(ids, skip_special_tokens=True)
            assert 1 <= len(ids) <= config.max_new_tokens and all(isinstance(i, int) for i in ids)
        assert len(call["solution"]) == len(call["completions"])
        assert isinstance(call["trainer_state"], TrainerState) and call["trainer_state"].max_steps == 2
    assert [c["trainer_state"].global_step for c in spy.calls][:2] == [0, 1]  # the steps done before each one
    # each row's extra column travels with its own prompt
    for call in spy.calls:
        for p, s in zip(call["prompts"], call["solution"]):
            assert p[1]["content"] == f"What is {int(s) - 1}+1?"


@pytest.mark.parametrize("recipe", ["grpo", "rloo"])
def test_trl_reward_functions_run_unchanged_on_standard_data(recipe, tmp_path):
    data = standard(tmp_path)
    spy = Spy()
    config = RECIPES[recipe].Config(**SMALL, dataset=data, steps=1, batch_size=2, num_samples=2, eval_every=1)
    state, history = RECIPES[recipe].train(config, reward_fn=[reward_len_standard, get_soft_overlong_punishment(8, 4),
                                                              spy])
    assert state.step == 1 and "eval/reward" in history[-1]
    prompts = set(load_source(data)["prompt"])
    for call in spy.calls:
        assert all(p in prompts for p in call["prompts"])  # as the dataset holds them, trailing space included
        assert all(isinstance(c, str) for c in call["completions"])
        assert len(call["completion_ids"]) == len(call["completions"])


@pytest.mark.parametrize("recipe", ["grpo", "rloo"])
def test_trl_functions_named_in_a_config(recipe, tmp_path):
    config = RECIPES[recipe].Config(**SMALL, dataset=conversational(tmp_path), steps=1, batch_size=2, num_samples=2,
                                    reward_funcs=("trl.rewards:think_format_reward",))
    state, history = RECIPES[recipe].train(config)
    assert state.step == 1 and history[0]["rollout/score"] == 0.0  # a random model writes no <think> block


def three_rewards(tmp_path, monkeypatch):
    """Two functions in an importable module (for reward_funcs) and one given from Python."""
    (tmp_path / "three_rewards.py").write_text(textwrap.dedent("""
        def digits(completions, **kwargs):
            return [float(sum(ch.isdigit() for ch in c)) for c in completions]

        def length(completions, completion_ids, **kwargs):
            return [float(len(ids)) for ids in completion_ids]
    """))
    monkeypatch.syspath_prepend(str(tmp_path))

    def starts_with_answer(completions, answer, **kwargs):
        return [float(c.strip().startswith(a)) + 0.25 for c, a in zip(completions, answer)]

    return starts_with_answer


def by_hand(texts, ids, answers, weights):
    terms = [[float(sum(ch.isdigit() for ch in c)) for c in texts],
             [float(len(i)) for i in ids],
             [float(c.strip().startswith(a)) + 0.25 for c, a in zip(texts, answers)]]
    w = weights or (1.0, 1.0, 1.0)
    python_first = [terms[2], terms[0], terms[1]]  # the functions given in Python come first, then the config's
    return torch.tensor([sum(wk * t[b] for wk, t in zip(w, python_first)) for b in range(len(texts))])


@pytest.mark.parametrize("weights", [None, (0.5, 2.0, -1.0)])
def test_evaluation_scores_with_exactly_the_training_reward(weights, tmp_path, monkeypatch):
    python_fn = three_rewards(tmp_path, monkeypatch)
    config = grpo.Config(**SMALL, steps=2, batch_size=2, num_samples=2, eval_every=2,
                         reward_funcs=("three_rewards:digits", "three_rewards:length"), reward_weights=weights)
    state, history = grpo.train(config, reward_fn=python_fn)  # evaluation after the last step: no error
    assert state.reward_fn is not None
    # evaluate from Python reuses what train was given: the same number as the run's own evaluation
    again = evaluate_policy(state, config)
    assert again["reward"] == pytest.approx(history[-1]["eval/reward"], abs=1e-6)
    assert grpo.evaluate(state, config)["reward"] == pytest.approx(again["reward"], abs=1e-6)
    # on a fixed batch: training's scores, evaluation's mean and the sum written out by hand agree
    held_out = load_source({"prompt": ["3+4=", "12+30="], "answer": ["7", "42"]})
    rows = held_out[:]
    tokenizer = build_online_state(config)[1]
    rollout = generate_rollout(state.model("policy"), tokenizer, rows["prompt"], do_sample=False, behaviour=None,
                               max_new_tokens=config.max_new_tokens, engine=config.engine, sampler=config.sampler)
    _, trained = score_samples(state, rows, rollout, generation=config, rewards=config, total_steps=config.steps,
                               tokenizer=tokenizer, reward_fn=state.reward_fn,
                                 num_samples=1)
    ids = [r[m].tolist() for r, m in zip(rollout[K.RESPONSE_IDS], rollout[K.RESPONSE_MASK])]
    expected = by_hand(tokenizer.batch_decode(ids, skip_special_tokens=True), ids, rows["answer"], weights)
    torch.testing.assert_close(trained[K.SCORE].cpu(), expected)
    evaluated = evaluate_policy(state, config, tokenizer=tokenizer, dataset=held_out)
    assert evaluated["reward"] == pytest.approx(float(expected.mean()), abs=1e-5)
    # given explicitly, the reward is built as train builds it (with the config's functions and weights)
    explicit = evaluate_policy(state, config, tokenizer=tokenizer, dataset=held_out, reward_fn=python_fn)
    assert explicit["reward"] == pytest.approx(evaluated["reward"], abs=1e-6)
