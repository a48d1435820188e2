"""The benchmark harness: discovery, timing, peak-memory measurement, floors, the Markdown report.

Protocol of a benchmark module ``benchmarks/bench_<topic>.py``::

    def cases(tiny: bool) -> dict[str, dict[str, Callable[[], Callable[[], object]]]]:
        '''case name -> {implementation name -> builder}; "rlcore" first.'''

    def floors(tiny: bool) -> dict[str, dict]:   # optional
        '''case name -> {"bytes": n} and/or {"flops": n}: the unavoidable traffic / work.'''

    def goals(tiny: bool) -> dict[str, list[tuple[str, str, float]]]:   # optional
        '''case name -> [(kind, other, target)]: "speedup" (other's time / rlcore's ≥ target),
        "memory" (rlcore's peak / other's ≤ target), "floor" (rlcore's × floor ≤ target; other
        unused). ``other`` names an implementation of the case, or "case/impl" of the topic.'''

A builder prepares the inputs (not timed) and returns the zero-argument thunk that is timed. A
builder whose peer is missing raises ``ImportError`` or :class:`Unavailable`; its row is then
skipped with a note. Every implementation of a case is timed in one process (warm-up, then
``reps`` runs: median and interquartile range). Peak memory is measured once per
(case, implementation) in a fresh process: the resident-set high-water mark while running the
thunk once, above the resident set after building its inputs. Floors become times through the
machine's measured copy bandwidth and matmul throughput (roofline: the larger of the two).

A timing is judged only when the machine let it be (``machine.py``): each implementation is timed
for at least ``Policy.min_time_s`` and repeated while its spread (IQR / median) is wide, up to a
cap; the load, the cores other processes kept busy and the CPU frequency are recorded around it.
A row timed on a busy machine, or whose spread stayed wide, is "not judged", and so are the goals
that read it. The report keeps one section per CPU (model, vector extensions, BLAS), one
subsection per topic in it.

Nothing here imports rlcore: the harness measures whatever the bench modules hand it.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from types import ModuleType

import torch

import machine as M
from records import Rates, Row, Timing
from reporting import (REFERENCE_IMPL, cpu_report, format_report, format_table, goal_lines,  # noqa: F401
                       merge_reports, sections_of, versions)

__all__ = [
    "REFERENCE_IMPL", "Unavailable", "Timing", "Rates", "Row",
    "discover", "load", "build", "time_thunk", "measure_rates", "floor_seconds",
    "machine_line", "versions", "MemoryProbe", "format_table", "format_report", "cpu_report", "sections_of",
    "merge_reports", "goal_lines",
]

BENCH_DIR = Path(__file__).resolve().parent
Builder = Callable[[], Callable[[], object]]


class Unavailable(Exception):
    """Raised by a builder whose implementation cannot run here (a peer is not installed)."""


# --- discovery --------------------------------------------------------------------------------
def discover(directory: Path = BENCH_DIR) -> dict[str, Path]:
    """``topic -> path`` for every ``bench_<topic>.py`` in ``directory``, sorted by topic."""
    return {p.stem.removeprefix("bench_"): p for p in sorted(directory.glob("bench_*.py"))}


def load(path: Path) -> ModuleType:
    """Import a bench module from its file path (benchmarks/ is not a package)."""
    name = f"_bench_{Path(path).stem}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def build(builder: Builder) -> Callable[[], object]:
    """Run a builder; a missing peer (``ImportError``) becomes :class:`Unavailable`."""
    try:
        return builder()
    except ImportError as err:
        raise Unavailable(f"not installed ({err.name or err})") from err


# --- timing -----------------------------------------------------------------------------------
def synchronize() -> None:
    """Wait for queued device work, so a timer measures it (a no-op on CPU)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _quartiles(times: list[float]) -> list[float]:
    return statistics.quantiles(times, n=4, method="inclusive") if len(times) > 1 else times * 3


