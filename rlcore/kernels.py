"""Which path ``rlcore.logprobs`` runs here, and why: ``python -m rlcore.kernels``.

Prints the active path (the compiled kernels from the package, from the per-user cache or compiled
into it by this run, or the pure-PyTorch path) with its reason (forced by ``RLCORE_PURE_TORCH``, no
C++ compiler, a failed compile), the instruction-set build and what the CPU runs, and the threads
the kernels' rows spread over (torch's intra-op threads, OpenMP).
"""

from __future__ import annotations

import platform

import torch

from rlcore import _kernel_build, _kernels

__all__ = ["report", "main"]


def _cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux), else the platform's processor string."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _path_line() -> str:
    """The active path and its reason."""
    if _kernels.ops is None:
        return f"pure PyTorch: {_kernels.reason}"
    where = {"packaged": "prebuilt in the package", "cache": "from the per-user cache",
             "built": "compiled into the per-user cache by this run"}[str(_kernels.source)]
    return f"compiled kernels, {_kernels.variant} build, {where} ({_kernels.path}); {_kernels.reason}"


def _threads_line() -> str:
    """torch's thread count, OpenMP in torch, and how many threads the kernels' rows run on."""
    threads = torch.get_num_threads()
    line = f"torch intra-op threads: {threads}; torch built with OpenMP: {torch.backends.openmp.is_available()}"
    if _kernels.ops is not None:
        n = _kernels.ops.parallel_threads(max(threads, 1) * 4)
        line += f"; the kernels' rows run on {n} thread(s) ({'OpenMP' if n > 1 or threads == 1 else 'no OpenMP'})"
    return line


def report() -> str:
    """The lines ``python -m rlcore.kernels`` prints."""
    bf16 = getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)()
    return "\n".join([
        f"rlcore.logprobs: {_path_line()}",
        f"CPU: {_cpu_name()}; torch {torch.__version__} sees {torch.backends.cpu.get_cpu_capability()} "
        f"(AVX-512 bfloat16: {'yes' if bf16 else 'no'}); builds it runs, best first: {', '.join(_kernels._builds())}",
        _threads_line(),
        f"per-user kernel cache: {_kernel_build.cache_root()}",
    ])


def main() -> None:
    """Prints ``report()``."""
    print(report())


if __name__ == "__main__":
    main()
