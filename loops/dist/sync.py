"""Synchronising gradients and state across data-parallel ranks: what ``update`` and
``save_checkpoint`` call so that N ranks behave as one process (see ``rlcore.loops.dist``).

- gradients (``update``): :func:`grad_sync` describes a step (which models reduce their own
  gradients, which parameters ``update`` reduces itself, the loss scale), :func:`accumulation_context`
  suspends the wrapped models' reduction during accumulation, :func:`reduce_gradients` sums the
  others in flat buckets, :func:`total_grad_norm` is the global norm of plain and sharded gradients;
- state (``save_checkpoint`` / ``load_checkpoint``): :func:`full_weights` and
  :func:`full_optimizer_state` gather FSDP2 shards into the tensors of one process,
  :func:`load_full_weights` and :func:`shard_optimizer_state` put them back, :func:`all_ranks_ok`
  is the barrier after rank 0's write that carries its outcome.

In one process every function here is a no-op or the plain computation.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from rlcore.loops.dist import all_reduce_sum, dist_info, is_fsdp2, overlaps_reduction, reduces_own_gradients

__all__ = ["GradSync", "grad_sync", "is_dtensor", "accumulation_context", "reduce_gradients", "OverlappedReduction",
           "total_grad_norm", "full_weights",
           "drop_tied", "load_full_weights", "full_optimizer_state", "shard_optimizer_state", "all_ranks_ok"]

_BUCKET = 1 << 25  # elements per flat all-reduce bucket (a 128 MiB float32 buffer)
_OVERLAP_BUCKET_BYTES = 25 << 20  # a bucket sent during the backward (DDP's default size)


# --- gradients (update) -----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, eq=False)
class GradSync:
    """How ``update`` synchronises one optimiser step across ``world_size`` ranks.

    Attributes:
        world_size: ``W``.
        device: the communication device.
        wrapped: the models that reduce their own gradients (DDP, FSDP2), which *average*.
        manual: the optimiser's parameters ``update`` sums itself (all the others).
        loss_scale: ``W`` when a wrapped model is present (its average of ``W·g_r`` is ``Σ g_r``;
            the manual reduction then averages too), else 1 (manual sums).
        lockstep: an FSDP2 module is present: its forwards are collectives, so every rank must
            run the same number of micro-batches.
        overlap: the manual parameters belong to models whose reduction overlaps the backward
            (``loops.dist.overlaps_reduction``: :class:`OverlappedReduction`).
    """

    world_size: int
    device: torch.device
    wrapped: tuple[nn.Module, ...]
    manual: tuple[torch.Tensor, ...]
    loss_scale: float
    lockstep: bool
    overlap: bool = False


def is_dtensor(p: torch.Tensor) -> bool:
    """Whether ``p`` is a ``DTensor`` (an FSDP2 shard)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - older PyTorch
        return False
    return isinstance(p, DTensor)


def grad_sync(models: Iterable[nn.Module], params: Sequence[torch.Tensor]) -> GradSync | None:
    """The ``GradSync`` of a step over ``params`` with ``models``; ``None`` in one process."""
    info = dist_info()
    if not info.distributed:
        return None
    trained = {id(p) for p in params}
    wrapped = tuple(m for m in models if reduces_own_gradients(m) and any(id(p) in trained for p in m.parameters()))
    owned = {id(p) for m in wrapped for p in m.parameters()}
    # an FSDP2 root gathered after its forward shows its unsharded parameters: its optimiser's are DTensors
    manual = tuple(p for p in params if id(p) not in owned and not is_dtensor(p))
    overlapped = {id(p) for m in models if overlaps_reduction(m) for p in m.parameters()}
    return GradSync(world_size=info.world_size, device=info.device, wrapped=wrapped, manual=manual,
                    loss_scale=float(info.world_size) if wrapped else 1.0, lockstep=any(map(is_fsdp2, wrapped)),
                    overlap=bool(manual) and all(id(p) in overlapped for p in manual))


@contextlib.contextmanager
def accumulation_context(sync: GradSync | None, *, last: bool) -> Iterator[None]:
    """Suspend the wrapped models' gradient reduction unless this is the step's ``last`` micro-batch.

    DDP: ``no_sync()``; FSDP2: ``set_requires_gradient_sync(False)`` (restored on exit). Manual
    parameters are never reduced during accumulation (``reduce_gradients`` does it once).
    """
    if sync is None or last or not sync.wrapped:
        yield
        return
    with contextlib.ExitStack() as stack:
        for m in sync.wrapped:
            if isinstance(m, DistributedDataParallel):
                stack.enter_context(m.no_sync())
            else:
                fsdp: Any = m  # an FSDP2 module
                fsdp.set_requires_gradient_sync(False)
                stack.callback(fsdp.set_requires_gradient_sync, True)
        yield


