"""Sharded checkpoints of FSDP2 models: every rank writes its own rows; any world size reads them.

A tensor store saved sharded is a folder::

    shards.json                          the index: the world size that wrote it, and each tensor's
                                         shape, dtype and whether its rows are split over the ranks
    shard-RRRRR-of-WWWWW.safetensors     rank R's rows of every split tensor (rank 0's file also
                                         holds every tensor that is not split, whole)

FSDP2 splits each parameter (and its optimiser state) on dim 0 as ``torch.chunk`` does: with
``c = ceil(n / W)``, rank ``r`` holds rows ``[min(r·c, n), min((r+1)·c, n))`` (:func:`rows_of`).
Reading needs only that rule: a process at world size ``W'`` reads, for each tensor, the rows its
own shard covers from the files whose rows overlap them (``safe_open(...).get_slice``: only those
bytes), so a checkpoint written at 4 ranks resumes at 2 or 1 and the reverse, and no rank ever
holds more than its own rows of a split tensor. :func:`gather_folder` writes the full tensors as a
plain ``from_pretrained`` folder, one output file at a time.

The format is safetensors and JSON only, read trusting nothing (``loops.checkpoint_codec``): the
index's entries are checked for type, every file's header against the file before a byte of data
is read, and every piece's shape and dtype against the index. ``torch.distributed.checkpoint``
stores its metadata as a pickle, which a checkpoint that is data cannot have.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from rlcore.loops.checkpoint_codec import CheckpointError, check_safetensors, read_json

__all__ = ["INDEX", "rows_of", "shard_file", "is_sharded_folder", "split_rows", "save_shards", "read_index",
           "read_rows", "gather_folder", "plain_folder"]

INDEX = "shards.json"
FORMAT_VERSION = 1
_MAX_WORLD = 1 << 16
_STORED = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64", "I64": "int64", "I32": "int32",
           "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}  # safetensors' dtype names
_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64,
                                                      torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
                                                      torch.bool)}


def rows_of(n: int, world_size: int, rank: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of an ``n``-row tensor that rank ``rank`` of ``world_size`` holds
    under FSDP2's split (``torch.chunk`` on dim 0: chunks of ``ceil(n / W)``, the last ones short
    or empty).

    >>> [rows_of(7, 3, r) for r in range(3)], [rows_of(2, 4, r) for r in range(4)]
    ([(0, 3), (3, 6), (6, 7)], [(0, 1), (1, 2), (2, 2), (2, 2)])
    """
    c = math.ceil(n / world_size) if n else 0
    return min(rank * c, n), min((rank + 1) * c, n)


def shard_file(rank: int, world_size: int) -> str:
    return f"shard-{rank:05d}-of-{world_size:05d}.safetensors"


def is_sharded_folder(directory: str | Path) -> bool:
    return (Path(directory) / INDEX).is_file()


def _split(t: torch.Tensor) -> bool:
    """Whether ``t`` is a DTensor split on dim 0 over a one-dimensional mesh (FSDP2's parameters and
    their optimiser state); any other DTensor placement is refused."""
    if not hasattr(t, "placements"):
        return False
    from torch.distributed.tensor import Shard

    placements = tuple(t.placements)
    if t.device_mesh.ndim != 1 or placements != (Shard(0),):
        raise ValueError(f"a sharded checkpoint stores tensors split on dim 0 over one mesh dimension (FSDP2's "
                         f"fully_shard), got placements {placements} on a {t.device_mesh.ndim}-d mesh")
    return True


def split_rows(t: torch.Tensor) -> tuple[int, int] | None:
    """The rows of the full tensor that ``t``'s local shard holds, for a DTensor split by FSDP2
    (checked against ``rows_of``); ``None`` for a tensor that is not split."""
    return _local_rows(t) if _split(t) else None


