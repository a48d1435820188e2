"""algorithms/policy_gradient.py: the conformance suite over POLICY_LOSSES, presets, peers' formulas."""

from __future__ import annotations

import doctest
import functools
import math

import pytest
import torch
from tensordict import TensorDict

import rlcore.algorithms.policy_gradient as pg
from rlcore import keys as K
from rlcore.algorithms.policy_gradient import (POLICY_LOSSES, POLICY_RATIO_LEVELS, bnpo_loss, cispo_loss, dapo_loss, dr_grpo_loss, grpo_loss,
                                               gspo_loss, luspo_loss, policy_loss, rloo_loss, sapo_loss, vespo_loss)
from rlcore.algorithms.ppo import ppo_loss
from rlcore.checks import lookup
from rlcore.masked import masked_sum
from rlcore.testing import assert_pure, assert_same, make_preference_batch, make_rollout
from tests.algorithms.conformance import check_compiles, check_loss_conformance

F64 = torch.float64


def rollout(B: int = 6, R: int = 5, *, dtype=F64, seed: int = 0, empty_rows: int = 1, spread: float = 0.3,
            seq_adv: bool = False):
    g = torch.Generator().manual_seed(seed)
    b = make_rollout(B, R, empty_rows=empty_rows, dtype=dtype, generator=g)

    def randn():
        return torch.randn(B, R, generator=g, dtype=F64).to(dtype)

    adv = randn()
    if seq_adv:  # one advantage per sequence, as the outcome estimators give
        adv = adv[:, :1].expand(B, R).clone()
    return b.update({K.LOGPROBS: b[K.OLD_LOGPROBS] + spread * randn(), K.ADVANTAGES: adv,
                     K.ENTROPY: torch.rand(B, R, generator=g, dtype=F64).to(dtype)})


def with_lp(batch):
    """A copy of ``batch`` whose logprobs are a fresh leaf requiring grad, and that leaf."""
    lp = batch[K.LOGPROBS].clone().requires_grad_(True)
    return batch.copy().update({K.LOGPROBS: lp}), lp


def masked(batch, key):
    return torch.where(batch[K.RESPONSE_MASK], batch[key], 0)


# --- the conformance suite, every entry -------------------------------------------------------
def bound(name):
    fn = functools.partial(POLICY_LOSSES[name], kl_coef=0.1, entropy_coef=0.01)
    if name == "dr_grpo":  # seq_sum_norm depends on the padded width unless L is given
        fn = functools.partial(fn, max_length=8)
    return fn


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_conformance(name):
    check_loss_conformance(bound(name), rollout(4, 5, seq_adv=True), grad_keys=[K.LOGPROBS, K.ENTROPY],
                           compile_backend=None)


@pytest.mark.slow  # about 1-3 s per entry, all of it in torch.compile's tracing
@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_conformance_under_compile(name):
    check_compiles(bound(name), rollout(4, 5, seq_adv=True), grad_keys=[K.LOGPROBS, K.ENTROPY],
                   backend="aot_eager")


def test_registry_has_one_signature_and_a_helpful_lookup():
    b = rollout()
    keys = None
    for name, fn in POLICY_LOSSES.items():
        loss, metrics = fn(b, kl_coef=0.05, entropy_coef=0.0, num_tokens=None, num_seqs=None, max_length=16,
                           ratio_threshold=None, log_ratio_clamp=20.0)
        assert loss.ndim == 0, name
        keys = keys or set(metrics.keys())
        assert set(metrics.keys()) == keys, name
    assert lookup(POLICY_LOSSES, "grpo", what="policy loss") is grpo_loss
    with pytest.raises(ValueError, match=r"policy loss: unknown 'ppo2'; valid: \['bnpo', 'cispo', 'dapo'"):
        lookup(POLICY_LOSSES, "ppo2", what="policy loss")


