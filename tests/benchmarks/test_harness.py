"""Tests for the benchmark harness: the tiny end-to-end run, and the harness pieces on fakes."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import harness as H  # noqa: E402
import machine as M  # noqa: E402
import run as R  # noqa: E402

FAKE_BENCH = '''
import torch

def _alloc(n_bytes):
    def builder():
        x = torch.ones(4)
        return lambda: torch.full((n_bytes // 4,), x[0].item())
    return builder

def _missing():
    import a_peer_that_is_not_installed  # noqa: F401

def _broken():
    return lambda: 1 / 0

def cases(tiny):
    return {
        "alloc": {"rlcore": _alloc(64 * 2**20), "small": _alloc(4096), "peer": _missing},
        "broken": {"rlcore": _broken},
    }

def floors(tiny):
    return {"alloc": {"bytes": 64 * 2**20}}
'''


@pytest.fixture
def fake_dir(tmp_path: Path) -> Path:
    (tmp_path / "bench_fake.py").write_text(textwrap.dedent(FAKE_BENCH))
    return tmp_path


def _run_tiny(*extra: str) -> str:
    start = time.monotonic()
    done = subprocess.run([sys.executable, "benchmarks/run.py", "--tiny", *extra], cwd=ROOT, capture_output=True,
                          text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-2000:]
    print(f"run.py --tiny {' '.join(extra)}: {time.monotonic() - start:.1f} s")
    return done.stdout


def test_tiny_run_prints_the_table():
    """The logprobs benchmarks end to end (other topics: the slow test below)."""
    out = _run_tiny("--topics", "logprobs")
    assert ("| case | impl | median ms | IQR ms | vs rlcore (peer/ours) | peak extra MB | × floor | load 1 min "
            "| others' cores |") in out
    for line in ("### logprobs", "Run: `python benchmarks/run.py --tiny --topics logprobs`", "Versions: torch ",
                 "Machine: ", "CPU: ", "torch CPU capability ", "BLAS "):
        assert line in out
    rows = [line for line in out.splitlines() if line.startswith("| logits") or line.startswith("| hidden")]
    assert len(rows) >= 5 * 2
    ours = [r for r in rows if r.split("|")[2].strip() == "rlcore"]
    assert len(ours) == 5 and all(r.split("|")[5].strip() == "1.00" for r in ours)
    # every rlcore row got a memory figure and a floor distance
    assert all(r.split("|")[6].strip() not in ("—", "") and r.split("|")[7].strip() != "—" for r in ours)


@pytest.mark.slow
def test_tiny_run_of_every_bench_module():
    """``run.py --tiny`` over every bench_*.py: each topic gets its table, none fails to import."""
    out = _run_tiny()
    assert "failed to import" not in out
    for topic in H.discover():
        assert f"### {topic}" in out


def test_missing_peer_and_broken_impl_are_notes_not_crashes(fake_dir, capsys):
    (fake_dir / "bench_zbroken.py").write_text("import a_module_that_does_not_exist\n")
    threads = str(torch.get_num_threads())  # run.main sets it for the process: keep it as it is
    report = R.main(["--tiny", "--dir", str(fake_dir), "--no-memory", "--reps", "2", "--threads", threads])
    assert "### zbroken" in report and "failed to import: ModuleNotFoundError" in report
    assert "### fake" in report
    assert "| alloc | peer | skipped |" in report
    assert "alloc / peer: skipped: not installed (a_peer_that_is_not_installed)" in report
    assert "| broken | rlcore | failed |" in report and "ZeroDivisionError" in report
    small = next(line for line in report.splitlines() if line.startswith("| alloc | small |"))
    assert float(small.split("|")[5]) > 0  # a ratio against rlcore's row


def test_memory_probe_measures_peak_extra_in_fresh_processes(fake_dir):
    path = fake_dir / "bench_fake.py"
    with H.MemoryProbe([path], tiny=True, threads=1) as probe:
        big = probe.measure(path, "alloc", "rlcore")
        small = probe.measure(path, "alloc", "small")
        missing = probe.measure(path, "alloc", "peer")
    assert 60 <= big["peak_bytes"] / 2**20 <= 80, big
    assert small["peak_bytes"] / 2**20 < 8, small
    assert "not installed" in missing["error"]


CPU_A = {"model": "Vendor CPU A", "isa": "AVX2, AVX-512", "capability": "AVX512", "blas": "mkl 2024.2"}
CPU_B = {"model": "Vendor CPU B", "isa": "AVX2", "capability": "AVX2", "blas": "openblas"}


def test_write_replaces_only_the_topics_run_in_this_cpus_section():
    rates = H.Rates(copy_bytes_per_s=1e9, matmul_flops_per_s=1e12)

    def report(tables, command, cpu):
        return H.format_report(tables, command=command, threads=2, rates=rates, machine=f"m {command}", cpu=cpu)
    first = report({"a": "table A1", "b": "table B1"}, "run 1", CPU_A)
    other_cpu = report({"a": "table A on B"}, "run B", CPU_B)
    second = report({"b": "table B2", "c": "table C2"}, "run 2", CPU_A)
    merged = H.merge_reports(H.merge_reports(first, other_cpu), second)
    cpus = H.sections_of(merged)
    assert list(cpus) == ["Vendor CPU A (AVX512)", "Vendor CPU B (AVX2)"] and merged.startswith("# Benchmarks")
    a, b = cpus["Vendor CPU A (AVX512)"], cpus["Vendor CPU B (AVX2)"]
    assert list(a) == ["", "a", "b", "c"] and list(b) == ["", "a"]
    assert a[""] == "CPU: Vendor CPU A; AVX2, AVX-512; torch CPU capability AVX512; BLAS mkl 2024.2\n"
    assert "table A1" in a["a"] and "run 1" in a["a"] and "m run 1" in a["a"]
    assert "table B2" in a["b"] and "run 2" in a["b"] and "B1" not in merged
    assert "table A on B" in b["a"] and "run B" in b["a"]  # another CPU's section is kept as it was
    assert H.merge_reports("", first) == first and H.merge_reports(merged, merged) == merged


def test_time_thunk_floor_and_table_formatting():
    calls = []
    timing = H.time_thunk(lambda: calls.append(1), reps=5, warmup=2)
    assert len(calls) == 7 and timing.reps == 5 and timing.q1_s <= timing.median_s <= timing.q3_s
    rates = H.Rates(copy_bytes_per_s=1e9, matmul_flops_per_s=1e12)
    assert H.floor_seconds({"bytes": 2e9}, rates) == pytest.approx(2.0)
    assert H.floor_seconds({"bytes": 1e6, "flops": 3e12}, rates) == pytest.approx(3.0)
    assert H.floor_seconds(None, rates) is None
    busy = M.Conditions(2.0, 0.5, 2.9, 1.4, 2600.0, 2600.0)
    rows = [H.Row("t", "c", "rlcore", H.Timing(0.010, 0.009, 0.012, 5), 3 * 2**20, 0.005),
            H.Row("t", "c", "peer", H.Timing(0.030, 0.02, 0.04, 5), None, 0.005, conditions=busy,
                  not_judged="load 2.90 above 2 threads"),
            H.Row("t", "c", "absent", note="skipped: not installed (x)")]
    table = H.format_table(rows)
    assert "| c | rlcore | 10 | 3 | 1.00 | 3.0 | 2.00 | — | — |" in table
    assert "| c | peer | 30 | 20 | 3.00 | — | 6.00 | 0.50→2.90 | 1.40 |" in table
    assert "| c | absent | skipped |" in table and "- c / absent: skipped: not installed (x)" in table
    assert "- c / peer: not judged: load 2.90 above 2 threads" in table


def test_discover_and_protocol_of_bench_logprobs():
    paths = H.discover()
    assert "logprobs" in paths
    module = H.load(paths["logprobs"])
    cases, floors = module.cases(True), module.floors(True)
    assert set(floors) == set(cases)
    for impls in cases.values():
        assert next(iter(impls)) == H.REFERENCE_IMPL
    goals = module.goals(True)
    assert set(goals) == set(cases)
    for case, lines in goals.items():  # every goal reads rows the topic times
        for kind, other, _ in lines:
            where, impl = other.split("/") if "/" in other else (case, other)
            assert kind == "floor" or impl in cases[where], (case, other)
    bf16 = [case for case in goals if "bf16" in case]
    assert len(bf16) == 2
    for case in bf16:  # judged against its float32 twin and cross_entropy, not a floor
        assert sorted(goals[case]) == [("speedup", "cross_entropy", 1.0),
                                       ("speedup", case.replace("bf16", "fp32") + "/rlcore", 1.0)]
    versions = H.versions()
    assert set(versions) >= {"torch", "trl", "torchrl"}


def test_memory_server_protocol_survives_noisy_benches(tmp_path):
    """A bench that prints to stdout (at import and while running) cannot break the protocol."""
    (tmp_path / "bench_noisy.py").write_text(textwrap.dedent('''
        import torch
        print("hello from import")

        def _b():
            print("building")
            return lambda: print("running") or torch.ones(8)

        def cases(tiny):
            return {"c": {"rlcore": _b}}
    '''))
    path = tmp_path / "bench_noisy.py"
    with H.MemoryProbe([path], tiny=True, threads=1) as probe:
        first, second = probe.measure(path, "c", "rlcore"), probe.measure(path, "c", "rlcore")
    assert "peak_bytes" in first and "peak_bytes" in second


def test_goal_lines_say_met_missed_or_not_measured():
    rows = [H.Row("t", "c", "rlcore", H.Timing(0.010, 0.009, 0.012, 5), 10 * 2**20, 0.004),
            H.Row("t", "c", "peer", H.Timing(0.120, 0.1, 0.13, 5), 200 * 2**20),
            H.Row("t", "d", "rlcore", H.Timing(0.050, 0.04, 0.06, 5)),
            H.Row("t", "c", "absent", note="skipped: not installed (x)")]
    goals = {"c": [("speedup", "peer", 10.0), ("memory", "peer", 0.01), ("floor", "", 3.0), ("speedup", "absent", 2.0)],
             "d": [("speedup", "c/peer", 2.0)], "e": [("speedup", "peer", 1.0)]}
    lines = H.goal_lines(rows, goals)
    assert lines == [
        "- goal, c: rlcore ≥ 10× faster than peer: 12.00×, met",
        "- goal, c: rlcore peak ≤ 0.01× peer's: 0.05×, MISSED",
        "- goal, c: rlcore ≤ 3× its floor: 2.50×, met",
        "- goal, c: rlcore ≥ 2× faster than absent: not measured",
        "- goal, d: rlcore ≥ 2× faster than c/peer: 2.40×, met",
    ]
    assert lines[0] in H.format_table(rows, goals)


def test_goals_read_from_a_busy_row_are_not_judged():
    rows = [H.Row("t", "c", "rlcore", H.Timing(0.010, 0.009, 0.012, 5), 10 * 2**20),
            H.Row("t", "c", "peer", H.Timing(0.030, 0.028, 0.031, 5), 20 * 2**20, not_judged="load 3.00 above 2 threads"),
            H.Row("t", "c", "calm", H.Timing(0.030, 0.028, 0.031, 5))]
    goals = {"c": [("speedup", "peer", 2.0), ("memory", "peer", 0.6), ("speedup", "calm", 2.0)]}
    assert H.goal_lines(rows, goals) == [
        "- goal, c: rlcore ≥ 2× faster than peer: 3.00×, not judged (peer: load 3.00 above 2 threads)",
        "- goal, c: rlcore peak ≤ 0.6× peer's: 0.50×, met",  # memory does not depend on the load
        "- goal, c: rlcore ≥ 2× faster than calm: 3.00×, met",
    ]