def time_thunk(thunk: Callable[[], object], *, reps: int, warmup: int = 1, min_time_s: float = 0.0,
               max_spread: float = math.inf, max_reps: int | None = None, max_time_s: float = math.inf,
               clock: Callable[[], float] = time.perf_counter) -> Timing:
    """Median and quartiles of timed calls after ``warmup`` untimed ones.

    At least ``reps`` calls and ``min_time_s`` of them; then, while the spread (IQR / median) is
    above ``max_spread``, ``reps`` more at a time, until ``max_reps`` calls or ``max_time_s``.
    """
    for _ in range(warmup):
        thunk()
    synchronize()
    times: list[float] = []
    cap = max(max_reps or reps, reps, 1)

    def more(n: int) -> None:
        for _ in range(min(n, cap - len(times))):
            start = clock()
            result = thunk()
            synchronize()
            times.append(clock() - start)
            del result

    more(max(1, reps))
    while sum(times) < min_time_s and len(times) < cap:
        more(1)
    while len(times) < cap and sum(times) < max_time_s:
        q1, med, q3 = _quartiles(times)
        if med <= 0 or (q3 - q1) / med <= max_spread:
            break
        more(max(1, reps))
    q1, med, q3 = _quartiles(times)
    return Timing(med, q1, q3, len(times), min(times))


