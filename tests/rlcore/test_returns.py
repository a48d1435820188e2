"""GAE and discounted returns against plain loops, golden values, torchrl, identities and properties."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from rlcore import keys as K
from rlcore.masked import masked_mean, masked_var
from rlcore.returns import BLOCK, discounted_cumsum, discounted_returns, gae, with_gae
from rlcore.testing import assert_padding_invariant, assert_pure, make_rollout, right_padded_mask
from tests.reference.returns import discounted_returns_reference, gae_reference

NAN = float("nan")


def random_case(shape=(5, 9), *, seed=0, dtype=torch.float64, holes=True, fill=NAN):
    """Rewards, values (``fill`` at masked positions) and a mask with one full and one empty row;
    with ``holes`` the mask also has gaps inside rows (multi-turn observation tokens)."""
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(shape, generator=g, dtype=torch.float64)
    v = torch.randn(shape, generator=g, dtype=torch.float64)
    T = shape[-1]
    lengths = torch.randint(0, T + 1, shape[:-1], generator=g).reshape(-1)
    lengths[0], lengths[-1] = T, 0
    mask = right_padded_mask(lengths, T).reshape(shape)
    if holes:
        mask = mask & (torch.rand(shape, generator=g) < 0.75)
    fill_t = torch.tensor(fill, dtype=torch.float64)
    return torch.where(mask, r, fill_t).to(dtype), torch.where(mask, v, fill_t).to(dtype), mask


def clean(x, mask):
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype))


# --- against the plain loops -----------------------------------------------------------------
@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.99, 0.95), (1.0, 1.0), (0.9, 0.0), (0.0, 0.5),
                                       (0.5, 0.1)])
@pytest.mark.parametrize("holes", [False, True])
def test_gae_matches_reference_loop(gamma, lam, holes):
    r, v, mask = random_case((6, 11), seed=1, holes=holes)
    adv, ret = gae(r, v, mask, gamma=gamma, lam=lam)
    ref_adv, ref_ret = gae_reference(clean(r, mask), clean(v, mask), mask, gamma=gamma, lam=lam)
    torch.testing.assert_close(adv, ref_adv, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ret, ref_ret, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shape", [(7,), (2, 3, 10)])
def test_gae_any_leading_dims(shape):
    r, v, mask = random_case(shape, seed=2)
    adv, ret = gae(r, v, mask, gamma=0.97, lam=0.9)
    ref_adv, ref_ret = gae_reference(clean(r, mask), clean(v, mask), mask, gamma=0.97, lam=0.9)
    assert adv.shape == ret.shape == shape
    torch.testing.assert_close(adv, ref_adv, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ret, ref_ret, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("gamma", [1.0, 0.9, 0.0])
def test_discounted_returns_matches_reference_loop(gamma):
    r, _, mask = random_case((6, 13), seed=3)
    out = discounted_returns(r, mask, gamma=gamma)
    torch.testing.assert_close(out, discounted_returns_reference(clean(r, mask), mask, gamma=gamma),
                               rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("T", [1, 2, 3, 7, 8, 9, 30])
@pytest.mark.parametrize("block", [2, 3, 8])
def test_discounted_cumsum_deep_recursion(T, block):
    """Small blocks make several levels of the chunked scan, with T not a multiple of the block."""
    x = torch.randn(3, T, generator=torch.Generator().manual_seed(T), dtype=torch.float64)
    out = discounted_cumsum(x, coef=0.8, block=block)
    expected = torch.zeros_like(x)
    for b in range(3):
        running = 0.0
        for t in reversed(range(T)):
            running = float(x[b, t]) + 0.8 * running
            expected[b, t] = running
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("T", [1, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK + 1, BLOCK * BLOCK + 3, 4096])
def test_gae_chunk_boundaries(T):
    r, v, mask = random_case((3, T), seed=T, holes=True)
    adv, ret = gae(r, v, mask, gamma=0.999, lam=0.99)
    ref_adv, ref_ret = gae_reference(clean(r, mask), clean(v, mask), mask, gamma=0.999, lam=0.99)
    torch.testing.assert_close(adv, ref_adv, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ret, ref_ret, rtol=1e-10, atol=1e-10)


# --- golden values ---------------------------------------------------------------------------
def test_gae_golden_values():
    """By hand, γ = λ = 0.5 (γλ = 0.25).
    Row 0, mask [1, 0, 1]: t=2: δ = 2 − 1 = 1, Â = 1, R = 2; t=1 skipped; t=0: V_next = V_2 = 1,
    δ = 1 + 0.5·1 − 1 = 0.5, Â = 0.5 + 0.25·1 = 0.75, R = 1.75.
    Row 1, mask [1, 1, 0]: t=1: δ = 1 − 1 = 0, Â = 0, R = 1; t=0: δ = 0 + 0.5·1 − 1 = −0.5, Â = −0.5.
    """
    r = torch.tensor([[1.0, NAN, 2.0], [0.0, 1.0, NAN]])
    v = torch.tensor([[1.0, NAN, 1.0], [1.0, 1.0, 9.0]])
    mask = torch.tensor([[True, False, True], [True, True, False]])
    adv, ret = gae(r, v, mask, gamma=0.5, lam=0.5)
    torch.testing.assert_close(adv, torch.tensor([[0.75, 0.0, 1.0], [-0.5, 0.0, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[1.75, 0.0, 2.0], [0.5, 1.0, 0.0]]))


def test_discounted_returns_golden_values():
    r = torch.tensor([[1.0, 5.0, 2.0, 4.0]])
    mask = torch.tensor([[True, False, True, True]])
    # t=3: 4; t=2: 2 + 0.5·4 = 4; t=0: 1 + 0.5·4 = 3 (t=1 skipped)
    torch.testing.assert_close(discounted_returns(r, mask, gamma=0.5), torch.tensor([[3.0, 0.0, 4.0, 4.0]]))


# --- parity with torchrl ---------------------------------------------------------------------
def _torchrl_inputs(r, v, mask):
    """torchrl layout ``[B, T, 1]``: done (= terminated) on the last valid token of each row."""
    B, T = r.shape
    last = mask.sum(-1) - 1
    done = torch.arange(T) == last[:, None]
    next_v = torch.cat([v[:, 1:], torch.zeros(B, 1, dtype=v.dtype)], 1)
    return v[..., None], next_v[..., None], r[..., None], done[..., None]


def test_gae_matches_torchrl_loop():
    functional = pytest.importorskip("torchrl.objectives.value.functional")
    r, v, mask = random_case((8, 20), seed=4, holes=False, fill=0.0)
    mask[-1] = True  # no empty row: torchrl needs a done somewhere in each row
    state, next_state, reward, done = _torchrl_inputs(r, v, mask)
    ref_adv, ref_ret = functional.generalized_advantage_estimate(0.75, 0.5, state, next_state, reward, done,
                                                                 time_dim=-2)
    adv, ret = gae(r, v, mask, gamma=0.75, lam=0.5)  # torchrl rounds γ to float32: use exact ones
    torch.testing.assert_close(adv, clean(ref_adv[..., 0], mask), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ret, clean(ref_ret[..., 0], mask), rtol=1e-12, atol=1e-12)


def test_gae_matches_torchrl_vectorised_within_its_truncation():
    """torchrl's vectorised GAE drops the terms with (γλ)^k < 1e-7: equal up to that tail."""
    functional = pytest.importorskip("torchrl.objectives.value.functional")
    r, v, mask = random_case((4, 400), seed=5, holes=False, fill=0.0)
    mask[:, :350] = True
    state, next_state, reward, done = _torchrl_inputs(r, v, mask)
    ref_adv, ref_ret = functional.vec_generalized_advantage_estimate(1.0, 0.95, state, next_state, reward, done,
                                                                     time_dim=-2)
    adv, ret = gae(r, v, mask, gamma=1.0, lam=0.95)
    # tail bound: Σ_{k ≥ 315} 0.95^k · max|δ| ≈ 2e-6 · max|δ|
    torch.testing.assert_close(adv, clean(ref_adv[..., 0], mask), rtol=0, atol=1e-4)
    torch.testing.assert_close(ret, clean(ref_ret[..., 0], mask), rtol=0, atol=1e-4)