def test_presets_bind_the_peers_defaults():
    expect = {
        "grpo": dict(ratio_level="token", clip_eps_low=0.2, clip_eps_high=0.2, agg="seq_mean_token_mean", kl="k3"),
        "dr_grpo": dict(ratio_level="token", agg="seq_sum_norm"),
        "dapo": dict(ratio_level="token", clip_eps_low=0.2, clip_eps_high=0.28, agg="token_mean"),
        "gspo": dict(ratio_level="sequence", clip_eps_low=3e-4, clip_eps_high=4e-4, agg="seq_mean_token_mean"),
        "rloo": dict(ratio_level="sequence_sum", clip_eps_low=0.2, clip_eps_high=0.2, agg="seq_mean_token_mean"),
        "reinforce_pp": dict(ratio_level="token", agg="token_mean"),
        "remax": dict(ratio_level="token", agg="token_mean"),
        "cispo": dict(surrogate="cispo", clip_eps_low=1.0, clip_eps_high=4.0, agg="token_mean"),
        # TRL 1.16's GRPOConfig defaults: epsilon 0.2 (epsilon_high = epsilon), sapo_temperature_pos/neg
        # 1.0 / 1.05, vespo_k_pos / lambda_pos 2 / 3, vespo_k_neg / lambda_neg 3 / 2
        "bnpo": dict(ratio_level="token", clip_eps_low=0.2, clip_eps_high=0.2, agg="local_token_mean"),
        "luspo": dict(ratio_level="sequence", clip_eps_low=0.2, clip_eps_high=0.2, agg="seq_mean_token_sum"),
        "sapo": dict(surrogate="sapo", ratio_level="token", agg="seq_mean_token_mean", sapo_temperature_pos=1.0,
                     sapo_temperature_neg=1.05),
        "vespo": dict(surrogate="vespo", ratio_level="token", agg="token_mean", vespo_k_pos=2.0,
                      vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0),
    }
    b = rollout(spread=0.2)
    for name, kw in expect.items():
        preset = POLICY_LOSSES[name]
        assert preset.func is policy_loss and kw.items() <= preset.keywords.items(), name
        assert preset.keywords.get("kl_coef", 0.0) == 0.0, name  # KL off by default everywhere
        assert preset.__doc__ and "arxiv.org" in preset.__doc__, name
        torch.testing.assert_close(preset(b, max_length=9), policy_loss(b, max_length=9, **kw), rtol=0, atol=0)
    assert POLICY_LOSSES["vanilla"] is policy_loss


def test_each_entry_declares_the_ratio_level_it_binds():
    """``POLICY_RATIO_LEVELS`` names every entry, each at the level its loss computes the ratio at."""
    assert list(POLICY_RATIO_LEVELS) == list(POLICY_LOSSES)
    for name, loss in POLICY_LOSSES.items():
        bound = loss.keywords.get("ratio_level") if isinstance(loss, functools.partial) else "token"
        assert POLICY_RATIO_LEVELS[name] == bound, name
    b = rollout(spread=0.2)
    for name, level in POLICY_RATIO_LEVELS.items():  # the loss at its declared level is the loss
        torch.testing.assert_close(POLICY_LOSSES[name](b, max_length=9, ratio_level=level),
                                   POLICY_LOSSES[name](b, max_length=9), rtol=0, atol=0)


def test_policy_loss_is_ppo_without_the_value_term():
    b = rollout()
    loss, metrics = assert_pure(policy_loss, b, kl_coef=0.1, entropy_coef=0.01)
    assert b.get(K.VALUE_PREDS) is not None and "loss_value" not in metrics.keys()
    ref_loss, ref_metrics = ppo_loss(b.exclude(K.VALUE_PREDS), kl_coef=0.1, entropy_coef=0.01)
    assert_same((loss, metrics), (ref_loss, ref_metrics))
    with_critic, _ = ppo_loss(b.copy().update({K.RETURNS: b[K.VALUES]}), kl_coef=0.1, entropy_coef=0.01)
    assert not torch.equal(with_critic, loss)


