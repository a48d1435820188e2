"""Tests of rlcore.algorithms.ddpo: DDIM step and its log-density, the clipped loss, advantages."""

from __future__ import annotations

import math
from collections import deque

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from rlcore import keys as K
from rlcore.algorithms.ddpo import (DDIM_PREDICTIONS, PromptStats, batch_advantages, ddim_step, ddim_step_logprob,
                                    ddpo_loss, ddpo_ratio_loss, prompt_stats_init, prompt_stats_update)
from rlcore.testing import assert_pure
from tests.algorithms.conformance import check_compiles, check_dtypes, check_gradients, check_outputs

T_TRAIN, STEPS = 1000, 10


def _alphas_cumprod(dtype=torch.float64):
    # Stable Diffusion's "scaled_linear" schedule
    betas = torch.linspace(0.00085 ** 0.5, 0.012 ** 0.5, T_TRAIN, dtype=torch.float64) ** 2
    return torch.cumprod(1 - betas, 0).to(dtype)


def _randn(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def _step(model_output, t, sample, **kw):
    ac = kw.pop("alphas_cumprod", _alphas_cumprod())
    kw.setdefault("final_alpha_cumprod", ac[0])
    return ddim_step(model_output, t, sample, alphas_cumprod=ac, num_train_timesteps=T_TRAIN,
                     num_inference_steps=STEPS, **kw)


# --- ddim_step_logprob ------------------------------------------------------------------------
def test_logprob_is_the_gaussian_density_averaged_over_latent_dims():
    B, C, H, W = 2, 3, 2, 2
    x, mu = _randn(B, C, H, W, seed=1), _randn(B, C, H, W, seed=2)
    std = torch.tensor([0.5, 2.0], dtype=torch.float64)
    out = ddim_step_logprob(x, mu, std)
    for b in range(B):
        s = float(std[b])
        vals = [-(float(x[b, c, i, j]) - float(mu[b, c, i, j])) ** 2 / (2 * s * s) - math.log(s)
                - math.log(math.sqrt(2 * math.pi))
                for c in range(C) for i in range(H) for j in range(W)]
        assert out[b].item() == pytest.approx(sum(vals) / len(vals), rel=1e-12)
    normal = torch.distributions.Normal(mu, std[:, None, None, None]).log_prob(x).mean((-3, -2, -1))
    torch.testing.assert_close(out, normal)


def test_logprob_golden_and_std_layouts():
    x = torch.zeros(1, 1, 1, 2, dtype=torch.float64)
    assert ddim_step_logprob(x, x, 1.0).item() == pytest.approx(-0.5 * math.log(2 * math.pi))
    x1 = torch.tensor([[[[1.0, 3.0]]]], dtype=torch.float64)
    # σ = 2: each entry is −x²/8 − log 2 − log √(2π); x = 1 and 3
    expected = np.mean([-1 / 8, -9 / 8]) - math.log(2) - 0.5 * math.log(2 * math.pi)
    assert ddim_step_logprob(x1, torch.zeros_like(x1), 2.0).item() == pytest.approx(expected)
    xs, ms = _randn(3, 2, 2, 2, seed=3), _randn(3, 2, 2, 2, seed=4)
    full = torch.full_like(xs, 0.7)
    ref = ddim_step_logprob(xs, ms, full)
    torch.testing.assert_close(ddim_step_logprob(xs, ms, 0.7), ref)
    torch.testing.assert_close(ddim_step_logprob(xs, ms, torch.tensor(0.7, dtype=torch.float64)), ref)
    torch.testing.assert_close(ddim_step_logprob(xs, ms, torch.full((3,), 0.7, dtype=torch.float64)), ref)
    # leading dims [P, G] and a 2-d latent (event_dims=2)
    y = _randn(2, 3, 4, 5, seed=5)
    out = ddim_step_logprob(y, torch.zeros_like(y), torch.ones(2, 3, dtype=torch.float64), event_dims=2)
    assert out.shape == (2, 3)
    torch.testing.assert_close(out, torch.distributions.Normal(0.0, 1.0).log_prob(y).mean((-2, -1)))


def test_logprob_gradcheck_pure_and_bad_inputs():
    x, mu = _randn(2, 2, 2, 2, seed=1), _randn(2, 2, 2, 2, seed=2).requires_grad_(True)
    std = torch.tensor([0.5, 1.5], dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda m, s: ddim_step_logprob(x, m, s), (mu, std))
    assert_pure(ddim_step_logprob, x, mu.detach(), std.detach())
    with pytest.raises(ValueError, match=r"mean: expected shape \[2, 2, 2, 2\].*got \[2, 2, 2\]"):
        ddim_step_logprob(x, mu[0], 1.0)
    with pytest.raises(ValueError, match=r"std: .*got \[2, 2\]"):
        ddim_step_logprob(x, mu, torch.ones(2, 2))
    with pytest.raises(ValueError, match=r"std: shape \[3, 1, 1, 1\] does not broadcast"):
        ddim_step_logprob(x, mu, torch.ones(3))
    with pytest.raises(ValueError, match=r"sample_prev: expected at least 3 dims"):
        ddim_step_logprob(torch.zeros(2, 2), torch.zeros(2, 2), 1.0)


# --- ddim_step --------------------------------------------------------------------------------
def _ref_ddim_mean_std(eps, t, x, ac, final, eta):
    """DDIM eq. 12/16 per sample with Python floats (epsilon prediction)."""
    means, stds = [], []
    for b in range(x.shape[0]):
        tb = int(t[b]) if torch.is_tensor(t) and t.ndim else int(t)
        a_t = float(ac[tb])
        prev = tb - T_TRAIN // STEPS
        a_p = float(ac[prev]) if prev >= 0 else float(final)
        sigma = eta * math.sqrt((1 - a_p) / (1 - a_t)) * math.sqrt(1 - a_t / a_p)
        x0 = (x[b] - math.sqrt(1 - a_t) * eps[b]) / math.sqrt(a_t)
        means.append(math.sqrt(a_p) * x0 + math.sqrt(1 - a_p - sigma ** 2) * eps[b])
        stds.append(sigma)
    return torch.stack(means), torch.tensor(stds, dtype=x.dtype)


@pytest.mark.parametrize("eta", [0.0, 0.5, 1.0])
def test_ddim_step_against_the_paper_formula(eta):
    ac = _alphas_cumprod()
    x, eps = _randn(4, 2, 3, 3, seed=1), _randn(4, 2, 3, 3, seed=2)
    t = torch.tensor([901, 501, 101, 1])            # the last one steps past 0: uses final ᾱ
    g = torch.Generator().manual_seed(7)
    prev, logprob, mean, std = _step(eps, t, x, eta=eta, generator=g, final_alpha_cumprod=1.0)
    ref_mean, ref_std = _ref_ddim_mean_std(eps, t, x, ac, 1.0, eta)
    torch.testing.assert_close(mean, ref_mean)
    torch.testing.assert_close(std, ref_std)
    assert std[-1] == 0  # final ᾱ = 1: the last step is deterministic
    noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(7), dtype=x.dtype)
    torch.testing.assert_close(prev, mean + std[:, None, None, None] * noise)
    if eta > 0:
        torch.testing.assert_close(logprob[:3], ddim_step_logprob(prev, mean, std)[:3])


