"""The cases of the float-range extremes, each written out: finite inputs near float32's largest
value (3.4e38) give finite losses, advantages and gradients (the fuzz harness covers every entry;
these pin the ones users met, with the value each should take)."""

import pytest
import torch

from rlcore.algorithms.dpo import dpo_loss
from rlcore.algorithms.dpo_variants import dpo_ipo_sum, dpo_sppo_hard
from rlcore.algorithms.ppo import clipped_value_loss, ppo_loss
from rlcore.baselines import grpo_advantage, rloo_advantage
from rlcore.masked import masked_mean, masked_sum, saturate, token_mean, wide, wide_sum
from rlcore.returns import gae
from rlcore.testing import make_rollout

BIG = torch.finfo(torch.float32).max


def _finite_with_grad(out, *leaves):
    assert torch.isfinite(out).all(), out
    grads = torch.autograd.grad(out.sum(), leaves, allow_unused=True)
    assert all(g is None or torch.isfinite(g).all() for g in grads), grads


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo_sum", "hinge", "robust"])
def test_dpo_loss_of_log_probs_near_the_edge_of_the_range(loss_type):
    cw = torch.tensor([-3e38, 0.0], requires_grad=True)
    rw = torch.tensor([3e38, -3e38], requires_grad=True)
    ref = torch.zeros(2)
    losses, chosen_rewards, rejected_rewards = dpo_loss(cw, rw, ref, ref, loss_type=loss_type, beta=0.1)
    _finite_with_grad(losses, cw, rw)
    assert torch.isfinite(chosen_rewards).all() and torch.isfinite(rejected_rewards).all()
    if loss_type == "sigmoid":  # −logσ(β·Δ) with Δ = −6e38: β·6e38 = 6e37, exactly representable
        torch.testing.assert_close(losses[0], torch.tensor(6e37), rtol=1e-6, atol=0)


def test_squared_variants_saturate_at_the_largest_value():
    one = torch.tensor([-3e38])
    assert dpo_ipo_sum(one, -one, torch.zeros(1), torch.zeros(1), beta=0.1) == BIG   # (6e38)² → largest float32
    assert dpo_sppo_hard(torch.tensor([2e30]), torch.tensor([-2e30]), torch.zeros(1), torch.zeros(1), beta=0.1) == BIG


def test_group_baselines_at_the_edge():
    adv = grpo_advantage(torch.tensor([[2e38, 2e38, 0.0, 0.0]]))
    torch.testing.assert_close(adv, torch.tensor([[0.866, 0.866, -0.866, -0.866]]), rtol=1e-3, atol=0)
    assert torch.isfinite(rloo_advantage(torch.tensor([[3e38, -3e38]]))).all()


def test_gae_of_rewards_near_the_edge():
    rewards = torch.full((1, 4), 3e38)
    adv, ret = gae(rewards, torch.zeros(1, 4), torch.ones(1, 4, dtype=torch.bool), gamma=1.0, lam=1.0)
    # the returns-to-go 4·3e38, 3·3e38, 2·3e38 pass the range: saturated; the last is 3e38
    assert (adv[0, :3] == BIG).all() and adv[0, 3] == torch.tensor(3e38) and torch.equal(ret, adv)
    adv, _ = gae(torch.tensor([[3e38, -3e38]]), torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool), gamma=1.0, lam=1.0)
    assert adv[0, 0] == 0 and adv[0, 1] == -3e38  # no inf − inf


def test_masked_reductions_accumulate_in_float64():
    x = torch.full((4,), 3e38, requires_grad=True)
    mask = torch.ones(4, dtype=torch.bool)
    assert masked_sum(x, mask) == BIG
    assert masked_mean(x, mask) == torch.tensor(3e38)  # exact, where a float32 sum gave inf / 4 = inf
    _finite_with_grad(token_mean(x[None], mask[None]), x)
    assert wide_sum({"a": torch.tensor(3e38), "b": torch.tensor(3e38)}) == BIG


def test_gradients_past_the_range_come_back_saturated():
    """∂(a·b)/∂a = b times an upstream factor: computed in float64, cast back to the leaf's dtype
    saturating (``wide``'s backward), never inf."""
    a = torch.tensor([1e30], requires_grad=True)
    out = saturate(wide(a) * 1e20, torch.float32)  # the value saturates: gradient 0
    (g,) = torch.autograd.grad(out.sum(), a)
    assert g == 0
    b = torch.tensor([1.0], requires_grad=True)
    (g,) = torch.autograd.grad((wide(b) * 1e300).sum(), b)
    assert g == BIG


def test_ppo_losses_of_huge_advantages_and_values():
    batch = make_rollout(3, 4).exclude("value_preds", "values")
    batch["advantages"] = torch.full((3, 4), 3e38)
    batch["logprobs"] = batch["old_logprobs"].clone().requires_grad_()
    loss, metrics = ppo_loss(batch)
    _finite_with_grad(loss, batch["logprobs"])
    assert all(torch.isfinite(v) for v in metrics.values())
    preds = torch.tensor([3e38], requires_grad=True)
    _finite_with_grad(clipped_value_loss(preds, torch.zeros(1), torch.tensor([-3e38])), preds)


def test_ppo_metrics_of_log_probs_near_the_edge():
    """The loss stayed finite at ±3e38 log-probs while lp − old overflowed in the KL metrics (k3: NaN)."""
    batch = make_rollout(2, 3).exclude("value_preds", "values")
    batch["logprobs"] = torch.tensor([[3e38, -3e38, 0.0], [-3e38, 0.0, 3e38]], requires_grad=True)
    batch["old_logprobs"] = torch.tensor([[-3e38, 3e38, 0.0], [0.0, -3e38, -3e38]])
    batch["response_mask"] = torch.ones(2, 3, dtype=torch.bool)
    batch["advantages"] = torch.tensor([[1.0, -1.0, 0.0], [-1.0, 1.0, -1.0]])
    loss, metrics = ppo_loss(batch, kl_coef=0.1)
    _finite_with_grad(loss, batch["logprobs"])
    assert all(torch.isfinite(v) for v in metrics.values()), dict(metrics.items())
    assert metrics["approx_kl_k3"] == BIG
