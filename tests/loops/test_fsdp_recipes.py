"""Every language-model recipe sharded with FSDP2 (``strategy: fsdp2``) on two gloo ranks trains as
with every rank holding the whole model (``strategy: none``): the same losses and the same
parameters after two steps, within float tolerance (sharded reductions sum in another order).

One module-scoped fixture spawns the two ranks once (``rlcore.loops.dist.spawn``); each rank runs
every recipe both ways and writes its gathered parameters and histories.
"""

from pathlib import Path

import pytest
import torch

from rlcore.loops.config import ConfigError, load_config
from rlcore.loops.dist import dist_info, is_fsdp2
from rlcore.loops.recipes import dpo, grpo, online_dpo, ppo, reward, rloo, sft
from tests.loops.conftest import assert_histories_close, gathered_parameters as _gathered, run_ranks, run_tensors, \
    save_tiny_llama, write_rank

TINY = dict(hidden_size=32, num_layers=2, num_heads=4, num_train=32, num_eval=8, steps=2, eval_every=2, run_dir=None,
            seed=1)
ONLINE = dict(TINY, num_samples=2, batch_size=4, max_new_tokens=6)
OFFLINE = dict(TINY, batch_size=8, max_length=24)
RUNS = {
    "sft": (sft, OFFLINE),
    "dpo": (dpo, OFFLINE),
    "reward": (reward, OFFLINE),
    "grpo": (grpo, ONLINE),
    "rloo": (rloo, ONLINE),
    "ppo_separate": (ppo, dict(ONLINE, value_model="separate")),
    "ppo_shared": (ppo, ONLINE),
    # ties: a rank with no pair runs a tied one at weight zero, so the collectives meet
    "online_dpo": (online_dpo, dict(ONLINE, num_samples=2, micro_batch_size=1, minibatch_size=1)),
    # rank 1's groups all tie: it refills every round while rank 0, done after one, samples along
    "grpo_dynamic": (grpo, dict(ONLINE, dynamic_sampling=True, max_sampling_rounds=3)),
    # TR-DPO: each rank mixes its rows of the policy into its rows of the reference after every step
    "dpo_sync": (dpo, dict(OFFLINE, sync_ref_model=True, ref_model_sync_steps=1, ref_model_mixup_alpha=0.5, lr=0.05)),
    "grpo_packed": (grpo, dict(ONLINE, padding_free=True, max_tokens_per_micro_batch=64)),
    "dpo_bf16": (dpo, dict(OFFLINE, fsdp_param_dtype="bfloat16")),
    "grpo_bf16": (grpo, dict(ONLINE, fsdp_param_dtype="bfloat16")),
    # a GPU run's default: the next block gathered during this one's backward (on a CPU it is off by default)
    "grpo_prefetch": (grpo, dict(ONLINE, fsdp_backward_prefetch=True)),
}
# a causal LM from a local folder: under fsdp2 each rank reads its rows onto a meta-built model
FOLDER_RUNS = {"dpo_folder": (dpo, OFFLINE), "grpo_folder": (grpo, ONLINE)}
# a reference or reward model given a device of its own is whole there on every rank, beside the sharded policy;
# the reward model from the folder "rm" (its score summed with length_reward's), sharded without reward_device
PLACED_RUNS = {
    "dpo_ref_placed": (dpo, dict(OFFLINE, ref_device="cpu")),
    # the policy is read sharded, so the reference is filled one gathered parameter at a time
    "dpo_folder_ref_placed": (dpo, dict(OFFLINE, ref_device="cpu", folder=True)),
    # TR-DPO: the sharded policy's parameters gathered one at a time into the whole reference
    "dpo_sync_placed": (dpo, dict(OFFLINE, sync_ref_model=True, ref_model_sync_steps=1, ref_model_mixup_alpha=0.5,
                                  lr=0.05, ref_device="cpu")),
    # the same from a folder (tied embeddings): the meta-built reference keeps the head tied to the embeddings
    "dpo_folder_sync_placed": (dpo, dict(OFFLINE, sync_ref_model=True, ref_model_sync_steps=1,
                                         ref_model_mixup_alpha=0.5, lr=0.05, ref_device="cpu", folder=True)),
    "grpo_placed": (grpo, dict(ONLINE, kl_coef=0.1, ref_device="cpu", reward_model="rm", reward_device="cpu")),
    "grpo_rm_sharded": (grpo, dict(ONLINE, kl_coef=0.1, reward_model="rm")),
}
# strategy: ddp (every rank whole, the gradients all-reduced bucket by bucket during the backward) against none
DDP_RUNS = ("sft", "dpo", "reward", "grpo", "ppo_separate", "ppo_shared", "online_dpo", "grpo_packed", "dpo_folder")
DDP_ONLY = {"grpo_lora": (grpo, dict(ONLINE, use_peft=True, kl_coef=0.1, lr=1e-2))}  # the adapter alone trains
TOL = dict(rtol=1e-4, atol=1e-5)
# fsdp_param_dtype: the sharded run's blocks compute in bfloat16 (8 bits of mantissa), the unsharded one in
# float32; Adam's first steps move a weight by about lr whatever its gradient's size, so a tiny gradient whose sign
# bfloat16 flips moves it 2·lr the other way (DPO's lr is 5e-4)
TOLS = {"dpo_bf16": dict(rtol=2e-2, atol=5e-3), "grpo_bf16": dict(rtol=2e-2, atol=5e-3)}
ONLINE_RECIPES = (grpo, rloo, ppo, online_dpo)