def test_scalar_and_per_sample_timesteps_agree():
    x, eps = _randn(3, 2, 2, 2, seed=1), _randn(3, 2, 2, 2, seed=2)
    prev = _randn(3, 2, 2, 2, seed=3)
    _, lp_batched, mean_b, std_b = _step(eps, torch.full((3,), 401), x, prev_sample=prev)
    _, lp_int, mean_i, std_i = _step(eps, 401, x, prev_sample=prev)
    torch.testing.assert_close(lp_batched, lp_int)
    torch.testing.assert_close(mean_b, mean_i)
    assert std_b.shape == (3,) and std_i.shape == (3,)


def test_rescoring_the_sample_gives_the_same_logprob():
    x, eps = _randn(2, 4, 4, 4, seed=1, dtype=torch.float32), _randn(2, 4, 4, 4, seed=2, dtype=torch.float32)
    ac = _alphas_cumprod(torch.float32)
    prev, lp, _, _ = _step(eps, 601, x, alphas_cumprod=ac, generator=torch.Generator().manual_seed(0))
    again, lp2, _, _ = _step(eps, 601, x, alphas_cumprod=ac, prev_sample=prev)
    assert again.equal(prev)
    assert lp2.equal(lp)  # bitwise: the ratio of the first DDPO update is exactly 1
    # bf16 latents: the log-prob is of the cast sample, so re-scoring still agrees
    xb, eb = x.bfloat16(), eps.bfloat16()
    prev_b, lp_b, mean_b, _ = _step(eb, 601, xb, alphas_cumprod=ac, generator=torch.Generator().manual_seed(0))
    assert prev_b.dtype == torch.bfloat16 and mean_b.dtype == torch.float32
    assert _step(eb, 601, xb, alphas_cumprod=ac, prev_sample=prev_b)[1].equal(lp_b)


