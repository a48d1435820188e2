"""Tests for rlcore.rewards: per-token rewards, score processing, the TensorDict adapter."""

from __future__ import annotations

import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore import keys as K
from rlcore.kl import KL_ESTIMATORS
from rlcore.rewards import compute_rewards, last_token_mask, process_scores, with_rewards
from rlcore.testing import assert_padding_invariant, assert_pure, make_rollout, right_padded_mask
from rlcore.transforms import running_moments_init, running_moments_update

GAPPED = torch.tensor([
    [True, True, True, False, False, False],     # right padded
    [False, False, True, True, True, True],      # left padded
    [True, False, True, True, False, False],     # gap inside
    [False, True, False, False, True, False],    # two islands
    [False, False, False, False, False, False],  # empty
    [True, True, True, True, True, True],        # full
])


def _inputs(B=6, T=6, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    ref = lp + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    score = torch.randn(B, generator=g, dtype=torch.float64)
    return score.to(dtype), lp.to(dtype), ref.to(dtype)


def _loop_rewards(score, lp, ref, mask, kl_coef, kind, clamp=None):
    """Plain reference: scan each row for its last valid token."""
    B, T = lp.shape
    rewards, kls = torch.zeros(B, T, dtype=torch.float64), torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        last = -1
        for t in range(T):
            if mask[b, t]:
                last = t
        for t in range(T):
            if mask[b, t]:
                d = float(lp[b, t]) - float(ref[b, t])
                if clamp is not None:
                    d = min(max(d, -clamp), clamp)
                kl = {"k1": d, "abs": abs(d), "k2": 0.5 * d * d, "k3": math.exp(-d) + d - 1}[kind]
                kls[b, t] = kl
                rewards[b, t] = -kl_coef * kl + (float(score[b]) if t == last else 0.0)
    return rewards, kls


def _trl_legacy_compute_rewards(scores, logprobs, ref_logprobs, masks, kl_coef, kl_penalty):
    """TRL's legacy PPO ``compute_rewards`` (v0.11), written out plainly (no longer shipped)."""
    def kl_pen(lp, ref):
        if kl_penalty == "kl":
            return lp - ref
        if kl_penalty == "abs":
            return (lp - ref).abs()
        if kl_penalty == "mse":
            return 0.5 * (lp - ref).square()
        raise NotImplementedError(kl_penalty)

    rewards, non_score_rewards, kls = [], [], []
    for score, logprob, ref_logprob, mask in zip(scores, logprobs, ref_logprobs, masks):
        kl = kl_pen(logprob, ref_logprob)
        kls.append(kl)
        non_score_reward = -kl_coef * kl
        non_score_rewards.append(non_score_reward)
        reward = non_score_reward.clone()
        last_non_masked_index = mask.nonzero()[-1]
        reward[last_non_masked_index] += score
        rewards.append(reward)
    return torch.stack(rewards), torch.stack(non_score_rewards), torch.stack(kls)


# --- compute_rewards ------------------------------------------------------------------------
@pytest.mark.parametrize("kind", list(KL_ESTIMATORS))
@pytest.mark.parametrize("clamp", [None, 0.2])
def test_compute_rewards_matches_plain_loop(kind, clamp):
    score, lp, ref = _inputs()
    rewards, kl = compute_rewards(score, lp, ref, GAPPED, kl_coef=0.15, kl=kind, clamp=clamp)
    want_r, want_kl = _loop_rewards(score, lp, ref, GAPPED, 0.15, kind, clamp)
    torch.testing.assert_close(rewards, want_r, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(kl, want_kl, rtol=1e-12, atol=1e-12)
    assert (rewards[4] == 0).all()  # empty row: the score has nowhere to go


def test_compute_rewards_golden():
    mask = torch.tensor([[True, True, False], [False, True, True], [False, False, False]])
    lp = torch.tensor([[-1.0, -2.0, 5.0], [0.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
    ref = torch.tensor([[-1.5, -1.0, 0.0], [0.0, -2.0, -0.5], [0.0, 0.0, 0.0]])
    score = torch.tensor([1.0, -2.0, 7.0])
    rewards, kl = compute_rewards(score, lp, ref, mask, kl_coef=0.1)
    # row 0: kl [0.5, −1.0], −0.1·kl = [−0.05, 0.1], +1 on t=1;  row 1: kl [·, 1.0, −0.5] → [0, −0.1, 0.05 − 2]
    torch.testing.assert_close(rewards, torch.tensor([[-0.05, 1.1, 0.0], [0.0, -0.1, -1.95], [0.0, 0.0, 0.0]]))
    torch.testing.assert_close(kl, torch.tensor([[0.5, -1.0, 0.0], [0.0, 1.0, -0.5], [0.0, 0.0, 0.0]]))


@pytest.mark.parametrize("trl_name,kind", [("kl", "k1"), ("abs", "abs"), ("mse", "k2")])
def test_parity_with_trl_legacy_formula(trl_name, kind):
    lengths = torch.tensor([3, 6, 1, 4, 5])
    mask = right_padded_mask(lengths, 6)
    score, lp, ref = _inputs(B=5)
    rewards, kl = compute_rewards(score, lp, ref, mask, kl_coef=0.2, kl=trl_name)
    trl_rewards, _, trl_kl = _trl_legacy_compute_rewards(score, lp, ref, mask, 0.2, trl_name)
    # TRL leaves −β·kl at padded positions (its GAE multiplies by the mask later)
    torch.testing.assert_close(rewards, trl_rewards * mask, rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(kl, trl_kl * mask, rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(compute_rewards(score, lp, ref, mask, kl=kind)[0], rewards)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.lists(st.booleans(), min_size=5, max_size=5), min_size=1, max_size=6))
def test_last_token_mask_property(rows):
    mask = torch.tensor(rows)
    last = last_token_mask(mask)
    for b, row in enumerate(rows):
        idx = [t for t, m in enumerate(row) if m]
        want = [False] * 5
        if idx:
            want[idx[-1]] = True
        assert last[b].tolist() == want


def test_kl_coef_tensor_and_dtypes():
    score, lp, ref = _inputs(dtype=torch.float32)
    r_float, _ = compute_rewards(score, lp, ref, GAPPED, kl_coef=0.3)
    r_tensor, kl = compute_rewards(score, lp, ref, GAPPED, kl_coef=torch.tensor(0.3, dtype=torch.float64))
    assert r_tensor.dtype == kl.dtype == torch.float32
    torch.testing.assert_close(r_tensor, r_float)
    s64, lp64, ref64 = _inputs()
    torch.testing.assert_close(r_float.double(), compute_rewards(s64, lp64, ref64, GAPPED, kl_coef=0.3)[0],
                               rtol=1e-5, atol=1e-6)
    r_bf16, _ = compute_rewards(score.bfloat16(), lp.bfloat16(), ref.bfloat16(), GAPPED, kl_coef=0.3)
    assert r_bf16.dtype == torch.bfloat16
    torch.testing.assert_close(r_bf16.double(), r_float.double(), rtol=2e-2, atol=2e-2)


def test_rewards_are_detached():
    score, lp, ref = _inputs()
    score, lp, ref = (x.clone().requires_grad_(True) for x in (score, lp, ref))
    coef = torch.tensor(0.2, requires_grad=True)
    rewards, kl = compute_rewards(score, lp, ref, GAPPED, kl_coef=coef, kl="k3")
    assert not rewards.requires_grad and not kl.requires_grad


def test_compute_rewards_nan_padding_never_leaks():
    score, lp, ref = _inputs()
    lp = torch.where(GAPPED, lp, torch.nan)
    ref = torch.where(GAPPED, ref, torch.inf)
    score = torch.where(GAPPED.any(-1), score, torch.nan)  # the empty row's score is garbage
    for kind in KL_ESTIMATORS:
        rewards, kl = compute_rewards(score, lp, ref, GAPPED, kl=kind)
        assert torch.isfinite(rewards).all() and torch.isfinite(kl).all()


def test_leading_dims():
    score, lp, ref = _inputs(B=6)
    r2, kl2 = compute_rewards(score, lp, ref, GAPPED)
    r3, kl3 = compute_rewards(score.view(2, 3), lp.view(2, 3, 6), ref.view(2, 3, 6), GAPPED.view(2, 3, 6))
    assert r3.shape == kl3.shape == (2, 3, 6)
    torch.testing.assert_close(r3.view(6, 6), r2, rtol=0, atol=0)
    torch.testing.assert_close(kl3.view(6, 6), kl2, rtol=0, atol=0)


# --- with_rewards ---------------------------------------------------------------------------
def test_with_rewards_reads_old_logprobs_and_adds_keys():
    batch = make_rollout(6, 7, empty_rows=1)
    out = with_rewards(batch, kl_coef=0.1, kl="k3")
    assert set(out.keys()) == set(batch.keys()) | {K.REWARDS, K.KL} and K.KL == "kl"
    want_r, want_kl = compute_rewards(batch[K.SCORE], batch[K.OLD_LOGPROBS], batch[K.REF_LOGPROBS],
                                      batch[K.RESPONSE_MASK], kl_coef=0.1, kl="k3")
    torch.testing.assert_close(out[K.REWARDS], want_r, rtol=0, atol=0)
    torch.testing.assert_close(out[K.KL], want_kl, rtol=0, atol=0)
    other = batch.copy().update({K.LOGPROBS: batch[K.LOGPROBS] + 1.0})
    torch.testing.assert_close(with_rewards(other, kl_coef=0.1, kl="k3")[K.REWARDS], want_r, rtol=0, atol=0)
    assert not torch.equal(out[K.REWARDS], batch[K.REWARDS])  # the input's rewards are replaced in the copy


def test_with_rewards_missing_key():
    batch = make_rollout(3, 4).exclude(K.SCORE)
    with pytest.raises(KeyError, match=r"with_rewards: batch is missing 'score' \[B\]"):
        with_rewards(batch)


@pytest.mark.parametrize("fill", [None, float("nan")])
def test_padding_invariant(fill):
    batch = make_rollout(6, 7, empty_rows=2)
    assert_padding_invariant(lambda td: with_rewards(td, kl_coef=0.05, kl="k3"), batch, fill=fill)
    assert_padding_invariant(lambda td: with_rewards(td, kl_coef=0.05, kl="k1"), batch, fill=fill)


def test_pure():
    score, lp, ref = _inputs()
    assert_pure(compute_rewards, score, lp, ref, GAPPED, kl_coef=torch.tensor(0.1), kl="k2", clamp=1.0)
    assert_pure(last_token_mask, GAPPED)
    assert_pure(with_rewards, make_rollout(4, 5), kl_coef=0.2)
    mom = running_moments_update(running_moments_init(), score)
    assert_pure(process_scores, score, mom, normalize=True, clip=1.0)


def test_bad_inputs():
    score, lp, ref = _inputs()
    with pytest.raises(ValueError, match=r"score: expected shape \[6\].*got \[6, 1\]"):
        compute_rewards(score[:, None], lp, ref, GAPPED)
    with pytest.raises(TypeError, match=r"mask: expected a torch.bool mask, got dtype torch.float32"):
        compute_rewards(score, lp, ref, GAPPED.float())
    with pytest.raises(ValueError, match=r"mask: expected shape \[6, 6\].*got \[6, 5\]"):
        compute_rewards(score, lp, ref, GAPPED[:, :5])
    with pytest.raises(ValueError, match=r"ref_logprobs: expected shape \[6, 6\].*got \[6, 5\]"):
        compute_rewards(score, lp, ref[:, :5], GAPPED)
    with pytest.raises(ValueError, match=r"unknown KL estimator 'full'"):
        compute_rewards(score, lp, ref, GAPPED, kl="full")
    with pytest.raises(TypeError, match=r"score: expected a floating-point tensor"):
        compute_rewards(torch.ones(6, dtype=torch.long), lp, ref, GAPPED)


@pytest.mark.parametrize("coef,shape", [(torch.full((6,), 0.1), "[6]"), (torch.full((6, 1), 0.1), "[6, 1]"),
                                         (torch.full((1, 6), 0.1), "[1, 6]"), (torch.full((1,), 0.1), "[1]")])
def test_kl_coef_of_another_shape_is_refused(coef, shape):
    """A [T] (or [B, 1], ...) β broadcast silently: one coefficient per token or per row."""
    score, lp, ref = _inputs()
    with pytest.raises(ValueError, match=rf"^kl_coef: expected a float or a 0-d tensor, got a tensor of shape {re.escape(shape)}"):
        compute_rewards(score, lp, ref, GAPPED, kl_coef=coef)


@pytest.mark.parametrize("coef", [float("nan"), -0.1, float("inf"), torch.tensor(float("nan")), torch.tensor(-0.1),
                                  torch.tensor(float("inf"), dtype=torch.float64), True, "0.1"])
def test_kl_coef_out_of_range_is_refused(coef):
    """A NaN β made every reward NaN; a negative one rewards drifting from the reference."""
    score, lp, ref = _inputs()
    with pytest.raises(ValueError, match=r"^kl_coef: expected a finite number >= 0, got "):
        compute_rewards(score, lp, ref, GAPPED, kl_coef=coef)
    with pytest.raises(ValueError, match=r"^kl_coef: "):
        with_rewards(make_rollout(2, 3), kl_coef=coef)


def test_kl_coef_tensor_must_be_float_and_clamp_positive():
    score, lp, ref = _inputs()
    with pytest.raises(TypeError, match=r"^kl_coef: expected a floating-point tensor, got dtype torch.int64"):
        compute_rewards(score, lp, ref, GAPPED, kl_coef=torch.tensor(1))
    for clamp in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match=r"^clamp: expected a number \(inf allowed\) > 0, got "):
            compute_rewards(score, lp, ref, GAPPED, clamp=clamp)
    zero, _ = compute_rewards(score, lp, ref, GAPPED, kl_coef=0)  # 0 and an int are a valid β
    torch.testing.assert_close(zero, compute_rewards(score, lp, ref, GAPPED, kl_coef=torch.tensor(0.0))[0])


def test_compile():
    score, lp, ref = _inputs(dtype=torch.float32)
    fn = torch.compile(lambda s, a, b, m, c: compute_rewards(s, a, b, m, kl_coef=c, kl="k3"),
                       fullgraph=True, backend="eager")
    got = fn(score, lp, ref, GAPPED, torch.tensor(0.2))
    want = compute_rewards(score, lp, ref, GAPPED, kl_coef=0.2, kl="k3")
    torch.testing.assert_close(got, want)


# --- process_scores -------------------------------------------------------------------------
def test_process_scores_golden():
    s = torch.tensor([1.0, 3.0])
    mom = running_moments_update(running_moments_init(), s)  # mean 2, unbiased std √2
    r2 = math.sqrt(2.0)
    torch.testing.assert_close(process_scores(s, mom), s)
    torch.testing.assert_close(process_scores(s, mom, scale=True), torch.tensor([1 / r2, 3 / r2]))
    torch.testing.assert_close(process_scores(s, mom, normalize=True), torch.tensor([-1 / r2, 1 / r2]))
    torch.testing.assert_close(process_scores(s, mom, scale=True, normalize=True), torch.tensor([-1 / r2, 1 / r2]))
    torch.testing.assert_close(process_scores(s, mom, scale=True, clip=1.0), torch.tensor([1 / r2, 1.0]))
    torch.testing.assert_close(process_scores(s * 10, mom, clip=5.0), torch.tensor([5.0, 5.0]))
    # with history: values seen {0, 4, 1, 3}: mean 2, unbiased var 10/3
    mom = running_moments_update(running_moments_update(running_moments_init(), torch.tensor([0.0, 4.0])), s)
    sd = math.sqrt(10 / 3)
    torch.testing.assert_close(process_scores(s, mom, normalize=True), torch.tensor([-1 / sd, 1 / sd]))
    # one value seen: σ taken as 1
    one = running_moments_update(running_moments_init(), torch.tensor([5.0]))
    torch.testing.assert_close(process_scores(torch.tensor([5.0]), one, normalize=True), torch.tensor([0.0]))
    torch.testing.assert_close(process_scores(torch.tensor([5.0]), one, scale=True), torch.tensor([5.0]))


def _trl_legacy_score_steps(batches, norm):
    """TRL's legacy PPO step: RunningMoments.update, then scale (and normalise) — written out."""
    mean, var, count = 0.0, 1.0, 1e-24
    out = []
    for xs in batches:
        xs_count = xs.numel()
        xs_var, xs_mean = torch.var_mean(xs.double(), unbiased=False)
        delta = float(xs_mean) - mean
        tot_count = count + xs_count
        new_sum = float(xs_var) * xs_count
        old_sum = var * count + delta**2 * count * xs_count / tot_count
        mean += delta * xs_count / tot_count
        var = (old_sum + new_sum) / tot_count
        std = math.sqrt(var * tot_count / (tot_count - 1))
        count = tot_count
        factor = std + torch.finfo(xs.dtype).eps
        out.append((xs - mean) / factor if norm else xs / factor)
    return out


@pytest.mark.parametrize("norm", [False, True])
def test_process_scores_trl_order_parity(norm):
    g = torch.Generator().manual_seed(5)
    batches = [torch.randn(n, generator=g) * 3 + 1 for n in (4, 2, 7, 3)]
    want = _trl_legacy_score_steps(batches, norm)
    mom = running_moments_init()
    eps = torch.finfo(torch.float32).eps
    for xs, w in zip(batches, want):
        mom = running_moments_update(mom, xs)
        got = process_scores(xs, mom, scale=True, normalize=norm, eps=eps)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, w.float(), rtol=1e-5, atol=1e-6)


def test_process_scores_bf16():
    s = torch.tensor([1.0, 3.0, -2.0]).bfloat16()
    mom = running_moments_update(running_moments_init(), s)
    out = process_scores(s, mom, normalize=True)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), process_scores(s.float(), mom, normalize=True), rtol=1e-2, atol=1e-2)


def test_zero_length_responses():
    mask = torch.zeros(3, 0, dtype=torch.bool)
    rewards, kl = compute_rewards(torch.ones(3), torch.zeros(3, 0), torch.zeros(3, 0), mask)
    assert rewards.shape == kl.shape == (3, 0)


def test_a_kl_tensor_is_the_penalty_itself():
    """kl given as values (TRL's kl_penalty="full": the exact KL over the vocabulary) replaces the estimator."""
    batch = make_rollout(5, 6, empty_rows=1)
    mask = batch[K.RESPONSE_MASK]
    values = torch.rand(mask.shape, dtype=batch[K.OLD_LOGPROBS].dtype, generator=torch.Generator().manual_seed(0))
    rewards, per_token = assert_pure(compute_rewards, batch[K.SCORE], batch[K.OLD_LOGPROBS], batch[K.REF_LOGPROBS],
                                     mask, kl_coef=0.4, kl=values)
    last = last_token_mask(mask)
    # the formula in float64, rounded once to the inputs' dtype (as compute_rewards computes it)
    want = torch.where(mask, -0.4 * values.double() + torch.where(last, batch[K.SCORE].double()[:, None], 0.0), 0.0)
    torch.testing.assert_close(rewards, want.to(values.dtype), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(per_token, torch.where(mask, values, 0.0), rtol=0, atol=0)
    out = with_rewards(batch.copy().update({K.FULL_KL: values}), kl_coef=0.4, kl="full")
    torch.testing.assert_close(out[K.REWARDS], rewards, rtol=0, atol=0)
    with pytest.raises(KeyError, match=r"with_rewards\(kl='full'\): batch is missing 'full_kl' \[B, R\]"):
        with_rewards(batch, kl="full")
    with pytest.raises(ValueError, match=r"kl"):
        compute_rewards(batch[K.SCORE], batch[K.OLD_LOGPROBS], batch[K.REF_LOGPROBS], mask, kl=values[:, :-1])


# --- soft overlong punishment (DAPO) -------------------------------------------------------------------
def _overlong_loop(lengths, max_length, buffer, factor):
    """The piecewise formula of the DAPO paper, one response at a time."""
    out = []
    for n in lengths:
        if n <= max_length - buffer:
            out.append(0.0)
        elif n <= max_length:
            out.append(factor * ((max_length - buffer) - n) / buffer)
        else:
            out.append(-factor)
    return out


@given(st.lists(st.integers(0, 12), min_size=1, max_size=8), st.integers(1, 10), st.data(),
       st.sampled_from([0.0, 0.5, 1.0, 3.0]))
def test_soft_overlong_penalty_is_the_piecewise_formula(lengths, max_length, data, factor):
    from rlcore.rewards import soft_overlong_penalty
    buffer = data.draw(st.integers(1, max_length))
    width = max(lengths)
    mask = torch.tensor([[t < n for t in range(width)] for n in lengths], dtype=torch.bool).reshape(len(lengths), width)
    got = soft_overlong_penalty(mask, max_length=max_length, buffer=buffer, factor=factor)
    assert got.dtype == torch.float32 and got.shape == (len(lengths),)
    assert got.tolist() == pytest.approx(_overlong_loop(lengths, max_length, buffer, factor), abs=1e-6)


def test_soft_overlong_penalty_refuses_bad_settings():
    from rlcore.rewards import soft_overlong_penalty
    mask = torch.ones(2, 3, dtype=torch.bool)
    for kwargs, message in ((dict(max_length=0, buffer=1), "max_length: expected an int >= 1, got 0"),
                            (dict(max_length=4, buffer=5), "buffer: expected at most max_length=4, got 5"),
                            (dict(max_length=4, buffer=0), "buffer: expected an int >= 1, got 0"),
                            (dict(max_length=4, buffer=2, factor=-1.0), "factor: expected a finite float >= 0"),
                            (dict(max_length=4, buffer=2, factor=float("nan")), "factor: expected a finite float")):
        with pytest.raises(ValueError, match=message):
            soft_overlong_penalty(mask, **kwargs)
    with pytest.raises((TypeError, ValueError), match="response_mask"):
        soft_overlong_penalty(mask.float(), max_length=4, buffer=2)