def length_reward(prompts, completions, **_):
    """Responses of unequal lengths score apart, so every online recipe has a gradient to take."""
    return [float(len(c)) for c in completions]


def rank_reward(prompts, completions, **_):
    """Rank 1's samples all tie (it has no pair: it runs a tied one at weight zero), rank 0's differ."""
    if dist_info().rank == 1:
        return [0.0] * len(completions)
    return [float(sum(map(ord, c)) % 7) for c in completions]


def train(recipe, settings, **overrides):
    reward_fn = rank_reward if recipe is online_dpo or settings.get("dynamic_sampling") else length_reward
    kwargs = {"reward_fn": reward_fn} if recipe in ONLINE_RECIPES else {}
    return recipe.train(recipe.Config(**settings, **overrides), **kwargs)



def _worker(out_dir):
    rank = dist_info().rank
    torch.set_num_threads(1)
    out, tensors = {}, {}
    from rlcore.loops.dist import barrier
    from rlcore.loops.models import build_model
    from rlcore.loops.recipe import _loads_sharded

    folder = Path(out_dir) / "folder"
    if rank == 0:
        tokenizer = save_tiny_llama(folder)
        from transformers import AutoModelForCausalLM, MixtralConfig

        AutoModelForCausalLM.from_config(MixtralConfig(  # experts stored one by one, fused in memory
            vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, num_local_experts=2, num_experts_per_tok=1)).save_pretrained(Path(out_dir) / "moe")
        tokenizer.save_pretrained(Path(out_dir) / "moe")
        from rlcore.loops.models import build_reward_model

        build_reward_model("llama", tokenizer=tokenizer, hidden_size=32, num_layers=1, num_heads=4,
                           seed=3).save_pretrained(Path(out_dir) / "rm")
    barrier()
    from rlcore.loops.recipe import build_policy

    for kind in ("folder", "moe"):  # read sharded, or (names converted on loading) loaded whole, then sharded
        policy, _ = build_policy(dpo.Config(**dict(OFFLINE, model=str(Path(out_dir) / kind)), strategy="fsdp2"))
        out[f"{kind}/built"] = {"training": policy.training, "sharded": is_fsdp2(policy)}
    runs = {**RUNS, **{name: (recipe, dict(settings, model=str(folder))) for name, (recipe, settings) in FOLDER_RUNS.items()}}
    for name, (recipe, settings) in PLACED_RUNS.items():
        settings = {k: v for k, v in settings.items() if k != "folder"} | (
            {"model": str(folder)} if settings.get("folder") else {})
        runs[name] = recipe, settings | ({"reward_model": str(Path(out_dir) / "rm")} if "reward_model" in settings else {})
    for name in FOLDER_RUNS:
        recipe, settings = runs[name]
        out[f"{name}/loads_sharded"] = _loads_sharded(recipe.Config(**settings, strategy="fsdp2"), "causal_lm")
    runs.update(DDP_ONLY)
    for name, (recipe, settings) in runs.items():
        strategies = ("none", "ddp") if name in DDP_ONLY else ("none", "fsdp2", "ddp") if name in DDP_RUNS \
            else ("none", "fsdp2")
        for strategy in strategies:
            state, history = train(recipe, settings, strategy=strategy)
            policy = state.model("policy")
            out[f"{name}/{strategy}"] = {"history": history, "sharded": is_fsdp2(policy),
                                         "models": {n: is_fsdp2(m) for n, m in state.models.items()}}
            for key, value in _gathered(policy).items():
                tensors[f"{name}/{strategy}/{key}"] = value.contiguous()
        start = _gathered(recipe.build_state(recipe.Config(**settings))[0].model("policy")) if hasattr(
            recipe, "build_state") else None
        out[f"{name}/moved"] = start is None or any(
            not torch.equal(start[k], tensors[f"{name}/none/{k}"]) for k in start)
    # the KV-cache loop on a sharded model: rank 0's rows stop at their first token, rank 1's run to the
    # budget; every decode step is a collective, so rank 0 keeps stepping until both are done
    from rlcore.loops.dist import wrap_model
    from rlcore.loops.engines import sample_responses

    model = wrap_model(build_model("llama", vocab_size=40, hidden_size=32, num_layers=2, num_heads=4, seed=0),
                       strategy="fsdp2")
    ids = torch.randint(3, 40, (2, 5), generator=torch.Generator().manual_seed(0))
    tokens, _, _ = sample_responses(model, ids, torch.ones_like(ids, dtype=torch.bool), max_new_tokens=6,
                                    stop_token_ids=range(40) if rank == 0 else [], pad_token_id=0,
                                    generator=torch.Generator().manual_seed(rank))
    out["decode"] = tokens.tolist()
    from tensordict import TensorDict

    from rlcore import keys as K
    from rlcore.loops.engines import _engine_hf

    batch = TensorDict({K.PROMPT_IDS: ids, K.PROMPT_MASK: torch.ones_like(ids, dtype=torch.bool)}, [2])
    with torch.random.fork_rng():
        torch.manual_seed(rank)
        tokens, _ = _engine_hf(model, batch, behaviour=None, max_new_tokens=6, num_samples=1,
                               stops=list(range(40)) if rank == 0 else [], pad=0, greedy=False, temperature=1.0,
                               top_k=None, top_p=None, seed=None, sampler="multinomial", options={})
    out["decode_hf"] = tokens.tolist()
    # a sharded run's checkpoint: written whole by rank 0, loadable in one process
    state, _ = train(dpo, dict(OFFLINE, run_dir=str(Path(out_dir) / "dpo-run"), save_every=2), strategy="fsdp2")
    for key, value in _gathered(state.model("policy")).items():
        tensors[f"checkpointed/{key}"] = value.contiguous()
    write_rank(out_dir, rank, out, tensors)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    return run_ranks(_worker, out), out