# --- identities ------------------------------------------------------------------------------
def test_gae_with_gamma_lambda_one_is_reward_to_go_minus_values():
    r, v, mask = random_case((5, 12), seed=6)
    adv, ret = gae(r, v, mask, gamma=1.0, lam=1.0)
    to_go = discounted_returns(r, mask, gamma=1.0)
    torch.testing.assert_close(adv, clean(to_go - clean(v, mask), mask), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ret, to_go, rtol=1e-12, atol=1e-12)


def test_gae_with_lambda_zero_is_one_step_td_error():
    r, v, mask = random_case((5, 12), seed=7, holes=False)
    adv, _ = gae(r, v, mask, gamma=0.9, lam=0.0)
    rc, vc = clean(r, mask), clean(v, mask)
    next_v = torch.cat([vc[:, 1:], torch.zeros(5, 1, dtype=vc.dtype)], 1)  # right padded: next slot
    torch.testing.assert_close(adv, clean(rc + 0.9 * next_v - vc, mask), rtol=1e-12, atol=1e-12)


def test_discounted_returns_is_gae_with_zero_values_and_lambda_one():
    r, _, mask = random_case((4, 10), seed=8)
    _, ret = gae(r, torch.zeros_like(r), mask, gamma=0.7, lam=1.0)
    torch.testing.assert_close(discounted_returns(r, mask, gamma=0.7), ret, rtol=1e-12, atol=1e-12)


