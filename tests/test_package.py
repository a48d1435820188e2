"""The distribution installs as one namespace: rlcore, rlcore.algorithms, rlcore.loops."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_installed_package_imports_from_outside_the_repo(tmp_path):
    code = ("import rlcore, rlcore.algorithms, rlcore.loops, rlcore.keys; "
            "print(rlcore.__file__, rlcore.algorithms.__file__, rlcore.loops.__file__)")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                         check=True).stdout.split()
    assert out[0].endswith("rlcore/__init__.py")
    assert out[1].endswith("algorithms/__init__.py") and out[2].endswith("loops/__init__.py")


@pytest.mark.slow
def test_regular_install_maps_the_three_folders(tmp_path):
    """Build a wheel and install it (no deps) into a fresh target; import it from there."""
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path / "dist"), str(ROOT)], check=True, capture_output=True)
    wheel = next((tmp_path / "dist").glob("rlcore-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    for module in ("rlcore/__init__.py", "rlcore/algorithms/__init__.py", "rlcore/loops/__init__.py"):
        assert module in names, f"{module} missing from {wheel.name}"
    assert not any(n.startswith(("algorithms/", "loops/")) for n in names)
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target),
                    str(wheel)], check=True, capture_output=True)
    code = ("import sys; sys.path.insert(0, sys.argv[1]); "
            "[sys.meta_path.remove(f) for f in list(sys.meta_path) if 'editable' in type(f).__module__]; "
            "import rlcore.algorithms, rlcore.loops; print(rlcore.algorithms.__file__)")
    out = subprocess.run([sys.executable, "-c", code, str(target)], cwd=tmp_path, capture_output=True,
                         text=True, check=True).stdout
    assert out.strip().startswith(str(target))


@pytest.mark.parametrize("package", ["rlcore", "rlcore.algorithms", "rlcore.loops"])
def test_flat_namespace_exports_each_name_once(package):
    import collections
    import importlib

    mod = importlib.import_module(package)
    counts = collections.Counter(mod.__all__)
    assert not [name for name, n in counts.items() if n > 1]
    missing = [name for name in mod.__all__ if not hasattr(mod, name)]
    assert not missing, f"{package}.__all__ names missing attributes: {missing}"


def test_dependencies_point_one_way():
    """rlcore/ never imports algorithms or loops; algorithms/ never imports loops."""
    import re

    rules = {"rlcore": r"^\s*(from|import)\s+(rlcore\.(algorithms|loops)|algorithms|loops)\b",
             "algorithms": r"^\s*(from|import)\s+(rlcore\.loops|loops)\b"}
    for folder, pattern in rules.items():
        for path in (ROOT / folder).rglob("*.py"):
            bad = [line for line in path.read_text().splitlines() if re.match(pattern, line)]
            assert not bad, f"{path.relative_to(ROOT)} imports against the layering: {bad}"
