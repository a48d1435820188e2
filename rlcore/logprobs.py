"""Per-token log-probabilities and entropies without full-vocabulary temporaries.

The naive ``log_softmax(logits).gather(...)`` writes a second ``[B, T, V]`` tensor (after a
float32 copy for half-precision logits) and its backward a third. The functions here work on row
chunks (from hidden states: vocabulary blocks) whose temporaries stay 16-32 MB, accumulate in
float32 (float64 for float64 inputs), and save only what their backward needs. Extra memory
(``N`` rows, ``V`` vocabulary): ``token_logprobs`` / ``entropy_from_logits`` one to three chunks
forward, the gradient ``[N, V]`` plus one chunk backward; ``rlcore.lm_head.hidden_logprobs`` (the
log-probs from hidden states through the LM head) a few blocks and the gradients ``[N, H]``,
``[V, H]``, ``[V]``, never the ``[N, V]`` logits.

Compiled kernels: on CPU, ``token_logprobs`` and ``entropy_from_logits`` of float32, bfloat16 and
float16 logits run C++ kernels (``rlcore/csrc``, compiled by the install or on first use for the
default, AVX2 and AVX-512 instruction sets, the best one the CPU runs loaded by ``rlcore._kernels``;
``python -m rlcore.kernels`` says which): per row, one
read of the logits forward (maximum, log-sum-exp, the label's logit; float32 statistics) and one
pass backward that writes the gradient. The chunked pure-PyTorch path here is their fallback and
reference: float64 logits, other devices, a vocabulary dim that is not contiguous, no build
loaded (no C++ compiler: a warning at import), or ``RLCORE_PURE_TORCH=1`` in the environment.

Shapes: ``...`` any leading dims (``[B, T]`` typically), ``V`` vocabulary, ``H`` hidden size.
"""

from __future__ import annotations

import itertools
import math

import torch
from torch.autograd.function import once_differentiable

from rlcore import _kernels
from rlcore.checks import check_float, check_mask, check_ndim, check_same_shape
from rlcore.masked import masked_mean, masked_sum

__all__ = ["token_logprobs", "entropy_from_logits", "sequence_logprobs"]

# float32 bytes of one row chunk (logits path) and one block (hidden path): small against [N, V],
# large enough that per-op overhead stays negligible (4 MB chunks ran ~3x slower than 16 MB ones
# on a busy CPU, no faster on an idle one); the hidden path's blocks also feed matmuls. A GPU
# launches each op as a kernel (microseconds apiece) and reads memory ~100x faster, so its chunks
# are 16x larger: at 16 MB, 8192 rows of a 151,936-word vocabulary took 4.8x the time of one
# matmul + log_softmax on an H200, launch-bound (benchmarks/gpu.py).
_CHUNK_BYTES = 16 * 2**20
_FAR = 2.0**24  # |log-normaliser| from which its float32 ulp (≥ 1) rounds a softmax probability away
_BLOCK_BYTES = 32 * 2**20  # rlcore.lm_head's
_GPU_SCALE = 16


def _budget(nbytes: int, device: torch.device) -> int:
    """``nbytes`` on a CPU, ``_GPU_SCALE`` times it on an accelerator (CUDA, MPS, XPU)."""
    return nbytes if device.type == "cpu" else _GPU_SCALE * nbytes


