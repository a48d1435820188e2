"""Outcome advantage estimators against plain loops, golden values, identities and properties."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from rlcore import keys as K
from rlcore.baselines import (ADVANTAGE_ESTIMATORS, GRPO_SCALES, broadcast_to_tokens, dr_grpo_advantage, group_mean,
                              grpo_advantage, opo_advantage, with_opo_advantage, reinforce_pp_advantage,
                              reinforce_pp_baseline_advantage, remax_advantage, rloo_advantage, with_dr_grpo_advantage,
                              with_grpo_advantage, with_reinforce_pp_advantage, with_remax_advantage,
                              with_rloo_advantage)
from rlcore.masked import masked_mean, masked_sum, masked_var
from rlcore.returns import discounted_returns
from rlcore.testing import assert_padding_invariant, assert_pure, make_rollout, right_padded_mask
from tests.reference.returns import (discounted_returns_reference, grpo_reference, reinforce_pp_reference,
                                     remax_reference, rloo_reference)

NAN = float("nan")


def flat_groups(seed=0, n=23, n_labels=7):
    """Flat scores with shuffled, non-contiguous labels: groups of mixed sizes, singletons included."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.tensor([3, 100, -5, 42, 7, 8, 1000])[:n_labels]
    group_id = labels[torch.randint(0, n_labels, (n,), generator=g)]
    group_id[-1] = 12345  # a singleton
    return torch.randn(n, generator=g, dtype=torch.float64), group_id


def rollout(B=8, R=6, G=4, seed=0, dtype=torch.float64, empty_rows=1):
    return make_rollout(B, R, group_size=G, empty_rows=empty_rows, dtype=dtype,
                        generator=torch.Generator().manual_seed(seed))


def ids_of(P, G):
    return torch.arange(P).repeat_interleave(G)


# --- RLOO ------------------------------------------------------------------------------------
def test_rloo_matches_reference_loop():
    s, gid = flat_groups(1)
    torch.testing.assert_close(rloo_advantage(s, group_id=gid), rloo_reference(s, gid), rtol=1e-12, atol=1e-12)


def test_rloo_golden_values():
    # mean 3; others' means: (2+6)/2 = 4, (1+6)/2 = 3.5, (1+2)/2 = 1.5
    out = rloo_advantage(torch.tensor([[1.0, 2.0, 6.0]]))
    torch.testing.assert_close(out, torch.tensor([[-3.0, -1.5, 4.5]]))


def test_rloo_is_scaled_group_centring():
    s = torch.randn(5, 4, dtype=torch.float64)
    torch.testing.assert_close(rloo_advantage(s), 4 / 3 * (s - s.mean(-1, keepdim=True)), rtol=1e-12, atol=1e-12)


