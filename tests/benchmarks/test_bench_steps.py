"""Tests for benchmarks/bench_steps.py: the protocol, the shared data, and that every row does the work it claims."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import harness as H  # noqa: E402

from rlcore import keys as K  # noqa: E402
from rlcore.loops.collate import collate_preference  # noqa: E402

B = H.load(ROOT / "benchmarks" / "bench_steps.py")


def test_protocol_and_floors():
    for tiny in (True, False):
        cases, floors = B.cases(tiny), B.floors(tiny)
        assert len(cases) == 6 and set(floors) <= set(cases)
        for impls in cases.values():
            assert next(iter(impls)) == H.REFERENCE_IMPL and len(impls) >= 2
        assert set(B.goals(tiny)) <= set(cases)
    full = B.cases(False)
    assert "dpo fp32 8x256 tok" in full and "rloo step 1x8 samples x64 new" in full
    # the DPO floor by hand for the tiny sizes: V=256, H=16, L=1, 2 pairs of 4 + 4 tokens
    s = B.TINY
    trunk = 2 * 1 * 16 * 16**2 + 2 * 1 * 8 * 16
    assert B.floors(True)["dpo fp32 2x8 tok"]["flops"] == 4 * (2 * 2 * 8 * trunk + 2 * 256 * 16 * 2 * 2 * 4)
    assert s.vocab == 256 and s.layers == 1


def test_word_tokenizer_round_trip_and_reward():
    tok = B.word_tokenizer(300)
    ids = [5, 299, 4, B.EOS]
    text = B.to_text(ids)
    assert text == "w5 w299 w4 </s>"
    assert tok(text)["input_ids"] == ids
    assert len(tok) == 300 and tok.pad_token_id == B.PAD and tok.eos_token_id == B.EOS
    assert B.reward(None, ["w2 w3 w4 w10", "", "w7"]) == [0.75, 0.0, 0.0]


def test_preference_rows_are_the_trl_batch():
    """TRL's collator, fed the text rows, yields exactly the ids rlcore's collate_preference makes."""
    pytest.importorskip("trl")
    thunk = B._dpo_trl(B.TINY, False)  # raises if the batches differ
    assert torch.isfinite(thunk())
    rows = B.preference_rows(B.TINY)
    assert all(r["chosen_ids"][-1] == B.EOS and len(r["prompt_ids"]) == B.TINY.prompt for r in rows)
    batch = collate_preference(rows, pad_id=B.PAD)
    assert batch[K.CHOSEN, K.INPUT_IDS].shape == (B.TINY.pairs, B.TINY.prompt + B.TINY.completion)


@pytest.mark.parametrize("kind", ["rloo", "grpo"])
@pytest.mark.parametrize("engine", ["loop", "hf"])
def test_online_rows_run_the_recipe_step(kind, engine):
    """The rlcore rows are the recipe's own step; only the generation engine differs."""
    s = B.TINY
    thunk = B._online_rlcore(s, kind, engine)  # one step already ran (warm-up)
    metrics = thunk()
    assert torch.isfinite(metrics["loss"]) and {"rollout/score", "grad_norm"} <= set(metrics.keys())


def test_plain_and_collect_rows_run():
    s = B.TINY
    for build in (lambda: B._dpo_plain(s, False), lambda: B._online_plain(s, "grpo"), lambda: B._collect(s, "loop")):
        assert build()() is not None
    rollout = B._collect(s, "loop")()
    assert rollout[K.RESPONSE_IDS].shape == (s.prompts * s.samples, s.new_tokens)
    assert (rollout[K.OLD_LOGPROBS] <= 0).all()