@pytest.mark.slow
@pytest.mark.parametrize("name", [*RUNS, *FOLDER_RUNS, *PLACED_RUNS])
def test_a_sharded_recipe_trains_as_the_replicated_one(ranks, name):
    ranks = ranks[0]
    if name in FOLDER_RUNS:
        assert all(info[f"{name}/loads_sharded"] for info, _ in ranks)
    for info, tensors in ranks:
        assert info[f"{name}/fsdp2"]["sharded"] and not info[f"{name}/none"]["sharded"]
        assert info[f"{name}/moved"]  # the steps trained
        whole = run_tensors(tensors, name, "none")
        sharded = run_tensors(tensors, name, "fsdp2")
        assert whole.keys() == sharded.keys() and whole
        tol = TOLS.get(name, TOL)
        for key in whole:
            torch.testing.assert_close(sharded[key], whole[key], **tol, msg=lambda m, key=key: f"{key}: {m}")
        assert_histories_close(info[f"{name}/none"]["history"], info[f"{name}/fsdp2"]["history"], **tol)
    (_, t0), (_, t1) = ranks
    for key in t0:  # the ranks end with the same (gathered) parameters
        if key.startswith(f"{name}/"):
            assert torch.equal(t0[key], t1[key]), key


@pytest.mark.slow
@pytest.mark.parametrize("name", [*DDP_RUNS, *DDP_ONLY])
def test_ddp_trains_as_none(ranks, name):
    """ddp's reduction overlaps the backward; the sums are the same (up to float order)."""
    for info, tensors in ranks[0]:
        assert not info[f"{name}/ddp"]["sharded"]
        whole = run_tensors(tensors, name, "none")
        ddp = run_tensors(tensors, name, "ddp")
        assert whole.keys() == ddp.keys() and whole
        for key in whole:
            torch.testing.assert_close(ddp[key], whole[key], **TOL, msg=lambda m, key=key: f"{key}: {m}")
        assert_histories_close(info[f"{name}/none"]["history"], info[f"{name}/ddp"]["history"], **TOL)
        assert info[f"{name}/moved"]