@settings(max_examples=40, deadline=None)
@given(P=st.integers(1, 6), G=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_rloo_sums_to_zero_per_group_and_forms_agree(P, G, seed):
    s = torch.randn(P, G, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    grouped = rloo_advantage(s)
    torch.testing.assert_close(grouped.sum(-1), torch.zeros(P, dtype=torch.float64), rtol=0, atol=1e-12)
    perm = torch.randperm(P * G, generator=torch.Generator().manual_seed(seed))
    flat = rloo_advantage(s.reshape(-1)[perm], group_id=ids_of(P, G)[perm])
    torch.testing.assert_close(flat, grouped.reshape(-1)[perm], rtol=1e-12, atol=1e-12)


# --- GRPO ------------------------------------------------------------------------------------
@pytest.mark.parametrize("scale", sorted(GRPO_SCALES))
@pytest.mark.parametrize("eps", [1e-6, 0.1])
def test_grpo_matches_reference_loop(scale, eps):
    s, gid = flat_groups(2)
    torch.testing.assert_close(grpo_advantage(s, group_id=gid, scale=scale, eps=eps),
                               grpo_reference(s, gid, scale=scale, eps=eps), rtol=1e-12, atol=1e-12)


def test_grpo_golden_values():
    # mean 2, unbiased σ = sqrt(((1-2)² + (3-2)²)/1) = sqrt(2)
    out = grpo_advantage(torch.tensor([[1.0, 3.0], [5.0, 5.0]]), eps=0.0)
    torch.testing.assert_close(out, torch.tensor([[-2 ** -0.5, 2 ** -0.5], [0.0, 0.0]]))
    # batch σ over [1, 3, 5, 5]: mean 3.5, Σ(x-μ)² = 6.25 + 0.25 + 2.25 + 2.25 = 11, var = 11/3
    out = grpo_advantage(torch.tensor([[1.0, 3.0], [5.0, 5.0]]), scale="batch", eps=0.0)
    torch.testing.assert_close(out, torch.tensor([[-1.0, 1.0], [0.0, 0.0]]) / (11 / 3) ** 0.5)


def test_dr_grpo_is_group_centring():
    s = torch.randn(6, 5, dtype=torch.float64)
    centred = s - s.mean(-1, keepdim=True)
    torch.testing.assert_close(dr_grpo_advantage(s), centred, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grpo_advantage(s, scale="none"), centred, rtol=1e-12, atol=1e-12)
    # and RLOO is Dr. GRPO scaled by G / (G - 1)
    torch.testing.assert_close(rloo_advantage(s), dr_grpo_advantage(s) * 5 / 4, rtol=1e-12, atol=1e-12)


@settings(max_examples=30, deadline=None)
@given(P=st.integers(1, 5), G=st.integers(1, 6), seed=st.integers(0, 2**16),
       scale=st.sampled_from(sorted(GRPO_SCALES)))
def test_grpo_grouped_view_and_group_id_agree(P, G, seed, scale):
    s = torch.randn(P, G, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    perm = torch.randperm(P * G, generator=torch.Generator().manual_seed(seed + 1))
    flat = grpo_advantage(s.reshape(-1)[perm], group_id=ids_of(P, G)[perm], scale=scale)
    torch.testing.assert_close(flat, grpo_advantage(s, scale=scale).reshape(-1)[perm], rtol=1e-10, atol=1e-12)


def test_grpo_unknown_scale_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"scale: unknown 'std'.*\['batch', 'group', 'none'\]"):
        grpo_advantage(torch.zeros(2, 2), scale="std")
    for bad in (-0.5, float("nan"), float("inf")):  # σ + eps could be 0 or NaN
        with pytest.raises(ValueError, match=r"eps: expected a finite number >= 0"):
            grpo_advantage(torch.zeros(2, 2), eps=bad)


# --- OPO ---------------------------------------------------------------------------------------
def opo_reference(scores, lengths, group_id):
    """Written out: per group, b = Σ l·r / Σ l (the mean where Σ l = 0), A = r − b."""
    out = torch.zeros_like(scores)
    for g in group_id.unique():
        idx = (group_id == g).nonzero().flatten()
        r, l = scores[idx], lengths[idx]
        b = (l * r).sum() / l.sum() if l.sum() > 0 else r.mean()
        out[idx] = r - b
    return out


@pytest.mark.parametrize("seed", range(4))
def test_opo_matches_the_written_out_formula(seed):
    g = torch.Generator().manual_seed(seed)
    P, G = 3, 4
    scores = torch.randn(P * G, generator=g, dtype=torch.float64)
    lengths = torch.randint(0, 9, (P * G,), generator=g).double()
    lengths[:G] = 0  # a group of empty responses: the plain mean
    ids = ids_of(P, G)
    perm = torch.randperm(P * G, generator=g)
    flat = opo_advantage(scores[perm], lengths[perm], group_id=ids[perm])
    torch.testing.assert_close(flat, opo_reference(scores, lengths, ids)[perm], rtol=1e-12, atol=1e-12)
    grid = opo_advantage(scores.view(P, G), lengths.view(P, G))
    torch.testing.assert_close(grid.reshape(-1), opo_reference(scores, lengths, ids), rtol=1e-12, atol=1e-12)
    weighted = (grid * lengths.view(P, G)).sum(-1)  # the length-weighted advantages cancel in each group
    torch.testing.assert_close(weighted, torch.zeros(P, dtype=torch.float64), rtol=0, atol=1e-12)


def test_opo_golden_values_singletons_and_errors():
    torch.testing.assert_close(opo_advantage(torch.tensor([[1.0, 0.0]]), torch.tensor([[3.0, 1.0]])),
                               torch.tensor([[0.25, -0.75]]))
    equal = opo_advantage(torch.tensor([[1.0, 3.0]]), torch.tensor([[5.0, 5.0]]))  # equal lengths: group centring
    torch.testing.assert_close(equal, torch.tensor([[-1.0, 1.0]]))
    single = opo_advantage(torch.tensor([2.0, 5.0]), torch.tensor([4.0, 0.0]), group_id=torch.tensor([0, 1]))
    assert torch.equal(single, torch.zeros(2))  # a singleton is its own baseline
    with pytest.raises(ValueError, match="lengths"):
        opo_advantage(torch.zeros(2, 3), torch.zeros(2, 2))


def test_opo_adapter_weights_by_response_length():
    batch = rollout()
    mask = batch[K.RESPONSE_MASK]
    out = assert_pure(with_opo_advantage, batch)
    score = masked_sum(batch[K.REWARDS], mask, dim=-1)
    want = opo_reference(score, mask.sum(-1).to(score.dtype), batch[K.GROUP_ID])
    torch.testing.assert_close(out[K.ADVANTAGES], broadcast_to_tokens(want, mask), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out[K.RETURNS], out[K.ADVANTAGES], rtol=0, atol=0)
    assert ADVANTAGE_ESTIMATORS["opo"] is with_opo_advantage


# --- singleton groups, empty rows ------------------------------------------------------------
@pytest.mark.parametrize("fn", [rloo_advantage, grpo_advantage, dr_grpo_advantage,
                                lambda s, **kw: grpo_advantage(s, scale="batch", **kw)])
def test_singleton_groups_give_zero(fn):
    """Chosen behaviour: no baseline from a lone sample, so advantage 0 (not NaN, not the score)."""
    s = torch.tensor([[3.0], [-1.0]])
    assert (fn(s) == 0).all()
    flat, gid = torch.tensor([3.0, -1.0, 2.0, 4.0]), torch.tensor([0, 1, 2, 2])
    out = fn(flat, group_id=gid)
    assert out[0] == 0 and out[1] == 0 and torch.isfinite(out).all()


def test_int32_labels_and_bad_labels():
    s, gid = flat_groups(3)
    torch.testing.assert_close(rloo_advantage(s, group_id=gid.int()), rloo_advantage(s, group_id=gid))
    with pytest.raises(TypeError, match="group_id: expected an integer"):
        rloo_advantage(s, group_id=gid.double())
    with pytest.raises(ValueError, match=r"group_id: expected shape \[23\].*got \[22\]"):
        grpo_advantage(s, group_id=gid[:-1])
    with pytest.raises(ValueError, match=r"scores: expected a 1-d tensor"):
        rloo_advantage(s.reshape(1, -1), group_id=gid)
    with pytest.raises(TypeError, match="scores: expected a floating-point"):
        rloo_advantage(torch.ones(2, 2, dtype=torch.long))


def test_group_mean():
    torch.testing.assert_close(group_mean(torch.tensor([1.0, 2.0, 5.0]), group_id=torch.tensor([7, 3, 7])),
                               torch.tensor([3.0, 2.0, 3.0]))
    torch.testing.assert_close(group_mean(torch.tensor([[1.0, 3.0]])), torch.tensor([[2.0, 2.0]]))


# --- REINFORCE++ and ReMax -------------------------------------------------------------------
def token_case(B=6, T=8, seed=0, G=3):
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(B, T, generator=g, dtype=torch.float64)
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    lengths[0] = T
    mask = right_padded_mask(lengths, T) & (torch.rand(B, T, generator=g) < 0.8)
    return torch.where(mask, r, torch.tensor(NAN, dtype=torch.float64)), mask, ids_of(B // G, G)


def clean(x, mask):
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype))


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_pp_matches_reference(gamma):
    r, mask, gid = token_case(seed=1)
    torch.testing.assert_close(reinforce_pp_advantage(r, mask, gamma=gamma),
                               reinforce_pp_reference(clean(r, mask), mask, gamma=gamma), rtol=1e-10, atol=1e-10)
    out = reinforce_pp_advantage(r, mask, gamma=gamma, group_id=gid, group_baseline=True)
    torch.testing.assert_close(out, reinforce_pp_reference(clean(r, mask), mask, gamma=gamma, group_id=gid),
                               rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(reinforce_pp_baseline_advantage(r, mask, gamma=gamma, group_id=gid), out)
    # the grouped view [P, G, T] agrees with group_id
    grouped = reinforce_pp_advantage(r.reshape(2, 3, -1), mask.reshape(2, 3, -1), gamma=gamma, group_baseline=True)
    torch.testing.assert_close(grouped.reshape(6, -1), out, rtol=1e-12, atol=1e-12)


def test_reinforce_pp_baseline_with_outcome_reward_is_whitened_centred_score():
    """Reward on the last valid token, γ = 1: every token's return is the score, so the advantage is
    whiten(broadcast(s − mean_group(s))), verl's REINFORCE++-baseline."""
    B, T, G = 6, 7, 3
    lengths = torch.tensor([7, 1, 4, 3, 7, 2])
    mask = right_padded_mask(lengths, T)
    score = torch.randn(B, dtype=torch.float64)
    rewards = torch.where(torch.arange(T) == (lengths - 1)[:, None], score[:, None], torch.zeros(()))
    rewards = rewards.to(torch.float64)
    out = reinforce_pp_advantage(rewards, mask, group_id=ids_of(2, G), group_baseline=True)
    centred = score - score.view(2, G).mean(-1).repeat_interleave(G)
    expected = broadcast_to_tokens(centred, mask)
    mu, var = masked_mean(expected, mask), masked_var(expected, mask)
    torch.testing.assert_close(out, clean((expected - mu) / torch.sqrt(var + 1e-8), mask), rtol=1e-10, atol=1e-10)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), gamma=st.floats(0.0, 1.0), baseline=st.booleans())
