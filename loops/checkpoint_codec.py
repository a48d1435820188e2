"""How a checkpoint stores values without pickle, and reads them back trusting nothing: nested
values (dicts, lists, NamedTuples, dataclasses, tensors, generators) as a JSON tree plus a flat
safetensors file of their tensors (``write_pair`` / ``read_pair``). A stored type is only ever
one of rlcore's own NamedTuples or dataclasses from a module already loaded; nothing is imported
or executed on a checkpoint's word."""

from __future__ import annotations

import dataclasses
import json
import sys
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

__all__ = ["CheckpointError", "write_pair", "read_pair", "read_json", "load_tensors"]


class CheckpointError(RuntimeError):
    """A checkpoint is missing, truncated, corrupted, or does not fit the state it is loaded into."""


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


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable JSON ({type(e).__name__}: {e})") from e


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(path)
    except Exception as e:  # safetensors raises its own error types for bad headers and truncation
        raise CheckpointError(f"{path}: unreadable safetensors file, corrupted or truncated "
                              f"({type(e).__name__}: {e})") from e


def read_pair(directory: Path, stem: str, like: Any = None) -> Any:
    tree = read_json(directory / f"{stem}.json")
    return _unflatten(tree, load_tensors(directory / f"{stem}.safetensors"), like, stem)
