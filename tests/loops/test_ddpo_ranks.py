"""DDPO on several ranks (``torchrun``), as DDPO runs on several devices: each rank samples its own
prompts and noise, the rewards (and prompts) of every rank are gathered before the advantages, so the
per-prompt statistics are the global batch's, and ``update`` sums the ranks' gradients. With
``strategy: fsdp2`` the UNet is sharded block by block: two gloo ranks end as with every rank holding
it whole, its checkpoints (sharded) resume exactly, and an adapter's export gathers it.

One module-scoped fixture spawns the two ranks once (``rlcore.loops.dist.spawn``)."""

import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers")

from rlcore import keys as K  # noqa: E402
from rlcore.algorithms.ddpo import prompt_stats  # noqa: E402
from rlcore.loops.dist import all_gather_strings, barrier, dist_info, is_fsdp2  # noqa: E402
from rlcore.loops.recipes import ddpo  # noqa: E402
from tests.loops.conftest import assert_histories_close, run_ranks, write_rank  # noqa: E402

PROMPTS = ("stripes", "checkers", "blob")
TINY = dict(prompts=PROMPTS, sample_size=8, block_out_channels=(8, 16), prediction_type="sample", sample_num_steps=3,
            sample_guidance_scale=1.0, sample_batch_size=4, sample_num_batches_per_epoch=1, train_batch_size=2,
            train_learning_rate=1e-3, num_epochs=2, save_every=1, num_eval_images=4, pretrain_steps=2,
            per_prompt_stat_tracking=True, per_prompt_stat_tracking_min_count=2)
# one optimiser step per epoch, at ratio 1: no clipping decision that float rounding could flip. The metrics
# agree to 1e-4; a weight may not: Adam moves it by about lr whatever its gradient's size, so a gradient near 0
# whose sign the sharded reduction's summation order flips moves it 2·lr the other way (lr 1e-3, two steps)
TOL = dict(rtol=1e-4, atol=1e-5)
PIPELINE = dict(prompts=("a cat", "a dog"), sample_num_steps=3, sample_guidance_scale=3.0, sample_batch_size=2,
                sample_num_batches_per_epoch=1, train_batch_size=1, train_learning_rate=1e-2, num_epochs=2,
                num_eval_images=2, train_use_lora=True, lora_r=2, lora_alpha=4, save_every=1)
WEIGHTS = dict(rtol=1e-4, atol=4e-3)


def brightness(images, prompts, metadata=None):
    return images.mean(dim=(1, 2, 3))


def _params(state):
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone().contiguous()
            for n, p in state.model().state_dict().items()}


def _worker(out_dir):
    rank, runs = dist_info().rank, Path(out_dir)
    torch.set_num_threads(1)
    out, tensors = {}, {}
    out["strings"] = all_gather_strings(["é" * rank, f"rank {rank}", ""][: 2 + rank])
    # one epoch's rollout, its gathered statistics, by hand
    config = ddpo.Config(**TINY, run_dir=None)
    state = ddpo.build_state(config)
    state, rollout = ddpo.collect(state, config, brightness)
    scored_state, scored = ddpo.score(state, rollout, config)
    tensors["rewards"], tensors["advantages"] = rollout.get(K.SCORE), scored.get(K.ADVANTAGES)
    out["prompts"] = list(rollout.get(K.PROMPT).tolist())
    tensors["latents"] = rollout.get(K.LATENTS)[:, -1].contiguous()
    for strategy in ("none", "fsdp2"):
        state, history = ddpo.train(ddpo.Config(**TINY, run_dir=None, strategy=strategy), reward_fn=brightness)
        out[f"train/{strategy}"] = {"history": history, "sharded": is_fsdp2(state.model())}
        tensors.update({f"train/{strategy}/{k}": v for k, v in _params(state).items()})
    # checkpoints under fsdp2: two epochs saved each epoch; then epoch 2 again from the epoch-1 checkpoint
    state, history = ddpo.train(ddpo.Config(**TINY, run_dir=str(runs / "a"), strategy="fsdp2"), reward_fn=brightness)
    out["a"] = history
    tensors.update({f"a/{k}": v for k, v in _params(state).items()})
    if rank == 0:
        shutil.copytree(runs / "a" / "checkpoint-1", runs / "b" / "checkpoint-1")
    barrier()
    state, history = ddpo.train(ddpo.Config(**TINY, run_dir=str(runs / "b"), strategy="fsdp2", resume=True),
                                reward_fn=brightness)
    out["b"] = history
    tensors.update({f"b/{k}": v for k, v in _params(state).items()})
    # a Stable Diffusion pipeline's UNet with a LoRA adapter, sharded with its base; the adapter exported
    from rlcore.loops.sd import build_tiny_sd

    if rank == 0:
        build_tiny_sd(runs / "sd", seed=0, prediction_type="sample")
    barrier()
    for strategy in ("none", "fsdp2"):
        state, history = ddpo.train(ddpo.Config(**{**PIPELINE, "model": str(runs / "sd"),
                                                   "run_dir": str(runs / f"sd-{strategy}")}, strategy=strategy),
                                    reward_fn=brightness)
        out[f"sd/{strategy}"] = {"history": history, "sharded": is_fsdp2(state.model())}
        tensors.update({f"sd/{strategy}/{k}": v for k, v in _params(state).items() if "lora_" in k})
    write_rank(out_dir, rank, out, tensors)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddpo_ranks")
    return run_ranks(_worker, out), out


