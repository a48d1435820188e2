"""The benchmark report: tables, goal verdicts, and RESULTS.md's sections (one per CPU, one
subsection per topic), merged so that a run replaces only what it measured.

Rows come from ``harness.py`` (``records.Row``: ``case``, ``impl``, ``timing``, ``peak_bytes``,
``floor_s``, ``note``, ``conditions``, ``not_judged``); nothing here times or imports rlcore.
"""

from __future__ import annotations

import importlib.metadata
import re
from collections.abc import Iterable
import machine as M
from records import Rates, Row

__all__ = ["REFERENCE_IMPL", "versions", "goal_lines", "format_table", "format_report", "cpu_report", "sections_of",
           "merge_reports"]

REFERENCE_IMPL = "rlcore"


def versions(packages: Iterable[str] = ("torch", "trl", "torchrl", "tensordict")) -> dict[str, str]:
    """Installed versions, read from package metadata (nothing is imported)."""
    out = {}
    for name in packages:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "absent"
    return out


# --- tables -------------------------------------------------------------------------------------
def _ms(seconds: float | None) -> str:
    return "—" if seconds is None else f"{seconds * 1e3:.3g}" if seconds < 1 else f"{seconds * 1e3:.0f}"


def _fmt_ratio(x: float) -> str:
    return f"{x:.2f}" if x >= 0.1 else f"{x:.2g}"


_GOAL_TEXT = {"speedup": "≥ {t:g}× faster than {o}", "memory": "peak ≤ {t:g}× {o}'s", "floor": "≤ {t:g}× its floor"}


def _goal_value(kind: str, ours: Row, other: Row | None) -> float | None:
    if ours.timing is None:
        return None
    if kind == "floor":
        return None if ours.floor_s is None else ours.timing.median_s / ours.floor_s
    if other is None:
        return None
    if kind == "speedup":
        return None if other.timing is None else other.timing.median_s / ours.timing.median_s
    return None if not (ours.peak_bytes and other.peak_bytes) else ours.peak_bytes / other.peak_bytes


def goal_lines(rows: list[Row], goals: dict[str, list[tuple[str, str, float]]]) -> list[str]:
    """One line per goal: what was aimed at, the measured value, met / missed / not measured."""
    index = {(r.case, r.impl): r for r in rows}
    lines = []
    for case, items in goals.items():
        ours = index.get((case, REFERENCE_IMPL))
        if ours is None:
            continue
        for kind, other, target in items:
            ref_case, _, ref_impl = other.rpartition("/")
            theirs = index.get((ref_case or case, ref_impl))
            value = _goal_value(kind, ours, theirs)
            met = None if value is None else (value >= target if kind == "speedup" else value <= target)
            verdict = "not measured" if met is None else f"{value:.2f}×, {'met' if met else 'MISSED'}"
            busy = [r for r in (ours, theirs) if r is not None and r.not_judged and kind != "memory"]
            if met is not None and busy:  # peak memory does not depend on the load
                verdict = f"{value:.2f}×, not judged ({'; '.join(f'{r.impl}: {r.not_judged}' for r in busy)})"
            lines.append(f"- goal, {case}: rlcore {_GOAL_TEXT[kind].format(t=target, o=other)}: {verdict}")
    return lines


