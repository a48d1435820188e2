"""Tests for rlcore.kl: Schulman's estimators, the registry, straight-through, clamping, kl_full."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore import keys as K
from rlcore.kl import KL_ALIASES, KL_ESTIMATORS, kl_abs, kl_estimate, kl_full, kl_k1, kl_k2, kl_k3
from rlcore.testing import assert_padding_invariant, assert_pure, make_rollout

FORMULAS = {  # plain per-element formulas of d = lp − ref
    "k1": lambda d: d,
    "abs": lambda d: abs(d),
    "k2": lambda d: 0.5 * d * d,
    "k3": lambda d: math.exp(-d) + d - 1,
}
FNS = {"k1": kl_k1, "abs": kl_abs, "k2": kl_k2, "k3": kl_k3}


def _pair(B=3, T=5, dtype=torch.float64, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    ref = lp + scale * torch.randn(B, T, generator=g, dtype=torch.float64)
    return lp.to(dtype), ref.to(dtype)


def _loop_reference(kind, lp, ref, clamp=None):
    out = torch.empty(lp.shape, dtype=torch.float64)
    for b in range(lp.shape[0]):
        for t in range(lp.shape[1]):
            d = float(lp[b, t]) - float(ref[b, t])
            if clamp is not None:
                d = min(max(d, -clamp), clamp)
            out[b, t] = FORMULAS[kind](d)
    return out


# --- values ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", list(FORMULAS))
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_estimators_match_plain_loop(kind, dtype, tol):
    lp, ref = _pair(dtype=dtype)
    out = FNS[kind](lp, ref)
    assert out.dtype == dtype and out.shape == lp.shape
    torch.testing.assert_close(out.double(), _loop_reference(kind, lp, ref), rtol=tol, atol=tol)
    torch.testing.assert_close(kl_estimate(lp, ref, kind), out, rtol=0, atol=0)


def test_golden_values():
    lp, ref = torch.tensor([-1.0, -2.0], dtype=torch.float64), torch.tensor([-1.5, -1.0], dtype=torch.float64)
    torch.testing.assert_close(kl_k1(lp, ref), torch.tensor([0.5, -1.0], dtype=torch.float64))
    torch.testing.assert_close(kl_abs(lp, ref), torch.tensor([0.5, 1.0], dtype=torch.float64))
    torch.testing.assert_close(kl_k2(lp, ref), torch.tensor([0.125, 0.5], dtype=torch.float64))
    # x = ref − lp = [−0.5, 1]: e^{−0.5} + 0.5 − 1 and e − 2
    torch.testing.assert_close(kl_k3(lp, ref), torch.tensor([0.10653065971263342, 0.7182818284590451],
                                                            dtype=torch.float64))


@pytest.mark.parametrize("alias,kind", sorted(KL_ALIASES.items()))
def test_aliases(alias, kind):
    lp, ref = _pair()
    torch.testing.assert_close(kl_estimate(lp, ref, alias), KL_ESTIMATORS[kind](lp, ref), rtol=0, atol=0)


def test_unknown_kind_lists_valid_names():
    lp, ref = _pair()
    with pytest.raises(ValueError, match=r"kind: unknown KL estimator 'k4'.*'abs'.*'k3'.*low_var_kl"):
        kl_estimate(lp, ref, "k4")


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(-30, 30, allow_nan=False), min_size=1, max_size=16),
       st.sampled_from([torch.float32, torch.float64, torch.bfloat16]))
def test_k3_non_negative(ds, dtype):
    d = torch.tensor(ds, dtype=torch.float64)
    tiny = d * 1e-6  # also exercise the series branch
    for x in (d, tiny):
        lp = torch.zeros_like(x).to(dtype)
        out = kl_k3(lp, (-x).to(dtype))
        assert (out >= 0).all() and not out.isnan().any()


@pytest.mark.parametrize("dtype,rtol", [(torch.float64, 1e-12), (torch.float32, 2e-6)])
def test_k3_close_to_k2_for_small_log_ratios_with_full_relative_precision(dtype, rtol):
    # k3 = d²/2 − d³/6 + … ; relative precision must hold even where expm1(x) − x cancels.
    d = torch.tensor([1e-7, -1e-7, 3e-5, -3e-5, 1e-3, -1e-3, 0.05, -0.09, 0.1, -0.1, 0.5], dtype=torch.float64)
    d = d.to(dtype).double()  # representable inputs
    lp, ref = d.to(dtype), torch.zeros_like(d).to(dtype)
    x = -d
    exact = x**2 / 2 + x**3 / 6 + x**4 / 24 + x**5 / 120 + x**6 / 720 + x**7 / 5040 + x**8 / 40320 + x**9 / 362880
    exact = torch.where(d.abs() < 0.2, exact, torch.expm1(x) - x)
    torch.testing.assert_close(kl_k3(lp, ref).double(), exact, rtol=rtol, atol=0)
    small = d.abs() <= 1e-3
    k2 = kl_k2(lp, ref).double()
    assert ((kl_k3(lp, ref).double()[small] / k2[small] - 1).abs() <= d[small].abs() / 3 * 1.01 + rtol).all()


def test_bf16_k3_tolerance():
    lp, ref = _pair(scale=0.5)
    out = kl_k3(lp.bfloat16(), ref.bfloat16())
    assert out.dtype == torch.bfloat16
    # inputs rounded to bf16 (|lp| ≤ 3: abs error ≤ 2^-7) dominate: compare with a loose bound
    torch.testing.assert_close(out.double(), kl_k3(lp, ref), rtol=5e-2, atol=3e-2)


# --- expectations over a small categorical --------------------------------------------------
def _categorical(V=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(V, generator=g, dtype=torch.float64)
    r = torch.randn(V, generator=g, dtype=torch.float64)
    return z, r


def test_k1_and_k3_are_unbiased_exactly_and_match_kl_full():
    z, r = _categorical()
    logp, logq = z.log_softmax(-1), r.log_softmax(-1)
    p = logp.exp()
    kl_true = (p * (logp - logq)).sum()
    for kind in ("k1", "k3"):  # E_π[k(y)] = Σ_v π(v)·k(v), enumerating every token
        torch.testing.assert_close((p * kl_estimate(logp, logq, kind)).sum(), kl_true, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(kl_full(z, r), kl_true, rtol=1e-12, atol=1e-12)
    # k2 is biased: a different expectation
    assert not torch.isclose((p * kl_k2(logp, logq)).sum(), kl_true, rtol=1e-3)


def _expected_grad(kind, z, r, straight_through=False):
    """E_{y~π}[∇_z k(log π_z(y), log π_ref(y))] with the sampling distribution held fixed."""
    z = z.clone().requires_grad_(True)
    logp, logq = z.log_softmax(-1), r.log_softmax(-1)
    est = kl_estimate(logp, logq, kind, straight_through=straight_through)
    (grad,) = torch.autograd.grad((logp.exp().detach() * est).sum(), z)
    return grad


def test_expected_gradients_match_the_documented_directions():
    z, r = _categorical()

    def grad_of(f):
        zz = z.clone().requires_grad_(True)
        return torch.autograd.grad(f(zz.log_softmax(-1), r.log_softmax(-1)), zz)[0]

    forward_kl = grad_of(lambda lp, lq: (lp.exp() * (lp - lq)).sum())   # ∇ KL(π‖π_ref)
    reverse_kl = grad_of(lambda lp, lq: (lq.exp() * (lq - lp)).sum())   # ∇ KL(π_ref‖π)
    torch.testing.assert_close(_expected_grad("k1", z, r), torch.zeros_like(z), atol=1e-12, rtol=0)
    torch.testing.assert_close(_expected_grad("k2", z, r), forward_kl, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(_expected_grad("k3", z, r), reverse_kl, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(_expected_grad("k3", z, r, straight_through=True), forward_kl, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(kl_full(z.clone().requires_grad_(True), r), kl_full(z, r))
    zz = z.clone().requires_grad_(True)
    torch.testing.assert_close(torch.autograd.grad(kl_full(zz, r), zz)[0], forward_kl, atol=1e-12, rtol=1e-10)


# --- straight-through and clamp -------------------------------------------------------------
@pytest.mark.parametrize("kind", list(FORMULAS))
def test_straight_through_value_of_estimator_gradient_of_k2(kind):
    lp0, ref0 = _pair()
    lp, ref = lp0.clone().requires_grad_(True), ref0.clone().requires_grad_(True)
    st_value = kl_estimate(lp, ref, kind, straight_through=True)
    torch.testing.assert_close(st_value, KL_ESTIMATORS[kind](lp0, ref0), rtol=1e-15, atol=1e-15)
    w = torch.randn(lp.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    g_st = torch.autograd.grad((w * st_value).sum(), (lp, ref))
    g_k2 = torch.autograd.grad((w * kl_k2(lp, ref)).sum(), (lp, ref))
    for a, b in zip(g_st, g_k2):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    if kind != "k2":  # and the plain estimator's gradient is indeed different
        g_plain = torch.autograd.grad((w * kl_estimate(lp, ref, kind)).sum(), lp)[0]
        assert not torch.allclose(g_plain, g_st[0])


@pytest.mark.parametrize("kind", list(FORMULAS))
def test_clamp_bounds_the_log_ratio_before_the_estimator(kind):
    lp, ref = _pair(scale=20.0)  # log-ratios well beyond ±5
    out = kl_estimate(lp, ref, kind, clamp=5.0)
    torch.testing.assert_close(out, _loop_reference(kind, lp, ref, clamp=5.0), rtol=1e-12, atol=1e-12)
    d = (lp - ref).clamp(-5, 5)
    torch.testing.assert_close(out, KL_ESTIMATORS[kind](d, torch.zeros_like(d)))
    torch.testing.assert_close(kl_estimate(lp, ref, kind, clamp=None), kl_estimate(lp, ref, kind))
    # beyond the bound the gradient stops
    lpg = lp.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(kl_estimate(lpg, ref, kind, clamp=5.0).sum(), lpg)
    outside = (lp - ref).abs() > 5
    assert outside.any() and (g[outside] == 0).all()


# --- kl_full --------------------------------------------------------------------------------
def _kl_div_reference(logits, ref_logits, temperature=1.0):
    logp = (logits.double() / temperature).log_softmax(-1)
    logq = (ref_logits.double() / temperature).log_softmax(-1)
    return F.kl_div(logq, logp, log_target=True, reduction="none").sum(-1)


@pytest.mark.parametrize("chunk_size", [None, 1, 4, 7, 100])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_kl_full_matches_kl_div_and_its_gradient(chunk_size, temperature):
    g = torch.Generator().manual_seed(1)
    z = torch.randn(3, 5, 11, generator=g, dtype=torch.float64) * 2
    r = torch.randn(3, 5, 11, generator=g, dtype=torch.float64) * 2
    zg, rg = z.clone().requires_grad_(True), r.clone().requires_grad_(True)
    out = kl_full(zg, rg, temperature=temperature, chunk_size=chunk_size)
    assert out.shape == (3, 5) and out.dtype == torch.float64
    torch.testing.assert_close(out, _kl_div_reference(z, r, temperature), rtol=1e-12, atol=1e-12)
    w = torch.randn(3, 5, generator=g, dtype=torch.float64)
    (out * w).sum().backward()
    assert rg.grad is None  # the reference is a constant
    zr = z.clone().requires_grad_(True)
    (_kl_div_reference(zr, r, temperature) * w).sum().backward()
    torch.testing.assert_close(zg.grad, zr.grad, rtol=1e-10, atol=1e-12)


def test_kl_full_gradcheck_and_shapes():
    g = torch.Generator().manual_seed(2)
    z = torch.randn(3, 4, generator=g, dtype=torch.float64, requires_grad=True)
    r = torch.randn(3, 4, generator=g, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda x: kl_full(x, r, temperature=0.5, chunk_size=3), (z,))
    assert kl_full(z[0], r[0]).shape == ()
    assert kl_full(z[:0], r[:0]).shape == (0,)
    torch.testing.assert_close(kl_full(z, z.detach()), torch.zeros(3, dtype=torch.float64), atol=1e-15, rtol=0)


def test_kl_full_ignores_impossible_tokens():
    z = torch.tensor([[0.0, 1.0, float("-inf")]], dtype=torch.float64, requires_grad=True)
    r = torch.tensor([[0.5, 0.0, 2.0]], dtype=torch.float64)
    out = kl_full(z, r)
    logp, logq = z[:, :2].log_softmax(-1), r.log_softmax(-1)[:, :2]
    torch.testing.assert_close(out, (logp.exp() * (logp - logq)).sum(-1))
    out.sum().backward()
    assert torch.isfinite(z.grad).all() and z.grad[0, 2] == 0


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_kl_full_low_precision_keeps_dtype(dtype, tol):
    g = torch.Generator().manual_seed(4)
    z = torch.randn(2, 3, 50, generator=g).to(dtype).requires_grad_(True)
    r = torch.randn(2, 3, 50, generator=g).to(dtype)
    out = kl_full(z, r, chunk_size=2)
    assert out.dtype == dtype
    # computed in float32 from the rounded inputs: only the final cast to dtype costs precision
    torch.testing.assert_close(out.double(), _kl_div_reference(z.detach(), r), rtol=tol, atol=tol)
    out.float().sum().backward()
    assert z.grad.dtype == dtype and torch.isfinite(z.grad.float()).all()


# --- conventions ----------------------------------------------------------------------------
@pytest.mark.parametrize("kind", list(FORMULAS))
def test_pure(kind):
    lp, ref = _pair()
    assert_pure(KL_ESTIMATORS[kind], lp, ref)
    assert_pure(kl_estimate, lp, ref, kind, clamp=3.0, straight_through=True)
    z, r = torch.randn(2, 3, 5), torch.randn(2, 3, 5)
    assert_pure(kl_full, z, r, temperature=0.9, chunk_size=4)


@pytest.mark.parametrize("kind", list(FORMULAS))
def test_padding_invariant(kind):
    def fn(td):
        mask = td[K.RESPONSE_MASK]
        kl = kl_estimate(td[K.LOGPROBS], td[K.REF_LOGPROBS], kind)
        return torch.where(mask, kl, torch.zeros((), dtype=kl.dtype))

    batch = make_rollout(5, 6, empty_rows=1)
    assert_padding_invariant(fn, batch, fill=float("nan"))
    assert_padding_invariant(fn, batch)


def test_bad_inputs_name_argument_and_shapes():
    lp = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"ref_logprobs: expected shape \[2, 3\].*got \[2, 4\]"):
        kl_k3(lp, torch.zeros(2, 4))
    with pytest.raises(TypeError, match=r"logprobs: expected a floating-point tensor.*int64"):
        kl_k1(torch.zeros(2, 3, dtype=torch.long), lp)
    with pytest.raises(TypeError, match=r"ref_logprobs"):
        kl_estimate(lp, [0.0, 0.0], "k2")
    with pytest.raises(ValueError, match=r"ref_logits: expected shape \[2, 3\].*got \[2, 5\]"):
        kl_full(lp, torch.zeros(2, 5))
    with pytest.raises(ValueError, match=r"logits: expected at least 1 dims"):
        kl_full(torch.tensor(0.0), torch.tensor(0.0))
    with pytest.raises(ValueError, match=r"chunk_size"):
        kl_full(lp, lp, chunk_size=0)


def test_torch_compile_and_func():
    lp, ref = _pair(dtype=torch.float32)
    est = torch.compile(lambda a, b: kl_estimate(a, b, "k3", clamp=10.0, straight_through=True),
                        fullgraph=True, backend="eager")
    torch.testing.assert_close(est(lp, ref), kl_estimate(lp, ref, "k3", clamp=10.0))
    z, r = torch.randn(3, 4, 7), torch.randn(3, 4, 7)
    full = torch.compile(lambda a, b: kl_full(a, b, chunk_size=5), fullgraph=True, backend="eager")
    torch.testing.assert_close(full(z, r), kl_full(z, r))
    g_func = torch.func.grad(lambda a: kl_full(a, r, chunk_size=5).sum())(z)
    zz = z.clone().requires_grad_(True)
    torch.testing.assert_close(g_func, torch.autograd.grad(kl_full(zz, r).sum(), zz)[0])
    torch.testing.assert_close(torch.func.vmap(kl_full)(z, r), kl_full(z, r))


def test_kl_full_saves_no_upcast_copy_for_backward():
    z = torch.randn(4, 6, 32).bfloat16().requires_grad_(True)
    r = torch.randn(4, 6, 32).bfloat16()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = kl_full(z, r, chunk_size=5)
    assert saved and all(t.dtype == torch.bfloat16 for t in saved)  # only the inputs themselves
    assert sum(t.numel() for t in saved) <= 2 * z.numel()
    out.float().sum().backward()
    assert z.grad.shape == z.shape


def test_zero_length_time():
    lp = torch.zeros(3, 0)
    assert kl_estimate(lp, lp, "k3").shape == (3, 0)
    assert kl_full(torch.zeros(3, 0, 5), torch.zeros(3, 0, 5)).shape == (3, 0)