# --- helpers --------------------------------------------------------------------------------
def _acc(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: float64 stays float64, everything else computes in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _mergeable(x: torch.Tensor) -> bool:
    """Whether the leading dims of ``x [..., V]`` view as one ``[N, V]`` without a copy."""
    lead = [(n, s) for n, s in zip(x.shape[:-1], x.stride()[:-1]) if n != 1]
    return x.numel() == 0 or all(s0 == n1 * s1 for (_, s0), (n1, s1) in itertools.pairwise(lead))


def _row_blocks(x: torch.Tensor) -> list[torch.Tensor]:
    """2-D views ``[n, V]`` covering the rows of ``x [..., V]`` in row-major order (no copy).

    A sliced input such as ``logits[:, :-1]`` is not one ``[N, V]`` view; it is split along its
    first dim instead of being copied.
    """
    if _mergeable(x):
        return [x.reshape(-1, x.shape[-1])]
    return [b for sub in x.unbind(0) for b in _row_blocks(sub)]


def _row_chunks(x: torch.Tensor, rows: int) -> list[tuple[int, torch.Tensor]]:
    """``(offset, [r, V] view)`` pairs, ``r ≤ rows``, covering the rows of ``x`` in order."""
    chunks, offset = [], 0
    for block in _row_blocks(x):
        for start in range(0, block.shape[0], rows):
            chunk = block[start:start + rows]
            chunks.append((offset, chunk))
            offset += chunk.shape[0]
    return chunks


def _rows_per_chunk(width: int, chunk_size: int | None, device: torch.device) -> int:
    _check_positive("chunk_size", chunk_size)
    return chunk_size if chunk_size is not None else max(1, _budget(_CHUNK_BYTES, device) // (4 * max(width, 1)))


def _check_positive(name: str, value: float | None) -> None:
    if value is not None and not value > 0:
        raise ValueError(f"{name}: expected a positive number, got {value}")


def _check_labels(labels: torch.Tensor, like: torch.Tensor, like_name: str, vocab: int) -> None:
    """``labels`` must be an integer tensor shaped like ``like`` without its last dim, its ids in
    ``[0, vocab)`` (one min/max read, in eager mode: an id outside would index past the vocabulary,
    a device assert on CUDA; a compiled graph skips the read)."""
    lead = torch.empty((), device=like.device).expand(like.shape[:-1])  # a view: no copy, any width
    check_same_shape(f"{like_name}[..., 0]", lead, labels=labels)
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise TypeError(f"labels: expected an integer (long) tensor, got dtype {labels.dtype} "
                        f"with shape {list(labels.shape)}")
    if labels.numel() and not torch.compiler.is_compiling():  # a data-dependent read: eager only
        low, high = (int(v) for v in torch.aminmax(labels))
        if low < 0 or high >= vocab:
            raise ValueError(f"labels: expected ids in [0, {vocab}) (the vocabulary V), got ids from {low} to {high}; "
                             "padding positions need a valid id (e.g. 0), masked downstream")


def _work(logits: torch.Tensor, rows: int, acc: torch.dtype, needed: bool) -> torch.Tensor | None:
    """A reusable ``[rows, V]`` chunk in ``acc`` if ``needed``: one allocation per call, not per chunk."""
    n = math.prod(logits.shape[:-1])
    return torch.empty(min(rows, n), logits.shape[-1], dtype=acc, device=logits.device) if needed else None


def _scaled(chunk: torch.Tensor, temperature: float, work: torch.Tensor | None,
            shift: torch.Tensor | None) -> torch.Tensor:
    """``x = (chunk − shift)/τ`` in float32 (``chunk`` itself, or in ``work``); the one definition
    of ``x`` that forward and backward share, so that they agree to the last bit.

    ``shift`` (the row maxima, with ``τ < 1``): ``x ≤ 0``, so dividing by ``τ`` cannot overflow
    for logits anywhere in the float range (``logits/τ`` would pass the largest float)."""
    if work is None:
        return chunk
    x = work[:len(chunk)]
    if shift is not None:
        if chunk.dtype != work.dtype:  # upcast first: the difference would round in half precision
            return x.copy_(chunk).sub_(shift[:, None]).div_(temperature)
        return torch.sub(chunk, shift[:, None], out=x).div_(temperature)
    if chunk.dtype == work.dtype:
        return torch.div(chunk, temperature, out=x)
    x.copy_(chunk)  # upcast first: a division by a Python number would run (and round) in half precision
    return x if temperature == 1.0 else x.div_(temperature)


def _scaled_log_softmax(chunk: torch.Tensor, temperature: float, work: torch.Tensor | None,
                        out: torch.Tensor | None = None, shift: torch.Tensor | None = None):
    """``(x, log_softmax(x))`` with ``x = _scaled(chunk, ...)``; the log-softmax is written into
    ``out`` when given (a buffer reused across chunks: a fresh multi-megabyte result per chunk would
    be fresh pages, and first-touch faults cost as much as the arithmetic)."""
    x = _scaled(chunk, temperature, work, shift)
    return x, (torch.log_softmax(x, dim=-1) if out is None else torch.log_softmax(x, dim=-1, out=out[:len(x)]))


def _row_max(chunk: torch.Tensor, temperature: float) -> torch.Tensor | None:
    """The shift of :func:`_scaled`: the row maxima when ``τ < 1`` (else ``None``, no shift)."""
    return chunk.amax(dim=-1) if temperature < 1.0 else None


def _grad_chunks(logits, lse, rows, temperature, fill, shifts=None) -> torch.Tensor:
    """Backward of a row-chunked function: ``work = x − lse`` (log p, ``x`` as the forward made it,
    :func:`_scaled`; clamped to ≤ 0 against the rounding of ``lse``) per chunk, turned in place into
    the chunk's gradient by ``fill(work, rows_slice)``, all in one gradient buffer.

    ``work`` is the gradient's own rows when no cast is needed (no temporary at all), else one
    reusable float32 chunk copied into the half-precision gradient.

    A chunk whose log-normalisers reach ``|lse| ≥ 2^24`` (logits near the ends of the float range
    without a shift, ``τ ≥ 1``; a label logit overflowing below the row's maximum, ``lse = +inf``,
    with or without) is read again through ``log_softmax``, which works relative to each row's
    maximum: ``x − lse`` would round the probabilities away there (the ulp of 3e38 is 2e31). One
    host check per chunk decides.
    """
    acc = lse.dtype
    grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    grad_rows, buf = grad.view(-1, logits.shape[-1]), _work(logits, rows, acc, logits.dtype != acc)
    for off, chunk in _row_chunks(logits, rows):
        sl = slice(off, off + len(chunk))
        dst = grad_rows[sl]
        out = dst if buf is None else buf
        shift = None if shifts is None else shifts[sl]
        if len(chunk) and bool(lse[sl].abs().amax() >= _FAR):
            x = _scaled(chunk, temperature, out, shift)
            work = x.copy_(torch.log_softmax(x, dim=-1))
        elif shifts is None and temperature == 1.0:
            work = torch.sub(chunk, lse[sl, None], out=out[:len(chunk)])  # half chunks promoted
        else:
            work = _scaled(chunk, temperature, out, shift).sub_(lse[sl, None])
        fill(work.clamp_(max=0.0), sl)
        if work is not dst:
            dst.copy_(work)
    return grad


# --- token_logprobs -------------------------------------------------------------------------
class _TokenLogprobs(torch.autograd.Function):
    """``log softmax(logits / T)[label]`` over row chunks; backward writes one gradient buffer."""

    @staticmethod
    def forward(ctx, logits, labels, temperature, rows):
        acc = _acc(logits.dtype)
        n = labels.numel()
        flat_labels = labels.reshape(n, 1)
        out, lse = (torch.empty(n, dtype=acc, device=logits.device) for _ in range(2))
        shifts = torch.empty(n, dtype=logits.dtype, device=logits.device) if temperature < 1.0 else None
        lowest = torch.finfo(acc).min
        work = _work(logits, rows, acc, logits.dtype != acc or temperature != 1.0)
        buf = _work(logits, rows, acc, True)
        for off, chunk in _row_chunks(logits, rows):
            sl = slice(off, off + len(chunk))
            shift = _row_max(chunk, temperature)
            x, logp = _scaled_log_softmax(chunk, temperature, work, buf, shift)
            lp = logp.gather(-1, flat_labels[sl])[:, 0]
            x_y = x.gather(-1, flat_labels[sl])[:, 0]
            # A finite label logit further below the row's maximum than the float range reaches:
            # the largest negative value, not −inf; a −inf logit (masked vocabulary) keeps its −inf.
            masked = chunk.gather(-1, flat_labels[sl])[:, 0] == -math.inf
            out[sl] = torch.where(masked, lp, lp.clamp(min=lowest))
            # lse = x_y − logp_y: exact to a few ulps of |logp_y|, and no extra pass over the
            # chunk (the backward clamps log p ≤ 0 against that rounding). A −inf label logit
            # gives lse = +inf, i.e. a zero softmax in backward, never NaN.
            lse[sl] = x_y.clamp(min=lowest) - lp
            if shifts is not None and shift is not None:
                shifts[sl] = shift
            del x, logp  # free this chunk's temporaries before the next chunk allocates its own
        ctx.save_for_backward(logits, flat_labels, lse, *(() if shifts is None else (shifts,)))
        ctx.temperature, ctx.rows = temperature, rows
        return out.view(labels.shape)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        logits, flat_labels, lse, *shifts = ctx.saved_tensors
        g = grad_out.reshape(-1, 1).to(lse.dtype) / ctx.temperature   # [N, 1]

        def fill(logp, sl):  # log p → g·(onehot(y) − p)/τ, in place
            logp.exp_().mul_(-g[sl]).scatter_add_(-1, flat_labels[sl], g[sl])

        return _grad_chunks(logits, lse, ctx.rows, ctx.temperature, fill, *shifts), None, None, None


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, *, temperature: float = 1.0,
                   chunk_size: int | None = None) -> torch.Tensor:
    """Log-probability of each label under ``softmax(logits / temperature)``, chunked over rows.

    ``logp[...] = logits[..., y]/τ − log Σ_v exp(logits[..., v]/τ)``, with ``y = labels[...]``.

    Memory: the rows (all leading dims flattened, without a copy even for a sliced input such as
    ``logits[:, :-1]``) are processed ``chunk_size`` at a time, each chunk upcast to float32 and
    passed through one ``log_softmax``; no ``[..., V]`` float32 copy of the logits ever exists.
    The autograd graph saves the logits themselves, the labels and the per-row log-normaliser
    ``[N]``. Backward writes ``∂logp/∂logits = g·(onehot(y) − softmax(logits/τ))/τ`` chunk by
    chunk into one gradient buffer of the logits' dtype, so the only full-size allocation of a
    forward+backward is the gradient itself.

    Speed: on CPU, float32 / bfloat16 / float16 logits go through the compiled kernels (module
    docstring): one read of the logits forward, one pass writing the gradient backward, the same
    memory (the graph saves the logits, the labels and two float32 numbers per row) and the same
    values to float32 rounding; ``chunk_size`` then has no effect. Elsewhere, or without a build,
    this chunked pure-PyTorch path runs.

    Args:
        logits: ``[..., V]`` float32 / float64 / bfloat16 / float16.
        labels: ``[...]`` long, ids in ``[0, V)`` (``logits.shape[:-1]``). Padding positions must
            hold a valid id (e.g. 0) and be masked downstream; an id outside ``[0, V)`` (``-100``)
            raises a ``ValueError`` naming ``labels``.
        temperature: ``τ > 0``; pass the sampling temperature to score the sampled distribution.
        chunk_size: rows per chunk of the pure-PyTorch path; default keeps a chunk's float32
            temporaries near 16 MB.
    Returns:
        ``[...]`` float32 for half-precision logits, else the logits' dtype.

    >>> logits = torch.tensor([[0.0, 0.0], [0.0, 1.0]])
    >>> token_logprobs(logits, torch.tensor([0, 1]))
    tensor([-0.6931, -0.3133])

    References:
        Milakov & Gimelshein, "Online normalizer calculation for softmax",
        https://arxiv.org/abs/1805.02867 (the log-normaliser kept per row).

    Gradient: flows to ``logits`` (not twice differentiable); ``labels`` have none.
    """
    check_float("logits", logits)
    check_ndim("logits", logits, min_ndim=1, layout="[..., V]")
    if logits.shape[-1] == 0:
        raise ValueError(f"logits: expected a non-empty vocabulary dim [..., V], got shape {list(logits.shape)}")
    _check_labels(labels, logits, "logits", logits.shape[-1])
    _check_positive("temperature", temperature)
    rows = _rows_per_chunk(logits.shape[-1], chunk_size, logits.device)
    if _kernels.usable(logits, temperature):
        return _kernels.TokenLogprobs.apply(logits, labels.long(), float(temperature))
    return _TokenLogprobs.apply(logits, labels.long(), float(temperature), rows)


# --- entropy_from_logits --------------------------------------------------------------------
class _Entropy(torch.autograd.Function):
    """``H = −Σ p log p`` of ``softmax(logits / T)`` over row chunks, with its exact gradient."""

    @staticmethod
    def forward(ctx, logits, temperature, rows):
        acc = _acc(logits.dtype)
        n = math.prod(logits.shape[:-1])
        ent, lse = (torch.empty(n, dtype=acc, device=logits.device) for _ in range(2))
        shifts = torch.empty(n, dtype=logits.dtype, device=logits.device) if temperature < 1.0 else None
        work = _work(logits, rows, acc, logits.dtype != acc or temperature != 1.0)
        buf = _work(logits, rows, acc, True)
        for off, chunk in _row_chunks(logits, rows):
            sl = slice(off, off + len(chunk))
            shift = _row_max(chunk, temperature)
            x, logp = _scaled_log_softmax(chunk, temperature, work, buf, shift)
            if shifts is not None and shift is not None:
                shifts[sl] = shift
            # lse = max_v x_v − max_v log p_v: read where log p ≈ 0, so exact and finite
            lse[sl] = x.amax(dim=-1) - logp.amax(dim=-1)
            p = logp.exp()
            # p = 0 where logits are −inf: clamp log p so that p·log p is 0, not NaN
            ent[sl] = -p.mul_(logp.clamp_(min=torch.finfo(acc).min)).sum(-1)
            del x, logp, p  # free this chunk's temporaries before the next chunk allocates its own
        ctx.save_for_backward(logits, lse, ent, *(() if shifts is None else (shifts,)))
        ctx.temperature, ctx.rows = temperature, rows
        return ent.view(logits.shape[:-1])

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        logits, lse, ent, *shifts = ctx.saved_tensors
        g = grad_out.reshape(-1, 1).to(lse.dtype) / ctx.temperature
        lowest = torch.finfo(lse.dtype).min

        def fill(logp, sl):  # log p → −g·p·(log p + H)/τ, in place (log p clamped: 0·−inf is NaN)
            p = logp.exp()
            logp.clamp_(min=lowest).add_(ent[sl, None]).mul_(p).mul_(-g[sl])

        return _grad_chunks(logits, lse, ctx.rows, ctx.temperature, fill, *shifts), None, None


def entropy_from_logits(logits: torch.Tensor, *, temperature: float = 1.0,
                        chunk_size: int | None = None) -> torch.Tensor:
    """Entropy of ``softmax(logits / temperature)`` per row, chunked over rows, differentiable.

    ``H[...] = −Σ_v p_v log p_v``, ``p = softmax(logits[...]/τ)``; logits of ``−inf`` (masked
    vocabulary) contribute 0.

    Memory: as ``token_logprobs``: row chunks of ~16 MB upcast to float32; the graph saves the
    logits, the log-normaliser ``[N]`` and ``H [N]``; backward writes
    ``∂H/∂logits_v = −g·p_v (log p_v + H)/τ`` chunk by chunk into one gradient buffer. On CPU,
    float32 / bfloat16 / float16 logits go through the compiled kernels instead (one read forward,
    one pass backward; module docstring).

    Args:
        logits: ``[..., V]`` float32 / float64 / bfloat16 / float16.
        temperature: ``τ > 0``.
        chunk_size: rows per chunk; default keeps a chunk's float32 temporaries near 16 MB.
    Returns:
        ``[...]`` float32 for half-precision logits, else the logits' dtype.

    >>> entropy_from_logits(torch.zeros(2, 4))
    tensor([1.3863, 1.3863])

    References:
        Shannon, "A Mathematical Theory of Communication" (1948); entropy bonus as in
        Schulman et al., "Proximal Policy Optimization Algorithms", https://arxiv.org/abs/1707.06347

    Gradient: exact, to ``logits`` (not twice differentiable). Callers wanting a detached metric
    pass ``logits.detach()``.
    """
    check_float("logits", logits)
    check_ndim("logits", logits, min_ndim=1, layout="[..., V]")
    _check_positive("temperature", temperature)
    rows = _rows_per_chunk(logits.shape[-1], chunk_size, logits.device)
    if _kernels.usable(logits, temperature):
        return _kernels.Entropy.apply(logits, float(temperature))
    return _Entropy.apply(logits, float(temperature), rows)


# --- sequence_logprobs ----------------------------------------------------------------------
def sequence_logprobs(logprobs: torch.Tensor, mask: torch.Tensor, *, average: bool = False) -> torch.Tensor:
    """Log-probability of each sequence: the masked sum of its token log-probs (or their mean).

    ``Σ_t m_t·logp_t`` (``average=False``: DPO, RLOO) or ``Σ_t m_t·logp_t / max(Σ_t m_t, 1)``
    (``average=True``: the length-normalised log-prob of ORPO, SimPO and IPO).

    Args:
        logprobs: ``[..., T]`` float per-token log-probs.
        mask: ``[..., T]`` bool, True on the tokens that count (completion tokens).
        average: divide by the number of tokens under the mask.
    Returns:
        ``[...]``; 0 for a row whose mask is empty. Values under ``mask=False`` are never read
        (NaN there is harmless, in the value and in the gradient).

    >>> sequence_logprobs(torch.tensor([[-1.0, -2.0, float("nan")]]), torch.tensor([[True, True, False]]))
    tensor([-3.])

    References:
        Rafailov et al., "Direct Preference Optimization", https://arxiv.org/abs/2305.18290;
        Meng et al., "SimPO", https://arxiv.org/abs/2405.14734; Hong et al., "ORPO",
        https://arxiv.org/abs/2403.07691.

    Gradient: flows to ``logprobs`` on masked-in tokens only.
    """
    check_float("logprobs", logprobs)
    check_ndim("logprobs", logprobs, min_ndim=1, layout="[..., T]")
    check_mask("mask", mask, like=logprobs, like_name="logprobs")
    return (masked_mean if average else masked_sum)(logprobs, mask, dim=-1)
