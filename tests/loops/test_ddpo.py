"""loops/recipes/ddpo.py: the DDPO recipe: config, collect -> score -> train_epoch, ratio 1 at lr 0, one optimiser
step per sample batch, accumulation over micro-batches, resume, and a short run that raises the reward."""

import dataclasses
import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("PIL")

from rlcore import keys as K  # noqa: E402
from rlcore.algorithms.ddpo import batch_advantages, prompt_stats_init, prompt_stats_update  # noqa: E402
from rlcore.loops.recipes.ddpo import Config, build_state, collect, evaluate, score, train, train_epoch  # noqa: E402
from rlcore.loops.diffusion import ddim_schedule, step_logprobs, timestep_rows  # noqa: E402
from rlcore.loops.images import jpeg_compressibility, latents_to_images  # noqa: E402
from rlcore.loops.logging import read_jsonl  # noqa: E402
from rlcore.loops.config import load_config  # noqa: E402

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "ddpo.yaml"
PROMPTS = ("stripes", "checkers", "blob")


def tiny(tmp_path, **overrides) -> Config:
    """A 3x8x8 model, 3 DDIM steps, 2 batches of 4 samples per epoch: a fraction of a second per epoch."""
    fields = dict(run_dir=str(tmp_path / "run"), prompts=PROMPTS, sample_size=8, block_out_channels=(8,),
                  prediction_type="sample", sample_num_steps=3, sample_guidance_scale=1.0, sample_batch_size=4,
                  sample_num_batches_per_epoch=2, train_batch_size=2, train_learning_rate=1e-3, num_epochs=2,
                  save_every=1, num_eval_images=4)
    return Config(**{**fields, **overrides})


def params(state):
    return torch.cat([p.detach().reshape(-1).clone() for p in state.model().parameters()])


def collected(cfg):
    state = build_state(cfg)
    state, rollout = collect(state, cfg, jpeg_compressibility)
    state, rollout = score(state, rollout, cfg)
    return state, rollout


