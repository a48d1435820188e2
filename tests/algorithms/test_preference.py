"""ORPO, SimPO, CPO, AlphaPO, KTO and the PREFERENCE_LOSSES registry."""

import math
from collections import defaultdict
from decimal import Decimal, getcontext
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from rlcore import keys as K
from rlcore.algorithms.dpo import dpo_loss
from rlcore.algorithms.preference import (PREFERENCE_LOSSES, alphapo_reward, cpo, cpo_loss, kto, kto_loss, log1mexp,
                                          odds_ratio_loss, orpo, simpo, simpo_loss)
from rlcore.testing import assert_padding_invariant, assert_pure, make_preference_batch, right_padded_mask
from tests.algorithms.conformance import check_loss_conformance

getcontext().prec = 60


def exact_log1mexp(x: float) -> float:
    """log(1 − e^x) in 60-digit decimal arithmetic (a series −Σ u^k/k, u = e^x, when u ≤ 1/2)."""
    u = Decimal(x).exp()
    if u > Decimal("0.5"):
        return float((1 - u).ln())
    return float(-sum(u**k / k for k in range(1, 200)))


def logsig(x):
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def avg_pairs(B=6, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple((-torch.rand(B, generator=g, dtype=torch.float64) * 3 - 0.01).to(dtype) for _ in range(2))


# --- log1mexp --------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype, rtol, atol", [(torch.float64, 1e-14, 0.0), (torch.float32, 1e-6, 1e-40)])
def test_log1mexp_accuracy_near_zero_and_far_out(dtype, rtol, atol):
    """float32: e^x is subnormal below x ≈ −87, hence the absolute tolerance there."""
    xs = [-1e-30, -1e-12, -1e-6, -1e-3, -0.5, -math.log(2), -0.7, -1.0, -5.0, -30.0, -100.0, -700.0]
    got = log1mexp(torch.tensor(xs, dtype=dtype))
    want = torch.tensor([exact_log1mexp(float(torch.tensor(x, dtype=dtype))) for x in xs], dtype=torch.float64)
    torch.testing.assert_close(got.double(), want, rtol=rtol, atol=atol)
    naive = torch.log(1 - torch.exp(torch.tensor(xs, dtype=dtype)))  # what the branches avoid
    assert not torch.allclose(naive.double(), want, rtol=rtol, atol=0)


def test_log1mexp_gradients_finite_on_both_branches():
    x = torch.tensor([-1e-8, -0.3, -math.log(2), -0.7, -50.0], dtype=torch.float64, requires_grad=True)
    (g,) = torch.autograd.grad(log1mexp(x).sum(), x)
    want = -torch.exp(x) / -torch.expm1(x)  # d/dx log(1 − e^x) = −e^x/(1 − e^x)
    torch.testing.assert_close(g, want.detach())
    # Near 0 the far branch log1p(−e^x) is log1p(−1) = −inf: fed x itself, its gradient would
    # be 0·inf = NaN even though the branch is not selected.
    tiny = torch.tensor([-1e-20, -1e-30], requires_grad=True)
    (g,) = torch.autograd.grad(log1mexp(tiny).sum(), tiny)
    torch.testing.assert_close(g, 1 / tiny.detach())
    naive = torch.where(tiny > -math.log(2), torch.log(-torch.expm1(tiny)), torch.log1p(-torch.exp(tiny)))
    assert torch.isnan(torch.autograd.grad(naive.sum(), tiny)[0]).all()
    assert torch.autograd.gradcheck(log1mexp, (x[1:].detach().requires_grad_(True),))  # steps of 1e-6


@pytest.mark.trl
def test_log1mexp_matches_trl():
    orpo_mod = pytest.importorskip("trl.experimental.orpo.orpo_trainer")
    x = -torch.logspace(-8, 2, 50, dtype=torch.float64)
    torch.testing.assert_close(log1mexp(x), orpo_mod.log1mexp(x))


# --- ORPO ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_odds_ratio_loss_against_plain_formula(dtype, tol):
    aw, al = avg_pairs(dtype=dtype)
    losses, log_odds = odds_ratio_loss(aw, al, beta=0.25)
    assert losses.dtype == dtype and log_odds.dtype == dtype
    want_lo, want = [], []
    for w, l in zip(aw.double().tolist(), al.double().tolist()):
        lo = (w - l) - (math.log(1 - math.exp(w)) - math.log(1 - math.exp(l)))
        want_lo.append(lo)
        want.append(-0.25 * logsig(lo))
    torch.testing.assert_close(log_odds.double(), torch.tensor(want_lo, dtype=torch.float64), rtol=tol, atol=tol)
    torch.testing.assert_close(losses.double(), torch.tensor(want, dtype=torch.float64), rtol=tol, atol=tol)


@pytest.mark.trl
def test_odds_ratio_loss_matches_trl():
    orpo_mod = pytest.importorskip("trl.experimental.orpo.orpo_trainer")
    aw, al = avg_pairs(dtype=torch.float32)
    stub = SimpleNamespace(beta=0.2, accelerator=SimpleNamespace(device="cpu"))
    trl_losses, _, _, _, trl_log_odds = orpo_mod.ORPOTrainer.odds_ratio_loss(stub, aw, al)
    losses, log_odds = odds_ratio_loss(aw, al, beta=0.2)
    torch.testing.assert_close(losses, -trl_losses)  # TRL returns β·logσ and subtracts it
    torch.testing.assert_close(log_odds.mean(), trl_log_odds)


def pref_batch(dtype=torch.float64, empty=True, seed=4):
    b = make_preference_batch(5, 9, dtype=dtype, generator=torch.Generator().manual_seed(seed))
    for side in (K.CHOSEN, K.REJECTED):  # mean log-probs in a realistic range (< 0 per token)
        b[side, K.LOGPS] = b[side, K.LOGPS] / 10
    if empty:  # an empty chosen completion in the last pair: logps 0 by definition
        b[K.CHOSEN, K.LOSS_MASK][-1] = False
        b[K.CHOSEN, K.LOGPS][-1] = 0.0
        b[K.CHOSEN, K.REF_LOGPS][-1] = 0.0
    return b


def sides(b):
    c, r = b[K.CHOSEN], b[K.REJECTED]
    return c[K.LOGPS], r[K.LOGPS], c[K.LOSS_MASK].sum(-1), r[K.LOSS_MASK].sum(-1)


def test_orpo_batch_is_nll_plus_odds_ratio_and_skips_empty_pairs():
    b = pref_batch()
    loss, m = orpo(b, beta=0.1)
    cw, rw, nw, nl = sides(b)
    nll = -sum(cw.tolist()) / sum(nw.tolist())
    ors = [-0.1 * logsig((w / n - l / k) - (math.log(1 - math.exp(w / n)) - math.log(1 - math.exp(l / k))))
           for w, l, n, k in zip(cw.tolist(), rw.tolist(), nw.tolist(), nl.tolist()) if n > 0 and k > 0]
    assert len(ors) == 4
    assert m["loss_nll"].item() == pytest.approx(nll, rel=1e-12)
    assert m["loss_or"].item() == pytest.approx(sum(ors) / 4, rel=1e-12)
    assert loss.item() == pytest.approx(nll + sum(ors) / 4, rel=1e-12)
    torch.testing.assert_close(m["logps/chosen"], (cw / nw.clamp(min=1)).mean())


# --- SimPO / CPO / AlphaPO -------------------------------------------------------------------------
def plain_margin_loss(w, l, beta, gamma, eps, alpha):
    r = (lambda p: p) if alpha == 0 else (lambda p: (1 - math.exp(p) ** -alpha) / alpha)
    x = beta * (r(w) - r(l)) - gamma
    return -(1 - eps) * logsig(x) - eps * logsig(-x)


@pytest.mark.parametrize("alpha", [0.0, 0.25])
@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_simpo_and_cpo_against_plain_formula(alpha, dtype, tol):
    aw, al = avg_pairs(dtype=dtype)
    w, l = aw.double().tolist(), al.double().tolist()
    got = simpo_loss(aw, al, beta=2.0, gamma=0.8, label_smoothing=0.1, alpha=alpha)
    want = [plain_margin_loss(a, b, 2.0, 0.8, 0.1, alpha) for a, b in zip(w, l)]
    torch.testing.assert_close(got.double(), torch.tensor(want, dtype=torch.float64), rtol=tol, atol=tol)
    got = cpo_loss(aw, al, beta=0.3, label_smoothing=0.1, alpha=alpha)
    want = [plain_margin_loss(a, b, 0.3, 0.0, 0.1, alpha) for a, b in zip(w, l)]
    torch.testing.assert_close(got.double(), torch.tensor(want, dtype=torch.float64), rtol=tol, atol=tol)
    assert got.dtype == dtype


@pytest.mark.trl
@pytest.mark.parametrize("loss_type, alpha", [("simpo", 0.0), ("simpo", 0.25), ("sigmoid", 0.0),
                                             ("sigmoid", 0.25)])
def test_simpo_cpo_match_trl(loss_type, alpha):
    cpo_mod = pytest.importorskip("trl.experimental.cpo.cpo_trainer")
    aw, al = avg_pairs(dtype=torch.float32, seed=1)
    stub = SimpleNamespace(alpha=alpha, loss_type=loss_type, simpo_gamma=0.7, beta=2.0, label_smoothing=0.1,
                           accelerator=SimpleNamespace(device="cpu"))
    want, trl_rw, _ = cpo_mod.CPOTrainer.cpo_loss(stub, aw, al)
    if loss_type == "simpo":
        got = simpo_loss(aw, al, beta=2.0, gamma=0.7, label_smoothing=0.1, alpha=alpha)
    else:
        got = cpo_loss(aw, al, beta=2.0, label_smoothing=0.1, alpha=alpha)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(2.0 * alphapo_reward(aw, alpha=alpha), trl_rw)


def test_simpo_identities():
    aw, al = avg_pairs()
    # SimPO without margin is reference-free DPO on average log-probs; CPO on sums.
    torch.testing.assert_close(simpo_loss(aw, al, beta=2.0, gamma=0.0),
                               dpo_loss(aw, al, None, None, beta=2.0, reference_free=True)[0])
    torch.testing.assert_close(cpo_loss(aw, al, beta=2.0), simpo_loss(aw, al, beta=2.0, gamma=0.0))
    torch.testing.assert_close(alphapo_reward(aw, alpha=1e-7), aw, rtol=1e-6, atol=1e-6)  # α → 0 limit


def test_simpo_and_cpo_batches():
    b = pref_batch()
    cw, rw, nw, nl = sides(b)
    aw, al = cw / nw.clamp(min=1), rw / nl.clamp(min=1)
    nll = -cw.sum() / nw.sum()
    loss, m = simpo(b, beta=2.0, gamma=1.0, cpo_alpha=0.5)
    torch.testing.assert_close(m["loss_simpo"], simpo_loss(aw, al, beta=2.0, gamma=1.0).mean())
    torch.testing.assert_close(loss, m["loss_simpo"] + 0.5 * nll)
    assert "loss_nll" not in simpo(b)[1].keys()
    loss, m = cpo(b, beta=0.1)
    torch.testing.assert_close(loss, cpo_loss(cw, rw, beta=0.1).mean() + nll)
    torch.testing.assert_close(m["rewards/chosen"], 0.1 * cw.mean())


# --- KTO -------------------------------------------------------------------------------------------
def kto_batch(B=6, dtype=torch.float64, seed=0, T=7):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[-1] = 0
    mask = right_padded_mask(lengths, T)

    def lp():
        return (-torch.rand(B, generator=g, dtype=torch.float64) * 10).to(dtype)

    return TensorDict({
        K.INPUT_IDS: torch.randint(0, 32, (B, T), generator=g), K.ATTENTION_MASK: mask, K.LOSS_MASK: mask,
        K.LOGPS: lp(), K.REF_LOGPS: lp(), K.KL_LOGPS: lp(), K.REF_KL_LOGPS: lp() - 1.0,
        K.LABELS: torch.arange(B) % 3 != 0,
    }, batch_size=[B])


def plain_kto(lp, ref, kl, ref_kl, labels, beta, wd, wu):
    z = max(0.0, sum(a - b for a, b in zip(kl, ref_kl)) / len(kl))
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    return [wd * (1 - sig(beta * ((p - r) - z))) if y else wu * (1 - sig(beta * (z - (p - r))))
            for p, r, y in zip(lp, ref, labels)], z


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
def test_kto_against_plain_formula(dtype, tol):
    b = kto_batch(dtype=dtype)
    args = [b[k] for k in (K.LOGPS, K.REF_LOGPS, K.KL_LOGPS, K.REF_KL_LOGPS)]
    losses, z = kto_loss(*args, b[K.LABELS], beta=0.5, desirable_weight=1.3, undesirable_weight=0.7)
    want, want_z = plain_kto(*[a.double().tolist() for a in args], b[K.LABELS].tolist(), 0.5, 1.3, 0.7)
    assert want_z > 0 and losses.dtype == dtype
    assert z.item() == pytest.approx(want_z, rel=tol)
    torch.testing.assert_close(losses.double(), torch.tensor(want, dtype=torch.float64), rtol=tol, atol=tol)


def test_kto_reference_point_clamped_and_detached():
    lp = torch.tensor([-1.0, -2.0], requires_grad=True)
    kl = torch.tensor([-5.0, -5.0], requires_grad=True)
    losses, z = kto_loss(lp, torch.tensor([-1.5, -1.5]), kl, torch.tensor([-1.0, -1.0]),
                         torch.tensor([True, False]), beta=1.0)
    assert z.item() == 0.0  # mean KL estimate −4 clamps to 0
    torch.testing.assert_close(losses, torch.sigmoid(torch.tensor([-0.5, -0.5])))
    g_lp, g_kl = torch.autograd.grad(losses.sum(), (lp, kl), allow_unused=True)
    assert g_kl is None and torch.isfinite(g_lp).all()


def trl_kto_loss(b, *, beta, wd, wu):
    """TRL 1.x KTOTrainer._compute_loss on a stub model returning the given sequence log-probs."""
    from trl.trainer.kto_trainer import KTOTrainer

    B, T = b.batch_size[0], 3
    ids, kl_ids = torch.zeros(B, T, dtype=torch.long), torch.ones(B, T, dtype=torch.long)

    def per_token(x):
        out = torch.zeros(B, T - 1, dtype=x.dtype)
        out[:, 0] = x
        return out

    def model(**kw):
        x = b[K.KL_LOGPS] if kw["input_ids"] is kl_ids else b[K.LOGPS]
        zeros = torch.zeros(B, T - 1)
        return SimpleNamespace(log_probs=per_token(x), entropy=zeros, mean_logits=zeros)

    stub = KTOTrainer.__new__(KTOTrainer)
    stub.__dict__.update(
        model=SimpleNamespace(training=True), aux_loss_enabled=False, calculate_KL=True, precompute_ref_logps=True,
        accelerator=SimpleNamespace(device="cpu", gather_for_metrics=lambda x: x), loss_type="kto", beta=beta,
        desirable_weight=wd, undesirable_weight=wu, _metrics=defaultdict(lambda: defaultdict(list)),
        _total_train_tokens=0, _tp_size=1)
    ones = torch.ones(B, T, dtype=torch.long)
    inputs = {"input_ids": ids, "attention_mask": ones, "completion_mask": ones, "KL_input_ids": kl_ids,
              "KL_attention_mask": ones, "KL_completion_mask": ones, "label": b[K.LABELS],
              "ref_logps": b[K.REF_LOGPS], "ref_KL_logps": b[K.REF_KL_LOGPS]}
    return KTOTrainer._compute_loss(stub, model, inputs, False)


@pytest.mark.trl
def test_kto_matches_trl():
    pytest.importorskip("trl")
    b = kto_batch(dtype=torch.float32, seed=1)
    loss, _ = kto(b, beta=0.5, desirable_weight=1.3, undesirable_weight=0.7)
    torch.testing.assert_close(loss, trl_kto_loss(b, beta=0.5, wd=1.3, wu=0.7))


def test_kto_batch_metrics():
    b = kto_batch()
    loss, m = kto(b, beta=0.5)
    labels, rho = b[K.LABELS], b[K.LOGPS] - b[K.REF_LOGPS]
    torch.testing.assert_close(m["rewards/chosen"], 0.5 * rho[labels].mean())
    torch.testing.assert_close(m["rewards/rejected"], 0.5 * rho[~labels].mean())
    torch.testing.assert_close(m["logps/rejected"], b[K.LOGPS][~labels].mean())
    all_good = b.clone()
    all_good[K.LABELS] = torch.ones(6, dtype=torch.bool)
    assert kto(all_good)[1]["rewards/rejected"].item() == 0.0  # defined, not NaN


def test_kernels_pure_and_gradcheck():
    aw, al = avg_pairs(B=4, seed=2)
    b = kto_batch(B=4)
    kto_args = (b[K.LOGPS], b[K.REF_LOGPS], b[K.KL_LOGPS], b[K.REF_KL_LOGPS], b[K.LABELS])
    assert_pure(log1mexp, aw)
    assert_pure(alphapo_reward, aw, alpha=0.3)
    assert_pure(odds_ratio_loss, aw, al, beta=0.2)
    assert_pure(simpo_loss, aw, al, label_smoothing=0.1, alpha=0.2)
    assert_pure(cpo_loss, aw, al, label_smoothing=0.1)
    assert_pure(kto_loss, *kto_args, desirable_weight=2.0)
    w, lo = aw.clone().requires_grad_(True), al.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x, y: odds_ratio_loss(x, y, beta=0.2)[0], (w, lo))
    assert torch.autograd.gradcheck(lambda x, y: simpo_loss(x, y, label_smoothing=0.1, alpha=0.3), (w, lo))
    assert torch.autograd.gradcheck(lambda x, y: cpo_loss(x, y, label_smoothing=0.1), (w, lo))
    lp = b[K.LOGPS].clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: kto_loss(x, *kto_args[1:], beta=0.5)[0], (lp,))


