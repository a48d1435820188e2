"""How a checkpoint stores values without pickle, and reads them back trusting nothing: nested
values (dicts, lists, NamedTuples, dataclasses, tensors, generators) as a JSON tree plus a flat
safetensors file of their tensors (``write_pair`` / ``read_pair``). A stored type is only ever
one of rlcore's own NamedTuples or dataclasses from a module already loaded; nothing is imported
or executed on a checkpoint's word.

Every JSON file of a checkpoint or run folder is read by :func:`read_json`, bounded in size
(``MAX_JSON_BYTES``) and nesting (``MAX_JSON_DEPTH``) before it is parsed; every safetensors file
by :func:`load_tensors`, whose header (8-byte little-endian length, then JSON) is checked by
:func:`check_safetensors` before a byte of tensor memory is allocated. Their errors name the file
(and the tensor)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import re
import sys
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

__all__ = ["CheckpointError", "CheckpointMismatch", "write_pair", "read_pair", "read_json", "parse_json", "check_safetensors",
           "load_tensors", "MAX_JSON_BYTES", "MAX_JSON_DEPTH", "json_depth"]

MAX_JSON_BYTES = 64 << 20  # a checkpoint's JSON files: config, state, RNGs, optimiser (no tensors), manifest
MAX_JSON_DEPTH = 64        # nesting of arrays and objects; rlcore writes at most about 10
MAX_HEADER_BYTES = 100 << 20  # a safetensors header (safetensors' own limit)


class CheckpointError(RuntimeError):
    """A checkpoint is missing, truncated, corrupted, or does not fit the state it is loaded into."""


class CheckpointMismatch(CheckpointError, ValueError):
    """A checkpoint's weights do not fit the model its own configuration describes (missing, extra or
    differently shaped keys, more layers than it holds); a ``ValueError`` too, as every other check
    of a model folder raises."""


def _flatten(obj: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, torch.Tensor):
        tensors[path] = obj.detach().to("cpu", copy=True).contiguous()  # a copy: no shared storage
        return {"__tensor__": path, "device": str(obj.device)}
    if isinstance(obj, torch.Generator):
        return {"__generator__": str(obj.device), "state": _flatten(obj.get_state(), path, tensors)}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        cls = type(obj)
        return {"__namedtuple__": f"{cls.__module__}:{cls.__qualname__}",
                "fields": {f: _flatten(v, f"{path}.{f}", tensors) for f, v in zip(obj._fields, obj)}}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {"__dataclass__": f"{type(obj).__module__}:{type(obj).__qualname__}",
                "fields": {f.name: _flatten(getattr(obj, f.name), f"{path}.{f.name}", tensors)
                           for f in dataclasses.fields(obj)}}
    if isinstance(obj, (tuple, list)):
        items = [_flatten(v, f"{path}.{i}", tensors) for i, v in enumerate(obj)]
        return {"__tuple__": items} if isinstance(obj, tuple) else items
    if isinstance(obj, Mapping):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: _flatten(v, f"{path}.{k}", tensors) for k, v in obj.items()}
        return {"__items__": [[_flatten(k, f"{path}.k{i}", tensors), _flatten(v, f"{path}.{k}", tensors)]
                              for i, (k, v) in enumerate(obj.items())]}
    raise TypeError(f"checkpoint: cannot store {path or 'value'} of type {type(obj).__name__} "
                    f"(tensors, numbers, strings, lists, dicts, NamedTuples and dataclasses only)")


def _stored_type(name: str, where: str) -> type:
    """The class a checkpoint names for a value with no template: one of rlcore's own NamedTuples or
    dataclasses, in a module already loaded. Nothing is imported or executed on a checkpoint's word;
    for any other type, load with a template value (``state_template``)."""
    module_name, _, qualname = name.partition(":")
    module = sys.modules.get(module_name) if module_name.split(".")[0] == "rlcore" else None
    obj: Any = module
    for part in qualname.split(".") if module is not None else ():
        obj = vars(obj).get(part) if isinstance(obj, (types.ModuleType, type)) else None
    if module is None or not isinstance(obj, type):
        raise CheckpointError(f"{where}: the stored type {name!r} is not one of rlcore's loaded types; a checkpoint "
                              "never makes the loader import anything (give a template value for other types)")
    return obj


def _unflatten(tree: Any, tensors: Mapping[str, torch.Tensor], like: Any = None, where: str = "") -> Any:
    if isinstance(tree, list):
        return [_unflatten(v, tensors, None, f"{where}[{i}]") for i, v in enumerate(tree)]
    if not isinstance(tree, dict):
        return tree
    if "__tensor__" in tree:
        device = like.device if isinstance(like, torch.Tensor) else torch.device(tree["device"])
        if device.type == "cuda" and not torch.cuda.is_available():
            device = torch.device("cpu")
        return tensors[tree["__tensor__"]].to(device)
    if "__generator__" in tree:
        device = like.device if isinstance(like, torch.Generator) else tree["__generator__"]
        g = torch.Generator(device=device)
        g.set_state(_unflatten(tree["state"], tensors, None, where).cpu())
        return g
    if "__namedtuple__" in tree or "__dataclass__" in tree:
        is_nt = "__namedtuple__" in tree
        name = tree.get("__namedtuple__") or tree["__dataclass__"]
        cls = type(like) if like is not None else _stored_type(name, where)
        if (is_nt and not (issubclass(cls, tuple) and hasattr(cls, "_fields"))) or \
                (not is_nt and not dataclasses.is_dataclass(cls)):
            raise CheckpointError(f"{where}: stored type does not match {cls.__name__}")
        fields = {k: _unflatten(v, tensors, getattr(like, k, None), f"{where}.{k}") for k, v in tree["fields"].items()}
        return cls(**fields)
    if "__tuple__" in tree:
        return tuple(_unflatten(v, tensors, None, f"{where}[{i}]") for i, v in enumerate(tree["__tuple__"]))
    if "__items__" in tree:
        return {_unflatten(k, tensors): _unflatten(v, tensors, None, where) for k, v in tree["__items__"]}
    like = like if isinstance(like, Mapping) else {}
    return {k: _unflatten(v, tensors, like.get(k), f"{where}[{k!r}]") for k, v in tree.items()}


def write_pair(directory: Path, stem: str, obj: Any) -> None:
    tensors: dict[str, torch.Tensor] = {}
    tree = _flatten(obj, stem, tensors)
    save_file(tensors, directory / f"{stem}.safetensors")
    (directory / f"{stem}.json").write_text(json.dumps(tree))


_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_DEPTH_STEP = bytes.maketrans(b"[{]}", b"\x01\x01\x02\x02")


def json_depth(data: bytes, start: int = 0) -> int:
    """The deepest nesting of arrays and objects in JSON text (``start`` levels deep at its first
    byte, for a document read line by line), counted without parsing it (strings skipped), so a
    deep document is refused before the parser recurses."""
    marks = _STRING.sub(b"", data).translate(_DEPTH_STEP, delete=bytes(c for c in range(256) if c not in b"[{]}"))
    steps = (1 if b == 1 else -1 for b in marks)
    return max(itertools.accumulate(steps, initial=start))


def parse_json(data: bytes, where: str, *, expect: type | None = None, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``data`` (UTF-8 JSON) parsed with its nesting bounded by ``max_depth``; ``expect`` (``dict`` or
    ``list``) the type the top level must have. Errors are ``CheckpointError`` naming ``where``."""
    depth = json_depth(data)
    if depth > max_depth:
        raise CheckpointError(f"{where}: JSON nested {depth} deep, more than the {max_depth} levels allowed")
    try:
        value = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise CheckpointError(f"{where}: unreadable JSON ({type(e).__name__}: {e})") from e
    if expect is not None and not isinstance(value, expect):
        raise CheckpointError(f"{where}: expected a JSON {'object' if expect is dict else expect.__name__} at the "
                              f"top level, got {type(value).__name__}")
    return value


