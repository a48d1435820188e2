"""Tests for rlcore.logprobs: values and gradients against plain references, memory structure."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict
from torch.utils._pytree import tree_leaves

from rlcore import keys as K
from rlcore.logprobs import entropy_from_logits, sequence_logprobs, token_logprobs
from rlcore.lm_head import hidden_logprobs
from rlcore.testing import assert_padding_invariant, assert_pure, right_padded_mask

F64 = torch.float64


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _logits(*shape: int, dtype=F64, scale: float = 3.0, seed: int = 0) -> torch.Tensor:
    return (torch.randn(*shape, generator=_gen(seed), dtype=F64) * scale).to(dtype)


def _labels(shape, vocab: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, tuple(shape), generator=_gen(seed))


# --- plain references, written from the formulas --------------------------------------------
def loop_logprobs(logits, labels, temperature=1.0):
    """logp = x_y/τ − log Σ_v exp(x_v/τ), one row at a time in float64."""
    x = logits.detach().double().reshape(-1, logits.shape[-1]) / temperature
    y = labels.reshape(-1)
    out = torch.empty(x.shape[0], dtype=F64)
    for i in range(x.shape[0]):
        m = max(x[i].tolist())
        lse = m + math.log(sum(math.exp(v - m) for v in x[i].tolist()))
        out[i] = x[i, y[i]].item() - lse
    return out.reshape(labels.shape)


def loop_entropy(logits, temperature=1.0):
    """H = −Σ p log p, one row at a time in float64."""
    x = logits.detach().double().reshape(-1, logits.shape[-1]) / temperature
    out = torch.empty(x.shape[0], dtype=F64)
    for i in range(x.shape[0]):
        m = max(x[i].tolist())
        z = sum(math.exp(v - m) for v in x[i].tolist())
        ps = [math.exp(v - m) / z for v in x[i].tolist()]
        out[i] = -sum(p * math.log(p) for p in ps if p > 0)
    return out.reshape(logits.shape[:-1])


def naive_logprobs(logits, labels, temperature=1.0):
    return torch.log_softmax(logits / temperature, dim=-1).gather(-1, labels[..., None])[..., 0]


def naive_entropy(logits, temperature=1.0):
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def naive_head_logits(hidden, weight, bias=None, *, softcap=None, logit_scale=1.0, temperature=1.0):
    z = hidden @ weight.T + (0 if bias is None else bias)
    z = logit_scale * z
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return z / temperature


def loop_sequence(logprobs, mask, average=False):
    out = torch.zeros(logprobs.shape[:-1], dtype=logprobs.dtype).reshape(-1)
    lp, m = logprobs.reshape(-1, logprobs.shape[-1]), mask.reshape(-1, mask.shape[-1])
    for b in range(lp.shape[0]):
        vals = [lp[b, t].item() for t in range(lp.shape[1]) if m[b, t]]
        out[b] = (sum(vals) / len(vals) if vals else 0.0) if average else sum(vals)
    return out.reshape(logprobs.shape[:-1])


# --- golden values ----------------------------------------------------------------------------
def test_golden_values():
    logits = torch.tensor([[0.0, 0.0], [0.0, 1.0], [0.0, 2.0]])
    lp = token_logprobs(logits, torch.tensor([0, 1, 0]))
    expected = torch.tensor([-math.log(2), -math.log(1 + math.exp(-1)), -math.log(1 + math.exp(2))])
    torch.testing.assert_close(lp, expected)
    # τ = 2 turns [0, 2] into [0, 1]
    torch.testing.assert_close(token_logprobs(logits[2:], torch.tensor([1]), temperature=2.0), expected[1:2])
    torch.testing.assert_close(entropy_from_logits(torch.zeros(3, 4)), torch.full((3,), math.log(4)))
    # p = (1/(1+e), e/(1+e)): H = log(1+e) − e/(1+e)
    e = math.e
    torch.testing.assert_close(entropy_from_logits(torch.tensor([0.0, 1.0])),
                               torch.tensor(math.log(1 + e) - e / (1 + e)))
    lp_h, ent_h = hidden_logprobs(torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 0.0], [1.0, 0.0]]),
                                  torch.tensor([1]), with_entropy=True)
    torch.testing.assert_close(lp_h, expected[1:2])
    torch.testing.assert_close(ent_h, torch.tensor([math.log(1 + e) - e / (1 + e)]))
    seq = torch.tensor([[-1.0, -2.0, -4.0], [-1.0, 0.0, 0.0]])
    m = torch.tensor([[True, True, False], [False, False, False]])
    torch.testing.assert_close(sequence_logprobs(seq, m), torch.tensor([-3.0, 0.0]))
    torch.testing.assert_close(sequence_logprobs(seq, m, average=True), torch.tensor([-1.5, 0.0]))


# --- token_logprobs ---------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(7,), (5, 7), (2, 3, 7), (2, 1, 3, 7)])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.5])
@pytest.mark.parametrize("chunk_size", [None, 1, 4])
def test_token_logprobs_matches_loop_reference(shape, temperature, chunk_size):
    x = _logits(*shape)
    y = _labels(shape[:-1], shape[-1])
    got = token_logprobs(x, y, temperature=temperature, chunk_size=chunk_size)
    assert got.shape == shape[:-1] and got.dtype == F64
    torch.testing.assert_close(got, loop_logprobs(x, y, temperature), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_token_logprobs_gradient_matches_naive_float64(temperature):
    x = _logits(3, 5, 11).requires_grad_()
    y = _labels((3, 5), 11)
    g = torch.randn(3, 5, generator=_gen(2), dtype=F64)
    ours = token_logprobs(x, y, temperature=temperature, chunk_size=4)
    ref = naive_logprobs(x, y, temperature)
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    (g_ours,) = torch.autograd.grad(ours, x, g)
    (g_ref,) = torch.autograd.grad(ref, x, g)
    torch.testing.assert_close(g_ours, g_ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype, atol, grad_atol", [
    # inputs are exactly representable: values are float32 maths on them (about 1e-6); gradients
    # are rounded to the input dtype (bf16 keeps 8 bits: |g| ≤ 1 ⇒ error ≤ 2^-8).
    (torch.float32, 2e-6, 1e-6),
    (torch.bfloat16, 2e-6, 4e-3),
    (torch.float16, 2e-6, 1e-3),
])
def test_token_logprobs_low_precision(dtype, atol, grad_atol):
    x = _logits(4, 6, 50, dtype=dtype).requires_grad_()
    y = _labels((4, 6), 50)
    g = torch.rand(4, 6, generator=_gen(3))
    got = token_logprobs(x, y, temperature=0.9, chunk_size=5)
    assert got.dtype == torch.float32
    x64 = x.detach().double().requires_grad_()
    ref = naive_logprobs(x64, y, 0.9)
    torch.testing.assert_close(got.double(), ref, rtol=0, atol=atol * 10)
    (g_ours,) = torch.autograd.grad(got, x, g)
    (g_ref,) = torch.autograd.grad(ref, x64, g.double())
    assert g_ours.dtype == dtype
    torch.testing.assert_close(g_ours.double(), g_ref, rtol=0, atol=grad_atol)


def test_token_logprobs_sliced_and_strided_inputs_need_no_copy():
    base = _logits(3, 6, 9).requires_grad_()
    y = _labels((3, 6), 9)
    for view, lab in [(base[:, :-1], y[:, :-1]), (base.transpose(0, 1), y.T), (base[:, 1::2], y[:, 1::2])]:
        got = token_logprobs(view, lab, chunk_size=2)
        torch.testing.assert_close(got, naive_logprobs(view, lab), rtol=1e-12, atol=1e-12)
        (g1,) = torch.autograd.grad(got.sum(), base)
        (g2,) = torch.autograd.grad(naive_logprobs(view, lab).sum(), base)
        torch.testing.assert_close(g1, g2, rtol=1e-12, atol=1e-12)


def test_token_logprobs_extreme_and_masked_logits():
    x = torch.tensor([[1e4, -1e4, 0.0], [0.0, -float("inf"), 1.0]], requires_grad=True)
    y = torch.tensor([0, 2])
    lp = token_logprobs(x, y)
    torch.testing.assert_close(lp, torch.tensor([0.0, -math.log(1 + math.exp(-1))]))
    (g,) = torch.autograd.grad(lp.sum(), x)
    assert torch.isfinite(g).all() and g[1, 1] == 0


def test_token_logprobs_empty_rows():
    x = torch.zeros(0, 3, 5, requires_grad=True)
    lp = token_logprobs(x, torch.zeros(0, 3, dtype=torch.long))
    assert lp.shape == (0, 3)
    (g,) = torch.autograd.grad(lp.sum(), x)
    assert g.shape == x.shape


# --- entropy ----------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(7,), (2, 3, 7)])
@pytest.mark.parametrize("temperature", [1.0, 0.5, 3.0])
def test_entropy_matches_loop_reference_and_naive_gradient(shape, temperature):
    x = _logits(*shape).requires_grad_()
    got = entropy_from_logits(x, temperature=temperature, chunk_size=2)
    torch.testing.assert_close(got, loop_entropy(x, temperature), rtol=1e-12, atol=1e-12)
    g = torch.randn(shape[:-1], generator=_gen(4), dtype=F64)
    (g_ours,) = torch.autograd.grad(got, x, g)
    (g_ref,) = torch.autograd.grad(naive_entropy(x, temperature), x, g)
    torch.testing.assert_close(g_ours, g_ref, rtol=1e-12, atol=1e-12)


def test_entropy_low_precision_and_masked_vocabulary():
    x = _logits(3, 40, dtype=torch.bfloat16).requires_grad_()
    got = entropy_from_logits(x, chunk_size=2)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), loop_entropy(x), rtol=0, atol=1e-5)
    (g,) = torch.autograd.grad(got.sum(), x)
    x64 = x.detach().double().requires_grad_()
    (g_ref,) = torch.autograd.grad(naive_entropy(x64).sum(), x64)
    torch.testing.assert_close(g.double(), g_ref, rtol=0, atol=4e-3)
    # −inf logits (masked vocabulary) count as p = 0: finite value, zero gradient there
    xm = torch.tensor([[0.0, -float("inf"), 0.0]], requires_grad=True)
    h = entropy_from_logits(xm)
    torch.testing.assert_close(h, torch.tensor([math.log(2)]))
    (gm,) = torch.autograd.grad(h.sum(), xm)
    assert torch.isfinite(gm).all() and gm[0, 1] == 0


def test_entropy_identity_with_token_logprobs():
    """H = −Σ_v exp(logp_v)·logp_v, with logp_v from token_logprobs for every label v."""
    x = _logits(2, 3, 6)
    every = torch.stack([token_logprobs(x, torch.full((2, 3), v), temperature=0.8) for v in range(6)], -1)
    torch.testing.assert_close(entropy_from_logits(x, temperature=0.8), -(every.exp() * every).sum(-1),
                               rtol=1e-12, atol=1e-12)


# --- hidden_logprobs --------------------------------------------------------------------------
HIDDEN_CONFIGS = [
    dict(),
    dict(temperature=0.7),
    dict(softcap=2.0, logit_scale=1.5),
    dict(softcap=3.0, temperature=1.3, logit_scale=0.5),
]


@pytest.mark.parametrize("config", HIDDEN_CONFIGS)
@pytest.mark.parametrize("use_bias", [False, True])
@pytest.mark.parametrize("chunk_size", [3, 4, 64])
def test_hidden_logprobs_matches_naive_values_and_gradients(config, use_bias, chunk_size):
    h = _logits(2, 3, 5, scale=1.0).requires_grad_()
    w = _logits(11, 5, scale=1.0, seed=7).requires_grad_()
    b = _logits(11, scale=1.0, seed=8).requires_grad_() if use_bias else None
    y = _labels((2, 3), 11)
    lp, ent = hidden_logprobs(h, w, y, bias=b, chunk_size=chunk_size, with_entropy=True, **config)
    logits = naive_head_logits(h, w, b, **config)
    lp_ref, ent_ref = naive_logprobs(logits, y), naive_entropy(logits)
    torch.testing.assert_close(lp, lp_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ent, ent_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lp, loop_logprobs(logits, y), rtol=1e-12, atol=1e-12)
    g1 = torch.randn(2, 3, generator=_gen(5), dtype=F64)
    g2 = torch.randn(2, 3, generator=_gen(6), dtype=F64)
    params = [p for p in (h, w, b) if p is not None]
    ours = torch.autograd.grad((lp * g1).sum() + (ent * g2).sum(), params)
    refs = torch.autograd.grad((lp_ref * g1).sum() + (ent_ref * g2).sum(), params, retain_graph=True)
    for a, r in zip(ours, refs):
        torch.testing.assert_close(a, r, rtol=1e-11, atol=1e-12)
    # without entropy: a single output, same log-probs and log-prob gradient
    lp_only = hidden_logprobs(h, w, y, bias=b, chunk_size=chunk_size, **config)
    torch.testing.assert_close(lp_only, lp, rtol=0, atol=0)
    ours = torch.autograd.grad((lp_only * g1).sum(), params)
    refs = torch.autograd.grad((lp_ref * g1).sum(), params)
    for a, r in zip(ours, refs):
        torch.testing.assert_close(a, r, rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("config", HIDDEN_CONFIGS)
@pytest.mark.parametrize("chunk_size", [3, 4, 64])
def test_hidden_logprobs_stats_match_naive_full_logits(config, chunk_size):
    """with_stats: top1 = (argmax of the full logits == label, first index on ties), mean_logit =
    mean of the full logits over the vocabulary, entropy and log-probs as without; same gradient."""
    h = _logits(3, 4, 5, scale=1.0).requires_grad_()
    w = _logits(11, 5, scale=1.0, seed=7).requires_grad_()
    w.data[2] = w.data[9] = 4 * w.data[2] / w.data[2].norm()  # rows 2 and 9: equal logits, a tie across blocks
    h.data[1, :2] = w.data[2]                                   # ... which is the maximum of these two rows
    y = _labels((3, 4), 11)
    logits = naive_head_logits(h, w, **config)
    y[0] = logits[0].argmax(-1)  # label on the argmax: top1
    y[1, :2] = 9                 # label on the later copy of the tied maximum: not top1 (argmax says 2)
    assert (logits[1, :2].argmax(-1) == 2).all()
    out = hidden_logprobs(h, w, y, chunk_size=chunk_size, with_stats=True, **config)
    torch.testing.assert_close(out.logprobs, naive_logprobs(logits, y), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out.entropy, naive_entropy(logits), rtol=1e-12, atol=1e-12)
    assert out.top1.dtype == torch.bool and torch.equal(out.top1, logits.argmax(-1) == y)
    assert out.top1[0].all() and not out.top1[1, :2].any() and out.top1.shape == y.shape
    torch.testing.assert_close(out.mean_logit, logits.mean(-1), rtol=1e-12, atol=1e-12)
    assert not out.top1.requires_grad and not out.mean_logit.requires_grad
    g = torch.randn(3, 4, generator=_gen(5), dtype=F64)
    ours = torch.autograd.grad((out.logprobs * g).sum() + out.entropy.sum(), (h, w))
    plain_lp, plain_ent = hidden_logprobs(h, w, y, chunk_size=chunk_size, with_entropy=True, **config)
    refs = torch.autograd.grad((plain_lp * g).sum() + plain_ent.sum(), (h, w))
    for a, r in zip(ours, refs):
        torch.testing.assert_close(a, r, rtol=0, atol=0)
    empty = hidden_logprobs(h[:0], w, y[:0], with_stats=True)
    assert empty.top1.shape == (0, 4) and empty.mean_logit.shape == (0, 4)


def test_hidden_entropy_gradient_alone_is_not_dropped():
    h = _logits(4, 3, scale=1.0).requires_grad_()
    w = _logits(7, 3, scale=1.0, seed=9).requires_grad_()
    y = _labels((4,), 7)
    _, ent = hidden_logprobs(h, w, y, chunk_size=3, with_entropy=True, softcap=2.0)
    gh, gw = torch.autograd.grad(ent.sum(), (h, w))
    rh, rw = torch.autograd.grad(naive_entropy(naive_head_logits(h, w, softcap=2.0)).sum(), (h, w))
    assert gh.abs().sum() > 0
    torch.testing.assert_close(gh, rh, rtol=1e-11, atol=1e-12)
    torch.testing.assert_close(gw, rw, rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 2e-5), (torch.bfloat16, 5e-2)])
def test_hidden_logprobs_low_precision(dtype, atol):
    """float32 within float32 rounding; bf16: the head's matmul is rounded to bf16 (as in the
    model), logits of magnitude ~4 carry errors up to ~2^-6, log-probs about as much."""
    h = _logits(16, 8, scale=1.0, dtype=dtype).requires_grad_()
    w = _logits(40, 8, scale=0.7, seed=3, dtype=dtype).requires_grad_()
    y = _labels((16,), 40)
    lp, ent = hidden_logprobs(h, w, y, chunk_size=16, with_entropy=True, temperature=0.9)
    assert lp.dtype == ent.dtype == torch.float32
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    logits = naive_head_logits(h64, w64, temperature=0.9)
    torch.testing.assert_close(lp.double(), naive_logprobs(logits, y), rtol=0, atol=atol)
    torch.testing.assert_close(ent.double(), naive_entropy(logits), rtol=0, atol=atol)
    gh, gw = torch.autograd.grad(lp.sum() + ent.sum(), (h, w))
    rh, rw = torch.autograd.grad(naive_logprobs(logits, y).sum() + naive_entropy(logits).sum(), (h64, w64))
    assert gh.dtype == gw.dtype == dtype
    torch.testing.assert_close(gh.double(), rh, rtol=0, atol=atol * 4)
    torch.testing.assert_close(gw.double(), rw, rtol=0, atol=atol * 4)


class _MatmulDtypes(TorchDispatchMode):
    """Records the dtype of every matrix product dispatched while active."""

    def __init__(self):
        super().__init__()
        self.dtypes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm):
            self.dtypes.append(args[-1].dtype)
        return func(*args, **(kwargs or {}))


def test_hidden_logprobs_backward_runs_under_the_forwards_autocast():
    """Under bf16 autocast the backward's recomputed blocks and gradient products are bf16 like
    the forward's (consistent with the forward's log-normaliser, and at bf16 speed); the
    gradients keep the inputs' dtype and agree with the autocast naive path."""
    h = _logits(24, 16, scale=1.0, dtype=torch.float32).requires_grad_()
    w = _logits(50, 16, scale=0.5, seed=3, dtype=torch.float32).requires_grad_()
    y = _labels((24,), 50)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp = hidden_logprobs(h, w, y, chunk_size=16)
        naive = torch.log_softmax((h @ w.T).float(), -1).gather(-1, y[:, None])[:, 0]
    with _MatmulDtypes() as seen:
        gh, gw = torch.autograd.grad(lp.sum(), (h, w))
    assert seen.dtypes and set(seen.dtypes) == {torch.bfloat16}
    assert gh.dtype == gw.dtype == torch.float32
    rh, rw = torch.autograd.grad(naive.sum(), (h, w))
    torch.testing.assert_close(lp, naive, rtol=0, atol=2e-2)
    torch.testing.assert_close(gh, rh, rtol=0, atol=3e-2)
    torch.testing.assert_close(gw, rw, rtol=0, atol=3e-2)
    with _MatmulDtypes() as seen:  # without autocast, float32 throughout
        torch.autograd.grad(hidden_logprobs(h, w, y, chunk_size=16).sum(), (h, w))
    assert set(seen.dtypes) == {torch.float32}