def test_holes_are_skipped_not_zero_rewarded():
    """Removing the masked columns of a row changes nothing on the remaining tokens."""
    r, v, mask = random_case((2, 10), seed=9)
    r, v, mask = r[:1], v[:1], mask[:1]  # row 0: full length, with holes
    keep = mask[0]
    assert 0 < keep.sum() < 10
    adv, ret = gae(r, v, mask, gamma=0.9, lam=0.8)
    adv_c, ret_c = gae(r[:, keep], v[:, keep], mask[:, keep], gamma=0.9, lam=0.8)
    torch.testing.assert_close(adv[:, keep], adv_c, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ret[:, keep], ret_c, rtol=1e-12, atol=1e-12)


# --- properties ------------------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(B=st.integers(1, 4), T=st.integers(1, 140), seed=st.integers(0, 2**16),
       gamma=st.floats(0.0, 1.0), lam=st.floats(0.0, 1.0), holes=st.booleans())
def test_gae_property_matches_reference(B, T, seed, gamma, lam, holes):
    r, v, mask = random_case((B, T), seed=seed, holes=holes)
    adv, ret = gae(r, v, mask, gamma=gamma, lam=lam)
    ref_adv, ref_ret = gae_reference(clean(r, mask), clean(v, mask), mask, gamma=gamma, lam=lam)
    torch.testing.assert_close(adv, ref_adv, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(ret, ref_ret, rtol=1e-9, atol=1e-9)


def _gae_td(batch):
    adv, ret = gae(batch[K.REWARDS], batch[K.VALUES], batch[K.RESPONSE_MASK], gamma=0.95, lam=0.9)
    return TensorDict({K.ADVANTAGES: adv, K.RETURNS: ret}, batch_size=batch.batch_size)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), pad=st.integers(1, 70), whiten=st.booleans())
def test_padding_invariance(seed, pad, whiten):
    batch = make_rollout(5, 9, empty_rows=1, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    keys = [K.REWARDS, K.VALUES, K.RESPONSE_MASK]
    assert_padding_invariant(_gae_td, batch.select(*keys), pad=pad, fill=NAN, rtol=1e-12, atol=1e-12)
    assert_padding_invariant(lambda b: with_gae(b, whiten=whiten).select(K.ADVANTAGES, K.RETURNS),
                             batch.select(*keys), pad=pad, fill=NAN, rtol=1e-12, atol=1e-12)
    assert_padding_invariant(lambda b: discounted_returns(b[K.REWARDS], b[K.RESPONSE_MASK], gamma=0.9),
                             batch.select(*keys), pad=pad, fill=NAN, rtol=1e-12, atol=1e-12)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16))
