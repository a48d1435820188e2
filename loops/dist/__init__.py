"""Data parallelism: one code path for 1 or N processes under ``torch.distributed``.

Launch N copies of the same script with ``torchrun`` (or :func:`spawn` on one machine); each calls
:func:`init_distributed` once, and the loop code is unchanged: ``update`` sees the process group
and makes the step the step of the *global* batch.

What is synchronised, and where:

- ``update`` (``loops/update.py``): the step's token / sequence / row counts are all-reduced
  before the micro-batch losses (global denominators, so each rank's loss is its share of the
  global loss and the global gradient is the *sum* of the ranks' gradients); gradients are
  summed across ranks once per optimiser step (after the last micro-batch: accumulation never
  communicates); the loss metrics are summed and the other metrics averaged by rows; the
  non-finite and early-stop flags are agreed, so every rank steps, skips or stops together;
- ``save_checkpoint`` (``loops/checkpoint.py``): rank 0 writes, every rank waits for it and
  fails with it; DDP's ``module.`` prefix is stripped and FSDP2 shards are gathered, so a
  checkpoint loads in one process and resumes on any world size;
- ``fold`` (``loops/fold.py``): each step's metrics are averaged across ranks before the
  callbacks see them, so every rank logs the same numbers.

Gradient reduction strategies (:func:`wrap_model`):

- ``None`` (the default for recipes): the module stays as it is, its parameters are broadcast
  from rank 0 once, and ``update`` sums the gradients of the optimiser's parameters itself, in
  flat buckets. Any forward path works (the chunked trunk → head log-probs of ``loops.score``,
  ``generate``), because nothing hooks the module's ``forward``.
- ``"bucketed"`` (the recipes' ``strategy: ddp``): as ``None``, but ``update`` all-reduces the
  gradients in buckets of about 25 MiB, each sent (asynchronously, in a fixed order) as soon as the
  last micro-batch's backward has made all of its gradients, so the communication overlaps the rest
  of the backward as DDP's does; it needs no wrapper, so every forward path works. A gradient that
  changes after its bucket was sent (a parameter reached twice by a reentrant checkpoint) is caught
  and that step is reduced again after the backward. The buckets hold one copy of the gradients.
- ``"ddp"``: ``DistributedDataParallel``: bucketed all-reduce overlapped with the backward of the
  last micro-batch (``no_sync`` on the others). DDP *averages* over ranks, so ``update``
  multiplies each micro-batch loss by ``W`` before ``backward`` (the mean of ``W·g_r`` is
  ``Σ_r g_r``). DDP arms its hooks in ``DDP.forward``: the loss must call the wrapper (a loss that
  reaches the inner module's trunk directly would skip the reduction, so such code fails loudly:
  the wrapper has no ``get_decoder`` / ``generate``).
- ``"fsdp2"``: ``torch.distributed.fsdp.fully_shard`` on each block (a Hugging Face model's
  ``_no_split_modules``) and on the root: parameters, gradients and optimiser state sharded;
  reduce-scatter averages, so the same ``W`` scaling applies. Works on CPU with gloo. Every rank
  must run the same number of forwards per step (``update`` agrees on the micro-batch count: a rank
  with fewer halves its own, or runs its last row again at weight zero).

References:
    Li et al., "PyTorch Distributed: Experiences on Accelerating Data Parallel Training",
    https://arxiv.org/abs/2006.15704; Zhao et al., "PyTorch FSDP: Experiences on Scaling Fully
    Sharded Data Parallel", https://arxiv.org/abs/2304.11277
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import os
import socket
import sys
import weakref
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
from tensordict import TensorDict, TensorDictBase
from torch import nn

from rlcore.checks import lookup
from rlcore.transforms import RunningMoments, running_moments_init, running_moments_merge

__all__ = [
    "DistInfo",
    "init_distributed",
    "dist_info",
    "shutdown_distributed",
    "is_main",
    "barrier",
    "all_gather_moments",
    "all_gather_rows",
    "gathered",
    "all_gather_strings",
    "STRATEGIES",
    "wrap_model",
    "unwrap_model",
    "reduces_own_gradients",
    "overlaps_reduction",
    "is_fsdp2",
    "release_gathered",
    "sharded_root",
    "broadcast_module",
    "all_reduce_sum",
    "agree",
    "reduce_metrics",
    "shard_batch",
    "shard_source",
    "free_port",
    "process_context",
    "spawn",
]

# --- the process group ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class DistInfo:
    """Where this process stands: ``rank`` of ``world_size``, ``local_rank`` on its machine.

    ``backend`` is ``None`` in a single process without a process group; ``device`` is the device
    this rank computes (and communicates) on: ``cuda:<local_rank>`` under NCCL, else ``cpu``.
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    backend: str | None = None
    device: torch.device = torch.device("cpu")  # noqa: RUF009 -- immutable

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that writes files."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """More than one rank in an initialised process group."""
        return self.world_size > 1


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}: expected an integer in the environment, got {value!r}") from None


def _comm_device(backend: str | None) -> torch.device:
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def dist_info() -> DistInfo:
    """The ``DistInfo`` of the current process group, or the single-process one. Starts nothing."""
    if not (dist.is_available() and dist.is_initialized()):
        return DistInfo()
    backend = dist.get_backend()
    return DistInfo(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=_env_int("LOCAL_RANK", 0),
                    local_world_size=_env_int("LOCAL_WORLD_SIZE", 1), backend=backend,
                    device=_comm_device(backend))


def init_distributed(*, backend: str | None = None, timeout_s: float = 1800.0) -> DistInfo:
    """Join the process group ``torchrun`` describes in the environment; a no-op in one process.

    Reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` /
    ``MASTER_PORT`` (the ``env://`` rendezvous). With ``WORLD_SIZE`` unset or 1 and no group, no
    group is created and the single-process ``DistInfo`` is returned: the same script runs with
    ``python`` and with ``torchrun``. Calling it again returns the current group's info. Under
    torchrun's restarts (``--max-restarts``) on one node each attempt keys the rendezvous by its
    number (``TORCHELASTIC_RESTART_COUNT``), so no rank reads an address of the attempt before.

    Args:
        backend: ``"nccl"`` when CUDA is available, else ``"gloo"`` (default), or as given.
        timeout_s: how long a collective may wait for the other ranks before failing.
    Returns:
        ``DistInfo``. Under NCCL the current CUDA device is set to ``cuda:LOCAL_RANK``.
    """
    if dist.is_available() and dist.is_initialized():
        return dist_info()
    world_size = _env_int("WORLD_SIZE", 1)
    if world_size <= 1:
        return DistInfo()
    if not dist.is_available():
        raise RuntimeError("init_distributed: WORLD_SIZE > 1 but this PyTorch build has no torch.distributed")
    missing = [v for v in ("RANK", "MASTER_ADDR", "MASTER_PORT") if not os.environ.get(v)]
    if missing:
        raise ValueError(f"init_distributed: WORLD_SIZE={world_size} but {missing} are not set; launch with "
                         "torchrun (or rlcore.loops.dist.spawn), which sets them")
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(_env_int("LOCAL_RANK", 0))
    rank, timeout = _env_int("RANK", 0), datetime.timedelta(seconds=timeout_s)
    store = None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is not None and _env_int("LOCAL_WORLD_SIZE", world_size) == world_size:
        # torchrun's agent keeps one store across the restarts it makes (--max-restarts): the addresses
        # the last attempt's ranks wrote there are still readable, and a relaunched rank that reads one
        # before its peer has written anew connects to a process that is gone. Each attempt's own keys;
        # on one node only: there one agent counts the attempts, while each node's agent counts its own
        # (and a restart for a node joining counts none), so the nodes' counts need not agree.
        store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world_size, timeout=timeout))
        store = dist.PrefixStore(f"rlcore/attempt-{attempt}", store)
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout, store=store)
    return dist_info()


def shutdown_distributed() -> None:
    """Leave the process group (if any). Call once at the end of a distributed script."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def is_main() -> bool:
    """True on rank 0 (and in a single process)."""
    return dist_info().is_main


def barrier() -> None:
    """Wait for every rank (a no-op in one process)."""
    if dist_info().distributed:
        dist.barrier()


# --- collectives on small values --------------------------------------------------------------------
def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    """``Σ_r x_r`` over the ranks as a new tensor on ``x``'s device (``x`` itself in one process).

    The sum travels on the rank's communication device (CPU under gloo, CUDA under NCCL).
    """
    info = dist_info()
    if not info.distributed:
        return x
    buf = x.detach().to(info.device, copy=True)
    dist.all_reduce(buf)
    return buf.to(x.device)


def gathered(t: torch.Tensor) -> torch.Tensor:
    """The full tensor of an FSDP2 shard (``DTensor.full_tensor``: a collective, every rank calls it),
    on the shard's device; any other tensor as it is. A shard kept on the CPU (``fsdp_cpu_offload``)
    under NCCL, which cannot gather CPU tensors, goes through the rank's device and comes back."""
    if not hasattr(t, "full_tensor"):
        return t
    if t.device.type == "cpu" and dist.get_backend() == "nccl":
        return cast(torch.Tensor, t.to(dist_info().device).full_tensor()).to("cpu")
    return cast(torch.Tensor, t.full_tensor())


def all_gather_rows(x: torch.Tensor) -> torch.Tensor:
    """Every rank's ``x`` ``[n, ...]`` concatenated in rank order, the same on every rank (``x`` in one
    process). Each rank must pass the same shape."""
    info = dist_info()
    if not info.distributed:
        return x
    local = x.detach().to(info.device).contiguous()
    parts = [torch.empty_like(local) for _ in range(info.world_size)]
    dist.all_gather(parts, local)
    return torch.cat(parts).to(x.device)


def all_gather_strings(strings: Sequence[str]) -> list[str]:
    """Every rank's strings in rank order, the same on every rank (a copy in one process): UTF-8
    bytes in padded tensors (two all-gathers; no pickling)."""
    info = dist_info()
    if not info.distributed:
        return list(strings)
    encoded = [s.encode() for s in strings]
    sizes = all_gather_rows(torch.tensor([len(encoded), max(map(len, encoded), default=0)], dtype=torch.long))
    rows, width = int(sizes.view(-1, 2)[:, 0].max()), int(sizes.view(-1, 2)[:, 1].max())
    local = torch.zeros(rows, max(width, 1), dtype=torch.uint8)
    lengths = torch.zeros(rows, dtype=torch.long)
    for i, b in enumerate(encoded):
        local[i, :len(b)] = torch.tensor(list(b), dtype=torch.uint8)
        lengths[i] = len(b)
    table, counts = all_gather_rows(local), all_gather_rows(lengths)
    out = []
    for r, n in enumerate(sizes.view(-1, 2)[:, 0].tolist()):
        for i in range(r * rows, r * rows + n):
            out.append(bytes(table[i, :int(counts[i])].tolist()).decode())
    return out


def all_gather_moments(moments: RunningMoments) -> RunningMoments:
    """The moments of every rank's values together, the same on every rank (``moments`` in one process).

    Each rank's ``(count, mean, M2)`` is gathered and the parts merged in rank order with
    ``running_moments_merge`` (Chan et al.'s exact formula), so ``W`` ranks holding shards of a
    batch get the moments of the whole batch, as TRL's cross-rank ``RunningMoments`` does.
    """
    info = dist_info()
    if not info.distributed:
        return moments
    dtype, device = moments.mean.dtype, moments.mean.device
    local = torch.stack([moments.count.to(torch.float64), moments.mean.to(torch.float64),
                         moments.m2.to(torch.float64)]).to(info.device)
    parts = [torch.empty_like(local) for _ in range(info.world_size)]
    dist.all_gather(parts, local)
    merged = running_moments_init(dtype, device)
    for count, mean, m2 in (part.tolist() for part in parts):
        part = RunningMoments(torch.tensor(int(count), device=device), torch.tensor(mean, dtype=dtype, device=device),
                              torch.tensor(m2, dtype=dtype, device=device))
        merged = running_moments_merge(merged, part)
    return merged


def agree(values: Sequence[int], *, what: str) -> None:
    """Raise ``ValueError`` on every rank unless every rank passed the same integers.

    One all-reduce of ``[v, v²]`` (int64): the ranks agree iff ``W·Σ v² = (Σ v)²`` for every
    entry (Cauchy–Schwarz), a condition every rank evaluates on the same reduced numbers, so all
    raise or none does. ``values`` must have the same length on every rank.
    """
    info = dist_info()
    if not info.distributed:
        return
    v = torch.as_tensor([int(x) % (1 << 24) for x in values], dtype=torch.int64)
    buf = torch.cat([v, v * v]).to(info.device)
    dist.all_reduce(buf)
    s, s2 = buf.cpu().view(2, -1)
    if not torch.equal(s * s, s2 * info.world_size):
        raise ValueError(f"{what}: the ranks disagree (this rank has {list(values)}); every rank must run "
                         "the same number of steps / forwards and report the same metric names")


def _names_signature(names: Sequence[str]) -> int:
    return zlib.crc32("\x00".join(names).encode())


def reduce_metrics(metrics: Mapping[str, Any] | TensorDictBase) -> TensorDict | Mapping[str, Any]:
    """The mean over the ranks of every scalar metric (the metrics themselves in one process).

    ``m ← (1/W) Σ_r m_r`` for each key, in one all-reduce (float64). Every rank must report the
    same keys (checked: a mismatch raises ``ValueError`` on every rank instead of hanging).

    Args:
        metrics: TensorDict ``batch_size=[]`` or a mapping of scalars (tensors or numbers).
    Returns:
        A new TensorDict of 0-d float64 CPU tensors (nested keys joined with ``/``).
    """
    info = dist_info()
    if not info.distributed:
        return metrics
    items = metrics.items(include_nested=True, leaves_only=True) if isinstance(metrics, TensorDictBase) \
        else metrics.items()
    names, values = [], []
    for k, v in items:
        names.append("/".join(k) if isinstance(k, tuple) else str(k))
        values.append(torch.as_tensor(v).detach().reshape(()).to(info.device, torch.float64))
    agree([len(names), _names_signature(names)], what="reduce_metrics: metric names")
    if not values:
        return TensorDict({}, batch_size=[])
    buf = torch.stack(values)
    dist.all_reduce(buf)
    mean = (buf / info.world_size).cpu()
    return TensorDict(dict(zip(names, mean.unbind())), batch_size=[])


# --- model wrapping ------------------------------------------------------------------------------
def broadcast_module(model: nn.Module, *, src: int = 0) -> nn.Module:
    """Copy rank ``src``'s parameters and buffers into every rank's ``model`` (in place; setup only).

    Replicas must start equal: gradients are summed, not the weights. A no-op in one process.
    """
    info = dist_info()
    if not info.distributed:
        return model
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            buf = t.detach().to(info.device, copy=True)
            dist.broadcast(buf, src)
            t.copy_(buf.to(t.device))
    return model


def _replicate(model: nn.Module, **kwargs: Any) -> nn.Module:
    if kwargs:
        raise TypeError(f"wrap_model(strategy=None) takes no options, got {sorted(kwargs)}")
    return broadcast_module(model)


_OVERLAPPED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def _bucketed(model: nn.Module, **kwargs: Any) -> nn.Module:
    if kwargs:
        raise TypeError(f"wrap_model(strategy='bucketed') takes no options, got {sorted(kwargs)}")
    _OVERLAPPED.add(broadcast_module(model))
    return model


def overlaps_reduction(model: nn.Module) -> bool:
    """Whether ``update`` all-reduces ``model``'s gradients while the backward makes them
    (``wrap_model(strategy="bucketed")``, the recipes' ``strategy: ddp``)."""
    return model in _OVERLAPPED


def _ddp(model: nn.Module, **kwargs: Any) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel
    device = next(model.parameters()).device
    if device.type == "cuda":
        kwargs.setdefault("device_ids", [device.index])
    return DistributedDataParallel(model, **kwargs)


class FreedAfterReduce:
    """FSDP2's gradient reduce-scatter for a gloo group, whose collectives are done when they return:
    the flat input (one block's unsharded gradients, in the reduce dtype) is freed at once.

    FSDP2 keeps the last input referenced until the next block's reduce, so that a GPU's communication
    stream may still read it. On a CPU nothing reads it after the call, and it was held through the
    next block's backward: at the Qwen2.5-0.5B shape one block's float32 gradients, 57 MiB, beside the
    embedding's gradient at the step's peak. ``wrap_model(strategy="fsdp2")`` installs it on every
    sharded module when the process group is gloo (``set_custom_reduce_scatter``)."""

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                 async_op: bool = False) -> None:
        reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        reduce_scatter(output_tensor, input_tensor, op=op, group=group)  # synchronous even if asked otherwise
        if dist.get_backend(group) == "gloo":  # done with the input once the call returns
            input_tensor.untyped_storage().resize_(0)


def _fsdp2(model: nn.Module, *, blocks: Sequence[type | str] | None = None, backward_prefetch: bool = True,
           **kwargs: Any) -> nn.Module:
    from torch.distributed.fsdp import FSDPModule, fully_shard
    names = blocks if blocks is not None else list(getattr(model, "_no_split_modules", None) or [])
    wanted = tuple(b for b in names if isinstance(b, type))
    wanted_names = {b for b in names if isinstance(b, str)}
    for module in reversed(list(model.modules())[1:]):  # inner blocks first: FSDP2 shards bottom-up
        if isinstance(module, wanted) or type(module).__name__ in wanted_names:
            fully_shard(module, **kwargs)
    # the root's parameters (embeddings, final norm, head) stay gathered after its forward: the chunked
    # log-prob path reads the head's weight after the forward, and the backward needs them at once
    root = cast(nn.Module, fully_shard(model, **{**kwargs, "reshard_after_forward": False}))
    gloo = dist.get_backend() == "gloo"
    for module in root.modules():
        if not isinstance(module, FSDPModule):
            continue
        if not backward_prefetch:
            # FSDP2 gathers the block its backward reaches next unless a module names the modules to
            # prefetch; naming itself (gathered already when its backward starts) leaves nothing to prefetch
            module.set_modules_to_backward_prefetch([module])
        if gloo:
            module.set_custom_reduce_scatter(FreedAfterReduce())  # type: ignore[arg-type]
    return root


STRATEGIES: dict[str, Callable[..., nn.Module]] = {
    "none": _replicate,
    "bucketed": _bucketed,
    "ddp": _ddp,
    "fsdp2": _fsdp2,
}


def wrap_model(model: nn.Module, *, strategy: str | None = "ddp", **kwargs: Any) -> nn.Module:
    """Prepare ``model`` for data-parallel training under the current process group.

    - ``None`` / ``"none"``: the module itself, its weights broadcast from rank 0; ``update`` sums
      its gradients after the step's last backward (works with every forward path);
    - ``"bucketed"``: the same, but ``update`` all-reduces the gradients bucket by bucket while the
      step's last backward makes them, as DDP does, with no wrapper (every forward path works);
      the recipes' ``strategy: ddp``;
    - ``"ddp"``: ``DistributedDataParallel(model, **kwargs)`` (``device_ids`` set on CUDA); the
      loss must call the wrapper's ``forward``;
    - ``"fsdp2"``: ``fully_shard`` on each block (``blocks=``: classes or class names; default the
      Hugging Face ``_no_split_modules``) and on the root, ``**kwargs`` passed to ``fully_shard``
      (``mp_policy``, ``reshard_after_forward``...; the root keeps its parameters gathered after its
      forward, as FSDP2's own default for a root does); ``backward_prefetch=False`` gathers each block
      only when its backward starts (by default the next one is gathered while this one runs: an
      overlap on an accelerator, one more gathered block held for nothing on a CPU, whose gloo
      all-gather is synchronous); under gloo each block's gradient reduce-scatter frees its input
      as soon as it returns (:class:`FreedAfterReduce`); the model is changed in place and returned.

    In one process every strategy returns ``model`` unchanged. Build the optimiser *after*
    wrapping (FSDP2 replaces the parameters by sharded ones).

    Raises:
        ValueError: an unknown strategy (the message lists them).
    """
    wrap = lookup(STRATEGIES, "none" if strategy is None else strategy, what="strategy")
    if not dist_info().distributed:
        return model
    return wrap(model, **kwargs)


def _is_ddp(model: nn.Module) -> bool:
    from torch.nn.parallel import DistributedDataParallel
    return isinstance(model, DistributedDataParallel)


def is_fsdp2(model: nn.Module) -> bool:
    """Whether ``model`` was sharded by ``fully_shard`` (FSDP2)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - older PyTorch
        return False
    return isinstance(model, FSDPModule)


def release_gathered(model: nn.Module) -> None:
    """Free what an FSDP2 model keeps gathered after a forward: the root's parameters (embeddings,
    final norm, head; ``wrap_model`` leaves them gathered so that the chunked log-prob path can read
    the head), and the blocks' under ``reshard_after_forward=False``. Call it after a no-grad scoring
    pass (a frozen reference or reward model, or the policy's old log-probs), never between a
    forward and its backward; the next forward gathers them again. A no-op for an unsharded model."""
    root = sharded_root(model)
    if root is None:
        return
    from torch.distributed.fsdp import FSDPModule

    for module in root.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def sharded_root(model: nn.Module) -> nn.Module | None:
    """The FSDP2 root a forward of ``model`` must run through, or ``None``: ``model`` itself when
    sharded, else the sharded model a wrapper of it calls, named by the wrapper's class attribute
    ``calls_through`` (``loops.lora.AdapterOff``: the LoRA policy with its adapters off;
    ``loops.reft_model.ReftModel``: the frozen model its interventions edit). The root's forward
    gathers the parameters outside the blocks (embeddings, final norm, head); a caller that
    reaches past it (the trunk alone, the head by hand) must call the root instead."""
    if is_fsdp2(model):
        return model
    name = getattr(type(model), "calls_through", None)
    inner = model.__dict__.get(name) or model._modules.get(name) if name else None
    return inner if inner is not None and is_fsdp2(inner) else None


def reduces_own_gradients(model: nn.Module) -> bool:
    """Whether ``model`` reduces its gradients itself (a DDP wrapper or an FSDP2 module)."""
    return _is_ddp(model) or is_fsdp2(model)


def unwrap_model(model: nn.Module) -> nn.Module:
    """The module inside a DDP wrapper (``model.module``); any other module as it is.

    An FSDP2 module is its own module (its parameters are sharded ``DTensor`` s: use
    ``loops.checkpoint`` to gather them).
    """
    return cast(nn.Module, model.module) if _is_ddp(model) else model


# --- data sharding -----------------------------------------------------------------------------------
def _bounds(n: int, rank: int, world_size: int, where: str) -> tuple[int, int]:
    if n < world_size:
        raise ValueError(f"{where}: {n} rows cannot be split over {world_size} ranks (each needs at least one)")
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def shard_batch(item: Any, *, rank: int | None = None, world_size: int | None = None) -> Any:
    """This rank's contiguous block of rows of a batch: rows ``[start_r, end_r)`` of ``n``.

    The first ``n mod W`` ranks get ``⌈n/W⌉`` rows, the others ``⌊n/W⌋`` (``tensor_split``'s rule),
    so the ranks' blocks concatenated in rank order are the batch. Works on a TensorDict ``[n]``
    (rows), a mapping of columns (lists, tuples or tensors with ``n`` rows: a batch of prompts),
    and a list / tuple / tensor of rows. Groups of samples stay whole when the batch is split
    before they are drawn (split prompts, not rollouts).

    >>> shard_batch({"prompt": ["a", "b", "c"], "answer": ["1", "2", "3"]}, rank=0, world_size=2)
    {'prompt': ['a', 'b'], 'answer': ['1', '2']}
    """
    info = dist_info()
    rank = info.rank if rank is None else rank
    world_size = info.world_size if world_size is None else world_size
    if world_size == 1 or item is None:  # None: a source without data (DDPO samples its own)
        return item
    if isinstance(item, TensorDictBase):
        lo, hi = _bounds(item.batch_size[0], rank, world_size, "shard_batch")
        return item[lo:hi]
    if isinstance(item, Mapping):
        lengths = {k: len(v) for k, v in item.items()}
        if len(set(lengths.values())) != 1:
            raise ValueError(f"shard_batch: the columns have different lengths {lengths}")
        lo, hi = _bounds(next(iter(lengths.values())), rank, world_size, "shard_batch")
        return {k: v[lo:hi] for k, v in item.items()}
    if isinstance(item, (list, tuple, torch.Tensor)):
        lo, hi = _bounds(len(item), rank, world_size, "shard_batch")
        return item[lo:hi]
    raise TypeError(f"shard_batch: expected a TensorDict, a mapping of columns or a sequence of rows, "
                    f"got {type(item).__name__}")


class _ShardedIterable:
    def __init__(self, source: Iterable, rank: int | None, world_size: int | None):
        self.source, self.rank, self.world_size = source, rank, world_size

    def __iter__(self) -> Iterator:
        return (shard_batch(x, rank=self.rank, world_size=self.world_size) for x in self.source)


def shard_source(source: Iterable | Callable[[int], Iterable], *, rank: int | None = None,
                 world_size: int | None = None) -> Iterable | Callable[[int], Iterable]:
    """A ``fold`` source whose every item is this rank's :func:`shard_batch` of the original item.

    Each item is one *global* batch split across the ranks, so ``state.step`` counts global
    batches and a run resumes on any world size. A callable source ``source(start)`` stays a
    callable (resumable by arithmetic); an iterable stays re-iterable. One process: ``source``.
    """
    if (dist_info().world_size if world_size is None else world_size) == 1:
        return source
    if callable(source) and not hasattr(source, "__iter__"):
        return lambda start: _ShardedIterable(source(start), rank, world_size)
    return _ShardedIterable(source, rank, world_size)


# --- local launch ------------------------------------------------------------------------------------
def free_port() -> int:
    """A TCP port free on this machine now (for ``MASTER_PORT``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_context(start_method: str = "spawn", preload: Sequence[str] = ()):
    """The ``torch.multiprocessing`` context for ``start_method``; with ``"forkserver"`` its server
    imports the modules named in ``preload`` (the caller's, e.g. ``"rlcore.loops"``) once, so each
    child starts from a process that has them."""
    ctx = torch.multiprocessing.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(list(preload))
    return ctx


def _spawned(local_rank: int, fn: Callable, world_size: int, port: int, backend: str | None, args: tuple) -> None:
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    init_distributed(backend=backend, timeout_s=120.0)
    try:
        fn(*args)
        barrier()  # no rank leaves the group while another may still be talking to it
    finally:
        shutdown_distributed()
    # Leave without the interpreter's teardown: models still holding the group (an FSDP2 mesh) would
    # otherwise free gloo's worker threads during finalisation, which can abort the process.
    gc.collect()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(fn: Callable, nprocs: int, *args: Any, backend: str | None = None, port: int | None = None,
          start_method: str = "spawn", preload: Sequence[str] = ()) -> None:
    """Run ``fn(*args)`` in ``nprocs`` new processes forming one process group on this machine.

    ``torchrun --nproc_per_node=nprocs`` for a function: each child gets the torchrun environment
    (a free ``MASTER_PORT`` unless ``port``), calls :func:`init_distributed` (``backend`` default:
    NCCL with CUDA, else gloo; 120 s collective timeout), runs ``fn`` and leaves the group. ``fn``
    must be importable (a module-level function). An exception in any child ends the others and
    is raised here (``torch.multiprocessing.ProcessRaisedException``).

    ``start_method``: ``"spawn"`` (default, always safe), ``"forkserver"`` (children fork from a
    server that imported the ``preload`` modules once: fast after the first launch), or ``"fork"``
    (no import at all, but only from a process that has not yet run multi-threaded work: a fork
    after OpenMP ran can deadlock, and never after CUDA is initialised).
    """
    import torch.multiprocessing as mp
    process_context(start_method, preload)
    mp.start_processes(_spawned, args=(fn, nprocs, port or free_port(), backend, args), nprocs=nprocs,
                       start_method=start_method, join=True)