def test_hidden_logprobs_equals_token_logprobs_of_the_logits():
    h, w = _logits(2, 4, 6, scale=1.0), _logits(13, 6, seed=2, scale=1.0)
    y = _labels((2, 4), 13)
    logits = naive_head_logits(h, w, softcap=5.0)
    lp, ent = hidden_logprobs(h, w, y, softcap=5.0, temperature=0.8, chunk_size=5, with_entropy=True)
    torch.testing.assert_close(lp, token_logprobs(logits, y, temperature=0.8), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ent, entropy_from_logits(logits, temperature=0.8), rtol=1e-12, atol=1e-12)


def test_hidden_logprobs_label_out_of_range_is_named_not_garbage():
    """An id outside [0, V) is refused naming labels (it used to come back as a NaN row)."""
    h = torch.randn(3, 4, generator=_gen(), dtype=F64, requires_grad=True)
    w = torch.randn(5, 4, generator=_gen(1), dtype=F64, requires_grad=True)
    for bad in (5, -1):
        with pytest.raises(ValueError, match=rf"labels: expected ids in \[0, 5\) \(the vocabulary V\), got ids from "
                                             rf"{min(bad, 0)} to {max(bad, 4)}"):
            hidden_logprobs(h, w, torch.tensor([0, bad, 4]), chunk_size=2, softcap=3.0)
    # the valid rows alone: gradients as the naive head's
    keep = torch.tensor([0, 2])
    lp = hidden_logprobs(h[keep], w, torch.tensor([0, 4]), chunk_size=2, softcap=3.0)
    gh, gw = torch.autograd.grad(lp.sum(), (h, w))
    rh, rw = torch.autograd.grad(naive_logprobs(naive_head_logits(h[keep], w, softcap=3.0),
                                                torch.tensor([0, 4])).sum(), (h, w))
    torch.testing.assert_close(gh, rh, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gw, rw, rtol=1e-12, atol=1e-12)