def test_with_gae_whitens_over_the_mask(seed):
    batch = make_rollout(6, 8, empty_rows=1, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    mask = batch[K.RESPONSE_MASK]
    out = with_gae(batch, gamma=0.99, lam=0.95)
    adv = out[K.ADVANTAGES]
    assert masked_mean(adv, mask).abs() < 1e-9
    assert (masked_var(adv, mask) - 1).abs() < 1e-6  # eps = 1e-8 in the rsqrt
    assert (adv[~mask] == 0).all()
    _, ret = gae(batch[K.REWARDS], batch[K.VALUES], mask, gamma=0.99, lam=0.95)
    torch.testing.assert_close(out[K.RETURNS], ret, rtol=0, atol=0)  # returns are not whitened
    raw = with_gae(batch, gamma=0.99, lam=0.95, whiten=False)[K.ADVANTAGES]
    torch.testing.assert_close(raw, gae(batch[K.REWARDS], batch[K.VALUES], mask, gamma=0.99, lam=0.95)[0])


# --- purity, gradients, dtypes, numerics -----------------------------------------------------
def test_pure():
    r, v, mask = random_case((4, 70), seed=10)
    assert_pure(gae, r, v, mask, gamma=0.9, lam=0.8)
    assert_pure(discounted_returns, r, mask, gamma=0.9)
    assert_pure(discounted_cumsum, clean(r, mask), coef=0.5)
    batch = make_rollout(4, 6)
    out = assert_pure(with_gae, batch)
    assert set(out.keys()) == set(batch.keys()) | {K.ADVANTAGES, K.RETURNS}
    assert K.ADVANTAGES not in batch.keys()


def test_outputs_are_detached():
    r, v, mask = random_case((3, 6), seed=11, fill=0.0)
    r.requires_grad_(True)
    v.requires_grad_(True)
    adv, ret = gae(r, v, mask)
    assert not adv.requires_grad and not ret.requires_grad
    assert not discounted_returns(r, mask).requires_grad


def test_discounted_cumsum_is_differentiable():
    x = torch.randn(2, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: discounted_cumsum(t, coef=0.7, block=2), (x,))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_low_precision(dtype, tol):
    """float32: close to the float64 loop. bf16: computed in float32, rounded to bf16 once."""
    r, v, mask = random_case((4, 300), seed=12, fill=0.0)
    r, v = r.to(dtype), v.to(dtype)
    adv, ret = gae(r, v, mask, gamma=0.99, lam=0.95)
    assert adv.dtype == ret.dtype == dtype
    ref_adv, ref_ret = gae_reference(r.double(), v.double(), mask, gamma=0.99, lam=0.95)
    scale = ref_adv.abs().max()
    torch.testing.assert_close(adv.double(), ref_adv, rtol=tol, atol=tol * scale)
    torch.testing.assert_close(ret.double(), ref_ret, rtol=tol, atol=tol * scale)


@pytest.mark.parametrize("gamma,lam", [(0.5, 0.01), (1.0, 0.0), (0.0, 0.0), (1.0, 1.0)])
def test_long_sequences_stay_finite_in_float32(gamma, lam):
    """(γλ)^k underflows to 0 for large k; it must never meet an inf (no inf·0 = NaN)."""
    r, v, mask = random_case((2, 4096), seed=13, dtype=torch.float32, fill=NAN)
    adv, ret = gae(r, v, mask, gamma=gamma, lam=lam)
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    ref_adv, _ = gae_reference(clean(r, mask).double(), clean(v, mask).double(), mask, gamma=gamma, lam=lam)
    torch.testing.assert_close(adv.double(), ref_adv, rtol=1e-4, atol=1e-3 * max(1.0, float(ref_adv.abs().max())))


def test_empty_rows_and_empty_time():
    mask = torch.zeros(2, 5, dtype=torch.bool)
    r = torch.full((2, 5), NAN)
    adv, ret = gae(r, r, mask)
    assert (adv == 0).all() and (ret == 0).all()
    adv, ret = gae(torch.zeros(3, 0), torch.zeros(3, 0), torch.zeros(3, 0, dtype=torch.bool))
    assert adv.shape == ret.shape == (3, 0)


def test_works_under_torch_compile():
    r, v, mask = random_case((3, 70), seed=14)
    compiled = torch.compile(lambda a, b, m: gae(a, b, m, gamma=0.9, lam=0.8), backend="eager", fullgraph=True)
    adv, ret = compiled(r, v, mask)
    ref_adv, ref_ret = gae(r, v, mask, gamma=0.9, lam=0.8)
    torch.testing.assert_close(adv, ref_adv)
    torch.testing.assert_close(ret, ref_ret)


# --- bad input -------------------------------------------------------------------------------
def test_bad_inputs_name_the_argument_and_shapes():
    r, v, mask = random_case((2, 4), seed=15)
    with pytest.raises(TypeError, match="mask.*torch.bool"):
        gae(r, v, mask.float())
    with pytest.raises(ValueError, match=r"values: expected shape \[2, 4\].*got \[2, 3\]"):
        gae(r, v[:, :3], mask)
    with pytest.raises(ValueError, match=r"mask: expected shape \[2, 4\].*got \[2, 5\]"):
        gae(r, v, torch.ones(2, 5, dtype=torch.bool))
    with pytest.raises(TypeError, match="rewards: expected a floating-point"):
        gae(r.long(), v, mask)
    with pytest.raises(ValueError, match="rewards: expected at least 1 dims"):
        gae(torch.tensor(1.0), torch.tensor(1.0), torch.tensor(True))
    with pytest.raises(ValueError, match="gamma"):
        gae(r, v, mask, gamma=1.5)
    with pytest.raises(ValueError, match="lam"):
        gae(r, v, mask, lam=-0.1)
    with pytest.raises(TypeError, match="mask.*torch.bool"):
        discounted_returns(r, mask.long())
    with pytest.raises(ValueError, match="coef"):
        discounted_cumsum(r, coef=2.0)
    with pytest.raises(ValueError, match="block"):
        discounted_cumsum(r, coef=0.5, block=1)
    with pytest.raises(KeyError, match="values"):
        with_gae(make_rollout(2, 3).exclude(K.VALUES))
