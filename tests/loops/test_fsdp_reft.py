"""The ReFT recipes under FSDP2 (``strategy: fsdp2``): the frozen base model is sharded, the interventions
(and a reward model's score head, in the sharded root) train, and each recipe on two gloo ranks ends as
with every rank holding the whole model: the same losses and the same interventions after two steps.
GRPO's ``ReftModel`` policy reaches its sharded base through the root (``loops.dist.sharded_root``),
in the decode loop and the scoring alike.

One module-scoped fixture spawns the two ranks once (``rlcore.loops.dist.spawn``)."""

import pytest
import torch

from rlcore.loops.dist import dist_info, is_fsdp2
from rlcore.loops.recipes.reft import ReftConfig, train_reft_sft
from rlcore.loops.recipes.reft_recipes import (ReftDpoConfig, ReftGrpoConfig, ReftRewardConfig, train_reft_dpo,
                                               train_reft_policy_gradient, train_reft_reward)
from tests.loops.conftest import assert_histories_close, run_ranks, run_tensors, write_rank

BASE = dict(hidden_size=32, num_layers=2, num_heads=4, num_train=32, num_eval=8, steps=2, eval_every=2, run_dir=None,
            seed=1, lr=2e-2, layers=[1])
OFFLINE = dict(BASE, batch_size=8, max_length=24)


def character_reward(prompts, completions, **_):
    return [float(sum(map(ord, c)) % 7) for c in completions]


RUNS = {
    "sft": (ReftConfig, train_reft_sft, OFFLINE, {}),
    "dpo": (ReftDpoConfig, train_reft_dpo, OFFLINE, {}),
    "reward": (ReftRewardConfig, train_reft_reward, dict(OFFLINE, zero_init=False), {}),  # the score head trains too
    "grpo": (ReftGrpoConfig, train_reft_policy_gradient,
             dict(BASE, batch_size=4, num_samples=2, max_new_tokens=6, zero_init=False), {"reward_fn": character_reward}),
}
TOL = dict(rtol=1e-4, atol=1e-5)


def _base(model):
    return getattr(model, "model", model) if type(model).__name__ == "ReftModel" else model


def _worker(out_dir):
    rank = dist_info().rank
    torch.set_num_threads(1)
    out, tensors = {}, {}
    for name, (config, train, settings, kwargs) in RUNS.items():
        for strategy in ("none", "fsdp2"):
            state, history = train(config(**settings, strategy=strategy), **kwargs)
            out[f"{name}/{strategy}"] = {"history": history, "sharded": is_fsdp2(_base(state.model("policy")))}
            for model_name, model in state.models.items():
                for key, value in model.state_dict().items():
                    value = value.full_tensor() if hasattr(value, "full_tensor") else value
                    tensors[f"{name}/{strategy}/{model_name}/{key}"] = value.detach().clone().contiguous()
    write_rank(out_dir, rank, out, tensors)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(_worker, tmp_path_factory.mktemp("fsdp_reft"))


@pytest.mark.slow
@pytest.mark.parametrize("name", RUNS)
def test_a_sharded_reft_recipe_trains_as_the_replicated_one(ranks, name):
    for info, tensors in ranks:
        assert info[f"{name}/fsdp2"]["sharded"] and not info[f"{name}/none"]["sharded"]
        whole = run_tensors(tensors, name, "none")
        sharded = run_tensors(tensors, name, "fsdp2")
        assert whole.keys() == sharded.keys() and any(k.startswith("interventions/") or "interventions." in k
                                                      for k in whole)
        for key in whole:
            torch.testing.assert_close(sharded[key], whole[key], **TOL, msg=lambda m, key=key: f"{key}: {m}")
        assert all(row["grad_norm"] > 0 for row in info[f"{name}/none"]["history"])  # the interventions had a gradient
        assert_histories_close(info[f"{name}/none"]["history"], info[f"{name}/fsdp2"]["history"], **TOL)
