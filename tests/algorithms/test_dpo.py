"""DPO and its variants: plain references, TRL 1.x parity, golden values, identities, checks."""

import math
from collections import defaultdict
from functools import partial
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from rlcore import keys as K
from rlcore.algorithms.dpo import chosen_nll, dpo, dpo_loss, preference_metrics
from rlcore.algorithms.dpo_variants import DPO_LOSSES, F_DIVERGENCES, smoothed_sigmoid_loss
from rlcore.testing import assert_padding_invariant, assert_pure, make_preference_batch, right_padded_mask
from tests.algorithms.conformance import check_loss_conformance

VARIANTS = ["sigmoid", "hinge", "ipo", "ipo_sum", "robust", "exo_pair", "nca_pair", "bco_pair", "sppo_hard",
            "aot", "aot_unpaired", "apo_zero", "apo_down", "discopop", "sigmoid_norm"]
DIFFERENCE_VARIANTS = ["sigmoid", "hinge", "ipo", "ipo_sum", "robust", "exo_pair", "discopop", "sigmoid_norm"]
SMOOTHED = {"sigmoid", "robust", "exo_pair", "aot", "aot_unpaired"}


# --- a plain reference, written from the formulas with Python floats and loops ------------------
def logsig(x):
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def sig(x):
    return math.exp(logsig(x))


SCORE = {
    "reverse_kl": lambda r, a: r,
    "forward_kl": lambda r, a: 1.0 - math.exp(-r),
    "js": lambda r, a: math.log(2.0) + logsig(r),
    "alpha": lambda r, a: (math.exp((a - 1.0) * r) - 1.0) / (a - 1.0),
}


def reference(name, cw, rw, rcw, rrw, nw, nl, *, beta=0.1, eps=0.0, div="reverse_kl", a=0.5, tau=0.05):
    B = len(cw)
    lw = [cw[b] - rcw[b] for b in range(B)]
    ll = [rw[b] - rrw[b] for b in range(B)]
    if name in ("aot", "aot_unpaired"):
        if name == "aot":
            d = [x - y for x, y in zip(sorted(cw[b] - rw[b] for b in range(B)),
                                       sorted(rcw[b] - rrw[b] for b in range(B)))]
        else:
            d = [x - y for x, y in zip(sorted(lw), sorted(ll))]
        return [-(1 - eps) * logsig(beta * x) - eps * logsig(-beta * x) for x in d]
    out = []
    for b in range(B):
        sw, sl = SCORE[div](lw[b], a), SCORE[div](ll[b], a)
        x = beta * (sw - sl)
        mw, ml = max(nw[b], 1), max(nl[b], 1)
        if name == "sigmoid":
            v = -(1 - eps) * logsig(x) - eps * logsig(-x)
        elif name == "hinge":
            v = max(0.0, 1 - x)
        elif name == "ipo":
            v = (sw / mw - sl / ml - 1 / (2 * beta)) ** 2
        elif name == "ipo_sum":
            v = (sw - sl - 1 / (2 * beta)) ** 2
        elif name == "robust":
            v = (-(1 - eps) * logsig(x) + eps * logsig(-x)) / (1 - 2 * eps)
        elif name == "exo_pair":
            v = sig(x) * (logsig(x) - math.log(1 - eps)) + sig(-x) * (logsig(-x) - math.log(eps))
        elif name == "nca_pair":
            v = -logsig(beta * lw[b]) - 0.5 * logsig(-beta * lw[b]) - 0.5 * logsig(-beta * ll[b])
        elif name == "bco_pair":
            v = -logsig(beta * lw[b]) - logsig(-beta * ll[b])
        elif name == "sppo_hard":
            v = (lw[b] - 0.5 / beta) ** 2 + (ll[b] + 0.5 / beta) ** 2
        elif name == "apo_zero":
            v = (1 - sig(beta * lw[b])) + sig(beta * ll[b])
        elif name == "apo_down":
            v = sig(beta * lw[b]) + (1 - sig(beta * (lw[b] - ll[b])))
        elif name == "discopop":
            w = sig(x / tau)
            v = (1 - w) * -logsig(x) + w * math.exp(-x)
        elif name == "sigmoid_norm":
            v = -logsig(beta * (sw / mw - sl / ml))
        out.append(v)
    return out