def test_reinforce_pp_is_whitened_over_the_mask(seed, gamma, baseline):
    r, mask, gid = token_case(seed=seed)
    out = reinforce_pp_advantage(r, mask, gamma=gamma, group_id=gid, group_baseline=baseline)
    assert masked_mean(out, mask).abs() < 1e-9
    var = masked_var(out, mask)
    assert (var - 1).abs() < 1e-5 or var < 1e-5  # all returns equal: whitening gives 0
    assert (out[~mask] == 0).all()


def test_remax_matches_reference_and_golden():
    r, mask, _ = token_case(seed=2)
    b = torch.randn(6, dtype=torch.float64)
    torch.testing.assert_close(remax_advantage(r, b, mask), remax_reference(clean(r, mask), b, mask),
                               rtol=1e-12, atol=1e-12)
    out = remax_advantage(torch.tensor([[0.0, 1.0, 2.0]]), torch.tensor([0.5]), torch.tensor([[True, True, False]]))
    torch.testing.assert_close(out, torch.tensor([[0.5, 0.5, 0.0]]))
    torch.testing.assert_close(discounted_returns(clean(r, mask), mask), discounted_returns_reference(
        clean(r, mask), mask))


def test_broadcast_to_tokens():
    out = broadcast_to_tokens(torch.tensor([2.0, -1.0]), torch.tensor([[True, False], [True, True]]))
    torch.testing.assert_close(out, torch.tensor([[2.0, 0.0], [-1.0, -1.0]]))
    with pytest.raises(ValueError, match=r"mask: expected shape \[2, T\].*got \[3, 2\]"):
        broadcast_to_tokens(torch.zeros(2), torch.ones(3, 2, dtype=torch.bool))
    with pytest.raises(TypeError, match="mask.*torch.bool"):
        broadcast_to_tokens(torch.zeros(2), torch.ones(2, 2))


