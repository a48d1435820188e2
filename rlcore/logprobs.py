"""Per-token log-probabilities and entropies without full-vocabulary temporaries.

The naive ``log_softmax(logits).gather(...)`` writes a second ``[B, T, V]`` tensor (after a
float32 copy for half-precision logits) and its backward a third. The functions here work on row
chunks (from hidden states: vocabulary blocks) whose temporaries stay 16-32 MB, accumulate in
float32 (float64 for float64 inputs), and save only what their backward needs. Extra memory
(``N`` rows, ``V`` vocabulary): ``token_logprobs`` / ``entropy_from_logits`` one to three chunks
forward, the gradient ``[N, V]`` plus one chunk backward; ``hidden_logprobs`` a few blocks and
the gradients ``[N, H]``, ``[V, H]``, ``[V]``, never the ``[N, V]`` logits.

Shapes: ``...`` any leading dims (``[B, T]`` typically), ``V`` vocabulary, ``H`` hidden size.
"""

from __future__ import annotations

import contextlib
import itertools
import math

import torch
from torch.autograd.function import once_differentiable

from rlcore.checks import check_float, check_mask, check_ndim, check_same_shape
from rlcore.masked import masked_mean, masked_sum

__all__ = ["token_logprobs", "entropy_from_logits", "hidden_logprobs", "sequence_logprobs"]

# float32 bytes of one row chunk (logits path) and one block (hidden path): small against [N, V],
# large enough that per-op overhead stays negligible (4 MB chunks ran ~3x slower than 16 MB ones
# on a busy CPU, no faster on an idle one); the hidden path's blocks also feed matmuls.
_CHUNK_BYTES = 16 * 2**20
_BLOCK_BYTES = 32 * 2**20


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


