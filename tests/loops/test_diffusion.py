"""loops/diffusion.py: DDIM schedules (against diffusers), the tiny denoiser, CFG, trajectories whose
log-probs are the Gaussian density of each step, training rows, JPEG rewards, grids, pre-training."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

pytest.importorskip("diffusers")
pytest.importorskip("PIL")

from rlcore import keys as K  # noqa: E402
from rlcore.algorithms.ddpo import ddim_step  # noqa: E402
from rlcore.loops.diffusion import (BETA_SCHEDULES, SYNTHETIC_PATTERNS, build_denoiser, ddim_schedule,  # noqa: E402
                                    predict_noise, pretrain_denoiser, sample_trajectories, schedule_from_scheduler,
                                    step_logprobs, synthetic_images, timestep_rows)
from rlcore.loops.images import (REWARD_FUNCTIONS, get_reward_fn, image_grid, images_to_uint8,  # noqa: E402
                                 jpeg_compressibility, jpeg_incompressibility, jpeg_sizes, latents_to_images,
                                 save_image_grid, score_images)
from rlcore.testing import assert_pure  # noqa: E402

P = 3  # classes; id 3 is the null class


@pytest.fixture(scope="module")
def model():
    """A tiny 3x8x8 denoiser (do not modify it in a test)."""
    return build_denoiser(P, sample_size=8, block_out_channels=(8, 16), seed=0)


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


# --- schedules ----------------------------------------------------------------------------------
def test_schedule_golden():
    s = ddim_schedule(2, num_train_timesteps=4, beta_start=0.1, beta_end=0.4)
    torch.testing.assert_close(s.alphas_cumprod, torch.tensor([0.9, 0.72, 0.504, 0.3024]))
    assert s.timesteps.tolist() == [3, 1] and s.final_alpha_cumprod.item() == pytest.approx(0.9)
    assert ddim_schedule(2, num_train_timesteps=4, set_alpha_to_one=True, steps_offset=0).timesteps.tolist() == [2, 0]
    assert ddim_schedule(2, num_train_timesteps=4, set_alpha_to_one=True).final_alpha_cumprod.item() == 1.0
    kw = s.step_kwargs()
    assert kw["num_inference_steps"] == 2 and kw["num_train_timesteps"] == 4 and kw["prediction_type"] == "epsilon"


@pytest.mark.parametrize("beta_schedule", sorted(BETA_SCHEDULES))
@pytest.mark.parametrize("steps", [10, 7])
def test_schedule_matches_diffusers(beta_schedule, steps):
    from diffusers import DDIMScheduler
    sched = DDIMScheduler(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule=beta_schedule,
                          clip_sample=False, set_alpha_to_one=False, steps_offset=1)
    ours = ddim_schedule(steps, beta_start=0.00085, beta_end=0.012, beta_schedule=beta_schedule)
    theirs = schedule_from_scheduler(sched, steps)
    torch.testing.assert_close(ours.alphas_cumprod, sched.alphas_cumprod, rtol=1e-6, atol=0)
    torch.testing.assert_close(ours.final_alpha_cumprod, sched.final_alpha_cumprod)
    assert ours.timesteps.tolist() == theirs.timesteps.tolist()
    assert sched.num_inference_steps is None  # the caller's scheduler was not touched
    # one step through rlcore's ddim_step with the schedule equals diffusers' step with the same noise
    g = gen(1)
    x, eps, z = (torch.randn(2, 3, 4, 4, generator=g) for _ in range(3))
    t = int(ours.timesteps[1])
    _, _, mean, std = ddim_step(eps, t, x, eta=1.0, prev_sample=x, **ours.step_kwargs())
    s2 = schedule_from_scheduler(sched, steps)  # any copy with timesteps set
    del s2
    sched.set_timesteps(steps)
    expected = sched.step(eps, t, x, eta=1.0, variance_noise=z).prev_sample
    torch.testing.assert_close(mean + std[:, None, None, None] * z, expected, rtol=1e-5, atol=1e-6)


def test_schedule_bad_inputs():
    from diffusers import DDIMScheduler
    with pytest.raises(ValueError, match=r"beta_schedule: unknown 'cos'.*linear"):
        ddim_schedule(10, beta_schedule="cos")
    with pytest.raises(ValueError, match="num_inference_steps"):
        ddim_schedule(0)
    with pytest.raises(ValueError, match="clip_sample"):
        schedule_from_scheduler(DDIMScheduler(clip_sample=True), 10)


def test_missing_optional_packages_say_what_to_install(monkeypatch):
    import rlcore.loops.diffusion as diffusion
    import rlcore.loops.images as images
    monkeypatch.setattr(diffusion, "UNet2DModel", None)
    monkeypatch.setattr(images, "Image", None)
    with pytest.raises(ImportError, match=r"build_denoiser needs diffusers: pip install 'rlcore\[diffusion\]'"):
        build_denoiser(P)
    with pytest.raises(ImportError, match="jpeg_sizes needs pillow"):
        jpeg_sizes(torch.zeros(1, 3, 8, 8))
    assert ddim_schedule(4).timesteps.shape == (4,)  # the rest works without them


# --- the denoiser and guidance ---------------------------------------------------------------------
def test_build_denoiser_is_seeded_and_leaves_the_global_rng(model):
    state = torch.get_rng_state()
    again = build_denoiser(P, sample_size=8, block_out_channels=(8, 16), seed=0)
    other = build_denoiser(P, sample_size=8, block_out_channels=(8, 16), seed=1)
    assert torch.equal(torch.get_rng_state(), state)
    a, b, c = (torch.cat([p.reshape(-1) for p in m.parameters()]) for m in (model, again, other))
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert model.config.num_class_embeds == P + 1


def test_predict_noise_guidance_formula(model):
    g = gen()
    x, labels = torch.randn(4, 3, 8, 8, generator=g), torch.tensor([0, 1, 2, 0])
    t = torch.tensor([900, 500, 10, 1])
    with torch.no_grad():
        cond = model(x, t, class_labels=labels).sample
        uncond = model(x, t, class_labels=torch.full_like(labels, P)).sample
        assert torch.equal(predict_noise(model, x, t, labels), cond)
        guided = predict_noise(model, x, t, labels, guidance_scale=3.0, null_class=P)
        torch.testing.assert_close(guided, uncond + 3.0 * (cond - uncond), rtol=1e-5, atol=1e-5)
        same_t = predict_noise(model, x, 500, labels)  # an int timestep broadcasts
        torch.testing.assert_close(same_t, model(x, torch.full((4,), 500), class_labels=labels).sample)
    assert_pure(predict_noise, model, x, t, labels, guidance_scale=2.0, null_class=P)


def test_predict_noise_bad_inputs(model):
    x = torch.randn(2, 3, 8, 8)
    with pytest.raises(ValueError, match=r"latents: expected a 4-d tensor \[B, C, H, W\], got shape \[3, 8, 8\]"):
        predict_noise(model, x[0], 1, torch.tensor([0]))
    with pytest.raises(ValueError, match="class_labels"):
        predict_noise(model, x, 1, torch.tensor([[0, 1]]))
    with pytest.raises(ValueError, match="null_class"):
        predict_noise(model, x, 1, torch.tensor([0, 1]), guidance_scale=2.0)
    with pytest.raises(TypeError, match="latents"):
        predict_noise(model, x.long(), 1, torch.tensor([0, 1]))


# --- trajectories -------------------------------------------------------------------------------------
def _gaussian_step_logprob(model, x, x_next, t, label, *, schedule, eta, w):
    """log N(x_next; μ, σ²) averaged over C·H·W, written out from DDIM eq. 12/16 for one sample."""
    ac, stride = schedule.alphas_cumprod.double(), schedule.num_train_timesteps // len(schedule.timesteps)
    a_t = float(ac[t])
    a_p = float(ac[t - stride]) if t - stride >= 0 else float(schedule.final_alpha_cumprod)
    with torch.no_grad():
        tt = torch.tensor([t])
        eps_c = model(x[None], tt, class_labels=torch.tensor([label])).sample[0].double()
        eps_u = model(x[None], tt, class_labels=torch.tensor([P])).sample[0].double()
    eps = eps_c if w == 1.0 else eps_u + w * (eps_c - eps_u)
    x0 = (x.double() - math.sqrt(1 - a_t) * eps) / math.sqrt(a_t)
    sigma = eta * math.sqrt((1 - a_p) / (1 - a_t)) * math.sqrt(1 - a_t / a_p)
    mu = math.sqrt(a_p) * x0 + math.sqrt(1 - a_p - sigma ** 2) * eps
    total, n = 0.0, 0
    for v, m in zip(x_next.double().reshape(-1).tolist(), mu.reshape(-1).tolist()):
        total += -(v - m) ** 2 / (2 * sigma ** 2) - math.log(sigma) - 0.5 * math.log(2 * math.pi)
        n += 1
    return total / n


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-9), (torch.float32, 1e-4)])
@pytest.mark.parametrize("w", [1.0, 2.5])
def test_collected_logprob_is_the_gaussian_density_of_each_step(dtype, tol, w):
    model = build_denoiser(P, sample_size=8, block_out_channels=(8, 16), seed=2).to(dtype)
    schedule = ddim_schedule(4)
    if dtype == torch.float64:  # a float64 run keeps ᾱ (and so σ) in float64 too
        schedule = schedule._replace(alphas_cumprod=schedule.alphas_cumprod.double(),
                                     final_alpha_cumprod=schedule.final_alpha_cumprod.double())
    labels = torch.tensor([0, 2])
    traj = sample_trajectories(model, labels, schedule, eta=0.7, guidance_scale=w, null_class=P, generator=gen(3))
    lat = traj[K.LATENTS]
    for b in range(2):
        for j, t in enumerate(schedule.timesteps.tolist()):
            expected = _gaussian_step_logprob(model, lat[b, j], lat[b, j + 1], t, int(labels[b]), schedule=schedule,
                                              eta=0.7, w=w)
            assert traj[K.OLD_LOGPROBS][b, j].item() == pytest.approx(expected, rel=tol, abs=tol)


def test_trajectory_layout_and_seeding(model):
    schedule = ddim_schedule(5)
    labels = torch.tensor([0, 1, 2])
    traj = assert_pure(sample_trajectories, model, labels, schedule, guidance_scale=2.0, null_class=P, generator=gen(4))
    assert traj.batch_size == torch.Size([3])
    assert traj[K.LATENTS].shape == (3, 6, 3, 8, 8) and traj[K.LATENTS].dtype == torch.float32
    assert traj[K.TIMESTEPS].shape == (3, 5) and traj[K.TIMESTEPS].dtype == torch.long
    assert traj[K.TIMESTEPS][1].tolist() == schedule.timesteps.tolist()
    assert traj[K.OLD_LOGPROBS].shape == (3, 5) and torch.isfinite(traj[K.OLD_LOGPROBS]).all()
    assert torch.equal(traj[K.CLASS_LABELS], labels)
    assert torch.equal(traj[K.LATENTS][:, 0], torch.randn(3, 3, 8, 8, generator=gen(4)))  # x_T from the generator
    other = sample_trajectories(model, labels, schedule, guidance_scale=2.0, null_class=P, generator=gen(5))
    assert not torch.equal(other[K.LATENTS], traj[K.LATENTS])
    assert not traj[K.OLD_LOGPROBS].requires_grad


def test_step_logprobs_rescore_the_collected_steps(model):
    """Re-scoring stored steps through the same model (other batch composition) gives the same log-probs."""
    schedule = ddim_schedule(4)
    traj = sample_trajectories(model, torch.tensor([0, 1, 2, 1]), schedule, guidance_scale=3.0, null_class=P,
                               generator=gen(6))
    rows = timestep_rows(traj.copy().set(K.ADVANTAGES, torch.zeros(4)), generator=gen(7)).reshape(-1)
    logp = step_logprobs(model, rows, schedule, guidance_scale=3.0, null_class=P)
    torch.testing.assert_close(logp, rows[K.OLD_LOGPROBS], rtol=0, atol=1e-5)
    unguided = step_logprobs(model, rows, schedule)  # the guidance is part of the policy
    assert (unguided - rows[K.OLD_LOGPROBS]).abs().max() > 1e-3
    assert_pure(step_logprobs, model, rows[:5], schedule, guidance_scale=3.0, null_class=P)
    logp.sum().backward()  # differentiable in the parameters
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    model.zero_grad(set_to_none=True)
    with pytest.raises(KeyError, match="next_latents"):
        step_logprobs(model, rows.exclude(K.NEXT_LATENTS), schedule)


def test_bf16_model_samples_and_rescores():
    """bf16 weights: samples are bf16, log-probs float32 (ᾱ stays float32); rescoring agrees (bitwise on
    this CPU; allowed 1e-2, since a kernel may round differently for another batch composition)."""
    model = build_denoiser(P, sample_size=8, block_out_channels=(8, 16), seed=0).to(torch.bfloat16)
    schedule = ddim_schedule(4, prediction_type="sample")
    traj = sample_trajectories(model, torch.tensor([0, 1, 2, 1]), schedule, generator=gen(11))
    assert traj[K.LATENTS].dtype == torch.bfloat16 and traj[K.OLD_LOGPROBS].dtype == torch.float32
    assert torch.isfinite(traj[K.OLD_LOGPROBS]).all()
    rows = timestep_rows(traj.copy().set(K.ADVANTAGES, torch.zeros(4)), generator=gen(12)).reshape(-1)
    with torch.no_grad():
        logp = torch.cat([step_logprobs(model, rows[i:i + 2], schedule) for i in range(0, len(rows), 2)])
    torch.testing.assert_close(logp, rows[K.OLD_LOGPROBS], rtol=0, atol=1e-2)


# --- training rows --------------------------------------------------------------------------------------
def labelled_trajectories(B=2, S=3):
    """latents[b, s] == 10·b + s everywhere, timesteps[b, s] == 1000 − s, old_logprobs[b, s] == 100·b + s."""
    b, s = torch.meshgrid(torch.arange(B), torch.arange(S + 1), indexing="ij")
    lat = (10.0 * b + s)[..., None, None, None].expand(B, S + 1, 3, 2, 2).clone()
    return TensorDict({K.LATENTS: lat, K.TIMESTEPS: 1000 - s[:, :S], K.OLD_LOGPROBS: (100.0 * b + s)[:, :S],
                       K.CLASS_LABELS: torch.arange(B), K.ADVANTAGES: torch.arange(B) - 0.5}, [B])


def test_timestep_rows_golden_without_generator():
    rows = timestep_rows(labelled_trajectories(), timestep_fraction=2 / 3)
    assert rows.batch_size == torch.Size([2, 2])  # int(3 · 2/3) = 2 steps, the first two
    assert rows[K.LATENTS][..., 0, 0, 0].tolist() == [[0.0, 1.0], [10.0, 11.0]]
    assert rows[K.NEXT_LATENTS][..., 0, 0, 0].tolist() == [[1.0, 2.0], [11.0, 12.0]]
    assert rows[K.TIMESTEPS].tolist() == [[1000, 999], [1000, 999]]
    assert rows[K.ADVANTAGES].tolist() == [[-0.5, -0.5], [0.5, 0.5]]
    assert rows[K.CLASS_LABELS].tolist() == [[0, 0], [1, 1]]


@settings(max_examples=30, deadline=None)
@given(B=st.integers(1, 4), S=st.integers(1, 6), fraction=st.floats(0.01, 1.0), seed=st.integers(0, 2 ** 16))
def test_timestep_rows_keep_consistent_distinct_steps(B, S, fraction, seed):
    if int(S * fraction) < 1:
        with pytest.raises(ValueError, match="timestep_fraction"):
            timestep_rows(labelled_trajectories(B, S), timestep_fraction=fraction)
        return
    traj = labelled_trajectories(B, S)
    rows = assert_pure(timestep_rows, traj, timestep_fraction=fraction, generator=gen(seed))
    n = int(S * fraction)
    assert rows.batch_size == torch.Size([B, n])
    step = rows[K.LATENTS][..., 0, 0, 0] - 10.0 * torch.arange(B)[:, None]
    assert torch.equal(rows[K.NEXT_LATENTS][..., 0, 0, 0], rows[K.LATENTS][..., 0, 0, 0] + 1)
    assert torch.equal(rows[K.TIMESTEPS], 1000 - step.long())
    assert torch.equal(rows[K.OLD_LOGPROBS], 100.0 * torch.arange(B)[:, None] + step)
    assert all(len(set(r.tolist())) == n for r in step)  # no step twice in a sample


def test_timestep_rows_draw_every_step_order():
    seen = {tuple(timestep_rows(labelled_trajectories(1, 3), timestep_fraction=1 / 3, generator=gen(s))
                  [K.TIMESTEPS].reshape(-1).tolist()) for s in range(40)}
    assert seen == {(1000,), (999,), (998,)}


def test_timestep_rows_bad_inputs():
    traj = labelled_trajectories()
    with pytest.raises(KeyError, match="advantages"):
        timestep_rows(traj.exclude(K.ADVANTAGES))
    with pytest.raises(ValueError, match=r"timesteps'\]: expected a 2-d tensor \[B, S\], got shape \[2\]"):
        timestep_rows(traj.copy().set(K.TIMESTEPS, torch.zeros(2, dtype=torch.long)))
    with pytest.raises(ValueError, match="timestep_fraction"):
        timestep_rows(traj, timestep_fraction=1.5)


# --- images and rewards --------------------------------------------------------------------------------------
def test_image_conversions_golden():
    x = torch.tensor([-1.0, 0.0, 1.0, 3.0, -7.0]).reshape(1, 1, 1, 5)
    assert latents_to_images(x).reshape(-1).tolist() == [0.0, 0.5, 1.0, 1.0, 0.0]
    u8 = images_to_uint8(torch.tensor([0.0, 0.5, 1.0, 0.2]).reshape(1, 4, 1, 1))
    assert u8.shape == (1, 1, 1, 4) and u8.dtype == torch.uint8 and u8.reshape(-1).tolist() == [0, 128, 255, 51]
    assert_pure(latents_to_images, x)
    with pytest.raises(TypeError, match="images"):
        images_to_uint8(torch.zeros(1, 3, 2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"images: expected a 4-d tensor \[B, C, H, W\]"):
        images_to_uint8(torch.zeros(3, 2, 2))


def test_jpeg_reward_is_monotone_in_noise():
    g = gen(8)
    flat = torch.full((1, 3, 16, 16), 0.5)
    noise = torch.rand(1, 3, 16, 16, generator=g) - 0.5
    images = torch.cat([flat, (flat + 0.1 * noise).clamp(0, 1), (flat + noise).clamp(0, 1)])
    sizes = jpeg_sizes(images)
    assert sizes.dtype == torch.float32 and sizes[0] < sizes[1] < sizes[2]
    assert 0.3 < sizes[0] < 1.0  # kB: a 16x16 JPEG is mostly header
    torch.testing.assert_close(jpeg_compressibility(images, ["a"] * 3), -sizes)
    torch.testing.assert_close(jpeg_incompressibility(images), sizes)
    assert jpeg_compressibility(images).argmax() == 0
    assert jpeg_sizes(flat[:, :1]).shape == (1,)  # grey-scale images work too


def test_reward_lookup_and_score_images():
    assert get_reward_fn("jpeg_compressibility") is REWARD_FUNCTIONS["jpeg_compressibility"]
    fn = lambda images, prompts: [len(p) for p in prompts]  # noqa: E731 -- any Python function
    assert get_reward_fn(fn) is fn
    r = score_images(fn, torch.zeros(2, 3, 4, 4), ("ab", "abc"))
    assert r.dtype == torch.float32 and r.tolist() == [2.0, 3.0]
    with pytest.raises(ValueError, match=r"unknown 'aesthetic'.*jpeg_compressibility"):
        get_reward_fn("aesthetic")
    with pytest.raises(ValueError, match=r"expected rewards of shape \[2\].*got \[3\]"):
        score_images(lambda images, prompts: torch.zeros(3), torch.zeros(2, 3, 4, 4), ["a", "b"])


def test_image_grid_png(tmp_path):
    from PIL import Image
    images = torch.rand(5, 3, 8, 8, generator=gen(9))
    grid = image_grid(images, nrow=3, scale=2, padding=1)
    assert grid.size == (3 * 17 + 1, 2 * 17 + 1)
    path = save_image_grid(images, tmp_path / "sub" / "grid.png")
    with Image.open(path) as im:
        assert im.format == "PNG" and im.size == image_grid(images).size
    tile = torch.tensor(list(grid.crop((1, 1, 17, 17)).tobytes()), dtype=torch.uint8).reshape(16, 16, 3)
    assert torch.equal(tile[::2, ::2], images_to_uint8(images[:1])[0])


# --- synthetic data and pre-training -------------------------------------------------------------------------
def test_synthetic_images():
    labels = torch.tensor([0, 1, 2, 1])
    x = synthetic_images(labels, sorted(SYNTHETIC_PATTERNS), size=8, generator=gen(10))
    assert x.shape == (4, 3, 8, 8) and x.min() >= -1 and x.max() <= 1
    assert torch.equal(x, synthetic_images(labels, sorted(SYNTHETIC_PATTERNS), size=8, generator=gen(10)))
    with pytest.raises(ValueError, match=r"unknown \['cat'\].*blob"):
        synthetic_images(labels, ["cat"], generator=gen())


@pytest.mark.parametrize("prediction_type", ["epsilon", "sample", "v_prediction"])
def test_pretrain_denoiser_lowers_the_loss(prediction_type):
    model = build_denoiser(P, sample_size=8, block_out_channels=(8, 16), seed=0)
    before = [p.detach().clone() for p in model.parameters()]
    schedule = ddim_schedule(4, prediction_type=prediction_type)
    history = pretrain_denoiser(model, schedule, ("stripes", "checkers", "blob"), steps=12, batch_size=8, lr=3e-3)
    assert len(history) == 12 and all(math.isfinite(h["loss"]) for h in history)
    assert sum(h["loss"] for h in history[-3:]) < sum(h["loss"] for h in history[:3])
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