# --- purity, dtypes --------------------------------------------------------------------------
def test_pure():
    s, gid = flat_groups(4)
    for fn in (rloo_advantage, grpo_advantage, dr_grpo_advantage, group_mean):
        assert_pure(fn, s, group_id=gid)
        assert_pure(fn, s.reshape(1, -1))
    r, mask, gid = token_case(seed=3)
    assert_pure(reinforce_pp_advantage, r, mask, gamma=0.9, group_id=gid, group_baseline=True)
    assert_pure(remax_advantage, r, torch.ones(6, dtype=torch.float64), mask)
    assert_pure(broadcast_to_tokens, s, torch.ones(23, 3, dtype=torch.bool))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_low_precision(dtype, tol):
    s, gid = flat_groups(5)
    for fn in (rloo_advantage, grpo_advantage):
        out = fn(s.to(dtype), group_id=gid)
        assert out.dtype == dtype
        ref = fn(s.to(dtype).double(), group_id=gid)
        torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)


def test_outputs_are_detached():
    s = torch.randn(3, 4, requires_grad=True)
    assert not rloo_advantage(s).requires_grad and not grpo_advantage(s).requires_grad
    r = torch.randn(2, 3, requires_grad=True)
    m = torch.ones(2, 3, dtype=torch.bool)
    assert not reinforce_pp_advantage(r, m).requires_grad
    assert not remax_advantage(r, torch.zeros(2, requires_grad=True), m).requires_grad


