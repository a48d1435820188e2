"""Tests for rlcore.transforms: KL controllers, observed KL, running moments."""

from __future__ import annotations

import functools
import inspect

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore import keys as K
from rlcore.testing import assert_padding_invariant, assert_pure, make_rollout
from rlcore.transforms import (KL_CONTROLLERS, KL_REDUCTIONS, KLControllerState, RunningMoments, StateTransform,
                               adaptive_kl_init, adaptive_kl_update, fixed_kl_init, fixed_kl_update, kl_controller,
                               observed_kl, running_moments, running_moments_init, running_moments_merge,
                               running_moments_std, running_moments_update, running_moments_var)


# --- KL controllers -------------------------------------------------------------------------
def test_fixed_controller_keeps_coef():
    s = fixed_kl_init(0.05)
    assert isinstance(s, KLControllerState) and s.coef.shape == () and s.coef.dtype == torch.float64
    s2 = fixed_kl_update(s, torch.tensor(100.0), 512, target=6.0, horizon=10)
    torch.testing.assert_close(s2.coef, torch.tensor(0.05, dtype=torch.float64), rtol=0, atol=0)


def test_adaptive_controller_golden_sequence():
    # target 6, horizon 10000, n_steps 256, by hand:
    #   KL 12 → e = clip(1, ±0.2) = 0.2   → 0.2·1.00512          = 0.201024
    #   KL 6  → e = 0                     → 0.201024
    #   KL 3  → e = clip(−0.5) = −0.2     → 0.201024·0.99488     = 0.19999475712
    #   KL 5.7 → e = −0.05                → 0.19999475712·0.99872 = 0.1997387638309
    #   KL 0  → e = −0.2                  → ·0.99488              = 0.1987161013601
    want = [0.201024, 0.201024, 0.19999475712, 0.1997387638309, 0.1987161013601]
    s = adaptive_kl_init(0.2)
    for kl, w in zip([12.0, 6.0, 3.0, 5.7, 0.0], want):
        s = adaptive_kl_update(s, torch.tensor(kl, dtype=torch.float64), 256, target=6.0, horizon=10000)
        torch.testing.assert_close(s.coef, torch.tensor(w, dtype=torch.float64), rtol=1e-12, atol=0)
    # float32 observed KL and tensor n_steps give the same
    s32 = adaptive_kl_update(adaptive_kl_init(0.2), torch.tensor(12.0, dtype=torch.float32), torch.tensor(256))
    torch.testing.assert_close(s32.coef, torch.tensor(0.201024, dtype=torch.float64), rtol=1e-12, atol=0)


@settings(max_examples=40, deadline=None)
@given(st.floats(0, 1e6, allow_nan=False), st.floats(0.01, 10), st.integers(1, 5000), st.floats(1e-3, 5.0))
def test_adaptive_controller_clip_bounds(kl, target, n_steps, coef):
    horizon = 10000
    new = adaptive_kl_update(adaptive_kl_init(coef), torch.tensor(kl, dtype=torch.float64), n_steps,
                             target=target, horizon=horizon).coef
    ratio = new / coef
    step = 0.2 * n_steps / horizon
    assert 1 - step - 1e-12 <= float(ratio) <= 1 + step + 1e-12
    if kl > target * 1.2:
        assert abs(float(ratio) - (1 + step)) < 1e-12
    if kl < target * 0.8:
        assert abs(float(ratio) - (1 - step)) < 1e-12


def test_registry_shares_one_signature():
    for name, (init, update) in KL_CONTROLLERS.items():
        s = init(0.1)
        s = update(s, torch.tensor(3.0), 64, target=6.0, horizon=1000)
        assert isinstance(s, KLControllerState) and s.coef.shape == ()
        params = list(inspect.signature(update).parameters)
        assert params[:3] == ["state", "observed_kl", "n_steps"]
    with pytest.raises(ValueError, match=r"kl_controller: unknown 'pid'; valid: \['adaptive', 'fixed'\]"):
        kl_controller("pid")


@pytest.mark.parametrize("name", ["adaptive", "fixed"])
def test_a_controller_binds_its_hyper_parameters_when_made(name):
    """``kl_controller(name, coef=, target=, horizon=)`` is the registry's pair with those bound:
    the same states as the unbound functions, step after step."""
    init, update = KL_CONTROLLERS[name]
    controller = kl_controller(name, coef=0.3, target=2.0, horizon=500)
    assert isinstance(controller, StateTransform)
    bound, free = controller.init(), init(0.3)
    for kl in (torch.tensor(5.0), torch.tensor(0.5), torch.tensor(2.0)):
        bound, free = controller.update(bound, kl, 64), update(free, kl, 64, target=2.0, horizon=500)
        assert torch.equal(bound.coef, free.coef)
    assert (name == "fixed") == bool(bound.coef == 0.3)