def _rows_per_chunk(width: int, chunk_size: int | None) -> int:
    _check_positive("chunk_size", chunk_size)
    return chunk_size if chunk_size is not None else max(1, _CHUNK_BYTES // (4 * max(width, 1)))


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


def _scaled_log_softmax(chunk: torch.Tensor, temperature: float, work: torch.Tensor | None,
                        out: torch.Tensor | None = None):
    """``(x, log_softmax(x))`` with ``x = chunk / τ`` in float32 (``chunk`` itself, or in ``work``);
    the log-softmax is written into ``out`` when given (a buffer reused across chunks: a fresh
    multi-megabyte result per chunk would be fresh pages, and first-touch faults cost as much as
    the arithmetic)."""
    if work is None:
        x = chunk
    elif chunk.dtype == work.dtype:
        x = torch.div(chunk, temperature, out=work[:len(chunk)])
    else:  # upcast first: a division by a Python number would run (and round) in half precision
        x = work[:len(chunk)].copy_(chunk)
        if temperature != 1.0:
            x.div_(temperature)
    return x, (torch.log_softmax(x, dim=-1) if out is None else torch.log_softmax(x, dim=-1, out=out[:len(x)]))


def _grad_chunks(logits, lse, rows, temperature, fill) -> torch.Tensor:
    """Backward of a row-chunked function: ``work = logits/τ − lse`` (log p) per chunk, turned in
    place into the chunk's gradient by ``fill(work, rows_slice)``, all in one gradient buffer.

    ``work`` is the gradient's own rows when no cast is needed (no temporary at all), else one
    reusable float32 chunk copied into the half-precision gradient.
    """
    acc = lse.dtype
    grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    grad_rows, buf = grad.view(-1, logits.shape[-1]), _work(logits, rows, acc, logits.dtype != acc)
    for off, chunk in _row_chunks(logits, rows):
        sl = slice(off, off + len(chunk))
        dst = grad_rows[sl]
        out = dst if buf is None else buf[:len(chunk)]
        work = torch.add(-lse[sl, None], chunk, alpha=1.0 / temperature, out=out)  # half chunks promoted
        fill(work, sl)
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
        lowest = torch.finfo(acc).min
        work = _work(logits, rows, acc, logits.dtype != acc or temperature != 1.0)
        buf = _work(logits, rows, acc, True)
        for off, chunk in _row_chunks(logits, rows):
            sl = slice(off, off + len(chunk))
            x, logp = _scaled_log_softmax(chunk, temperature, work, buf)
            lp = logp.gather(-1, flat_labels[sl])[:, 0]
            out[sl] = lp
            # lse = x_y − logp_y: exact to a few ulps of |logp_y|, and no extra pass over the
            # chunk. A −inf label logit gives lse = +inf, i.e. a zero softmax in backward
            # (finite gradients for a row whose log-prob is −inf), never NaN.
            lse[sl] = x.gather(-1, flat_labels[sl])[:, 0].clamp(min=lowest) - lp
            del x, logp  # free this chunk's temporaries before the next chunk allocates its own
        ctx.save_for_backward(logits, flat_labels, lse)
        ctx.temperature, ctx.rows = temperature, rows
        return out.view(labels.shape)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        logits, flat_labels, lse = ctx.saved_tensors
        g = grad_out.reshape(-1, 1).to(lse.dtype) / ctx.temperature   # [N, 1]

        def fill(logp, sl):  # log p → g·(onehot(y) − p)/τ, in place
            logp.exp_().mul_(-g[sl]).scatter_add_(-1, flat_labels[sl], g[sl])

        return _grad_chunks(logits, lse, ctx.rows, ctx.temperature, fill), None, None, None


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

    Args:
        logits: ``[..., V]`` float32 / float64 / bfloat16 / float16.
        labels: ``[...]`` long, ids in ``[0, V)`` (``logits.shape[:-1]``). Padding positions must
            hold a valid id (e.g. 0) and be masked downstream; an id outside ``[0, V)`` (``-100``)
            raises a ``ValueError`` naming ``labels``.
        temperature: ``τ > 0``; pass the sampling temperature to score the sampled distribution.
        chunk_size: rows per chunk; default keeps a chunk's float32 temporaries near 16 MB.
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
    rows = _rows_per_chunk(logits.shape[-1], chunk_size)
    return _TokenLogprobs.apply(logits, labels.long(), float(temperature), rows)


# --- entropy_from_logits --------------------------------------------------------------------
class _Entropy(torch.autograd.Function):
    """``H = −Σ p log p`` of ``softmax(logits / T)`` over row chunks, with its exact gradient."""

    @staticmethod
    def forward(ctx, logits, temperature, rows):
        acc = _acc(logits.dtype)
        n = math.prod(logits.shape[:-1])
        ent, lse = (torch.empty(n, dtype=acc, device=logits.device) for _ in range(2))
        work = _work(logits, rows, acc, logits.dtype != acc or temperature != 1.0)
        buf = _work(logits, rows, acc, True)
        for off, chunk in _row_chunks(logits, rows):
            sl = slice(off, off + len(chunk))
            x, logp = _scaled_log_softmax(chunk, temperature, work, buf)
            # lse = max_v x_v − max_v log p_v: read where log p ≈ 0, so exact and finite
            lse[sl] = x.amax(dim=-1) - logp.amax(dim=-1)
            p = logp.exp()
            # p = 0 where logits are −inf: clamp log p so that p·log p is 0, not NaN
            ent[sl] = -p.mul_(logp.clamp_(min=torch.finfo(acc).min)).sum(-1)
            del x, logp, p  # free this chunk's temporaries before the next chunk allocates its own
        ctx.save_for_backward(logits, lse, ent)
        ctx.temperature, ctx.rows = temperature, rows
        return ent.view(logits.shape[:-1])

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        logits, lse, ent = ctx.saved_tensors
        g = grad_out.reshape(-1, 1).to(lse.dtype) / ctx.temperature
        lowest = torch.finfo(lse.dtype).min

        def fill(logp, sl):  # log p → −g·p·(log p + H)/τ, in place (log p clamped: 0·−inf is NaN)
            p = logp.exp()
            logp.clamp_(min=lowest).add_(ent[sl, None]).mul_(p).mul_(-g[sl])

        return _grad_chunks(logits, lse, ctx.rows, ctx.temperature, fill), None, None


def entropy_from_logits(logits: torch.Tensor, *, temperature: float = 1.0,
                        chunk_size: int | None = None) -> torch.Tensor:
    """Entropy of ``softmax(logits / temperature)`` per row, chunked over rows, differentiable.

    ``H[...] = −Σ_v p_v log p_v``, ``p = softmax(logits[...]/τ)``; logits of ``−inf`` (masked
    vocabulary) contribute 0.

    Memory: as ``token_logprobs``: row chunks of ~16 MB upcast to float32; the graph saves the
    logits, the log-normaliser ``[N]`` and ``H [N]``; backward writes
    ``∂H/∂logits_v = −g·p_v (log p_v + H)/τ`` chunk by chunk into one gradient buffer.

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
    rows = _rows_per_chunk(logits.shape[-1], chunk_size)
    return _Entropy.apply(logits, float(temperature), rows)


# --- hidden_logprobs ------------------------------------------------------------------------
def _head_block(h, weight, bias, v0, v1, *, acc, logit_scale, softcap, temperature):
    """Logits of vocabulary ``[v0, v1)`` for rows ``h [r, H]``: ``[r, v1−v0]`` in ``acc``.

    ``l = c·tanh(s·(h·Wᵀ + b)/c) / τ``; the matmul runs in the input dtype (as the LM head
    would), the rest in ``acc`` on a fresh tensor this function owns.
    """
    w = weight[v0:v1]
    z = (h @ w.T if bias is None else torch.addmm(bias[v0:v1], h, w.T)).to(acc)
    if softcap is not None:  # the three scalings folded into two passes
        return z.mul_(logit_scale / softcap).tanh_().mul_(softcap / temperature)
    return z if logit_scale == temperature else z.mul_(logit_scale / temperature)


def _label_logit(l, labels, v0, current):
    """Take ``l[r, labels − v0]`` where the label falls in this vocabulary block, else ``current``."""
    inside = (labels >= v0) & (labels < v0 + l.shape[1])
    idx = (labels - v0).clamp(0, l.shape[1] - 1)
    return torch.where(inside, l.gather(-1, idx[:, None])[:, 0], current)


def _fold_vocabulary(h, labels, weight, bias, chunk, with_entropy, **kw):
    """Online log-sum-exp over vocabulary blocks for rows ``h [r, H]``: ``(lse, l_y, H)`` ``[r]``.

    Running max ``m``, ``s = Σ e^{l−m}`` and ``u = Σ e^{l−m}(l−m)`` are rescaled by ``e^{m−m'}``
    when the max grows; ``lse = m + log s``, ``H = log s − u/s``. ``H`` is empty unless asked for.
    """
    acc = kw["acc"]
    m = torch.full((len(h),), torch.finfo(acc).min, dtype=acc, device=h.device)
    s, u = torch.zeros_like(m), torch.zeros_like(m)
    label_logit = torch.full_like(m, float("nan"))  # stays NaN for a label outside [0, V)
    for v0 in range(0, weight.shape[0], chunk):
        l = _head_block(h, weight, bias, v0, v0 + chunk, **kw)
        label_logit = _label_logit(l, labels, v0, label_logit)
        m_new = torch.maximum(m, l.amax(-1))
        rescale = torch.exp(m - m_new)
        d = l.sub_(m_new[:, None])                                   # l − m', in place
        e = d.exp() if with_entropy else d.exp_()
        s_block = e.sum(-1)
        if with_entropy:
            u = rescale * (u + (m - m_new) * s) + e.mul_(d).sum(-1)
        s, m = s * rescale + s_block, m_new
        del l, d, e  # free the block before the next one is computed
    log_s = s.log()
    return m + log_s, label_logit, (log_s - u / s) if with_entropy else m[:0]


def _hidden_rows(vocab_chunk: int) -> int:
    """Rows per block of the hidden path, so that a ``[rows, vocab_chunk]`` block is ~32 MB."""
    return max(1, _BLOCK_BYTES // (4 * vocab_chunk))


class _HiddenLogprobs(torch.autograd.Function):
    """Log-probs (and entropy) from hidden states and an LM head, over vocabulary chunks."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, temperature, softcap, logit_scale, chunk,
                with_entropy):
        kw = dict(acc=_acc(hidden.dtype), logit_scale=logit_scale, softcap=softcap, temperature=temperature)
        rows = _hidden_rows(chunk)
        parts = [_fold_vocabulary(hidden[r0:r0 + rows], labels[r0:r0 + rows], weight, bias, chunk,
                                  with_entropy, **kw) for r0 in range(0, hidden.shape[0], rows)]
        lse, label_logit, ent = (torch.cat(p) for p in zip(*parts))
        ctx.save_for_backward(hidden, weight, bias, labels, lse, ent, label_logit)
        ctx.kw, ctx.chunk, ctx.rows, ctx.with_entropy = kw, chunk, rows, with_entropy
        device = hidden.device.type  # backward recomputes the blocks under the forward's autocast
        amp = torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)
        ctx.amp = dict(device_type=device, dtype=torch.get_autocast_dtype(device)) if amp else None
        ctx.set_materialize_grads(False)
        return label_logit - lse, ent

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_lp, grad_ent):
        with contextlib.nullcontext() if ctx.amp is None else torch.autocast(**ctx.amp):
            return _hidden_backward(ctx, grad_lp, grad_ent)