# --- TensorDict adapters ---------------------------------------------------------------------
OUTCOME_ADAPTERS = {
    "rloo": (with_rloo_advantage, rloo_advantage),
    "grpo": (with_grpo_advantage, grpo_advantage),
    "dr_grpo": (with_dr_grpo_advantage, dr_grpo_advantage),
}


@pytest.mark.parametrize("name", sorted(OUTCOME_ADAPTERS))
def test_outcome_adapters(name):
    adapter, kernel = OUTCOME_ADAPTERS[name]
    batch = rollout()
    mask = batch[K.RESPONSE_MASK]
    out = assert_pure(adapter, batch)
    assert set(out.keys()) == set(batch.keys()) | {K.ADVANTAGES, K.RETURNS}
    score = masked_sum(batch[K.REWARDS], mask, dim=-1)  # rewards present: they make the score
    expected = broadcast_to_tokens(kernel(score, group_id=batch[K.GROUP_ID]), mask)
    torch.testing.assert_close(out[K.ADVANTAGES], expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out[K.RETURNS], expected, rtol=0, atol=0)
    assert (out[K.ADVANTAGES][~mask.any(-1)] == 0).all()  # the empty row
    # consecutive groups by size, and a [P, G] batch, agree with group_id
    by_size = adapter(batch.exclude(K.GROUP_ID), group_size=4)
    torch.testing.assert_close(by_size[K.ADVANTAGES], expected, rtol=1e-12, atol=1e-12)
    grid = adapter(batch.exclude(K.GROUP_ID).reshape(2, 4))
    torch.testing.assert_close(grid[K.ADVANTAGES].reshape(8, -1), expected, rtol=1e-12, atol=1e-12)
    # without rewards the score key is used
    from_score = adapter(batch.exclude(K.REWARDS))
    torch.testing.assert_close(from_score[K.ADVANTAGES],
                               broadcast_to_tokens(kernel(batch[K.SCORE], group_id=batch[K.GROUP_ID]), mask))


@pytest.mark.parametrize("name", sorted(OUTCOME_ADAPTERS))
def test_outcome_adapter_errors(name):
    adapter, _ = OUTCOME_ADAPTERS[name]
    batch = rollout()
    with pytest.raises(KeyError, match="group_id"):
        adapter(batch.exclude(K.GROUP_ID))
    with pytest.raises(ValueError, match="group_size: expected a positive divisor of the batch size 8, got 3"):
        adapter(batch, group_size=3)
    with pytest.raises(KeyError, match="score"):
        adapter(batch.exclude(K.REWARDS, K.SCORE))


