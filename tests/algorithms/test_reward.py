"""Bradley–Terry reward modelling: plain reference, TRL parity, identities, the batch loss."""

import math
from collections import defaultdict
from functools import partial
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from rlcore import keys as K
from rlcore.algorithms.dpo import dpo_loss
from rlcore.algorithms.reward import bradley_terry_loss, reward_loss
from rlcore.testing import assert_pure, right_padded_mask
from tests.algorithms.conformance import check_loss_conformance


def rewards(B=6, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple((torch.randn(B, generator=g, dtype=torch.float64) * 3).to(dtype) for _ in range(3))


def plain_bt(rw, rl, m):
    out = []
    for a, b, c in zip(rw, rl, m):
        x = a - b - c
        out.append(math.log1p(math.exp(-x)) if x >= 0 else -x + math.log1p(math.exp(x)))
    return out


def reward_batch(B=5, T=6, dtype=torch.float64, seed=0):
    rw, rl, m = rewards(B, dtype, seed)
    g = torch.Generator().manual_seed(seed)

    def side(r):
        mask = right_padded_mask(torch.randint(1, T + 1, (B,), generator=g), T)
        return {K.INPUT_IDS: torch.randint(0, 32, (B, T), generator=g), K.ATTENTION_MASK: mask, K.REWARD: r}

    return TensorDict({K.CHOSEN: side(rw), K.REJECTED: side(rl), "margin": m.abs()}, batch_size=[B])


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-6), (torch.bfloat16, 3e-2)])
def test_against_plain_formula(dtype, tol):
    rw, rl, m = rewards(dtype=dtype)
    got = bradley_terry_loss(rw, rl, margin=m)
    assert got.dtype == dtype and got.shape == rw.shape
    want = plain_bt(*(x.double().tolist() for x in (rw, rl, m)))
    torch.testing.assert_close(got.double(), torch.tensor(want, dtype=torch.float64), rtol=tol, atol=tol)


def test_golden_values_and_scalar_margin():
    got = bradley_terry_loss(torch.tensor([2.0, 0.0]), torch.tensor([1.0, 0.0]), margin=1.0)
    torch.testing.assert_close(got, torch.tensor([math.log(2), math.log1p(math.e)]))


def test_margin_zero_is_dpo_sigmoid_with_beta_one_on_rewards():
    rw, rl, _ = rewards()
    zero = torch.zeros_like(rw)
    bt = bradley_terry_loss(rw, rl)
    torch.testing.assert_close(bt, bradley_terry_loss(rw, rl, margin=zero))
    torch.testing.assert_close(bt, dpo_loss(rw, rl, zero, zero, beta=1.0)[0])


@settings(max_examples=30, deadline=None)
@given(st.floats(-20, 20), st.floats(-20, 20), st.floats(0, 5))
def test_shift_invariant_and_margin_raises_loss(a, b, m):
    rw, rl = torch.tensor([a], dtype=torch.float64), torch.tensor([b], dtype=torch.float64)
    base = bradley_terry_loss(rw, rl)
    torch.testing.assert_close(bradley_terry_loss(rw + 3.5, rl + 3.5), base)
    assert bradley_terry_loss(rw, rl, margin=m) >= base


def test_gradcheck_and_purity():
    rw, rl, m = rewards(seed=1)
    rw, rl = rw.requires_grad_(True), rl.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda a, b: bradley_terry_loss(a, b, margin=m), (rw, rl))
    assert_pure(bradley_terry_loss, rw.detach(), rl.detach(), margin=m)
    assert_pure(partial(reward_loss, margin_key="margin", center_rewards_coefficient=0.01), reward_batch())


def test_reward_loss_batch():
    b = reward_batch()
    loss, m = reward_loss(b, margin_key="margin", center_rewards_coefficient=0.1)
    rw, rl, mg = b[K.CHOSEN, K.REWARD], b[K.REJECTED, K.REWARD], b["margin"]
    bt = sum(plain_bt(rw.tolist(), rl.tolist(), mg.tolist())) / 5
    center = 0.1 * sum((x + y) ** 2 for x, y in zip(rw.tolist(), rl.tolist())) / 5
    assert m["loss_bt"].item() == pytest.approx(bt, rel=1e-12)
    assert m["loss_center"].item() == pytest.approx(center, rel=1e-12)
    assert loss.item() == pytest.approx(bt + center, rel=1e-12)
    assert m["accuracy"].item() == pytest.approx(float((rw > rl).double().mean()))
    torch.testing.assert_close(m["margin"], (rw - rl).mean())
    torch.testing.assert_close(m["rewards/chosen"], rw.mean())
    assert set(reward_loss(b)[1].keys()) == {"loss_bt", "accuracy", "margin", "rewards/chosen", "rewards/rejected"}


@pytest.mark.trl
@pytest.mark.parametrize("margin", [None, "margin"])
@pytest.mark.parametrize("center", [None, 0.01])
def test_matches_trl(margin, center):
    pytest.importorskip("trl")
    from trl.trainer.reward_trainer import RewardTrainer

    b = reward_batch(dtype=torch.float32, seed=2)
    logits = torch.cat([b[K.CHOSEN, K.REWARD], b[K.REJECTED, K.REWARD]])[:, None]
    stub = RewardTrainer.__new__(RewardTrainer)
    stub.__dict__.update(model=SimpleNamespace(training=False),
                         args=SimpleNamespace(center_rewards_coefficient=center),
                         accelerator=SimpleNamespace(gather=lambda x: x, gather_for_metrics=lambda x: x),
                         _metrics=defaultdict(lambda: defaultdict(list)), _total_train_tokens=0, _tp_size=1)
    inputs = {"input_ids": torch.zeros(10, 3, dtype=torch.long), "attention_mask": torch.ones(10, 3)}
    if margin:
        inputs["margin"] = b["margin"]
    want = RewardTrainer.compute_loss(stub, lambda **_: SimpleNamespace(logits=logits), inputs)
    got, _ = reward_loss(b, margin_key=margin, center_rewards_coefficient=center)
    torch.testing.assert_close(got, want)


def test_conformance():
    check_loss_conformance(partial(reward_loss, margin_key="margin", center_rewards_coefficient=0.01),
                           reward_batch(), mask_key=[(K.CHOSEN, K.ATTENTION_MASK), (K.REJECTED, K.ATTENTION_MASK)],
                           grad_keys=[(K.CHOSEN, K.REWARD), (K.REJECTED, K.REWARD)])


def test_bad_input_names_argument_and_shapes():
    rw, rl, m = rewards()
    with pytest.raises(ValueError, match=r"rejected_rewards: expected shape \[6\].*got \[6, 1\]"):
        bradley_terry_loss(rw, rl[:, None])
    with pytest.raises(ValueError, match=r"margin: expected shape \[6\].*got \[2\]"):
        bradley_terry_loss(rw, rl, margin=m[:2])
    with pytest.raises(TypeError, match="chosen_rewards: expected a floating-point"):
        bradley_terry_loss(rw.long(), rl)
    b = reward_batch()
    with pytest.raises(KeyError, match=r"reward_loss: batch is missing .*mg.* \[B\] float"):
        reward_loss(b, margin_key="mg")
    del b[K.REJECTED][K.REWARD]
    with pytest.raises(KeyError, match=r"reward_loss: batch is missing .*rejected.*reward"):
        reward_loss(b)
