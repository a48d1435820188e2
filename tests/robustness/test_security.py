"""No code execution from data: the package source never unpickles, never evals, never trusts remote code.

The scan parses every module of ``rlcore/``, ``algorithms/`` and ``loops/`` (the ``ast``, so that a
method called ``.eval()`` or a word in a docstring is not mistaken for the builtin) and flags:

- ``pickle`` / ``cPickle`` / ``dill`` / ``cloudpickle`` / ``joblib`` / ``shelve`` / ``marshal`` imports
  and ``pickle.load(s)`` / ``Unpickler`` calls;
- ``torch.load`` without ``weights_only=True``; ``numpy.load`` with ``allow_pickle=True``;
- ``yaml.load`` without ``Loader=SafeLoader`` (or ``CSafeLoader``), ``yaml.unsafe_load``,
  ``yaml.full_load`` and their ``_all`` forms;
- ``trust_remote_code=True`` in a call, and a parameter or dataclass field named
  ``trust_remote_code`` whose default is not ``False``;
- the builtins ``eval`` / ``exec`` / ``compile`` / ``__import__``, ``os.system``, ``shell=True``.

Then every public callable of the three packages is inspected: wherever a signature has a
``trust_remote_code`` parameter its default is ``False``, and the known loaders have one.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
from pathlib import Path

import pytest

import rlcore
import rlcore.algorithms
import rlcore.loops

PACKAGES = (rlcore, rlcore.algorithms, rlcore.loops)
PICKLE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "shelve", "marshal"}
UNSAFE_YAML = {"unsafe_load", "unsafe_load_all", "full_load", "full_load_all"}
SAFE_LOADERS = {"SafeLoader", "CSafeLoader", "BaseLoader"}
BUILTINS = {"eval", "exec", "compile", "__import__"}


def _name(node: ast.AST) -> str:
    """Dotted name of ``a.b.c`` (``""`` for anything else)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _name(node.value)
        return f"{base}.{node.attr}" if base else ""
    return ""