# --- gradcheck (float64, tiny) ----------------------------------------------------------------
def test_gradcheck_token_logprobs():
    x = _logits(2, 3, 5, scale=1.0).requires_grad_()
    y = _labels((2, 3), 5)
    assert torch.autograd.gradcheck(
        lambda x: token_logprobs(x[:, :-1], y[:, :-1], temperature=0.6, chunk_size=3), (x,))


def test_gradcheck_entropy():
    x = _logits(2, 3, 5, scale=1.0).requires_grad_()
    assert torch.autograd.gradcheck(lambda x: entropy_from_logits(x[:, 1:], temperature=1.6, chunk_size=3), (x,))


@pytest.mark.parametrize("with_entropy", [False, True])
def test_gradcheck_hidden_logprobs(with_entropy):
    h = _logits(2, 3, 4, scale=1.0).requires_grad_()
    w = _logits(9, 4, scale=1.0, seed=3).requires_grad_()
    b = _logits(9, scale=1.0, seed=4).requires_grad_()
    y = _labels((2, 3), 9)
    fn = lambda h, w, b: hidden_logprobs(h, w, y, bias=b, temperature=0.8, softcap=2.0,  # noqa: E731
                                         logit_scale=1.3, chunk_size=4, with_entropy=with_entropy)
    assert torch.autograd.gradcheck(fn, (h, w, b))


