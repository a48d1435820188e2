"""benchmarks/overlap.py end to end at its tiny size: ``none`` and ``ddp`` timed in the same two ranks,
the ddp buckets sent during the backward, and both runs ending with the same weights."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_tiny_run_reports_both_reductions(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "overlap.py"), "--tiny", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "| none (after the backward) |" in out and "| ddp (during the backward) |" in out
    sent, buckets = map(int, re.search(r"buckets sent before the backward ended: (\d+) of (\d+)", out).groups())
    assert buckets >= 1 and 1 <= sent <= buckets
    assert float(re.search(r"differ by at most (\S+)", out).group(1)) < 1e-5
