"""The test helpers must catch what they claim to catch."""

import pytest
import torch
from tensordict import TensorDict

from rlcore import keys as K
from rlcore.masked import masked_mean
from rlcore.testing import (MockLM, assert_padding_invariant, assert_pure, left_padded_mask, make_preference_batch,
                            make_rollout, right_padded_mask)


def test_assert_pure_catches_in_place_write_even_if_values_restored():
    def sneaky(x):
        x.add_(1.0)
        x.sub_(1.0)
        return x.sum()

    with pytest.raises(AssertionError, match="written in place"):
        assert_pure(sneaky, torch.ones(3))


def test_assert_pure_catches_td_set_and_nondeterminism():
    def adds_key(td):
        td.set("extra", torch.zeros(2))
        return td["a"].sum()

    with pytest.raises(AssertionError, match="gained or lost keys"):
        assert_pure(adds_key, TensorDict({"a": torch.ones(2)}, batch_size=[2]))

    state = {"n": 0}

    def counter(x):
        state["n"] += 1
        return x * state["n"]

    with pytest.raises(AssertionError, match="second call differs"):
        assert_pure(counter, torch.ones(2))


def test_assert_pure_rewinds_generators():
    g = torch.Generator().manual_seed(1)
    out = assert_pure(lambda x, gen: x + torch.rand(x.shape, generator=gen), torch.zeros(3), g)
    assert out.shape == (3,)


def test_assert_padding_invariant_catches_unmasked_reduction():
    batch = make_rollout(4, 5)
    good = lambda td: masked_mean(td[K.REWARDS], td[K.RESPONSE_MASK])  # noqa: E731
    bad = lambda td: td[K.REWARDS].mean()  # noqa: E731
    assert_padding_invariant(good, batch, fill=float("nan"))
    with pytest.raises(AssertionError, match="padding changed the output"):
        assert_padding_invariant(bad, batch)


def test_masks_and_factories():
    lengths = torch.tensor([0, 2, 3])
    assert right_padded_mask(lengths, 3).tolist() == [[False] * 3, [True, True, False], [True] * 3]
    assert left_padded_mask(lengths, 3).tolist() == [[False] * 3, [False, True, True], [True] * 3]
    r = make_rollout(6, 5, group_size=3, empty_rows=1)
    assert r[K.GROUP_ID].tolist() == [0, 0, 0, 1, 1, 1]
    assert not r[K.RESPONSE_MASK][-1].any() and r[K.RESPONSE_MASK][:-1].any(-1).all()
    assert r[K.PROMPT_MASK][:, -1].all()  # left padded: last prompt column always real
    p = make_preference_batch(3, 8)
    assert p[K.CHOSEN, K.LOGPS].shape == (3,)
    assert not (p[K.CHOSEN, K.LOSS_MASK] & ~p[K.CHOSEN, K.ATTENTION_MASK]).any()
    with pytest.raises(ValueError, match="batch_size"):
        make_rollout(5, 3, group_size=2)


def test_mock_lm_left_and_right_padding_agree():
    lm = MockLM(vocab_size=11, hidden_size=8)
    ids = torch.tensor([[3, 4, 5, 6]])
    full = lm(ids).logits
    right = lm(torch.tensor([[3, 4, 5, 6, 0, 0]]), torch.tensor([[1, 1, 1, 1, 0, 0]]).bool()).logits
    left = lm(torch.tensor([[0, 0, 3, 4, 5, 6]]), torch.tensor([[0, 0, 1, 1, 1, 1]]).bool()).logits
    torch.testing.assert_close(right[:, :4], full)
    torch.testing.assert_close(left[:, 2:], full)
    # causal: a later token never changes an earlier output
    changed = lm(torch.tensor([[3, 4, 5, 9]])).logits
    torch.testing.assert_close(changed[:, :3], full[:, :3])