# --- config ---------------------------------------------------------------------------------------
def test_config_defaults_validation_and_derived_accumulation():
    cfg = Config()
    assert (cfg.sample_num_steps, cfg.sample_eta, cfg.sample_guidance_scale, cfg.train_clip_range,
            cfg.train_adv_clip_max, cfg.train_learning_rate) == (50, 1.0, 5.0, 1e-4, 5.0, 3e-4)  # DDPO's defaults
    assert Config(sample_batch_size=8, train_batch_size=2).train_gradient_accumulation_steps == 4
    with pytest.raises(ValueError, match=r"sample_batch_size \(6\) must be a multiple of train_batch_size \(4\)"):
        Config(sample_batch_size=6, train_batch_size=4)
    with pytest.raises(ValueError, match="train_timestep_fraction"):
        Config(sample_num_steps=4, train_timestep_fraction=0.2)
    with pytest.raises(ValueError, match="sample_eta"):
        Config(sample_eta=0.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.seed = 1


def test_yaml_config_loads_with_every_field():
    cfg = load_config(Config, CONFIG, {"num_epochs": 3})
    assert isinstance(cfg, Config) and cfg.num_epochs == 3
    assert cfg.prompts == PROMPTS and cfg.block_out_channels == (16, 32)
    assert isinstance(cfg.train_adam_epsilon, float) and cfg.train_adam_epsilon == 1e-8
    import yaml
    assert set(yaml.safe_load(CONFIG.read_text())) == {f.name for f in dataclasses.fields(Config)}


def test_cli_lists_the_recipe():
    from rlcore.loops.cli import field_docs
    from rlcore.loops.recipes import RECIPES
    assert RECIPES["ddpo"].config is Config
    assert "ddpo_loss(clip_range=)" in field_docs(Config)["train_clip_range"]


def test_build_state_pretrains_on_request(tmp_path):
    plain = build_state(tiny(tmp_path))
    assert torch.equal(params(plain), params(build_state(tiny(tmp_path))))  # seeded
    pre = build_state(tiny(tmp_path, pretrain_steps=2))
    assert not torch.equal(params(pre), params(plain))
    assert torch.equal(params(build_state(tiny(tmp_path, pretrain_steps=2), pretrain=False)), params(plain))
    assert set(plain.transforms) == {"prompt_stats"} and plain.optimizer.defaults["lr"] == 1e-3


# --- collect and score -------------------------------------------------------------------------------
def test_collect_layout_rewards_and_rng(tmp_path):
    cfg = tiny(tmp_path)
    state = build_state(cfg)
    rng_before = state.rng.get_state()
    new_state, rollout = collect(state, cfg, jpeg_compressibility)
    assert torch.equal(state.rng.get_state(), rng_before)  # the old state is untouched
    assert not torch.equal(new_state.rng.get_state(), rng_before)
    assert rollout.batch_size == torch.Size([8])
    assert rollout[K.LATENTS].shape == (8, 4, 3, 8, 8) and rollout[K.OLD_LOGPROBS].shape == (8, 3)
    assert rollout[K.TIMESTEPS].shape == (8, 3) and rollout[K.CLASS_LABELS].max() < len(PROMPTS)
    torch.testing.assert_close(rollout[K.SCORE], jpeg_compressibility(latents_to_images(rollout[K.LATENTS][:, -1])))
    with ThreadPoolExecutor(2) as pool:  # rewards in threads: the same rollout
        _, async_rollout = collect(state, cfg, jpeg_compressibility, pool)
    assert (async_rollout == rollout).all()


def test_score_batch_and_per_prompt_advantages(tmp_path):
    pcfg = tiny(tmp_path, per_prompt_stat_tracking=True, per_prompt_stat_tracking_min_count=2)
    state, rollout = collected(dataclasses.replace(pcfg, per_prompt_stat_tracking=False))
    torch.testing.assert_close(rollout[K.ADVANTAGES], batch_advantages(rollout[K.SCORE]))
    before = state.transforms["prompt_stats"]
    new_state, scored = score(state, rollout.exclude(K.ADVANTAGES), pcfg)
    names = [PROMPTS[i] for i in rollout[K.CLASS_LABELS].tolist()]
    stats, expected = prompt_stats_update(prompt_stats_init(16, 2), names, rollout[K.SCORE])
    torch.testing.assert_close(scored[K.ADVANTAGES], expected)
    assert new_state.transforms["prompt_stats"].counts.tolist() == stats.counts.tolist()
    assert state.transforms["prompt_stats"] is before and K.ADVANTAGES not in rollout.exclude(K.ADVANTAGES).keys()


# --- the update --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("guidance", [1.0, 2.5])
def test_ratio_is_one_and_nothing_clipped_with_lr_zero(tmp_path, guidance):
    cfg = tiny(tmp_path, train_learning_rate=0.0, sample_guidance_scale=guidance, sample_num_batches_per_epoch=1)
    state, rollout = collected(cfg)
    before = params(state)
    rows = timestep_rows(rollout).reshape(-1)
    schedule = ddim_schedule(3, prediction_type="sample")
    with torch.no_grad():  # recomputed in the update's micro-batches of train_batch_size rows
        logp = torch.cat([step_logprobs(state.model(), rows[i:i + 2], schedule, guidance_scale=guidance,
                                        null_class=len(PROMPTS)) for i in range(0, len(rows), 2)])
    # 2-row micro-batches vs the collection's 4-row batches: the convolutions' float32 summation order
    # may differ (by batch size and CPU kernel), so the ratio is 1 to rounding (seen: |ρ − 1| <= 6e-6),
    # bound 2e-5, five times inside clip_range (1e-4)
    ratio = torch.exp(logp - rows[K.OLD_LOGPROBS])
    torch.testing.assert_close(ratio, torch.ones_like(ratio), rtol=0, atol=2e-5)
    new_state, metrics = train_epoch(state, rollout, cfg)
    assert metrics["clipfrac"].item() == 0.0  # every ratio inside [1 − clip_range, 1 + clip_range]
    assert 0.0 <= metrics["approx_kl"].item() < 1e-9  # ½·mean(log ρ²) for |log ρ| of float32 rounding, not 0
    assert metrics["optimizer_steps"].item() == 1.0 and new_state.optimizer_steps == 1
    assert torch.equal(params(new_state), before)  # lr = 0 moves nothing


def test_one_optimiser_step_per_sample_batch(tmp_path):
    cfg = tiny(tmp_path, sample_num_batches_per_epoch=3, train_num_inner_epochs=2)
    state, rollout = collected(cfg)
    before = params(state)
    new_state, metrics = train_epoch(state, rollout, cfg)
    assert new_state.optimizer_steps == 6 and metrics["optimizer_steps"].item() == 3.0  # per inner epoch
    assert metrics["clipfrac"].item() > 0  # after the first step the ratio leaves [1 - 1e-4, 1 + 1e-4]
    assert not torch.equal(params(new_state), before)
    assert math.isfinite(metrics["loss"].item()) and metrics["grad_norm"].item() > 0


def test_gradient_accumulation_equals_one_big_micro_batch(tmp_path):
    """train_batch_size only changes how the rows are cut: with SGD the weights move the same."""
    results = []
    for train_batch_size in (1, 4):
        cfg = tiny(tmp_path, train_batch_size=train_batch_size, train_max_grad_norm=1e6)
        state = build_state(cfg)
        state.model().double()  # float64: only the summation order differs between the two runs
        state = dataclasses.replace(state, optimizer=torch.optim.SGD(state.model().parameters(), lr=0.1))
        state, rollout = collect(state, cfg, jpeg_compressibility)
        state, rollout = score(state, rollout, cfg)
        assert rollout[K.OLD_LOGPROBS].dtype == torch.float64
        start = params(state)
        state, _ = train_epoch(state, rollout, cfg)
        results.append(params(state) - start)
    assert results[0].abs().max() > 0
    torch.testing.assert_close(results[0], results[1], rtol=1e-9, atol=1e-12)


def test_timestep_fraction_trains_on_that_many_steps(tmp_path):
    cfg = tiny(tmp_path, sample_num_steps=4, train_timestep_fraction=0.5, sample_num_batches_per_epoch=1)
    state, rollout = collected(cfg)
    rows = []
    hook = state.model().register_forward_pre_hook(lambda m, args: rows.append(args[0].shape[0]))
    try:
        train_epoch(state, rollout, cfg)
    finally:
        hook.remove()
    assert rows == [2, 2, 2, 2]  # 4 samples x int(4 * 0.5) steps, micro-batches of 2 rows


# --- the run ------------------------------------------------------------------------------------------------
def test_train_logs_saves_grids_and_resumes_exactly(tmp_path):
    kw = dict(per_prompt_stat_tracking=True, per_prompt_stat_tracking_min_count=2, train_timestep_fraction=0.67,
              resume=True)
    full_state, full = train(tiny(tmp_path / "a", num_epochs=3, **kw))
    cfg = tiny(tmp_path / "b", num_epochs=2, **kw)
    train(cfg)
    run = Path(cfg.run_dir)
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    state, resumed = train(dataclasses.replace(cfg, num_epochs=3))  # continues from checkpoint-2
    assert state.step == 3 and len(resumed) == 1
    assert torch.equal(params(state), params(full_state))
    assert state.transforms["prompt_stats"].counts.tolist() == full_state.transforms["prompt_stats"].counts.tolist()
    assert resumed[0]["reward_mean"] == full[2]["reward_mean"]
    assert resumed[0]["eval/reward_mean"] == full[2]["eval/reward_mean"]
    lines = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in lines] == [1, 2, 3] and all("eval/reward_mean" in r for r in lines)
    grids = sorted(p.name for p in (run / "images").glob("*.png"))  # fixed-noise evaluations, each epoch's samples
    assert grids == [f"epoch-0000{i}.png" for i in range(1, 4)] + [f"samples-0000{i}.png" for i in range(1, 4)]
    assert state.samples_seen == 3 * 8 and state.optimizer_steps == 3 * 2