# --- hypothesis -------------------------------------------------------------------------------
@settings(max_examples=30, deadline=None)
@given(lead=st.lists(st.integers(1, 4), min_size=0, max_size=3), vocab=st.integers(1, 30),
       temperature=st.floats(0.25, 4.0), chunk_size=st.one_of(st.none(), st.integers(1, 7)),
       seed=st.integers(0, 2**16))
def test_property_token_logprobs_and_entropy(lead, vocab, temperature, chunk_size, seed):
    x = _logits(*lead, vocab, seed=seed).requires_grad_()
    y = _labels(lead, vocab, seed=seed + 1)
    lp = token_logprobs(x, y, temperature=temperature, chunk_size=chunk_size)
    ent = entropy_from_logits(x, temperature=temperature, chunk_size=chunk_size)
    torch.testing.assert_close(lp, naive_logprobs(x, y, temperature), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ent, naive_entropy(x, temperature), rtol=1e-10, atol=1e-12)
    assert (lp <= 1e-12).all() and (ent >= -1e-12).all() and (ent <= math.log(vocab) + 1e-9).all()
    g_ours = torch.autograd.grad(lp.sum() + ent.sum(), x)[0]
    g_ref = torch.autograd.grad(naive_logprobs(x, y, temperature).sum() + naive_entropy(x, temperature).sum(), x)[0]
    torch.testing.assert_close(g_ours, g_ref, rtol=1e-10, atol=1e-12)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 9), vocab=st.integers(1, 17), hidden=st.integers(1, 5), chunk=st.integers(1, 8),
       temperature=st.floats(0.3, 3.0), softcap=st.one_of(st.none(), st.floats(0.5, 10.0)),
       seed=st.integers(0, 2**16))
