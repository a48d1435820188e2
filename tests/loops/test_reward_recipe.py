"""Tests of the reward-modelling recipe (loops/recipes/reward.py) on tiny offline models."""

import copy
import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from rlcore import keys as K
from rlcore.loops.tokenization import tokenize_dataset
from rlcore.loops.models import pad_token_id, reward_model_scores
from rlcore.loops.recipe import build_policy, init_train_state
from rlcore.loops.config import load_config
from rlcore.loops.recipes.reward import Config, collate_pairs, evaluate, reward_loss_fn, reward_step, train, with_rewards
from rlcore.loops.recipes import RECIPES
from rlcore.loops.tasks import preference_dataset
from rlcore.testing import assert_pure

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
TINY = dict(hidden_size=32, num_layers=1, num_heads=4, num_train=64, num_eval=32, batch_size=16, max_length=24,
            lr=3e-3, run_dir=None, log_every=100)


def _batch(n=6, margin=None):
    model, tok = build_policy(Config(**TINY), task="reward")
    data = preference_dataset("add", n)
    if margin is not None:
        data = data.add_column("margin", [margin] * n)
    rows = tokenize_dataset(data, tok, format="preference")[:]
    return model, collate_pairs(rows, pad_id=pad_token_id(tok), margin_key=None if margin is None else "margin")


@pytest.mark.slow
def test_reward_model_learns_the_preferences():
    config = Config(steps=15, eval_every=15, **TINY)
    model, _ = build_policy(config, task="reward")
    before = evaluate(init_train_state({"policy": model}, config), config)
    state, hist = train(config)
    first, last = sum(h["loss"] for h in hist[:3]) / 3, sum(h["loss"] for h in hist[-3:]) / 3
    assert last < 0.75 * first, (first, last)
    after = hist[-1]
    assert after["eval/accuracy"] >= before["accuracy"] + 0.15 and after["eval/margin"] > 0.1
    assert after["eval/loss"] < before["loss"]
    assert evaluate(state, config) == pytest.approx({k[5:]: v for k, v in after.items() if k.startswith("eval/")})


def test_with_rewards_scores_each_side_at_its_last_token():
    model, batch = _batch(5)
    with torch.no_grad():
        out = assert_pure(with_rewards, model, batch)
    for side in (K.CHOSEN, K.REJECTED):
        alone = reward_model_scores(model, batch[side, K.INPUT_IDS], batch[side, K.ATTENTION_MASK])
        torch.testing.assert_close(out[side, K.REWARD], alone, rtol=1e-5, atol=1e-5)
        # extra right padding changes nothing
        ids = torch.nn.functional.pad(batch[side, K.INPUT_IDS], (0, 3), value=0)
        mask = torch.nn.functional.pad(batch[side, K.ATTENTION_MASK], (0, 3), value=False)
        torch.testing.assert_close(reward_model_scores(model, ids, mask), alone, rtol=1e-5, atol=1e-5)
        assert K.REWARD not in batch[side].keys()  # the input is untouched


def test_margin_and_centring_terms():
    model, plain = _batch(6)
    _, with_margin = _batch(6, margin=1.0)
    state = init_train_state({"policy": model}, Config(**TINY))
    base, m0 = reward_loss_fn(state, plain)
    shifted, m1 = reward_loss_fn(state, with_margin, margin_key="margin")
    # −logσ(d − m) with m = 1, from the same rewards
    d = m0["margin"]
    rewards = with_rewards(model, plain)
    diff = rewards[K.CHOSEN, K.REWARD] - rewards[K.REJECTED, K.REWARD]
    torch.testing.assert_close(shifted, -torch.nn.functional.logsigmoid(diff - 1.0).mean())
    assert shifted > base and torch.isclose(m1["margin"], d)
    centred, m2 = reward_loss_fn(state, plain, center_rewards_coefficient=0.5)
    sums = rewards[K.CHOSEN, K.REWARD] + rewards[K.REJECTED, K.REWARD]
    torch.testing.assert_close(m2["loss_center"], 0.5 * sums.square().mean().detach())
    torch.testing.assert_close(centred, base + m2["loss_center"])
    with pytest.raises(KeyError, match="margin_key"):
        collate_pairs({"prompt_ids": [[1]], "chosen_ids": [[2]], "rejected_ids": [[3]]}, pad_id=0,
                      margin_key="margin")