def test_noise_is_standard_normal():
    x, eps = _randn(2, 4, 32, 32, seed=1), _randn(2, 4, 32, 32, seed=2)
    prev, _, mean, std = _step(eps, 501, x, generator=torch.Generator().manual_seed(3))
    z = (prev - mean) / std[:, None, None, None]
    assert abs(z.mean().item()) < 0.05 and abs(z.std().item() - 1) < 0.05


def test_prediction_types_agree_on_the_same_x0_and_eps():
    ac = _alphas_cumprod()
    x, eps = _randn(2, 2, 3, 3, seed=1), _randn(2, 2, 3, 3, seed=2)
    t = 701
    a = ac[t]
    x0 = (x - (1 - a).sqrt() * eps) / a.sqrt()
    v = a.sqrt() * eps - (1 - a).sqrt() * x0
    prev = _randn(2, 2, 3, 3, seed=3)
    outs = {name: _step(out, t, x, prediction_type=name, prev_sample=prev)
            for name, out in [("epsilon", eps), ("sample", x0), ("v_prediction", v)]}
    assert set(outs) == set(DDIM_PREDICTIONS)
    for name in ("sample", "v_prediction"):
        torch.testing.assert_close(outs[name][2], outs["epsilon"][2])
        torch.testing.assert_close(outs[name][1], outs["epsilon"][1])


def test_final_alpha_equal_to_alpha0_is_ddpo_clamping():
    """DDPO clamps t' at 0; diffusers uses final_alpha_cumprod. They agree when it is ᾱ_0."""
    ac = _alphas_cumprod()
    x, eps, prev = _randn(1, 2, 2, 2, seed=1), _randn(1, 2, 2, 2, seed=2), _randn(1, 2, 2, 2, seed=3)
    _, lp, mean, std = _step(eps, 1, x, prev_sample=prev, final_alpha_cumprod=ac[0])
    a_t, a_p = float(ac[1]), float(ac[0])      # clamped t' = 0
    sigma = math.sqrt((1 - a_p) / (1 - a_t) * (1 - a_t / a_p))
    assert std.item() == pytest.approx(sigma, rel=1e-12)
    x0 = (x - math.sqrt(1 - a_t) * eps) / math.sqrt(a_t)
    torch.testing.assert_close(mean, math.sqrt(a_p) * x0 + math.sqrt(1 - a_p - sigma ** 2) * eps)


def test_ddim_step_gradients():
    x, prev = _randn(2, 2, 2, 2, seed=1), _randn(2, 2, 2, 2, seed=3)
    eps = _randn(2, 2, 2, 2, seed=2).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda e: _step(e, 301, x, prev_sample=prev)[1], (eps,))
    prev_g = prev.clone().requires_grad_(True)
    _, lp, _, _ = _step(eps, 301, x, prev_sample=prev_g)
    lp.sum().backward()
    assert prev_g.grad is None and eps.grad is not None and torch.isfinite(eps.grad).all()


def test_ddim_step_pure():
    x, eps = _randn(2, 2, 2, 2, seed=1), _randn(2, 2, 2, 2, seed=2)
    ac = _alphas_cumprod()
    kw = dict(alphas_cumprod=ac, final_alpha_cumprod=ac[0], num_train_timesteps=T_TRAIN, num_inference_steps=STEPS)
    assert_pure(ddim_step, eps, torch.tensor([501, 301]), x, generator=torch.Generator().manual_seed(0), **kw)
    assert_pure(ddim_step, eps, 501, x, prev_sample=_randn(2, 2, 2, 2, seed=3), **kw)