def _hidden_backward(ctx, grad_lp, grad_ent):
    """Backward of ``_HiddenLogprobs``: recompute each block of logits, accumulate the three gradients."""
    hidden, weight, bias, labels, lse, ent, label_logit = ctx.saved_tensors
    kw, acc, n = ctx.kw, ctx.kw["acc"], hidden.shape[0]
    factor = kw["logit_scale"] / kw["temperature"]  # ∂l'/∂z without the soft cap
    g_lp = torch.zeros(n, dtype=acc, device=hidden.device) if grad_lp is None else grad_lp.to(acc) * factor
    g_ent = grad_ent.to(acc) * factor if grad_ent is not None and ctx.with_entropy else None
    need_h, need_w, need_b = ctx.needs_input_grad[:3]
    zeros = lambda like: torch.zeros(like.shape, dtype=acc, device=like.device)  # noqa: E731
    grad_h, grad_w = zeros(hidden) if need_h else None, zeros(weight) if need_w else None
    grad_b = zeros(bias) if need_b else None
    for r0 in range(0, n, ctx.rows):
        rs = slice(r0, r0 + ctx.rows)
        h = hidden[rs]
        for v0 in range(0, weight.shape[0], ctx.chunk):
            l = _head_block(h, weight, bias, v0, v0 + ctx.chunk, **kw)
            q, row = _softmax_grad_block(l, lse[rs], ent[rs], g_lp[rs], None if g_ent is None else g_ent[rs],
                                         softcap=kw["softcap"], temperature=kw["temperature"])
            qd, w = q.to(hidden.dtype), weight[v0:v0 + ctx.chunk]
            if grad_h is not None:
                grad_h[rs].addcmul_((qd @ w).to(acc), row[:, None])
            if grad_w is not None:
                hr, blk = (h.to(acc) * row[:, None]).to(hidden.dtype), grad_w[v0:v0 + ctx.chunk]
                if acc == hidden.dtype and ctx.amp is None:
                    blk.addmm_(qd.T, hr)                         # in place, no temporary
                else:
                    blk.add_((qd.T @ hr).to(acc))
            if grad_b is not None:
                grad_b[v0:v0 + ctx.chunk] += q.T @ row
            del l, q, qd  # free the block before the next one is computed
        _label_grad(grad_h, grad_w, grad_b, rs, h, weight, labels[rs], g_lp[rs], label_logit[rs], **kw)
    cast = lambda g, like: None if g is None else g.to(like.dtype)  # noqa: E731
    return (cast(grad_h, hidden), cast(grad_w, weight), cast(grad_b, weight),
            None, None, None, None, None, None)