def test_async_rewards_give_the_same_run(tmp_path):
    _, sync = train(tiny(tmp_path, run_dir=None, num_epochs=1))
    _, pooled = train(tiny(tmp_path, run_dir=None, num_epochs=1, async_reward_computation=True))
    assert sync == pooled


def test_custom_reward_function_and_unknown_names(tmp_path):
    brightness = lambda images, prompts: images.mean(dim=(1, 2, 3))  # noqa: E731 -- any Python function
    _, history = train(tiny(tmp_path, run_dir=None, num_epochs=1), reward_fn=brightness)
    assert -1 < history[0]["reward_mean"] < 1 and 0 < history[0]["eval/reward_mean"] < 1
    with pytest.raises(ValueError, match="reward_fn: unknown 'beauty'"):
        train(tiny(tmp_path, reward_fn="beauty"))


@pytest.mark.slow
def test_short_run_raises_the_compressibility_reward(tmp_path):
    """configs/ddpo.yaml for 12 epochs: evaluation on fixed seeds, first 3 epochs vs last 3."""
    cfg = load_config(Config, CONFIG, {"run_dir": str(tmp_path / "run"), "num_epochs": 12, "save_every": 0})
    before = evaluate(build_state(cfg), cfg)["reward_mean"]  # the same initial model as train's
    state, history = train(cfg)
    after = evaluate(state, cfg)["reward_mean"]
    first = sum(h["eval/reward_mean"] for h in history[:3]) / 3
    last = sum(h["eval/reward_mean"] for h in history[-3:]) / 3
    print(f"eval reward before {before:.4f}, first 3 epochs {first:.4f}, last 3 {last:.4f}, after {after:.4f}")
    assert last > first + 0.02 and after > before + 0.03  # seeds 0-7 gave +0.04..0.07 and more
