"""The compiled CPU kernels of ``rlcore.logprobs`` (rlcore/csrc/logprobs.h), when they are built.

``setup.py`` compiles the kernels once per instruction set; this module imports, once, the best
build the CPU runs (``torch.backends.cpu.get_cpu_capability()``: ``AVX512``, with the bfloat16
instructions or without, then ``AVX2``, then ``default``; ``RLCORE_KERNEL_BUILD=<name>`` picks
one), which registers the operators ``torch.ops.rlcore.{logprobs,entropy}_{fwd,bwd}`` (with
shape-only implementations, so that they trace under ``torch.compile``).

Rows are spread over torch's intra-op threads (``torch.set_num_threads``) where the build has
OpenMP, as every Linux build does (``torch.ops.rlcore.parallel_threads(n)`` says how many threads
``n`` rows run on). Each row is one thread's work, computed the same way whatever the split, so
results are bitwise the same for any thread count.

``ops`` is ``None`` where no build loads (not compiled, another torch, another platform) or where
``RLCORE_PURE_TORCH=1`` is set in the environment: ``rlcore.logprobs`` then runs its pure-PyTorch
path. Tests set ``ops`` to ``None`` to compare the two paths.
"""

from __future__ import annotations

import importlib
import math
import os
import re
import warnings
from typing import Any

import torch
from torch.autograd.function import once_differentiable

__all__ = ["ops", "variant", "usable", "BUILDS", "TokenLogprobs", "Entropy"]

_ORDER = {"AVX512": ("avx512bf16", "avx512", "avx2", "default"), "AVX2": ("avx2", "default")}
BUILDS = ("avx512bf16", "avx512", "avx2", "default")
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_TINY, _HUGE = torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).max


def _load() -> tuple[Any, str | None]:
    if os.environ.get("RLCORE_PURE_TORCH", "") not in ("", "0"):
        return None, None
    tag = re.sub(r"\W", "_", torch.__version__)
    for name in _builds():
        try:
            importlib.import_module(f"rlcore._logprobs_{name}_torch{tag}")
        except ImportError:
            continue
        except Exception as err:  # noqa: BLE001 - a broken build must not break the import of rlcore
            warnings.warn(f"rlcore: the compiled {name} kernels failed to load ({err}); using the pure-PyTorch path",
                          RuntimeWarning, stacklevel=2)
            return None, None
        _register_fakes()
        return torch.ops.rlcore, name
    return None, None


def _builds() -> tuple[str, ...]:
    """The builds to try, best first: those the CPU runs, or the one named by RLCORE_KERNEL_BUILD."""
    if os.environ.get("RLCORE_KERNEL_BUILD"):
        return (os.environ["RLCORE_KERNEL_BUILD"],)
    order = _ORDER.get(torch.backends.cpu.get_cpu_capability(), ("default",))
    bf16 = getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)()
    return tuple(b for b in order if b != "avx512bf16" or bf16)


def _register_fakes() -> None:
    """Shapes and dtypes of the operators' results, for tracing (``torch.compile``, meta tensors)."""

    def rows(logits):
        return logits.new_empty(math.prod(logits.shape[:-1]), dtype=torch.float32)

    torch.library.register_fake("rlcore::logprobs_fwd")(lambda logits, labels, t: tuple(rows(logits) for _ in range(3)))
    torch.library.register_fake("rlcore::entropy_fwd")(lambda logits, t: tuple(rows(logits) for _ in range(3)))
    for op in ("rlcore::logprobs_bwd", "rlcore::entropy_bwd"):
        torch.library.register_fake(op)(lambda grad, logits, *rest: torch.empty_like(
            logits, memory_format=torch.contiguous_format))


ops, variant = _load()


def usable(logits: torch.Tensor, temperature: float) -> bool:
    """Whether the compiled kernels take ``logits [..., V]`` at ``temperature``: built and loaded,
    a CPU tensor of float32 / bfloat16 / float16 with a contiguous last dim, rows to process, and
    ``1/τ`` a normal float32 (float64 logits keep the float64 pure-PyTorch path)."""
    return (ops is not None and logits.device.type == "cpu" and logits.dtype in _DTYPES
            and logits.numel() > 0 and (logits.stride(-1) == 1 or logits.shape[-1] == 1)
            and _TINY <= 1.0 / temperature <= _HUGE)


# --- autograd: the operators' forward and backward as one differentiable function each ---------
def _rows(grad_out: torch.Tensor) -> torch.Tensor:
    return grad_out.reshape(-1).to(torch.float32).contiguous()


class TokenLogprobs(torch.autograd.Function):
    """``log softmax(logits/τ)[label]`` per row (float32), one read of the logits; the graph saves
    the logits, the labels and two float32 numbers per row; backward writes the gradient in one
    pass."""

    @staticmethod
    def forward(ctx, logits, labels, temperature):
        flat = labels.reshape(-1).contiguous()
        out, shift, lse = ops.logprobs_fwd(logits, flat, temperature)
        ctx.save_for_backward(logits, flat, shift, lse)
        ctx.temperature = temperature
        return out.view(labels.shape)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        logits, flat, shift, lse = ctx.saved_tensors
        return ops.logprobs_bwd(_rows(grad_out), logits, flat, shift, lse, ctx.temperature), None, None


class Entropy(torch.autograd.Function):
    """``−Σ p log p`` of ``softmax(logits/τ)`` per row (float32), one read of the logits; backward
    ``−g·p_v·(log p_v + H)/τ`` in one pass."""

    @staticmethod
    def forward(ctx, logits, temperature):
        ent, shift, lse = ops.entropy_fwd(logits, temperature)
        ctx.save_for_backward(logits, ent, shift, lse)
        ctx.temperature = temperature
        return ent.view(logits.shape[:-1])

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        logits, ent, shift, lse = ctx.saved_tensors
        return ops.entropy_bwd(_rows(grad_out), logits, ent, shift, lse, ctx.temperature), None
