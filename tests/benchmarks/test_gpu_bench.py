"""benchmarks/gpu.py: refuses plainly without a GPU; on one (marked gpu), the tiny run fills every table."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import harness as H  # noqa: E402

G = H.load(ROOT / "benchmarks" / "gpu.py")


def test_without_cuda_it_says_so_and_exits_2(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert G.main([]) == 2
    assert "no CUDA device visible to torch" in capsys.readouterr().err


@pytest.mark.gpu
def test_tiny_run_fills_every_table(tmp_path):
    out = tmp_path / "gpu.md"
    assert G.main(["--tiny", "--out", str(out)]) == 0
    text = out.read_text()
    for heading in ("#### ceilings", "#### lm head", "#### generate"):
        assert heading in text
    assert "failed" not in text and "Traceback" not in text
    assert "| bfloat16 | rlcore hidden_logprobs |" in text and "| rlcore KV-cache loop |" in text