def _softmax_grad_block(l, lse, ent, g_lp, g_ent, *, softcap, temperature):
    """One vocabulary block of the softmax part of ``∂L/∂z`` (``z = h·Wᵀ + b``), as ``row ⊙ q``.

    ``∂L/∂z_v = c·δ_{v,y} − dtanh_v·p_v·(g_lp + g_H·(log p_v + H))``, with the ``g`` already
    multiplied by ``s/τ`` (the label term ``c·δ`` is added by ``_label_grad``). Without a soft cap
    or an entropy gradient the block is ``−g_lp ⊙ p``: ``q = p`` and the per-row factor
    ``row = −g_lp`` is applied to the small ``[rows, H]`` matmul operands, not to the block.
    Works in place on ``l`` (the block's logits over ``τ``), which the caller owns.
    """
    if softcap is None and g_ent is None:
        return l.sub_(lse[:, None]).exp_(), -g_lp
    dtanh = None if softcap is None else 1 - (l * (temperature / softcap)).square()  # 1 − tanh²
    logp = l.sub_(lse[:, None])
    if g_ent is None:
        q = logp.exp_().mul_(g_lp[:, None])
    else:
        p = logp.exp()
        q = logp.add_(ent[:, None]).mul_(g_ent[:, None]).add_(g_lp[:, None]).mul_(p)
    if dtanh is not None:
        q.mul_(dtanh)
    return q, torch.full_like(g_lp, -1.0)


def _label_grad(grad_h, grad_w, grad_b, rs, h, weight, labels, g_lp, label_logit, *, acc, softcap,
                temperature, logit_scale):
    """Add the label term ``c·δ_{v,y}`` of ``∂L/∂z``, ``c = g_lp·dtanh_y``, to the three gradients.

    A label outside ``[0, V)`` (its log-prob is NaN) contributes nothing.
    """
    vocab = weight.shape[0]
    c = g_lp if softcap is None else g_lp * (1 - (label_logit * (temperature / softcap)).square())
    c = torch.where((labels >= 0) & (labels < vocab), c, 0)
    y = labels.clamp(0, vocab - 1)
    if grad_h is not None:
        grad_h[rs] += c[:, None] * weight[y].to(acc)
    if grad_w is not None:
        grad_w.index_add_(0, y, h.to(acc) * c[:, None])
    if grad_b is not None:
        grad_b.index_add_(0, y, c)


