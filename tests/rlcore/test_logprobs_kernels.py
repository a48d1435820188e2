"""The compiled CPU kernels of rlcore.logprobs (rlcore/_kernels.py) against its pure-PyTorch path.

Both paths compute in float32 for float32 / bfloat16 / float16 logits, so they agree to float32
rounding: values to ``1e-5`` (relative and absolute: |log p| up to ~30 here, whose float32 ulp is
2e-6, plus the kernels' exp, within 4e-7 relative), float32 gradients to ``2e-6`` (the gradient
``g·(onehot − p)/τ`` with ``|g| ≤ 1``; its error is that of ``p``, a few ulps of 1). Gradients in
bfloat16 / float16 are the same float32 numbers rounded once; where the two float32 values fall
on either side of a rounding boundary they differ by one ulp of the 16-bit type (at most 2^-7 /
2^-10 relative). No test times anything.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlcore import _kernels
from rlcore.logprobs import entropy_from_logits, token_logprobs

pytestmark = pytest.mark.skipif(_kernels.ops is None, reason="the compiled CPU kernels are not built here")

BIG = 3e38
LOWEST = torch.finfo(torch.float32).min
# (values rtol = atol, gradients rtol, gradients atol) per dtype
TOL = {torch.float32: (1e-5, 0.0, 2e-6), torch.bfloat16: (1e-5, 2**-7, 1e-6), torch.float16: (1e-5, 2**-10, 1e-6)}


@pytest.fixture
def pure(monkeypatch):
    """Runs its body on the pure-PyTorch path: ``pure(fn, *args, **kw)``."""

    def run(fn, *args, **kwargs):
        with monkeypatch.context() as m:
            m.setattr(_kernels, "ops", None)
            return fn(*args, **kwargs)
    return run


def _logits(*shape, dtype=torch.float32, scale=3.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def _both(pure, fn, x, *args, g=None, **kw):
    """``(value, gradient)`` of ``fn(x, ...)`` on the kernels and on the pure path, with the same
    upstream gradient ``g`` (uniform in [0, 1) unless given)."""
    out = []
    for run in (lambda f, *a, **k: f(*a, **k), pure):
        leaf = x.detach().clone().requires_grad_()
        val = run(fn, leaf, *args, **kw)
        up = torch.rand(val.shape, generator=torch.Generator().manual_seed(9)) if g is None else g
        (grad,) = run(torch.autograd.grad, val, leaf, up)
        out.append((val, grad))
    return out


def _assert_agree(ours, ref, dtype):
    tol, grad_rtol, grad_atol = TOL[dtype]
    (v1, g1), (v2, g2) = ours, ref
    assert v1.dtype == v2.dtype == torch.float32 and g1.dtype == g2.dtype == dtype
    torch.testing.assert_close(v1, v2, rtol=tol, atol=tol)
    torch.testing.assert_close(g1.float(), g2.float(), rtol=grad_rtol, atol=grad_atol)


def test_the_kernels_run_where_they_are_built():
    x = _logits(2, 3, 40).requires_grad_()
    assert _kernels.variant in _kernels.BUILDS
    assert _kernels.usable(x, 1.0) and not _kernels.usable(x.double(), 1.0)
    assert "TokenLogprobs" in type(token_logprobs(x, torch.zeros(2, 3, dtype=torch.long)).grad_fn).__name__
    assert "Entropy" in type(entropy_from_logits(x).grad_fn).__name__


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the kernels use OpenMP on Linux builds only")
def test_rows_spread_over_the_intra_op_threads():
    """at::parallel_for runs rows on torch's threads only where the build has OpenMP."""
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            assert _kernels.ops.parallel_threads(8) == threads
            assert _kernels.ops.parallel_threads(1) == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_results_do_not_depend_on_the_thread_count(dtype):
    """Each row is one thread's work, in the same order whatever the split: bitwise equal."""
    x = _logits(6, 7, 3001, dtype=dtype)
    y = torch.randint(0, 3001, (6, 7), generator=torch.Generator().manual_seed(1))
    before, out = torch.get_num_threads(), []
    try:
        for threads in (1, 2, 4):
            torch.set_num_threads(threads)
            leaf = x.clone().requires_grad_()
            lp, h = token_logprobs(leaf, y, temperature=0.7), entropy_from_logits(leaf)
            out.append((lp, h, torch.autograd.grad(lp.sum(), leaf)[0], torch.autograd.grad(h.sum(), leaf)[0]))
    finally:
        torch.set_num_threads(before)
    for other in out[1:]:
        for a, b in zip(out[0], other):
            assert torch.equal(a, b)