@pytest.mark.slow
@pytest.mark.parametrize("name", PLACED_RUNS)
def test_a_model_given_a_device_of_its_own_stays_whole(ranks, name):
    settings = PLACED_RUNS[name][1]
    expected = {"policy": True, "ref": "ref_device" not in settings}
    if "reward_model" in settings:
        expected["reward"] = "reward_device" not in settings
    for info, _ in ranks[0]:
        assert info[f"{name}/fsdp2"]["models"] == expected
        assert not any(info[f"{name}/none"]["models"].values())


@pytest.mark.slow
def test_a_policy_folder_loads_sharded_in_eval_mode_and_a_converted_one_whole(ranks):
    for info, _ in ranks[0]:
        assert info["folder/built"] == {"training": False, "sharded": True}
        assert info["moe/built"] == {"training": False, "sharded": False}  # whole; shard_models shards it next


@pytest.mark.slow
def test_a_sharded_runs_checkpoint_loads_in_one_process(ranks):
    from rlcore.loops.checkpoint import latest_checkpoint, load_checkpoint

    (_, tensors), out = ranks[0][0], ranks[1]
    path = latest_checkpoint(out / "dpo-run")
    state = load_checkpoint(path, dpo._setup(dpo.Config(**OFFLINE))[0])
    for key, value in _gathered(state.model("policy")).items():
        torch.testing.assert_close(value, tensors[f"checkpointed/{key}"], rtol=0, atol=0)


@pytest.mark.slow
def test_the_decode_loop_steps_until_every_rank_is_done(ranks):
    (r0, _), (r1, _) = ranks[0]
    assert all(len(row) == 6 for row in r1["decode"])  # rank 1 ran to its budget ...
    assert all(len(row) == 6 and row[1:] == [0] * 5 for row in r0["decode"])  # ... and rank 0 with it, padding
    assert all(len(row) == 6 for row in r1["decode_hf"])  # Hugging Face generate, synced: the same
    assert all(row[1:] == [0] * (len(row) - 1) for row in r0["decode_hf"])


def test_a_batch_the_ranks_cannot_split_evenly_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="batch_size: fsdp2 runs every forward on every rank at once"):
        load_config(grpo.Config, overrides={"strategy": "fsdp2", "batch_size": 5, "run_dir": None})


def test_a_model_on_a_device_of_its_own_is_taken():
    import dataclasses

    from rlcore.loops.config import _sharding_faults

    config = dataclasses.replace(grpo.Config(), strategy="fsdp2")
    object.__setattr__(config, "device", "cuda:0")  # a GPU run's config, checked here without the GPU
    assert _sharding_faults(dataclasses.replace(config, ref_device="cpu", reward_device="cpu")) == []


def test_backward_prefetch_defaults_to_on_for_an_accelerator_and_off_on_a_cpu():
    import dataclasses

    from rlcore.loops.recipe import _fsdp_kwargs

    cpu = dataclasses.replace(grpo.Config(), strategy="fsdp2")
    gpu = dataclasses.replace(cpu)
    object.__setattr__(gpu, "device", "cuda:0")  # a GPU run's config, read here without the GPU
    assert _fsdp_kwargs(cpu)["backward_prefetch"] is False and _fsdp_kwargs(gpu)["backward_prefetch"] is True
    for given in (True, False):
        assert _fsdp_kwargs(dataclasses.replace(cpu, fsdp_backward_prefetch=given))["backward_prefetch"] is given
        object.__setattr__(gpu, "fsdp_backward_prefetch", given)
        assert _fsdp_kwargs(gpu)["backward_prefetch"] is given


def test_an_unknown_strategy_is_refused_at_load():
    with pytest.raises(ConfigError, match=r"strategy: expected one of \['none', 'ddp', 'fsdp2'\], got 'zero3'"):
        load_config(grpo.Config, overrides={"strategy": "zero3", "run_dir": None})
    assert load_config(grpo.Config, overrides={"strategy": "fsdp2", "engine": "vllm", "run_dir": None}).engine == "vllm"


def test_in_one_process_fsdp2_changes_nothing():
    state, history = train(grpo, ONLINE, strategy="fsdp2")
    same, same_history = train(grpo, ONLINE)
    assert not is_fsdp2(state.model("policy"))
    assert history == same_history