# --- the registry and the conformance suite ---------------------------------------------------------
PAIR_MASKS = [(K.CHOSEN, K.LOSS_MASK), (K.REJECTED, K.LOSS_MASK)]
PAIR_GRADS = [(K.CHOSEN, K.LOGPS), (K.REJECTED, K.LOGPS)]
COMPILED = {"sigmoid", "ipo", "aot", "discopop", "orpo", "simpo", "kto"}  # compile is slow on CPU


@pytest.mark.parametrize("name", sorted(PREFERENCE_LOSSES))
def test_registry_conformance(name):
    fn = PREFERENCE_LOSSES[name]
    backend = "aot_eager" if name in COMPILED else None
    if name == "kto":
        check_loss_conformance(fn, kto_batch(), mask_key=K.LOSS_MASK, grad_keys=[K.LOGPS], compile_backend=backend)
    else:
        check_loss_conformance(fn, pref_batch(), mask_key=PAIR_MASKS, grad_keys=PAIR_GRADS,
                               compile_backend=backend)


@pytest.mark.parametrize("name", ["orpo", "simpo", "cpo"])
def test_reference_free_losses_padding_invariant_and_pure(name):
    fn = PREFERENCE_LOSSES[name]
    assert_padding_invariant(fn, pref_batch(), mask_key=(K.CHOSEN, K.LOSS_MASK), fill=float("nan"))
    b = pref_batch()
    del b[K.CHOSEN][K.REF_LOGPS], b[K.REJECTED][K.REF_LOGPS]  # no reference needed
    assert_pure(fn, b)


