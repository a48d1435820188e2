"""algorithms/ppo.py: kernels against loop references, golden values, identities, peers' formulas."""

from __future__ import annotations

import doctest
import functools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

import rlcore.algorithms.ppo as ppo
from rlcore import keys as K
from rlcore.algorithms.ppo import (SURROGATES, approx_kl_k1, approx_kl_k3, cispo_surrogate, clip_fraction,
                                   clipped_surrogate, clipped_value_loss, early_stop, explained_variance, ppo_loss,
                                   ratio_stats, sapo_surrogate, vespo_surrogate)
from rlcore.algorithms.ratios import RATIO_LEVELS, importance_log_ratio
from rlcore.testing import assert_pure, make_rollout, right_padded_mask
from tests.algorithms.conformance import check_compiles, check_loss_conformance

F64 = torch.float64


def rollout(B: int = 5, R: int = 6, *, dtype=F64, seed: int = 0, empty_rows: int = 1, spread: float = 0.3):
    """A rollout with every key ppo_loss reads; ratios spread enough to hit both clip bounds."""
    g = torch.Generator().manual_seed(seed)
    b = make_rollout(B, R, empty_rows=empty_rows, dtype=dtype, generator=g)

    def randn():
        return torch.randn(B, R, generator=g, dtype=F64).to(dtype)

    return b.update({K.LOGPROBS: b[K.OLD_LOGPROBS] + spread * randn(), K.ADVANTAGES: randn(),
                     K.RETURNS: randn(), K.ENTROPY: torch.rand(B, R, generator=g, dtype=F64).to(dtype) * 3})


def put(batch, **entries):
    """A shallow copy of ``batch`` with ``entries`` replaced (TensorDict.set writes in place)."""
    return batch.copy().update({getattr(K, k.upper()): v for k, v in entries.items()})


# --- plain references, written from the formulas with loops over B and T --------------------
def _valid(mask):
    B, T = mask.shape
    return [[t for t in range(T) if mask[i, t]] for i in range(B)]


def ref_log_ratio(lp, old, mask, level):
    out = torch.zeros_like(lp)
    for i, ts in enumerate(_valid(mask)):
        diffs = [float(lp[i, t] - old[i, t]) for t in ts]
        for t in ts:
            out[i, t] = {"token": float(lp[i, t] - old[i, t]), "sequence": sum(diffs) / len(diffs),
                         "sequence_sum": sum(diffs)}[level]
    return out


def ref_clip_token(log_ratio, a, lo=0.2, hi=0.2, c=None):
    r = math.exp(log_ratio)
    loss = max(-a * r, -a * min(max(r, 1 - lo), 1 + hi))
    if c is not None and a < 0:
        loss = min(loss, -a * c)
    return loss


def ref_value_token(vp, v, ret, c):
    unclipped = (vp - ret) ** 2
    if c is None:
        return 0.5 * unclipped
    return 0.5 * max(unclipped, (min(max(vp, v - c), v + c) - ret) ** 2)


def ref_aggregate(per_token, mask, mode):
    """per_token: [B, T] tensor (only masked entries read)."""
    rows = [[float(per_token[i, t]) for t in ts] for i, ts in enumerate(_valid(mask))]
    n_tok = sum(len(r) for r in rows)
    nonempty = [r for r in rows if r]
    if mode == "token_mean":
        return sum(map(sum, rows)) / max(n_tok, 1)
    if mode == "seq_mean_token_mean":
        return sum(sum(r) / len(r) for r in nonempty) / max(len(nonempty), 1)
    if mode == "seq_mean_token_sum":
        return sum(map(sum, nonempty)) / max(len(nonempty), 1)
    raise AssertionError(mode)


def ref_ppo_loss(b, *, lo=0.2, hi=0.2, c=None, level="token", vf_coef=0.1, cv=0.2, ent=0.0, kl_coef=0.0,
                 agg="token_mean"):
    mask = b[K.RESPONSE_MASK]
    lr = ref_log_ratio(b[K.LOGPROBS], b[K.OLD_LOGPROBS], mask, level)
    B, T = mask.shape
    pg, vf, kl = (torch.zeros(B, T, dtype=F64) for _ in range(3))
    for i, ts in enumerate(_valid(mask)):
        for t in ts:
            pg[i, t] = ref_clip_token(float(lr[i, t]), float(b[K.ADVANTAGES][i, t]), lo, hi, c)
            vf[i, t] = ref_value_token(float(b[K.VALUE_PREDS][i, t]), float(b[K.VALUES][i, t]),
                                       float(b[K.RETURNS][i, t]), cv)
            d = float(b[K.REF_LOGPROBS][i, t] - b[K.LOGPROBS][i, t])
            kl[i, t] = math.exp(d) - d - 1
    return (ref_aggregate(pg, mask, agg) + vf_coef * ref_aggregate(vf, mask, agg)
            - ent * ref_aggregate(b[K.ENTROPY], mask, agg) + kl_coef * ref_aggregate(kl, mask, agg))


# --- importance ratios ------------------------------------------------------------------------
@pytest.mark.parametrize("level", sorted(RATIO_LEVELS))
def test_log_ratio_matches_loops(level):
    b = rollout()
    lp, old, mask = b[K.LOGPROBS], b[K.OLD_LOGPROBS], b[K.RESPONSE_MASK]
    out = assert_pure(importance_log_ratio, lp, old, mask, level=level)
    torch.testing.assert_close(out, ref_log_ratio(lp, old, mask, level), rtol=1e-12, atol=1e-12)