def test_running_moments_as_a_transform():
    init, update = running_moments(dtype=torch.float32)
    x = torch.tensor([1.0, 2.0, 6.0])
    state = update(init(), x)
    want = running_moments_update(running_moments_init(torch.float32), x)
    assert state.mean.dtype == torch.float32 and all(torch.equal(a, b) for a, b in zip(state, want))


def test_controller_pure_and_compiles():
    s = adaptive_kl_init(0.2)
    assert_pure(adaptive_kl_update, s, torch.tensor(9.0), 128, target=6.0, horizon=1000)
    assert_pure(fixed_kl_update, s, torch.tensor(9.0), 128)
    fn = torch.compile(functools.partial(adaptive_kl_update, target=6.0, horizon=1000), fullgraph=True,
                       backend="eager")
    torch.testing.assert_close(fn(s, torch.tensor(9.0), 128).coef,
                               adaptive_kl_update(s, torch.tensor(9.0), 128, target=6.0, horizon=1000).coef)


# --- observed_kl ----------------------------------------------------------------------------
def _loop_observed(kl, mask, reduce):
    vals = []
    for b in range(kl.shape[0]):
        toks = [float(kl[b, t]) for t in range(kl.shape[1]) if mask[b, t]]
        if toks:
            vals.append(sum(toks) if reduce == "sequence_sum" else sum(toks) / len(toks))
    return sum(vals) / len(vals) if vals else 0.0


@pytest.mark.parametrize("reduce", sorted(KL_REDUCTIONS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_observed_kl_matches_loop(reduce, dtype):
    batch = make_rollout(7, 6, empty_rows=2, dtype=dtype)
    kl, mask = batch[K.VALUES], batch[K.RESPONSE_MASK]
    got = observed_kl(kl, mask, reduce=reduce)
    assert got.shape == () and got.dtype == dtype
    torch.testing.assert_close(got.double(), torch.tensor(_loop_observed(kl, mask, reduce), dtype=torch.float64),
                               rtol=1e-6, atol=1e-6)


def test_observed_kl_golden_and_edges():
    kl = torch.tensor([[1.0, 2.0, 9.0], [3.0, 9.0, 9.0], [5.0, 5.0, 5.0]], requires_grad=True)
    m = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]]).bool()
    assert observed_kl(kl, m) == 3.0                        # (3 + 3) / 2, the empty row left out
    assert observed_kl(kl, m, reduce="token_mean") == 2.25   # (1.5 + 3) / 2
    assert not observed_kl(kl, m).requires_grad
    assert observed_kl(kl, torch.zeros_like(m)) == 0.0
    with pytest.raises(ValueError, match=r"reduce: unknown 'mean'; valid: \['sequence_sum', 'token_mean'\]"):
        observed_kl(kl, m, reduce="mean")
    with pytest.raises(TypeError, match=r"mask: expected a torch.bool mask"):
        observed_kl(kl, m.float())


@pytest.mark.parametrize("reduce", sorted(KL_REDUCTIONS))
def test_observed_kl_padding_invariant_and_pure(reduce):
    batch = make_rollout(6, 5, empty_rows=1)
    fn = lambda td: observed_kl(td[K.REWARDS], td[K.RESPONSE_MASK], reduce=reduce)  # noqa: E731
    assert_padding_invariant(fn, batch, fill=float("nan"))
    assert_pure(observed_kl, batch[K.REWARDS], batch[K.RESPONSE_MASK], reduce=reduce)


# --- running moments ------------------------------------------------------------------------
def _close(state, values, *, rtol=1e-10, atol=1e-10):
    n = values.numel()
    assert int(state.count) == n
    if n == 0:
        assert float(state.mean) == 0 and float(state.m2) == 0
        return
    var_b, mean = torch.var_mean(values.double(), correction=0)
    torch.testing.assert_close(state.mean, mean, rtol=rtol, atol=atol)
    torch.testing.assert_close(running_moments_var(state, unbiased=False), var_b, rtol=rtol, atol=atol)
    want_unbiased = torch.var(values.double(), correction=1) if n > 1 else torch.zeros((), dtype=torch.float64)
    torch.testing.assert_close(running_moments_var(state), want_unbiased, rtol=rtol, atol=atol)
    torch.testing.assert_close(running_moments_std(state), want_unbiased.sqrt(), rtol=rtol, atol=atol)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 6), min_size=0, max_size=8), st.integers(0, 2**16),
       st.sampled_from([torch.float32, torch.float64]))