def _kw(call: ast.Call, name: str) -> ast.AST | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is_true(node: ast.AST | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def _is_false(node: ast.AST | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is False


def _field_default(value: ast.expr | None) -> ast.expr | None:
    """The default of a config field's value: ``x`` of ``setting(x, help=...)`` (``loops.settings``) or
    of ``setting(default=x, ...)``, else the value itself."""
    if isinstance(value, ast.Call) and _name(value.func).rsplit(".", 1)[-1] == "setting":
        return value.args[0] if value.args else _kw(value, "default")
    return value


def scan(source: str, filename: str = "<source>") -> list[str]:
    """The unsafe constructs of one module's source, as ``file:line: what`` strings."""
    found = []
    tree = ast.parse(source, filename)
    for node in ast.walk(tree):
        where = f"{filename}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            found += [f"{where}: import {a.name}" for a in node.names if a.name.split(".")[0] in PICKLE_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in PICKLE_MODULES:
            found.append(f"{where}: from {node.module} import ...")
        elif isinstance(node, ast.Call):
            name = _name(node.func)
            last = name.rsplit(".", 1)[-1]
            if name.split(".")[0] in PICKLE_MODULES and last in {"load", "loads", "Unpickler"}:
                found.append(f"{where}: {name}(...)")
            if name == "torch.load" and not _is_true(_kw(node, "weights_only")):
                found.append(f"{where}: torch.load without weights_only=True")
            if name in {"np.load", "numpy.load"} and _is_true(_kw(node, "allow_pickle")):
                found.append(f"{where}: {name}(allow_pickle=True)")
            if name.startswith("yaml."):
                loader = _name(_kw(node, "Loader") or ast.Constant(None))
                if last in UNSAFE_YAML or (last in {"load", "load_all"} and loader.rsplit(".", 1)[-1]
                                           not in SAFE_LOADERS):
                    found.append(f"{where}: {name} without a safe loader")
            if isinstance(node.func, ast.Name) and node.func.id in BUILTINS:
                found.append(f"{where}: {node.func.id}(...)")
            if name in {"os.system", "os.popen"}:
                found.append(f"{where}: {name}(...)")
            if _is_true(_kw(node, "shell")):
                found.append(f"{where}: shell=True")
            if _is_true(_kw(node, "trust_remote_code")):
                found.append(f"{where}: trust_remote_code=True")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            positional = args.posonlyargs + args.args
            pairs = list(zip(positional[len(positional) - len(args.defaults):], args.defaults))
            pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None]
            pairs += [(a, None) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is None]
            for arg, default in pairs:
                if arg.arg == "trust_remote_code" and not _is_false(default):
                    found.append(f"{where}: {node.name}(trust_remote_code=...) does not default to False")
        elif isinstance(node, ast.AnnAssign) and _name(node.target) == "trust_remote_code":
            if not _is_false(_field_default(node.value)):
                found.append(f"{where}: field trust_remote_code does not default to False")
        elif isinstance(node, ast.ClassDef):  # class C(Section, defaults={"trust_remote_code": ...})
            defaults = _kw(node, "defaults")
            if isinstance(defaults, ast.Dict):
                for key, value in zip(defaults.keys, defaults.values):
                    if isinstance(key, ast.Constant) and key.value == "trust_remote_code" and not _is_false(value):
                        found.append(f"{where}: {node.name} defaults trust_remote_code to something other than False")
    return found


def _sources() -> list[Path]:
    return sorted(f for p in PACKAGES for f in Path(p.__file__).parent.glob("*.py"))


def test_the_scan_covers_the_three_packages():
    folders = {f.parent.name for f in _sources()}
    assert {"rlcore", "algorithms", "loops"} <= folders
    assert len(_sources()) >= 25


@pytest.mark.parametrize("path", _sources(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_package_source_has_no_unsafe_deserialisation_or_eval(path):
    assert scan(path.read_text(), str(path)) == []


def test_the_scan_flags_every_pattern():
    """The scanner can fail: each unsafe construct below is found, each safe one is not."""
    bad = '''
import pickle
from dill import loads
import yaml, torch, numpy as np, os, subprocess
pickle.loads(b"")
torch.load("x.pt")
torch.load("x.pt", weights_only=False)
np.load("x.npy", allow_pickle=True)
yaml.load(text)
yaml.load(text, Loader=yaml.Loader)
yaml.unsafe_load(text)
yaml.full_load(text)
eval("1")
exec("x = 1")
os.system("ls")
subprocess.run("ls", shell=True)
AutoModel.from_pretrained("m", trust_remote_code=True)
def load(name, *, trust_remote_code=True): ...
def load2(name, trust_remote_code=None): ...
def load3(name, *, trust_remote_code): ...
@dataclass
class Config:
    trust_remote_code: bool = True
@dataclass
class Section:
    trust_remote_code: bool = setting(True, help="runs code")
class Recipe(Section, defaults={"trust_remote_code": True}):
    pass
'''
    found = scan(bad)
    assert len(found) == 21, "\n".join(found)
    safe = '''
import yaml, torch
torch.load("x.pt", weights_only=True)
yaml.safe_load(text)
yaml.load(text, Loader=yaml.SafeLoader)
model.eval()
AutoModel.from_pretrained("m", trust_remote_code=trust_remote_code)
def load(name, *, trust_remote_code: bool = False): ...
"""eval( exec( pickle.load( in a docstring are fine"""
class Config:
    trust_remote_code: bool = False
class Section:
    trust_remote_code: bool = setting(False, help="runs code shipped with a model")
class Recipe(Section, defaults={"seed": 1}):
    pass
'''
    assert scan(safe) == []


def _public_objects():
    for package in PACKAGES:
        folder = Path(package.__file__).parent
        for f in sorted(folder.glob("*.py")):
            if f.stem == "__init__":
                continue
            module = importlib.import_module(f"{package.__name__}.{f.stem}")
            for name in getattr(module, "__all__", []):
                yield f"{module.__name__}.{name}", getattr(module, name)


def test_every_public_loader_defaults_trust_remote_code_to_false():
    seen = []
    for name, obj in _public_objects():
        if dataclasses.is_dataclass(obj) and isinstance(obj, type):
            for field in dataclasses.fields(obj):
                if field.name == "trust_remote_code":
                    seen.append(name)
                    assert field.default is False, f"{name}.trust_remote_code defaults to {field.default!r}"
        if not callable(obj):
            continue
        try:
            signature = inspect.signature(obj)
        except (TypeError, ValueError):  # builtins, some classes
            continue
        param = signature.parameters.get("trust_remote_code")
        if param is not None:
            seen.append(name)
            assert param.default is False, f"{name}: trust_remote_code defaults to {param.default!r}"
    # the check is not vacuous: the hub loaders take the flag
    assert {"rlcore.loops.models.load_model", "rlcore.loops.models.load_tokenizer"} <= set(seen), seen
