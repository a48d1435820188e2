"""The records a benchmark run produces: one timing, the machine's rates, one report row.

Plain data, imported by ``harness.py`` (which fills them) and ``reporting.py`` (which formats them).
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class Timing:
    median_s: float
    q1_s: float
    q3_s: float
    reps: int
    min_s: float = math.nan

    @property
    def iqr_s(self) -> float:
        return self.q3_s - self.q1_s

    @property
    def spread(self) -> float:
        """IQR / median (NaN for a single run)."""
        return self.iqr_s / self.median_s if self.reps > 1 and self.median_s > 0 else math.nan


@dataclasses.dataclass(frozen=True)
class Rates:
    copy_bytes_per_s: float   # bytes read + written per second by a large tensor copy
    matmul_flops_per_s: float  # float32 matmul throughput


@dataclasses.dataclass(frozen=True)
class Row:
    topic: str
    case: str
    impl: str
    timing: Timing | None = None
    peak_bytes: int | None = None
    floor_s: float | None = None
    note: str = ""
    conditions: object | None = None  # machine.Conditions around the timing
    not_judged: str = ""  # why the timing cannot be judged ("" when it can)
