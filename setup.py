"""Builds rlcore's optional compiled CPU kernels (rlcore/csrc) beside the pure-Python package.

Everything else about the package is in pyproject.toml. The kernels are one source compiled once
per instruction set: ``default`` (the compiler's baseline for the platform), and on x86-64 also
``avx2``, ``avx512`` (the flags and ``CPU_CAPABILITY`` macros of torch's own per-capability
kernels) and ``avx512bf16``. ``rlcore/_kernels.py`` loads, at run time, the best one the CPU
supports (``torch.backends.cpu.get_cpu_capability()``). Each module's name carries the torch
version it was compiled against, so a build for another torch is never loaded.

A failed compile (no compiler, no torch at build time) leaves the package installed without the
kernels, with a warning; ``rlcore.logprobs`` then uses its pure-PyTorch path.
"""

from __future__ import annotations

import platform
import re
import sys

from setuptools import setup

_X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")
_AVX2 = ["-mavx2", "-mfma", "-mf16c"]
_AVX512 = [*_AVX2, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]
_VARIANTS = {
    "default": ["-DCPU_CAPABILITY=DEFAULT", "-DCPU_CAPABILITY_DEFAULT"],
    **({"avx2": [*_AVX2, "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"],
        "avx512": [*_AVX512, "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"],
        # the same with the bfloat16 conversion instructions (Cooper Lake, Sapphire Rapids, Zen 4)
        "avx512bf16": [*_AVX512, "-mavx512bf16", "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"]}
       if _X86 else {}),
}

# at::parallel_for is inline and runs its rows on OpenMP threads only where the extension itself is
# compiled with OpenMP; without the flag it runs every row on the calling thread. Linux torch
# wheels ship libgomp.so.1, which the kernels' libgomp.so.1 resolves to at load: one thread pool.
_OPENMP = ["-fopenmp"] if sys.platform.startswith("linux") else []


def _warn(message: str) -> None:
    print(f"WARNING: rlcore: {message}; installing without the compiled CPU kernels "
          "(rlcore.logprobs falls back to its pure-PyTorch path)", file=sys.stderr)


def _kernels() -> dict:
    try:
        import torch
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError as err:
        _warn(f"torch is not importable at build time ({err})")
        return {}

    class Build(BuildExtension):
        """torch's builder (no ninja needed), with a failed compile a warning, not an error."""

        def run(self):
            try:
                super().run()
            except Exception as err:  # noqa: BLE001 - any build failure leaves the pure-Python package
                _warn(f"building the kernels failed ({err})")

        def build_extension(self, ext):
            try:
                super().build_extension(ext)
            except Exception as err:  # noqa: BLE001
                if not _OPENMP or _OPENMP[0] not in ext.extra_compile_args:
                    _warn(f"building {ext.name} failed ({err})")
                    return
                # a compiler without OpenMP (clang without libomp): the same kernels on one thread
                print(f"WARNING: rlcore: building {ext.name} with OpenMP failed ({err}); building it "
                      "without (its rows then run on the calling thread only)", file=sys.stderr)
                ext.extra_compile_args = [a for a in ext.extra_compile_args if a not in _OPENMP]
                ext.extra_link_args = [a for a in ext.extra_link_args if a not in _OPENMP]
                self.build_extension(ext)

    tag = re.sub(r"\W", "_", torch.__version__)
    modules = [
        CppExtension(f"rlcore._logprobs_{name}_torch{tag}", [f"rlcore/csrc/logprobs_{name}.cpp"],
                     depends=["rlcore/csrc/logprobs.h"],
                     extra_compile_args=["-O3", "-fvisibility=hidden", "-fno-math-errno", *_OPENMP, *flags],
                     extra_link_args=list(_OPENMP))
        for name, flags in _VARIANTS.items()
    ]
    return {"ext_modules": modules, "cmdclass": {"build_ext": Build}}


setup(**_kernels())
