"""Test helpers shipped with the package: purity and padding assertions, a tiny mock LM, batch
factories. Users testing their own losses get the same tools rlcore's suite uses.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn

from rlcore import keys as K

__all__ = [
    "assert_pure",
    "assert_padding_invariant",
    "assert_same",
    "tensor_leaves",
    "right_padded_mask",
    "left_padded_mask",
    "make_rollout",
    "make_preference_batch",
    "MockLM",
    "MockLMOutput",
]


# --- walking nested inputs and outputs ------------------------------------------------------
def tensor_leaves(obj: Any, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """``(path, tensor)`` for every tensor inside tensors, TensorDicts, dicts, lists, tuples and dataclasses."""
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, TensorDictBase):
        for k, v in obj.items(include_nested=True, leaves_only=True):
            yield f"{path}[{k!r}]", v
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from tensor_leaves(v, f"{path}[{k!r}]")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from tensor_leaves(v, f"{path}[{i}]")
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from tensor_leaves(getattr(obj, f.name), f"{path}.{f.name}")


def _structure(obj: Any) -> Any:
    if isinstance(obj, TensorDictBase):
        return ("td", tuple(obj.batch_size), tuple(sorted(map(str, obj.keys(True, True)))))
    if isinstance(obj, dict):
        return {k: _structure(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return tuple(_structure(v) for v in obj)
    return None


def assert_same(a: Any, b: Any, *, rtol: float = 0.0, atol: float = 0.0, what: str = "output") -> None:
    """Assert two nested results (tensors, TensorDicts, tuples, dicts, dataclasses) are equal.

    NaNs compare equal to NaNs; dtypes and shapes must match; tolerances default to bitwise.
    """
    assert _structure(a) == _structure(b), f"{what}: structures differ: {_structure(a)} vs {_structure(b)}"
    la, lb = list(tensor_leaves(a)), list(tensor_leaves(b))
    assert [p for p, _ in la] == [p for p, _ in lb], f"{what}: different leaves"
    if not la:
        assert a == b, f"{what}: {a!r} != {b!r}"
    for (path, x), (_, y) in zip(la, lb):
        torch.testing.assert_close(x, y, rtol=rtol, atol=atol, equal_nan=True,
                                   msg=lambda m, p=path: f"{what}{p}: {m}")  # type: ignore[misc]


def assert_pure(fn: Callable, *args: Any, rtol: float = 0.0, atol: float = 0.0, **kwargs: Any) -> Any:
    """Assert ``fn(*args, **kwargs)`` leaves its inputs untouched and gives the same output twice.

    Checks, for every tensor reachable from the arguments (inside TensorDicts, tuples, dicts,
    dataclasses): its values (NaN-aware, bitwise), its version counter (so an in-place write
    that happens to restore the values is caught too), and the key sets of TensorDicts (no
    ``td.set`` on an input). A ``torch.Generator`` argument is rewound before the second call.

    Returns:
        The first output, for further assertions.
    """
    inputs = (args, kwargs)
    snapshot = [(p, t.detach().clone(), t._version) for p, t in tensor_leaves(inputs)]
    structure = _structure(inputs)
    generators = [g for g in list(args) + list(kwargs.values()) if isinstance(g, torch.Generator)]
    states = [g.get_state() for g in generators]

    first = fn(*args, **kwargs)
    for g, s in zip(generators, states):
        g.set_state(s)
    second = fn(*args, **kwargs)

    assert _structure(inputs) == structure, "an input TensorDict/dict gained or lost keys"
    for (path, before, version), (_, after) in zip(snapshot, tensor_leaves(inputs)):
        assert after._version == version, f"input{path} was written in place"
        torch.testing.assert_close(after.detach(), before, rtol=0, atol=0, equal_nan=True,
                                   msg=lambda m, p=path: f"input{p} changed: {m}")  # type: ignore[misc]
    assert_same(first, second, rtol=rtol, atol=atol, what="second call differs: output")
    return first


def _pad_last(x: torch.Tensor, pad: int, generator: torch.Generator, fill: float | None) -> torch.Tensor:
    shape = (*x.shape[:-1], pad)
    if x.dtype == torch.bool:
        extra = torch.zeros(shape, dtype=torch.bool)
    elif x.is_floating_point():
        extra = (torch.randn(shape, generator=generator, dtype=torch.float64) * 3 if fill is None
                 else torch.full(shape, fill, dtype=torch.float64)).to(x.dtype)
    else:
        extra = torch.randint(0, 7, shape, generator=generator).to(x.dtype)
    return torch.cat([x, extra.to(x.device)], dim=-1)


def _trim_like(a: Any, b: Any) -> Any:
    """Trim the tensors of ``b`` (padded run) to the last-dim sizes of ``a`` (plain run)."""
    if isinstance(a, torch.Tensor):
        if a.ndim and b.ndim == a.ndim and b.shape[-1] > a.shape[-1]:
            return b[..., : a.shape[-1]]
        return b
    if isinstance(a, TensorDictBase):
        return TensorDict({k: _trim_like(a.get(k), b.get(k)) for k in a.keys()}, batch_size=a.batch_size)
    if isinstance(a, dict):
        return {k: _trim_like(a[k], b[k]) for k in a}
    if isinstance(a, tuple) and hasattr(a, "_fields"):
        return type(a)(*(_trim_like(x, y) for x, y in zip(a, b)))
    if isinstance(a, (list, tuple)):
        return type(a)(_trim_like(x, y) for x, y in zip(a, b))
    return b


def assert_padding_invariant(fn: Callable[[TensorDictBase], Any], batch: TensorDictBase, *,
                             time_keys: Sequence | None = None, mask_key: Any = K.RESPONSE_MASK,
                             pad: int = 3, fill: float | None = None, seed: int = 0,
                             rtol: float = 1e-6, atol: float = 1e-6) -> None:
    """Assert that extra right padding of the time dimension changes nothing in ``fn(batch)``.

    Appends ``pad`` columns to every entry of ``time_keys`` (default: every leaf shaped like
    ``batch[mask_key]``): ``False`` in bool masks, random garbage (or ``fill``, e.g. NaN) in
    floats, random ids in integers. Tensor outputs that grew along their last dim are compared
    on the original columns; everything else is compared whole.
    """
    mask_shape = batch.get(mask_key).shape
    if time_keys is None:
        time_keys = [k for k, v in batch.items(True, True) if v.shape == mask_shape]
    gen = torch.Generator().manual_seed(seed)
    padded = batch.clone()
    for k in time_keys:
        padded.set(k, _pad_last(batch.get(k), pad, gen, fill))
    plain_out, padded_out = fn(batch), fn(padded)
    assert_same(plain_out, _trim_like(plain_out, padded_out), rtol=rtol, atol=atol,
                what="padding changed the output")


# --- batch factories ------------------------------------------------------------------------
def right_padded_mask(lengths: torch.Tensor, width: int) -> torch.Tensor:
    """``[B, width]`` bool, True on the first ``lengths[b]`` positions of each row."""
    return torch.arange(width, device=lengths.device) < lengths[:, None]


def left_padded_mask(lengths: torch.Tensor, width: int) -> torch.Tensor:
    """``[B, width]`` bool, True on the last ``lengths[b]`` positions of each row."""
    return torch.arange(width, device=lengths.device) >= (width - lengths)[:, None]


def make_rollout(batch_size: int = 6, response_length: int = 7, prompt_length: int = 4, *,
                 vocab_size: int = 32, group_size: int = 1, empty_rows: int = 0,
                 dtype: torch.dtype = torch.float32, generator: torch.Generator | None = None) -> TensorDict:
    """A random rollout TensorDict ``[B]`` with every rollout key of ``rlcore.keys``.

    Response lengths are random in ``[1, R]``; the last ``empty_rows`` rows have an empty
    response. With ``group_size = G`` rows ``g·G … g·G + G - 1`` share ``group_id = g``.
    Float values at padded positions are random garbage, so a function that reads them fails
    the padding tests.
    """
    g = generator if generator is not None else torch.Generator().manual_seed(0)
    B, R, P = batch_size, response_length, prompt_length
    if B % group_size:
        raise ValueError(f"batch_size: expected a multiple of group_size={group_size}, got {B}")
    resp_len = torch.randint(1, R + 1, (B,), generator=g)
    if empty_rows:
        resp_len[B - empty_rows:] = 0
    prompt_len = torch.randint(1, P + 1, (B,), generator=g)

    def f(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

    old = -f(B, R).abs() - 0.1
    return TensorDict({
        K.PROMPT_IDS: torch.randint(0, vocab_size, (B, P), generator=g),
        K.PROMPT_MASK: left_padded_mask(prompt_len, P),
        K.RESPONSE_IDS: torch.randint(0, vocab_size, (B, R), generator=g),
        K.RESPONSE_MASK: right_padded_mask(resp_len, R),
        K.OLD_LOGPROBS: old,
        K.LOGPROBS: old + 0.1 * f(B, R),
        K.REF_LOGPROBS: old + 0.1 * f(B, R),
        K.VALUES: f(B, R),
        K.VALUE_PREDS: f(B, R),
        K.REWARDS: f(B, R),
        K.SCORE: f(B),
        K.GROUP_ID: torch.arange(B) // group_size,
    }, batch_size=[B])


def make_preference_batch(batch_size: int = 4, length: int = 9, *, vocab_size: int = 32,
                          dtype: torch.dtype = torch.float32,
                          generator: torch.Generator | None = None) -> TensorDict:
    """A random preference batch ``[B]`` with nested ``chosen`` / ``rejected`` sub-TensorDicts.

    Each side: right-padded ``input_ids``, ``attention_mask``, ``loss_mask`` (completion tokens
    after a prompt of 2-3 tokens), and sequence log-probs ``logps`` / ``ref_logps`` ``[B]``.
    """
    g = generator if generator is not None else torch.Generator().manual_seed(0)
    B, T = batch_size, length

    def side() -> TensorDict:
        n = torch.randint(4, T + 1, (B,), generator=g)
        attn = right_padded_mask(n, T)
        prompt = right_padded_mask(torch.randint(2, 4, (B,), generator=g), T)
        return TensorDict({
            K.INPUT_IDS: torch.randint(0, vocab_size, (B, T), generator=g),
            K.ATTENTION_MASK: attn,
            K.LOSS_MASK: attn & ~prompt,
            K.LOGPS: (-torch.rand(B, generator=g, dtype=torch.float64) * 20 - 1).to(dtype),
            K.REF_LOGPS: (-torch.rand(B, generator=g, dtype=torch.float64) * 20 - 1).to(dtype),
        }, batch_size=[B])

    return TensorDict({K.CHOSEN: side(), K.REJECTED: side()}, batch_size=[B])


# --- a tiny mock LM -------------------------------------------------------------------------
class MockLMOutput(NamedTuple):
    logits: torch.Tensor         # [B, T, V]
    hidden_states: torch.Tensor  # [B, T, H], the input of lm_head


class MockLM(nn.Module):
    """A tiny causal LM for tests: no attention, a causal running mean over valid tokens.

    ``h_t = tanh(W·[e(x_t), mean_{s≤t, valid} e(x_s)] + p(pos_t))``, ``logits = lm_head(h)``.
    Positions count valid tokens only, so left and right padding give the same per-token
    outputs on real tokens. ``lm_head`` is an ``nn.Linear(H, V)`` as in Hugging Face models.
    """

    def __init__(self, vocab_size: int = 32, hidden_size: int = 16, max_positions: int = 128, *,
                 seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.embed = nn.Embedding(vocab_size, hidden_size)
        self.pos = nn.Embedding(max_positions, hidden_size)
        self.mix = nn.Linear(2 * hidden_size, hidden_size)
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        self.vocab_size, self.hidden_size = vocab_size, hidden_size

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> MockLMOutput:
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids, dtype=torch.bool)
        m = attention_mask.bool()
        e = self.embed(input_ids) * m[..., None]
        count = m.cumsum(-1)
        running = e.cumsum(-2) / count.clamp(min=1)[..., None]
        pos = (count - 1).clamp(min=0)
        h = torch.tanh(self.mix(torch.cat([e, running], -1)) + self.pos(pos))
        return MockLMOutput(self.lm_head(h), h)

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head