def _local_rows(t: torch.Tensor) -> tuple[int, int]:
    rank, world = t.device_mesh.get_local_rank(), t.device_mesh.size()
    start, stop = rows_of(t.shape[0], world, rank)
    local = t.to_local()
    if local.shape[0] != stop - start or tuple(local.shape[1:]) != tuple(t.shape[1:]):
        raise ValueError(f"a shard of shape {tuple(local.shape)} on rank {rank} of {world} is not rows "
                         f"[{start}, {stop}) of {tuple(t.shape)}: not FSDP2's even split")
    return start, stop


def save_shards(directory: Path, tensors: Mapping[str, torch.Tensor], *, rank: int, world_size: int) -> list[Path]:
    """Write this rank's part of ``tensors`` into ``directory`` (which must exist): its rows of every
    split tensor (a DTensor sharded on dim 0) and, on rank 0, every other tensor whole and the index.
    Every rank calls it with the same names. Returns the files this rank wrote."""
    local: dict[str, torch.Tensor] = {}
    index: dict[str, Any] = {}
    for name, t in tensors.items():
        split = split_rows(t) is not None
        if split:
            local[name] = t.to_local().detach().to("cpu", copy=True).contiguous()
        elif rank == 0:
            local[name] = t.detach().to("cpu", copy=True).contiguous()
        index[name] = {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."), "split": split}
    written = [directory / shard_file(rank, world_size)]
    save_file(local, str(written[0]))
    if rank == 0:
        written.append(directory / INDEX)
        written[-1].write_text(json.dumps({"format": FORMAT_VERSION, "world_size": world_size, "tensors": index},
                                          indent=1))
    return written


def read_index(directory: Path) -> dict[str, Any]:
    """``shards.json`` of ``directory``, every entry checked, and every shard file's header checked
    against the index (each piece of the expected shape and dtype) before any data is read.

    Raises:
        CheckpointError: naming the file, the tensor and what is wrong.
    """
    where = directory / INDEX
    index = read_json(where, expect=dict)
    world = index.get("world_size")
    tensors = index.get("tensors")
    if index.get("format") != FORMAT_VERSION or not isinstance(world, int) or isinstance(world, bool) \
            or not 1 <= world <= _MAX_WORLD or not isinstance(tensors, dict):
        raise CheckpointError(f"{where}: expected {{'format': {FORMAT_VERSION}, 'world_size': 1..{_MAX_WORLD}, "
                              f"'tensors': {{name: {{shape, dtype, split}}}}}}, got format {index.get('format')!r}, "
                              f"world_size {world!r}, tensors of type {type(tensors).__name__}")
    for name, entry in tensors.items():
        shape = entry.get("shape") if isinstance(entry, dict) else None
        if not (isinstance(shape, list) and all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s < 2 ** 62
                                                for s in shape) and math.prod(shape) < 2 ** 62
                and isinstance(entry.get("dtype"), str) and entry["dtype"] in _DTYPES
                and isinstance(entry.get("split"), bool)
                and (shape or not entry["split"])):
            raise CheckpointError(f"{where}: tensor {name!r}: expected {{shape: [0 <= int < 2**62, ...], dtype: one of "
                                  f"{sorted(_DTYPES)}, split: bool (only with a shape)}}, got {entry!r:.200}")
    for rank in range(world):
        path = directory / shard_file(rank, world)
        if not path.is_file():
            raise CheckpointError(f"{path}: missing (the index says {world} ranks wrote this folder)")
        header = check_safetensors(path)
        expected = {name: e for name, e in tensors.items() if e["split"] or rank == 0}
        if set(header) != set(expected):
            raise CheckpointError(f"{path}: holds tensors {sorted(set(header) ^ set(expected))[:5]} the index does "
                                  f"not place there")
        for name, e in expected.items():
            start, stop = rows_of(e["shape"][0], world, rank) if e["split"] else (0, None)
            shape = [stop - start, *e["shape"][1:]] if e["split"] else e["shape"]
            if header[name]["shape"] != shape or _STORED.get(header[name]["dtype"]) != e["dtype"]:
                raise CheckpointError(f"{path}: tensor {name!r}: {header[name]['dtype']} {header[name]['shape']}, "
                                      f"expected {e['dtype']} {shape} (rank {rank} of {world})")
    return index


