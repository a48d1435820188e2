"""Log-probs (and entropies) of labels from hidden states through the LM head, without the logits.

``hidden_logprobs(hidden [N, H], weight [V, H], labels [N])`` folds the vocabulary in blocks with an
online log-sum-exp: the ``[N, V]`` logits never exist, in the forward or in the backward pass, which
recomputes each block. Memory: a few ``_BLOCK_BYTES`` blocks plus the gradients ``[N, H]``,
``[V, H]``, ``[V]``. The row-chunked kernels on logits are in ``rlcore.logprobs``.

Why vocabulary blocks rather than whole-vocabulary row blocks read by the compiled kernels: a row
block re-reads the whole head ``[V, H]`` once per block, and at a real vocabulary a 32 MB block
holds few rows (55 at V = 151,936). Measured on a 2-core Intel Xeon (AVX-512, AMX), fp32 forward +
backward: at [1024, 896] × [151,936, 896], row blocks took 11.4 s and this fold 3.7 s. At
[4096, 256] × [32,000, 256] they took 1.06 s and 0.96 s, with the head matmul + the kernel at 1.07 s.
"""

from __future__ import annotations

import contextlib
import math
from typing import NamedTuple

import torch
from torch.autograd.function import once_differentiable

from rlcore.checks import check_float, check_ndim, check_same_shape
from rlcore.logprobs import _BLOCK_BYTES, _acc, _budget, _check_labels, _check_positive

__all__ = ["hidden_logprobs", "LogprobStats"]


class LogprobStats(NamedTuple):
    """Per-row outputs of ``hidden_logprobs(..., with_stats=True)``, each shaped like the labels.

    ``logprobs`` and ``entropy`` carry gradient; ``top1`` (bool: the label is the first
    ``argmax`` of the logits) and ``mean_logit`` (``Σ_v l_v / V`` of the logits ``l`` over ``τ``)
    are detached diagnostics."""

    logprobs: torch.Tensor
    entropy: torch.Tensor
    top1: torch.Tensor
    mean_logit: torch.Tensor


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


def _fold_vocabulary(h, labels, weight, bias, chunk, with_entropy, with_stats=False, **kw):
    """Online log-sum-exp over vocabulary blocks for rows ``h [r, H]``: ``(lse, l_y, H, top1, mean)`` ``[r]``.

    Running max ``m``, ``s = Σ e^{l−m}`` and ``u = Σ e^{l−m}(l−m)`` are rescaled by ``e^{m−m'}``
    when the max grows; ``lse = m + log s``, ``H = log s − u/s``. ``H`` is empty unless asked for.
    With ``with_stats``, from the same blocks: the index of the first maximum (``argmax``: a block's
    maximum replaces the running one only when strictly larger, so the earliest index wins a tie)
    compared with the label (``top1``), and ``Σ_v l_v / V`` (``mean``); both empty otherwise.
    """
    acc = kw["acc"]
    m = torch.full((len(h),), torch.finfo(acc).min, dtype=acc, device=h.device)
    s, u = torch.zeros_like(m), torch.zeros_like(m)
    label_logit = torch.full_like(m, float("nan"))  # stays NaN for a label outside [0, V)
    if with_stats:
        best = torch.full((len(h),), -1, dtype=torch.long, device=h.device)
        best_logit, total = torch.full_like(m, -math.inf), torch.zeros_like(m)
    for v0 in range(0, weight.shape[0], chunk):
        l = _head_block(h, weight, bias, v0, v0 + chunk, **kw)
        label_logit = _label_logit(l, labels, v0, label_logit)
        if with_stats:
            idx = l.argmax(-1)
            block_max = l.gather(-1, idx[:, None])[:, 0]
            better = block_max > best_logit
            best = torch.where(better, idx + v0, best)
            best_logit = torch.where(better, block_max, best_logit)
            total += l.sum(-1)
            m_new = torch.maximum(m, block_max)
        else:
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
    stats = (best == labels, total / weight.shape[0]) if with_stats else (labels[:0] == 0, m[:0])
    return (m + log_s, label_logit, (log_s - u / s) if with_entropy else m[:0], *stats)


