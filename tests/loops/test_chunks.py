"""Bounded memory (loops/chunks.py, score_rollout(rows_per_forward=)): a rollout sampled and scored
in chunks of rows is the rollout of its chunks, padded and joined, and the recipes run with it."""

import dataclasses

import pytest
import torch

from rlcore import keys as K
from rlcore.loops.recipes import grpo, ppo
from rlcore.loops.chunks import cat_rollouts, chunk_seed, generate_in_chunks
from rlcore.loops.collect import _prompts, generate_rollout
from rlcore.loops.models import build_model, build_reward_model, build_tokenizer, pad_token_id, token_values
from rlcore.loops.config import check_config
from rlcore.loops.score import score_rollout
from rlcore.testing import make_rollout
from tests.loops.online_helpers import TINY, digit_fraction

PROMPTS = ["12+3=", "a", "hello there", "7*8=", "xyz", "the cat"]
G = 2


@pytest.fixture(scope="module")
def lm():
    tokenizer = build_tokenizer()
    return build_model(tokenizer=tokenizer, hidden_size=32, num_layers=1, num_heads=4, seed=3).eval(), tokenizer


def _strip(rollout, row):
    """Row ``row``'s prompt and response tokens without padding, and its behaviour log-probs."""
    p, r = rollout[K.PROMPT_MASK][row], rollout[K.RESPONSE_MASK][row]
    return (rollout[K.PROMPT_IDS][row][p].tolist(), rollout[K.RESPONSE_IDS][row][r].tolist(),
            rollout[K.OLD_LOGPROBS][row][r])


@pytest.mark.parametrize("engine", ["hf", "loop"])
def test_one_chunk_is_the_unchunked_rollout(lm, engine):
    model, tok = lm
    kw = dict(num_samples=G, max_new_tokens=6, seed=11, engine=engine)
    whole = generate_rollout(model, tok, PROMPTS, **kw)
    for rows in (None, len(PROMPTS) * G, 100):
        same = generate_in_chunks(model, tok, PROMPTS, rows_per_call=rows, **kw)
        assert (same == whole).all()


def test_chunks_are_the_rollouts_of_their_prompts_joined(lm):
    model, tok = lm
    joined = generate_in_chunks(model, tok, PROMPTS, rows_per_call=2 * G, num_samples=G, max_new_tokens=6, seed=5)
    assert joined.batch_size[0] == len(PROMPTS) * G
    assert torch.equal(joined[K.GROUP_ID], torch.arange(len(PROMPTS)).repeat_interleave(G))
    prompts = _prompts(PROMPTS, tok, pad_token_id(tok), None)  # tokenised once, as generate_in_chunks does
    for k, start in enumerate(range(0, len(PROMPTS), 2)):
        # the same rows, padding and seed: the chunk's own call, bit for bit on any CPU
        part = generate_rollout(model, tok, prompts[start:start + 2], num_samples=G, max_new_tokens=6,
                                seed=chunk_seed(5, k))
        for row in range(part.batch_size[0]):
            ids, response, lp = _strip(joined, start * G + row)
            ids_part, response_part, lp_part = _strip(part, row)
            assert ids == ids_part and response == response_part
            assert torch.equal(lp, lp_part)
    # the padding is the rollout layout: recomputed log-probs agree with the recorded ones
    rescored = score_rollout(joined, policy=model)
    mask = joined[K.RESPONSE_MASK]
    torch.testing.assert_close(rescored[K.OLD_LOGPROBS][mask], joined[K.OLD_LOGPROBS][mask], rtol=1e-4, atol=1e-5)
    assert not joined[K.PROMPT_MASK][:, -1].logical_not().any()  # left padded: every prompt ends at the last column


def test_chunks_share_one_budget_and_differ_in_seed(lm):
    model, tok = lm
    kw = dict(num_samples=G, length_sampler=(2, 9), seed=8)
    joined = generate_in_chunks(model, tok, PROMPTS, rows_per_call=G, **kw)
    budget = generate_rollout(model, tok, PROMPTS[:1], **kw)[K.RESPONSE_IDS].shape[-1]
    assert joined[K.RESPONSE_MASK].sum(-1).max() <= budget
    assert chunk_seed(8, 0) == 8 and len({chunk_seed(8, k) for k in range(100)}) == 100
    assert chunk_seed(None, 3) is None and all(0 <= chunk_seed(2**62 - 1, k) < 2**62 for k in range(5))


def test_rows_per_call_must_be_whole_groups(lm):
    model, tok = lm
    for bad in (3, 0, -2, 2.0, True):
        with pytest.raises(ValueError, match=r"generation_batch_size: expected a positive multiple of num_samples=2"):
            generate_in_chunks(model, tok, PROMPTS, rows_per_call=bad, num_samples=G, max_new_tokens=4)
    with pytest.raises(ValueError, match=r"generation_batch_size: expected a multiple of num_samples=4 .*got 6"):
        check_config(grpo.Config(num_samples=4, generation_batch_size=6))
    with pytest.raises(ValueError, match=r"forward_batch_size: expected >= 1, got 0"):
        check_config(grpo.Config(forward_batch_size=0))