def test_ddim_step_bad_inputs():
    x, eps = _randn(2, 2, 2, 2, seed=1), _randn(2, 2, 2, 2, seed=2)
    with pytest.raises(ValueError, match="exactly one of prev_sample"):
        _step(eps, 501, x)
    with pytest.raises(ValueError, match="exactly one of prev_sample"):
        _step(eps, 501, x, prev_sample=x, generator=torch.Generator())
    with pytest.raises(ValueError, match=r"prediction_type.*valid.*epsilon.*v_prediction"):
        _step(eps, 501, x, prediction_type="eps", prev_sample=x)
    with pytest.raises(ValueError, match=r"model_output: expected shape \[2, 2, 2, 2\].*got \[2, 2, 2\]"):
        _step(eps[0], 501, x, prev_sample=x)
    with pytest.raises(TypeError, match="timestep.*integer"):
        _step(eps, torch.tensor(501.0), x, prev_sample=x)
    with pytest.raises(ValueError, match=r"timestep: expected a scalar or the leading shape \[2\]"):
        _step(eps, torch.ones(2, 2, dtype=torch.long), x, prev_sample=x)
    with pytest.raises(ValueError, match=r"alphas_cumprod: expected a 1-d tensor"):
        _step(eps, 501, x, prev_sample=x, alphas_cumprod=torch.ones(2, 3))


def test_ddim_step_compiles_without_graph_breaks():
    x, eps, prev = _randn(2, 2, 2, 2, seed=1), _randn(2, 2, 2, 2, seed=2), _randn(2, 2, 2, 2, seed=3)
    ac = _alphas_cumprod()
    t = torch.tensor([501, 301])

    def f(e, s, p):
        return ddim_step(e, t, s, alphas_cumprod=ac, final_alpha_cumprod=ac[0], num_train_timesteps=T_TRAIN,
                         num_inference_steps=STEPS, prev_sample=p)[1]

    torch.testing.assert_close(torch.compile(f, backend="eager", fullgraph=True)(eps, x, prev), f(eps, x, prev))


@pytest.mark.parametrize("set_alpha_to_one", [False, True])
def test_parity_with_diffusers_ddim_scheduler(set_alpha_to_one):
    diffusers = pytest.importorskip("diffusers")
    sched = diffusers.DDIMScheduler(num_train_timesteps=T_TRAIN, beta_start=0.00085, beta_end=0.012,
                                    beta_schedule="scaled_linear", clip_sample=False,
                                    set_alpha_to_one=set_alpha_to_one, steps_offset=1)
    sched.set_timesteps(STEPS)
    x = _randn(2, 4, 8, 8, seed=1, dtype=torch.float32)
    for i, t in enumerate(sched.timesteps):
        eps = _randn(2, 4, 8, 8, seed=10 + i, dtype=torch.float32)
        kw = dict(alphas_cumprod=sched.alphas_cumprod, final_alpha_cumprod=sched.final_alpha_cumprod,
                  num_train_timesteps=T_TRAIN, num_inference_steps=STEPS, generator=torch.Generator())
        ref0 = sched.step(eps, t, x, eta=0.0).prev_sample
        torch.testing.assert_close(ddim_step(eps, t, x, eta=0.0, **kw)[2], ref0, rtol=1e-5, atol=1e-5)
        noise = _randn(2, 4, 8, 8, seed=50 + i, dtype=torch.float32)
        ref1 = sched.step(eps, t, x, eta=1.0, variance_noise=noise).prev_sample
        _, _, mean, std = ddim_step(eps, t, x, eta=1.0, **kw)
        torch.testing.assert_close(mean + std[:, None, None, None] * noise, ref1, rtol=1e-5, atol=1e-5)
        x = ref1


