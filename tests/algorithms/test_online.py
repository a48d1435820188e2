"""Online preference pairs: best against worst per prompt, ties dropped, and the batch builder."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore import keys as K
from rlcore.algorithms.dpo import dpo
from rlcore.algorithms.online import best_worst_pairs, online_preference_batch
from rlcore.testing import assert_padding_invariant, assert_pure, make_rollout


def plain_pairs(scores, group_id, num_groups):
    """Loops: per group, first index of the max, first index of the min, and max > min."""
    out = []
    for p in range(num_groups):
        members = [i for i, g in enumerate(group_id) if g == p]
        vals = [scores[i] for i in members]
        if not members or any(v != v for v in vals):
            out.append((None, None, False))
            continue
        hi, lo = max(vals), min(vals)
        out.append((members[vals.index(hi)], members[vals.index(lo)], hi > lo))
    return out


def check_against_plain(scores, group_id, num_groups, got):
    chosen, rejected, valid = got
    for p, (c, r, v) in enumerate(plain_pairs(scores.tolist(), group_id.tolist(), num_groups)):
        assert bool(valid[p]) == v, p
        if v:
            assert (chosen[p].item(), rejected[p].item()) == (c, r), p


def test_golden_values():
    scores = torch.tensor([[0.1, 0.9, 0.5], [1.0, 1.0, 1.0], [2.0, -1.0, 2.0]])
    chosen, rejected, valid = best_worst_pairs(scores)
    assert chosen.tolist() == [1, 3, 6] and rejected.tolist() == [0, 3, 7]
    assert valid.tolist() == [True, False, True]


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 5), st.integers(1, 4), st.data())
def test_grid_layout_against_loops_and_segment_layout(P, G, data):
    vals = data.draw(st.lists(st.integers(0, 3), min_size=P * G, max_size=P * G))  # small ints: many ties
    scores = torch.tensor(vals, dtype=torch.float64).view(P, G)
    got = best_worst_pairs(scores)
    group_id = torch.arange(P).repeat_interleave(G)
    check_against_plain(scores.flatten(), group_id, P, got)
    seg = best_worst_pairs(scores.flatten(), group_id, num_groups=P)
    assert torch.equal(got[2], seg[2])
    assert torch.equal(got[0][got[2]], seg[0][seg[2]]) and torch.equal(got[1][got[2]], seg[1][seg[2]])


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 12), st.integers(1, 6), st.data())
def test_segment_layout_against_loops(B, P, data):
    group_id = torch.tensor(data.draw(st.lists(st.integers(0, P - 1), min_size=B, max_size=B)))
    scores = torch.tensor(data.draw(st.lists(st.integers(-2, 2), min_size=B, max_size=B)), dtype=torch.float32)
    got = best_worst_pairs(scores, group_id, num_groups=P)
    assert all(x.shape == (P,) for x in got)
    check_against_plain(scores, group_id, P, got)
    if P <= B:  # ids in [0, B): the default P' = B is an upper bound
        default = best_worst_pairs(scores, group_id)
        assert default[2].shape == (B,) and int(default[2].sum()) == int(got[2].sum())
    assert ((got[0] >= 0) & (got[0] < B)).all() and ((got[1] >= 0) & (got[1] < B)).all()


def test_nan_lone_and_empty_groups_are_invalid():
    scores = torch.tensor([1.0, float("nan"), 0.0, 2.0, 5.0])
    group_id = torch.tensor([0, 0, 1, 1, 2])
    _, _, valid = best_worst_pairs(scores, group_id, num_groups=4)
    assert valid.tolist() == [False, True, False, False]
    assert best_worst_pairs(torch.tensor([[1.0, float("nan")]]))[2].tolist() == [False]


def test_pure_and_compiles():
    scores, group_id = torch.randn(8), torch.tensor([3, 0, 1, 0, 1, 3, 2, 2])
    eager = assert_pure(best_worst_pairs, scores, group_id, num_groups=4)
    torch._dynamo.reset()
    compiled = torch.compile(best_worst_pairs, backend="eager", fullgraph=True)
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled(scores, group_id, num_groups=4)))
    grid = torch.randn(3, 4)
    assert all(torch.equal(a, b) for a, b in zip(best_worst_pairs(grid), compiled(grid)))


def scored_rollout():
    r = make_rollout(12, response_length=6, prompt_length=4, group_size=4,
                     generator=torch.Generator().manual_seed(1))
    r[K.SCORE][4:8] = 0.5  # the second prompt: all tied
    return r


def test_online_preference_batch():
    r = scored_rollout()
    pairs = online_preference_batch(r)
    assert pairs.batch_size == torch.Size([2])  # the tied group is dropped
    chosen_idx, rejected_idx = [], []
    for p in (0, 2):
        s = r[K.SCORE][4 * p:4 * p + 4].tolist()
        chosen_idx.append(4 * p + s.index(max(s)))
        rejected_idx.append(4 * p + s.index(min(s)))
    for side, idx in ((K.CHOSEN, chosen_idx), (K.REJECTED, rejected_idx)):
        sub, src = pairs[side], r[idx]
        assert torch.equal(sub[K.INPUT_IDS], torch.cat([src[K.PROMPT_IDS], src[K.RESPONSE_IDS]], -1))
        assert torch.equal(sub[K.ATTENTION_MASK], torch.cat([src[K.PROMPT_MASK], src[K.RESPONSE_MASK]], -1))
        assert not sub[K.LOSS_MASK][:, :4].any() and torch.equal(sub[K.LOSS_MASK][:, 4:], src[K.RESPONSE_MASK])
        assert torch.equal(sub[K.SCORE], src[K.SCORE])
        for b in range(2):
            m = src[K.RESPONSE_MASK][b]
            assert sub[K.LOGPS][b].item() == pytest.approx(src[K.LOGPROBS][b][m].sum().item(), rel=1e-6)
            assert sub[K.REF_LOGPS][b].item() == pytest.approx(src[K.REF_LOGPROBS][b][m].sum().item(), rel=1e-6)
    assert (pairs[K.CHOSEN, K.SCORE] > pairs[K.REJECTED, K.SCORE]).all()
    loss, _ = dpo(pairs)  # any DPO variant can follow
    assert torch.isfinite(loss)


def test_online_preference_batch_pure_padding_invariant_and_without_logprobs():
    r = scored_rollout()
    assert_pure(online_preference_batch, r)
    assert_padding_invariant(online_preference_batch, r, mask_key=K.RESPONSE_MASK, fill=float("nan"))
    bare = r.exclude(K.LOGPROBS, K.REF_LOGPROBS)
    pairs = online_preference_batch(bare, num_groups=3)
    assert K.LOGPS not in pairs[K.CHOSEN].keys() and pairs.batch_size == torch.Size([2])


def test_bad_input_names_argument_and_shapes():
    with pytest.raises(ValueError, match=r"scores: expected a 2-d tensor \[P, G\].*got shape \[6\]"):
        best_worst_pairs(torch.randn(6))
    with pytest.raises(ValueError, match=r"group_id: expected shape \[6\].*got \[5\]"):
        best_worst_pairs(torch.randn(6), torch.zeros(5, dtype=torch.long))
    with pytest.raises(TypeError, match="group_id: expected an integer tensor"):
        best_worst_pairs(torch.randn(6), torch.zeros(6))
    with pytest.raises(TypeError, match="scores: expected a floating-point"):
        best_worst_pairs(torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(KeyError, match="online_preference_batch: batch is missing 'score'"):
        online_preference_batch(scored_rollout().exclude(K.SCORE))