# vocabularies around the vector widths (16 / 32 floats per step) and the 2048-wide blocks
VOCABS = [1, 2, 31, 32, 33, 100, 2048, 2049, 5000]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("temperature", [1.0, 0.6, 2.5])
@pytest.mark.parametrize("vocab", VOCABS)
def test_token_logprobs_and_entropy_agree_with_the_pure_path(pure, dtype, temperature, vocab):
    x = _logits(3, 5, vocab, dtype=dtype, seed=vocab)
    y = torch.randint(0, vocab, (3, 5), generator=torch.Generator().manual_seed(1))
    y[0, 0], y[-1, -1] = 0, vocab - 1  # the vocabulary's edges
    for chunk_size in (None, 1, 4):  # the pure path's chunks: ragged against the 15 rows
        _assert_agree(*_both(pure, token_logprobs, x, y, temperature=temperature, chunk_size=chunk_size), dtype)
    ours, ref = _both(pure, entropy_from_logits, x, temperature=temperature, chunk_size=4)
    if dtype == torch.float32:
        _assert_agree(ours, ref, dtype)
    else:  # H's gradient −g·p·(log p + H)/τ cancels to near 0 where log p ≈ −H: judged in absolute terms
        torch.testing.assert_close(ours[0], ref[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours[1].float(), ref[1].float(), rtol=0, atol=TOL[dtype][1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_non_contiguous_inputs(pure, dtype):
    """Sliced leading dims are read in place; a strided vocabulary dim goes to the pure path."""
    base = _logits(4, 6, 70, dtype=dtype)
    y = torch.randint(0, 70, (4, 6), generator=torch.Generator().manual_seed(2))
    views = [(base[:, :-1], y[:, :-1]), (base.transpose(0, 1), y.T), (base[:, 1::2], y[:, 1::2]),
             (base[1:3, 2], y[1:3, 2])]
    for view, lab in views:
        assert _kernels.usable(view, 1.0)
        _assert_agree(*_both(pure, token_logprobs, view, lab, temperature=0.8), dtype)
        _assert_agree(*_both(pure, entropy_from_logits, view), dtype)
    strided = base.transpose(-1, -2).contiguous().transpose(-1, -2)  # V not contiguous
    assert not _kernels.usable(strided, 1.0)
    torch.testing.assert_close(token_logprobs(strided, y), pure(token_logprobs, base, y), rtol=0, atol=0)


def test_gradient_lands_in_the_leading_layout_of_a_view(pure):
    base = _logits(3, 5, 33).requires_grad_()
    y = torch.randint(0, 33, (3, 5), generator=torch.Generator().manual_seed(3))
    (g1,) = torch.autograd.grad(token_logprobs(base[:, 1::2], y[:, 1::2]).sum(), base)
    (g2,) = torch.autograd.grad(pure(token_logprobs, base[:, 1::2], y[:, 1::2]).sum(), base)
    torch.testing.assert_close(g1, g2, rtol=0, atol=2e-6)
    assert (g1[:, 0::2] == 0).all()


def _float64(fn, x, *args, temperature):
    """``(value, gradient)`` of the plain formula in float64 (where 3e38 is far from the range's end)."""
    x64 = x.detach().double().requires_grad_()
    logp = torch.log_softmax(x64 / temperature, dim=-1)
    val = fn(logp, *args)
    return val, torch.autograd.grad(val.sum(), x64)[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.5, 3.0])
def test_extreme_logits(pure, dtype, temperature):
    """Logits at ±3e38 (finite), −inf (masked vocabulary), ties at the top of the range: log p ≤ 0
    and finite gradients, both as the float64 formula gives them (the statistics are kept relative
    to the row maximum); a −inf label gives −inf, a finite one past the float32 range the lowest
    float32. The pure path agrees in values and gradients (its backward reads such chunks again
    through log_softmax: at τ ≥ 1 it has no shift, and an overflowing label leaves lse = +inf)."""
    inf = float("inf")
    x = torch.tensor([[BIG, -BIG, 0.0, 1.0], [BIG, BIG, -inf, -BIG], [-BIG, -BIG, -BIG, -BIG],
                      [0.0, -inf, 1.0, -inf], [-inf, -inf, 5.0, -inf], [1e30, -1e30, 3.0, 2.0]]).to(dtype)
    grad_rtol = TOL[dtype][1]
    for labels in ([0, 0, 3, 2, 2, 0], [1, 3, 0, 1, 0, 1], [2, 2, 1, 0, 2, 3]):
        y = torch.tensor(labels)
        (lp, g), (lp_pure, g_pure) = _both(pure, token_logprobs, x, y, g=torch.ones(6), temperature=temperature)
        lp64, g64 = _float64(lambda logp, y: logp.gather(-1, y[:, None])[:, 0], x, y, temperature=temperature)
        assert (lp <= 0).all() and torch.equal(lp.isneginf(), x[torch.arange(6), y].float().isneginf())
        lp64 = torch.where(lp64.isneginf(), lp64, lp64.clamp(min=LOWEST))  # past the range: the lowest float32
        torch.testing.assert_close(lp.double(), lp64, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lp, lp_pure, rtol=1e-5, atol=1e-5)
        assert torch.isfinite(g).all() and torch.isfinite(g_pure).all()
        torch.testing.assert_close(g.double(), g64, rtol=grad_rtol, atol=1e-6)
        torch.testing.assert_close(g_pure.double(), g64, rtol=grad_rtol, atol=1e-6)
    (h, gh), (h_pure, gh_pure) = _both(pure, entropy_from_logits, x, g=torch.ones(6), temperature=temperature)
    h64, gh64 = _float64(lambda logp: -(logp.exp() * logp.clamp(min=-1e300)).sum(-1), x, temperature=temperature)
    assert torch.isfinite(h).all() and torch.isfinite(gh).all() and (h >= 0).all()
    torch.testing.assert_close(h.double(), h64, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gh.double(), gh64, rtol=grad_rtol, atol=1e-6)
    torch.testing.assert_close(h_pure.double(), h64, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gh_pure.double(), gh64, rtol=grad_rtol, atol=1e-6)


def test_nan_rows_stay_in_their_rows(pure):
    x = _logits(3, 50)
    x[1, 7] = float("nan")
    lp = token_logprobs(x, torch.tensor([0, 1, 2]))
    assert lp[1].isnan() and torch.isfinite(lp[[0, 2]]).all()
    torch.testing.assert_close(lp[[0, 2]], pure(token_logprobs, x, torch.tensor([0, 1, 2]))[[0, 2]])
    assert entropy_from_logits(x)[1].isnan()


def test_temperatures_whose_inverse_leaves_float32_take_the_pure_path():
    x = _logits(2, 9)
    assert _kernels.usable(x, 1e-30) and not _kernels.usable(x, 1e-39) and not _kernels.usable(x, 1e39)
    assert torch.isfinite(token_logprobs(x, torch.tensor([0, 8]), temperature=1e-39)).all()


_PROBE = """
import torch, rlcore._kernels as k
from rlcore.logprobs import token_logprobs, entropy_from_logits
ops = k.ops
base = torch.randn(5, 3001, generator=torch.Generator().manual_seed(0)) * 3
y = torch.arange(5) * 700
for dtype, grad_rtol in ((torch.float32, 0.0), (torch.bfloat16, 2**-7), (torch.float16, 2**-10)):
    out = []
    for kernels in (ops, None):
        k.ops = kernels
        x = base.to(dtype).requires_grad_()
        lp, h = token_logprobs(x, y, temperature=0.7), entropy_from_logits(x)
        out.append((lp, h, torch.autograd.grad(lp.sum(), x)[0], torch.autograd.grad(h.sum(), x)[0]))
    (lp, h, g, gh), (lp2, h2, g2, gh2) = out
    torch.testing.assert_close((lp, h), (lp2, h2), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(g.float(), g2.float(), rtol=grad_rtol, atol=2e-6)
    torch.testing.assert_close(gh.float(), gh2.float(), rtol=0, atol=max(grad_rtol, 2e-6))
torch.set_num_threads(2)
print(ops.parallel_threads(8), k.variant)
"""


def _built() -> set[str]:
    here = Path(_kernels.__file__).parent
    return {p.name.split("_")[2] for p in here.glob("_logprobs_*_torch*.so")}


def _runs(build: str) -> bool:
    """Whether this CPU runs ``build`` (what the loader checks before trying it)."""
    caps = {"AVX512": {"avx512", "avx2", "default"}, "AVX2": {"avx2", "default"}}
    runs = caps.get(torch.backends.cpu.get_cpu_capability(), {"default"})
    return build in runs or (build == "avx512bf16" and "avx512" in runs and torch.cpu._is_avx512_bf16_supported())


@pytest.mark.parametrize("build", _kernels.BUILDS)
def test_every_build_agrees_with_the_pure_path(build):
    """Each instruction-set build this CPU runs, loaded by name (RLCORE_KERNEL_BUILD)."""
    if build not in _built():
        pytest.skip(f"no {build} build here")
    if not _runs(build):
        pytest.skip(f"this CPU does not run the {build} build")
    env = {**os.environ, "RLCORE_KERNEL_BUILD": build}
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    threads, variant = out.stdout.split()[-2:]
    assert variant == build
    assert threads == ("2" if sys.platform.startswith("linux") else "1")  # OpenMP in every Linux build


def test_the_environment_switch_forces_the_pure_path():
    env = {**os.environ, "RLCORE_PURE_TORCH": "1"}
    code = "import rlcore._kernels as k; print(k.ops is None, k.variant)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.split() == ["True", "None"], out.stderr
