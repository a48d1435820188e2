"""The asynchronous learner (``train_async``) on two gloo ranks: each rank runs its own generator process
on its own prompts, and with ``strategy: fsdp2`` the learner's policy is sharded, each generator getting
the whole weights gathered one tensor at a time. With ``max_lag = 0`` the sharded run trains as the
unsharded one (losses and parameters within float tolerance), and the unsharded one as the synchronous
recipe on the same two ranks: each rank's generator sampled its own block of every batch's prompts."""

import pytest
import torch

from rlcore.loops.dist import dist_info, is_fsdp2
from rlcore.loops.recipes import grpo
from rlcore.loops.scale.async_rl import train_async
from tests.loops.conftest import assert_histories_close, gathered_parameters, run_ranks, run_tensors, write_rank

ONLINE = dict(hidden_size=32, num_layers=2, num_heads=4, num_train=32, num_eval=8, steps=2, eval_every=2,
              run_dir=None, seed=1, num_samples=2, batch_size=4, max_new_tokens=6, kl_coef=0.1)
TOL = dict(rtol=1e-4, atol=1e-5)
# max_lag (the key's first character), and a LoRA policy: its generator gets a whole peft copy (the base built on
# the meta device, the same adapter put on it), pushed one gathered tensor at a time
CASES = {"0": {}, "1": {}, "0_lora": dict(use_peft=True, lr=1e-2), "1_lora": dict(use_peft=True, lr=1e-2)}


def length_reward(prompts, completions, **_):
    return [float(len(c)) for c in completions]


def _worker(out_dir):
    torch.set_num_threads(1)
    out, tensors = {}, {}
    for strategy in ("none", "fsdp2"):
        for lag, extra in CASES.items():
            state, history = train_async(grpo.Config(**ONLINE, **extra, strategy=strategy), max_lag=int(lag[0]),
                                         reward_fn=length_reward, start_method="forkserver", generator_threads=1)
            out[f"{strategy}/{lag}"] = {"history": history, "sharded": is_fsdp2(state.model("policy"))}
            for key, value in gathered_parameters(state.model("policy")).items():
                tensors[f"{strategy}/{lag}/{key}"] = value.contiguous()
    state, history = grpo.train(grpo.Config(**ONLINE), reward_fn=length_reward)  # the synchronous recipe
    out["sync"] = {"history": history}
    for key, value in gathered_parameters(state.model("policy")).items():
        tensors[f"sync/{key}"] = value.contiguous()
    write_rank(out_dir, dist_info().rank, out, tensors)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(_worker, tmp_path_factory.mktemp("async"))


@pytest.mark.slow
@pytest.mark.parametrize("lag", CASES)
def test_the_sharded_asynchronous_learner_trains_as_the_unsharded_one(ranks, lag):
    for info, tensors in ranks:
        assert info[f"fsdp2/{lag}"]["sharded"] and not info[f"none/{lag}"]["sharded"]
        whole = run_tensors(tensors, "none", lag)
        sharded = run_tensors(tensors, "fsdp2", lag)
        assert whole.keys() == sharded.keys() and whole
        for key in whole:
            torch.testing.assert_close(sharded[key], whole[key], **TOL, msg=lambda m, key=key: f"{key}: {m}")
        untimed = [[{k: v for k, v in row.items() if not k.endswith("_s")} for row in info[f"{strategy}/{lag}"]["history"]]
                   for strategy in ("none", "fsdp2")]  # seconds differ from run to run
        assert_histories_close(*untimed, **TOL)
        assert all(h["loss"] == h["loss"] for h in info[f"fsdp2/{lag}"]["history"])
    (_, t0), (_, t1) = ranks
    assert all(torch.equal(t0[k], t1[k]) for k in t0)  # the ranks end with the same parameters


@pytest.mark.slow
def test_with_no_lag_the_ranks_learn_as_the_synchronous_recipe(ranks):
    for info, tensors in ranks:
        sync = {k.split("/", 1)[1]: v for k, v in tensors.items() if k.startswith("sync/")}
        for key, value in sync.items():
            torch.testing.assert_close(tensors[f"none/0/{key}"], value, **TOL, msg=lambda m, key=key: f"{key}: {m}")
        for row, theirs in zip(info["none/0"]["history"], info["sync"]["history"], strict=True):
            assert row["loss"] == pytest.approx(theirs["loss"], rel=1e-4, abs=1e-5)


def test_a_bare_cuda_generator_goes_to_this_ranks_gpu(monkeypatch):
    from rlcore.loops.scale import async_rl

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)  # init_distributed set LOCAL_RANK 3
    assert async_rl._generator_device("cuda") == torch.device("cuda", 3)
    assert async_rl._generator_device("cuda:1") == torch.device("cuda", 1)
    assert async_rl._generator_device("cpu") == torch.device("cpu")