def test_log_ratio_golden_and_clamp():
    lp = torch.tensor([[-1.0, -2.0, 5.0], [-30.0, 0.0, 0.0]], dtype=F64)
    old = torch.tensor([[-1.5, -1.5, float("nan")], [-1.0, 0.0, 0.0]], dtype=F64)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    expect = {"token": [[0.5, -0.5, 0.0], [-29.0, 0.0, 0.0]], "sequence": [[0.0, 0.0, 0.0], [-29.0, 0, 0]],
              "sequence_sum": [[0.0, 0.0, 0.0], [-29.0, 0.0, 0.0]]}
    for level, want in expect.items():
        torch.testing.assert_close(importance_log_ratio(lp, old, mask, level=level), torch.tensor(want, dtype=F64))
    clamped = importance_log_ratio(lp, old, mask, clamp=20.0)
    assert clamped[1, 0] == -20.0 and clamped[0, 0] == 0.5
    lp_g = lp.clone().requires_grad_(True)
    importance_log_ratio(lp_g, old, mask, clamp=20.0).sum().backward()
    assert lp_g.grad[1, 0] == 0 and lp_g.grad[0, 0] == 1  # a clamped token has no gradient


@pytest.mark.parametrize("level", ["sequence", "sequence_sum"])
def test_sequence_ratio_equals_token_ratio_for_one_token(level):
    b = rollout()
    mask = right_padded_mask(torch.tensor([1, 1, 0, 1, 1]), 6)
    lp = b[K.LOGPROBS].clone().requires_grad_(True)
    grads = []
    for lvl in ("token", level):
        out = clipped_surrogate(importance_log_ratio(lp, b[K.OLD_LOGPROBS], mask, level=lvl), b[K.ADVANTAGES])
        loss = ppo.aggregate(out.loss, mask, "token_mean")
        grads.append((loss.detach(), *torch.autograd.grad(loss, lp)))
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
def test_gspo_tokens_carry_the_sequence_gradient(agg):
    """Aggregated per-token GSPO loss == the sequence objective Σ_i w_i ℓ(s_i), value and gradient."""
    b = rollout(spread=0.05)
    mask, adv = b[K.RESPONSE_MASK], b[K.ADVANTAGES][:, :1].expand(5, 6)  # one advantage per sequence
    lp = b[K.LOGPROBS].clone().requires_grad_(True)
    per_token = clipped_surrogate(importance_log_ratio(lp, b[K.OLD_LOGPROBS], mask, level="sequence"), adv,
                                  clip_eps_low=0.03, clip_eps_high=0.04).loss
    ours = ppo.aggregate(per_token, mask, agg)
    # The sequence objective written plainly: s_i = mean_t(lp - old), ℓ_i, weighted as agg weighs rows.
    n = mask.sum(-1).to(F64)
    s = torch.where(mask, lp - b[K.OLD_LOGPROBS], 0).sum(-1) / n.clamp(min=1)
    ell = torch.maximum(-adv[:, 0] * s.exp(), -adv[:, 0] * s.exp().clamp(0.97, 1.04))
    rows = (n > 0).to(F64)
    weight = {"token_mean": n / n.sum(), "seq_mean_token_mean": rows / rows.sum(),
              "seq_mean_token_sum": n / rows.sum()}[agg]
    plain = (weight * torch.where(n > 0, ell, 0)).sum()
    torch.testing.assert_close(ours, plain, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(*(torch.autograd.grad(x, lp)[0] for x in (ours, plain)), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("level", sorted(RATIO_LEVELS))
def test_log_ratio_gradcheck(level):
    b = rollout(3, 4)
    lp = b[K.LOGPROBS].clone().requires_grad_(True)
    mask, old = b[K.RESPONSE_MASK], b[K.OLD_LOGPROBS]
    adv = b[K.ADVANTAGES][:, :1].expand(3, 4)  # sequence-level advantages, as GSPO assumes

    def fn(x):  # the aggregated loss is the function whose gradient the ratio levels promise
        lr = importance_log_ratio(x, old, mask, level=level)
        return ppo.aggregate(clipped_surrogate(lr, adv, clip_eps_low=10.0, clip_eps_high=10.0).loss, mask)

    assert torch.autograd.gradcheck(fn, (lp,))
    if level != "sequence":  # GSPO's per-token values carry a stop-gradient by design
        assert torch.autograd.gradcheck(lambda x: importance_log_ratio(x, old, mask, level=level), (lp,))


# --- surrogates -------------------------------------------------------------------------------
def test_clipped_surrogate_golden():
    ratio = torch.tensor([1.0, 1.5, 0.5, 4.0, 0.5, 1.5], dtype=F64)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, 1.0, -1.0], dtype=F64)
    out = clipped_surrogate(ratio.log(), adv)
    torch.testing.assert_close(out.loss, torch.tensor([-1.0, -1.2, 0.8, 4.0, -0.5, 1.5], dtype=F64))
    assert out.clipped_high.tolist() == [False, True, False, False, False, False]
    assert out.clipped_low.tolist() == [False, False, True, False, False, False]
    dual = clipped_surrogate(ratio.log(), adv, clip_ratio_c=3.0)
    torch.testing.assert_close(dual.loss, torch.tensor([-1.0, -1.2, 0.8, 3.0, -0.5, 1.5], dtype=F64))
    assert dual.clipped_dual.tolist() == [False, False, False, True, False, False]
    asym = clipped_surrogate(ratio.log(), adv, clip_eps_low=0.2, clip_eps_high=0.6)
    assert asym.loss[1] == -1.5 and not asym.clipped_high.any()  # clip-higher leaves ρ = 1.5 alone


@given(st.lists(st.tuples(st.floats(-3, 3), st.floats(-5, 5)), min_size=1, max_size=12),
       st.floats(0.01, 0.9), st.floats(0.01, 2.0), st.one_of(st.none(), st.floats(1.01, 10.0)))
