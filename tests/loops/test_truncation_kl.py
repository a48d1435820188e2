"""Truncation (top-k / top-p) shapes sampling only: the behaviour, recomputed and reference log-probs
share one definition, ``log softmax(z/τ)`` over the full vocabulary, so an unchanged policy has KL 0
to its own copy and an importance ratio of 1, whatever the truncation and temperature."""

import pytest
import torch

from rlcore import keys as K
from rlcore.loops.recipes import grpo, online_dpo, ppo, rloo
from rlcore.loops.online import build_online_state, prompt_source
from tests.loops.online_helpers import collect_rollout
from rlcore.loops.recipe import load_splits
from rlcore.loops.tasks import task_dataset
from tests.loops.online_helpers import TINY, digit_fraction

RECIPES = {"grpo": grpo, "rloo": rloo, "ppo": ppo, "online_dpo": online_dpo}
TRUNCATIONS = [dict(top_k=5, temperature=0.7), dict(top_p=0.8, temperature=1.3), dict(top_k=3, top_p=0.9)]
# the KV-cached decode against a full forward of another batching: float32 rounding (measured ≤ 2e-6)
TOL = 1e-4


def setup(name, engine, **truncation):
    recipe = RECIPES[name]
    config = recipe.Config(**TINY, steps=1, batch_size=2, num_samples=2, lr=0.0, engine=engine, **truncation)
    state, tokenizer = getattr(recipe, "build_state", build_online_state)(config)
    rows = next(iter(prompt_source(load_splits(config, task_dataset)[0], config)(0)))
    return recipe, config, state, tokenizer, rows


@pytest.mark.parametrize("truncation", TRUNCATIONS, ids=lambda t: "-".join(f"{k}{v}" for k, v in t.items()))
@pytest.mark.parametrize("engine", ["hf", "loop"])
def test_collected_kl_to_an_unchanged_copy_is_zero(engine, truncation):
    _, config, state, tokenizer, rows = setup("rloo", engine, **truncation)
    _, rollout = collect_rollout(state, rows, config=config, tokenizer=tokenizer, reward_fn=digit_fraction)
    mask = rollout[K.RESPONSE_MASK]
    assert mask.any()
    torch.testing.assert_close(rollout[K.OLD_LOGPROBS][mask], rollout[K.REF_LOGPROBS][mask], rtol=0, atol=TOL)


def by_length(prompts, completions, **_):
    """Distinct rewards within a group, so online DPO forms pairs and advantages are not all 0."""
    return [len(c) + 0.01 * i for i, c in enumerate(completions)]


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_a_step_of_every_online_recipe_sees_no_kl_and_ratio_one(name):
    kl = {"kl_coef": 0.1} if name == "grpo" else {}  # GRPO runs the reference only for its KL term
    recipe, config, state, tokenizer, rows = setup(name, "loop", top_k=5, top_p=0.9, temperature=0.7, **kl)
    _, metrics = recipe.step(state, rows, config=config, tokenizer=tokenizer, reward_fn=by_length)
    found = {k: float(v) for k, v in metrics.items()}
    if name == "online_dpo":  # implicit rewards β·(log π − log π_ref) of both answers of every pair
        assert found["rollout/pairs"] > 0 and abs(found["rewards/chosen"]) < TOL and abs(found["rewards/rejected"]) < TOL
        return
    assert abs(found["rollout/kl_ref"]) < TOL, found
    for key, expected in {"approx_kl_k1": 0.0, "ratio_mean": 1.0, "ratio_max": 1.0, "clipfrac_low": 0.0,
                          "clipfrac_high": 0.0}.items():
        assert abs(found[key] - expected) < TOL, (key, found)
