"""The conformance suite every loss ``(batch, **hyper) -> (loss, metrics)`` must pass.

``check_loss_conformance(loss_fn, batch, mask_key=..., grad_keys=...)`` asserts, on one small
batch (the caller picks it: it should hold real and masked positions, and an empty row):

0. the function is pure (``rlcore.testing.assert_pure``: inputs untouched, same output twice);
1. the loss is a finite 0-d float tensor; ``metrics`` is a TensorDict ``[]`` of detached 0-d
   tensors; its ``loss_*`` entries sum to the loss;
2. extra right padding (NaN-filled, then random garbage) changes nothing;
3. values at masked positions (NaN, −inf, 1e4) change neither the loss, the metrics, nor the
   gradients, and masked positions of ``grad_keys`` get exactly zero gradient;
4. the dtype is kept (float32 in ⇒ float32 loss, float64 in ⇒ float64 loss);
5. gradients of ``grad_keys`` exist and are finite;
6. it runs under ``torch.compile(loss_fn, backend="aot_eager")`` and matches eager, gradients
   included.

Each step is also a function of its own (``check_outputs``, ...) for partial use.

Usage (e.g. in a preference-loss test)::

    from tests.algorithms.conformance import check_loss_conformance

    @pytest.mark.parametrize("name", sorted(LOSSES))
    def test_conformance(name):
        check_loss_conformance(LOSSES[name], batch, mask_key=[("chosen", "loss_mask"),
                               ("rejected", "loss_mask")], grad_keys=[("chosen", "logps")])
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from tensordict import TensorDictBase

from rlcore import keys as K
from rlcore.testing import assert_padding_invariant, assert_pure, assert_same

__all__ = [
    "check_loss_conformance",
    "check_outputs",
    "check_padding",
    "check_masked_positions",
    "check_dtypes",
    "check_gradients",
    "check_compiles",
    "with_grad",
    "fill_masked",
]

LossFn = Callable[[TensorDictBase], tuple[torch.Tensor, TensorDictBase]]
NestedKey = Any  # str or tuple of str


def _keys(key_or_keys: NestedKey | Sequence[NestedKey]) -> list[NestedKey]:
    # A list means several keys; a str or a tuple (a nested key) is one key.
    return list(key_or_keys) if isinstance(key_or_keys, list) else [key_or_keys]


def _as_tuple(key: NestedKey) -> tuple[str, ...]:
    return key if isinstance(key, tuple) else (key,)


def with_grad(batch: TensorDictBase, grad_keys: Sequence[NestedKey]) -> tuple[TensorDictBase, list]:
    """A deep copy of ``batch`` whose ``grad_keys`` are fresh leaves requiring grad, and them."""
    out = batch.clone()
    leaves = []
    for key in grad_keys:
        leaf = batch.get(key).detach().clone().requires_grad_(True)
        out.set(key, leaf)
        leaves.append(leaf)
    return out, leaves


def _masked_siblings(batch: TensorDictBase, mask_key: NestedKey) -> Iterator[tuple[tuple, torch.Tensor]]:
    """Float leaves in the sub-TensorDict of ``mask_key`` shaped like the mask, with the mask."""
    mask = batch.get(mask_key)
    prefix = _as_tuple(mask_key)[:-1]
    sub = batch.get(prefix) if prefix else batch
    for k, v in sub.items(include_nested=True, leaves_only=True):
        if v.is_floating_point() and v.shape == mask.shape:
            yield prefix + _as_tuple(k), mask


def fill_masked(batch: TensorDictBase, mask_keys: Sequence[NestedKey], fill: float) -> TensorDictBase:
    """A deep copy of ``batch`` with ``fill`` wherever a mask is False, in every float leaf
    shaped like that mask (in the mask's own sub-TensorDict)."""
    out = batch.clone()
    for mask_key in mask_keys:
        for key, mask in _masked_siblings(batch, mask_key):
            x = batch.get(key).detach()
            out.set(key, torch.where(mask, x, torch.full_like(x, fill)))
    return out


def _grads(loss_fn: LossFn, batch: TensorDictBase, grad_keys: Sequence[NestedKey]) -> list[torch.Tensor]:
    b, leaves = with_grad(batch, grad_keys)
    loss, _ = loss_fn(b)
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    for key, g in zip(grad_keys, grads):
        assert g is not None, f"{key!r}: the loss does not depend on it (no gradient)"
    return list(grads)


def check_outputs(loss_fn: LossFn, batch: TensorDictBase, *, grad_keys: Sequence[NestedKey] = (),
                  rtol: float = 1e-6, atol: float = 1e-6) -> None:
    """Loss: finite 0-d float. Metrics: TensorDict ``[]`` of detached 0-d tensors; ``loss_*`` sum to it."""
    b, _ = with_grad(batch, grad_keys)
    out = loss_fn(b)
    assert isinstance(out, tuple) and len(out) == 2, f"expected (loss, metrics), got {type(out).__name__}"
    loss, metrics = out
    assert isinstance(loss, torch.Tensor) and loss.ndim == 0, f"loss: expected a 0-d tensor, got {loss!r}"
    assert loss.is_floating_point(), f"loss: expected a float tensor, got {loss.dtype}"
    assert torch.isfinite(loss), f"loss is not finite: {loss}"
    assert not grad_keys or loss.requires_grad, "loss does not require grad although its inputs do"
    assert isinstance(metrics, TensorDictBase), f"metrics: expected a TensorDict, got {type(metrics).__name__}"
    assert metrics.batch_size == torch.Size([]), f"metrics: batch_size {metrics.batch_size}, expected []"
    parts = []
    for key, v in metrics.items(include_nested=True, leaves_only=True):
        assert v.ndim == 0, f"metrics[{key!r}]: expected a 0-d tensor, got shape {list(v.shape)}"
        assert not v.requires_grad and v.grad_fn is None, f"metrics[{key!r}] is not detached"
        if _as_tuple(key)[-1].startswith("loss_"):
            parts.append(v)
    assert parts, f"metrics: no loss_* entry among {sorted(map(str, metrics.keys(True, True)))}"
    torch.testing.assert_close(torch.stack(parts).sum(), loss.detach(), rtol=rtol, atol=atol,
                               msg=lambda m: f"the loss_* metrics do not sum to the loss: {m}")


def check_padding(loss_fn: LossFn, batch: TensorDictBase, *, mask_key: NestedKey,
                  rtol: float = 1e-6, atol: float = 1e-6) -> None:
    """Extra right padding, NaN-filled then garbage-filled, changes neither loss nor metrics."""
    for fill in (float("nan"), None):
        assert_padding_invariant(loss_fn, batch, mask_key=mask_key, fill=fill, rtol=rtol, atol=atol)


def check_masked_positions(loss_fn: LossFn, batch: TensorDictBase, *, mask_keys: Sequence[NestedKey],
                           grad_keys: Sequence[NestedKey], rtol: float = 1e-6, atol: float = 1e-6) -> None:
    """Garbage under the masks changes nothing; masked positions of ``grad_keys`` get zero gradient."""
    plain = loss_fn(batch)
    plain_grads = _grads(loss_fn, batch, grad_keys)
    masks = {key: mask for mk in mask_keys for key, mask in _masked_siblings(batch, mk)}
    for fill in (float("nan"), float("-inf"), 1e4):
        dirty = fill_masked(batch, mask_keys, fill)
        assert_same(plain, loss_fn(dirty), rtol=rtol, atol=atol, what=f"masked positions = {fill}: output")
        for key, g_plain, g_dirty in zip(grad_keys, plain_grads, _grads(loss_fn, dirty, grad_keys)):
            torch.testing.assert_close(g_dirty, g_plain, rtol=rtol, atol=atol, equal_nan=False,
                                       msg=lambda m, k=key, f=fill: f"grad of {k!r}, masked = {f}: {m}")
            if _as_tuple(key) in masks:
                zero = torch.zeros((), dtype=g_dirty.dtype)
                assert torch.equal(torch.where(masks[_as_tuple(key)], zero, g_dirty), torch.zeros_like(g_dirty)), \
                    f"grad of {key!r} is not zero at masked positions"


def check_dtypes(loss_fn: LossFn, batch: TensorDictBase, *,
                 dtypes: Sequence[torch.dtype] = (torch.float32, torch.float64)) -> None:
    """Float inputs cast to ``dtype`` give a loss of that dtype."""
    for dtype in dtypes:
        cast = batch.apply(lambda x, d=dtype: x.to(d) if x.is_floating_point() else x)
        loss, _ = loss_fn(cast)
        assert loss.dtype == dtype, f"{dtype} inputs gave a {loss.dtype} loss"


def check_gradients(loss_fn: LossFn, batch: TensorDictBase, *, grad_keys: Sequence[NestedKey]) -> None:
    """Every key of ``grad_keys`` gets a finite gradient of its own shape."""
    for key, g in zip(grad_keys, _grads(loss_fn, batch, grad_keys)):
        assert g.shape == batch.get(key).shape, f"grad of {key!r}: shape {list(g.shape)}"
        assert torch.isfinite(g).all(), f"grad of {key!r} is not finite"


def check_compiles(loss_fn: LossFn, batch: TensorDictBase, *, grad_keys: Sequence[NestedKey],
                   backend: str = "aot_eager", rtol: float = 1e-6, atol: float = 1e-6) -> None:
    """``torch.compile(loss_fn, backend=backend)`` gives the eager loss, metrics and gradients."""
    torch._dynamo.reset()  # a fresh cache: earlier compiles must not push this one to eager fallback
    compiled = torch.compile(loss_fn, backend=backend)
    b, leaves = with_grad(batch, grad_keys)
    loss_c, metrics_c = compiled(b)
    loss_e, metrics_e = loss_fn(b)
    assert_same((loss_c.detach(), metrics_c), (loss_e.detach(), metrics_e), rtol=rtol, atol=atol,
                what=f"torch.compile(backend={backend!r})")
    if leaves:
        for key, gc, ge in zip(grad_keys, torch.autograd.grad(loss_c, leaves), torch.autograd.grad(loss_e, leaves)):
            torch.testing.assert_close(gc, ge, rtol=rtol, atol=atol, msg=lambda m, k=key: f"compiled grad {k!r}: {m}")


def check_loss_conformance(loss_fn: LossFn, batch: TensorDictBase, *,
                           mask_key: NestedKey | list[NestedKey] = K.RESPONSE_MASK,
                           grad_keys: Sequence[NestedKey] = (K.LOGPROBS,), compile_backend: str | None = "aot_eager",
                           dtypes: Sequence[torch.dtype] = (torch.float32, torch.float64),
                           rtol: float = 1e-6, atol: float = 1e-6) -> None:
    """Run the whole suite (see the module docstring) on ``loss_fn(batch)``.

    Args:
        loss_fn: ``(batch) -> (loss, metrics)``; bind hyper-parameters with ``functools.partial``.
        batch: a small TensorDict the loss accepts (use float64 for tight tolerances).
        mask_key: the key of the mask (or a list of keys, e.g. one per side of a preference pair).
            Float leaves of the mask's sub-TensorDict shaped like it are the masked values.
        grad_keys: keys that must receive a finite gradient (e.g. ``logprobs``, ``value_preds``).
        compile_backend: ``torch.compile`` backend, or ``None`` to skip that check.
        dtypes: float dtypes whose loss must keep the dtype.
    """
    mask_keys = _keys(mask_key)
    grad_keys = list(grad_keys)
    # Purity first, and every check on its own deep copy: a loss that writes into its input must
    # be caught here, not silently change the batch the later checks (and the caller) see.
    assert_pure(loss_fn, batch.clone())
    check_outputs(loss_fn, batch.clone(), grad_keys=grad_keys, rtol=rtol, atol=atol)
    check_padding(loss_fn, batch.clone(), mask_key=mask_keys[0], rtol=rtol, atol=atol)
    check_masked_positions(loss_fn, batch.clone(), mask_keys=mask_keys, grad_keys=grad_keys, rtol=rtol, atol=atol)
    check_dtypes(loss_fn, batch.clone(), dtypes=dtypes)
    check_gradients(loss_fn, batch.clone(), grad_keys=grad_keys)
    if compile_backend is not None:
        check_compiles(loss_fn, batch.clone(), grad_keys=grad_keys, backend=compile_backend, rtol=rtol, atol=atol)