@settings(max_examples=40, deadline=None)
def test_clipped_surrogate_matches_formula(pairs, lo, hi, c):
    lr = torch.tensor([p[0] for p in pairs], dtype=F64)
    adv = torch.tensor([p[1] for p in pairs], dtype=F64)
    out = clipped_surrogate(lr, adv, clip_eps_low=lo, clip_eps_high=hi, clip_ratio_c=c)
    want = torch.tensor([ref_clip_token(x, a, lo, hi, c) for x, a in pairs], dtype=F64)
    torch.testing.assert_close(out.loss, want, rtol=1e-12, atol=1e-12)
    r = lr.exp()
    assert out.clipped_low.tolist() == [bool(x < 1 - lo and a < 0) for x, a in zip(r, adv)]
    assert out.clipped_high.tolist() == [bool(x > 1 + hi and a > 0) for x, a in zip(r, adv)]
    # PPO's pessimism: never below the unclipped surrogate (dual clip aside)
    if c is None:
        assert (out.loss >= -adv * r - 1e-12).all()


def test_dual_clip_only_changes_negative_advantages():
    b = rollout(seed=2, spread=1.5)
    lr = importance_log_ratio(b[K.LOGPROBS], b[K.OLD_LOGPROBS], b[K.RESPONSE_MASK])
    adv = b[K.ADVANTAGES]
    plain, dual = clipped_surrogate(lr, adv).loss, clipped_surrogate(lr, adv, clip_ratio_c=2.0).loss
    assert torch.equal(plain[adv >= 0], dual[adv >= 0])
    assert (dual <= plain).all() and (dual < plain)[adv < 0].any()
    assert (dual[adv < 0] <= -adv[adv < 0] * 2.0 + 1e-12).all()


@pytest.mark.parametrize("c", [1.0, 0.5])
def test_dual_clip_constant_must_exceed_one(c):
    with pytest.raises(ValueError, match="clip_ratio_c.*> 1"):
        clipped_surrogate(torch.zeros(3), torch.zeros(3), clip_ratio_c=c)


def test_surrogate_gradcheck():
    g = torch.Generator().manual_seed(3)
    lr = (torch.rand(4, 6, generator=g, dtype=F64) - 0.5).requires_grad_(True)  # ρ in (0.6, 1.65)
    adv = torch.randn(4, 6, generator=g, dtype=F64)
    keep = ((lr.detach().exp() - 0.8).abs() > 1e-3) & ((lr.detach().exp() - 1.2).abs() > 1e-3)
    lr = torch.where(keep, lr, lr + 0.01).detach().requires_grad_(True)  # away from the kinks
    assert torch.autograd.gradcheck(lambda x: clipped_surrogate(x, adv, clip_ratio_c=1.3).loss, (lr,))
    lp = -torch.rand(4, 6, generator=g, dtype=F64).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: cispo_surrogate(lr.detach(), x, adv).loss, (lp,))


def test_cispo_golden_detached_weight_and_gradient():
    lr = torch.tensor([0.0, math.log(2.0), math.log(0.5), math.log(8.0)], dtype=F64, requires_grad=True)
    lp = torch.tensor([-1.0, -2.0, -0.5, -3.0], dtype=F64, requires_grad=True)
    adv = torch.tensor([1.0, -1.0, 2.0, 1.0], dtype=F64)
    out = cispo_surrogate(lr, lp, adv, clip_eps_low=0.2, clip_eps_high=0.5)
    w = torch.tensor([1.0, 1.5, 0.8, 1.5], dtype=F64)  # clip(ρ, 0.8, 1.5)
    torch.testing.assert_close(out.loss, -w * adv * lp.detach())
    assert out.clipped_low.tolist() == [False, False, True, False]
    assert out.clipped_high.tolist() == [False, True, False, True]
    g_lp, g_lr = torch.autograd.grad(out.loss.sum(), (lp, lr), allow_unused=True)
    torch.testing.assert_close(g_lp, -w * adv)  # every token keeps a gradient, clipped or not
    assert g_lr is None or torch.equal(g_lr, torch.zeros_like(g_lr))  # the weight is detached
    defaults = cispo_surrogate(torch.tensor([math.log(7.0), -5.0]), torch.tensor([-1.0, -1.0]), torch.ones(2))
    torch.testing.assert_close(defaults.loss, torch.tensor([5.0, math.exp(-5.0)]))  # cap 5, no floor


def test_sapo_and_vespo_kernels_gradcheck_and_edges():
    g = torch.Generator().manual_seed(4)
    lr = (torch.rand(3, 5, generator=g, dtype=F64) - 0.5).requires_grad_(True)
    lp = -torch.rand(3, 5, generator=g, dtype=F64).requires_grad_(True)
    adv = torch.randn(3, 5, generator=g, dtype=F64)
    assert torch.autograd.gradcheck(lambda x: sapo_surrogate(x, adv, temperature_neg=2.0).loss, (lr,))
    assert torch.autograd.gradcheck(lambda x: vespo_surrogate(lr.detach(), x, adv).loss, (lp,))
    # SAPO: ∂ℓ/∂log ρ = −A·4σ(1−σ)ρ, −A at ρ = 1 for any τ; a huge ratio gives a zero gradient, not NaN
    x = torch.tensor([0.0, 0.0, 800.0, -800.0], dtype=F64, requires_grad=True)
    out = sapo_surrogate(x, torch.tensor([1.0, -2.0, 1.0, -1.0], dtype=F64), temperature_neg=3.0)
    (grad,) = torch.autograd.grad(out.loss.sum(), x)
    torch.testing.assert_close(grad, torch.tensor([-1.0, 2.0, 0.0, 0.0], dtype=F64))
    torch.testing.assert_close(out.loss[2:], torch.tensor([-4.0, 4 / 3 * torch.sigmoid(torch.tensor(-3.0)).item()],
                                                          dtype=F64))
    # VESPO: φ(1) = 1; log w clamped to 20 gives φ = e^{λ + 20k − λe^20} = 0; the weight is detached
    lr2 = torch.tensor([[0.0, 0.0], [15.0, 15.0]], dtype=F64, requires_grad=True)
    lp2 = torch.full((2, 2), -1.0, dtype=F64, requires_grad=True)
    out = vespo_surrogate(lr2, lp2, torch.ones(2, 2, dtype=F64))
    torch.testing.assert_close(out.loss, torch.tensor([[1.0, 1.0], [0.0, 0.0]], dtype=F64))
    g_lp, g_lr = torch.autograd.grad(out.loss.sum(), (lp2, lr2), allow_unused=True)
    torch.testing.assert_close(g_lp, torch.tensor([[-1.0, -1.0], [0.0, 0.0]], dtype=F64))
    assert g_lr is None or torch.equal(g_lr, torch.zeros_like(g_lr))