def reduce_gradients(sync: GradSync | None, present: Sequence[float] | None = None) -> None:
    """Sum (or average, see ``GradSync.loss_scale``) the manual parameters' gradients across ranks.

    In place on ``p.grad`` (``update`` owns the gradients). ``present [len(sync.manual)]``: how many
    ranks hold a gradient for each parameter (all-reduced by the caller); a parameter with a
    gradient on some rank gets zeros where it has none, one with none anywhere stays ``None``
    (so AdamW keeps skipping it). Gradients are flattened into buckets per dtype and device.
    """
    if sync is None or not sync.manual:
        return
    params = [p for i, p in enumerate(sync.manual) if (p.grad is not None if present is None else present[i] > 0)]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    groups: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        grad = cast(torch.Tensor, p.grad)
        groups.setdefault((grad.dtype, grad.device), []).append(grad)
    for grads in groups.values():
        start = 0
        while start < len(grads):
            bucket: list[torch.Tensor] = []
            size = 0
            while start < len(grads) and (not bucket or size + grads[start].numel() <= _BUCKET):
                bucket.append(grads[start])
                size += grads[start].numel()
                start += 1
            flat = torch.cat([g.reshape(-1) for g in bucket]).to(sync.device)
            dist.all_reduce(flat)
            if sync.loss_scale != 1.0:
                flat /= sync.loss_scale
            for g, chunk in zip(bucket, flat.split([g.numel() for g in bucket])):
                g.copy_(chunk.view_as(g))


class OverlappedReduction:
    """The manual parameters' gradients all-reduced while the step's last backward makes them.

    The parameters, in reverse order (the backward reaches the last layers first), are cut into
    buckets of about 25 MiB per dtype and device. While :meth:`armed`, a hook on each parameter
    (``register_post_accumulate_grad_hook``) counts it ready once its gradient of the last
    micro-batch is accumulated; a bucket is sent as soon as it and every bucket before it are
    ready (a flat copy, ``all_reduce(async_op=True)``), so every rank sends the same buckets in the
    same order whatever its graph. :meth:`finish` (after the backward) sends the rest (a parameter
    that got no gradient sends zeros) and waits; :meth:`apply` writes the sums back, the parameters
    absent on every rank staying ``None``, as :func:`reduce_gradients` leaves them.

    A gradient accumulated again after its bucket was sent (a parameter reached twice, through a
    reentrant checkpoint's inner backward) sets :attr:`late`; ``update`` agrees on it across the
    ranks and then reduces the untouched ``.grad`` again with :func:`reduce_gradients`. The buckets
    hold one copy of the gradients until :meth:`apply`.
    """

    def __init__(self, sync: GradSync):
        self.sync = sync
        groups: dict[tuple, list[torch.Tensor]] = {}
        for p in reversed(sync.manual):
            groups.setdefault((p.dtype, p.device), []).append(p)
        self.buckets: list[list[torch.Tensor]] = []
        for params in groups.values():
            size = 0
            for p in params:
                nbytes = p.numel() * p.element_size()
                if not self.buckets or self.buckets[-1][0].dtype != p.dtype or self.buckets[-1][0].device != p.device \
                        or size + nbytes > _OVERLAP_BUCKET_BYTES:
                    self.buckets.append([])
                    size = 0
                self.buckets[-1].append(p)
                size += nbytes
        self._bucket_of = {id(p): i for i, bucket in enumerate(self.buckets) for p in bucket}
        self._sent: list[tuple[torch.Tensor, Any]] = []
        self._waiting = [sum(p.requires_grad for p in b) for b in self.buckets]  # a frozen one never comes
        self._send_ready()
        self._fired: set[int] = set()
        self.late = False
        self.sent_in_backward = 0  # buckets sent before finish(): the overlap achieved

    @contextlib.contextmanager
    def armed(self) -> Iterator[None]:
        """Watch the gradients the backward run inside accumulates (the hooks removed on exit)."""
        hooks = [p.register_post_accumulate_grad_hook(self._ready) for p in self.sync.manual if p.requires_grad]
        try:
            yield
        finally:
            for h in hooks:
                h.remove()

    def _ready(self, p: torch.Tensor) -> None:
        i = self._bucket_of[id(p)]
        if id(p) in self._fired:
            self.late |= i < len(self._sent)
            return
        self._fired.add(id(p))
        self._waiting[i] -= 1
        self._send_ready()

    def _send_ready(self) -> None:
        while len(self._sent) < len(self.buckets) and self._waiting[len(self._sent)] == 0:
            self._send()

    def _send(self) -> None:
        bucket = self.buckets[len(self._sent)]
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                          for p in bucket]).to(self.sync.device)
        self._sent.append((flat, dist.all_reduce(flat, async_op=True)))

    def finish(self) -> None:
        """After the backward: send the buckets not yet sent, wait for all of them."""
        self.sent_in_backward = len(self._sent)
        while len(self._sent) < len(self.buckets):
            self._send()
        for _, work in self._sent:
            work.wait()

    def release(self) -> None:
        """Drop the buckets' copies unused (the step is reduced again from ``.grad``)."""
        self._sent = []

    def apply(self, present: Sequence[float]) -> None:
        """The sums (over ``loss_scale``) into ``.grad``; ``present`` as in :func:`reduce_gradients`."""
        has = {id(p): n > 0 for p, n in zip(self.sync.manual, present)}
        for bucket, (flat, _) in zip(self.buckets, self._sent):
            if self.sync.loss_scale != 1.0:
                flat /= self.sync.loss_scale
            for p, chunk in zip(bucket, flat.split([p.numel() for p in bucket])):
                if has[id(p)]:
                    p.grad = chunk.view_as(p).to(p.device)
        self._sent = []