def test_grpo_adapter_passes_hyper_parameters():
    batch = rollout()
    mask = batch[K.RESPONSE_MASK]
    score = masked_sum(batch[K.REWARDS], mask, dim=-1)
    out = with_grpo_advantage(batch, scale="batch", eps=0.5)
    expected = grpo_advantage(score, group_id=batch[K.GROUP_ID], scale="batch", eps=0.5)
    torch.testing.assert_close(out[K.ADVANTAGES], broadcast_to_tokens(expected, mask))


@pytest.mark.parametrize("baseline", [False, True])
def test_reinforce_pp_adapter(baseline):
    batch = rollout()
    r, mask = batch[K.REWARDS], batch[K.RESPONSE_MASK]
    out = assert_pure(with_reinforce_pp_advantage, batch, gamma=0.9, group_baseline=baseline)
    expected = reinforce_pp_advantage(r, mask, gamma=0.9, group_id=batch[K.GROUP_ID], group_baseline=baseline)
    torch.testing.assert_close(out[K.ADVANTAGES], expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out[K.RETURNS], discounted_returns(r, mask, gamma=0.9))
    by_size = with_reinforce_pp_advantage(batch.exclude(K.GROUP_ID), gamma=0.9, group_baseline=baseline,
                                          group_size=4)
    torch.testing.assert_close(by_size[K.ADVANTAGES], expected, rtol=1e-12, atol=1e-12)


def test_remax_adapter():
    batch = rollout()
    batch[K.BASELINE_SCORE] = torch.randn(8, dtype=torch.float64)
    r, mask = batch[K.REWARDS], batch[K.RESPONSE_MASK]
    out = assert_pure(with_remax_advantage, batch)
    torch.testing.assert_close(out[K.ADVANTAGES], remax_advantage(r, batch[K.BASELINE_SCORE], mask))
    torch.testing.assert_close(out[K.RETURNS], discounted_returns(r, mask))
    with pytest.raises(KeyError, match="baseline_score"):
        with_remax_advantage(rollout())


ALL_ADAPTERS = {
    "rloo": with_rloo_advantage,
    "grpo": with_grpo_advantage,
    "dr_grpo": with_dr_grpo_advantage,
    "reinforce_pp": with_reinforce_pp_advantage,
    "reinforce_pp_baseline": lambda b: with_reinforce_pp_advantage(b, group_baseline=True),
    "remax": with_remax_advantage,
}


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), pad=st.integers(1, 10), name=st.sampled_from(sorted(ALL_ADAPTERS)))
def test_adapters_padding_invariance(seed, pad, name):
    batch = rollout(seed=seed)
    batch[K.BASELINE_SCORE] = torch.randn(8, dtype=torch.float64)
    batch = batch.select(K.REWARDS, K.RESPONSE_MASK, K.GROUP_ID, K.BASELINE_SCORE, K.SCORE)
    fn = ALL_ADAPTERS[name]
    assert_padding_invariant(lambda b: fn(b).select(K.ADVANTAGES, K.RETURNS), batch, pad=pad, fill=NAN,
                             rtol=1e-10, atol=1e-10)


def test_adapters_keep_dtype():
    batch = rollout(dtype=torch.float32)
    batch[K.BASELINE_SCORE] = torch.randn(8)
    for name, fn in ALL_ADAPTERS.items():
        out = fn(batch)
        assert out[K.ADVANTAGES].dtype == out[K.RETURNS].dtype == torch.float32, name
        assert out[K.ADVANTAGES].shape == batch[K.RESPONSE_MASK].shape, name
        assert torch.isfinite(out[K.ADVANTAGES]).all(), name


def test_adapter_on_a_plain_tensordict_without_masks_fails_clearly():
    batch = TensorDict({K.REWARDS: torch.zeros(4, 3)}, batch_size=[4])
    with pytest.raises(KeyError, match="response_mask"):
        with_reinforce_pp_advantage(batch)
    with pytest.raises(KeyError, match="response_mask"):
        with_rloo_advantage(batch, group_size=2)
