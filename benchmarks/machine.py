"""What the machine is, and what it was doing while a case was timed: the harness's judge of a run.

A timing only says something about the code when the cores were ours. Around every timed case
the harness takes a :class:`Sample` (1-minute load average, the busy CPU ticks of the whole
machine and of this process from ``/proc``, the mean CPU frequency) and :func:`conditions`
turns two samples into what other processes did meanwhile: the cores they kept busy (the
machine's busy ticks minus ours, over the elapsed time), the load before and after, the
frequency before and after. :func:`not_judged` names what disqualifies a case (other processes
busy on the cores we use, a load above our threads, the frequency moving, a spread still wide
after the repeats); a disqualified case's goals read "not judged" instead of met / missed.

:func:`cpu_identity` names the CPU for the report, which keeps one section per CPU: the model
string, its vector extensions (AVX2, AVX-512 and its BF16 / VNNI parts, AMX), torch's CPU
capability and the BLAS torch was built with. Everything reads ``/proc`` through a ``root``
argument, so tests feed it fake files; nothing here imports the harness.
"""

from __future__ import annotations

import dataclasses
import math
import os
import platform
import re
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["Sample", "Conditions", "Policy", "read_sample", "conditions", "not_judged", "cpu_identity",
           "cpu_heading"]


@dataclasses.dataclass(frozen=True)
class Sample:
    """One reading of the machine."""

    time_s: float              # monotonic clock
    load1: float | None        # 1-minute load average
    busy_ticks: int | None     # non-idle ticks of all CPUs together (/proc/stat: user nice system irq softirq steal)
    own_ticks: int | None      # this process's user + system ticks (/proc/self/stat)
    mhz: float | None          # mean current frequency over the CPUs


@dataclasses.dataclass(frozen=True)
class Conditions:
    """The machine around one timed case."""

    seconds: float
    load_before: float | None
    load_after: float | None
    others_cores: float | None  # cores kept busy by other processes meanwhile (None: unknown, or too short to tell)
    mhz_before: float | None
    mhz_after: float | None

    def summary(self) -> str:
        load = "—" if self.load_before is None else f"{self.load_before:.2f}→{self.load_after:.2f}"
        others = "—" if self.others_cores is None else f"{self.others_cores:.2f}"
        return f"{load} | {others}"


@dataclasses.dataclass(frozen=True)
class Policy:
    """How long to time a case and when its timing cannot be judged."""

    min_time_s: float = 1.0        # time each implementation for at least this long
    max_spread: float = 0.10       # repeat while IQR / median is above this ...
    max_reps_factor: int = 4       # ... up to this many times the requested runs ...
    max_time_s: float = 120.0      # ... or this many seconds of timed runs
    load_margin: float = 0.5       # not judged: 1-minute load above threads + this
    others_margin: float = 0.25    # not judged: other processes' cores above the idle cores + this
    max_mhz_change: float = 0.10   # not judged: frequency moved by more than this fraction
    min_window_s: float = 0.5      # /proc/stat ticks are 10 ms: shorter windows tell nothing


TINY_POLICY = Policy(min_time_s=0.0, max_reps_factor=1, max_time_s=10.0)


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def read_sample(*, root: Path = Path("/"), clock: Callable[[], float] = time.monotonic) -> Sample:
    """Load, busy ticks (machine and this process) and mean frequency, now."""
    loadavg = _read(root / "proc/loadavg")
    load1 = float(loadavg.split()[0]) if loadavg else None
    stat, own = _read(root / "proc/stat"), _read(root / "proc/self/stat")
    busy = None
    if stat and stat.startswith("cpu "):
        f = [int(x) for x in stat.split("\n", 1)[0].split()[1:]]
        busy = f[0] + f[1] + f[2] + sum(f[5:8])  # user nice system | irq softirq steal (idle, iowait excluded)
    own_ticks = None
    if own:
        rest = own.rsplit(")", 1)[-1].split()  # the command name may hold spaces
        own_ticks = int(rest[11]) + int(rest[12])  # utime, stime (fields 14 and 15)
    return Sample(clock(), load1, busy, own_ticks, _mhz(root))