def random_pairs(B=6, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)

    def lp():
        return (-torch.rand(B, generator=g, dtype=torch.float64) * 20 - 0.5).to(dtype)

    return lp(), lp(), lp(), lp(), torch.randint(0, 9, (B,), generator=g), torch.randint(1, 9, (B,), generator=g)


def hyper(name, div="reverse_kl"):
    return dict(beta=0.3, label_smoothing=0.1 if name in SMOOTHED else 0.0, divergence=div, alpha=0.5)


def run(name, cw, rw, rcw, rrw, nw, nl, **kw):
    return dpo_loss(cw, rw, rcw, rrw, loss_type=name, chosen_lengths=nw, rejected_lengths=nl, **kw)[0]


def as_floats(*xs):
    return [[float(v) for v in x.double().tolist()] for x in xs]


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), (torch.float32, 2e-5), (torch.bfloat16, 6e-2)])
def test_variants_against_plain_reference(name, dtype, tol):
    """bf16 inputs: the reference runs on the same (rounded) inputs; bf16 arithmetic costs ~3 digits."""
    cw, rw, rcw, rrw, nw, nl = random_pairs(dtype=dtype)
    kw = hyper(name)
    got = run(name, cw, rw, rcw, rrw, nw, nl, **kw)
    assert got.dtype == dtype and got.shape == cw.shape
    want = reference(name, *as_floats(cw, rw, rcw, rrw), nw.tolist(), nl.tolist(), beta=kw["beta"],
                     eps=kw["label_smoothing"])
    torch.testing.assert_close(got.double(), torch.tensor(want, dtype=torch.float64), rtol=tol, atol=tol)


@pytest.mark.parametrize("name", DIFFERENCE_VARIANTS)
@pytest.mark.parametrize("div", ["forward_kl", "js", "alpha"])
def test_divergences_against_plain_reference(name, div):
    cw, rw, rcw, rrw, nw, nl = random_pairs(seed=1)
    kw = hyper(name, div)
    want = reference(name, *as_floats(cw, rw, rcw, rrw), nw.tolist(), nl.tolist(), beta=kw["beta"],
                     eps=kw["label_smoothing"], div=div, a=kw["alpha"])
    torch.testing.assert_close(run(name, cw, rw, rcw, rrw, nw, nl, **kw),
                               torch.tensor(want, dtype=torch.float64), rtol=1e-10, atol=1e-10)


# --- parity with TRL 1.x: its DPOTrainer._compute_loss, driven by a stub model -----------------
TRL_DIVERGENCE = {"reverse_kl": "reverse_kl", "forward_kl": "forward_kl", "js": "js_divergence",
                  "alpha": "alpha_divergence"}


def trl_dpo_loss(cw, rw, rcw, rrw, nw, nl, *, loss_type, beta, label_smoothing, divergence, alpha, tau=0.05):
    """TRL's mean loss. The stub model returns per-token log-probs whose sum is the given logps."""
    from trl.trainer.dpo_trainer import DPOTrainer

    B = cw.shape[0]
    T = int(max(nw.max(), nl.max())) + 1
    log_probs = torch.zeros(2 * B, T - 1, dtype=cw.dtype)
    log_probs[:, 0] = torch.cat([cw, rw])
    zeros = torch.zeros_like(log_probs)
    out = SimpleNamespace(log_probs=log_probs, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool())
    model = SimpleNamespace(training=True)
    stub = DPOTrainer.__new__(DPOTrainer)
    stub.__dict__.update(
        model=model, accelerator=SimpleNamespace(device="cpu", gather_for_metrics=lambda x: x, gather=lambda x: x),
        aux_loss_enabled=False, ld_alpha=None, precompute_ref_logps=True, loss_types=[loss_type],
        loss_weights=[1.0], beta=beta, label_smoothing=label_smoothing, use_weighting=False,
        f_divergence_type=TRL_DIVERGENCE[divergence], f_alpha_divergence_coef=alpha,
        args=SimpleNamespace(discopop_tau=tau), _metrics=defaultdict(lambda: defaultdict(list)),
        _total_train_tokens=0, _tp_size=1)
    inputs = {"input_ids": torch.zeros(2 * B, T, dtype=torch.long),
              "attention_mask": torch.ones(2 * B, T, dtype=torch.long),
              "completion_mask": right_padded_mask(torch.cat([nw, nl]), T).long(),
              "ref_chosen_logps": rcw, "ref_rejected_logps": rrw}
    return DPOTrainer._compute_loss(stub, lambda **_: out, inputs, False)