@pytest.mark.slow
def test_strings_gather_in_rank_order(ranks):
    for info, _ in ranks[0]:
        assert info["strings"] == ["", "rank 0", "é", "rank 1", ""]


@pytest.mark.slow
def test_each_rank_samples_its_own_and_the_advantages_are_the_global_batchs(ranks):
    (i0, t0), (i1, t1) = ranks[0]
    assert not torch.equal(t0["latents"], t1["latents"])  # each rank its own noise (and prompts)
    rewards = torch.cat([t0["rewards"], t1["rewards"]])
    config = ddpo.Config(**TINY, run_dir=None)
    _, expected = prompt_stats(config.per_prompt_stat_tracking_buffer_size,
                               config.per_prompt_stat_tracking_min_count).update(
        ddpo._prompt_stats(config).init(), i0["prompts"] + i1["prompts"], rewards)
    torch.testing.assert_close(torch.cat([t0["advantages"], t1["advantages"]]), expected, rtol=0, atol=0)


@pytest.mark.slow
def test_a_sharded_unet_trains_as_the_replicated_one(ranks):
    for info, tensors in ranks[0]:
        assert info["train/fsdp2"]["sharded"] and not info["train/none"]["sharded"]
        names = [k.split("/", 2)[2] for k in tensors if k.startswith("train/none/")]
        assert names
        for name in names:
            torch.testing.assert_close(tensors[f"train/fsdp2/{name}"], tensors[f"train/none/{name}"], **WEIGHTS,
                                       msg=lambda m, name=name: f"{name}: {m}")
        assert_histories_close(info["train/none"]["history"], info["train/fsdp2"]["history"], **TOL)
    (_, t0), (_, t1) = ranks[0]
    assert all(torch.equal(t0[k], t1[k]) for k in t0 if k.startswith("train/"))  # the ranks agree


@pytest.mark.slow
def test_a_sharded_ddpo_checkpoint_resumes_exactly(ranks):
    (info, tensors), out = ranks[0][0], ranks[1]
    assert any(p.name.startswith("shard-") for p in (out / "a" / "checkpoint-2" / "models" / "policy").iterdir())
    assert info["b"][-1] == info["a"][-1]
    for key in [k for k in tensors if k.startswith("a/")]:
        assert torch.equal(tensors["b/" + key[2:]], tensors[key]), key


@pytest.mark.slow
def test_a_sharded_pipeline_lora_trains_as_the_replicated_one_and_exports(ranks):
    from safetensors.torch import load_file

    (info, tensors), out = ranks[0][0], ranks[1]
    assert info["sd/fsdp2"]["sharded"] and not info["sd/none"]["sharded"]
    names = [k.split("/", 2)[2] for k in tensors if k.startswith("sd/none/")]
    assert names and any(tensors[f"sd/none/{n}"].abs().max() > 0 for n in names if "lora_B" in n)
    for name in names:
        torch.testing.assert_close(tensors[f"sd/fsdp2/{name}"], tensors[f"sd/none/{name}"], rtol=1e-4, atol=0.05,
                                   msg=lambda m, name=name: f"{name}: {m}")  # Adam: ± lr = 1e-2 per step
    for row, other in zip(info["sd/none"]["history"], info["sd/fsdp2"]["history"], strict=True):
        assert other["loss"] == pytest.approx(row["loss"], rel=1e-4, abs=1e-5)
    exported = {s: load_file(out / f"sd-{s}" / "lora" / "pytorch_lora_weights.safetensors") for s in ("none", "fsdp2")}
    assert exported["none"].keys() == exported["fsdp2"].keys() and exported["none"]
    for key in exported["none"]:
        torch.testing.assert_close(exported["fsdp2"][key], exported["none"][key], rtol=1e-4, atol=0.05)


def test_a_bad_sharding_setting_is_refused_before_any_model_is_built():
    from rlcore.loops.config import ConfigError

    with pytest.raises(ConfigError, match=r"strategy: expected one of \['none', 'ddp', 'fsdp2'\], got 'zero3'"):
        ddpo.build_state(ddpo.Config(**TINY, run_dir=None, strategy="zero3"))
