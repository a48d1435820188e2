"""ReFT data: the intervention spec, and where the interventions go in each padded row.

A ReFT run edits the hidden states of a frozen model at a few *positions* of each prompt, at a
few *layers*. ``ReftSpec`` says which (a frozen, JSON-serialisable dataclass); the positions of
each row are computed **after** padding and truncation, from the row's prompt mask, and travel
in the batch as ``keys.INTERVENTION_LOCATIONS [B, n]`` (column indices of the padded row, ``-1``
where a row has no position to fill).

Positions, ``"f{a}+l{b}"`` (also ``"f{a}"`` or ``"l{b}"``): the first ``a`` and the last ``b``
prompt tokens. Column ``j < a`` of the locations holds the ``j``-th prompt token, column
``a + k`` the ``k``-th of the last block. With a prompt of ``L`` tokens and both blocks asked
for, each block is cut to ``min(n, L // 2)`` tokens so they never overlap (pyreft's rule: an
overlap would edit a position twice); a single block takes ``min(n, L)``. The columns left over
hold ``-1``. Where pyreft's dataset classes differ: they pass ``last_position = L - 1`` and
prepend a pad token, so their "last" block ends one token before the prompt's end; here the last
block ends on the last prompt token, as the ``"l5"`` notation reads.

Interventions per layer: one, applied at every position, when ``share_weights`` or when only one
block is asked for (group ``"all"``); otherwise two, one for the first block (``"first"``) and
one for the last (``"last"``), as pyreft's ``num_interventions = 2 × layers``.

References:
    Wu et al., "ReFT: Representation Finetuning for Language Models", https://arxiv.org/abs/2404.03592.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from typing import Any

import torch
from tensordict import TensorDictBase

from rlcore import keys as K
from rlcore.algorithms.reft import REFT_INTERVENTIONS
from rlcore.checks import check_mask, check_ndim
from rlcore.loops.collate import collate

__all__ = ["ReftSpec", "REFT_COMPONENTS", "REFT_ACTIVATIONS", "parse_positions", "reft_locations",
           "with_intervention_locations", "collate_reft"]

# Where an intervention reads and writes the residual stream of decoder block ``i``; the hook
# installing each is ``rlcore.loops.reft_model.COMPONENT_HOOKS[name]``.
REFT_COMPONENTS = ("block_output", "block_input")
# Activation on ``W h + b`` by name, so a spec stays JSON.
REFT_ACTIVATIONS: dict[str, Any] = {
    "identity": None,
    "relu": torch.relu,
    "tanh": torch.tanh,
    "gelu": torch.nn.functional.gelu,
    "silu": torch.nn.functional.silu,
}

_POSITIONS = re.compile(r"^(?:f(\d+)(?:\+l(\d+))?|l(\d+))$")


def parse_positions(positions: str) -> tuple[int, int]:
    """``"f5+l5"`` -> ``(5, 5)``, ``"f3"`` -> ``(3, 0)``, ``"l1"`` -> ``(0, 1)``.

    Raises ``ValueError`` on anything else or when both counts are 0.

    >>> parse_positions("f5+l5"), parse_positions("l1")
    ((5, 5), (0, 1))
    """
    m = _POSITIONS.match(positions.replace(" ", "")) if isinstance(positions, str) else None
    if m is None:
        raise ValueError(f"positions: expected 'f<n>+l<m>', 'f<n>' or 'l<m>' (e.g. 'f5+l5'), got {positions!r}")
    first, last = int(m.group(1) or 0), int(m.group(2) or m.group(3) or 0)
    if first + last == 0:
        raise ValueError(f"positions: {positions!r} selects no position; ask for at least one")
    return first, last


@dataclasses.dataclass(frozen=True)
class ReftSpec:
    """Which hidden states a set of ReFT interventions edits, and how (JSON with ``to_dict``).

    Attributes:
        layers: indices of the decoder blocks to intervene on (0-based).
        component: ``"block_output"`` (the residual stream after block ``i``, the paper's
            setting) or ``"block_input"`` (before it); see ``REFT_COMPONENTS``.
        positions: ``"f<a>+l<b>"``, the first ``a`` and last ``b`` prompt tokens (module doc).
        rank: ``r``, the dimension of the edited subspace.
        share_weights: one intervention per layer for both blocks, instead of one per block.
        dropout: dropout probability on the intervention's output.
        variant: ``"loreft"`` | ``"noreft"`` | ``"direft"`` | ``"nodireft"`` | ``"consreft"`` |
            ``"lobireft"`` (``rlcore.algorithms.reft.REFT_INTERVENTIONS``).
        act: activation on ``W h + b`` by name (``REFT_ACTIVATIONS``; ``"identity"``: the paper's).
        blocks: dotted path of the block list (``"model.layers"``); ``None`` finds it.
    """

    layers: tuple[int, ...] = (0,)
    component: str = "block_output"
    positions: str = "f5+l5"
    rank: int = 4
    share_weights: bool = False
    dropout: float = 0.0
    variant: str = "loreft"
    act: str = "identity"
    blocks: str | None = None

    def __post_init__(self):
        layers = (self.layers,) if isinstance(self.layers, int) else tuple(self.layers)
        object.__setattr__(self, "layers", layers)
        if not layers or any(not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in layers) \
                or len(set(layers)) != len(layers):
            raise ValueError(f"layers: expected distinct non-negative block indices, got {self.layers!r}")
        for name, value, valid in (("component", self.component, REFT_COMPONENTS),
                                   ("variant", self.variant, sorted(REFT_INTERVENTIONS)),
                                   ("act", self.act, sorted(REFT_ACTIVATIONS))):
            if value not in valid:
                raise ValueError(f"{name}: unknown {value!r}; valid: {list(valid)}")
        parse_positions(self.positions)
        if not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"rank: expected a positive int, got {self.rank!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout: expected a probability in [0, 1), got {self.dropout!r}")

    @property
    def counts(self) -> tuple[int, int]:
        """``(first_n, last_n)`` parsed from ``positions``."""
        return parse_positions(self.positions)

    @property
    def num_positions(self) -> int:
        """``n``, the width of ``INTERVENTION_LOCATIONS``."""
        return sum(self.counts)

    @property
    def groups(self) -> tuple[tuple[str, slice], ...]:
        """``(group, columns of the locations)`` pairs: one intervention per group and layer."""
        first, last = self.counts
        if self.share_weights or first == 0 or last == 0:
            return (("all", slice(0, first + last)),)
        return ("first", slice(0, first)), ("last", slice(first, first + last))

    def names(self) -> list[str]:
        """Names of the interventions, ``layer{i}_{group}`` (the keys of their ``ModuleDict``)."""
        return [f"layer{i}_{g}" for i in self.layers for g, _ in self.groups]

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "layers": list(self.layers)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ReftSpec:
        """The spec of ``to_dict`` (or of a config mapping); unknown fields raise ``ValueError``."""
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - fields)
        if unknown:
            raise ValueError(f"ReftSpec: unknown fields {unknown}; valid: {sorted(fields)}")
        return cls(**dict(d))

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)


def reft_locations(prompt_mask: torch.Tensor, *, first_n: int, last_n: int) -> torch.Tensor:
    """Column indices of the first ``first_n`` and last ``last_n`` prompt tokens of each row.

    With ``L_b = Σ_t m_{b,t}`` and ``a_b = min(first_n, L_b // 2)``, ``c_b = min(last_n, L_b // 2)``
    (``min(n, L_b)`` when the other count is 0), the prompt token of rank ``k`` (0-based, in
    order) sits at column ``col_b(k) = min{t : Σ_{s≤t} m_{b,s} = k + 1}`` and

    ``loc[b, j] = col_b(j)`` if ``j < a_b``; ``loc[b, first_n + k] = col_b(L_b − c_b + k)`` if
    ``k < c_b``; ``−1`` elsewhere.

    Any padding side (and any holes) works: ranks are counted from the mask.

    Args:
        prompt_mask: ``[B, T]`` bool, True on prompt tokens.
        first_n, last_n: the counts of the positions spec (``parse_positions``).
    Returns:
        ``[B, first_n + last_n]`` long.

    >>> m = torch.tensor([[False, True, True, True, True, True]])  # left padded, L = 5
    >>> reft_locations(m, first_n=2, last_n=2)
    tensor([[1, 2, 4, 5]])
    >>> reft_locations(m[:, :3], first_n=2, last_n=2)  # L = 2: one token per block
    tensor([[ 1, -1,  2, -1]])

    References: Wu et al., https://arxiv.org/abs/2404.03592 (the "f+l" positions of LoReFT).
    Gradient: none (integer output).
    """
    check_mask("prompt_mask", prompt_mask)
    check_ndim("prompt_mask", prompt_mask, ndim=2, layout="[B, T]")
    if first_n < 0 or last_n < 0 or first_n + last_n == 0:
        raise ValueError(f"first_n, last_n: expected non-negative counts, not both 0; got {first_n}, {last_n}")
    csum = prompt_mask.long().cumsum(-1)  # [B, T]
    L = prompt_mask.sum(-1, keepdim=True)  # [B, 1]
    cap = L // 2 if first_n and last_n else L
    a, c = cap.clamp(max=first_n), cap.clamp(max=last_n)
    j = torch.arange(first_n, device=L.device)
    k = torch.arange(last_n, device=L.device)
    ranks = torch.cat([j.expand(L.shape[0], -1), L - c + k], -1)  # [B, n]
    valid = torch.cat([j < a, k < c], -1)
    cols = torch.searchsorted(csum.contiguous(), (ranks + 1).contiguous())
    return torch.where(valid, cols, torch.full_like(cols, -1))


def _prompt_mask(td: TensorDictBase) -> torch.Tensor:
    """The prompt of a rollout / prompt batch, or of a sequence batch: real tokens outside the loss."""
    if K.PROMPT_MASK in td.keys():
        return td.get(K.PROMPT_MASK)
    if K.ATTENTION_MASK in td.keys() and K.LOSS_MASK in td.keys():
        attention, loss = td.get(K.ATTENTION_MASK), td.get(K.LOSS_MASK)
        check_mask(K.LOSS_MASK, loss, like=attention, like_name=K.ATTENTION_MASK)
        return attention & ~loss
    raise KeyError(f"with_intervention_locations: the batch needs {K.PROMPT_MASK!r} [B, P] bool, or "
                   f"{K.ATTENTION_MASK!r} and {K.LOSS_MASK!r} [B, T] bool; it has {sorted(map(str, td.keys()))}")


def with_intervention_locations(batch: TensorDictBase, spec: ReftSpec) -> TensorDictBase:
    """A shallow copy of ``batch`` with ``INTERVENTION_LOCATIONS [B, n]`` (``reft_locations``).

    The prompt is read from ``prompt_mask`` (rollouts, prompt batches) or, in sequence batches,
    as ``attention_mask ∧ ¬loss_mask``. A preference batch gets locations on each of its
    ``chosen`` / ``rejected`` sides. Call it on the padded, truncated batch.

    Args:
        batch: TensorDict ``[B]`` (rollout, prompt, sequence or preference layout).
        spec: gives ``positions``.
    Returns:
        A shallow copy with ``INTERVENTION_LOCATIONS [B, n]`` long (per side for pairs); the
        input is not modified.
    """
    first, last = spec.counts
    if K.CHOSEN in batch.keys() and K.REJECTED in batch.keys():
        out = batch.copy()
        for side in (K.CHOSEN, K.REJECTED):
            out[side] = with_intervention_locations(batch.get(side), spec)
        return out
    locations = reft_locations(_prompt_mask(batch), first_n=first, last_n=last)
    return batch.copy().update({K.INTERVENTION_LOCATIONS: locations})


def collate_reft(format: str, rows, *, pad_id: int, spec: ReftSpec) -> TensorDictBase:
    """``rlcore.loops.collate.collate`` then ``with_intervention_locations``: positions after padding."""
    return with_intervention_locations(collate(format, rows, pad_id=pad_id), spec)