def hidden_logprobs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                    bias: torch.Tensor | None = None, temperature: float = 1.0,
                    softcap: float | None = None, logit_scale: float = 1.0,
                    chunk_size: int = 4096, with_entropy: bool = False):
    """Label log-probs (and entropy) straight from hidden states and the LM head, vocab-chunked.

    ``l = c·tanh(s·(h·Wᵀ + b)/c)`` (without ``c`` when ``softcap`` is None: ``l = s·(h·Wᵀ + b)``),
    ``logp[...] = l_y/τ − log Σ_v exp(l_v/τ)``, ``H[...] = −Σ_v p_v log p_v``, ``p = softmax(l/τ)``.

    Memory: the ``[N, V]`` logits never exist. Rows are taken in blocks and the vocabulary in
    blocks of ``chunk_size``; each ``[rows, chunk_size]`` block of logits (~32 MB) is computed, folded
    into running float32 maxima / sums (an online log-sum-exp, plus ``Σ p·log p`` for the
    entropy) and dropped. The graph saves ``hidden``, ``weight``, ``bias``, ``labels`` and two
    ``[N]`` vectors; backward recomputes each block, so memory stays at the gradients
    (``[N, H]``, ``[V, H]``, ``[V]``) plus a few blocks, at the price of a second matmul.

    Args:
        hidden: ``[..., H]`` float (the input of the LM head).
        weight: ``[V, H]``, same dtype as ``hidden`` (``lm_head.weight``).
        labels: ``[...]`` long ids in ``[0, V)``, shaped ``hidden.shape[:-1]``; an id outside
            that range gives a NaN log-prob (ids are never read back to the host to check).
        bias: optional ``[V]``.
        temperature: ``τ > 0``.
        softcap: final-logit soft cap ``c > 0`` (Gemma 2), or None.
        logit_scale: ``s``, a multiplier on the head's output (Cohere-style models).
        chunk_size: vocabulary block width.
        with_entropy: also return the entropy.
    Returns:
        ``logp [...]``, or ``(logp [...], entropy [...])`` with ``with_entropy=True``; float32
        for half-precision inputs, else the input dtype. The matmul runs in the input dtype (as
        the LM head does); everything after it in float32.

    >>> h, w = torch.zeros(2, 3), torch.zeros(4, 3)
    >>> hidden_logprobs(h, w, torch.tensor([0, 3]))
    tensor([-1.3863, -1.3863])

    References:
        Wijmans et al., "Cut Your Losses in Large-Vocabulary Language Models",
        https://arxiv.org/abs/2411.09009; Milakov & Gimelshein, "Online normalizer calculation
        for softmax", https://arxiv.org/abs/1805.02867; Gemma Team, "Gemma 2",
        https://arxiv.org/abs/2408.00118 (logit soft-capping).

    Gradient: to ``hidden``, ``weight`` and ``bias``, through the log-probs and through the
    entropy (an entropy bonus trains the policy on this path too). Not twice differentiable.
    """
    check_float("hidden", hidden)
    check_ndim("hidden", hidden, min_ndim=1, layout="[..., H]")
    check_ndim("weight", weight, ndim=2, layout="[V, H]")
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight: expected shape [V, {hidden.shape[-1]}] (H = hidden.shape[-1]), "
                         f"got {list(weight.shape)}")
    if bias is not None:
        check_same_shape("weight[:, 0]", weight.new_empty(()).expand(weight.shape[:1]), bias=bias)
    for name, x in (("weight", weight), ("bias", bias)):
        if x is not None and x.dtype != hidden.dtype:
            raise TypeError(f"{name}: expected dtype {hidden.dtype} (the dtype of hidden), got {x.dtype}")
    _check_labels(labels, hidden, "hidden", weight.shape[0])
    _check_positive("temperature", temperature)
    _check_positive("softcap", softcap)
    _check_positive("chunk_size", chunk_size)
    lead = hidden.shape[:-1]
    if math.prod(lead) == 0:  # no rows: empty results, still attached to the graph of hidden
        empty = hidden.sum(-1).to(_acc(hidden.dtype)) * 0
        return (empty, empty.clone()) if with_entropy else empty
    lp, ent = _HiddenLogprobs.apply(
        hidden.reshape(math.prod(lead), hidden.shape[-1]), weight, bias, labels.reshape(-1).long(),
        float(temperature), None if softcap is None else float(softcap), float(logit_scale),
        int(chunk_size), bool(with_entropy))
    return (lp.view(lead), ent.view(lead)) if with_entropy else lp.view(lead)


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