# --- the peers' formulas, written out ---------------------------------------------------------
def test_trl_grpo_parity_with_k3_in_the_loss():
    """TRL GRPO loss_type='grpo': ℓ = −min(c1·A, c2·A) + β·k3; mean_i(Σ_t Mℓ / Σ_t M)."""
    b, lp = with_lp(rollout(empty_rows=0, seq_adv=True))
    m = b[K.RESPONSE_MASK].to(F64)
    adv, old, ref = masked(b, K.ADVANTAGES), masked(b, K.OLD_LOGPROBS), masked(b, K.REF_LOGPROBS)
    lp0 = torch.where(b[K.RESPONSE_MASK], lp, 0)
    c1 = torch.exp(lp0 - old)
    c2 = torch.clamp(c1, 1 - 0.2, 1 + 0.2)
    k3 = torch.exp(ref - lp0) - (ref - lp0) - 1
    per_token = -torch.min(c1 * adv, c2 * adv) + 0.04 * k3
    trl = ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1)).mean()
    ours, metrics = grpo_loss(b, kl_coef=0.04)
    torch.testing.assert_close(ours, trl, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(*(torch.autograd.grad(x, lp)[0] for x in (ours, trl)), rtol=1e-10, atol=1e-14)
    assert metrics["loss_kl"] > 0


def test_trl_dapo_and_dr_grpo_normalisers():
    b, lp = with_lp(rollout(empty_rows=0, spread=0.4))
    m = b[K.RESPONSE_MASK].to(F64)
    adv, old = masked(b, K.ADVANTAGES), masked(b, K.OLD_LOGPROBS)
    c1 = torch.exp(torch.where(b[K.RESPONSE_MASK], lp, 0) - old)

    def per_token(hi):
        return -torch.min(c1 * adv, torch.clamp(c1, 0.8, 1 + hi) * adv) * m

    torch.testing.assert_close(dapo_loss(b)[0], per_token(0.28).sum() / m.sum(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dr_grpo_loss(b, max_length=16)[0], per_token(0.2).sum() / (6 * 16),
                               rtol=1e-12, atol=1e-12)
    # Dr. GRPO's constant normaliser: padding-free only with max_length given
    wider = b.apply(lambda x: torch.cat([x, torch.zeros_like(x[:, :2])], -1) if x.ndim == 2 else x)
    torch.testing.assert_close(dr_grpo_loss(wider, max_length=16)[0], dr_grpo_loss(b, max_length=16)[0])
    assert not torch.allclose(dr_grpo_loss(wider)[0], dr_grpo_loss(b)[0])


def test_trl_rloo_sequence_sum_parity():
    """TRL RLOO: ρ_i = exp(Σ_t M·lp − Σ_t M·old), ℓ_i = −min(ρ_i A_i, clip(ρ_i) A_i), mean_i ℓ_i."""
    b, lp = with_lp(rollout(empty_rows=0, spread=0.1, seq_adv=True))
    mask = b[K.RESPONSE_MASK]
    a = b[K.ADVANTAGES][:, 0]
    rho = torch.exp(torch.where(mask, lp, 0).sum(-1) - masked(b, K.OLD_LOGPROBS).sum(-1))
    assert ((rho < 0.8) | (rho > 1.2)).any() and ((rho > 0.8) & (rho < 1.2)).any()  # both branches
    trl = (-torch.min(rho * a, torch.clamp(rho, 0.8, 1.2) * a)).mean()
    ours, _ = rloo_loss(b)
    torch.testing.assert_close(ours, trl, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(*(torch.autograd.grad(x, lp)[0] for x in (ours, trl)), rtol=1e-10, atol=1e-14)


def test_gspo_is_the_sequence_objective():
    """GSPO: s_i = exp(mean_t(lp − old)), ℓ_i = −min(s_i A_i, clip(s_i, 1−3e-4, 1+4e-4) A_i), mean_i ℓ_i."""
    b, lp = with_lp(rollout(empty_rows=0, spread=2e-3, seq_adv=True))
    mask = b[K.RESPONSE_MASK]
    n = mask.sum(-1).to(F64)
    a = b[K.ADVANTAGES][:, 0]
    s = torch.exp((torch.where(mask, lp, 0) - masked(b, K.OLD_LOGPROBS)).sum(-1) / n)
    plain = (-torch.min(s * a, torch.clamp(s, 1 - 3e-4, 1 + 4e-4) * a)).mean()
    ours, metrics = gspo_loss(b)
    torch.testing.assert_close(ours, plain, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(*(torch.autograd.grad(x, lp)[0] for x in (ours, plain)), rtol=1e-10, atol=1e-14)
    assert 0 < metrics["clipfrac_low"] + metrics["clipfrac_high"] < 1


def test_cispo_keeps_the_gradient_of_clipped_tokens():
    b, lp = with_lp(rollout(spread=1.0))
    mask = b[K.RESPONSE_MASK]
    adv = masked(b, K.ADVANTAGES)
    ratio = torch.exp(masked(b, K.LOGPROBS) - masked(b, K.OLD_LOGPROBS))
    w = ratio.clamp(0.0, 5.0)
    plain = (torch.where(mask, -w * adv * lp, 0)).sum() / mask.sum()
    ours, _ = cispo_loss(b)
    torch.testing.assert_close(ours, plain, rtol=1e-12, atol=1e-12)
    g_cispo = torch.autograd.grad(ours, lp)[0]
    torch.testing.assert_close(g_cispo, torch.where(mask, -w * adv, 0) / mask.sum())
    g_ppo = torch.autograd.grad(policy_loss(b)[0], lp)[0]
    outside = mask & (((ratio > 1.2) & (adv > 0)) | ((ratio < 0.8) & (adv < 0)))
    assert outside.any() and (g_ppo[outside] == 0).all() and (g_cispo[outside] != 0).all()


def test_dapo_clip_higher_keeps_more_gradient_than_grpo():
    b, lp = with_lp(rollout(spread=0.0))
    b = b.copy().update({K.LOGPROBS: lp + math.log(1.25), K.ADVANTAGES: masked(b, K.ADVANTAGES).abs() + 0.1})
    mask = b[K.RESPONSE_MASK]
    g_dapo = torch.autograd.grad(dapo_loss(b)[0], lp)[0]
    g_grpo = torch.autograd.grad(grpo_loss(b)[0], lp)[0]
    assert (g_dapo[mask] != 0).all() and (g_grpo == 0).all()  # ρ = 1.25 with A > 0: inside 1.28, outside 1.2


# --- TRL 1.16's bnpo / luspo / sapo / vespo, each against its formula written out -------------------
def valid_rows(b, lp):
    """Per row, the valid tokens as ``(lp_t, old_t, A_t)``: ``lp_t`` a 0-d slice of the leaf ``lp``
    (so a reference built from them is differentiable), ``old_t`` and ``A_t`` plain floats."""
    mask, old, adv = b[K.RESPONSE_MASK], b[K.OLD_LOGPROBS], b[K.ADVANTAGES]
    return [[(lp[i, t], float(old[i, t]), float(adv[i, t])) for t in range(mask.shape[1]) if mask[i, t]]
            for i in range(mask.shape[0])]


def clip_term(rho, a, eps_lo=0.2, eps_hi=0.2):
    return -torch.min(rho * a, torch.clamp(rho, 1 - eps_lo, 1 + eps_hi) * a)


def bnpo_reference(b, lp, micro):
    """TRL bnpo with gradient accumulation: each micro-batch's Σ ℓ / (its valid tokens), then / the
    number of micro-batches (TRL's current_gradient_accumulation_steps), summed over the step."""
    rows = valid_rows(b, lp)
    chunks = [rows[i:i + micro] for i in range(0, len(rows), micro)]
    total = 0.0
    for chunk in chunks:
        terms = [clip_term(torch.exp(lp_t - old_t), a) for row in chunk for lp_t, old_t, a in row]
        total = total + sum(terms) / max(len(terms), 1) / len(chunks)
    return total


def sapo_reference(b, lp, tau_pos=1.0, tau_neg=1.05):
    """TRL sapo: ℓ_t = −A·(4/τ)·σ(τ(ρ_t − 1)), τ = τ_pos if A > 0 else τ_neg; mean_i (Σ_t ℓ / n_i)."""
    per_seq = []
    for row in valid_rows(b, lp):
        terms = []
        for lp_t, old_t, a in row:
            tau = tau_pos if a > 0 else tau_neg
            terms.append(-a * 4 / tau * torch.sigmoid(tau * (torch.exp(lp_t - old_t) - 1)))
        per_seq.append(sum(terms) / len(terms))
    return sum(per_seq) / len(per_seq)


def luspo_reference(b, lp, eps=0.2):
    """TRL luspo (sequence level): s_i = exp(Σ_t (lp − old) / n_i), mean_i n_i·(−min(s_i A_i, clip(s_i) A_i))."""
    rows = valid_rows(b, lp)
    total = 0.0
    for row in rows:
        n = len(row)
        s = torch.exp(sum(lp_t - old_t for lp_t, old_t, _ in row) / n)
        total = total + n * clip_term(s, row[0][2], eps, eps)
    return total / len(rows)


def vespo_weight(log_w, a, k=(2.0, 3.0), lam=(3.0, 2.0)):
    kk, ll = (k[0], lam[0]) if a >= 0 else (k[1], lam[1])
    return math.exp(ll + kk * log_w - ll * math.exp(log_w))


def vespo_reference(b, lp):
    """TRL vespo: log w_i = clamp(Σ_t clamp(lp − old, ±20), log 1e-8, 20), φ = e^λ w^k e^{−λw},
    ℓ_t = −φ·A_t·lp_t; Σ ℓ over the step's valid tokens (TRL's dapo normaliser)."""
    terms = []
    for row in valid_rows(b, lp):
        log_w = sum(min(max(float(lp_t.detach()) - old_t, -20.0), 20.0) for lp_t, old_t, _ in row)
        log_w = min(max(log_w, math.log(1e-8)), 20.0)
        terms += [-vespo_weight(log_w, a) * a * lp_t for lp_t, old_t, a in row]
    return sum(terms) / len(terms)


def test_bnpo_normalises_by_the_tokens_of_each_micro_batch():
    b, lp = with_lp(rollout(6, 5, empty_rows=0, spread=0.4))
    step = b[K.RESPONSE_MASK]
    counts = dict(num_tokens=step.sum(), num_seqs=step.any(-1).sum())
    ours = sum(bnpo_loss(b[i:i + 2], **counts)[0] for i in range(0, 6, 2))  # as loops.update sums micro-batches
    trl = bnpo_reference(b, lp, micro=2)
    torch.testing.assert_close(ours, trl, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(*(torch.autograd.grad(x, lp)[0] for x in (ours, trl)), rtol=1e-10, atol=1e-14)
    # one micro-batch: the plain token mean, whatever num_tokens says; dapo's global count differs
    torch.testing.assert_close(bnpo_loss(b, num_tokens=999)[0], bnpo_reference(b, lp, micro=6), rtol=1e-12, atol=1e-12)
    dapo_parts = sum(dapo_loss(b[i:i + 2], clip_eps_high=0.2, **counts)[0] for i in range(0, 6, 2))
    torch.testing.assert_close(dapo_parts, bnpo_reference(b, lp, micro=6), rtol=1e-12, atol=1e-12)
    assert not torch.allclose(ours, dapo_parts)


def test_sapo_soft_gate():
    b, lp = with_lp(rollout(empty_rows=0, spread=0.5))
    ours, metrics = sapo_loss(b)
    plain = sapo_reference(b, lp)
    torch.testing.assert_close(ours, plain, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(*(torch.autograd.grad(x, lp)[0] for x in (ours, plain)), rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(sapo_loss(b, sapo_temperature_pos=2.0, sapo_temperature_neg=0.5)[0],
                               sapo_reference(b, lp, 2.0, 0.5), rtol=1e-12, atol=1e-12)
    assert metrics["clipfrac_low"] == metrics["clipfrac_high"] == 0  # nothing is clipped
    # the gate keeps a (small) gradient where the clip has none: ρ = 1.5 with A > 0
    b2 = b.copy().update({K.LOGPROBS: lp + math.log(1.5), K.ADVANTAGES: masked(b, K.ADVANTAGES).abs() + 0.1})
    g_sapo, g_grpo = (torch.autograd.grad(fn(b2.copy().update({K.OLD_LOGPROBS: lp.detach()}))[0], lp)[0]
                      for fn in (sapo_loss, grpo_loss))
    mask = b[K.RESPONSE_MASK]
    assert (g_sapo[mask] < 0).all() and (g_grpo == 0).all()


def test_luspo_scales_each_sequence_by_its_length():
    b, lp = with_lp(rollout(empty_rows=0, spread=0.3, seq_adv=True))
    ours, _ = luspo_loss(b)
    plain = luspo_reference(b, lp)
    torch.testing.assert_close(ours, plain, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(*(torch.autograd.grad(x, lp)[0] for x in (ours, plain)), rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(luspo_loss(b, clip_eps_low=3e-4, clip_eps_high=3e-4)[0], luspo_reference(b, lp, 3e-4),
                               rtol=1e-12, atol=1e-12)
    # with equal lengths, LUSPO is GSPO (same ε) times the length
    full = b.copy().update({K.RESPONSE_MASK: torch.ones_like(b[K.RESPONSE_MASK])})
    torch.testing.assert_close(luspo_loss(full)[0], 5 * gspo_loss(full, clip_eps_low=0.2, clip_eps_high=0.2)[0],
                               rtol=1e-12, atol=1e-12)


def test_vespo_gamma_weight():
    b, lp = with_lp(rollout(empty_rows=0, spread=0.3))
    old = b[K.OLD_LOGPROBS].clone()
    old[0, 0] = lp[0, 0].detach() - 25.0  # one token's log-ratio past the per-token clamp of 20
    b = b.copy().update({K.OLD_LOGPROBS: old})
    ours, metrics = vespo_loss(b)
    plain = vespo_reference(b, lp)
    torch.testing.assert_close(ours, plain, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(*(torch.autograd.grad(x, lp)[0] for x in (ours, plain)), rtol=1e-10, atol=1e-14)
    counts = dict(num_tokens=torch.tensor(40))  # the step's tokens, as TRL's dapo / vespo
    torch.testing.assert_close(vespo_loss(b, **counts)[0], plain * b[K.RESPONSE_MASK].sum() / 40, rtol=1e-12, atol=1e-12)
    assert vespo_weight(0.0, 1.0) == vespo_weight(0.0, -1.0) == 1.0  # φ(1) = 1 on both sides
    assert metrics["clipfrac_low"] == metrics["clipfrac_high"] == 0


def test_vespo_weight_matches_trl():
    """TRL exposes the Gamma weight as a static method; the loss around it is −φ·A·lp, Σ / tokens."""
    trainer = pytest.importorskip("trl.trainer.grpo_trainer")
    b, lp = with_lp(rollout(empty_rows=1, spread=0.4, seq_adv=True))
    mask = b[K.RESPONSE_MASK]
    m = mask.to(F64)
    lp0, old = torch.where(mask, lp, 0), masked(b, K.OLD_LOGPROBS)
    adv = b[K.ADVANTAGES][:, :1]
    phi = trainer.GRPOTrainer.get_gamma_weights(advantages=adv, log_ratio_per_token=lp0 - old, mask=m,
                                                importance_sampling_ratio=None)
    trl = (-phi * adv * lp0 * m).sum() / m.sum()
    ours, _ = vespo_loss(b)
    torch.testing.assert_close(ours, trl, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(*(torch.autograd.grad(x, lp)[0] for x in (ours, trl)), rtol=1e-10, atol=1e-14)


def test_trl_loss_types_golden_values():
    """One tiny case, by hand: ρ = e^{lp − old}; row 0 A = 1 on 3 tokens, row 1 A = −0.5 on 2."""
    b = TensorDict({K.LOGPROBS: torch.tensor([[-1.0, -0.5, -2.0], [-0.3, -1.2, 0.0]], dtype=F64),
                    K.OLD_LOGPROBS: torch.tensor([[-1.2, -0.4, -1.5], [-0.5, -1.0, 0.0]], dtype=F64),
                    K.ADVANTAGES: torch.tensor([[1.0] * 3, [-0.5] * 3], dtype=F64),
                    K.RESPONSE_MASK: torch.tensor([[True] * 3, [True, True, False]])}, [2])
    golden = {"bnpo": -0.3382602644259035, "luspo": -0.8127599785644213, "sapo": -0.47500557326370596,
              "vespo": 0.6956623757693806}
    lp = b[K.LOGPROBS]
    refs = {"bnpo": bnpo_reference(b, lp, micro=2), "luspo": luspo_reference(b, lp), "sapo": sapo_reference(b, lp),
            "vespo": vespo_reference(b, lp)}
    for name, value in golden.items():
        got = POLICY_LOSSES[name](b)[0]
        assert got.item() == pytest.approx(value, rel=1e-12, abs=1e-15), name
        assert float(refs[name]) == pytest.approx(value, rel=1e-12), name
    # bnpo by hand (A > 0 clips ρ = e^{0.2} to 1.2; A < 0 keeps max(ρ, clip ρ) = ρ), over 5 tokens
    by_hand = (-(1.2 + math.exp(-0.1) + math.exp(-0.5)) + 0.5 * (math.exp(0.2) + math.exp(-0.2))) / 5
    assert golden["bnpo"] == pytest.approx(by_hand, rel=1e-12)


def test_soft_surrogates_refuse_bad_hyper():
    b = rollout()
    with pytest.raises(ValueError, match="clip_ratio_c"):
        sapo_loss(b, clip_ratio_c=3.0)
    with pytest.raises(ValueError, match=r"temperature_neg: expected a finite number > 0, got 0.0"):
        sapo_loss(b, sapo_temperature_neg=0.0)
    with pytest.raises(ValueError, match=r"lambda_pos: expected a finite number > 0, got -1.0"):
        vespo_loss(b, vespo_lambda_pos=-1.0)


@pytest.mark.parametrize("name", ["vanilla", "dapo", "reinforce_pp", "remax", "grpo", "bnpo", "sapo", "vespo", "luspo"])
def test_single_update_is_reinforce(name):
    """ratio 1 (old = lp): ∂loss/∂lp = −A·(agg weights), the REINFORCE gradient."""
    b, lp = with_lp(rollout())
    b = b.copy().update({K.OLD_LOGPROBS: lp.detach().clone()})
    mask = b[K.RESPONSE_MASK]
    n = mask.sum(-1, keepdim=True).to(F64)
    weight = {"seq_mean_token_mean": 1 / (n.clamp(min=1) * (n > 0).sum()), "token_mean": 1 / n.sum(),
              "local_token_mean": 1 / n.sum(), "seq_mean_token_sum": 1 / (n > 0).sum().to(F64)}[
        POLICY_LOSSES[name].keywords.get("agg", "token_mean") if name != "vanilla" else "token_mean"]
    grad = torch.autograd.grad(POLICY_LOSSES[name](b)[0], lp)[0]
    torch.testing.assert_close(grad, torch.where(mask, -b[K.ADVANTAGES] * weight, 0), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_bf16_follows_float64(name):
    fn = functools.partial(POLICY_LOSSES[name], kl_coef=0.1, max_length=8)
    b64 = rollout(spread=0.1, seq_adv=True)
    b16 = b64.apply(lambda x: x.to(torch.bfloat16) if x.is_floating_point() else x)
    loss16, loss64 = fn(b16)[0], fn(b64)[0]
    assert loss16.dtype == torch.bfloat16
    torch.testing.assert_close(loss16.to(F64), loss64, rtol=3e-2, atol=3e-2)


def test_missing_key_and_bad_hyper():
    b = rollout()
    with pytest.raises(KeyError, match=r"'old_logprobs' \[B, R\]"):
        grpo_loss(b.exclude(K.OLD_LOGPROBS))
    with pytest.raises(KeyError, match=r"'ref_logprobs' \[B, R\]"):
        grpo_loss(b.exclude(K.REF_LOGPROBS), kl_coef=0.04)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        dapo_loss(b, clip_ratio_c=0.9)


def test_doctests():
    result = doctest.testmod(pg, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


# --- the conformance suite itself must be able to fail --------------------------------------------
def _broken(kind):
    def loss_fn(batch):
        loss, metrics = policy_loss(batch)
        if kind == "metric_with_grad":
            metrics = metrics.copy().set("leaky", loss)
        elif kind == "parts_do_not_sum":
            metrics = metrics.copy().set("loss_extra", torch.ones((), dtype=loss.dtype))
        elif kind == "reads_padding":
            loss = loss + (batch[K.LOGPROBS] * 0).sum()
        elif kind == "writes_input":
            batch.set("scratch", torch.zeros(batch.batch_size))
        elif kind == "casts_dtype":
            loss = loss.float()
        elif kind == "not_a_scalar":
            loss = loss.expand(2)
        return loss, metrics
    return loss_fn


@pytest.mark.parametrize("kind", ["metric_with_grad", "parts_do_not_sum", "reads_padding", "writes_input",
                                  "casts_dtype", "not_a_scalar"])
def test_conformance_suite_catches(kind):
    with pytest.raises(AssertionError):
        check_loss_conformance(_broken(kind), rollout(4, 5), compile_backend=None)


def test_conformance_suite_takes_nested_preference_batches():
    """Other engineers reuse the suite on preference pairs: nested keys, one mask per side."""
    def toy_pair_loss(batch):  # per-token log-probs summed under each side's loss_mask
        side = {s: masked_sum(batch[s, "token_logps"], batch[s, K.LOSS_MASK], dim=-1) for s in (K.CHOSEN, K.REJECTED)}
        loss = -torch.nn.functional.logsigmoid(side[K.CHOSEN] - side[K.REJECTED]).mean()
        return loss, TensorDict({"loss_pair": loss.detach()}, batch_size=[])

    b = make_preference_batch(3, 6, dtype=F64)
    g = torch.Generator().manual_seed(0)
    for s in (K.CHOSEN, K.REJECTED):
        b[s, "token_logps"] = -torch.rand(3, 6, generator=g, dtype=F64)
    check_loss_conformance(toy_pair_loss, b, mask_key=[(K.CHOSEN, K.LOSS_MASK), (K.REJECTED, K.LOSS_MASK)],
                           grad_keys=[(K.CHOSEN, "token_logps"), (K.REJECTED, "token_logps")], compile_backend=None)