def test_property_hidden_logprobs(n, vocab, hidden, chunk, temperature, softcap, seed):
    h = _logits(n, hidden, scale=1.0, seed=seed).requires_grad_()
    w = _logits(vocab, hidden, scale=1.0, seed=seed + 1).requires_grad_()
    y = _labels((n,), vocab, seed=seed + 2)
    kw = dict(temperature=temperature, softcap=softcap)
    lp, ent = hidden_logprobs(h, w, y, chunk_size=chunk, with_entropy=True, **kw)
    logits = naive_head_logits(h, w, softcap=softcap, temperature=temperature)
    torch.testing.assert_close(lp, naive_logprobs(logits, y), rtol=1e-11, atol=1e-12)
    torch.testing.assert_close(ent, naive_entropy(logits), rtol=1e-10, atol=1e-12)
    ours = torch.autograd.grad(lp.sum() - ent.sum(), (h, w))
    refs = torch.autograd.grad(naive_logprobs(logits, y).sum() - naive_entropy(logits).sum(), (h, w))
    for a, r in zip(ours, refs):
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-11)


# --- sequence_logprobs ------------------------------------------------------------------------
@pytest.mark.parametrize("average", [False, True])
def test_sequence_logprobs_matches_loop_and_ignores_padding(average):
    lengths = torch.tensor([3, 0, 5, 1])
    mask = right_padded_mask(lengths, 5)
    lp = -torch.rand(4, 5, generator=_gen(), dtype=F64)
    garbage = torch.where(mask, lp, torch.full_like(lp, float("nan"))).requires_grad_()
    got = sequence_logprobs(garbage, mask, average=average)
    torch.testing.assert_close(got, loop_sequence(lp, mask, average), rtol=1e-12, atol=1e-12)
    (g,) = torch.autograd.grad(got.sum(), garbage)
    assert torch.isfinite(g).all() and (g[~mask] == 0).all()
    expected = 1.0 / lengths.clamp(min=1).double()[:, None].expand(4, 5) if average else torch.ones(4, 5, dtype=F64)
    torch.testing.assert_close(g[mask], expected[mask])
    batch = TensorDict({K.LOGPROBS: lp, K.RESPONSE_MASK: mask}, batch_size=[4])
    assert_padding_invariant(lambda td: sequence_logprobs(td[K.LOGPROBS], td[K.RESPONSE_MASK], average=average),
                             batch, fill=float("nan"))


