"""Builds rlcore's compiled CPU kernels (rlcore/csrc) beside the pure-Python package.

Everything else about the package is in pyproject.toml. The kernels are one source compiled once
per instruction set (the builds and their flags are in ``rlcore/_kernel_build.py``);
``rlcore/_kernels.py`` loads, at run time, the best one the CPU supports. Each build's name carries
the torch version it was compiled against, so a build for another torch is never loaded.

The sources ship in the package (sdist and wheel). Where torch is not importable at build time
(pip's default build isolation) or the compile fails, the package installs without the kernels and
``rlcore._kernels`` compiles them on first use into a per-user cache.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from setuptools import setup

_HERE = Path(__file__).resolve().parent


def _warn(message: str) -> None:
    print(f"WARNING: rlcore: {message}; installing without the compiled CPU kernels "
          "(rlcore compiles them on first use)", file=sys.stderr)


def _build_module():
    """rlcore/_kernel_build.py, loaded by path (the package itself imports torch)."""
    spec = importlib.util.spec_from_file_location("rlcore_kernel_build", _HERE / "rlcore" / "_kernel_build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _kernels() -> dict:
    try:
        import torch
    except ImportError as err:
        _warn(f"torch is not importable at build time ({err})")
        return {}
    build = _build_module()

    def failed(ext, err):
        _warn(f"building {ext.name} failed ({err})")

    base = build.build_ext_class(failed)

    class Build(base):
        """A failed build leaves the pure-Python package, with a warning."""

        def run(self):
            try:
                super().run()
            except Exception as err:  # noqa: BLE001 - any build failure leaves the pure-Python package
                _warn(f"building the kernels failed ({err})")

    modules = [build.extension(f"rlcore.{build.module_name(name, torch.__version__)}", name, "rlcore/csrc")
               for name in build.VARIANTS]
    return {"ext_modules": modules, "cmdclass": {"build_ext": Build}}


setup(package_data={"rlcore": ["csrc/*.h", "csrc/*.cpp"]}, **_kernels())