def read_json(path: str | Path, *, expect: type | None = None, max_bytes: int = MAX_JSON_BYTES) -> Any:
    """A JSON file of a checkpoint or run folder, read as data: at most ``max_bytes`` bytes, nested at
    most ``MAX_JSON_DEPTH`` deep, its top level of type ``expect`` when given.

    Raises:
        CheckpointError: naming the file: unreadable, too big, too deep, malformed, or of another
            top-level type.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as e:
        raise CheckpointError(f"{path}: unreadable JSON ({type(e).__name__}: {e})") from e
    if len(data) > max_bytes:
        raise CheckpointError(f"{path}: a JSON file over {max_bytes} bytes; refused")
    return parse_json(data, str(path), expect=expect)


# safetensors dtype name -> bytes per element
_ITEM_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I16": 2, "U16": 2, "F16": 2,
               "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8, "C64": 8}


def _tensor_span(name: str, entry: Any, where: str) -> tuple[int, int]:
    """``(begin, end)`` of one header entry after checking its dtype, shape and byte count."""
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise CheckpointError(f"{where}: tensor {name!r}: expected {{dtype, shape, data_offsets}}, got {entry!r:.200}")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    ints = lambda v, n=None: isinstance(v, list) and (n is None or len(v) == n) and all(  # noqa: E731
        isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v)
    if dtype not in _ITEM_BYTES:
        raise CheckpointError(f"{where}: tensor {name!r}: unknown dtype {dtype!r}; expected one of {sorted(_ITEM_BYTES)}")
    if not ints(shape):
        raise CheckpointError(f"{where}: tensor {name!r}: shape must be a list of ints >= 0, got {shape!r:.200}")
    if not ints(offsets, 2) or offsets[0] > offsets[1]:
        raise CheckpointError(f"{where}: tensor {name!r}: data_offsets must be [begin, end] with 0 <= begin <= end, "
                              f"got {offsets!r:.200}")
    need = math.prod(shape) * _ITEM_BYTES[dtype]
    if need != offsets[1] - offsets[0]:
        raise CheckpointError(f"{where}: tensor {name!r}: shape {shape} of {dtype} needs {need} bytes, its "
                              f"data_offsets {offsets} hold {offsets[1] - offsets[0]}")
    return offsets[0], offsets[1]


def check_safetensors(path: str | Path) -> dict[str, Any]:
    """The header of safetensors file ``path`` after checking it against the file, before any tensor
    is read: the 8-byte little-endian header length fits the file; the header is a JSON object
    (bounded as :func:`read_json`) of ``{dtype, shape, data_offsets}`` entries (plus an optional
    ``__metadata__`` of strings); each shape's byte count equals its span; the spans tile the data
    section exactly, without gap, overlap or overrun.

    Raises:
        CheckpointError: naming the file and the tensor at fault.
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            length = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
            if not 0 < length <= min(size - 8, MAX_HEADER_BYTES):
                raise CheckpointError(f"{path}: safetensors header length {length} does not fit a file of {size} "
                                      f"bytes (at most {MAX_HEADER_BYTES})")
            header = parse_json(f.read(length), f"{path} (safetensors header)", expect=dict, max_depth=4)
    except OSError as e:
        raise CheckpointError(f"{path}: unreadable safetensors file ({type(e).__name__}: {e})") from e
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise CheckpointError(f"{path}: __metadata__ must map names to strings")
    spans = sorted((_tensor_span(name, entry, str(path)), name) for name, entry in header.items())
    end = 0
    for (begin, stop), name in spans:
        if begin != end:
            raise CheckpointError(f"{path}: tensor {name!r}: data_offsets [{begin}, {stop}] "
                                  f"{'overlap' if begin < end else 'leave a gap after'} the previous tensor's "
                                  f"(ending at {end})")
        end = stop
    if end != size - 8 - length:
        raise CheckpointError(f"{path}: the tensors' data ends at byte {end} of a data section of "
                              f"{size - 8 - length} bytes{f' (tensor {spans[-1][1]!r})' if spans else ''}")
    return header


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of safetensors file ``path`` (on the CPU), its header checked first
    (:func:`check_safetensors`)."""
    check_safetensors(path)
    try:
        return load_file(path)
    except Exception as e:  # safetensors raises its own error types for bad headers and truncation
        raise CheckpointError(f"{path}: unreadable safetensors file, corrupted or truncated "
                              f"({type(e).__name__}: {e})") from e


def read_pair(directory: Path, stem: str, like: Any = None) -> Any:
    """The value ``write_pair`` stored as ``stem.json`` + ``stem.safetensors`` (``like``: a template)."""
    tree = read_json(directory / f"{stem}.json", expect=dict)  # write_pair stores mappings only
    tensors = load_tensors(directory / f"{stem}.safetensors")
    return _unflatten(tree, _Named(tensors, directory / f"{stem}.safetensors"), like, stem)


class _Named(dict):
    """The tensors of one safetensors file; a name the JSON tree refers to but the file lacks is an
    error naming both."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], path: Path):
        super().__init__(tensors)
        self.path = path

    def __missing__(self, name: str) -> torch.Tensor:
        raise CheckpointError(f"{self.path}: no tensor {name!r}, which {self.path.with_suffix('.json').name} "
                              f"refers to (it holds {sorted(self)[:8]})")
