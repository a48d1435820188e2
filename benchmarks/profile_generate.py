"""Where sampling time goes: rlcore's decode loop against HF ``generate``, operator by operator.

    python benchmarks/profile_generate.py [--tiny] [--model tiny|qwen] [--top 12]

The same cases as ``bench_steps``' ``collect`` rows (8 samples of 64 new tokens from one prompt of
64; ``--model qwen``: the Qwen2.5-0.5B shape in bfloat16), each built by ``bench_steps``' builder
(which runs it once, untimed) and then run once under ``torch.profiler``. For each side it prints the wall time, the self CPU time summed over
operators, the share spent in the operators both sides must run (the matrix products and the
attention kernel: ``MATMUL_OPS``), and the top operators.

What it bounds: however small the loop's own overhead, its time cannot fall below the matrix
products it shares with ``generate``. ``generate``'s total over those shared products is the
largest speedup any decode loop can reach on that machine without making the products
themselves cheaper (another GEMM kernel, quantised weights).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import time
from pathlib import Path

import torch

import harness as H
import machine as M

# operators that compute the model itself: both decode paths run them on the same shapes
MATMUL_OPS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm",
                        "aten::_scaled_dot_product_flash_attention_for_cpu", "mkldnn::_linear_pointwise"})


@dataclasses.dataclass(frozen=True)
class Profile:
    """One side's profile: wall ms, self CPU ms over every operator, of which ``shared_ms`` in
    ``MATMUL_OPS``, and the ``top`` operators ``(name, ms)``."""

    name: str
    wall_ms: float
    self_ms: float
    shared_ms: float
    top: tuple[tuple[str, float], ...]


def profile(name: str, thunk, top: int = 12) -> Profile:
    """Run ``thunk`` (already warmed up by its builder) once under the profiler."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        thunk()
        wall = time.perf_counter() - start
    self_ms = collections.Counter()
    for event in prof.key_averages():
        self_ms[event.key] += event.self_cpu_time_total / 1e3
    shared = sum(ms for key, ms in self_ms.items() if key in MATMUL_OPS)
    return Profile(name, wall * 1e3, sum(self_ms.values()), shared, tuple(self_ms.most_common(top)))


def bound(ours: Profile, peer: Profile) -> float:
    """The largest speedup over ``peer`` a loop could reach that still runs ``ours``' shared products:
    the peer's self time over ours' shared time."""
    return peer.self_ms / ours.shared_ms


def report(ours: Profile, peer: Profile) -> str:
    lines = []
    for p in (ours, peer):
        lines.append(f"== {p.name}: wall {p.wall_ms:.0f} ms; self CPU {p.self_ms:.0f} ms, matrix products "
                     f"and attention {p.shared_ms:.0f} ms ({100 * p.shared_ms / p.self_ms:.0f}%)")
        lines += [f"   {key:52s} {ms:9.1f} ms {100 * ms / p.self_ms:5.1f}%" for key, ms in p.top]
    lines.append(f"speedup over {peer.name}: {peer.wall_ms / ours.wall_ms:.2f}x measured (wall), at most "
                 f"{bound(ours, peer):.2f}x for any loop running these products (self CPU)")
    return "\n".join(lines)


def cases(tiny: bool, model: str):
    """``(rlcore thunk builder, hf_generate thunk builder)`` from ``bench_steps``."""
    steps = H.load(Path(__file__).with_name("bench_steps.py"))
    s = steps._sizes(tiny)
    if model == "tiny":
        return functools.partial(steps._collect, s, "loop"), functools.partial(steps._collect_hf, s)
    q = dataclasses.replace(s, vocab=steps.QWEN_VOCAB)
    qwen = functools.partial(steps._qwen, "tiny" if tiny else "0.5b")
    return functools.partial(steps._collect, q, "loop", build=qwen), functools.partial(steps._collect_hf, q, qwen)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="small sizes (the smoke test)")
    parser.add_argument("--model", choices=("tiny", "qwen"), default="qwen")
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ours, peer = cases(args.tiny, args.model)
    cpu = M.cpu_identity()
    print(f"CPU: {cpu['model']}; {cpu['isa']}; BLAS {cpu['blas']}; {args.threads} threads")
    print(report(profile("rlcore", ours(), args.top), profile("hf_generate", peer(), args.top)))


if __name__ == "__main__":
    main()
