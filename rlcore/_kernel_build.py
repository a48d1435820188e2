"""How the compiled CPU kernels (rlcore/csrc) are built: at install time and on first use.

One source, ``csrc/logprobs.h``, is compiled once per instruction set: ``default`` (the compiler's
baseline for the platform), and on x86-64 also ``avx2``, ``avx512`` (the flags and
``CPU_CAPABILITY`` macros of torch's own per-capability kernels) and ``avx512bf16``. Each build is
a plain shared library that registers the operators ``torch.ops.rlcore.*`` when loaded
(``torch.ops.load_library``); its file name carries the torch version it was compiled against.

``setup.py`` compiles every build into the package where torch is importable at build time
(``make setup``, ``pip install --no-build-isolation``). Where the installed package holds no build
for this CPU and this torch (a build-isolated ``pip install``, a wheel built elsewhere),
``rlcore._kernels`` compiles the best build the CPU runs on first use, into a per-user cache:
``$RLCORE_KERNEL_CACHE``, else ``$XDG_CACHE_HOME/rlcore/kernels``, else ``~/.cache/rlcore/kernels``,
one folder per build keyed by the torch version, the Python ABI, the flags and a hash of the
sources, under a file lock so that concurrent processes compile once. The compile runs in a
child process (torch's ``BuildExtension`` through setuptools, no ninja needed) whose output goes to
a log file beside the build.

This module imports only the standard library at the top: ``setup.py`` loads it by path before
torch may be importable.
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Callable
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path
from typing import Any

__all__ = ["VARIANTS", "OPENMP", "FLAGS", "CSRC", "BuildFailed", "module_name", "extension",
           "build_ext_class", "cache_root", "cache_dir", "find_module", "compiler_missing", "build_cached", "main"]

CSRC = Path(__file__).resolve().parent / "csrc"
_X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")
_AVX2 = ["-mavx2", "-mfma", "-mf16c"]
_AVX512 = [*_AVX2, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]
VARIANTS: dict[str, list[str]] = {
    "default": ["-DCPU_CAPABILITY=DEFAULT", "-DCPU_CAPABILITY_DEFAULT"],
    **({"avx2": [*_AVX2, "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"],
        "avx512": [*_AVX512, "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"],
        # the same with the bfloat16 conversion instructions (Cooper Lake, Sapphire Rapids, Zen 4)
        "avx512bf16": [*_AVX512, "-mavx512bf16", "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"]}
       if _X86 else {}),
}
# at::parallel_for is inline and runs its rows on OpenMP threads only where the kernels themselves
# are compiled with OpenMP; without the flag it runs every row on the calling thread. Linux torch
# wheels ship libgomp.so.1, which the kernels' libgomp.so.1 resolves to at load: one thread pool.
OPENMP = ["-fopenmp"] if sys.platform.startswith("linux") else []
FLAGS = ["-O3", "-fvisibility=hidden", "-fno-math-errno"]
_BUILD_TIMEOUT_S = 1800


class BuildFailed(RuntimeError):
    """A first-use compile failed; the message ends with the tail of the compiler's output."""


def module_name(build: str, torch_version: str) -> str:
    """The file name (less its suffix) of ``build`` compiled against torch ``torch_version``."""
    return f"_logprobs_{build}_torch{re.sub(r'[^0-9A-Za-z_]', '_', torch_version)}"


def extension(name: str, build: str, csrc: str) -> Any:
    """torch's ``CppExtension`` for ``build`` named ``name``, its sources in the folder ``csrc``."""
    from torch.utils.cpp_extension import CppExtension

    return CppExtension(name, [f"{csrc}/logprobs_{build}.cpp"], depends=[f"{csrc}/logprobs.h"],
                        extra_compile_args=[*FLAGS, *OPENMP, *VARIANTS[build]], extra_link_args=list(OPENMP))


def build_ext_class(on_failure: Callable[[Any, Exception], None]) -> Any:
    """torch's ``BuildExtension`` without ninja, rebuilding an extension without OpenMP where the
    compiler has none (clang without libomp: the same kernels, rows on the calling thread), and
    calling ``on_failure(ext, err)`` where the compile fails otherwise."""
    from torch.utils.cpp_extension import BuildExtension

    class Build(BuildExtension):
        def build_extension(self, ext):
            try:
                super().build_extension(ext)
            except Exception as err:  # noqa: BLE001 - the failure goes to on_failure
                if not OPENMP or OPENMP[0] not in ext.extra_compile_args:
                    on_failure(ext, err)
                    return
                print(f"WARNING: rlcore: building {ext.name} with OpenMP failed ({err}); building it "
                      "without (its rows then run on the calling thread only)", file=sys.stderr)
                ext.extra_compile_args = [a for a in ext.extra_compile_args if a not in OPENMP]
                ext.extra_link_args = [a for a in ext.extra_link_args if a not in OPENMP]
                self.build_extension(ext)

    return Build.with_options(use_ninja=False)