def test_sequence_logprobs_average_identity_and_leading_dims():
    lp = -torch.rand(2, 3, 6, generator=_gen(), dtype=F64)
    mask = torch.rand(2, 3, 6, generator=_gen(1)) > 0.4
    total = sequence_logprobs(lp, mask)
    assert total.shape == (2, 3)
    torch.testing.assert_close(sequence_logprobs(lp, mask, average=True), total / mask.sum(-1).clamp(min=1))
    torch.testing.assert_close(total, loop_sequence(lp, mask))


def test_token_logprobs_padding_rows_do_not_leak():
    """Rows are independent: NaN logits on padded positions change no other row, value or grad."""
    x = _logits(2, 4, 6)
    y = _labels((2, 4), 6)
    padded = torch.cat([x, torch.full((2, 3, 6), float("nan"), dtype=F64)], 1).requires_grad_()
    y_pad = torch.cat([y, torch.zeros(2, 3, dtype=torch.long)], 1)
    mask = right_padded_mask(torch.tensor([4, 4]), 7)
    lp = token_logprobs(padded, y_pad, chunk_size=3)
    torch.testing.assert_close(lp[:, :4], token_logprobs(x, y), rtol=0, atol=0)
    seq = sequence_logprobs(lp, mask)
    torch.testing.assert_close(seq, token_logprobs(x, y).sum(-1), rtol=1e-14, atol=1e-14)
    (g,) = torch.autograd.grad(seq.sum(), padded)
    assert torch.isfinite(g[:, :4]).all()


# --- purity -----------------------------------------------------------------------------------
def test_pure():
    x = _logits(2, 3, 7, dtype=torch.float32)
    y = _labels((2, 3), 7)
    assert_pure(token_logprobs, x, y, temperature=0.7, chunk_size=2)
    assert_pure(entropy_from_logits, x, temperature=1.3)
    h, w, b = _logits(2, 3, 4), _logits(7, 4, seed=1), _logits(7, seed=2)
    assert_pure(hidden_logprobs, h, w, y, bias=b, softcap=3.0, chunk_size=3, with_entropy=True)
    assert_pure(sequence_logprobs, x[..., 0], y > 2, average=True)
    # backward leaves the saved inputs untouched as well
    xr = x.clone().requires_grad_()
    before = xr.detach().clone()
    version = xr._version
    torch.autograd.grad(token_logprobs(xr, y).sum() + entropy_from_logits(xr).sum(), xr)
    assert xr._version == version and torch.equal(xr.detach(), before)