@settings(max_examples=25, deadline=None)
@given(st.floats(-8.0, -1e-6), st.floats(-8.0, -1e-6))
def test_odds_ratio_loss_finite_and_monotone(w, l):
    lw, ll = torch.tensor([w], dtype=torch.float64), torch.tensor([l], dtype=torch.float64)
    losses, log_odds = odds_ratio_loss(lw, ll)
    assert torch.isfinite(losses).all() and (losses > 0).all()
    assert (log_odds > 0).item() == (w > l) or w == l


def test_bad_input_names_argument_and_shapes():
    aw, al = avg_pairs()
    with pytest.raises(ValueError, match=r"rejected_logps_avg: expected shape \[6\].*got \[2\]"):
        odds_ratio_loss(aw, al[:2])
    with pytest.raises(ValueError, match=r"rejected_logps_avg: expected shape \[6\].*got \[2\]"):
        simpo_loss(aw, al[:2])
    b = kto_batch()
    with pytest.raises(TypeError, match="labels: expected a torch.bool mask"):
        kto_loss(b[K.LOGPS], b[K.REF_LOGPS], b[K.KL_LOGPS], b[K.REF_KL_LOGPS], b[K.LABELS].long())
    del b[K.REF_KL_LOGPS]
    with pytest.raises(KeyError, match=r"kto: batch is missing 'ref_kl_logps' \[B\] float"):
        kto(b)
    b = pref_batch()
    del b[K.REJECTED][K.LOSS_MASK]
    with pytest.raises(KeyError, match=r"orpo: batch is missing .*rejected.*loss_mask.* \[B, T\] bool"):
        orpo(b)


def test_orpo_nll_is_the_token_mean_over_the_batch_not_the_mean_of_sequence_means():
    """docs/differences.md: one chosen answer of 1 token at log-prob −3 and one of 5 tokens at −1 each give
    (3 + 5) / 6 = 1.333 here, where ROLL's ORPO (each sequence's mean first) gives (3/1 + 5/5) / 2 = 2.000."""
    from rlcore.algorithms.dpo import chosen_nll

    nll = chosen_nll(torch.tensor([-3.0, -5.0]), torch.tensor([1, 5]))
    torch.testing.assert_close(nll, torch.tensor(8.0 / 6.0))
    torch.testing.assert_close((torch.tensor([3.0, 5.0]) / torch.tensor([1.0, 5.0])).mean(), torch.tensor(2.0))
