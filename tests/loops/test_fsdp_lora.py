"""LoRA under FSDP2 (``use_peft`` with ``strategy: fsdp2``): the frozen base and the adapter are sharded
together, block by block, and each recipe trains on two gloo ranks as with every rank holding the whole
model: the same losses and the same adapter after two steps, within float tolerance. The reference is
the policy with its adapter off, through the sharded root. A checkpoint holds the adapter alone (gathered,
small), resumes exactly on the same world size, loads in one process and exports merged.

One module-scoped fixture spawns the two ranks once (``rlcore.loops.dist.spawn``)."""

import shutil
from pathlib import Path

import pytest
import torch

from rlcore.loops.dist import barrier, dist_info, is_fsdp2
from rlcore.loops.recipes import dpo, grpo, ppo, reward, sft
from tests.loops.conftest import assert_histories_close, gathered_parameters as _gathered, run_ranks, run_tensors, \
    save_tiny_llama, write_rank

TINY = dict(hidden_size=32, num_layers=2, num_heads=4, num_train=32, num_eval=8, steps=2, eval_every=2, run_dir=None,
            seed=1, use_peft=True, lora_r=4, lora_alpha=8, lora_target_modules=["all-linear"])
ONLINE = dict(TINY, num_samples=2, batch_size=4, max_new_tokens=6, lr=1e-3)
OFFLINE = dict(TINY, batch_size=8, max_length=24)
RUNS = {
    "sft": (sft, OFFLINE),
    "dpo": (dpo, OFFLINE),
    "dpo_checkpointing": (dpo, dict(OFFLINE, gradient_checkpointing=True, padding_free=True)),
    "reward": (reward, OFFLINE),
    "grpo": (grpo, dict(ONLINE, kl_coef=0.1)),  # the reference's log-probs: the adapter off, through the root
    "ppo_separate": (ppo, dict(ONLINE, value_model="separate")),  # a LoRA policy beside a full value model
}
# a causal LM from a local folder: each rank reads its rows of the base onto a meta-built model, the adapter
# drawn as on the whole model
FOLDER_RUNS = {"grpo_folder": (grpo, dict(ONLINE, kl_coef=0.1)),
               "dpo_folder": (dpo, dict(OFFLINE, gradient_checkpointing=True))}
TOL = dict(rtol=1e-4, atol=1e-5)
ONLINE_RECIPES = (grpo, ppo)


def character_reward(prompts, completions, **_):
    """Scores that differ within a group, so the online recipes have advantages to follow."""
    return [float(sum(map(ord, c)) % 7) for c in completions]


def train(recipe, settings, **overrides):
    kwargs = {"reward_fn": character_reward} if recipe in ONLINE_RECIPES else {}
    return recipe.train(recipe.Config(**settings, **overrides), **kwargs)


def _worker(out_dir):
    rank = dist_info().rank
    torch.set_num_threads(1)
    out, tensors = {}, {}
    folder = Path(out_dir) / "folder"
    if rank == 0:
        save_tiny_llama(folder)
    barrier()
    from rlcore.loops.recipe import _loads_sharded

    runs = {**RUNS, **{name: (recipe, dict(settings, model=str(folder))) for name, (recipe, settings) in FOLDER_RUNS.items()}}
    from rlcore.loops.recipe import build_policy, shard_models

    for strategy in ("none", "fsdp2"):  # a trained copy of the head: both copies start as the stored head
        config = dpo.Config(**dict(OFFLINE, model=str(folder), lora_modules_to_save=["lm_head"]), strategy=strategy)
        policy = shard_models({"policy": build_policy(config)[0]}, config)["policy"]
        for key, value in _gathered(policy).items():
            tensors[f"saved_head/{strategy}/{key}"] = value
    for name in FOLDER_RUNS:
        recipe, settings = runs[name]
        out[f"{name}/loads_sharded"] = _loads_sharded(recipe.Config(**settings, strategy="fsdp2"), "causal_lm")
    for name, (recipe, settings) in runs.items():
        for strategy in ("none", "fsdp2"):
            state, history = train(recipe, settings, strategy=strategy)
            policy = state.model("policy")
            out[f"{name}/{strategy}"] = {"history": history, "sharded": is_fsdp2(policy)}
            for key, value in _gathered(policy).items():
                tensors[f"{name}/{strategy}/{key}"] = value
    # checkpoints: two steps saved each step; then step 2 again from the step-1 checkpoint
    runs = Path(out_dir)
    state, history = train(dpo, dict(OFFLINE, run_dir=str(runs / "a")), strategy="fsdp2", save_every=1)
    out["a"] = history
    for key, value in _gathered(state.model("policy")).items():
        tensors[f"a/{key}"] = value
    if rank == 0:
        shutil.copytree(runs / "a" / "checkpoint-1", runs / "b" / "checkpoint-1")
    barrier()
    state, history = train(dpo, dict(OFFLINE, run_dir=str(runs / "b")), strategy="fsdp2", save_every=1, resume=True)
    out["b"] = history
    for key, value in _gathered(state.model("policy")).items():
        tensors[f"b/{key}"] = value
    write_rank(out_dir, rank, out, tensors)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp_lora")
    return run_ranks(_worker, out), out