# --- bad input --------------------------------------------------------------------------------
def test_bad_inputs_raise_with_names_and_shapes():
    x = torch.zeros(2, 3, 5)
    with pytest.raises(ValueError, match=r"labels: expected shape \[2, 3\].*got \[2, 4\]"):
        token_logprobs(x, torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(TypeError, match="labels: expected an integer"):
        token_logprobs(x, torch.zeros(2, 3))
    with pytest.raises(TypeError, match="logits: expected a floating-point"):
        token_logprobs(torch.zeros(2, 3, 5, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="logits: expected at least 1 dims"):
        entropy_from_logits(torch.tensor(1.0))
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(x, torch.zeros(2, 3, dtype=torch.long), temperature=0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        entropy_from_logits(x, chunk_size=0)
    h, w = torch.zeros(2, 3, 4), torch.zeros(6, 4)
    y = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match=r"weight: expected shape \[V, 4\].*got \[6, 5\]"):
        hidden_logprobs(h, torch.zeros(6, 5), y)
    with pytest.raises(TypeError, match="weight: expected dtype torch.float32"):
        hidden_logprobs(h, w.double(), y)
    with pytest.raises(ValueError, match=r"bias: expected shape \[6\].*got \[5\]"):
        hidden_logprobs(h, w, y, bias=torch.zeros(5))
    with pytest.raises(ValueError, match=r"labels: expected shape \[2, 3\].*got \[3\]"):
        hidden_logprobs(h, w, torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="softcap"):
        hidden_logprobs(h, w, y, softcap=-1.0)
    with pytest.raises(TypeError, match="mask: expected a torch.bool mask"):
        sequence_logprobs(torch.zeros(2, 3), torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"mask: expected shape \[2, 3\] \(the shape of logprobs\), got \[2, 4\]"):
        sequence_logprobs(torch.zeros(2, 3), torch.ones(2, 4, dtype=torch.bool))


# --- memory structure -------------------------------------------------------------------------
class _Allocations(TorchDispatchMode):
    """Records every tensor an op creates (not views, not in-place or ``out=`` results)."""

    def __init__(self):
        super().__init__()
        self.created: list[tuple[str, int, torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        seen = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                self.created.append((str(func), t.numel(), t.dtype))
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_logprobs_never_materialises_full_size_temporaries(dtype):
    n, vocab, rows = 64, 500, 8
    x = _logits(n, vocab, dtype=dtype).requires_grad_()
    y = _labels((n,), vocab)
    with _Allocations() as fwd:
        lp = token_logprobs(x, y, chunk_size=rows)
    assert max(size for _, size, _ in fwd.created) <= rows * vocab, fwd.created
    # the graph keeps the logits themselves, the labels and [N] vectors; nothing else of size N·V
    saved = lp.grad_fn.saved_tensors
    assert any(t.data_ptr() == x.data_ptr() for t in saved)
    assert all(t.numel() <= n for t in saved if t.data_ptr() != x.data_ptr())
    with _Allocations() as bwd:
        (g,) = torch.autograd.grad(lp.sum(), x)
    big = [c for c in bwd.created if c[1] > rows * vocab]
    assert len(big) == 1 and big[0][1] == n * vocab and big[0][2] == dtype, bwd.created  # the gradient
    ent = entropy_from_logits(x, chunk_size=rows)
    with _Allocations() as bwd:
        torch.autograd.grad(ent.sum(), x)
    assert len([c for c in bwd.created if c[1] > rows * vocab]) == 1, bwd.created


def test_hidden_logprobs_never_materialises_the_logits():
    n, vocab, hidden, chunk = 64, 1000, 8, 100
    h = _logits(n, hidden, dtype=torch.float32).requires_grad_()
    w = _logits(vocab, hidden, dtype=torch.float32, seed=1).requires_grad_()
    y = _labels((n,), vocab)
    with _Allocations() as fwd:
        lp, ent = hidden_logprobs(h, w, y, chunk_size=chunk, with_entropy=True, softcap=5.0)
    assert max(size for _, size, _ in fwd.created) <= n * chunk, fwd.created
    node = lp.grad_fn.next_functions[0][0]  # through the final view, the custom Function's node
    assert all(t.numel() <= max(n * hidden, vocab * hidden) for t in node.saved_tensors if t is not None)
    with _Allocations() as bwd:
        torch.autograd.grad(lp.sum() + ent.sum(), (h, w))
    # backward: blocks of [n, chunk], and the gradients [n, H], [V, H]; never [n, V]
    assert max(size for _, size, _ in bwd.created) <= max(n * chunk, vocab * hidden) < n * vocab // 4


# --- parity with TRL --------------------------------------------------------------------------
@pytest.mark.trl
@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 5e-2)])
def test_parity_with_trl_selective_log_softmax(dtype, atol):
    """TRL computes bf16 log-softmax in bf16 (errors ~|logp|·2^-8); ours computes in float32."""
    trl_utils = pytest.importorskip("trl.trainer.utils")
    x = _logits(3, 5, 40, dtype=dtype)
    y = _labels((3, 5), 40)
    for temperature in (1.0, 0.7):
        theirs = trl_utils.selective_log_softmax(x, y, temperature=temperature)
        ours = token_logprobs(x, y, temperature=temperature)
        torch.testing.assert_close(ours, theirs.float(), rtol=0, atol=atol * max(1.0, theirs.abs().max().item()))
    torch.testing.assert_close(entropy_from_logits(x), trl_utils.entropy_from_logits(x).float(), rtol=0,
                               atol=atol * 4)


# --- torch.compile ----------------------------------------------------------------------------
@pytest.mark.slow
def test_traces_under_torch_compile_without_graph_breaks():
    x = _logits(2, 5, 9, dtype=torch.float32).requires_grad_()
    y = _labels((2, 5), 9)
    h, w = _logits(6, 4, dtype=torch.float32), _logits(9, 4, dtype=torch.float32, seed=1).requires_grad_()
    yh = _labels((6,), 9)

    def fn(x, w):
        lp, ent = hidden_logprobs(h, w, yh, chunk_size=4, with_entropy=True, softcap=3.0)
        return token_logprobs(x, y, temperature=0.7, chunk_size=3).sum() + entropy_from_logits(x).sum() + \
            lp.sum() + ent.sum()

    compiled = torch.compile(fn, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x, w), fn(x, w))
    g1 = torch.autograd.grad(compiled(x, w), (x, w))
    g2 = torch.autograd.grad(fn(x, w), (x, w))
    torch.testing.assert_close(g1, g2)