def test_value_loss_golden_matches_loops_and_gradcheck():
    vp = torch.tensor([1.0, 0.5, -1.0, 2.0], dtype=F64)
    v = torch.tensor([0.0, 0.4, 0.0, 1.0], dtype=F64)
    ret = torch.tensor([0.0, 0.0, 1.0, 1.0], dtype=F64)
    # by hand: 0.5*max(1, 0.04) ; 0.5*max(.25,.25) ; 0.5*max(4, 1.44) ; 0.5*max(1, .04)
    torch.testing.assert_close(clipped_value_loss(vp, v, ret), torch.tensor([0.5, 0.125, 2.0, 0.5], dtype=F64))
    torch.testing.assert_close(clipped_value_loss(vp, None, ret, cliprange_value=None),
                               torch.tensor([0.5, 0.125, 2.0, 0.5], dtype=F64))
    b = rollout()
    args = (b[K.VALUE_PREDS], b[K.VALUES], b[K.RETURNS])
    out = assert_pure(clipped_value_loss, *args, cliprange_value=0.3)
    want = torch.tensor([[ref_value_token(*(float(x[i, t]) for x in args), 0.3) for t in range(6)]
                         for i in range(5)], dtype=F64)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    x = b[K.VALUE_PREDS].clone().requires_grad_(True)
    away = ((x.detach() - b[K.VALUES]).abs() - 0.3).abs() > 1e-3
    assert away.all()
    assert torch.autograd.gradcheck(
        lambda y: clipped_value_loss(y, b[K.VALUES], b[K.RETURNS], cliprange_value=0.3), (x,))
    with pytest.raises(ValueError, match="values"):
        clipped_value_loss(vp, None, ret)


# --- diagnostics ------------------------------------------------------------------------------
def test_metric_kernels_match_loops():
    b = rollout(spread=0.5)
    lp, old, mask, adv = b[K.LOGPROBS], b[K.OLD_LOGPROBS], b[K.RESPONSE_MASK], b[K.ADVANTAGES]
    lr = importance_log_ratio(lp, old, mask)
    cells = [(i, t) for i, ts in enumerate(_valid(mask)) for t in ts]
    d = [float(lp[i, t] - old[i, t]) for i, t in cells]
    torch.testing.assert_close(approx_kl_k1(lr, mask), torch.tensor(-sum(d) / len(d), dtype=F64))
    torch.testing.assert_close(approx_kl_k3(lr, mask),
                               torch.tensor(sum(math.exp(x) - 1 - x for x in d) / len(d), dtype=F64))
    mean, mx = ratio_stats(lr, mask)
    torch.testing.assert_close(mean, torch.tensor(sum(math.exp(x) for x in d) / len(d), dtype=F64))
    torch.testing.assert_close(mx, torch.tensor(max(math.exp(x) for x in d), dtype=F64))
    out = clipped_surrogate(lr, adv)
    low = sum(math.exp(x) < 0.8 and adv[c] < 0 for x, c in zip(d, cells)) / len(d)
    high = sum(math.exp(x) > 1.2 and adv[c] > 0 for x, c in zip(d, cells)) / len(d)
    assert low > 0 and high > 0
    torch.testing.assert_close(clip_fraction(out.clipped_low, mask, dtype=F64), torch.tensor(float(low), dtype=F64))
    torch.testing.assert_close(clip_fraction(out.clipped_high, mask, dtype=F64), torch.tensor(float(high), dtype=F64))
    empty = torch.zeros_like(mask)
    for value in (approx_kl_k1(lr, empty), *ratio_stats(lr, empty), clip_fraction(out.clipped_low, empty)):
        assert value == 0


def test_explained_variance_matches_loops():
    b = rollout()
    vp, ret, mask = b[K.VALUE_PREDS], b[K.RETURNS], b[K.RESPONSE_MASK]
    cells = [(i, t) for i, ts in enumerate(_valid(mask)) for t in ts]

    def var(xs):
        m = sum(xs) / len(xs)
        return sum((x - m) ** 2 for x in xs) / (len(xs) - 1)

    r = [float(ret[c]) for c in cells]
    res = [float(ret[c] - vp[c]) for c in cells]
    torch.testing.assert_close(explained_variance(vp, ret, mask), torch.tensor(1 - var(res) / var(r), dtype=F64))
    assert explained_variance(ret, ret, mask) == 1
    const = torch.ones_like(ret)
    assert explained_variance(vp, const, mask) == 0  # no variance in the targets: defined as 0
    assert explained_variance(vp, ret, torch.zeros_like(mask)) == 0