# --- the clipped surrogate --------------------------------------------------------------------
def test_ratio_loss_against_formula():
    g = torch.Generator().manual_seed(0)
    lp = torch.randn(20, generator=g, dtype=torch.float64) * 1e-4
    old = torch.randn(20, generator=g, dtype=torch.float64) * 1e-4
    adv = torch.randn(20, generator=g, dtype=torch.float64) * 4
    out = ddpo_ratio_loss(lp, old, adv, clip_range=1e-4, adv_clip_max=5.0)
    for i in range(20):
        a = min(max(float(adv[i]), -5.0), 5.0)
        rho = math.exp(float(lp[i]) - float(old[i]))
        ref = max(-a * rho, -a * min(max(rho, 1 - 1e-4), 1 + 1e-4))
        assert out[i].item() == pytest.approx(ref, rel=1e-12)


def test_ratio_loss_golden():
    lp = torch.log(torch.tensor([1.0, 1.5, 0.5, 1.5], dtype=torch.float64))
    adv = torch.tensor([2.0, 1.0, -1.0, -10.0], dtype=torch.float64)
    out = ddpo_ratio_loss(lp, torch.zeros(4, dtype=torch.float64), adv, clip_range=0.2, adv_clip_max=5.0)
    # ρ=1: −2;  ρ=1.5, A=1: max(−1.5, −1.2) = −1.2;  ρ=0.5, A=−1: max(0.5, 0.8) = 0.8;
    # ρ=1.5, A=−10 → −5: max(7.5, 6.0) = 7.5
    torch.testing.assert_close(out, torch.tensor([-2.0, -1.2, 0.8, 7.5], dtype=torch.float64))


def test_ratio_one_gradient_is_minus_advantage_times_grad_logp():
    g = torch.Generator().manual_seed(1)
    theta = torch.randn(5, generator=g, dtype=torch.float64, requires_grad=True)
    feats = torch.randn(8, 5, generator=g, dtype=torch.float64)
    adv = torch.randn(8, generator=g, dtype=torch.float64) * 3
    lp = torch.nn.functional.logsigmoid(feats @ theta)
    out = ddpo_ratio_loss(lp, lp.detach(), adv)
    torch.testing.assert_close(out, -adv.clamp(-5, 5))  # ratio exactly 1
    (grad,) = torch.autograd.grad(out.mean(), theta, retain_graph=True)
    (expected,) = torch.autograd.grad((-adv.clamp(-5, 5) * lp).mean(), theta)
    torch.testing.assert_close(grad, expected)
    # outside the clip range on the profitable side the gradient vanishes
    lp2 = lp.detach() + 0.1
    lp2.requires_grad_(True)
    pos = torch.ones(8, dtype=torch.float64)
    ddpo_ratio_loss(lp2, lp.detach(), pos).sum().backward()
    assert lp2.grad.abs().max() == 0


def _ratio_loss_as_written(lp, old, adv, clip_range, adv_clip_max):
    """The surrogate exactly as the formula reads, with no bound on the ratio."""
    a = adv.detach().clamp(-adv_clip_max, adv_clip_max)
    ratio = torch.exp(lp - old.detach())
    return torch.maximum(-a * ratio, -a * ratio.clamp(1 - clip_range, 1 + clip_range))