def total_grad_norm(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """The global L2 norm ``‖g‖₂`` of ``grads``, sharded (``DTensor``) and plain ones alike.

    The norm of FSDP2's sharded gradients is completed across ranks (a collective: every rank
    must call it). Returns a plain 0-d tensor; ``zeros(())`` for no gradient.
    """
    if not grads:
        return torch.zeros(())
    sharded = [g for g in grads if hasattr(g, "full_tensor")]
    plain = [g for g in grads if not hasattr(g, "full_tensor")]
    norms = []
    if plain:
        norms.append(torch.nn.utils.get_total_norm(plain))
    if sharded:
        n = torch.nn.utils.get_total_norm(sharded)
        norms.append(n.full_tensor() if hasattr(n, "full_tensor") else n)
    if len(norms) == 1:
        return norms[0]
    device = norms[0].device
    return torch.linalg.vector_norm(torch.stack([n.to(device, torch.float64) for n in norms])).to(norms[0].dtype)


# --- state (checkpoints) ------------------------------------------------------------------------
def full_weights(model: nn.Module) -> dict[str, torch.Tensor] | None:
    """FSDP2: the gathered full state dict (a collective: every rank calls it; rank 0 gets the
    tensors, on CPU). Other models: ``None`` (saved from the module itself)."""
    if not is_fsdp2(model):
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    return cast(dict[str, torch.Tensor],
                get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)))


def drop_tied(model: nn.Module, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``weights`` without the second names of tied parameters (safetensors stores a tensor once)."""
    unique = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
    every = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    return {k: v for k, v in weights.items() if k in unique or k not in every}


def load_full_weights(model: nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Load full tensors into an FSDP2 module, each rank keeping its shards (in place).

    Raises ``ValueError`` naming missing / unexpected keys (tied duplicates may be absent)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    own = set(model.state_dict())
    tied = {n for n, _ in model.named_parameters(remove_duplicate=False)} - {n for n, _ in model.named_parameters()}
    unexpected, missing = sorted(set(weights) - own), sorted(own - set(weights) - tied)
    if unexpected or missing:
        raise ValueError(f"weights do not fit the model: missing {missing[:8]}, "
                              f"unexpected {unexpected[:8]}")
    set_model_state_dict(model, cast(Any, weights), options=StateDictOptions(full_state_dict=True, strict=False))


def _is_sharded(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and hasattr(x, "full_tensor")


def full_optimizer_state(optimizer: torch.optim.Optimizer) -> dict:
    """The optimiser's state dict with FSDP2-sharded tensors gathered into full ones (a collective:
    every rank calls it, in the same order); as it is when nothing is sharded."""
    sd = optimizer.state_dict()
    if not any(_is_sharded(v) for st in sd["state"].values() for v in st.values()):
        return sd
    state = {i: {k: v.full_tensor() if _is_sharded(v) else v for k, v in sorted(sd["state"][i].items())}
             for i in sorted(sd["state"])}
    return {**sd, "state": state}


def shard_optimizer_state(sd: dict, optimizer: torch.optim.Optimizer) -> dict:
    """Full optimiser tensors re-sharded like their FSDP2 parameters (every rank holds the file)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if not any(_is_sharded(p) for p in params):
        return sd
    from torch.distributed.tensor import distribute_tensor

    def place(p: Any, v: Any) -> Any:
        if _is_sharded(p) and isinstance(v, torch.Tensor) and v.shape == p.shape:
            return distribute_tensor(v.to(p.device, p.dtype), p.device_mesh, p.placements)
        return v

    state = {i: {k: place(params[int(i)], v) for k, v in st.items()} for i, st in sd["state"].items()}
    return {**sd, "state": state}


def all_ranks_ok(ok: bool) -> bool:
    """Whether every rank passed ``ok=True`` (one all-reduce; every rank must call it). Used as the
    barrier after rank 0 writes a checkpoint, carrying whether the write succeeded."""
    info = dist_info()
    if not info.distributed:
        return ok
    failed = all_reduce_sum(torch.tensor([float(not ok)], device=info.device))
    return not bool(failed.item())
