"""Run the benchmarks side by side with their peers and print a Markdown report.

    python benchmarks/run.py [--tiny] [--only SUBSTR] [--reps N] [--threads 2] [--write]
                             [--topics A,B] [--no-memory] [--warmup N] [--dir FOLDER]
                             [--min-time S] [--max-spread F]

Discovers ``benchmarks/bench_*.py`` (protocol in ``benchmarks/harness.py``), times every
implementation of each case in this process, measures each one's peak extra memory in a fresh
process, converts the cases' floors into times with this machine's measured rates, and prints
the report; ``--write`` also saves it to ``benchmarks/RESULTS.md``, replacing the topics run in this
CPU's section and keeping the others and other CPUs' sections (each names the run, machine load and
rates it comes from). Each implementation is timed for at least ``--min-time`` seconds and repeated
while its IQR / median is above ``--max-spread``; the load and the cores other processes used are
recorded around it, and a row timed on a busy machine is "not judged" (``machine.py``). ``--only`` keeps the cases
whose ``topic/case`` contains the substring; ``--topics`` loads only the named bench modules
(their imports can take seconds). Missing peers are skipped with a note.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import shlex
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import harness as H  # noqa: E402
import machine as M  # noqa: E402


def run_topic(topic: str, path: Path, probe: H.MemoryProbe | None, *, args, rates: H.Rates) -> str | None:
    """Time (and measure) every selected case of one bench module; its Markdown table."""
    module = H.load(path)
    cases = module.cases(args.tiny)
    floors = module.floors(args.tiny) if hasattr(module, "floors") else {}
    selected = {c: impls for c, impls in cases.items() if args.only is None or args.only in f"{topic}/{c}"}
    if not selected:
        return None
    rows = []
    for case, impls in selected.items():
        floor_s = H.floor_seconds(floors.get(case), rates)
        for impl, builder in impls.items():
            try:
                thunk = H.build(builder)
            except H.Unavailable as err:
                rows.append(H.Row(topic, case, impl, note=f"skipped: {err}"))
                continue
            except Exception as err:  # noqa: BLE001 - one broken implementation must not end the run
                rows.append(H.Row(topic, case, impl, note=f"failed: {type(err).__name__}: {err}"[:200]))
                continue
            policy = args.policy
            try:
                before = M.read_sample()
                timing = H.time_thunk(thunk, reps=args.reps, warmup=args.warmup, min_time_s=policy.min_time_s,
                                      max_spread=policy.max_spread, max_reps=args.reps * policy.max_reps_factor,
                                      max_time_s=policy.max_time_s)
                cond = M.conditions(before, M.read_sample(), min_window_s=policy.min_window_s)
            except Exception as err:  # noqa: BLE001 - one broken implementation must not end the run
                rows.append(H.Row(topic, case, impl, note=f"failed: {type(err).__name__}: {err}"[:200]))
                continue
            finally:
                del thunk
                gc.collect()
            peak, note = None, ""
            if probe is not None:
                answer = probe.measure(path, case, impl)
                peak = answer.get("peak_bytes")
                note = (f"memory not measured: {answer['error']}" if "error" in answer else
                        "" if answer.get("exact") else "memory: getrusage high-water mark (may undercount)")
            busy = M.not_judged(cond, spread=timing.spread, reps=timing.reps, threads=args.threads,
                                cores=os.cpu_count() or 1, policy=policy)
            rows.append(H.Row(topic, case, impl, timing, peak, floor_s, note, cond, busy))
            print(f"  {topic}/{case} {impl}: {timing.median_s * 1e3:.3g} ms ({timing.reps} runs; load "
                  f"{cond.summary().replace(' | ', ', others ')}){' NOT JUDGED: ' + busy if busy else ''}",
                  file=sys.stderr, flush=True)
    return H.format_table(rows, module.goals(args.tiny) if hasattr(module, "goals") else None)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny sizes (a smoke test, seconds)")
    parser.add_argument("--only", metavar="SUBSTR", help="keep cases whose 'topic/case' contains SUBSTR")
    parser.add_argument("--topics", metavar="A,B", help="load only these bench modules (bench_A.py, ...)")
    parser.add_argument("--reps", type=int, default=None, help="timed runs per implementation (10; 3 tiny)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs before timing")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory processes")
    parser.add_argument("--write", action="store_true", help="also write benchmarks/RESULTS.md")
    parser.add_argument("--dir", type=Path, default=H.BENCH_DIR, help="folder holding bench_*.py")
    parser.add_argument("--min-time", type=float, default=None, help="seconds of timed runs per implementation (1; 0 tiny)")
    parser.add_argument("--max-spread", type=float, default=M.Policy.max_spread, help="repeat while IQR/median is above")
    args = parser.parse_args(argv)
    args.reps = args.reps or (3 if args.tiny else 10)
    base = M.TINY_POLICY if args.tiny else M.Policy()
    args.policy = dataclasses.replace(base, max_spread=args.max_spread,
                                      min_time_s=base.min_time_s if args.min_time is None else args.min_time)

    command = "python benchmarks/run.py " + " ".join(map(shlex.quote, sys.argv[1:] if argv is None else argv))
    torch.set_num_threads(args.threads)
    machine = H.machine_line(args.threads)  # load average before we add to it
    paths = H.discover(args.dir)
    if args.topics:
        wanted = set(args.topics.split(","))
        paths = {t: p for t, p in paths.items() if t in wanted}
    # the memory server starts first and imports the bench modules while this process does the
    # same; timing starts once it is ready, so the two never compete for the cores
    probe = None if args.no_memory else H.MemoryProbe(paths.values(), tiny=args.tiny, threads=args.threads)
    start = time.perf_counter()

    def log(what: str) -> None:
        print(f"[run.py {time.perf_counter() - start:6.1f} s] {what}", file=sys.stderr, flush=True)

    try:
        tables = {}
        for topic, path in list(paths.items()):
            try:
                H.load(path)
            except Exception as err:  # noqa: BLE001 - a broken bench module must not end the run
                tables[topic] = f"failed to import: {type(err).__name__}: {err}"
                del paths[topic]
        if probe is not None:
            probe.wait_ready()
        log(f"imported {', '.join(paths)}")
        rates = H.measure_rates(tiny=args.tiny)
        for topic, path in paths.items():
            table = run_topic(topic, path, probe, args=args, rates=rates)
            if table is not None:
                tables[topic] = table
                log(f"done {topic}")
    finally:
        if probe is not None:
            probe.close()
    report = H.format_report(tables, command=command, threads=args.threads, rates=rates, machine=machine)
    print(report)
    if args.write:  # replaces the sections of the topics run, keeps the others
        results = H.BENCH_DIR / "RESULTS.md"
        results.write_text(H.merge_reports(results.read_text() if results.exists() else "", report))
    return report


if __name__ == "__main__":
    main()