@pytest.mark.parametrize("clip_range", [0.0, 1e-4, 0.2, 1.0, 1.5])
def test_ratio_loss_is_the_formula_bit_for_bit_wherever_the_formula_is_finite(clip_range):
    """float64: value and gradient equal the unbounded formula's wherever those are finite, on a grid
    through every bound (log(1 ± ε) ± 1, exp's overflow at 709.78) and both signs of the advantage."""
    lo = math.log(1 - clip_range) if clip_range < 1 else -50.0
    points = [0.0, 1e-5, -1e-5, 0.5, -0.5, 3.0, -3.0, 30.0, -30.0, 700.0, -700.0, 709.78, 709.79, -745.0, 800.0,
              math.log1p(clip_range), math.log1p(clip_range) + 1, math.log1p(clip_range) + 1 + 1e-9, lo, lo - 1,
              lo - 1 - 1e-9]
    lr = torch.tensor(points, dtype=torch.float64)
    n = len(points)
    for adv in (torch.full((n,), 2.0), torch.full((n,), -2.0), torch.zeros(n), torch.full((n,), -1e-300)):
        adv = adv.double()
        got_lp = lr.clone().requires_grad_(True)
        want_lp = lr.clone().requires_grad_(True)
        got = ddpo_ratio_loss(got_lp, torch.zeros(n, dtype=torch.float64), adv, clip_range=clip_range,
                              adv_clip_max=5.0)
        want = _ratio_loss_as_written(want_lp, torch.zeros(n, dtype=torch.float64), adv, clip_range, 5.0)
        (g_got,) = torch.autograd.grad(got.sum(), got_lp)
        (g_want,) = torch.autograd.grad(want.sum(), want_lp)
        assert torch.isfinite(got).all() and torch.isfinite(g_got).all()
        finite = torch.isfinite(want) & torch.isfinite(g_want)
        assert finite.sum() >= n - 3
        assert torch.equal(got[finite], want[finite].detach()), (adv[0], got, want)
        assert torch.equal(g_got[finite], g_want[finite]), (adv[0], g_got, g_want)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_ratio_loss_is_finite_for_any_finite_log_probs(dtype):
    """The ratio exp(lp − old) of far-apart log-probs overflowed: NaN loss and gradient at 0·inf."""
    lp0 = torch.tensor([100.0], dtype=dtype, requires_grad=True)
    loss = ddpo_ratio_loss(lp0, torch.zeros(1, dtype=dtype), torch.zeros(1, dtype=dtype))
    (g,) = torch.autograd.grad(loss.sum(), lp0)
    assert loss.item() == 0 and g.item() == 0
    big = torch.finfo(dtype).max
    lp = torch.tensor([100.0, 100.0, -3e38, 0.0, -3e38, 0.0, 1e4], dtype=dtype, requires_grad=True)
    old = torch.tensor([0.0, 0.0, 0.0, -3e38, 0.0, -3e38, 0.0], dtype=dtype)
    adv = torch.tensor([1.0, -1.0, 1.0, 1.0, -1.0, -1.0, -3e38], dtype=dtype)
    loss = ddpo_ratio_loss(lp, old, adv, clip_range=0.2, adv_clip_max=float("inf"))
    (g,) = torch.autograd.grad(loss.sum(), lp)
    assert torch.isfinite(loss).all() and torch.isfinite(g).all()
    # A > 0 past 1 + ε: −A(1 + ε); A < 0 far below 1 − ε: −A(1 − ε); A < 0, ρ past the range: saturated
    want = torch.tensor([-1.2, min(math.exp(100), big), 0.0, -1.2, 0.8, big, big], dtype=torch.float64).to(dtype)
    torch.testing.assert_close(loss, want)
    ddpo_loss_, metrics = ddpo_loss(TensorDict({K.LOGPROBS: lp, K.OLD_LOGPROBS: old, K.ADVANTAGES: adv}, [7]),
                                    adv_clip_max=float("inf"))
    assert torch.isfinite(ddpo_loss_) and all(torch.isfinite(v) for v in metrics.values())
    kl = 0.5 * (4 * 9e76 + 2 * 1e4 + 1e8) / 7  # four log-ratios of ±3e38: saturated below float64
    assert metrics["approx_kl"].item() == pytest.approx(min(kl, big), rel=1e-6) and metrics["clipfrac"] == 1


@pytest.mark.parametrize("kw", [dict(clip_range=-0.1), dict(clip_range=float("nan")), dict(clip_range=float("inf")),
                                dict(adv_clip_max=-1.0), dict(adv_clip_max=float("nan"))])
def test_ratio_loss_refuses_bad_hyper_parameters(kw):
    (name, value), = kw.items()
    x = torch.zeros(2)
    with pytest.raises(ValueError, match=rf"^{name}: expected .*got {value}"):
        ddpo_ratio_loss(x, x, x, **kw)
    with pytest.raises(ValueError, match=rf"^{name}: "):
        ddpo_loss(TensorDict({K.LOGPROBS: x, K.OLD_LOGPROBS: x, K.ADVANTAGES: x}, [2]), **kw)


