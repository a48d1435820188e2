"""benchmarks/sharding.py end to end at its tiny size: one rank unsharded and two FSDP2 ranks of GRPO
and DPO, each reporting its per-rank peak and losses (DPO's two ranks train on the one rank's batch)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_tiny_run_reports_every_recipe_and_world_size(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sharding.py"), "--tiny", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines() if line.startswith("| grpo") or
            line.startswith("| dpo")]
    rows = rows[len(rows) // 2:]  # the report repeats the rows printed as they finished
    assert [(r[0].strip(), r[1].strip(), r[2].strip()) for r in rows] == [
        ("grpo", "1", "none"), ("grpo", "2", "fsdp2"), ("dpo", "1", "none"), ("dpo", "2", "fsdp2")]
    dpo_losses = [r[7].strip() for r in rows if r[0].strip() == "dpo"]
    assert dpo_losses[0] == dpo_losses[1]  # the same global batch, sharded or not