def measure_rates(*, tiny: bool = False) -> Rates:
    """The machine's copy bandwidth (bytes read + written per second) and matmul throughput.

    The fastest of several runs: what the machine can do, not what a busy moment allowed.
    """
    n_bytes = (8 if tiny else 256) * 2**20
    src = torch.ones(n_bytes // 4)
    dst = torch.empty_like(src)
    copy = time_thunk(lambda: dst.copy_(src), reps=3 if tiny else 7)
    n = 256 if tiny else 1024
    a, b = torch.ones(n, n), torch.ones(n, n)
    out = torch.empty(n, n)
    mm = time_thunk(lambda: torch.mm(a, b, out=out), reps=3 if tiny else 7)
    return Rates(2 * n_bytes / copy.min_s, 2 * n**3 / mm.min_s)


def floor_seconds(floor: dict | None, rates: Rates) -> float | None:
    """Time of a case's unavoidable work: ``max(bytes / bandwidth, flops / throughput)``."""
    if not floor:
        return None
    parts = [floor.get("bytes", 0) / rates.copy_bytes_per_s, floor.get("flops", 0) / rates.matmul_flops_per_s]
    return max(parts) or None


# --- the machine ------------------------------------------------------------------------------
def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_line(threads: int) -> str:
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
    device = f"; GPU {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    mhz = M.read_sample().mhz
    return (f"{_cpu_model()}, {os.cpu_count()} cores, torch threads {threads}, "
            f"load average at start {load}{'' if mhz is None else f', {mhz:.0f} MHz'}{device}")


# --- peak memory ------------------------------------------------------------------------------
def _status_kb(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_peak() -> bool:
    """Reset the resident-set high-water mark to the current resident set (Linux ≥ 4.0)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return _status_kb("VmHWM") is not None
    except OSError:
        return False


def _maxrss_bytes() -> int:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def measure_once(path: str, case: str, impl: str, tiny: bool, threads: int) -> dict:
    """In this (fresh) process: build the inputs, then run the thunk once; peak extra bytes.

    Uses ``VmHWM`` reset through ``/proc/self/clear_refs`` where available (exact), else the
    ``getrusage`` high-water mark (an underestimate when building the inputs peaked higher).
    """
    torch.set_num_threads(threads)
    # start the runtime's lazy parts (thread pool, autograd engine) so they are not charged
    x = torch.ones(1 << 16, requires_grad=True)
    torch.autograd.grad(x.exp().sum(), x)
    del x
    try:
        thunk = build(load(Path(path)).cases(tiny)[case][impl])
    except Unavailable as err:
        return {"error": str(err)}
    gc.collect()
    exact = _reset_peak()
    before = _status_kb("VmRSS") * 1024 if exact else _maxrss_bytes()
    result = thunk()
    synchronize()
    after = _status_kb("VmHWM") * 1024 if exact else _maxrss_bytes()
    del result
    return {"peak_bytes": max(0, after - before), "exact": exact}


class MemoryProbe:
    """Measures peak memory of (case, impl) pairs, each in a fresh process.

    On POSIX a server process imports torch and the bench modules once and forks one child per
    measurement (so a peer that takes seconds to import is imported once); it never runs a
    tensor op itself, which keeps forking safe. Elsewhere each measurement is a new interpreter.
    """

    def __init__(self, paths: Iterable[Path], *, tiny: bool, threads: int, timeout_s: float = 600):
        self.tiny, self.threads, self.timeout_s = tiny, threads, timeout_s
        self.proc, self.ready = None, False
        # glibc's mmap threshold, fixed: blocks from 1 MiB up are mapped on allocation and unmapped
        # on release, so the peak counts live memory, not heap slack that depends on what the
        # process did before (with the default, dynamic threshold the same thunk read 35-85 MB)
        self.env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": os.environ.get("MALLOC_MMAP_THRESHOLD_", "1048576")}
        if hasattr(os, "fork"):
            cmd = [sys.executable, __file__, "--serve", "--threads", str(threads), *["--tiny"] * tiny,
                   *map(str, paths)]
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
                                         env=self.env)

    def wait_ready(self) -> None:
        """Block until the server has imported the bench modules (so it does not compete with timing)."""
        if self.proc is not None and not self.ready:
            self.proc.stdout.readline()
            self.ready = True

    def measure(self, path: Path, case: str, impl: str) -> dict:
        request = {"path": str(path), "case": case, "impl": impl, "tiny": self.tiny, "threads": self.threads}
        if self.proc is None:
            cmd = [sys.executable, __file__, "--measure", json.dumps(request)]
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=self.timeout_s, env=self.env)
                return json.loads(done.stdout.strip().splitlines()[-1])
            except (subprocess.TimeoutExpired, IndexError, json.JSONDecodeError) as err:
                return {"error": f"measurement failed ({type(err).__name__})"}
        self.wait_ready()
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        return json.loads(line) if line else {"error": "memory server died"}

    def close(self) -> None:
        if self.proc is not None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
            self.proc = None

    def __enter__(self) -> "MemoryProbe":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _serve(paths: list[str], threads: int, tiny: bool, timeout_s: float = 600) -> None:
    """Memory server loop: one JSON request per stdin line, one JSON answer per stdout line.

    The protocol keeps stdout to itself: anything else printed (by imports, bench modules, the
    children) goes to stderr.
    """
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    for p in paths:
        try:  # noqa: SIM105 -- import bench modules, and what their cases() import lazily, once before forking
            load(Path(p)).cases(tiny)
        except Exception:  # noqa: BLE001 - reported per measurement by the child instead
            pass
    gc.collect()
    gc.freeze()  # children's collections then skip the inherited objects (no copy-on-write storm)
    print("ready", file=proto, flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # child: measure, answer, and leave without running any cleanup
            os.close(read_fd)
            try:
                answer = measure_once(req["path"], req["case"], req["impl"], req["tiny"], req["threads"])
            except BaseException as err:  # noqa: BLE001
                answer = {"error": f"{type(err).__name__}: {err}"}
            with os.fdopen(write_fd, "w") as w:
                w.write(json.dumps(answer))
            os._exit(0)
        os.close(write_fd)
        with os.fdopen(read_fd) as r:
            deadline = time.monotonic() + timeout_s
            while os.waitpid(pid, os.WNOHANG) == (0, 0):
                if time.monotonic() > deadline:
                    os.kill(pid, 9)
                    os.waitpid(pid, 0)
                    break
                time.sleep(0.005)
            text = r.read()
        print(text or json.dumps({"error": "measurement process failed"}), file=proto, flush=True)


def _main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="memory measurement entry points (used by run.py)")
    parser.add_argument("--serve", action="store_true")
    parser.add_argument("--measure", metavar="JSON")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("paths", nargs="*")
    args = parser.parse_args(argv)
    if args.serve:
        torch.set_num_threads(args.threads)
        _serve(args.paths, args.threads, args.tiny)
    elif args.measure:
        req = json.loads(args.measure)
        print(json.dumps(measure_once(req["path"], req["case"], req["impl"], req["tiny"], req["threads"])))


if __name__ == "__main__":
    _main()