def _hidden_rows(vocab_chunk: int, device: torch.device) -> int:
    """Rows per block of the hidden path, so that a ``[rows, vocab_chunk]`` block is ~32 MB (on a
    GPU ``_GPU_SCALE`` times that)."""
    return max(1, _budget(_BLOCK_BYTES, device) // (4 * vocab_chunk))


class _HiddenLogprobs(torch.autograd.Function):
    """Log-probs (and entropy) from hidden states and an LM head, over vocabulary chunks."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, temperature, softcap, logit_scale, chunk,
                with_entropy, with_stats=False):
        kw = dict(acc=_acc(hidden.dtype), logit_scale=logit_scale, softcap=softcap, temperature=temperature)
        rows = _hidden_rows(chunk, hidden.device)
        parts = [_fold_vocabulary(hidden[r0:r0 + rows], labels[r0:r0 + rows], weight, bias, chunk,
                                  with_entropy, with_stats, **kw) for r0 in range(0, hidden.shape[0], rows)]
        lse, label_logit, ent, top1, mean_logit = (torch.cat(p) for p in zip(*parts))
        ctx.save_for_backward(hidden, weight, bias, labels, lse, ent, label_logit)
        ctx.kw, ctx.chunk, ctx.rows, ctx.with_entropy = kw, chunk, rows, with_entropy
        device = hidden.device.type  # backward recomputes the blocks under the forward's autocast
        amp = torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)
        ctx.amp = dict(device_type=device, dtype=torch.get_autocast_dtype(device)) if amp else None
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(top1, mean_logit)
        return label_logit - lse, ent, top1, mean_logit

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_lp, grad_ent, *_):
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
            None, None, None, None, None, None, None)


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
                    chunk_size: int = 4096, with_entropy: bool = False, with_stats: bool = False):
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
        labels: ``[...]`` long ids in ``[0, V)``, shaped ``hidden.shape[:-1]``; an id outside that
            range is refused with a ``ValueError`` (one min / max read in eager mode; under
            ``torch.compile`` the read is skipped and such a row's log-prob is NaN).
        bias: optional ``[V]``.
        temperature: ``τ > 0``.
        softcap: final-logit soft cap ``c > 0`` (Gemma 2), or None.
        logit_scale: ``s``, a multiplier on the head's output (Cohere-style models).
        chunk_size: vocabulary block width.
        with_entropy: also return the entropy.
        with_stats: return a ``LogprobStats`` (``logprobs``, ``entropy``, ``top1``, ``mean_logit``),
            all from the same pass over the vocabulary blocks (no second matmul): ``top1[...]`` is
            ``argmax_v l_v = y`` (ties: the first index, as ``torch.argmax``), ``mean_logit[...]`` is
            ``Σ_v l_v / V`` with ``l`` the logits over ``τ``. Implies the entropy; costs one
            ``argmax`` and one sum per block in the forward, nothing in the backward.
    Returns:
        ``logp [...]``, or ``(logp [...], entropy [...])`` with ``with_entropy=True``, or a
        ``LogprobStats`` with ``with_stats=True``; float32 for half-precision inputs, else the
        input dtype (``top1`` bool). The matmul runs in the input dtype (as
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
        if with_stats:
            return LogprobStats(empty, empty.clone(), torch.zeros(lead, dtype=torch.bool, device=hidden.device),
                                empty.detach().clone())
        return (empty, empty.clone()) if with_entropy else empty
    lp, ent, top1, mean_logit = _HiddenLogprobs.apply(
        hidden.reshape(math.prod(lead), hidden.shape[-1]), weight, bias, labels.reshape(-1).long(),
        float(temperature), None if softcap is None else float(softcap), float(logit_scale),
        int(chunk_size), bool(with_entropy or with_stats), bool(with_stats))
    if with_stats:
        return LogprobStats(lp.view(lead), ent.view(lead), top1.view(lead), mean_logit.view(lead))
    return (lp.view(lead), ent.view(lead)) if with_entropy else lp.view(lead)
