"""Per-token log-probs: rlcore.logprobs against the usual ways of computing them.

Cases (full size; ``--tiny`` shrinks every dimension):
- logits ``[8, 512, 32000]`` float32 and bfloat16, forward and forward+backward:
  rlcore ``token_logprobs`` / naive ``log_softmax(logits.float()).gather`` /
  ``-cross_entropy(reduction="none")`` / TRL ``selective_log_softmax``;
- hidden states ``[8·512, 256]`` with an LM head ``[32000, 256]``, forward+backward:
  rlcore ``hidden_logprobs`` / the LM-head matmul then log-softmax-gather / the matmul then
  rlcore ``token_logprobs`` / TRL's chunked log-prob function.

Project goals (aimed at, not asserted): float32 logits forward ≤ 2× its read floor with ≤ 70 MB
extra, forward+backward ≤ 3× its floor with nothing extra beyond the gradient and one chunk;
bfloat16 logits no slower than float32 and faster than ``cross_entropy``, in both directions;
hidden path peak extra ≤ 10% of the naive path at ≤ 1.1× its time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlcore.logprobs import token_logprobs
from rlcore.lm_head import hidden_logprobs

try:  # imported here, once, so that the memory server's forked children inherit it
    from trl.trainer.utils import selective_log_softmax as _trl_selective
except ImportError:
    _trl_selective = None
try:
    from trl.kernels import ChunkedLogProbFunction as _TrlChunked
except ImportError:
    _TrlChunked = None


def _sizes(tiny: bool) -> dict[str, int]:
    return dict(B=2, T=16, V=257, H=16) if tiny else dict(B=8, T=512, V=32000, H=256)


def _require(peer, name: str):
    if peer is None:
        raise ImportError(name=name)
    return peer


# --- implementations: (logits [B, T, V], labels [B, T]) -> logprobs [B, T] --------------------
def _naive(x, y):
    return x.float().log_softmax(-1).gather(-1, y[..., None])[..., 0]


def _cross_entropy(x, y):
    return -F.cross_entropy(x.flatten(0, -2), y.flatten(), reduction="none").view(y.shape)


def _trl(x, y):
    return _require(_trl_selective, "trl")(x, y)


LOGITS_IMPLS = {"rlcore": token_logprobs, "naive": _naive, "cross_entropy": _cross_entropy, "trl": _trl}


def _logits_builder(fn, dtype, *, backward: bool, tiny: bool):
    def builder():
        if fn is _trl:
            _require(_trl_selective, "trl")
        s = _sizes(tiny)
        g = torch.Generator().manual_seed(0)
        x = (torch.randn(s["B"], s["T"], s["V"], generator=g) * 2).to(dtype).requires_grad_(backward)
        y = torch.randint(0, s["V"], (s["B"], s["T"]), generator=g)
        if not backward:
            return lambda: fn(x, y)
        w = torch.rand(s["B"], s["T"], generator=g)

        def thunk():
            out = fn(x, y)
            return torch.autograd.grad(out, x, w.to(out.dtype))
        return thunk
    return builder


# --- implementations: (hidden [N, H], weight [V, H], labels [N]) -> logprobs [N] --------------
def _head_naive(h, w, y):
    return (h @ w.T).log_softmax(-1).gather(-1, y[:, None])[:, 0]


def _head_then_rlcore(h, w, y):
    return token_logprobs(h @ w.T, y)


def _trl_chunked(h, w, y):
    return _require(_TrlChunked, "trl").apply(h, w, None, y, 1.0, 4096, None, 1.0, ())[0]


HIDDEN_IMPLS = {"rlcore": lambda h, w, y: hidden_logprobs(h, w, y), "matmul+log_softmax": _head_naive,
                "matmul+rlcore.token_logprobs": _head_then_rlcore, "trl_chunked": _trl_chunked}


def _hidden_builder(fn, *, tiny: bool):
    def builder():
        if fn is _trl_chunked:
            _require(_TrlChunked, "trl")
        s = _sizes(tiny)
        n = s["B"] * s["T"]
        g = torch.Generator().manual_seed(0)
        h = torch.randn(n, s["H"], generator=g).requires_grad_()
        w = (torch.randn(s["V"], s["H"], generator=g) / s["H"] ** 0.5).requires_grad_()
        y = torch.randint(0, s["V"], (n,), generator=g)
        grad_out = torch.rand(n, generator=g)
        return lambda: torch.autograd.grad(fn(h, w, y), (h, w), grad_out)
    return builder


# --- protocol ---------------------------------------------------------------------------------
def _names(tiny: bool) -> dict[str, tuple]:
    s = _sizes(tiny)
    shape = f"[{s['B']},{s['T']},{s['V']}]"
    head = f"[{s['B'] * s['T']},{s['H']}]x[{s['V']},{s['H']}]"
    return {
        f"logits fp32 fwd {shape}": (torch.float32, False),
        f"logits fp32 fwd+bwd {shape}": (torch.float32, True),
        f"logits bf16 fwd {shape}": (torch.bfloat16, False),
        f"logits bf16 fwd+bwd {shape}": (torch.bfloat16, True),
        f"hidden fp32 fwd+bwd {head}": None,
    }


def cases(tiny: bool) -> dict[str, dict]:
    out = {}
    for name, spec in _names(tiny).items():
        if spec is None:
            out[name] = {impl: _hidden_builder(fn, tiny=tiny) for impl, fn in HIDDEN_IMPLS.items()}
        else:
            dtype, backward = spec
            out[name] = {impl: _logits_builder(fn, dtype, backward=backward, tiny=tiny)
                         for impl, fn in LOGITS_IMPLS.items()}
    return out


def goals(tiny: bool) -> dict[str, list[tuple[str, str, float]]]:
    """Logits in float32: forward ≤ 2× its floor, forward+backward ≤ 3×. Logits in bfloat16 (half
    the bytes, float32 statistics): no slower than the float32 case and faster than
    ``cross_entropy``. Hidden: peak ≤ 10% of "LM head then log-probs", at ≤ 1.1× its time (a
    speedup ≥ 1/1.1)."""
    names = _names(tiny)
    fp32 = {spec[1]: name for name, spec in names.items() if spec and spec[0] == torch.float32}
    out = {}
    for name, spec in names.items():
        if spec is None:
            out[name] = [("memory", "matmul+log_softmax", 0.1), ("speedup", "matmul+log_softmax", round(1 / 1.1, 3))]
        elif spec[0] == torch.float32:
            out[name] = [("floor", "", 3.0 if spec[1] else 2.0)]
        else:
            out[name] = [("speedup", f"{fp32[spec[1]]}/rlcore", 1.0), ("speedup", "cross_entropy", 1.0)]
    return out


def floors(tiny: bool) -> dict[str, dict]:
    """Logits: read the logits once (forward) or twice plus write the gradient (forward+backward).
    Hidden: the three matmuls of forward+backward, ``6·N·V·H`` flops."""
    s = _sizes(tiny)
    n, v = s["B"] * s["T"], s["V"]
    out = {}
    for name, spec in _names(tiny).items():
        if spec is None:
            out[name] = {"flops": 6 * n * v * s["H"]}
        else:
            dtype, backward = spec
            item = torch.finfo(dtype).bits // 8
            out[name] = {"bytes": (3 if backward else 1) * n * v * item + n * (8 + 4)}
    return out
