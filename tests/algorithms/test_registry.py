"""``REGISTRIES`` lists every registry of rlcore and rlcore.algorithms, each under its own name."""

import importlib
import pkgutil

import pytest

import rlcore
import rlcore.algorithms
from rlcore import lookup
from rlcore.algorithms import REGISTRIES


def _is_registry(name: str, value: object) -> bool:
    """A public module-level dict from names to functions (or to tuples of them, as ``(init, update)`` pairs)."""
    if name.startswith("_") or not name.isupper() or not isinstance(value, dict) or not value:
        return False
    entries = [v if isinstance(v, tuple) else (v,) for v in value.values()]
    return all(isinstance(k, str) for k in value) and all(e and all(map(callable, e)) for e in entries)


def _registries() -> dict[str, dict]:
    """Every registry defined in a public module of rlcore or rlcore.algorithms, by ``module.NAME``
    (one name per dict: a registry imported into another module is the same object)."""
    found: dict[int, tuple[str, dict]] = {}
    for package in (rlcore, rlcore.algorithms):
        for info in pkgutil.walk_packages(package.__path__, f"{package.__name__}."):
            if info.name.rpartition(".")[2].startswith("_"):
                continue
            module = importlib.import_module(info.name)
            for name, value in vars(module).items():
                if _is_registry(name, value):
                    found.setdefault(id(value), (f"{info.name}.{name}", value))
    return dict(found.values())


def test_every_registry_is_listed():
    listed = {id(r) for r in REGISTRIES.values()}
    missing = sorted(name for name, r in _registries().items() if id(r) not in listed)
    assert not missing, f"registries missing from rlcore.algorithms.registry.REGISTRIES: {missing}"
    assert len(REGISTRIES) == len(_registries())


@pytest.mark.parametrize("name", sorted(REGISTRIES))
def test_each_is_listed_under_its_own_name(name):
    homes = [q for q, r in _registries().items() if r is REGISTRIES[name]]
    assert [q.rpartition(".")[2] for q in homes] == [name]


def test_lookup_reads_the_table():
    assert lookup(REGISTRIES, "POLICY_LOSSES", what="registry") is rlcore.algorithms.POLICY_LOSSES
    with pytest.raises(ValueError, match=r"registry: unknown 'LOSSES'; valid: \['ADVANTAGE_ESTIMATORS', "):
        lookup(REGISTRIES, "LOSSES", what="registry")
