"""The harness's judge of a busy machine (benchmarks/machine.py) and its adaptive timing
(harness.time_thunk), on fake clocks and fake /proc files: no wall-clock assertion."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import harness as H  # noqa: E402
import machine as M  # noqa: E402


class FakeClock:
    """A clock that only moves when a fake thunk says how long it took."""

    def __init__(self, durations):
        self.now, self.durations, self.calls = 0.0, list(durations), 0

    def __call__(self) -> float:
        return self.now

    def thunk(self):
        self.now += self.durations[min(self.calls, len(self.durations) - 1)]
        self.calls += 1


def _time(durations, **kw):
    clock = FakeClock(durations)
    timing = H.time_thunk(clock.thunk, clock=clock, **kw)
    return timing, clock


def test_time_thunk_runs_at_least_the_minimum_time():
    timing, clock = _time([0.125], reps=3, warmup=1, min_time_s=1.0, max_reps=100)
    assert timing.reps == 8 and clock.calls == 9  # 8 timed runs of 0.125 s reach 1 s; one warm-up
    assert timing.median_s == 0.125 and timing.spread == 0.0


def test_time_thunk_repeats_while_the_spread_is_wide_then_stops():
    # warm-up, then a noisy first batch (a burst of another process), then quiet runs
    noisy = [1.0, 1.0, 3.0, 1.0, 3.0, 3.0] + [1.0] * 40
    timing, clock = _time(noisy, reps=5, warmup=1, max_spread=0.1, max_reps=40)
    assert 5 < timing.reps < 40 and timing.spread <= 0.1 and timing.median_s == pytest.approx(1.0)
    assert timing.reps % 5 == 0  # repeats come in batches of reps


def test_time_thunk_gives_up_at_the_cap_and_reports_the_spread():
    alternating = [1.0, 2.0] * 50
    timing, _ = _time(alternating, reps=4, warmup=0, max_spread=0.1, max_reps=12)
    assert timing.reps == 12 and timing.spread > 0.1
    timing, _ = _time(alternating, reps=4, warmup=0, max_spread=0.1, max_reps=1000, max_time_s=10.0)
    assert 4 < timing.reps <= 12 and sum([1.0, 2.0] * (timing.reps // 2)) >= 10.0 - 4 * 2.0


def test_time_thunk_defaults_keep_the_old_contract():
    timing, clock = _time([0.5, 0.1, 0.2, 0.3], reps=3, warmup=1)
    assert timing.reps == 3 and clock.calls == 4 and timing.median_s == pytest.approx(0.2)
    assert math.isnan(H.Timing(1.0, 1.0, 1.0, 1).spread)


def _fake_proc(root: Path, *, load: float, busy: int, own: int, mhz: list[float], cpufreq_khz: list[int] = ()):
    (root / "proc/self").mkdir(parents=True, exist_ok=True)
    (root / "proc/loadavg").write_text(f"{load:.2f} 0.50 0.40 2/300 12345\n")
    # user nice system idle iowait irq softirq steal guest guest_nice
    (root / "proc/stat").write_text(f"cpu  {busy - 30} 0 20 9999 500 4 3 3 0 0\ncpu0 1 2 3 4 5 6 7 8 0 0\n")
    (root / "proc/self/stat").write_text(f"4242 (python bench (x)) R 1 2 3 4 5 6 7 8 9 10 {own - 5} 5 0 0 20 0 3\n")
    (root / "proc/cpuinfo").write_text("".join(
        f"processor\t: {i}\nmodel name\t: Fake CPU\nflags\t\t: fpu avx2 avx512f avx512_bf16\ncpu MHz\t\t: {f}\n\n"
        for i, f in enumerate(mhz)))
    for i, khz in enumerate(cpufreq_khz):
        d = root / f"sys/devices/system/cpu/cpu{i}/cpufreq"
        d.mkdir(parents=True, exist_ok=True)
        (d / "scaling_cur_freq").write_text(f"{khz}\n")


def test_read_sample_parses_proc(tmp_path):
    _fake_proc(tmp_path, load=1.25, busy=1000, own=300, mhz=[2000.0, 3000.0])
    s = M.read_sample(root=tmp_path, clock=lambda: 7.0)
    assert s == M.Sample(7.0, 1.25, 1000, 300, 2500.0)
    _fake_proc(tmp_path, load=1.25, busy=1000, own=300, mhz=[2000.0, 3000.0], cpufreq_khz=[1_000_000, 1_500_000])
    assert M.read_sample(root=tmp_path).mhz == 1250.0  # cpufreq, where present, wins over /proc/cpuinfo
    empty = M.read_sample(root=tmp_path / "nothing", clock=lambda: 1.0)
    assert empty == M.Sample(1.0, None, None, None, None)


def test_conditions_count_other_processes_cores():
    before = M.Sample(10.0, 0.5, 1_000, 100, 2600.0)
    after = M.Sample(12.0, 2.1, 1_000 + 400 + 150, 100 + 400, 2600.0)  # we used 2 cores, others 150 ticks
    cond = M.conditions(before, after, ticks_per_s=100)
    assert cond.seconds == 2.0 and cond.others_cores == pytest.approx(0.75)
    assert (cond.load_before, cond.load_after) == (0.5, 2.1) and cond.summary() == "0.50→2.10 | 0.75"
    assert M.conditions(before, M.Sample(10.1, 0.5, 1_010, 110, None), ticks_per_s=100).others_cores is None
    assert M.conditions(M.Sample(0.0, None, None, None, None), after).summary() == "— | —"


@pytest.mark.parametrize("cond, spread, expected", [
    (M.Conditions(2.0, 0.3, 1.9, 0.05, 2600.0, 2600.0), 0.03, ""),
    (M.Conditions(2.0, 0.3, 1.9, 0.90, 2600.0, 2600.0), 0.03, "other processes kept 0.90 cores busy (0 spare)"),
    (M.Conditions(2.0, 3.2, 1.9, 0.00, 2600.0, 2600.0), 0.03, "load 3.20 above 2 threads"),
    (M.Conditions(2.0, 0.3, 1.9, None, 2600.0, 1900.0), 0.03, "frequency moved 2600→1900 MHz"),
    (M.Conditions(2.0, 0.3, 1.9, 0.00, None, None), 0.25, "spread (IQR/median) 25% after 30 runs"),
    (None, math.nan, ""),
])
def test_not_judged_names_what_disqualifies_a_case(cond, spread, expected):
    assert M.not_judged(cond, spread=spread, reps=30, threads=2, cores=2, policy=M.Policy()) == expected


def test_spare_cores_absorb_other_processes():
    cond = M.Conditions(2.0, 1.0, 2.0, 1.1, None, None)
    assert M.not_judged(cond, spread=0.0, reps=10, threads=2, cores=4, policy=M.Policy()) == ""
    assert M.not_judged(cond, spread=0.0, reps=10, threads=4, cores=4, policy=M.Policy()).startswith("other")


def test_cpu_identity_names_model_extensions_capability_and_blas(tmp_path):
    _fake_proc(tmp_path, load=0.1, busy=100, own=10, mhz=[2600.0])
    config = ("  - Intel(R) oneAPI Math Kernel Library Version 2024.2-Product Build 20240605\n"
              "  - Intel(R) MKL-DNN v3.12.0 (Git Hash x)\n  - Build settings: BLAS_INFO=mkl, BUILD_TYPE=Release\n")
    cpu = M.cpu_identity(root=tmp_path, torch_config=config, capability="AVX512")
    assert cpu == {"model": "Fake CPU", "isa": "AVX2, AVX-512, AVX512-BF16", "capability": "AVX512",
                   "blas": "mkl 2024.2, oneDNN 3.12.0"}
    assert M.cpu_heading(cpu) == "Fake CPU (AVX512)"
    bare = M.cpu_identity(root=tmp_path / "none", torch_config="", capability="DEFAULT")
    assert bare["isa"] == "none of AVX2 / AVX-512 / AMX" and bare["blas"] == "unknown" and bare["model"]
