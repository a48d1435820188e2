"""The fuzz table covers every public name of rlcore and rlcore.algorithms, and nothing stale.

A new public function (a name added to a module's ``__all__``) fails this test until it gets a fuzz
entry in ``entries_rlcore.py`` / ``entries_algorithms.py`` or an exemption with a reason.
"""

import importlib
from pathlib import Path

import pytest

import rlcore
import rlcore.algorithms
from tests.robustness.fuzz import Alias
from tests.robustness.table import EXEMPT, EXEMPT_MODULES, FUZZ


def _modules() -> list[str]:
    found = []
    for package in (rlcore, rlcore.algorithms):
        folder = Path(package.__file__).parent
        found += [f"{package.__name__}.{f.stem}" for f in sorted(folder.glob("*.py")) if f.stem != "__init__"]
    return found


MODULES = _modules()


def test_the_package_layout_is_the_expected_one():
    assert {"rlcore.masked", "rlcore.kl", "rlcore.algorithms.dpo", "rlcore.algorithms.ppo"} <= set(MODULES)


@pytest.mark.parametrize("module", MODULES)
def test_every_public_name_is_fuzzed_or_exempt(module):
    mod = importlib.import_module(module)  # a module that fails to import fails here
    names = getattr(mod, "__all__", None)
    assert names is not None, f"{module}: no __all__ (the flat namespace needs one)"
    if module in EXEMPT_MODULES:
        assert EXEMPT_MODULES[module].strip()
        if module == "rlcore.keys":
            assert all(isinstance(getattr(mod, n), str) for n in names), "rlcore.keys holds only strings"
        return
    missing = [f"{module}.{n}" for n in names if f"{module}.{n}" not in FUZZ and f"{module}.{n}" not in EXEMPT]
    assert not missing, f"public names with neither a fuzz entry nor an exemption: {missing}"


def test_no_stale_entries_and_aliases_point_at_covered_objects():
    public = {}
    for module in MODULES:
        mod = importlib.import_module(module)
        public |= {f"{module}.{n}": getattr(mod, n) for n in getattr(mod, "__all__", [])}
    stale = sorted(k for k in list(FUZZ) + list(EXEMPT) if k not in public)
    assert not stale, f"fuzz/exempt entries for names that are no longer public: {stale}"
    assert not set(FUZZ) & set(EXEMPT)
    for name, entry in FUZZ.items():
        if isinstance(entry, Alias):
            assert public[name] is public[entry.target], f"{name} is not the object {entry.target}"
            assert not isinstance(FUZZ[entry.target], Alias)
    assert all(reason.strip() for reason in EXEMPT.values())