@pytest.mark.slow
@pytest.mark.parametrize("name", [*RUNS, *FOLDER_RUNS])
def test_a_sharded_lora_recipe_trains_as_the_replicated_one(ranks, name):
    for info, tensors in ranks[0]:
        assert name not in FOLDER_RUNS or info[f"{name}/loads_sharded"]
        assert info[f"{name}/fsdp2"]["sharded"] and not info[f"{name}/none"]["sharded"]
        whole = run_tensors(tensors, name, "none")
        sharded = run_tensors(tensors, name, "fsdp2")
        assert whole.keys() == sharded.keys() and any("lora_B" in k for k in whole)
        assert any(whole[k].abs().max() > 0 for k in whole if "lora_B" in k)  # the adapter trained (B starts at 0)
        for key in whole:
            torch.testing.assert_close(sharded[key], whole[key], **TOL, msg=lambda m, key=key: f"{key}: {m}")
        assert_histories_close(info[f"{name}/none"]["history"], info[f"{name}/fsdp2"]["history"], **TOL)
    (_, t0), (_, t1) = ranks[0]
    for key in t0:  # the ranks end with the same (gathered) parameters
        if key.startswith(f"{name}/"):
            assert torch.equal(t0[key], t1[key]), key


@pytest.mark.slow
def test_a_sharded_lora_checkpoint_holds_the_adapter_and_resumes_exactly(ranks):
    (info, tensors), out = ranks[0][0], ranks[1]
    path = out / "a" / "checkpoint-2"
    files = sorted(p.name for p in (path / "models" / "policy").iterdir())
    assert "adapter_model.safetensors" in files and not any(f.startswith(("shard-", "model")) for f in files)
    assert info["b"][-1]["loss"] == info["a"][-1]["loss"]
    names = [k.split("/", 1)[1] for k in tensors if k.startswith("a/")]
    assert names
    for name in names:
        assert torch.equal(tensors[f"b/{name}"], tensors[f"a/{name}"]), name


@pytest.mark.slow
def test_a_sharded_lora_checkpoint_loads_in_one_process_and_exports_merged(ranks, tmp_path):
    from transformers import AutoModelForCausalLM

    from rlcore.loops import cli
    from rlcore.loops.checkpoint import load_checkpoint
    from rlcore.loops.lora import linear_weights

    (_, tensors), out = ranks[0][0], ranks[1]
    path = out / "a" / "checkpoint-2"
    state = load_checkpoint(path, dpo._setup(dpo.Config(**OFFLINE))[0])
    policy = state.model("policy")
    for key, value in _gathered(policy).items():
        torch.testing.assert_close(value, tensors[f"a/{key}"], rtol=0, atol=0)
    assert cli.main(["export", "dpo", "--checkpoint", str(path), "--out", str(tmp_path / "exported")]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "exported")
    layer = policy.get_base_model().model.layers[0].self_attn.q_proj
    weight, _ = linear_weights(layer)  # W + (α/r)·B·A of the trained adapter
    torch.testing.assert_close(merged.model.layers[0].self_attn.q_proj.weight, weight.detach(), rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_a_folder_policys_trained_copy_of_a_module_starts_as_the_stored_module(ranks):
    for _, tensors in ranks[0]:
        whole = run_tensors(tensors, "saved_head", "none")
        sharded = run_tensors(tensors, "saved_head", "fsdp2")
        assert whole.keys() == sharded.keys() and any("modules_to_save" in k for k in whole)
        for key in whole:
            torch.testing.assert_close(sharded[key], whole[key], rtol=0, atol=0, msg=lambda m, key=key: f"{key}: {m}")