TRL_CASES = [(n, "reverse_kl") for n in VARIANTS if n != "ipo_sum"] + [
    (n, d) for n in DIFFERENCE_VARIANTS if n != "ipo_sum" for d in ("forward_kl", "js", "alpha")]


@pytest.mark.trl
@pytest.mark.parametrize("name, div", TRL_CASES)
def test_parity_with_trl(name, div):
    pytest.importorskip("trl")
    cw, rw, _, _, nw, nl = random_pairs(B=5, dtype=torch.float32, seed=2)
    g = torch.Generator().manual_seed(5)  # log-ratios within ±3: TRL's discopop is NaN far out
    rcw, rrw = cw + 6 * torch.rand(5, generator=g) - 3, rw + 6 * torch.rand(5, generator=g) - 3
    kw = hyper(name, div)
    if name == "sigmoid":  # TRL 1.x has no label smoothing on sigmoid
        kw["label_smoothing"] = 0.0
    want = trl_dpo_loss(cw, rw, rcw, rrw, nw, nl, loss_type=name, **kw)
    torch.testing.assert_close(run(name, cw, rw, rcw, rrw, nw, nl, **kw).mean(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.trl
def test_discopop_finite_where_trl_is_nan():
    pytest.importorskip("trl")
    cw, rw, zero = torch.tensor([-1.0, -1.0]), torch.tensor([-400.0, -1.0]), torch.zeros(2)
    n = torch.tensor([1, 1])
    kw = dict(beta=1.0, label_smoothing=0.0, divergence="reverse_kl", alpha=0.5)
    assert torch.isnan(trl_dpo_loss(rw, cw, zero, zero, n, n, loss_type="discopop", **kw))  # x = −399
    assert torch.isfinite(run("discopop", rw, cw, zero, zero, n, n, **kw)).all()


def test_per_side_variants_reject_f_divergences():  # as TRL 1.x does
    cw, rw, rcw, rrw, nw, nl = random_pairs()
    for name in sorted(set(VARIANTS) - set(DIFFERENCE_VARIANTS)):
        with pytest.raises(ValueError, match="divergence"):
            run(name, cw, rw, rcw, rrw, nw, nl, divergence="js")


# --- golden values -------------------------------------------------------------------------------
def test_golden_values():
    # ρ_w = 1, ρ_l = −1, Δ = 2, β = 0.5: βΔ = 1.
    one = torch.tensor([-5.0], dtype=torch.float64), torch.tensor([-7.0], dtype=torch.float64)
    refs = torch.tensor([-6.0], dtype=torch.float64), torch.tensor([-6.0], dtype=torch.float64)
    n = torch.tensor([2]), torch.tensor([4])
    args = (*one, *refs)
    g = {name: run(name, *args, *n, beta=0.5, label_smoothing=0.25).item() for name in VARIANTS}
    assert g["sigmoid"] == pytest.approx(0.75 * math.log1p(math.exp(-1)) + 0.25 * math.log1p(math.exp(1)))
    assert g["hinge"] == 0.0
    assert g["ipo_sum"] == pytest.approx(1.0)  # (2 − 1)²
    assert g["ipo"] == pytest.approx((1 / 2 + 1 / 4 - 1) ** 2)  # per-token margin 0.75, target 1
    assert g["sppo_hard"] == pytest.approx(0.0)  # ρ_w = 1/(2β), ρ_l = −1/(2β)
    assert g["apo_zero"] == pytest.approx(2 * (1 - 1 / (1 + math.exp(-0.5))))
    assert g["robust"] == pytest.approx((0.75 * math.log1p(math.exp(-1)) - 0.25 * math.log1p(math.exp(1))) / 0.5)
    losses, rw, rl = dpo_loss(*args, beta=0.5)
    assert (rw.item(), rl.item()) == (0.5, -0.5)


# --- identities ----------------------------------------------------------------------------------
def test_small_beta_first_order_expansion():
    cw, rw, rcw, rrw, _, _ = random_pairs()
    beta = 1e-4
    delta = (cw - rcw) - (rw - rrw)
    got = dpo_loss(cw, rw, rcw, rrw, beta=beta)[0]
    torch.testing.assert_close(got, math.log(2) - beta * delta / 2, rtol=0, atol=(beta * 20) ** 2)


@pytest.mark.parametrize("name", ["ipo", "ipo_sum"])
def test_ipo_minimiser_at_margin_one_over_two_beta(name):
    beta = 0.5  # target margin 1/(2β) = 1, per token for ipo (lengths 2 and 3)
    rw = torch.tensor([-9.0], dtype=torch.float64)
    cw = torch.tensor([-4.0 if name == "ipo" else -8.0], dtype=torch.float64, requires_grad=True)
    zero = torch.zeros(1, dtype=torch.float64)
    loss = run(name, cw, rw, zero, zero, torch.tensor([2]), torch.tensor([3]), beta=beta)
    (grad,) = torch.autograd.grad(loss.sum(), cw)
    assert loss.item() == 0.0 and grad.item() == 0.0
    for step in (-0.1, 0.1):  # and it is a minimum
        assert run(name, cw.detach() + step, rw, zero, zero, torch.tensor([2]), torch.tensor([3]), beta=beta) > 0


def test_reference_free_equals_zero_references():
    cw, rw, rcw, rrw, nw, nl = random_pairs()
    zero = torch.zeros_like(cw)
    for name in VARIANTS:
        kw = dict(hyper(name), chosen_lengths=nw, rejected_lengths=nl, loss_type=name)
        free = dpo_loss(cw, rw, None, None, reference_free=True, **kw)
        torch.testing.assert_close(free, dpo_loss(cw, rw, zero, zero, **kw))
        torch.testing.assert_close(free, dpo_loss(cw, rw, rcw, rrw, reference_free=True, **kw))


def test_label_smoothing_zero_is_plain_dpo_and_robust_zero_is_dpo():
    cw, rw, rcw, rrw, nw, nl = random_pairs()
    plain = -torch.nn.functional.logsigmoid(0.1 * ((cw - rcw) - (rw - rrw)))
    torch.testing.assert_close(dpo_loss(cw, rw, rcw, rrw, label_smoothing=0.0)[0], plain)
    torch.testing.assert_close(run("robust", cw, rw, rcw, rrw, nw, nl), plain)
    torch.testing.assert_close(smoothed_sigmoid_loss(torch.tensor([3.0]), label_smoothing=0.5),
                               torch.tensor([0.5 * (math.log1p(math.exp(-3)) + math.log1p(math.exp(3)))]))


def test_single_pair_and_unit_length_identities():
    cw, rw, rcw, rrw, nw, nl = random_pairs(B=1)
    ones = torch.ones(1, dtype=torch.long)
    sig = run("sigmoid", cw, rw, rcw, rrw, nw, nl, label_smoothing=0.2)
    torch.testing.assert_close(run("aot", cw, rw, rcw, rrw, nw, nl, label_smoothing=0.2), sig)
    torch.testing.assert_close(run("aot_unpaired", cw, rw, rcw, rrw, nw, nl, label_smoothing=0.2), sig)
    cw, rw, rcw, rrw, nw, nl = random_pairs()
    ones = torch.ones(6, dtype=torch.long)
    torch.testing.assert_close(run("ipo", cw, rw, rcw, rrw, ones, ones), run("ipo_sum", cw, rw, rcw, rrw, nw, nl))
    torch.testing.assert_close(run("sigmoid_norm", cw, rw, rcw, rrw, ones, ones),
                               run("sigmoid", cw, rw, rcw, rrw, nw, nl))


def test_alpha_divergence_limit_and_scores_vanish_at_reference():
    x = torch.linspace(-5, 5, 11, dtype=torch.float64)
    torch.testing.assert_close(F_DIVERGENCES["alpha"](x, alpha=1.0), x)
    torch.testing.assert_close(F_DIVERGENCES["alpha"](x, alpha=1.0 + 1e-5), x, rtol=1e-3, atol=1e-3)
    for name, f in F_DIVERGENCES.items():
        assert f(torch.zeros(1, dtype=torch.float64), alpha=0.5).item() == pytest.approx(0.0, abs=1e-15), name
    big = F_DIVERGENCES["alpha"](torch.tensor([-1e4]), alpha=0.5)  # exponent clamped: finite
    assert torch.isfinite(big).all()


def test_discopop_finite_at_extremes():
    cw = torch.tensor([-1.0, -1e3, -1.0], requires_grad=True)
    rw = torch.tensor([-1e3, -1.0, -1.0])
    zero = torch.zeros(3)
    loss = run("discopop", cw, rw, zero, zero, None, None, beta=1.0)
    loss.sum().backward()
    assert torch.isfinite(loss).all() and torch.isfinite(cw.grad).all()
    assert loss[1].item() == pytest.approx(999.0, rel=1e-6)  # −logσ(−999) ≈ 999, the exponential is off


def test_sigmoid_gradient_closed_form():
    cw, rw, rcw, rrw, _, _ = random_pairs()
    cw = cw.clone().requires_grad_(True)
    beta, eps = 0.3, 0.2
    loss = dpo_loss(cw, rw, rcw, rrw, beta=beta, label_smoothing=eps)[0]
    (grad,) = torch.autograd.grad(loss.sum(), cw)
    x = beta * ((cw - rcw) - (rw - rrw)).detach()
    torch.testing.assert_close(grad, -beta * (1 - eps) * torch.sigmoid(-x) + beta * eps * torch.sigmoid(x))


@settings(max_examples=30, deadline=None)
@given(st.lists(st.floats(-30, 30), min_size=4, max_size=4), st.floats(0.01, 2.0))
def test_sigmoid_decreases_with_margin_and_is_positive(vals, beta):
    cw, rw, rcw, rrw = (torch.tensor([v], dtype=torch.float64) for v in vals)
    base = dpo_loss(cw, rw, rcw, rrw, beta=beta)[0]
    more = dpo_loss(cw + 1.0, rw, rcw, rrw, beta=beta)[0]
    assert (base > 0).all() and (more <= base).all()


# --- gradients, purity, dtypes -------------------------------------------------------------------
@pytest.mark.parametrize("name", VARIANTS)
def test_gradcheck(name):
    cw, rw, rcw, rrw, nw, nl = random_pairs(B=4, seed=3)
    cw, rw = cw.requires_grad_(True), rw.requires_grad_(True)
    kw = hyper(name)
    assert torch.autograd.gradcheck(lambda a, b: run(name, a, b, rcw, rrw, nw, nl, **kw), (cw, rw), fast_mode=True)


@pytest.mark.parametrize("name", VARIANTS)
def test_pure_and_reference_detached(name):
    cw, rw, rcw, rrw, nw, nl = random_pairs()
    rcw = rcw.clone().requires_grad_(True)
    out = assert_pure(partial(run, name, **hyper(name)), cw, rw, rcw, rrw, nw, nl)
    assert not out.requires_grad  # the only grad input is a reference: detached
    _, rew_w, rew_l = dpo_loss(cw.requires_grad_(True), rw, rcw, rrw, loss_type=name, chosen_lengths=nw,
                               rejected_lengths=nl, **hyper(name))
    assert not rew_w.requires_grad and not rew_l.requires_grad


def test_registry_is_complete():
    assert sorted(DPO_LOSSES) == sorted(VARIANTS)


# --- the TensorDict loss ---------------------------------------------------------------------------
def pref_batch(dtype=torch.float64, empty=True):
    b = make_preference_batch(5, 9, dtype=dtype, generator=torch.Generator().manual_seed(4))
    if empty:  # an empty chosen completion in the last pair: logps 0 by definition
        b[K.CHOSEN, K.LOSS_MASK][-1] = False
        b[K.CHOSEN, K.LOGPS][-1] = 0.0
        b[K.CHOSEN, K.REF_LOGPS][-1] = 0.0
    return b


def test_dpo_batch_matches_kernel_and_metrics():
    b = pref_batch()
    loss, m = dpo(b, beta=0.2, loss_type="ipo", rpo_alpha=0.5)
    c, r = b[K.CHOSEN], b[K.REJECTED]
    nw, nl = c[K.LOSS_MASK].sum(-1), r[K.LOSS_MASK].sum(-1)
    losses, rew_w, rew_l = dpo_loss(c[K.LOGPS], r[K.LOGPS], c[K.REF_LOGPS], r[K.REF_LOGPS], beta=0.2,
                                    loss_type="ipo", chosen_lengths=nw, rejected_lengths=nl)
    nll = -sum(c[K.LOGPS].tolist()) / sum(nw.tolist())
    torch.testing.assert_close(m["loss_dpo"], losses.mean())
    assert m["loss_rpo"].item() == pytest.approx(0.5 * nll)
    torch.testing.assert_close(loss, m["loss_dpo"] + m["loss_rpo"])
    torch.testing.assert_close(m["rewards/margins"], (rew_w - rew_l).mean())
    assert m["rewards/accuracies"].item() == pytest.approx(sum(rew_w > rew_l).item() / 5)
    torch.testing.assert_close(m["logps/chosen"], c[K.LOGPS].mean())
    assert set(m.keys()) == {"loss_dpo", "loss_rpo", "rewards/chosen", "rewards/rejected", "rewards/margins",
                             "rewards/accuracies", "logps/chosen", "logps/rejected"}


def test_chosen_nll_is_token_mean_and_helpers_pure():
    assert chosen_nll(torch.tensor([-3.0, 0.0]), torch.tensor([3, 0])).item() == 1.0
    assert chosen_nll(torch.tensor([0.0]), torch.tensor([0])).item() == 0.0
    cw, rw, _, _, nw, _ = random_pairs()
    assert_pure(chosen_nll, cw, nw)
    assert_pure(smoothed_sigmoid_loss, cw, label_smoothing=0.1)
    assert_pure(preference_metrics, cw, rw, cw, rw)


@pytest.mark.parametrize("name", VARIANTS)
def test_dpo_batch_padding_invariant(name):
    assert_padding_invariant(partial(dpo, loss_type=name, **hyper(name)), pref_batch(),
                             mask_key=(K.CHOSEN, K.LOSS_MASK), fill=float("nan"))


def test_dpo_conformance():
    check_loss_conformance(partial(dpo, loss_type="ipo", rpo_alpha=1.0), pref_batch(),
                           mask_key=[(K.CHOSEN, K.LOSS_MASK), (K.REJECTED, K.LOSS_MASK)],
                           grad_keys=[(K.CHOSEN, K.LOGPS), (K.REJECTED, K.LOGPS)])


# --- bad input -----------------------------------------------------------------------------------
def test_bad_input_names_argument_and_shapes():
    cw, rw, rcw, rrw, nw, nl = random_pairs(B=4)
    with pytest.raises(ValueError, match=r"rejected_logps: expected shape \[4\].*got \[3\]"):
        dpo_loss(cw, rw[:3], rcw, rrw)
    with pytest.raises(ValueError, match=r"chosen_lengths: expected shape \[4\].*got \[2\]"):
        dpo_loss(cw, rw, rcw, rrw, loss_type="ipo", chosen_lengths=nw[:2], rejected_lengths=nl)
    with pytest.raises(ValueError, match="chosen_lengths: required"):
        dpo_loss(cw, rw, rcw, rrw, loss_type="sigmoid_norm")
    with pytest.raises(TypeError, match="ref_chosen_logps"):
        dpo_loss(cw, rw, None, rrw)
    with pytest.raises(TypeError, match="chosen_logps: expected a floating-point"):
        dpo_loss(cw.long(), rw, rcw, rrw)
    with pytest.raises(ValueError, match=r"loss_type: unknown 'dpo'; valid: \['aot'"):
        dpo_loss(cw, rw, rcw, rrw, loss_type="dpo")
    with pytest.raises(ValueError, match=r"divergence: unknown 'kl'; valid"):
        dpo_loss(cw, rw, rcw, rrw, divergence="kl")
    with pytest.raises(ValueError, match="label_smoothing: exo_pair"):
        dpo_loss(cw, rw, rcw, rrw, loss_type="exo_pair")
    with pytest.raises(ValueError, match="label_smoothing: robust"):
        dpo_loss(cw, rw, rcw, rrw, loss_type="robust", label_smoothing=0.5)


def test_bad_batch_names_key_and_shapes():
    b = pref_batch()
    del b[K.REJECTED][K.REF_LOGPS]
    with pytest.raises(KeyError, match=r"dpo: batch is missing .*rejected.*ref_logps.* \[B\] float"):
        dpo(b)
    dpo(b, reference_free=True)  # not read then
    b = pref_batch()
    b[K.CHOSEN, K.LOSS_MASK] = b[K.CHOSEN, K.LOSS_MASK].long()
    with pytest.raises(TypeError, match="chosen.loss_mask: expected a torch.bool mask"):
        dpo(b)
    b = pref_batch()
    bad = TensorDict({K.CHOSEN: b[K.CHOSEN].to_dict(), K.REJECTED: b[K.REJECTED].to_dict()}, [])
    bad[K.REJECTED, K.LOGPS] = bad[K.REJECTED, K.LOGPS][:3]
    with pytest.raises(ValueError, match=r"rejected.logps: expected shape \[5\].*got \[3\]"):  # the batch key
        dpo(bad)


@pytest.mark.parametrize("loss_type", ["ipo", "ipo_sum", "sppo_hard", "sigmoid"])
def test_a_denormal_beta_is_refused_where_it_would_make_nan(loss_type):
    """β = 1e-310 passed "> 0 and finite", and 1/(2β) = inf gave NaN gradients in IPO and SPPO."""
    x = torch.zeros(2)
    with pytest.raises(ValueError, match=r"^beta: expected a finite number >= 1e-12"):
        DPO_LOSSES[loss_type](x, x, x, x, beta=1e-310, chosen_lengths=x + 1, rejected_lengths=x + 1)
    lp = torch.tensor([-3.0, -1.0], requires_grad=True)  # the floor itself: finite loss and gradient
    loss = DPO_LOSSES[loss_type](lp, x, x, x, beta=1e-12, chosen_lengths=x + 1, rejected_lengths=x + 1)
    loss.sum().backward()
    assert torch.isfinite(loss).all() and torch.isfinite(lp.grad).all()


def test_a_denormal_discopop_tau_is_refused():
    x = torch.zeros(2)
    with pytest.raises(ValueError, match=r"^discopop_tau: expected a finite number >= 1e-12"):
        DPO_LOSSES["discopop"](x, x, x, x, discopop_tau=1e-310)
