"""The compiled CPU kernels wherever rlcore is installed (rlcore/_kernels.py, rlcore/_kernel_build.py).

Each test imports rlcore in a fresh process with the per-user cache pointed at ``tmp_path``
(``RLCORE_KERNEL_CACHE``), the package's own builds skipped (``RLCORE_KERNEL_PACKAGED=0``) and,
to keep the compile short, only the ``default`` build asked for (``RLCORE_KERNEL_BUILD``). A
compile takes about 25 s of compiler time; the tests here compile twice in all (both marked slow).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_PROBE = """
import torch, rlcore._kernels as k
from rlcore.logprobs import token_logprobs
x, y = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)), torch.tensor([0, 7, 49])
ours = token_logprobs(x, y)
k.ops = None
torch.testing.assert_close(ours, token_logprobs(x, y), rtol=1e-5, atol=1e-5)
print(k.source, k.variant, k.path)
"""


def _env(cache: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLCORE_")}
    return {**env, "RLCORE_KERNEL_CACHE": str(cache), "RLCORE_KERNEL_PACKAGED": "0",
            "RLCORE_KERNEL_BUILD": "default", **extra}


def _probe(env: dict[str, str], python: str = sys.executable, cwd: Path | None = None) -> subprocess.Popen:
    return subprocess.Popen([python, "-c", _PROBE], env=env, cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen) -> tuple[list[str], str]:
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err
    return out.split(), err


@pytest.mark.slow
def test_first_use_compiles_once_for_concurrent_processes(tmp_path):
    """Two processes start at once on an empty cache: one compiles, the other waits and loads its
    build; a third loads it from the cache with nothing on stderr about kernels."""
    env = _env(tmp_path)
    runs = [_finish(p) for p in [_probe(env), _probe(env)]]
    assert sorted(out[0] for out, _ in runs) == ["built", "cache"]
    assert all(out[1] == "default" and out[2].startswith(str(tmp_path)) for out, _ in runs)
    assert sum(err.count("rlcore: compiling the default CPU kernels") for _, err in runs) == 1
    out, err = _finish(_probe(env))
    assert out[0] == "cache" and "rlcore:" not in err


def test_without_a_compiler_the_pure_path_with_one_warning(tmp_path):
    env = _env(tmp_path, CC="/bin/false", CXX="/bin/false")
    out, err = _finish(_probe(env))
    assert out[:2] == ["None", "None"]
    assert err.count("RuntimeWarning: rlcore: no working C++ compiler") == 1, err
    out, err = _finish(_probe({**env, "RLCORE_PURE_TORCH": "1"}))
    assert out[:2] == ["None", "None"] and "rlcore" not in err


def test_a_failed_compile_warns_and_is_not_retried(tmp_path):
    """The compile fails (a flag the compiler rejects): a warning naming the log, the pure path; the
    next process reads the recorded failure instead of compiling again."""
    env = _env(tmp_path, CFLAGS="-fno-such-flag-anywhere", CXXFLAGS="-fno-such-flag-anywhere")
    out, err = _finish(_probe(env))
    assert out[:2] == ["None", "None"] and "compiling the default kernels failed" in err, err
    assert len(list(tmp_path.glob("*/failed.log"))) == 1
    out, err = _finish(_probe(env))
    assert out[:2] == ["None", "None"] and "failed earlier" in err and "CPU kernels for torch" not in err


def test_the_report_names_the_active_path(tmp_path):
    code = [sys.executable, "-m", "rlcore.kernels"]
    forced = subprocess.run(code, env=_env(tmp_path, RLCORE_PURE_TORCH="1"), capture_output=True, text=True,
                            check=True).stdout
    assert "pure PyTorch: forced by RLCORE_PURE_TORCH" in forced and "intra-op threads" in forced
    packaged = subprocess.run(code, capture_output=True, text=True, check=True).stdout
    assert packaged.startswith("rlcore.logprobs: ") and "CPU: " in packaged


def _copy_project(dst: Path) -> Path:
    """The files a build of the distribution reads, without any compiled module."""
    for folder in ("rlcore", "algorithms", "loops"):
        shutil.copytree(ROOT / folder, dst / folder, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    for name in ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md"):
        shutil.copy2(ROOT / name, dst / name)
    return dst


def _venv(where: Path) -> str:
    """A fresh venv that sees this environment's packages (torch and the rest) after its own."""
    subprocess.run([sys.executable, "-m", "venv", str(where)], check=True, capture_output=True)
    python = str(where / "bin" / "python")
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    Path(purelib, "outer.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


def _pip(python: str, *args: str) -> None:
    out = subprocess.run([python, "-m", "pip", "--disable-pip-version-check", "-q", *args],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="venv layout and compiler of Linux")
def test_build_isolated_installs_end_on_the_compiled_kernels(tmp_path):
    """``pip install -e .`` with build isolation (torch not importable while building, so nothing is
    compiled at install) in a fresh venv: the first import compiles the kernels into the cache.
    Then the wheel, built the same way: it ships the sources, whose hash finds the same build."""
    project, cache = _copy_project(tmp_path / "project"), tmp_path / "cache"
    python = _venv(tmp_path / "venv")
    _pip(python, "install", "--no-deps", "-e", str(project))
    assert not list((project / "rlcore").glob("*.so"))
    env = {**_env(cache), "RLCORE_KERNEL_PACKAGED": ""}
    out, err = _finish(_probe(env, python, cwd=tmp_path))
    assert out[:2] == ["built", "default"] and "rlcore: compiling" in err

    _pip(python, "wheel", "--no-deps", "-w", str(tmp_path / "dist"), str(project))
    wheel = next((tmp_path / "dist").glob("rlcore-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"rlcore/csrc/logprobs.h", "rlcore/csrc/logprobs_default.cpp", "rlcore/_kernel_build.py"} <= names
    assert not any(n.endswith(".so") for n in names)
    _pip(python, "install", "--no-deps", "--force-reinstall", str(wheel))
    out, err = _finish(_probe(env, python, cwd=tmp_path))
    assert out[:2] == ["cache", "default"] and subprocess.run(
        [python, "-c", "import rlcore; print(rlcore.__file__)"], env=env, cwd=tmp_path, capture_output=True,
        text=True, check=True).stdout.startswith(str(tmp_path / "venv"))