def test_token_logprobs_minus_inf_label_gives_finite_gradient():
    """A label with a −inf logit (masked vocabulary at a padded position) has log-prob −inf, and
    a zero upstream gradient (the position is masked out) must leave no NaN in the gradient."""
    x = torch.tensor([[0.0, -float("inf"), 1.0], [0.5, 0.2, 0.1]], requires_grad=True)
    lp = token_logprobs(x, torch.tensor([1, 0]))
    assert lp[0] == -float("inf") and torch.isfinite(lp[1])
    masked = sequence_logprobs(lp[None], torch.tensor([[False, True]]))
    (g,) = torch.autograd.grad(masked.sum(), x)
    assert torch.isfinite(g).all() and (g[0] == 0).all()


def test_hidden_logprobs_degenerate_widths():
    """No rows: empty results that still backpropagate; a zero-width hidden state: uniform logits."""
    h0 = torch.zeros(0, 5, requires_grad=True)
    lp, ent = hidden_logprobs(h0, torch.zeros(4, 5), torch.zeros(0, dtype=torch.long), with_entropy=True)
    assert lp.shape == ent.shape == (0,)
    assert torch.autograd.grad(lp.sum(), h0)[0].shape == (0, 5)
    h, b = torch.zeros(3, 0, requires_grad=True), torch.tensor([0.0, 0, 0, 1], requires_grad=True)
    lp = hidden_logprobs(h, torch.zeros(4, 0), torch.tensor([0, 1, 3]), bias=b)
    ref = torch.log_softmax(b, -1)[[0, 1, 3]]
    torch.testing.assert_close(lp, ref)
    torch.testing.assert_close(torch.autograd.grad(lp.sum(), b)[0], torch.autograd.grad(ref.sum(), b)[0])


def test_chunk_budgets_are_larger_on_an_accelerator():
    """A GPU's chunks are ``_GPU_SCALE`` times a CPU's (launch-bound otherwise); ``chunk_size`` still wins."""
    from rlcore import logprobs as L
    from rlcore.lm_head import _hidden_rows

    cpu, gpu = torch.device("cpu"), torch.device("meta")
    assert L._rows_per_chunk(151_936, None, cpu) == L._CHUNK_BYTES // (4 * 151_936)
    assert L._rows_per_chunk(151_936, None, gpu) == L._GPU_SCALE * L._CHUNK_BYTES // (4 * 151_936)
    assert L._rows_per_chunk(151_936, 7, gpu) == 7
    assert _hidden_rows(4096, gpu) == L._GPU_SCALE * _hidden_rows(4096, cpu)


def test_hidden_logprobs_label_outside_the_vocabulary_is_a_nan_row_when_unchecked(monkeypatch):
    """Where the eager label check is skipped (under torch.compile), an id outside ``[0, V)`` gives
    a NaN log-prob for its row; the other rows and their gradients are unchanged."""
    from rlcore import lm_head

    monkeypatch.setattr(lm_head, "_check_labels", lambda *a, **k: None)
    h = _logits(4, 6, dtype=torch.float32).requires_grad_()
    w = _logits(50, 6, dtype=torch.float32, seed=3)
    lp = hidden_logprobs(h, w, torch.tensor([1, 50, 7, -3]))
    assert lp[[1, 3]].isnan().all() and torch.isfinite(lp[[0, 2]]).all()
    good = hidden_logprobs(h, w, torch.tensor([1, 0, 7, 0]))
    torch.testing.assert_close(lp[[0, 2]], good[[0, 2]])
    (g,) = torch.autograd.grad(lp[[0, 2]].sum(), (h,))
    (ref,) = torch.autograd.grad(good[[0, 2]].sum(), (h,))
    torch.testing.assert_close(g, ref)