def test_early_stop():
    assert early_stop(torch.tensor(0.16), target_kl=0.1)
    assert not early_stop(torch.tensor(0.14), target_kl=0.1)
    assert not early_stop(torch.tensor(0.16), target_kl=0.1, factor=2.0)
    assert early_stop(torch.tensor(0.16), target_kl=0.1).dtype == torch.bool


# --- the loss ---------------------------------------------------------------------------------
@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean"])
@pytest.mark.parametrize("cfg", [
    {},
    dict(lo=0.1, hi=0.3, c=2.0, vf_coef=0.5, cv=None, ent=0.01, kl_coef=0.2),
    dict(level="sequence", lo=0.05, hi=0.05, cv=0.1),
    dict(level="sequence_sum", vf_coef=0.0),
])
def test_ppo_loss_matches_loops(agg, cfg):
    b = rollout(spread=0.4)
    names = dict(lo="clip_eps_low", hi="clip_eps_high", c="clip_ratio_c", level="ratio_level", vf_coef="vf_coef",
                 cv="cliprange_value", ent="entropy_coef", kl_coef="kl_coef")
    loss, metrics = assert_pure(ppo_loss, b, agg=agg, **{names[k]: v for k, v in cfg.items()})
    torch.testing.assert_close(loss, torch.tensor(ref_ppo_loss(b, agg=agg, **cfg), dtype=F64), rtol=1e-12, atol=1e-12)
    total = sum(v for k, v in metrics.items() if k.startswith("loss_"))
    torch.testing.assert_close(total, loss, rtol=1e-12, atol=1e-12)


def test_ppo_loss_golden():
    mask = torch.tensor([[True, True, False]])
    b = TensorDict({
        K.RESPONSE_MASK: mask,
        K.OLD_LOGPROBS: torch.tensor([[-1.0, -1.0, float("nan")]], dtype=F64),
        K.LOGPROBS: torch.tensor([[-1.0, -1.0 + math.log(1.5), 0.0]], dtype=F64),  # ρ = 1, 1.5
        K.ADVANTAGES: torch.tensor([[2.0, 1.0, float("nan")]], dtype=F64),
        K.VALUE_PREDS: torch.tensor([[1.0, 0.0, 0.0]], dtype=F64),
        K.VALUES: torch.tensor([[0.0, 0.0, 0.0]], dtype=F64),
        K.RETURNS: torch.tensor([[0.0, 1.0, 0.0]], dtype=F64),
    }, batch_size=[1])
    loss, m = ppo_loss(b, vf_coef=0.5)
    # pg: (max(-2, -2) + max(-1.5, -1.2)) / 2 = -1.6 ; vf: (0.5·max(1, 0.04) + 0.5·max(1, 1)) / 2 = 0.5
    torch.testing.assert_close(m["loss_policy"], torch.tensor(-1.6, dtype=F64))
    torch.testing.assert_close(m["loss_value"], torch.tensor(0.25, dtype=F64))
    torch.testing.assert_close(loss, torch.tensor(-1.35, dtype=F64))
    torch.testing.assert_close(m["clipfrac_high"], torch.tensor(0.5, dtype=F64))
    torch.testing.assert_close(m["ratio_mean"], torch.tensor(1.25, dtype=F64))
    torch.testing.assert_close(m["ratio_max"], torch.tensor(1.5, dtype=F64))
    torch.testing.assert_close(m["value_loss_unweighted"], torch.tensor(0.5, dtype=F64))
    torch.testing.assert_close(m["clipfrac_value"], torch.tensor(0.5, dtype=F64))  # |V̂ − V| = 1 > 0.2, 0
    torch.testing.assert_close(m["explained_variance"], torch.tensor(-3.0, dtype=F64))  # 1 − 2/0.5


