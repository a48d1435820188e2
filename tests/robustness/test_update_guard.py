"""The non-finite guard of ``update`` where tests/loops/test_update.py does not reach.

That file covers a NaN loss and an infinite gradient in a one-micro-batch step, and counts the
steps when the second micro-batch is bad. Here: the bad micro-batch first, in the middle or last
of an accumulation of three; NaN, +inf and −inf losses and an infinite gradient under a finite
loss; the good micro-batches' gradients must not leak into the next step (weights and AdamW state
compared bitwise with a run that never saw the bad minibatch); raise mode mid-accumulation;
a finite gradient whose norm overflows; every step bad.
"""

import pytest
import torch
from tensordict import TensorDict
from torch import nn

from rlcore.checks import NonFiniteError
from rlcore.loops.state import init_state
from rlcore.loops.update import (chain, clip_by_global_norm, make_optimizer, make_scheduler, raise_nonfinite,
                                  skip_nonfinite, update)

KINDS = ("nan", "inf", "-inf", "inf_grad")


def make_state(dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    model = nn.Linear(3, 1).to(dtype)
    opt = make_optimizer(model, lr=1e-2, weight_decay=0.1)
    return init_state(model, optimizer=opt, scheduler=make_scheduler(opt, total_steps=10), seed=1)


def make_batch(n=12, dtype=torch.float64):
    g = torch.Generator().manual_seed(7)
    return TensorDict({"x": torch.randn(n, 3, generator=g, dtype=dtype), "y": torch.randn(n, generator=g, dtype=dtype)},
                      [n])


def mse(state, mb):
    pred = state.model()(mb["x"]).squeeze(-1)
    loss = (pred - mb["y"]).square().mean()
    return loss, {"loss_mse": loss.detach()}


def poisoned(bad_calls: set[int], kind: str):
    """``mse`` whose ``k``-th call (from 0) is made non-finite for every ``k`` in ``bad_calls``."""
    calls = []

    def loss_fn(state, mb):
        loss, metrics = mse(state, mb)
        if len(calls) in bad_calls:
            w = state.model().weight
            if kind == "inf_grad":  # value 0, gradient 1/(2·sqrt(0)) = inf
                loss = loss + torch.sqrt((w - w.detach()).sum())
            else:
                loss = loss + float(kind)
        calls.append(1)
        return loss, metrics

    return loss_fn


def snapshot(state):
    params = [p.detach().clone() for p in state.model().parameters()]
    opt = {k: {n: v.clone() if torch.is_tensor(v) else v for n, v in s.items()}
           for k, s in state.optimizer.state_dict()["state"].items()}
    return params, opt, state.scheduler.state_dict()


def assert_same_snapshot(a, b):
    for x, y in zip(a[0], b[0]):
        assert torch.equal(x, y)
    assert a[1].keys() == b[1].keys()
    for k in a[1]:
        for n in a[1][k]:
            assert torch.equal(torch.as_tensor(a[1][k][n]), torch.as_tensor(b[1][k][n])), (k, n)
    assert a[2] == b[2]


@pytest.mark.parametrize("position", [0, 1, 2], ids=["first", "middle", "last"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_bad_micro_batch_drops_its_whole_step_and_nothing_leaks(kind, position):
    batch = make_batch()
    # minibatches of 6 rows (rows 0:6, then 6:12), micro-batches of 2: calls 0-2, then 3-5
    state, metrics = update(make_state(), batch, poisoned({position}, kind), minibatch_size=6, micro_batch_size=2,
                            shuffle=False)
    reference, _ = update(make_state(), batch[6:], mse, minibatch_size=6, micro_batch_size=2, shuffle=False)
    assert (state.skipped_steps, state.optimizer_steps, state.policy_version) == (1, 1, 1)
    assert metrics["skipped_steps"] == 1 and metrics["optimizer_steps"] == 1
    assert all(p.grad is None for p in state.model().parameters())
    assert_same_snapshot(snapshot(state), snapshot(reference))  # the good micro-batches of step 1 left no trace


@pytest.mark.parametrize("kind", KINDS)
def test_raise_mode_mid_accumulation_leaves_everything_untouched(kind):
    state = make_state()
    before = snapshot(state)
    with pytest.raises(NonFiniteError, match="the step was not taken"):
        update(state, make_batch(), poisoned({1}, kind), minibatch_size=6, micro_batch_size=2, shuffle=False,
               transform=chain(raise_nonfinite(), clip_by_global_norm(1.0)))
    assert_same_snapshot(before, snapshot(state))
    assert all(p.grad is None for p in state.model().parameters())


def test_every_step_bad_changes_nothing_over_epochs():
    state = make_state()
    before = snapshot(state)
    new, metrics = update(state, make_batch(), poisoned(set(range(100)), "nan"), minibatch_size=4, micro_batch_size=2,
                          epochs=3)
    assert (new.skipped_steps, new.optimizer_steps, new.policy_version) == (9, 0, 0)
    assert_same_snapshot(before, snapshot(new))
    assert metrics["skipped_steps"] == 9 and metrics["optimizer_steps"] == 0


def test_a_finite_gradient_whose_norm_overflows_never_reaches_the_weights():
    """float32 gradients of ~1e25: each is finite, their squared norm is not."""
    state = make_state(torch.float32)
    before = snapshot(state)

    def huge(state, mb):
        loss, metrics = mse(state, mb)
        return loss * 1e25, metrics

    new, metrics = update(state, make_batch(dtype=torch.float32), huge,
                          transform=chain(skip_nonfinite(), clip_by_global_norm(1.0)))
    params = [p.detach() for p in new.model().parameters()]
    assert all(torch.isfinite(p).all() for p in params)
    for group in new.optimizer.state_dict()["state"].values():
        assert all(torch.isfinite(torch.as_tensor(v)).all() for v in group.values())
    if new.skipped_steps:  # the guard's verdict: skipped, nothing changed
        assert_same_snapshot(before, snapshot(new))
    else:  # or clipped to a finite step
        assert float(metrics["grad_norm"]) > 1e20