def test_running_moments_match_var_mean_of_concatenation(sizes, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    batches = [(torch.randn(n, generator=g, dtype=torch.float64) * 5 + 3).to(dtype) for n in sizes]
    s = running_moments_init()
    for x in batches:
        s = running_moments_update(s, x)
    _close(s, torch.cat(batches) if batches else torch.zeros(0))
    assert s.mean.dtype == torch.float64 and s.count.dtype == torch.int64


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=5), st.integers(0, 2**16))
def test_running_moments_with_mask(sizes, seed):
    g = torch.Generator().manual_seed(seed)
    s, kept = running_moments_init(), []
    for n in sizes:
        x = torch.randn(n, 4, generator=g, dtype=torch.float64)
        mask = torch.rand(n, 4, generator=g) < 0.5
        s = running_moments_update(s, torch.where(mask, x, torch.nan), mask)  # padding is NaN
        kept.append(x[mask])
    _close(s, torch.cat(kept))


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 6), min_size=3, max_size=3), st.integers(0, 2**16))
def test_merge_associative_commutative_and_identity(sizes, seed):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(n, generator=g, dtype=torch.float64) * 2 - 1 for n in sizes]
    a, b, c = (running_moments_update(running_moments_init(), x) for x in xs)
    left = running_moments_merge(running_moments_merge(a, b), c)
    right = running_moments_merge(a, running_moments_merge(b, c))
    swapped = running_moments_merge(c, running_moments_merge(b, a))
    for other in (right, swapped):
        assert int(other.count) == int(left.count)
        torch.testing.assert_close(other.mean, left.mean, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(other.m2, left.m2, rtol=1e-12, atol=1e-12)
    _close(left, torch.cat(xs))
    empty = running_moments_init()
    for x in (a, running_moments_merge(empty, a), running_moments_merge(a, empty)):
        assert int(x.count) == int(a.count)
        torch.testing.assert_close(x.mean, a.mean, rtol=0, atol=0)
        torch.testing.assert_close(x.m2, a.m2, rtol=0, atol=0)


def test_shards_merge_to_the_whole():
    x = torch.randn(1000, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 1e3 + 1e6
    whole = running_moments_update(running_moments_init(), x)
    shards = [running_moments_update(running_moments_init(), part) for part in x.split([1, 0, 299, 700])]
    merged = functools.reduce(running_moments_merge, shards, running_moments_init())
    _close(merged, x, rtol=1e-12, atol=1e-6)
    _close(whole, x, rtol=1e-12, atol=1e-6)


def test_running_moments_golden_and_edge_values():
    s = running_moments_update(running_moments_init(), torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert isinstance(s, RunningMoments) and int(s.count) == 4
    assert float(s.mean) == 2.5 and float(s.m2) == 5.0
    assert float(running_moments_var(s)) == 5.0 / 3 and float(running_moments_var(s, unbiased=False)) == 1.25
    one = running_moments_update(running_moments_init(), torch.tensor([7.0]))
    assert float(running_moments_std(one)) == 0.0 and float(one.mean) == 7.0
    zero = running_moments_init()
    assert float(running_moments_std(zero)) == 0.0 and float(running_moments_std(zero, unbiased=False)) == 0.0
    f32 = running_moments_init(torch.float32)
    assert running_moments_update(f32, torch.ones(3, dtype=torch.float64)).mean.dtype == torch.float32


def test_running_moments_pure_detached_and_compiles():
    x = torch.randn(3, 4, requires_grad=True)
    m = torch.rand(3, 4, generator=torch.Generator().manual_seed(1)) < 0.6
    s = assert_pure(running_moments_update, running_moments_init(), x, m)
    assert not s.mean.requires_grad
    assert_pure(running_moments_merge, s, s)
    assert_pure(running_moments_std, s, unbiased=False)
    fn = torch.compile(running_moments_update, fullgraph=True, backend="eager")
    got = fn(running_moments_init(), x, m)
    for a, b in zip(got, s):
        torch.testing.assert_close(a, b)


def test_running_moments_bad_inputs():
    s = running_moments_init()
    with pytest.raises(TypeError, match=r"x: expected a floating-point tensor, got dtype torch.int64"):
        running_moments_update(s, torch.ones(3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"mask: expected shape \[3\] \(the shape of x\), got \[4\]"):
        running_moments_update(s, torch.ones(3), torch.ones(4, dtype=torch.bool))
    with pytest.raises(TypeError, match=r"mask: expected a torch.bool mask"):
        running_moments_update(s, torch.ones(3), torch.ones(3))


@pytest.mark.filterwarnings("ignore:__array_wrap__:DeprecationWarning")  # np.clip on a tensor, in torchrl
def test_adaptive_controller_parity_with_torchrl():
    llm_utils = pytest.importorskip("torchrl.data.llm.utils")
    # torchrl's controller reads the per-sample KL rewards −β·KL_b and n_steps = their count;
    # it averages them in float32 (torch.as_tensor of Python floats), hence rtol 1e-6.
    peer = llm_utils.AdaptiveKLController(init_kl_coef=0.2, target=6.0, horizon=10000)
    ours = adaptive_kl_init(0.2)
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        per_seq_kl = torch.rand(64, generator=g, dtype=torch.float64) * 12
        peer_coef = peer.update((-peer.coef * per_seq_kl).tolist())
        ours = adaptive_kl_update(ours, per_seq_kl.mean(), per_seq_kl.numel(), target=6.0, horizon=10000)
        torch.testing.assert_close(ours.coef, torch.as_tensor(peer_coef, dtype=torch.float64), rtol=1e-6, atol=0)