def read_rows(directory: Path, index: Mapping[str, Any], name: str, rows: tuple[int, int] | None = None
              ) -> torch.Tensor:
    """Rows ``[start, stop)`` of stored tensor ``name`` (``None``: the whole tensor), read from the
    files that hold them and nothing else (an unreadable file is a ``CheckpointError`` naming it)."""
    try:
        return _read_rows(directory, index, name, rows)
    except (OSError, RuntimeError, TypeError, ValueError) as e:  # safetensors' own errors are RuntimeErrors
        raise CheckpointError(f"{directory}: tensor {name!r} unreadable ({type(e).__name__}: {e})") from e


def _read_rows(directory: Path, index: Mapping[str, Any], name: str, rows: tuple[int, int] | None) -> torch.Tensor:
    entry, world = index["tensors"][name], index["world_size"]
    if not entry["split"]:
        with safe_open(str(directory / shard_file(0, world)), "pt") as f:
            whole = f.get_tensor(name)
        return whole if rows is None else whole[rows[0]:rows[1]]
    n = entry["shape"][0]
    lo, hi = (0, n) if rows is None else rows
    pieces = []
    for rank in range(world):
        start, stop = rows_of(n, world, rank)
        a, b = max(lo, start), min(hi, stop)
        if a < b:
            with safe_open(str(directory / shard_file(rank, world)), "pt") as f:
                pieces.append(f.get_slice(name)[a - start:b - start])
    if not pieces:
        return torch.empty(0, *entry["shape"][1:], dtype=_DTYPES[entry["dtype"]])
    return torch.cat(pieces) if len(pieces) > 1 else pieces[0]


def gather_folder(directory: Path, out: Path, *, max_file_bytes: int = 2 << 30) -> list[Path]:
    """Write the full tensors of sharded folder ``directory`` into ``out`` as safetensors files of at
    most about ``max_file_bytes`` each (a larger tensor alone in its file; one file,
    ``model.safetensors``, when they fit; else
    ``model-0000i-of-0000n.safetensors`` and ``model.safetensors.index.json``, the layout
    ``from_pretrained`` reads), holding one output file's tensors in memory at a time."""
    index = read_index(directory)
    groups: list[list[str]] = [[]]
    size = 0
    for name, e in index["tensors"].items():
        nbytes = math.prod(e["shape"]) * _DTYPES[e["dtype"]].itemsize
        if groups[-1] and size + nbytes > max_file_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    out.mkdir(parents=True, exist_ok=True)
    names = ["model.safetensors"] if len(groups) == 1 else \
        [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    for file, group in zip(names, groups):
        save_file({name: read_rows(directory, index, name).contiguous() for name in group}, str(out / file),
                  metadata={"format": "pt"})
    if len(groups) > 1:
        total = sum(math.prod(e["shape"]) * _DTYPES[e["dtype"]].itemsize for e in index["tensors"].values())
        (out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": {n: f for f, g in zip(names, groups) for n in g}},
            indent=1))
    return [out / f for f in names]


def plain_folder(directory: Path, out: Path, *, max_file_bytes: int = 2 << 30) -> Path:
    """``out`` made a plain ``from_pretrained`` folder of sharded folder ``directory``: its full
    tensors (:func:`gather_folder`) and every other file it holds (the model's config, a tokenizer)."""
    gather_folder(directory, out, max_file_bytes=max_file_bytes)
    index = read_index(directory)
    shards = {INDEX} | {shard_file(r, index["world_size"]) for r in range(index["world_size"])}
    for f in sorted(directory.iterdir()):  # never weights beside the shards: the output holds the shards' only
        weights = f.suffix == ".safetensors" or f.name == "model.safetensors.index.json"
        if f.is_file() and not f.is_symlink() and f.name not in shards and not weights:
            shutil.copyfile(f, out / f.name)
    return out
