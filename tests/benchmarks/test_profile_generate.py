"""benchmarks/profile_generate.py at its tiny size: both sides profiled, shares and the bound computed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import harness as H  # noqa: E402

P = H.load(ROOT / "benchmarks" / "profile_generate.py")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def test_the_bound_is_the_peers_time_over_our_shared_products():
    ours = P.Profile("rlcore", 10.0, 8.0, 6.0, ())
    peer = P.Profile("hf_generate", 15.0, 12.0, 6.5, ())
    assert P.bound(ours, peer) == pytest.approx(2.0)
    text = P.report(ours, peer)
    assert "1.50x measured (wall), at most 2.00x" in text and "(75%)" in text


@pytest.mark.parametrize("model", ["tiny", "qwen"])
def test_tiny_profiles_of_both_sides(model):
    ours, peer = (P.profile(name, build(), top=5) for name, build in zip(("rlcore", "hf_generate"),
                                                                         P.cases(True, model)))
    for p in (ours, peer):
        assert 0 < p.shared_ms < p.self_ms and p.wall_ms > 0 and len(p.top) == 5
        assert any(key in P.MATMUL_OPS for key, _ in p.top)
    assert P.bound(ours, peer) > 0