def test_cat_rollouts_pads_each_side_and_renumbers_groups():
    a = {K.PROMPT_IDS: torch.tensor([[5, 6]]), K.PROMPT_MASK: torch.tensor([[True, True]]),
         K.RESPONSE_IDS: torch.tensor([[7]]), K.RESPONSE_MASK: torch.tensor([[True]]),
         K.OLD_LOGPROBS: torch.tensor([[-1.0]]), K.GROUP_ID: torch.tensor([0])}
    b = {K.PROMPT_IDS: torch.tensor([[4]]), K.PROMPT_MASK: torch.tensor([[True]]),
         K.RESPONSE_IDS: torch.tensor([[8, 9]]), K.RESPONSE_MASK: torch.tensor([[True, True]]),
         K.OLD_LOGPROBS: torch.tensor([[-2.0, -3.0]]), K.GROUP_ID: torch.tensor([0])}
    from tensordict import TensorDict
    out = cat_rollouts([TensorDict(a, batch_size=[1]), TensorDict(b, batch_size=[1])], pad_id=0)
    assert out[K.PROMPT_IDS].tolist() == [[5, 6], [0, 4]] and out[K.PROMPT_MASK].tolist() == [[True, True], [False, True]]
    assert out[K.RESPONSE_IDS].tolist() == [[7, 0], [8, 9]] and out[K.RESPONSE_MASK].tolist() == [[True, False], [True, True]]
    assert out[K.OLD_LOGPROBS].tolist() == [[-1.0, 0.0], [-2.0, -3.0]] and out[K.GROUP_ID].tolist() == [0, 1]
    with pytest.raises(ValueError, match=r"parts\[1\]: keys"):
        cat_rollouts([TensorDict(a, batch_size=[1]), TensorDict({k: v for k, v in b.items() if k != K.GROUP_ID},
                                                                  batch_size=[1])], pad_id=0)


def test_cat_rollouts_rebuilds_the_stored_sequences():
    a, b = make_rollout(2, 3, 4, group_size=2), make_rollout(4, 5, 2, group_size=2)
    for r in (a, b):
        r[K.INPUT_IDS] = torch.cat([r[K.PROMPT_IDS], r[K.RESPONSE_IDS]], -1)
        r[K.ATTENTION_MASK] = torch.cat([r[K.PROMPT_MASK], r[K.RESPONSE_MASK]], -1)
    out = cat_rollouts([a, b], pad_id=-7)
    assert out.batch_size == (6,) and out[K.PROMPT_IDS].shape == (6, 4) and out[K.RESPONSE_IDS].shape == (6, 5)
    assert out[K.GROUP_ID].tolist() == [0, 0, 1, 1, 2, 2]
    assert torch.equal(out[K.PROMPT_MASK][2:, 2:], b[K.PROMPT_MASK]) and not out[K.PROMPT_MASK][2:, :2].any()
    assert torch.equal(out[K.RESPONSE_MASK][:2, :3], a[K.RESPONSE_MASK]) and not out[K.RESPONSE_MASK][:2, 3:].any()
    assert (out[K.PROMPT_IDS][2:, :2] == -7).all() and (out[K.RESPONSE_IDS][:2, 3:] == -7).all()
    torch.testing.assert_close(out[K.OLD_LOGPROBS][2:], b[K.OLD_LOGPROBS])
    assert torch.equal(out[K.INPUT_IDS], torch.cat([out[K.PROMPT_IDS], out[K.RESPONSE_IDS]], -1))
    assert torch.equal(out[K.ATTENTION_MASK], torch.cat([out[K.PROMPT_MASK], out[K.RESPONSE_MASK]], -1))


def test_scoring_by_rows_equals_one_forward(lm):
    model, tok = lm
    rollout = generate_rollout(model, tok, PROMPTS, num_samples=G, max_new_tokens=6, seed=2)
    critic = build_model(tokenizer=tok, hidden_size=32, num_layers=1, num_heads=4, seed=4, task="value").eval()
    judge = build_reward_model(tokenizer=tok, hidden_size=32, num_layers=1, num_heads=4, seed=5).eval()
    kw = dict(policy=model, ref=model, value_fn=lambda i, m: token_values(critic, i, m), reward_model=judge)
    whole = score_rollout(rollout, **kw)
    for rows in (1, 5):
        parts = score_rollout(rollout, rows_per_forward=rows, **kw)
        for key in (K.OLD_LOGPROBS, K.REF_LOGPROBS, K.VALUES, K.SCORE):
            torch.testing.assert_close(parts[key], whole[key], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"rows_per_forward: expected a positive int or None, got 0"):
        score_rollout(rollout, ref=model, rows_per_forward=0)


def test_recipes_run_with_bounded_chunks():
    config = grpo.Config(**TINY, steps=2, batch_size=4, num_samples=2, lr=1e-2)
    whole_state, whole = grpo.train(config, reward_fn=digit_fraction)
    same_state, same = grpo.train(dataclasses.replace(config, generation_batch_size=8), reward_fn=digit_fraction)
    assert same == whole  # one call of all 8 rows: the unchunked run, bit for bit
    for a, b in zip(whole_state.model().parameters(), same_state.model().parameters()):
        assert torch.equal(a, b)
    _, chunked = grpo.train(dataclasses.replace(config, generation_batch_size=2, forward_batch_size=3,
                                                ref_device="cpu", eval_every=2), reward_fn=digit_fraction)
    assert len(chunked) == 2 and all(torch.isfinite(torch.tensor(h["loss"])) for h in chunked)
    _, critic = ppo.train(ppo.Config(**TINY, steps=1, batch_size=4, num_samples=2, generation_batch_size=4,
                                     forward_batch_size=1, value_model="separate"), reward_fn=digit_fraction)
    assert torch.isfinite(torch.tensor(critic[0]["loss"]))
