"""Tests for benchmarks/agents_learning.py: the SFT conversations it demonstrates tool use with, and
one tiny job end to end (SFT, the start, GRPO with and without the calculator)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import harness as H  # noqa: E402

A = H.load(ROOT / "benchmarks" / "agents_learning.py")


def test_the_demonstrations_call_the_calculator_as_the_environment_reads_calls():
    from rlcore.loops.envs import calculator_env

    rows = A.conversations("mul", 10, 0, 0.5, "train")
    demos = [r["messages"] for r in rows if len(r["messages"]) == 5]
    assert len(demos) == 5 and all(len(r["messages"]) == 3 for r in rows[5:])
    for messages in demos:
        env = calculator_env()
        assert env.reset({"prompt": messages[1]["content"]}) == messages[:2]  # the environment's own opening
        step = env.step(messages[2]["content"])
        assert step.messages == ({"role": "tool", "content": messages[3]["content"]},)
        assert messages[4]["content"] == messages[3]["content"]


def test_one_tiny_job_end_to_end(tmp_path):
    settings = dict(num_train=32, num_eval=8, steps=1, sft_steps=2, demo_fraction=0.5)  # as --tiny
    result = A.run_job("add", 0, settings, tmp_path)
    assert json.loads((tmp_path / "add-0.json").read_text()) == json.loads(json.dumps(result))
    for key in ("start", "tool", "start_no_tool", "no-tool"):
        assert 0 <= result[key] <= 1, key
    assert result["no-tool_turns"] == 1.0 and result["tool_s"] > 0
