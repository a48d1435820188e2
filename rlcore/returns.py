"""Returns and generalised advantage estimation over the time dimension of token sequences.

All recurrences run backwards over the last dimension ``[..., T]`` and only through positions whose
mask is True: a masked position (right padding, or a multi-turn observation token inside a
response) is skipped, and the recurrence carries through it unchanged to the next valid token.

How the kernels are fast. Valid tokens are first packed to the front of each row (a scatter by
their cumulative valid count), so that the recurrence has one constant coefficient ``c`` (``γλ``
for GAE, ``γ`` for returns) whatever the mask. The packed rows are then cut into blocks of ``C``
tokens: inside a block the reverse discounted sum is one matrix product with the ``[C, C]``
matrix ``c^{s-t}·[s ≥ t]``, and the block heads are combined by the same routine one level up with
coefficient ``c^C``. The work is ``O(T·C)`` per row, never ``O(T²)``, and no Python loop runs over
time steps. The readable reference loops live in the test suite (``tests/reference/returns.py``).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from tensordict import TensorDictBase

from rlcore import keys as K
from rlcore.checks import check_float, check_leaves, check_mask, check_ndim, check_same_shape
from rlcore.masked import masked_whiten, saturate, wide

__all__ = ["gae", "discounted_returns", "discounted_cumsum", "with_gae"]

BLOCK = 64  # tokens per block of the chunked scan (the [C, C] matrix of one matrix product)


# --- the chunked scan ------------------------------------------------------------------------
def _powers(coef: float, n: int, dtype: torch.dtype) -> list[float]:
    """``[coef^0, …, coef^(n-1)]`` as Python floats (``n ≤ block``, built once per call), with
    values below ``dtype``'s smallest normal number set to 0: subnormals are slow on CPUs and
    carry no useful precision."""
    tiny = torch.finfo(dtype).tiny
    return [coef ** k if coef ** k >= tiny else 0.0 for k in range(n)]


def _discount_matrix(n: int, coef: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``M[s, t] = coef^(s - t)`` for ``s ≥ t`` and 0 above the diagonal, ``[n, n]`` (Toeplitz)."""
    if n == 0:
        return torch.zeros(0, 0, dtype=dtype, device=device)
    padded = torch.tensor(_powers(coef, n, dtype)[::-1] + [0.0] * max(n - 1, 0), dtype=dtype, device=device)
    return padded.unfold(0, n, 1).flip(0).contiguous()  # row s, column t reads padded[n-1-s+t] = coef^(s-t)


