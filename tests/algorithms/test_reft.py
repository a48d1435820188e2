"""Tests of rlcore.algorithms.reft: the LoReFT family's maps (pyreft's six variants) and the parameter holder."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rlcore.algorithms.reft import (CONSTANT_SOURCE, REFT_INTERVENTIONS, ReftIntervention, consreft, direft, lobireft,
                                    loreft, nodireft, noreft, trainable_parameters)

LINEAR_SOURCE = sorted(set(REFT_INTERVENTIONS) - set(CONSTANT_SOURCE))
from rlcore.testing import MockLM, assert_pure

H, R_ = 6, 2


def _params(seed=0, dtype=torch.float64, orthonormal=True):
    g = torch.Generator().manual_seed(seed)
    rot = torch.randn(R_, H, generator=g, dtype=torch.float64)
    if orthonormal:
        rot = torch.linalg.qr(rot.T).Q.T  # rows orthonormal
    w = torch.randn(R_, H, generator=g, dtype=torch.float64)
    b = torch.randn(R_, generator=g, dtype=torch.float64)
    h = torch.randn(3, 4, H, generator=g, dtype=torch.float64)
    return tuple(x.to(dtype) for x in (h, rot, w, b))


def _plain(h, rot, w, b, *, act=None, subtract=True):
    """Φ(h) = h + Rᵀ(act(Wh + b) − [subtract]·Rh), one vector at a time with Python loops."""
    act = act or (lambda x: x)
    out = torch.empty_like(h)
    flat_h, flat_o = h.reshape(-1, H), out.reshape(-1, H)
    for n in range(flat_h.shape[0]):
        x = flat_h[n]
        coeff = []
        for i in range(R_):
            source = sum(float(w[i, j]) * float(x[j]) for j in range(H)) + float(b[i])
            proj = sum(float(rot[i, j]) * float(x[j]) for j in range(H))
            coeff.append(float(act(torch.tensor(source, dtype=torch.float64))) - (proj if subtract else 0.0))
        for j in range(H):
            flat_o[n, j] = float(x[j]) + sum(float(rot[i, j]) * coeff[i] for i in range(R_))
    return out


# --- the pure maps ----------------------------------------------------------------------------
def test_loreft_against_the_formula_written_plainly():
    h, rot, w, b = _params()
    torch.testing.assert_close(loreft(h, rot, w, b), _plain(h, rot, w, b))
    torch.testing.assert_close(loreft(h, rot, w, b, act=torch.tanh), _plain(h, rot, w, b, act=torch.tanh))


def test_direft_and_noreft_against_the_formula():
    h, rot, w, b = _params(orthonormal=False)
    torch.testing.assert_close(direft(h, rot, w, b), _plain(h, rot, w, b, subtract=False))
    torch.testing.assert_close(nodireft(h, rot, w, b), direft(h, rot, w, b))  # same map, other constraints
    torch.testing.assert_close(noreft(h, rot, w, b), _plain(h, rot, w, b))
    torch.testing.assert_close(noreft(h, rot, w, b), loreft(h, rot, w, b))   # same map, other constraints


def test_constant_source_variants_against_the_formula():
    """ConsReFT Φ = h + Rᵀ(b − Rh), LobiReFT Φ = h + Rᵀb: the linear formula with W = 0."""
    h, rot, w, b = _params()
    zero = torch.zeros_like(w)
    torch.testing.assert_close(consreft(h, rot, b), _plain(h, rot, zero, b))
    torch.testing.assert_close(lobireft(h, rot, b), _plain(h, rot, zero, b, subtract=False))
    torch.testing.assert_close(consreft(h, rot, b) @ rot.T, b.expand(3, 4, R_))  # R Φ(h) = b for any h
    for fn in (consreft, lobireft):
        args = tuple(x[:1, :2] if i == 0 else x for i, x in enumerate((h, rot, b)))
        args = tuple(x.clone().requires_grad_(True) for x in args)
        assert torch.autograd.gradcheck(fn, args)
        assert_pure(fn, *(x.detach() for x in args))
    with pytest.raises(ValueError, match=r"bias: expected shape \[2\].*got \[3\]"):
        lobireft(h, rot, torch.zeros(3, dtype=h.dtype))


def test_golden_values():
    R = torch.tensor([[1.0, 0.0]])
    W = torch.tensor([[0.0, 2.0]])
    b = torch.tensor([1.0])
    h = torch.tensor([3.0, 4.0])
    # W h + b = 9 replaces the coordinate R h = 3 along e1
    assert loreft(h, R, W, b).tolist() == [9.0, 4.0]
    assert direft(h, R, W, b).tolist() == [12.0, 4.0]
    assert consreft(h, R, b).tolist() == [1.0, 4.0] and lobireft(h, R, b).tolist() == [4.0, 4.0]


def test_loreft_sets_subspace_coordinates_and_keeps_the_complement():
    h, rot, w, b = _params()
    out = loreft(h, rot, w, b)
    torch.testing.assert_close(out @ rot.T, h @ w.T + b)                 # R Φ(h) = W h + b
    proj = torch.eye(H, dtype=h.dtype) - rot.T @ rot
    torch.testing.assert_close(out @ proj, h @ proj)                     # (I − RᵀR) Φ(h) = (I − RᵀR) h


@pytest.mark.parametrize("name", LINEAR_SOURCE)
def test_registry_entries_share_one_signature_gradcheck_and_purity(name):
    fn = REFT_INTERVENTIONS[name]
    h, rot, w, b = (x[:1, :2] if i == 0 else x for i, x in enumerate(_params()))
    args = tuple(x.clone().requires_grad_(True) for x in (h, rot, w, b))
    assert torch.autograd.gradcheck(lambda *a: fn(*a, act=torch.tanh), args)
    assert torch.autograd.gradcheck(lambda *a: fn(*a, act=None), args)
    assert_pure(fn, *(x.detach() for x in args), act=torch.tanh)
    out = torch.compile(fn, backend="eager", fullgraph=True)(*(x.detach() for x in args))
    torch.testing.assert_close(out, fn(*(x.detach() for x in args)))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 5e-2)])
def test_dtypes(dtype, tol):
    ref = loreft(*_params())
    out = loreft(*_params(dtype=dtype))
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)


def test_bad_inputs_name_the_argument_and_shapes():
    h, rot, w, b = _params()
    with pytest.raises(ValueError, match=r"rotation: expected shape \[r, 6\].*got \[2, 5\]"):
        loreft(h, rot[:, :5], w, b)
    with pytest.raises(ValueError, match=r"weight: expected shape \[2, 6\].*got \[1, 6\]"):
        direft(h, rot, w[:1], b)
    with pytest.raises(ValueError, match=r"bias: expected shape \[2\].*got \[3\]"):
        noreft(h, rot, w, torch.zeros(3, dtype=h.dtype))
    with pytest.raises(ValueError, match=r"rotation: expected a 2-d tensor \[r, H\], got shape \[6\]"):
        loreft(h, rot[0], w, b)
    with pytest.raises(TypeError, match="h: expected a floating-point tensor"):
        loreft(h.long(), rot, w, b)


# --- the parameter holder ---------------------------------------------------------------------
def _orthonormality_error(rot):
    return (rot @ rot.T - torch.eye(rot.shape[0], dtype=rot.dtype)).abs().max().item()


def test_loreft_rotation_stays_orthonormal_under_training():
    g = torch.Generator().manual_seed(0)
    mods = {v: ReftIntervention(H, R_, variant=v, generator=torch.Generator().manual_seed(1),
                                dtype=torch.float64) for v in REFT_INTERVENTIONS}
    h = torch.randn(32, H, generator=g, dtype=torch.float64)
    target = torch.randn(32, H, generator=g, dtype=torch.float64)
    for mod in mods.values():
        assert _orthonormality_error(mod.rotation) < 1e-12
        opt = torch.optim.Adam(trainable_parameters(mod), lr=0.1)
        first = None
        for _ in range(20):
            loss = (mod(h) - target).square().mean()
            first = loss.item() if first is None else first
            opt.zero_grad()
            loss.backward()
            opt.step()
        assert loss.item() < first                         # it trains
    for variant in ("loreft", "direft", "consreft", "lobireft"):  # orthonormal rows, as pyreft
        assert _orthonormality_error(mods[variant].rotation) < 1e-10
    for variant in ("noreft", "nodireft"):
        assert _orthonormality_error(mods[variant].rotation) > 1e-3   # unconstrained: drifts


@pytest.mark.parametrize("variant", sorted(set(REFT_INTERVENTIONS) - {"consreft"}))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_zero_init_is_the_identity(variant, dtype):
    mod = ReftIntervention(H, R_, variant=variant, zero_init=True, dtype=dtype,
                           generator=torch.Generator().manual_seed(0))
    h = torch.randn(3, 5, H, generator=torch.Generator().manual_seed(1), dtype=dtype)
    tol = 1e-6 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(mod(h), h, rtol=tol, atol=tol)
    # not the identity without zero_init
    other = ReftIntervention(H, R_, variant=variant, dtype=dtype, generator=torch.Generator().manual_seed(0))
    assert (other(h) - h).abs().max() > 1e-3


def test_zero_init_leaves_a_model_unchanged_through_a_hook():
    model = MockLM(vocab_size=16, hidden_size=8)
    ids = torch.randint(0, 16, (2, 5), generator=torch.Generator().manual_seed(0))
    base = model(ids).logits
    mod = ReftIntervention(8, 2, zero_init=True, generator=torch.Generator().manual_seed(0))
    handle = model.mix.register_forward_hook(lambda m, args, out: mod(out))
    try:
        torch.testing.assert_close(model(ids).logits, base, rtol=1e-6, atol=1e-6)
        with torch.no_grad():
            mod.bias.add_(1.0)
        assert (model(ids).logits - base).abs().max() > 1e-3
    finally:
        handle.remove()


def test_forward_calls_the_pure_function_with_its_parameters():
    for variant, fn in REFT_INTERVENTIONS.items():
        mod = ReftIntervention(H, R_, variant=variant, act=torch.tanh, generator=torch.Generator().manual_seed(2))
        h = torch.randn(4, H, generator=torch.Generator().manual_seed(3))
        if variant in CONSTANT_SOURCE:
            assert mod.weight is None and len(trainable_parameters(mod)) == 2
            torch.testing.assert_close(mod(h), fn(h, mod.rotation, mod.bias))
        else:
            torch.testing.assert_close(mod(h), fn(h, mod.rotation, mod.weight, mod.bias, act=torch.tanh))
        assert mod(h.bfloat16()).dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"zero_init: 'consreft' sets the subspace to a constant"):
        ReftIntervention(H, R_, variant="consreft", zero_init=True)


def test_seeded_init_is_reproducible_and_dropout_only_in_training():
    a = ReftIntervention(H, R_, generator=torch.Generator().manual_seed(5), dropout=0.5)
    b = ReftIntervention(H, R_, generator=torch.Generator().manual_seed(5), dropout=0.5)
    h = torch.randn(4, H)
    a.eval()
    b.eval()
    torch.testing.assert_close(a(h), b(h))
    a.train()
    assert not torch.allclose(a(h), b(h))


def test_trainable_parameters_are_the_interventions_only():
    base = nn.Linear(H, H).requires_grad_(False)
    mod = ReftIntervention(H, R_)
    params = trainable_parameters(mod)
    assert len(params) == 3 and all(p.requires_grad for p in params)
    assert {p.shape for p in params} == {torch.Size([R_, H]), torch.Size([R_])}
    ids = {id(p) for p in params}
    assert not ids & {id(p) for p in base.parameters()}
    two = ReftIntervention(H, R_, variant="direft")
    both = trainable_parameters([mod, two, mod])          # shared modules counted once
    assert len(both) == 6
    mod.bias.requires_grad_(False)
    assert len(trainable_parameters(mod)) == 2


def test_module_bad_arguments():
    with pytest.raises(ValueError, match=r"variant: unknown 'lora'; valid: \['consreft', 'direft', 'lobireft', "
                                         r"'loreft', 'nodireft', 'noreft'\]"):
        ReftIntervention(H, R_, variant="lora")
    with pytest.raises(ValueError, match="rank: expected at most hidden_size=6"):
        ReftIntervention(H, 7)
    ReftIntervention(H, 7, variant="nodireft")  # unconstrained R may be tall
    with pytest.raises(ValueError, match="rank: expected at most hidden_size=6"):
        ReftIntervention(H, 7, variant="direft")  # orthonormal rows, as pyreft


def test_a_generator_fixes_the_whole_state_and_leaves_the_global_rng_alone():
    """The orthogonal parametrisation completes R [r, H] to an H × H base with random columns; with
    a generator that draw is seeded from it, so the global RNG neither decides nor sees it."""
    states = []
    for global_seed in (1, 2):
        torch.manual_seed(global_seed)
        before = torch.random.get_rng_state()
        module = ReftIntervention(8, 3, generator=torch.Generator().manual_seed(5))
        assert torch.equal(torch.random.get_rng_state(), before)
        states.append(module.state_dict())
    assert states[0].keys() == states[1].keys() and any("base" in k for k in states[0])
    for key in states[0]:
        assert torch.equal(states[0][key], states[1][key]), key
    other = ReftIntervention(8, 3, generator=torch.Generator().manual_seed(6)).state_dict()
    assert not all(torch.equal(states[0][k], other[k]) for k in other)