def test_micro_batches_give_the_full_batch_step():
    model, batch = _batch(8)
    config = Config(**TINY)
    out = []
    for micro in (None, 3):
        m = copy.deepcopy(model)
        # SGD: the step is linear in the gradient, so the micro-batches' float32 summation order (which differs
        # by CPU and kernel) moves weights by lr x rounding; Adam's g/sqrt(v) can flip the sign of a near-0 gradient
        state = dataclasses.replace(init_train_state({"policy": m}, config), scheduler=None,
                                    optimizer=torch.optim.SGD(m.parameters(), lr=0.1))
        state, metrics = reward_step(state, batch, micro_batch_size=micro)
        out.append(([p.detach().clone() for p in m.parameters()], metrics["loss"]))
    torch.testing.assert_close(out[0][1], out[1][1], rtol=1e-5, atol=1e-6)
    for a, b in zip(out[0][0], out[1][0]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert state.samples_seen == 8 and state.optimizer_steps == 1


def test_margin_column_from_a_local_dataset(tmp_path):
    rows = [dict(r, margin=0.5) for r in preference_dataset("add", 24).to_list()]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = Config(steps=2, task=None, dataset=str(path), margin_key="margin", center_rewards_coefficient=0.01,
                    **{**TINY, "num_eval": 8, "batch_size": 8})
    state, hist = train(config)
    assert state.step == 2 and "loss_center" in hist[-1]
    assert {"accuracy", "margin", "loss"} <= set(evaluate(state, config))


def test_yaml_config_loads_and_runs(tmp_path):
    config = load_config(Config, CONFIGS / "reward.yaml", {"steps": "2", "run_dir": str(tmp_path), "eval_every": "2",
                                                           "num_train": 32, "num_eval": 8})
    assert config.margin_key is None and config.center_rewards_coefficient is None
    state, hist = train(config)
    assert state.step == 2 and "eval/accuracy" in hist[-1]
    assert (tmp_path / "checkpoint-2" / "models" / "policy").is_dir()
    # a checkpointed reward model loads back as a sequence classifier (the recipe's model_task)
    task = RECIPES["reward"].model_task
    assert task == "reward"
    loaded, _ = build_policy(dataclasses.replace(config, init_from=str(tmp_path)), task=task)
    assert type(loaded).__name__ == "LlamaForSequenceClassification"
    for a, b in zip(loaded.parameters(), state.model().parameters()):
        assert torch.equal(a, b)


def test_pre_tokenised_pairs_as_trl_gives_them(tmp_path):
    """TRL's RewardTrainer input: input_ids_chosen / input_ids_rejected (+ attention masks), no text."""
    import json
    from rlcore.loops.recipes import reward
    from rlcore.loops.data import load_local
    from rlcore.loops.models import build_tokenizer
    tok = build_tokenizer()
    rows = []
    for i in range(40):
        good, bad = tok(f"{i}+1={i + 1}")["input_ids"], tok(f"{i}+1={i + 7}")["input_ids"]
        rows.append({"input_ids_chosen": good + [0, 0], "attention_mask_chosen": [1] * len(good) + [0, 0],
                     "input_ids_rejected": bad})
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    prepared = reward._prepare(load_local(tmp_path / "pairs.jsonl"), tok, Config(**TINY))
    assert prepared[0]["chosen_ids"] == tok("0+1=1")["input_ids"] and prepared[0]["prompt_ids"] == []
    state, history = reward.train(Config(**{**TINY, "steps": 2, "num_eval": 4}, dataset=str(tmp_path / "pairs.jsonl")))
    assert state.optimizer_steps == 2 and math.isfinite(history[-1]["loss"])
    bad = load_local([{"input_ids_chosen": [1, 2], "attention_mask_chosen": [1], "input_ids_rejected": [3]}])
    with pytest.raises(ValueError, match=r"row 0: attention_mask_chosen has 1 entries, input_ids_chosen 2"):
        reward._prepare(bad, tok, Config(**TINY))


def test_pairs_past_the_model_context_are_refused_before_the_first_step():
    config = Config(**{**TINY, "max_length": 400}, model="tiny-gpt2", max_position_embeddings=8, steps=1)
    with pytest.raises(ValueError, match=r"dataset: the train split, row \d+: prompt_ids \+ chosen_ids of \d+ tokens "
                                         r"exceeds the model's context of 8 .*set max_length <= 8"):
        train(config)