def _mhz(root: Path) -> float | None:
    freqs = []
    for cur in sorted((root / "sys/devices/system/cpu").glob("cpu[0-9]*/cpufreq/scaling_cur_freq")):
        text = _read(cur)
        if text and text.strip().isdigit():
            freqs.append(int(text) / 1000)
    if not freqs:
        freqs = [float(m) for m in re.findall(r"^cpu MHz\s*:\s*([\d.]+)", _read(root / "proc/cpuinfo") or "", re.M)]
    return sum(freqs) / len(freqs) if freqs else None


def conditions(before: Sample, after: Sample, *, ticks_per_s: float | None = None,
               min_window_s: float = Policy.min_window_s) -> Conditions:
    """What other processes did between two samples of this process."""
    seconds = after.time_s - before.time_s
    hz = ticks_per_s or (os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100)
    others = None
    known = None not in (before.busy_ticks, after.busy_ticks, before.own_ticks, after.own_ticks)
    if known and seconds >= min_window_s:
        theirs = (after.busy_ticks - before.busy_ticks) - (after.own_ticks - before.own_ticks)
        others = max(0.0, theirs / hz / seconds)
    return Conditions(seconds, before.load1, after.load1, others, before.mhz, after.mhz)


def not_judged(cond: Conditions | None, *, spread: float, reps: int, threads: int, cores: int,
               policy: Policy) -> str:
    """Why a case's timing cannot be judged (``""``: it can): busy machine, moving clock, wide spread."""
    reasons = []
    if cond is not None:
        idle_cores = max(0, cores - threads)
        if cond.others_cores is not None and cond.others_cores > idle_cores + policy.others_margin:
            reasons.append(f"other processes kept {cond.others_cores:.2f} cores busy ({idle_cores} spare)")
        loads = [x for x in (cond.load_before, cond.load_after) if x is not None]
        if loads and max(loads) > threads + policy.load_margin:
            reasons.append(f"load {max(loads):.2f} above {threads} threads")
        if cond.mhz_before and cond.mhz_after and abs(cond.mhz_after / cond.mhz_before - 1) > policy.max_mhz_change:
            reasons.append(f"frequency moved {cond.mhz_before:.0f}→{cond.mhz_after:.0f} MHz")
    if not math.isnan(spread) and spread > policy.max_spread:
        reasons.append(f"spread (IQR/median) {spread:.0%} after {reps} runs")
    return "; ".join(reasons)


# --- which CPU --------------------------------------------------------------------------------
_ISA = [("avx2", "AVX2"), ("avx512f", "AVX-512"), ("avx512_bf16", "AVX512-BF16"), ("avx512_vnni", "AVX512-VNNI"),
        ("amx_tile", "AMX"), ("amx_bf16", "AMX-BF16")]


def cpu_identity(*, root: Path = Path("/"), torch_config: str | None = None,
                 capability: str | None = None) -> dict[str, str]:
    """``{"model", "isa", "capability", "blas"}``: the CPU's name, its vector extensions, torch's CPU
    capability (the kernels it dispatches to) and the BLAS torch was built with."""
    info = _read(root / "proc/cpuinfo") or ""
    model = next(iter(re.findall(r"^model name\s*:\s*(.+)$", info, re.M)), "") or platform.processor() \
        or platform.machine()
    flags = set(next(iter(re.findall(r"^flags\s*:\s*(.+)$", info, re.M)), "").split())
    isa = ", ".join(name for flag, name in _ISA if flag in flags) or "none of AVX2 / AVX-512 / AMX"
    if torch_config is None or capability is None:
        import torch

        torch_config = torch.__config__.show() if torch_config is None else torch_config
        capability = torch.backends.cpu.get_cpu_capability() if capability is None else capability
    blas = next(iter(re.findall(r"BLAS_INFO=(\w+)", torch_config)), "unknown")
    mkl = re.search(r"Math Kernel Library Version ([\w.]+)", torch_config)
    onednn = re.search(r"MKL-DNN v([\d.]+)", torch_config)
    blas += f" {mkl.group(1)}" if mkl and blas == "mkl" else ""
    blas += f", oneDNN {onednn.group(1)}" if onednn else ""
    return {"model": model.strip(), "isa": isa, "capability": capability, "blas": blas}


def cpu_heading(cpu: dict[str, str]) -> str:
    """The report's per-CPU section title (the key the sections are merged by)."""
    return f"{cpu['model']} ({cpu['capability']})"
