"""Representation fine-tuning: low-rank edits of hidden states, as pure functions of ``(h, params)``.

A ReFT intervention edits the hidden state ``h [..., H]`` of a frozen model inside an
``r``-dimensional subspace spanned by the rows of ``R [r, H]``:

- LoReFT    ``Φ(h) = h + Rᵀ(act(W h + b) − R h)``, rows of ``R`` orthonormal: within the subspace
  the hidden state's coordinates ``R h`` are replaced by learned ones ``W h + b``;
- NoReFT    the same formula with ``R`` unconstrained;
- DiReFT    ``Φ(h) = h + Rᵀ act(W h + b)``, rows of ``R`` orthonormal and no subtraction: a
  LoRA-like edit of the activations;
- NodiReFT  the same formula with ``R`` unconstrained;
- ConsReFT  ``Φ(h) = h + Rᵀ(b − R h)``, rows of ``R`` orthonormal: the subspace coordinates are set
  to a learned constant ``b``;
- LobiReFT  ``Φ(h) = h + Rᵀ b``, rows of ``R`` orthonormal: a learned shift inside the subspace
  (a low-rank BitFit).

The variants and their constraints are pyreft's. The first four read a linear source ``W h + b``
and share the signature ``(h, rotation, weight, bias, *, act)``; ConsReFT and LobiReFT have a
constant source and take ``(h, rotation, bias)``.

``ReftIntervention`` is only a holder of ``R, W, b`` (an ``nn.Module`` so optimisers and
``state_dict`` work) whose ``forward`` calls the pure function; installing interventions on a
model's layers is the job of ``rlcore.loops``.

References:
    Wu et al., "ReFT: Representation Finetuning for Language Models", https://arxiv.org/abs/2404.03592.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.nn.utils.parametrizations import orthogonal

from rlcore.checks import check_float, check_ndim, lookup
from rlcore.masked import in_float64

__all__ = [
    "loreft",
    "noreft",
    "direft",
    "nodireft",
    "consreft",
    "lobireft",
    "REFT_INTERVENTIONS",
    "CONSTANT_SOURCE",
    "ReftIntervention",
    "trainable_parameters",
]

Act = Callable[[torch.Tensor], torch.Tensor] | None


def _check(h: torch.Tensor, rotation: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor) -> None:
    check_float("h", h)
    check_ndim("h", h, min_ndim=1, layout="[..., H]")
    check_ndim("rotation", rotation, ndim=2, layout="[r, H]")
    r, H = rotation.shape
    if h.shape[-1] != H:
        raise ValueError(f"rotation: expected shape [r, {h.shape[-1]}] (H from h {list(h.shape)}), "
                         f"got {list(rotation.shape)}")
    if weight is not None and weight.shape != rotation.shape:
        raise ValueError(f"weight: expected shape {list(rotation.shape)} (the shape of rotation), "
                         f"got {list(weight.shape)}")
    check_ndim("bias", bias, ndim=1, layout="[r]")
    if bias.shape[0] != r:
        raise ValueError(f"bias: expected shape [{r}] (r from rotation), got {list(bias.shape)}")


def _subspace_edit(h, rotation, weight, bias, act: Act) -> torch.Tensor:
    source = nn.functional.linear(h, weight, bias)
    source = source if act is None else act(source)
    return h + (source - nn.functional.linear(h, rotation)) @ rotation


@in_float64  # hidden states anywhere in the float range give finite edits and gradients
def loreft(h: torch.Tensor, rotation: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, *,
           act: Act = None) -> torch.Tensor:
    """LoReFT: ``Φ(h) = h + Rᵀ(act(W h + b) − R h)``.

    With orthonormal rows of ``R`` (``R Rᵀ = I``) this sets the subspace coordinates ``R Φ(h)`` to
    ``act(W h + b)`` and leaves the orthogonal complement of ``h`` untouched. The function does not
    enforce orthonormality: ``ReftIntervention(variant="loreft")`` keeps ``R`` on the manifold.

    Args:
        h: ``[..., H]`` float hidden states.
        rotation: ``R`` ``[r, H]``.  weight: ``W`` ``[r, H]``.  bias: ``b`` ``[r]``.
        act: elementwise activation on ``W h + b``; ``None`` is the identity (the paper's setting).
    Returns:
        ``[..., H]``.

    >>> R = torch.tensor([[1.0, 0.0]]); W = torch.tensor([[0.0, 2.0]]); b = torch.tensor([1.0])
    >>> loreft(torch.tensor([3.0, 4.0]), R, W, b)
    tensor([9., 4.])

    Gradient: to ``h``, ``R``, ``W`` and ``b``.
    References: Wu et al., https://arxiv.org/abs/2404.03592, eq. 2.
    """
    _check(h, rotation, weight, bias)
    return _subspace_edit(h, rotation, weight, bias, act)


@in_float64  # hidden states anywhere in the float range give finite edits and gradients
def noreft(h: torch.Tensor, rotation: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, *,
           act: Act = None) -> torch.Tensor:
    """NoReFT: ``Φ(h) = h + Rᵀ(act(W h + b) − R h)`` with ``R`` not constrained orthonormal.

    The same map as ``loreft``; the variant differs in what its parameters may be
    (``ReftIntervention(variant="noreft")`` trains ``R`` freely). Shapes as ``loreft``.

    References: Wu et al., https://arxiv.org/abs/2404.03592 (ablations).
    Gradient: to ``h``, ``R``, ``W`` and ``b``.
    """
    _check(h, rotation, weight, bias)
    return _subspace_edit(h, rotation, weight, bias, act)


@in_float64  # hidden states anywhere in the float range give finite edits and gradients
def direft(h: torch.Tensor, rotation: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, *,
           act: Act = None) -> torch.Tensor:
    """DiReFT: ``Φ(h) = h + Rᵀ act(W h + b)``, ``R`` unconstrained and no ``− R h`` term.

    Args:
        h: ``[..., H]`` float.  rotation: ``R`` ``[r, H]``.  weight: ``W`` ``[r, H]``.  bias: ``b`` ``[r]``.
        act: elementwise activation, ``None`` for the identity.
    Returns:
        ``[..., H]``; the identity when ``W = 0`` and ``b = 0`` (and ``act(0) = 0``).

    >>> direft(torch.tensor([3.0, 4.0]), torch.tensor([[1.0, 1.0]]), torch.tensor([[1.0, 0.0]]), torch.tensor([0.0]))
    tensor([6., 7.])

    Gradient: to ``h``, ``R``, ``W`` and ``b``.
    References: Wu et al., https://arxiv.org/abs/2404.03592 (DiReFT, appendix).
    """
    _check(h, rotation, weight, bias)
    source = nn.functional.linear(h, weight, bias)
    source = source if act is None else act(source)
    return h + source @ rotation


@in_float64  # hidden states anywhere in the float range give finite edits and gradients
def nodireft(h: torch.Tensor, rotation: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, *,
             act: Act = None) -> torch.Tensor:
    """NodiReFT: ``Φ(h) = h + Rᵀ act(W h + b)`` with ``R`` not constrained orthonormal.

    The same map as ``direft``; the variant differs in what ``R`` may be
    (``ReftIntervention(variant="nodireft")`` trains it freely). Shapes as ``direft``.

    Gradient: to ``h``, ``R``, ``W`` and ``b``.
    References: Wu et al., https://arxiv.org/abs/2404.03592 (pyreft's NodiReFT).
    """
    return direft(h, rotation, weight, bias, act=act)


@in_float64  # hidden states anywhere in the float range give finite edits and gradients
def consreft(h: torch.Tensor, rotation: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """ConsReFT: ``Φ(h) = h + Rᵀ(b − R h)``: the subspace coordinates set to a learned constant.

    With orthonormal rows of ``R``, ``R Φ(h) = b`` whatever ``h``, and the orthogonal complement
    of ``h`` is kept.

    Args:
        h: ``[..., H]`` float.  rotation: ``R`` ``[r, H]``.  bias: ``b`` ``[r]``.
    Returns:
        ``[..., H]``.

    >>> consreft(torch.tensor([3.0, 4.0]), torch.tensor([[1.0, 0.0]]), torch.tensor([7.0]))
    tensor([7., 4.])

    Gradient: to ``h``, ``R`` and ``b``.
    References: Wu et al., https://arxiv.org/abs/2404.03592 (pyreft's ConsReFT).
    """
    _check(h, rotation, None, bias)
    return h + (bias - nn.functional.linear(h, rotation)) @ rotation


@in_float64  # hidden states anywhere in the float range give finite edits and gradients
def lobireft(h: torch.Tensor, rotation: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """LobiReFT: ``Φ(h) = h + Rᵀ b``: a learned shift inside the subspace (low-rank BitFit).

    Args:
        h: ``[..., H]`` float.  rotation: ``R`` ``[r, H]``.  bias: ``b`` ``[r]``.
    Returns:
        ``[..., H]``; the identity when ``b = 0``.

    >>> lobireft(torch.tensor([3.0, 4.0]), torch.tensor([[0.0, 1.0]]), torch.tensor([2.0]))
    tensor([3., 6.])

    Gradient: to ``h``, ``R`` and ``b``.
    References: Wu et al., https://arxiv.org/abs/2404.03592 (pyreft's LobiReFT).
    """
    _check(h, rotation, None, bias)
    return h + bias.to(h.dtype) @ rotation


# Every variant by name. Those of CONSTANT_SOURCE take ``(h, rotation, bias)``; the others
# ``(h, rotation, weight, bias, *, act)``.
REFT_INTERVENTIONS: dict[str, Callable[..., torch.Tensor]] = {
    "loreft": loreft,
    "noreft": noreft,
    "direft": direft,
    "nodireft": nodireft,
    "consreft": consreft,
    "lobireft": lobireft,
}


class _Variant(NamedTuple):
    orthogonal: bool  # rows of R kept orthonormal by a parametrisation
    subtracts: bool   # the edit subtracts R h, so W = R (not W = 0) makes Φ the identity
    constant: bool    # the source is b alone (no W): no identity start when it subtracts R h


_VARIANTS = {
    "loreft": _Variant(orthogonal=True, subtracts=True, constant=False),
    "noreft": _Variant(orthogonal=False, subtracts=True, constant=False),
    "direft": _Variant(orthogonal=True, subtracts=False, constant=False),
    "nodireft": _Variant(orthogonal=False, subtracts=False, constant=False),
    "consreft": _Variant(orthogonal=True, subtracts=True, constant=True),
    "lobireft": _Variant(orthogonal=True, subtracts=False, constant=True),
}
CONSTANT_SOURCE = tuple(name for name, v in _VARIANTS.items() if v.constant)  # the (h, rotation, bias) ones


class _Rotation(nn.Module):
    """Holds ``R [r, H]`` as ``weight`` so ``torch.nn.utils.parametrizations.orthogonal`` can wrap it."""

    def __init__(self, rank: int, hidden_size: int, generator, **factory):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rank, hidden_size, **factory))
        nn.init.orthogonal_(self.weight, generator=generator)


def _orthogonal_from(rotate: nn.Module, generator: torch.Generator | None) -> None:
    """Register the orthogonal parametrisation on ``rotate.weight``, seeded from ``generator``.

    For ``r < H`` the parametrisation completes ``R`` to an ``H × H`` orthogonal base with random
    columns drawn from the global RNG; that base steers training. With a ``generator`` the draw
    comes from a seed taken from it, inside ``fork_rng`` (the caller's global RNG is untouched), so
    the same generator gives the same run in any process.
    """
    if generator is None:
        orthogonal(rotate, "weight")
        return
    seed = int(torch.randint(0, 2**62, (), generator=generator, device=generator.device))
    device = rotate.weight.device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        orthogonal(rotate, "weight")


class ReftIntervention(nn.Module):
    """Parameters ``R [r, H]``, ``W [r, H]``, ``b [r]`` of one ReFT intervention; ``forward(h)`` applies it.

    ``forward(h) = dropout(REFT_INTERVENTIONS[variant](h, R, W, b, act=act))`` (``(h, R, b)`` for the
    constant-source variants, which hold no ``W``: ``weight`` is ``None``), computed in the
    parameters' dtype and returned in ``h``'s. For ``loreft``, ``direft``, ``consreft`` and
    ``lobireft`` the rows of ``R`` stay orthonormal through
    ``torch.nn.utils.parametrizations.orthogonal`` (they are initialised orthonormal for every
    variant). Dropout applies to the whole edited state, as in the reference implementation, so
    the identity property below holds in eval mode or with ``dropout=0``.

    Args:
        hidden_size: ``H``.  rank: ``r`` (``r ≤ H`` for the orthonormal variants).
        variant: a key of ``REFT_INTERVENTIONS``.
        dropout: probability, on the output.  act: activation on ``W h + b`` (``None``: identity).
        zero_init: start as the identity map: ``W = R``, ``b = 0`` for loreft/noreft, ``W = 0``,
            ``b = 0`` for direft/nodireft, ``b = 0`` for lobireft (for loreft/noreft only when
            ``act`` is ``None``); consreft has no identity and refuses it. Otherwise ``W, b``
            are initialised like ``nn.Linear(H, r)`` (``b`` uniform in ``[0, 1)`` for the
            constant-source variants, as pyreft).
        generator: ``torch.Generator`` for the initialisation.  dtype, device: of the parameters.

    Not a pure function: it owns parameters (and dropout draws from the global RNG in training).
    References: Wu et al., https://arxiv.org/abs/2404.03592.
    """

    def __init__(self, hidden_size: int, rank: int, *, variant: str = "loreft", dropout: float = 0.0,
                 act: Act = None, zero_init: bool = False, generator: torch.Generator | None = None,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None):
        super().__init__()
        spec = lookup(_VARIANTS, variant, what="variant")
        if spec.orthogonal and rank > hidden_size:
            raise ValueError(f"rank: expected at most hidden_size={hidden_size} orthonormal rows, got {rank}")
        if zero_init and spec.constant and spec.subtracts:
            raise ValueError(f"zero_init: {variant!r} sets the subspace to a constant, so no parameters make it the "
                             "identity; use another variant or zero_init=False")
        # drawn where the generator lives (a CPU generator: the same numbers for every device),
        # then moved to ``device``
        factory: dict[str, Any] = {"dtype": dtype, "device": device if generator is None else generator.device}
        self.variant, self.act = variant, act
        self.rotate = _Rotation(rank, hidden_size, generator, **factory)
        if spec.orthogonal:
            _orthogonal_from(self.rotate, generator)
        if spec.constant:
            self.register_parameter("weight", None)
        else:
            self.weight = nn.Parameter(torch.empty(rank, hidden_size, **factory))
        self.bias = nn.Parameter(torch.zeros(rank, **factory))
        with torch.no_grad():
            if spec.constant:
                if not zero_init:
                    nn.init.uniform_(self.bias, 0.0, 1.0, generator=generator)
            elif zero_init:
                self.weight.copy_(self.rotation if spec.subtracts else torch.zeros_like(self.weight))
            else:
                nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5), generator=generator)
                bound = 1 / math.sqrt(hidden_size)
                nn.init.uniform_(self.bias, -bound, bound, generator=generator)
        self.dropout = nn.Dropout(dropout)
        if device is not None:
            self.to(device)

    @property
    def rotation(self) -> torch.Tensor:
        """``R [r, H]`` (orthonormal rows for loreft)."""
        return self.rotate.weight

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        fn = REFT_INTERVENTIONS[self.variant]
        x = h.to(self.bias.dtype)
        out = fn(x, self.rotation, self.bias) if self.weight is None else \
            fn(x, self.rotation, self.weight, self.bias, act=self.act)
        return self.dropout(out).to(h.dtype)

    def extra_repr(self) -> str:
        r, H = self.rotation.shape
        return f"variant={self.variant!r}, hidden_size={H}, rank={r}"


def trainable_parameters(intervention: nn.Module | Iterable[nn.Module]) -> list[nn.Parameter]:
    """The parameters an optimiser should train: those of the intervention(s), nothing else.

    Args:
        intervention: one module or an iterable of modules (e.g. the interventions of every layer).
    Returns:
        A list of the parameters with ``requires_grad``, each once (shared ones are not repeated).
        The frozen model's weights never appear: they are not parameters of the interventions.
    """
    modules = [intervention] if isinstance(intervention, nn.Module) else list(intervention)
    seen: dict[int, nn.Parameter] = {}
    for module in modules:
        for p in module.parameters():
            if p.requires_grad:
                seen.setdefault(id(p), p)
    return list(seen.values())