def test_ddpo_loss_metrics():
    lp = torch.tensor([0.0, 0.2, -0.2, 0.0], dtype=torch.float64)
    old = torch.zeros(4, dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0, 2.0, 0.5], dtype=torch.float64)
    batch = TensorDict({K.LOGPROBS: lp, K.OLD_LOGPROBS: old, K.ADVANTAGES: adv}, [4])
    loss, m = ddpo_loss(batch, clip_range=0.1)
    torch.testing.assert_close(loss, ddpo_ratio_loss(lp, old, adv, clip_range=0.1).mean())
    assert m["approx_kl"].item() == pytest.approx(0.5 * (0.04 + 0.04) / 4)
    assert m["clipfrac"].item() == pytest.approx(0.5)
    assert m["loss_policy"].item() == loss.item()
    assert m.batch_size == torch.Size([]) and all(not v.requires_grad for v in m.values())
    assert_pure(ddpo_loss, batch, clip_range=0.1)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float64, 1e-12), (torch.bfloat16, 2e-2)])
def test_ddpo_loss_dtypes(dtype, tol):
    g = torch.Generator().manual_seed(2)
    lp64 = torch.randn(6, generator=g, dtype=torch.float64) * 1e-3
    adv64 = torch.randn(6, generator=g, dtype=torch.float64)
    ref, _ = ddpo_loss(TensorDict({K.LOGPROBS: lp64, K.OLD_LOGPROBS: torch.zeros(6, dtype=torch.float64),
                                   K.ADVANTAGES: adv64}, [6]), clip_range=1e-2)
    loss, m = ddpo_loss(TensorDict({K.LOGPROBS: lp64.to(dtype), K.OLD_LOGPROBS: torch.zeros(6, dtype=dtype),
                                    K.ADVANTAGES: adv64.to(dtype)}, [6]), clip_range=1e-2)
    assert loss.dtype == dtype and m["approx_kl"].dtype == dtype
    assert loss.double().item() == pytest.approx(ref.item(), rel=tol, abs=tol)


def test_ddpo_loss_conformance():
    """The conformance checks that apply to a loss without a time dimension or mask."""
    g = torch.Generator().manual_seed(4)
    batch = TensorDict({K.LOGPROBS: torch.randn(6, generator=g, dtype=torch.float64) * 1e-4,
                        K.OLD_LOGPROBS: torch.randn(6, generator=g, dtype=torch.float64) * 1e-4,
                        K.ADVANTAGES: torch.randn(6, generator=g, dtype=torch.float64) * 3}, [6])
    check_outputs(ddpo_loss, batch, grad_keys=[K.LOGPROBS])
    check_dtypes(ddpo_loss, batch)
    check_gradients(ddpo_loss, batch, grad_keys=[K.LOGPROBS])
    check_compiles(ddpo_loss, batch, grad_keys=[K.LOGPROBS])
    assert_pure(ddpo_loss, batch)


def test_ddpo_loss_bad_inputs():
    batch = TensorDict({K.LOGPROBS: torch.zeros(3), K.OLD_LOGPROBS: torch.zeros(3)}, [3])
    with pytest.raises(KeyError, match="advantages"):
        ddpo_loss(batch)
    with pytest.raises(ValueError, match=r"advantages: expected shape \[3\].*got \[2\]"):
        ddpo_ratio_loss(torch.zeros(3), torch.zeros(3), torch.zeros(2))
    with pytest.raises(TypeError, match="logprobs.*floating"):
        ddpo_ratio_loss(torch.zeros(3, dtype=torch.long), torch.zeros(3), torch.zeros(3))


def test_ratio_loss_compiles():
    args = (torch.randn(4) * 1e-3, torch.zeros(4), torch.randn(4))
    torch.testing.assert_close(torch.compile(ddpo_ratio_loss, backend="eager", fullgraph=True)(*args),
                               ddpo_ratio_loss(*args))


# --- advantages -------------------------------------------------------------------------------
def test_batch_advantages_use_the_biased_std():
    r = torch.tensor([1.0, 2.0, 4.0, 9.0], dtype=torch.float64)
    out = batch_advantages(r)
    rn = r.numpy()
    np.testing.assert_allclose(out.numpy(), (rn - rn.mean()) / (rn.std() + 1e-8), rtol=1e-12)
    torch.testing.assert_close(batch_advantages(torch.tensor([1.0, 3.0])), torch.tensor([-1.0, 1.0]))
    assert_pure(batch_advantages, r)
    assert batch_advantages(torch.full((3,), 2.0)).abs().max() == 0  # no spread: zeros, not NaN