def _block_decay(coef: float, block: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``[coef^C, …, coef^1]``: the weight of the next block's head at offsets ``t < C``."""
    return torch.tensor(_powers(coef, block + 1, dtype)[:0:-1], dtype=dtype, device=device)


_CACHED = {f: functools.lru_cache(maxsize=64)(f) for f in (_discount_matrix, _block_decay)}


def _constant(build, *key) -> torch.Tensor:
    """``build(*key)``, cached in eager mode: the scan's weights are constants per ``(size, coef,
    dtype, device)``, never written into, and building them costs more than the products they
    serve at RL sizes. Under ``torch.compile`` they are built in the graph (constant-folded)."""
    return build(*key) if torch.compiler.is_compiling() else _CACHED[build](*key)


def discounted_cumsum(x: torch.Tensor, *, coef: float, block: int = BLOCK) -> torch.Tensor:
    """Reverse discounted cumulative sum over the last dimension: ``y_t = Σ_{s≥t} coef^{s-t}·x_s``.

    Equivalently ``y_t = x_t + coef·y_{t+1}`` with ``y_T = 0``, computed without a loop over ``t``:
    blocks of ``block`` steps are one matrix product each, and the block heads are combined by
    the same routine with coefficient ``coef^block`` (recursion depth ``log_block(T)``).

    Args:
        x: ``[..., T]`` float (every position counts; pack or zero masked positions first).
        coef: the discount, ``0 ≤ coef ≤ 1``.
        block: tokens per block, ``≥ 2``.
    Returns:
        ``[..., T]``, dtype of ``x``, computed in float64 and cast back saturating (finite for
        finite inputs anywhere in the float32 / bfloat16 range).

    >>> discounted_cumsum(torch.tensor([1.0, 1.0, 1.0]), coef=0.5)
    tensor([1.7500, 1.5000, 1.0000])

    Gradients: differentiable in ``x`` (the weights are constants).

    References:
        The building block of :func:`gae` and :func:`discounted_returns`.
    """
    check_float("x", x)
    check_ndim("x", x, min_ndim=1, layout="[..., T]")
    if not 0.0 <= coef <= 1.0:
        raise ValueError(f"coef: expected 0 <= coef <= 1, got {coef}")
    if block < 2:
        raise ValueError(f"block: expected at least 2, got {block}")
    return saturate(_scan(wide(x), float(coef), block), x.dtype)  # float64, cast back saturating


def _scan(x: torch.Tensor, coef: float, block: int) -> torch.Tensor:
    T = x.shape[-1]
    if block >= T:
        return x @ _constant(_discount_matrix, T, coef, x.dtype, x.device)
    nb = -(-T // block)
    blocks = (F.pad(x, (0, nb * block - T)) if nb * block > T else x).unflatten(-1, (nb, block))
    local = blocks @ _constant(_discount_matrix, block, coef, x.dtype, x.device)  # sums inside each block
    heads = _scan(local[..., 0], coef ** block, block)                            # full sums at block starts
    carry = F.pad(heads[..., 1:], (0, 1))                                         # ... of the following block
    decay = _constant(_block_decay, coef, block, x.dtype, x.device)               # coef^(C - t), t < C
    return torch.addcmul(local, carry[..., None], decay).flatten(-2)[..., :T]


# --- packing valid tokens to the front of each row -------------------------------------------
def _pack_index(mask: torch.Tensor) -> torch.Tensor:
    """Slot of each position in the packed layout ``[..., T + 2]``: valid token ``t`` goes to slot
    ``n_t - 1`` (``n_t`` = valid tokens up to ``t``), masked positions to slot ``T + 1``."""
    T = mask.shape[-1]
    # Float arithmetic (exact for counts below 2^24) runs several times faster than int64 on CPUs,
    # and a uint8 view converts to float faster than bool does.
    m = mask.view(torch.uint8).to(torch.float32 if T < 2**24 else torch.float64)
    return m.cumsum(-1).sub_(T + 2).mul_(m).add_(T + 1).long()  # valid: n_t - 1; masked: T + 1


def _pack(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``[..., T + 2]``: valid values packed to the front, zeros after them (slot ``T`` included);
    slot ``T + 1`` receives every masked entry (garbage, NaN) and is never read."""
    return x.new_zeros(*x.shape[:-1], x.shape[-1] + 2).scatter_(-1, index, x)


def _unpack(packed: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_pack` for a clean packed ``[..., T]``: masked positions read a 0."""
    return F.pad(packed, (0, 2)).gather(-1, index)


def _work_dtype(x: torch.Tensor) -> torch.dtype:
    # float64, cast back saturating: sums of rewards near the float32 / bf16 range stay finite
    return torch.float64


def _check_gamma_lam(gamma: float, lam: float) -> None:
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma: expected 0 <= gamma <= 1, got {gamma}")
    if not 0.0 <= lam <= 1.0:
        raise ValueError(f"lam: expected 0 <= lam <= 1, got {lam}")


# --- kernels ---------------------------------------------------------------------------------
def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *, gamma: float = 1.0,
        lam: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over valid tokens.

    ``δ_t = r_t + γ·V_{t'} − V_t``,   ``Â_t = δ_t + γλ·Â_{t'}``,   ``R_t = Â_t + V_t``,

    where ``t'`` is the next position after ``t`` whose mask is True; after the last valid token
    ``V = Â = 0`` (the response ends the episode). Masked positions are skipped: the recurrence
    carries through them unchanged (multi-turn observation tokens inside a response, as verl
    does), so ``Â_t = Σ_{s≥t valid} (γλ)^{n_s − n_t}·δ_s`` with ``n`` the running count of valid
    tokens. With a right-padded mask this is the textbook recurrence (TRL's legacy PPO, torchrl's
    ``generalized_advantage_estimate`` with ``done`` on the last valid token).

    Args:
        rewards: ``[..., T]`` float, per-token rewards.
        values: ``[..., T]`` float, value estimates ``V(s_t)`` recorded with the rollout.
        mask: ``[..., T]`` bool, True on real tokens; values under False are never read (NaN ok).
        gamma: discount ``γ ∈ [0, 1]``.  lam: GAE ``λ ∈ [0, 1]``.
    Returns:
        ``(advantages, returns)``, each ``[..., T]`` with the dtype of ``rewards``, 0 where the
        mask is False. Computed in float64 and cast back saturating (``rlcore.masked.saturate``):
        finite for finite inputs anywhere in the float32 / bfloat16 range.

    >>> r = torch.tensor([[0.0, 0.0, 1.0]]); v = torch.tensor([[0.5, 0.5, 0.5]])
    >>> adv, ret = gae(r, v, torch.ones(1, 3, dtype=torch.bool), gamma=1.0, lam=1.0)
    >>> adv, ret
    (tensor([[0.5000, 0.5000, 0.5000]]), tensor([[1., 1., 1.]]))

    Gradients: none; both outputs are computed from detached inputs (they are targets).

    References:
        Schulman et al., "High-Dimensional Continuous Control Using Generalized Advantage
        Estimation", https://arxiv.org/abs/1506.02438
    """
    check_float("rewards", rewards)
    check_ndim("rewards", rewards, min_ndim=1, layout="[..., T]")
    check_float("values", values)
    check_same_shape("rewards", rewards, values=values)
    check_mask("mask", mask, like=rewards, like_name="rewards")
    _check_gamma_lam(gamma, lam)
    dtype, work = rewards.dtype, _work_dtype(rewards)
    r, v = rewards.detach().to(work), values.detach().to(work)
    T = r.shape[-1]
    index = _pack_index(mask)
    r_packed, v_packed = _pack(r, index), _pack(v, index)
    # Packed, the next valid value sits in the next slot; slot T and the tail hold 0.
    delta = r_packed[..., :T].sub_(v_packed[..., :T]).add_(v_packed[..., 1:T + 1], alpha=gamma)  # fresh: in place
    adv = _unpack(_scan(delta, gamma * lam, BLOCK), index)
    returns = torch.where(mask, adv + v, torch.zeros((), dtype=work, device=v.device))
    return saturate(adv, dtype), saturate(returns, dtype)


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, *, gamma: float = 1.0) -> torch.Tensor:
    """Discounted reward-to-go over valid tokens: ``G_t = r_t + γ·G_{t'}`` (``t'`` next valid).

    ``G_t = Σ_{s≥t valid} γ^{n_s − n_t}·r_s`` with ``n`` the running count of valid tokens: masked
    positions are skipped and the sum carries through them (the convention of ``gae``; verl's
    REINFORCE++ instead restarts the sum at masked positions, which differs only for masks
    with holes). The REINFORCE++ return; with ``γ = 1`` the ReMax reward-to-go.

    Args:
        rewards: ``[..., T]`` float.  mask: ``[..., T]`` bool, True on real tokens.
        gamma: discount ``γ ∈ [0, 1]``.
    Returns:
        ``[..., T]``, dtype of ``rewards``, 0 where the mask is False.

    >>> discounted_returns(torch.tensor([1.0, 5.0, 2.0]), torch.tensor([True, False, True]), gamma=0.5)
    tensor([2., 0., 2.])

    Gradients: none (computed from detached rewards).

    References:
        Hu, "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language Models",
        https://arxiv.org/abs/2501.03262
    """
    check_float("rewards", rewards)
    check_ndim("rewards", rewards, min_ndim=1, layout="[..., T]")
    check_mask("mask", mask, like=rewards, like_name="rewards")
    _check_gamma_lam(gamma, 0.0)
    dtype, work = rewards.dtype, _work_dtype(rewards)
    T = rewards.shape[-1]
    index = _pack_index(mask)
    packed = _pack(rewards.detach().to(work), index)[..., :T]
    return saturate(_unpack(_scan(packed, gamma, BLOCK), index), dtype)


# --- TensorDict adapter ----------------------------------------------------------------------
def with_gae(batch: TensorDictBase, *, gamma: float = 1.0, lam: float = 0.95,
             whiten: bool = True) -> TensorDictBase:
    """Add ``advantages`` and ``returns`` computed by :func:`gae` (PPO).

    ``advantages = whiten(Â)`` over the mask when ``whiten`` (PPO's default: ``masked_whiten``,
    mean 0 and unbiased variance 1), else ``Â``; ``returns = Â + V`` (value targets, never
    whitened).

    Args:
        batch: TensorDict ``[B]`` with ``rewards`` ``[B, R]`` float, ``values`` ``[B, R]`` float,
            ``response_mask`` ``[B, R]`` bool.
        gamma, lam: as in :func:`gae`.  whiten: whiten the advantages over the mask.
    Returns:
        A shallow copy of ``batch`` with ``advantages`` and ``returns`` ``[B, R]`` (0 where the mask
        is False); ``batch`` itself is not modified. Both are detached.
    """
    check_leaves(batch, where="with_gae", mask=K.RESPONSE_MASK, tokens=[K.REWARDS, K.VALUES])
    mask = batch.get(K.RESPONSE_MASK)
    adv, ret = gae(batch.get(K.REWARDS), batch.get(K.VALUES), mask, gamma=gamma, lam=lam)
    if whiten:
        adv = masked_whiten(adv, mask)
    return batch.copy().update({K.ADVANTAGES: adv, K.RETURNS: ret})