# --- the per-user cache --------------------------------------------------------------------
def cache_root() -> Path:
    """Where first-use builds go: ``$RLCORE_KERNEL_CACHE``, else ``$XDG_CACHE_HOME/rlcore/kernels``,
    else ``~/.cache/rlcore/kernels``."""
    if os.environ.get("RLCORE_KERNEL_CACHE"):
        return Path(os.environ["RLCORE_KERNEL_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "rlcore" / "kernels"


def _compilers() -> list[str]:
    """The C and C++ compiler commands setuptools compiles and links with (``$CC``, ``$CXX`` or
    Python's own configuration)."""
    return [os.environ.get(var) or sysconfig.get_config_var(var) or default
            for var, default in (("CC", "cc"), ("CXX", "c++"))]


def _identify(command: str) -> str | None:
    """The first line of ``command --version``, or ``None`` where it does not run."""
    words = shlex.split(command)
    if not words or not shutil.which(words[0]):
        return None
    try:
        out = subprocess.run([*words, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return (out.stdout.strip().splitlines() or [""])[0] if out.returncode == 0 else None


def compiler_missing() -> str | None:
    """``None`` where the compilers run, else which one does not."""
    for command in _compilers():
        if _identify(command) is None:
            return f"no working C++ compiler ({command!r} does not run; set CC / CXX or install g++ or clang)"
    return None


def cache_dir(build: str, torch_version: str) -> Path:
    """The cache folder of ``build`` for this torch, Python, machine, flags and sources."""
    digest = hashlib.sha256()
    for part in (torch_version, sys.implementation.cache_tag, sysconfig.get_config_var("SOABI") or "",
                 platform.machine(), *FLAGS, *OPENMP, *VARIANTS[build]):
        digest.update(f"{part}\n".encode())
    for source in (CSRC / "logprobs.h", CSRC / f"logprobs_{build}.cpp"):
        digest.update(source.read_bytes())
    return cache_root() / f"{module_name(build, torch_version)}-{digest.hexdigest()[:16]}"


def find_module(folder: Path, name: str) -> Path | None:
    """The compiled module ``name`` in ``folder`` (any of this Python's extension suffixes)."""
    for suffix in EXTENSION_SUFFIXES:
        if (folder / f"{name}{suffix}").is_file():
            return folder / f"{name}{suffix}"
    return None


def build_cached(build: str, torch_version: str, notice: Callable[[str], None]) -> tuple[Path, bool]:
    """``(path, compiled_here)`` of ``build`` in the cache, compiled now where it is not there yet
    (one process at a time; the others wait for it). Raises ``BuildFailed`` where the compile
    fails, now or in an earlier process (its log is kept in the cache folder)."""
    from filelock import FileLock, Timeout

    folder = cache_dir(build, torch_version)
    folder.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(f"{folder}.lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        notice(f"rlcore: waiting for another process compiling the {build} CPU kernels into {folder}")
        lock.acquire()
    try:
        found = find_module(folder, module_name(build, torch_version))
        if found is not None:
            return found, False
        if (folder / "failed.log").is_file():
            raise BuildFailed(f"compiling the {build} kernels failed earlier (log: {folder / 'failed.log'}; "
                              "delete that folder to try again)")
        notice(f"rlcore: compiling the {build} CPU kernels for torch {torch_version} into {folder} "
               "(once; about a minute)")
        return _compile(build, torch_version, folder), True
    finally:
        lock.release()


_RUNNER = ("import importlib.util as u, sys; s = u.spec_from_file_location('rlcore_kernel_build', sys.argv[1]); "
           "m = u.module_from_spec(s); s.loader.exec_module(m); m.main(sys.argv[2:])")


def _compile(build: str, torch_version: str, folder: Path) -> Path:
    """Compiles ``build`` in a child process into a fresh folder beside ``folder``, then moves the
    module into ``folder`` (a reader never sees half a file)."""
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder.parent, prefix=".build-") as work:
        try:
            out = subprocess.run([sys.executable, "-c", _RUNNER, __file__, build, work], cwd=work,
                                 capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S)
            log, ok = out.stdout + out.stderr, out.returncode == 0
        except (OSError, subprocess.SubprocessError) as err:
            log, ok = str(err), False
        built = find_module(Path(work), module_name(build, torch_version)) if ok else None
        if built is None:
            (folder / "failed.log").write_text(log)
            tail = " | ".join(line for line in log.strip().splitlines()[-3:])
            raise BuildFailed(f"compiling the {build} kernels failed (log: {folder / 'failed.log'}): {tail}")
        (folder / "build.log").write_text(log)
        target = folder / built.name
        os.replace(built, target)
    return target


def main(argv: list[str]) -> None:
    """``<build> <folder>``: compiles ``build`` into ``folder`` (the first-use child process)."""
    import torch
    from setuptools import Distribution

    build, folder = argv

    def fail(ext, err):
        raise BuildFailed(f"building {ext.name} failed: {err}") from err

    ext = extension(module_name(build, torch.__version__), build, str(CSRC))
    dist = Distribution({"name": "rlcore-kernels", "ext_modules": [ext],
                         "cmdclass": {"build_ext": build_ext_class(fail)}})
    command = dist.get_command_obj("build_ext")
    command.build_lib, command.build_temp = folder, str(Path(folder) / "objects")
    dist.run_command("build_ext")