def test_ratio_one_gives_the_reinforce_gradient():
    """PPO at ratio 1 without clipping: ∇loss = −agg(A·∇lp), i.e. ∂loss/∂lp = −A·m / N_tok."""
    b = rollout()
    b = put(b, old_logprobs=b[K.LOGPROBS].clone())
    lp = b[K.LOGPROBS].clone().requires_grad_(True)
    loss, _ = ppo_loss(put(b.exclude(K.VALUE_PREDS), logprobs=lp))
    (grad,) = torch.autograd.grad(loss, lp)
    mask, adv = b[K.RESPONSE_MASK], b[K.ADVANTAGES]
    torch.testing.assert_close(grad, torch.where(mask, -adv, 0) / mask.sum(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(loss, -torch.where(mask, adv, 0).sum() / mask.sum())


def test_trl_legacy_ppo_parity():
    """TRL v0.11 PPOTrainer.loss, written out: pg + vf_coef·vf, both masked means; ratio_threshold."""
    b = rollout(empty_rows=0, spread=0.4)
    m = b[K.RESPONSE_MASK].to(F64)
    lp = b[K.LOGPROBS].clone().requires_grad_(True)
    vp = b[K.VALUE_PREDS].clone().requires_grad_(True)
    adv, old, ret, values = (torch.where(b[K.RESPONSE_MASK], b[k], 0) for k in
                             (K.ADVANTAGES, K.OLD_LOGPROBS, K.RETURNS, K.VALUES))

    def masked_mean(x):
        return (x * m).sum() / m.sum()

    vpc = torch.clamp(vp, values - 0.2, values + 0.2)
    vf = 0.5 * masked_mean(torch.max((vp - ret) ** 2, (vpc - ret) ** 2))
    ratio = torch.exp(torch.where(b[K.RESPONSE_MASK], lp, 0) - old)
    pg = masked_mean(torch.max(-adv * ratio, -adv * torch.clamp(ratio, 0.8, 1.2)))
    trl = pg + 0.1 * vf
    ours, metrics = ppo_loss(put(b, logprobs=lp, value_preds=vp), vf_coef=0.1, cliprange_value=0.2,
                             ratio_threshold=10.0)
    torch.testing.assert_close(ours, trl, rtol=1e-12, atol=1e-12)
    for x, y in zip(torch.autograd.grad(ours, (lp, vp)), torch.autograd.grad(trl, (lp, vp))):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-14)
    assert metrics["skipped_ratio_threshold"] == 0
    torch.testing.assert_close(metrics["approx_kl_k1"], masked_mean(old - lp.detach()))  # TRL's policykl


def test_verl_vanilla_dual_clip_parity():
    """verl compute_policy_loss_vanilla, written out: clamp(lp−old, ±20), clip, dual clip c=3, token-mean."""
    b = rollout(seed=4, spread=2.0)
    mask = b[K.RESPONSE_MASK]
    m = mask.to(F64)
    lp = b[K.LOGPROBS].clone().requires_grad_(True)
    adv, old = (torch.where(mask, b[k], 0) for k in (K.ADVANTAGES, K.OLD_LOGPROBS))
    ratio = torch.exp(torch.clamp(torch.where(mask, lp, 0) - old, -20.0, 20.0))
    l1 = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - 0.2, 1 + 0.28))
    l3 = torch.minimum(-adv * 3.0, l1)
    per_token = torch.where(adv < 0, l3, l1)
    verl = (per_token * m).sum() / m.sum()
    ours, metrics = policy_only(put(b, logprobs=lp), clip_eps_high=0.28, clip_ratio_c=3.0, log_ratio_clamp=20.0)
    torch.testing.assert_close(ours, verl, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(*(torch.autograd.grad(x, lp)[0] for x in (ours, verl)), rtol=1e-12, atol=1e-14)
    dual = ((l1 > -adv * 3.0) & (adv < 0) & mask).sum() / m.sum()
    assert dual > 0
    torch.testing.assert_close(metrics["clipfrac_dual"], dual)


def policy_only(batch, **kw):
    return ppo_loss(batch.exclude(K.VALUE_PREDS), **kw)


def test_ratio_threshold_zeroes_the_batch_but_keeps_the_graph():
    b = rollout()
    high = put(b, logprobs=b[K.OLD_LOGPROBS] + 3.0)  # ρ = e³ ≈ 20 > 10
    lp = high[K.LOGPROBS].clone().requires_grad_(True)
    vp = high[K.VALUE_PREDS].clone().requires_grad_(True)
    loss, m = ppo_loss(put(high, logprobs=lp, value_preds=vp), ratio_threshold=10.0, kl_coef=0.1,
                       entropy_coef=0.1)
    assert loss == 0 and loss.requires_grad and m["skipped_ratio_threshold"] == 1
    assert all(m[k] == 0 for k in m.keys() if k.startswith("loss_"))
    assert m["ratio_mean"] > 10  # diagnostics still report the batch
    for g in torch.autograd.grad(loss, (lp, vp)):
        assert torch.equal(g, torch.zeros_like(g))
    below, m2 = ppo_loss(b, ratio_threshold=10.0)
    assert m2["skipped_ratio_threshold"] == 0 and torch.equal(below, ppo_loss(b)[0])
    # the test is on the masked *mean* ratio (TRL): one exploded token does not skip the batch
    one = put(b, logprobs=torch.where(torch.arange(6) == 0, b[K.OLD_LOGPROBS] + 3.0, b[K.OLD_LOGPROBS]))
    _, m3 = ppo_loss(one, ratio_threshold=10.0)
    assert m3["ratio_max"] > 10 > m3["ratio_mean"] and m3["skipped_ratio_threshold"] == 0


def test_fully_masked_rows_and_batches():
    b = rollout(empty_rows=2)
    keep = b[K.RESPONSE_MASK].any(-1)
    for agg in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum"):
        full = ppo_loss(b, agg=agg, kl_coef=0.1, entropy_coef=0.1)
        trimmed = ppo_loss(b[keep], agg=agg, kl_coef=0.1, entropy_coef=0.1)
        torch.testing.assert_close(full, trimmed, rtol=1e-12, atol=1e-12)  # empty rows change nothing
    empty = put(b, response_mask=torch.zeros_like(b[K.RESPONSE_MASK]))
    lp = empty[K.LOGPROBS].clone().requires_grad_(True)
    loss, m = ppo_loss(put(empty, logprobs=lp), kl_coef=0.1, entropy_coef=0.1)
    assert loss == 0 and all(torch.isfinite(v) for v in m.values())
    assert torch.equal(torch.autograd.grad(loss, lp)[0], torch.zeros_like(lp))


def test_entropy_and_kl_terms():
    b = rollout()
    mask = b[K.RESPONSE_MASK]
    ent = b[K.ENTROPY].clone().requires_grad_(True)
    loss, m = ppo_loss(put(b, entropy=ent), entropy_coef=0.05, kl_coef=0.3, kl="k2")
    n = mask.sum()
    torch.testing.assert_close(m["loss_entropy"], -0.05 * torch.where(mask, ent, 0).sum().detach() / n)
    k2 = 0.5 * torch.where(mask, b[K.LOGPROBS] - b[K.REF_LOGPROBS], 0).square()
    torch.testing.assert_close(m["loss_kl"], 0.3 * k2.sum() / n)
    torch.testing.assert_close(m["kl_ref"], k2.sum() / n)
    torch.testing.assert_close(torch.autograd.grad(loss, ent)[0], torch.where(mask, -0.05 / n, 0.0).to(F64))
    # off by default: no reference log-probs needed, loss_kl is 0; a tensor coefficient always computes
    no_ref = b.exclude(K.REF_LOGPROBS, K.ENTROPY)
    _, m0 = ppo_loss(no_ref)
    assert m0["loss_kl"] == 0 and m0["loss_entropy"] == 0 and "kl_ref" not in m0.keys()
    _, mt = ppo_loss(b, kl_coef=torch.tensor(0.3, dtype=F64), kl="k2")
    torch.testing.assert_close(mt["loss_kl"], m["loss_kl"])


def test_global_denominators_make_micro_batches_add_up():
    b = rollout(6, 6, empty_rows=1)
    mask = b[K.RESPONSE_MASK]
    for agg, kw in [("token_mean", dict(num_tokens=int(mask.sum()))),
                    ("seq_mean_token_mean", dict(num_seqs=int(mask.any(-1).sum())))]:
        whole, _ = ppo_loss(b, agg=agg, kl_coef=0.1, entropy_coef=0.01, **kw)
        parts = sum(ppo_loss(b[s], agg=agg, kl_coef=0.1, entropy_coef=0.01, **kw)[0]
                    for s in (slice(0, 2), slice(2, 6)))
        torch.testing.assert_close(parts, whole, rtol=1e-12, atol=1e-12)


def test_policy_only_without_critic_and_metrics_keys():
    b = rollout()
    _, m = ppo_loss(b)
    assert {"loss_policy", "loss_value", "loss_entropy", "loss_kl", "approx_kl_k1", "approx_kl_k3", "clipfrac_low",
            "clipfrac_high", "ratio_mean", "ratio_max", "explained_variance", "entropy",
            "skipped_ratio_threshold"} <= set(m.keys())
    _, m2 = ppo_loss(b.exclude(K.VALUE_PREDS, K.VALUES, K.RETURNS))
    assert "loss_value" not in m2.keys() and "explained_variance" not in m2.keys()
    _, m3 = ppo_loss(b.exclude(K.VALUES), cliprange_value=None)  # unclipped: old values not needed
    assert "loss_value" in m3.keys()


def test_bf16_and_float32_follow_float64():
    b64 = rollout(spread=0.2)
    loss64, m64 = ppo_loss(b64, kl_coef=0.1, entropy_coef=0.01)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
        b = b64.apply(lambda x, d=dtype: x.to(d) if x.is_floating_point() else x)
        loss, m = ppo_loss(b, kl_coef=0.1, entropy_coef=0.01)
        assert loss.dtype == dtype and all(v.dtype == dtype for v in m.values())
        torch.testing.assert_close(loss.to(F64), loss64, rtol=tol, atol=tol)
        for k in ("loss_policy", "loss_value", "approx_kl_k3", "ratio_mean"):
            torch.testing.assert_close(m[k].to(F64), m64[k], rtol=tol, atol=tol)


CONFORMANCE = functools.partial(ppo_loss, clip_ratio_c=3.0, kl_coef=0.1, entropy_coef=0.01, ratio_threshold=10.0)


def test_conformance_ppo_loss():
    check_loss_conformance(CONFORMANCE, rollout(4, 5, empty_rows=1),
                           grad_keys=[K.LOGPROBS, K.VALUE_PREDS, K.ENTROPY], compile_backend=None)


@pytest.mark.slow  # a few seconds, all of it in torch.compile's tracing (ratio levels: test_policy_gradient)
def test_ppo_loss_under_compile():
    check_compiles(CONFORMANCE, rollout(4, 5, empty_rows=1),
                   grad_keys=[K.LOGPROBS, K.VALUE_PREDS, K.ENTROPY], backend="aot_eager")


# --- bad input ----------------------------------------------------------------------------------
def test_missing_keys_name_the_key_and_its_shape():
    b = rollout()
    with pytest.raises(KeyError, match=r"'advantages' \[B, R\]"):
        ppo_loss(b.exclude(K.ADVANTAGES))
    with pytest.raises(KeyError, match=r"'ref_logprobs' \[B, R\]"):
        ppo_loss(b.exclude(K.REF_LOGPROBS), kl_coef=0.1)
    with pytest.raises(KeyError, match=r"'returns' \[B, R\]"):
        ppo_loss(b.exclude(K.RETURNS))
    with pytest.raises(KeyError, match=r"'values' \[B, R\]"):
        ppo_loss(b.exclude(K.VALUES))
    with pytest.raises(KeyError, match=r"'entropy' \[B, R\]"):
        ppo_loss(b.exclude(K.ENTROPY), entropy_coef=0.1)


def test_bad_shapes_dtypes_and_names():
    b = rollout()
    with pytest.raises(TypeError, match="response_mask.*bool"):
        ppo_loss(put(b, response_mask=b[K.RESPONSE_MASK].float()))
    bad = TensorDict({**b.to_dict(), K.ADVANTAGES: torch.zeros(5, 4, dtype=F64)}, batch_size=[5])
    with pytest.raises(ValueError, match=r"advantages: expected shape \[5, 6\].*got \[5, 4\]"):
        ppo_loss(bad)
    with pytest.raises(TypeError, match="logprobs.*floating"):
        importance_log_ratio(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(TypeError, match="mask.*bool"):
        importance_log_ratio(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"old_logprobs: expected shape \[2, 3\].*got \[2, 4\]"):
        importance_log_ratio(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"advantages: expected shape \[3\].*got \[4\]"):
        clipped_surrogate(torch.zeros(3), torch.zeros(4))
    with pytest.raises(ValueError, match=r"level: unknown 'seq'; valid: \['sequence', 'sequence_sum', 'token'\]"):
        ppo_loss(b, ratio_level="seq")
    with pytest.raises(ValueError, match=r"surrogate: unknown 'spo'; valid: \['cispo', 'clip', 'sapo', 'vespo'\]"):
        ppo_loss(b, surrogate="spo")
    with pytest.raises(ValueError, match=r"mode: unknown.*'mean'.*token_mean"):
        ppo_loss(b, agg="mean")
    with pytest.raises(ValueError, match="kind: unknown KL estimator"):
        ppo_loss(b, kl_coef=0.1, kl="k4")
    with pytest.raises(ValueError, match="clip_ratio_c: dual clip applies to surrogate='clip'"):
        ppo_loss(b, surrogate="cispo", clip_ratio_c=3.0)
    assert set(SURROGATES) == {"clip", "cispo", "sapo", "vespo"}


def test_doctests():
    result = doctest.testmod(ppo, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


# --- hyper-parameters out of range, and the metrics at the edge of the range -------------------
_NAN, _INF = float("nan"), float("inf")


@pytest.mark.parametrize("kw", [dict(clip_eps_low=-0.1), dict(clip_eps_low=_NAN), dict(clip_eps_high=-0.2),
                                dict(clip_eps_high=_NAN), dict(cliprange_value=-0.2), dict(cliprange_value=_NAN),
                                dict(vf_coef=-0.1), dict(vf_coef=_NAN), dict(entropy_coef=_NAN),
                                dict(kl_coef=-0.1), dict(kl_coef=_NAN), dict(log_ratio_clamp=-20.0),
                                dict(log_ratio_clamp=0.0), dict(ratio_threshold=_NAN), dict(ratio_threshold=-1.0)])
def test_ppo_loss_refuses_hyper_parameters_out_of_range(kw):
    """A negative or NaN clip range, weight or bound used to invert a term or make the loss NaN."""
    (name, value), = kw.items()
    with pytest.raises(ValueError, match=rf"^{name}: expected .* got {value}"):
        ppo_loss(rollout(), **kw)


@pytest.mark.parametrize("surrogate", ["clip", "cispo"])
def test_surrogate_kernels_refuse_bad_clip_ranges(surrogate):
    x = torch.zeros(3)
    for kw in (dict(clip_eps_low=-0.1), dict(clip_eps_high=_NAN)):
        with pytest.raises(ValueError, match=rf"^{next(iter(kw))}: expected a number \(inf allowed\) >= 0"):
            if surrogate == "clip":
                clipped_surrogate(x, x, **kw)
            else:
                cispo_surrogate(x, x, x, **kw)
    with pytest.raises(ValueError, match=r"^clamp: expected a number \(inf allowed\) > 0, got -1.0"):
        importance_log_ratio(x, x, torch.ones(3, dtype=torch.bool), clamp=-1.0)
    with pytest.raises(ValueError, match=r"^kl_coef: expected a float or a 0-d tensor, got a tensor of shape \[6\]"):
        ppo_loss(rollout(), kl_coef=torch.full((6,), 0.1))
    # no clip on a side (inf) and a tensor β are valid
    assert torch.isfinite(ppo_loss(rollout(), clip_eps_high=_INF, kl_coef=torch.tensor(0.1, dtype=F64))[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, F64])
def test_ppo_metrics_are_finite_at_the_edge_of_the_range(dtype):
    """log-probs at ±3e38: the loss stayed finite, but lp − old overflowed in the metrics (k3: inf − inf)."""
    b = rollout(2, 3, dtype=dtype, empty_rows=0).exclude(K.VALUE_PREDS)
    lp = torch.tensor([[3e38, -3e38, -1.0], [-3e38, 0.0, 3e38]], dtype=dtype)
    old = torch.tensor([[-3e38, 3e38, -1.0], [0.0, -3e38, -3e38]], dtype=dtype)
    b = put(b, logprobs=lp.requires_grad_(), old_logprobs=old, response_mask=torch.ones(2, 3, dtype=torch.bool))
    loss, metrics = ppo_loss(b)
    (g,) = torch.autograd.grad(loss, lp)
    assert torch.isfinite(loss) and torch.isfinite(g).all()
    assert all(torch.isfinite(v) for v in metrics.values()), dict(metrics.items())
    big = torch.finfo(dtype).max
    assert metrics["approx_kl_k3"] == big or dtype == F64  # float64: a mean of values capped at e^709.78
    # k1 = mean(old − lp) = (−6e38 + 6e38 + 0 + 3e38 − 3e38 − 6e38) / 6 = −1e38, exact in float64
    torch.testing.assert_close(metrics["approx_kl_k1"], torch.tensor(-1e38, dtype=F64).to(dtype))
    lr = torch.tensor([[100.0, 1.0]], dtype=dtype)
    assert approx_kl_k3(lr, torch.ones(1, 2, dtype=torch.bool)) == big if dtype != F64 else True
    lr64 = torch.tensor([1e-3, 0.5, -3.0, 700.0], dtype=F64)  # float64: the formula, exactly
    want = (torch.expm1(lr64) - lr64).mean()
    assert approx_kl_k3(lr64, torch.ones(4, dtype=torch.bool)) == want


def test_sapo_refuses_a_denormal_temperature():
    """τ = 1e-310 gave loss [nan, -3.4e38]: 4/τ = inf, and A = 0 makes 0·inf."""
    for name in ("temperature_pos", "temperature_neg"):
        with pytest.raises(ValueError, match=rf"^{name}: expected a finite number >= 1e-12"):
            sapo_surrogate(torch.tensor([0.0, 0.1]), torch.tensor([0.0, 1.0]), **{name: 1e-310})
    lr = torch.tensor([0.0, 0.1], requires_grad=True)
    out = sapo_surrogate(lr, torch.tensor([0.0, 1.0]), temperature_pos=1e-12, temperature_neg=1e-12)
    out.loss.sum().backward()
    assert torch.isfinite(out.loss).all() and torch.isfinite(lr.grad).all()
