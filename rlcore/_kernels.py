"""The compiled CPU kernels of ``rlcore.logprobs`` (rlcore/csrc/logprobs.h), found or built at import.

The best build the CPU runs (``torch.backends.cpu.get_cpu_capability()``: ``AVX512``, with the
bfloat16 instructions or without, then ``AVX2``, then ``default``; ``RLCORE_KERNEL_BUILD=<name>``
picks one) is loaded once, from the first of:

- the package (``source == "packaged"``): the builds ``setup.py`` compiles at install time where
  torch is importable then (``make setup``, ``pip install --no-build-isolation``);
- the per-user cache (``"cache"``), or compiled into it now (``"built"``, with a one-line notice on
  stderr; about a minute, once per torch version and instruction set) where the package holds no
  build for this CPU and torch: a build-isolated ``pip install``, a wheel built elsewhere. The cache
  and the lock that makes concurrent processes compile once are in ``rlcore/_kernel_build.py``
  (``RLCORE_KERNEL_CACHE=<dir>`` moves it; ``RLCORE_KERNEL_PACKAGED=0`` skips the package's builds).

Loading a build registers the operators ``torch.ops.rlcore.{logprobs,entropy}_{fwd,bwd}`` (with
shape-only implementations, so that they trace under ``torch.compile``).

Rows are spread over torch's intra-op threads (``torch.set_num_threads``) where the build has
OpenMP, as every Linux build does (``torch.ops.rlcore.parallel_threads(n)`` says how many threads
``n`` rows run on). Each row is one thread's work, computed the same way whatever the split, so
results are bitwise the same for any thread count.

``ops`` is ``None`` where ``RLCORE_PURE_TORCH=1`` is set in the environment (silently), or where
no build loads and none can be compiled (no C++ compiler, a failed compile: with a warning at
import): ``rlcore.logprobs`` then runs its pure-PyTorch path. ``source``, ``path`` and ``reason``
say which path is active and why (``python -m rlcore.kernels`` prints them). Tests set ``ops`` to
``None`` to compare the two paths.
"""

from __future__ import annotations

import math
import os
import sys
import warnings
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch.autograd.function import once_differentiable

from rlcore import _kernel_build

__all__ = ["ops", "variant", "source", "path", "reason", "usable", "BUILDS", "TokenLogprobs", "Entropy"]

_ORDER = {"AVX512": ("avx512bf16", "avx512", "avx2", "default"), "AVX2": ("avx2", "default")}
BUILDS = ("avx512bf16", "avx512", "avx2", "default")
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_TINY, _HUGE = torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).max


class _Loaded(NamedTuple):
    ops: Any
    variant: str | None
    source: str | None
    path: Path | None
    reason: str
    warn: bool = False


def _load() -> _Loaded:
    """The kernels from the package, else the cache (compiled there now where missing), else the
    pure-PyTorch path with the reason."""
    if os.environ.get("RLCORE_PURE_TORCH", "") not in ("", "0"):
        return _Loaded(None, None, None, None, "forced by RLCORE_PURE_TORCH")
    builds = _builds()
    if os.environ.get("RLCORE_KERNEL_PACKAGED", "") != "0":
        here = Path(__file__).resolve().parent
        for name in builds:
            found = _kernel_build.find_module(here, _kernel_build.module_name(name, torch.__version__))
            if found is not None:
                return _open(name, found, "packaged", "compiled into the package at install time")
    try:
        return _from_cache(builds)
    except Exception as err:  # noqa: BLE001 - no sources, an unwritable cache: never a failed import of rlcore
        return _pure(f"the package has no kernels for this CPU and torch, and none could be built ({err!r})")


def _from_cache(builds: tuple[str, ...]) -> _Loaded:
    """The best of ``builds`` in the per-user cache, compiled into it where it is not there (a
    build whose compile failed before, or that cannot be compiled here, gives way to the next)."""
    errors = []
    for name in builds:
        found = _kernel_build.find_module(_kernel_build.cache_dir(name, torch.__version__),
                                          _kernel_build.module_name(name, torch.__version__))
        compiled_here = False
        if found is None:
            why = _kernel_build.compiler_missing()
            if why is None:
                try:
                    found, compiled_here = _kernel_build.build_cached(name, torch.__version__, _notice)
                except _kernel_build.BuildFailed as err:
                    why = str(err)
            if found is None:
                errors.append(str(why))
                continue
        return _open(name, found, "built" if compiled_here else "cache",
                     "the package has no build for this CPU and torch: compiled on first use")
    return _pure("; ".join(dict.fromkeys(errors)))


def _notice(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _pure(why: str) -> _Loaded:
    """The pure-PyTorch path, to be warned about at import, saying why."""
    return _Loaded(None, None, None, None, why, warn=True)


def _open(name: str, found: Path, where: str, why: str) -> _Loaded:
    """Loads the build ``name`` from the file ``found``, which registers the operators."""
    try:
        torch.ops.load_library(str(found))
    except Exception as err:  # noqa: BLE001 - a broken build must not break the import of rlcore
        return _pure(f"the compiled {name} kernels at {found} failed to load ({err})")
    _register_fakes()
    return _Loaded(torch.ops.rlcore, name, where, found, why)


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


ops, variant, source, path, reason, _warn = _load()
if _warn:
    warnings.warn(f"rlcore: {reason}; rlcore.logprobs runs its pure-PyTorch path, several times slower on CPU "
                  "(RLCORE_PURE_TORCH=1 chooses that path without this warning)", RuntimeWarning, stacklevel=1)


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