class _DequeTracker:
    """DDPO's per-prompt stat tracker, written plainly: a deque per prompt, numpy statistics."""

    def __init__(self, buffer_size, min_count):
        self.buffer_size, self.min_count, self.stats = buffer_size, min_count, {}

    def update(self, prompts, rewards):
        prompts, rewards = np.array(prompts), np.array(rewards, dtype=np.float64)
        advantages = np.empty_like(rewards)
        for prompt in np.unique(prompts):
            sel = rewards[prompts == prompt]
            buf = self.stats.setdefault(prompt, deque(maxlen=self.buffer_size))
            buf.extend(sel)
            if len(buf) < self.min_count:
                mean, std = np.mean(rewards), np.std(rewards) + 1e-6
            else:
                mean, std = np.mean(buf), np.std(buf) + 1e-6
            advantages[prompts == prompt] = (sel - mean) / std
        return advantages


batches = st.lists(st.lists(st.tuples(st.sampled_from("abcd"), st.floats(-5, 5)), min_size=1, max_size=12),
                   min_size=1, max_size=5)


@settings(max_examples=40, deadline=None)
@given(batches=batches, buffer_size=st.integers(1, 6), min_count=st.integers(0, 7))
def test_prompt_stats_against_deque_tracker(batches, buffer_size, min_count):
    ref = _DequeTracker(buffer_size, min_count)
    state = prompt_stats_init(buffer_size, min_count)
    for batch in batches:
        prompts = [p for p, _ in batch]
        rewards = torch.tensor([r for _, r in batch], dtype=torch.float64)
        state, adv = prompt_stats_update(state, prompts, rewards)
        np.testing.assert_allclose(adv.numpy(), ref.update(prompts, rewards.tolist()), rtol=1e-9, atol=1e-9)
        for p, buf in ref.stats.items():
            i = state.prompts.index(p)
            n = int(state.counts[i])
            held = [float(state.rewards[i, k % buffer_size]) for k in range(max(n - buffer_size, 0), n)]
            assert held == list(buf)


def test_prompt_stats_golden_and_overflow_within_a_batch():
    state = prompt_stats_init(buffer_size=2, min_count=2)
    state, adv = prompt_stats_update(state, ["x", "x", "x", "y"], torch.tensor([1.0, 2.0, 4.0, 10.0]))
    # "x" keeps its last two rewards (2, 4): mean 3, std 1; "y" falls back to the batch (mean 4.25)
    assert state.prompts == ("x", "y") and state.counts.tolist() == [3, 1]
    assert sorted(state.rewards[0].tolist()) == [2.0, 4.0]
    batch_std = np.std([1.0, 2.0, 4.0, 10.0])
    expected = [(1 - 3) / (1 + 1e-6), (2 - 3) / (1 + 1e-6), (4 - 3) / (1 + 1e-6), (10 - 4.25) / (batch_std + 1e-6)]
    np.testing.assert_allclose(adv.numpy(), expected, rtol=1e-6)
    assert adv.dtype == torch.float32


def test_prompt_stats_update_is_pure():
    state = prompt_stats_init(buffer_size=3, min_count=1)
    state, _ = prompt_stats_update(state, ["a", "b"], torch.tensor([1.0, 2.0]))
    before = PromptStats(state.prompts, state.rewards.clone(), state.counts.clone(), state.min_count)
    new, _ = assert_pure(prompt_stats_update, state, ["a", "c", "a"], torch.tensor([3.0, 4.0, 5.0]))
    assert state.prompts == before.prompts and state.rewards.equal(before.rewards)
    assert state.counts.equal(before.counts)
    assert new.prompts == ("a", "b", "c") and new.counts.tolist() == [3, 1, 1]


def test_prompt_stats_bad_inputs():
    state = prompt_stats_init()
    with pytest.raises(ValueError, match=r"prompts: expected 3 prompts.*\[3\].*got 2"):
        prompt_stats_update(state, ["a", "b"], torch.zeros(3))
    with pytest.raises(ValueError, match=r"rewards: expected a 1-d tensor \[B\], got shape \[3, 1\]"):
        prompt_stats_update(state, ["a", "b", "c"], torch.zeros(3, 1))
    with pytest.raises(ValueError, match="buffer_size"):
        prompt_stats_init(buffer_size=0)