def format_table(rows: list[Row], goals: dict | None = None) -> str:
    """Markdown table: case, impl, median ms, IQR, ratio vs rlcore, peak extra MB, × floor, the load
    before → after and the cores other processes kept busy while timing."""
    head = ("| case | impl | median ms | IQR ms | vs rlcore (peer/ours) | peak extra MB | × floor | load 1 min "
            "| others' cores |\n| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    ours = {r.case: r.timing for r in rows if r.impl == REFERENCE_IMPL and r.timing is not None}
    lines = [head]
    for r in rows:
        if r.timing is None:
            status = "failed" if r.note.startswith("failed") else "skipped"
            lines.append(f"| {r.case} | {r.impl} | {status} | | | | | | |")
            continue
        ref = ours.get(r.case)
        ratio = _fmt_ratio(r.timing.median_s / ref.median_s) if ref else "—"
        mem = "—" if r.peak_bytes is None else f"{r.peak_bytes / 2**20:.1f}"
        dist = "—" if r.floor_s is None else _fmt_ratio(r.timing.median_s / r.floor_s)
        cond = "— | —" if r.conditions is None else r.conditions.summary()
        lines.append(f"| {r.case} | {r.impl} | {_ms(r.timing.median_s)} | {_ms(r.timing.iqr_s)} | {ratio} "
                     f"| {mem} | {dist} | {cond} |")
    notes = [f"- {r.case} / {r.impl}: {r.note}" for r in rows if r.note]
    notes += [f"- {r.case} / {r.impl}: not judged: {r.not_judged}" for r in rows if r.not_judged]
    notes += goal_lines(rows, goals or {})
    return "\n".join(lines + ([""] + notes if notes else []))


def format_report(tables: dict[str, str], *, command: str, threads: int, rates: Rates, machine: str,
                  cpu: dict[str, str] | None = None) -> str:
    """The report: a legend, then this CPU's section, one subsection per topic headed by its run."""
    run = (f"Run: `{command}`  \nVersions: {', '.join(f'{k} {v}' for k, v in versions().items())}  \n"
           f"Machine: {machine}  \nRates: copy {rates.copy_bytes_per_s / 1e9:.1f} GB/s (read + write), "
           f"matmul {rates.matmul_flops_per_s / 1e9:.0f} GFLOP/s (float32)")
    return cpu_report({topic: f"### {topic}\n\n{run}\n\n{table}\n" for topic, table in tables.items()}, cpu)


def cpu_report(sections: dict[str, str], cpu: dict[str, str] | None = None) -> str:
    """A report of one CPU (``machine.cpu_identity()`` by default) holding ``topic -> "### topic ..."`` sections."""
    cpu = cpu or M.cpu_identity()
    about = (f"CPU: {cpu['model']}; {cpu['isa']}; torch CPU capability {cpu['capability']}; BLAS {cpu['blas']}\n")
    return _assemble({M.cpu_heading(cpu): {"": about, **sections}})


_LEGEND = (
    "# Benchmarks\n\n"
    "One section per CPU the benchmarks ran on, one subsection per topic, each measured by the run "
    "named at its head (`python benchmarks/run.py --topics T --write` replaces topic T of this "
    "CPU's section only). Median of the timed runs after a warm-up (at least a second of runs, "
    "repeated while IQR / median > 10%, up to a cap); IQR = interquartile range; vs rlcore = peer "
    "time / rlcore time (> 1: rlcore faster); peak extra = resident-set high-water mark while running "
    "once, above the resident set after building inputs, each in a fresh process; × floor = median / "
    "(the case's bytes ÷ copy bandwidth, or flops ÷ matmul throughput); load 1 min = the load average "
    "before → after timing the row; others' cores = the cores other processes kept busy meanwhile. "
    "A row timed while the machine was busy (others' cores above the spare ones, load above the "
    "threads, frequency moving) or whose spread stayed wide is \"not judged\", and so are its goals.\n")


def _assemble(cpus: dict[str, dict[str, str]]) -> str:
    parts = [_LEGEND]
    for heading, sections in cpus.items():
        parts.append(f"## {heading}\n\n{sections.get('', '')}")
        parts += [sections[t] for t in sorted(sections) if t]
    return "\n".join(parts)


def sections_of(report: str) -> dict[str, dict[str, str]]:
    """``CPU heading -> {topic -> section text}`` of a report (``""``: the CPU's own lines; legend dropped)."""
    cpus: dict[str, dict[str, str]] = {}
    for chunk in re.split(r"^(?=## )", report, flags=re.MULTILINE):
        if not chunk.startswith("## "):
            continue
        heading, _, body = chunk.partition("\n")
        parts = re.split(r"^(?=### )", body, flags=re.MULTILINE)
        topics = {p.split("\n", 1)[0][4:].strip(): p.rstrip("\n") + "\n" for p in parts if p.startswith("### ")}
        cpus[heading[3:].strip()] = {"": parts[0].strip("\n") + "\n" if parts[0].strip() else "", **topics}
    return cpus


def merge_reports(old: str, new: str) -> str:
    """``old`` with the topics of ``new`` replaced (or added) in their CPU's section; other topics and
    other CPUs' sections keep their runs."""
    cpus = sections_of(old)
    for heading, sections in sections_of(new).items():
        cpus[heading] = {**cpus.get(heading, {}), **sections}
    return _assemble(cpus)
