"""update: accumulation equals the full-batch gradient, clipping, minibatch coverage, the
non-finite guard, early stop, autocast; optimiser and schedule factories."""

import dataclasses
import math

import pytest
import torch
from tensordict import TensorDict
from torch import nn

from rlcore import keys as K
from rlcore.checks import NonFiniteError
from rlcore.loops.state import TrainState, init_state
from rlcore.loops.update import (SCHEDULES, GradStep, chain, clip_by_global_norm, enable_gradient_checkpointing,
                                 global_denominators, make_optimizer, make_scheduler, nonfinite, raise_nonfinite,
                                 skip_nonfinite, stop_on, update)
from rlcore.masked import aggregate
from rlcore.testing import MockLM, assert_pure, make_rollout

DT = torch.float64


def response_logprobs(model, mb):
    """Log-probs of the response tokens through MockLM (prompt + response concatenated)."""
    ids = torch.cat([mb[K.PROMPT_IDS], mb[K.RESPONSE_IDS]], -1)
    attn = torch.cat([mb[K.PROMPT_MASK], mb[K.RESPONSE_MASK]], -1)
    logits = model(ids, attn).logits[:, mb[K.PROMPT_IDS].shape[1] - 1:-1]
    return logits.log_softmax(-1).gather(-1, mb[K.RESPONSE_IDS][..., None])[..., 0]


def make_loss(mode):
    def loss_fn(state, mb, **denominators):
        lp = response_logprobs(state.model(), mb)
        loss = aggregate(-lp, mb[K.RESPONSE_MASK], mode, **denominators)
        return loss, TensorDict({"loss_nll": loss.detach(), "rows": torch.tensor(float(mb.batch_size[0]))}, [])
    return loss_fn


def row_mean_loss(state, mb):
    """A per-row mean (DPO-like): no denominators, update weights the micro-batches by rows."""
    lp = response_logprobs(state.model(), mb)
    per_row = torch.where(mb[K.RESPONSE_MASK], -lp, 0.0).sum(-1)
    return per_row.mean(), {"loss_rows": per_row.mean().detach()}


def sgd_state(seed=0, dtype=DT, lr=1.0):
    model = MockLM(seed=seed).to(dtype)
    return init_state(model, optimizer=torch.optim.SGD(model.parameters(), lr=lr), seed=3)


def flat_params(state):
    return torch.cat([p.detach().reshape(-1).clone() for p in state.model().parameters()])


def rollout(B=8, dtype=DT, seed=1):
    return make_rollout(B, 6, 4, dtype=dtype, empty_rows=1, generator=torch.Generator().manual_seed(seed))


# --- accumulation -------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "seq_sum_norm"])
def test_accumulation_equals_the_full_batch_gradient(mode):
    batch = rollout()
    ref = sgd_state()
    loss, _ = make_loss(mode)(ref, batch)  # the reference: one backward over the whole batch
    loss.backward()
    expected = flat_params(ref) - torch.cat([p.grad.reshape(-1) for p in ref.model().parameters()])

    results = []
    for micro in (8, 2, 3):  # 1 micro-batch of 8, 4 of 2, uneven 3+3+2
        state = sgd_state()
        new, metrics = update(state, batch, make_loss(mode), micro_batch_size=micro, mask_key=K.RESPONSE_MASK,
                              transform=chain(skip_nonfinite()))
        results.append(flat_params(new))
        torch.testing.assert_close(metrics["loss"], loss.detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(metrics["loss_nll"], loss.detach(), rtol=1e-12, atol=1e-12)
        assert metrics["rows"] == micro if micro == 8 else metrics["rows"] < 8  # rows: a row-weighted mean
    for r in results:
        torch.testing.assert_close(r, expected, rtol=1e-12, atol=1e-12)


def test_accumulation_with_local_denominators_would_differ():
    """The test above can fail: a loss that ignores the global denominators gives another gradient."""
    batch = rollout()

    def local(state, mb, **ignored):
        return make_loss("token_mean")(state, mb)

    a, _ = update(sgd_state(), batch, local, micro_batch_size=8, mask_key=K.RESPONSE_MASK,
                  transform=chain(skip_nonfinite()))
    b, _ = update(sgd_state(), batch, local, micro_batch_size=2, mask_key=K.RESPONSE_MASK,
                  transform=chain(skip_nonfinite()))
    assert (flat_params(a) - flat_params(b)).abs().max() > 1e-6


def test_row_weighted_accumulation_without_mask_key():
    batch = rollout()
    ref = sgd_state()
    loss, _ = row_mean_loss(ref, batch)
    loss.backward()
    expected = flat_params(ref) - torch.cat([p.grad.reshape(-1) for p in ref.model().parameters()])
    for micro in (8, 2, 3):
        new, metrics = update(sgd_state(), batch, row_mean_loss, micro_batch_size=micro,
                              transform=chain(skip_nonfinite()))
        torch.testing.assert_close(flat_params(new), expected, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(metrics["loss_rows"], loss.detach(), rtol=1e-12, atol=1e-12)


def test_global_denominators_golden_and_pure():
    mask = torch.tensor([[True, True, False], [False, False, False], [True, False, False]])
    td = TensorDict({"m": mask}, [3])
    out = assert_pure(global_denominators, td, "m")
    assert out["num_tokens"] == 3 and out["num_seqs"] == 2
    empty = global_denominators(TensorDict({"m": torch.zeros(2, 3, dtype=torch.bool)}, [2]), "m")
    assert empty["num_tokens"] == 1 and empty["num_seqs"] == 1  # clamped, as in rlcore.masked
    assert global_denominators(td, None) == {}
    with pytest.raises(TypeError, match=r"batch\['m'\]: expected a torch.bool mask"):
        global_denominators(TensorDict({"m": mask.float()}, [3]), "m")


# --- clipping -----------------------------------------------------------------------------------
class Linear(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(2, dtype=DT))


def linear_state():
    m = Linear()
    return init_state(m, optimizer=torch.optim.SGD(m.parameters(), lr=1.0), seed=0)


def const_grad(c):
    c = torch.tensor(c, dtype=DT)
    return lambda state, mb: ((state.model().w * c).sum(), {})


def test_grad_clipping_golden():
    batch = TensorDict({"x": torch.zeros(4)}, [4])
    new, metrics = update(linear_state(), batch, const_grad([3.0, 4.0]),
                          transform=chain(skip_nonfinite(), clip_by_global_norm(1.0)))
    # ‖g‖ = 5, clip coefficient 1/(5 + 1e-6): w = -g·coef
    torch.testing.assert_close(new.model().w.detach(), -torch.tensor([3.0, 4.0], dtype=DT) / (5 + 1e-6))
    assert metrics["grad_norm"] == 5.0  # reported before clipping
    new, _ = update(linear_state(), batch, const_grad([0.3, 0.4]),
                    transform=chain(skip_nonfinite(), clip_by_global_norm(1.0)))
    torch.testing.assert_close(new.model().w.detach(), -torch.tensor([0.3, 0.4], dtype=DT))  # under the limit
    new, _ = update(linear_state(), batch, const_grad([3.0, 4.0]), transform=chain(skip_nonfinite()))
    torch.testing.assert_close(new.model().w.detach(), -torch.tensor([3.0, 4.0], dtype=DT))


# --- minibatches and epochs ---------------------------------------------------------------------
def test_every_row_once_per_epoch_and_shuffled():
    seen = []

    def loss_fn(state, mb):
        seen.append(mb["idx"].tolist())
        return (state.model().w.sum() * 0.0 + mb["x"].sum() * 0.0), {}

    batch = TensorDict({"idx": torch.arange(10), "x": torch.zeros(10)}, [10])
    state = linear_state()
    rng_before = state.rng.get_state()
    new, metrics = update(state, batch, loss_fn, minibatch_size=4, micro_batch_size=2, epochs=3)
    assert [len(s) for s in seen] == [2, 2, 2, 2, 2] * 3  # minibatches 4, 4, 2 cut in micro-batches of 2
    epochs = [sorted(sum(seen[i * 5:(i + 1) * 5], [])) for i in range(3)]
    assert epochs == [list(range(10))] * 3
    orders = [sum(seen[i * 5:(i + 1) * 5], []) for i in range(3)]
    assert orders[0] != orders[1] and orders[0] != list(range(10))
    assert new.optimizer_steps == 9 and metrics["optimizer_steps"] == 9 and new.policy_version == 1
    assert torch.equal(state.rng.get_state(), rng_before)  # the old state's generator is untouched
    assert not torch.equal(new.rng.get_state(), rng_before)
    seen.clear()
    update(state, batch, loss_fn, minibatch_size=4, micro_batch_size=2, epochs=3)
    assert [sum(seen[i * 5:(i + 1) * 5], []) for i in range(3)] == orders  # same state: same order


def test_one_minibatch_does_not_draw_from_the_generator():
    state = linear_state()
    new, _ = update(state, TensorDict({"x": torch.zeros(4)}, [4]), const_grad([1.0, 1.0]))
    assert new.rng is state.rng


def test_batch_is_not_written_and_state_counters():
    batch = rollout()
    before = batch.clone()
    state = sgd_state()
    new, metrics = update(state, batch, make_loss("token_mean"), minibatch_size=4, epochs=2, mask_key=K.RESPONSE_MASK)
    assert (batch == before).all() and set(batch.keys()) == set(before.keys())
    assert (new.optimizer_steps, new.policy_version, new.skipped_steps) == (4, 1, 0)
    assert (state.optimizer_steps, state.policy_version) == (0, 0)
    assert set(metrics.keys()) >= {"loss", "loss_nll", "grad_norm", "lr", "optimizer_steps", "skipped_steps",
                                   "early_stop"}
    assert all(v.ndim == 0 for v in metrics.values())


# --- early stop -------------------------------------------------------------------------------------
def test_early_stop_metric_ends_the_epochs_and_skips_that_step():
    calls = []

    def loss_fn(state, mb):
        calls.append(1)
        stop = torch.tensor(len(calls) == 2)  # second minibatch: "KL too large"
        return (state.model().w * 1.0).sum(), {"early_stop": stop}

    state = linear_state()
    new, metrics = update(state, TensorDict({"x": torch.zeros(8)}, [8]), loss_fn, minibatch_size=2, epochs=4,
                          transform=chain(skip_nonfinite(), stop_on("early_stop"), clip_by_global_norm(1.0)))
    assert len(calls) == 2 and new.optimizer_steps == 1 and metrics["early_stop"] == 1.0
    torch.testing.assert_close(new.model().w.detach(), -torch.ones(2, dtype=DT) / (math.sqrt(2) + 1e-6))


@pytest.mark.parametrize("flagged,steps", [((2,), 2), ((4,), 4), ((1, 3, 5, 7), 8), ((), 8)])
def test_epoch_check_reads_each_epochs_last_minibatch_after_its_steps(flagged, steps):
    """Legacy TRL PPO: the epoch's steps are all taken; only its last minibatch's flag ends the epochs."""
    calls = []

    def loss_fn(state, mb):
        calls.append(1)
        return (state.model().w * 1.0).sum(), {"early_stop": torch.tensor(len(calls) in flagged)}

    new, metrics = update(linear_state(), TensorDict({"x": torch.zeros(8)}, [8]), loss_fn, minibatch_size=4, epochs=4,
                          transform=chain(skip_nonfinite(), stop_on(when="epoch"), clip_by_global_norm(1.0)))
    assert len(calls) == steps and new.optimizer_steps == steps and new.skipped_steps == 0
    assert metrics["early_stop"] == float(steps < 8) and metrics["optimizer_steps"] == steps


def test_unknown_early_stop_check_is_refused():
    with pytest.raises(ValueError, match=r"when: unknown 'step'; valid: \['minibatch', 'epoch'\]"):
        stop_on("early_stop", when="step")


# --- non-finite guard ------------------------------------------------------------------------------
def nan_at(k, *, grad=False):
    """A loss that is NaN (or has an infinite gradient with a finite value) on call k."""
    calls = []

    def loss_fn(state, mb, **denominators):
        calls.append(1)
        loss, metrics = make_loss("token_mean")(state, mb, **denominators)
        if len(calls) == k:
            p = next(state.model().parameters())
            bad = torch.sqrt((p - p.detach()).sum()) if grad else torch.tensor(float("nan"), dtype=loss.dtype)
            loss = loss + bad
        return loss, metrics
    return loss_fn


def snapshot(state):
    opt = state.optimizer.state_dict()
    return (flat_params(state), {k: {n: v.clone() for n, v in s.items()} for k, s in opt["state"].items()},
            state.scheduler.state_dict())


@pytest.mark.parametrize("grad", [False, True], ids=["nan_loss", "inf_grad"])
def test_nonfinite_step_is_skipped_and_touches_nothing(grad):
    batch = rollout()
    model = MockLM().to(DT)
    opt = make_optimizer(model, lr=1e-2, weight_decay=0.1)
    state = init_state(model, optimizer=opt, scheduler=make_scheduler(opt, total_steps=10), seed=0)
    state, _ = update(state, batch, make_loss("token_mean"), mask_key=K.RESPONSE_MASK)  # Adam state exists
    before = snapshot(state)
    new, metrics = update(state, batch, nan_at(1, grad=grad), mask_key=K.RESPONSE_MASK)
    after = snapshot(new)
    assert torch.equal(before[0], after[0])  # bitwise
    assert before[1].keys() == after[1].keys()
    for k in before[1]:
        for n in before[1][k]:
            assert torch.equal(before[1][k][n], after[1][k][n]), (k, n)
    assert before[2] == after[2]
    assert all(p.grad is None for p in model.parameters())
    assert (new.skipped_steps, new.optimizer_steps, new.policy_version) == (1, 1, 1)
    assert metrics["skipped_steps"] == 1 and metrics["optimizer_steps"] == 0
    # the next good step goes on normally
    new, metrics = update(new, batch, make_loss("token_mean"), mask_key=K.RESPONSE_MASK)
    assert new.optimizer_steps == 2 and not torch.equal(flat_params(new), before[0])


def test_nonfinite_only_skips_the_bad_minibatch():
    state = sgd_state()
    new, metrics = update(state, rollout(), nan_at(2), minibatch_size=4, micro_batch_size=2,
                          mask_key=K.RESPONSE_MASK)  # call 2 is the second micro-batch of minibatch 1
    assert (new.skipped_steps, new.optimizer_steps) == (1, 1) and metrics["skipped_steps"] == 1


def test_nonfinite_raise_mode():
    state = sgd_state()
    before = flat_params(state)
    with pytest.raises(NonFiniteError, match="non-finite loss .* weights and optimiser state are unchanged"):
        update(state, rollout(), nan_at(1), mask_key=K.RESPONSE_MASK,
               transform=chain(raise_nonfinite(), clip_by_global_norm(1.0)))
    assert torch.equal(flat_params(state), before)
    assert all(p.grad is None for p in state.model().parameters())
    with pytest.raises(NonFiniteError, match="non-finite gradient"):
        update(state, rollout(), nan_at(1, grad=True), mask_key=K.RESPONSE_MASK,
               transform=chain(raise_nonfinite(), clip_by_global_norm(1.0)))


# --- gradient transforms ---------------------------------------------------------------------------
def grad_step(**fields):
    return GradStep(**{"params": [], "grad_norm": torch.tensor(1.0), "loss_finite": True, "grad_finite": True,
                       "stop": False, "where": "epoch 0, rows 0:8", **fields})


def test_chain_applies_in_order_and_the_first_veto_wins():
    seen = []

    def mark(name, outcome=None):
        return lambda step: seen.append(name) or outcome

    assert chain(mark("a"), None, mark("b"), mark("c"))(grad_step()) is None and seen == ["a", "b", "c"]
    seen.clear()
    assert chain(mark("a"), mark("b", "skipped"), mark("c", "stopped"))(grad_step()) == "skipped" and seen == ["a", "b"]
    seen.clear()
    assert chain(chain(mark("a"), mark("b", "stopped")), mark("c", "skipped"))(grad_step()) == "stopped"
    assert seen == ["a", "b"]
    flagged_nan = grad_step(loss_finite=False, stop=True)
    assert chain(skip_nonfinite(), stop_on())(flagged_nan) == "skipped"
    assert chain(stop_on(), skip_nonfinite())(flagged_nan) == "stopped"
    assert chain(stop_on(when="epoch"), skip_nonfinite())(grad_step(stop=True)) is None  # epoch: read by update


def test_transforms_see_the_norm_before_clipping_and_a_veto_drops_the_step():
    batch, norms = TensorDict({"x": torch.zeros(4)}, [4]), []
    new, metrics = update(linear_state(), batch, const_grad([3.0, 4.0]),
                          transform=chain(clip_by_global_norm(1.0), lambda s: norms.append(float(s.grad_norm))))
    assert norms == [5.0] and metrics["grad_norm"] == 5.0
    torch.testing.assert_close(new.model().w.detach(), -torch.tensor([3.0, 4.0], dtype=DT) / (5 + 1e-6))
    state = linear_state()
    new, metrics = update(state, batch, const_grad([3.0, 4.0]), transform=chain(lambda s: "skipped"))
    assert (new.skipped_steps, new.optimizer_steps, new.policy_version) == (1, 0, 0)
    assert torch.equal(new.model().w.detach(), torch.zeros(2, dtype=DT))
    assert all(p.grad is None for p in state.model().parameters())


def test_default_transform_is_the_explicit_chain_and_the_plain_step_bitwise():
    def fresh():
        model = MockLM()
        opt = make_optimizer(model, lr=1e-2, weight_decay=0.1)
        return init_state(model, optimizer=opt, scheduler=make_scheduler(opt, total_steps=10), seed=0)

    def big(state, mb, **denominators):  # a gradient norm past 1: the clip acts
        loss, metrics = make_loss("token_mean")(state, mb, **denominators)
        return loss * 100, metrics

    batch, runs = rollout(dtype=torch.float32), []
    for kw in ({}, {"transform": chain(skip_nonfinite(), clip_by_global_norm(1.0))}):
        state = fresh()
        for _ in range(2):
            state, metrics = update(state, batch, big, minibatch_size=4, micro_batch_size=2, epochs=2,
                                    mask_key=K.RESPONSE_MASK, **kw)
        runs.append((flat_params(state), metrics, state.optimizer.state_dict()["state"]))
    (p0, m0, s0), (p1, m1, s1) = runs
    assert torch.equal(p0, p1) and all(torch.equal(m0[k], m1[k]) for k in m0.keys()) and m0["grad_norm"] > 1
    assert all(torch.equal(s0[i][n], s1[i][n]) for i in s0 for n in s0[i])

    # one step of the default against the plain step: backward, global-norm clip, AdamW, scheduler
    state, metrics = update(fresh(), batch, big, mask_key=K.RESPONSE_MASK)
    ref = fresh()
    params = [p for g in ref.optimizer.param_groups for p in g["params"]]
    big(ref, batch, **global_denominators(batch, K.RESPONSE_MASK))[0].backward()
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    torch.nn.utils.clip_grads_with_norm_(params, 1.0, norm)
    ref.optimizer.step()
    ref.scheduler.step()
    assert torch.equal(flat_params(state), flat_params(ref)) and torch.equal(metrics["grad_norm"], norm.double())


def test_transform_arguments_name_themselves():
    for bad in (None, 0, -1.0, float("nan"), True, "1.0"):
        with pytest.raises(ValueError, match=r"max_norm: expected a number > 0 \(leave clip_by_global_norm out"):
            clip_by_global_norm(bad)
    with pytest.raises(ValueError, match=r"mode: unknown non-finite mode 'ignore'; valid: \['skip', 'raise'\]"):
        nonfinite("ignore")
    assert nonfinite("skip") is skip_nonfinite() and nonfinite("raise") is raise_nonfinite()
    with pytest.raises(ValueError, match=r"when: unknown 'step'; valid: \['minibatch', 'epoch'\]"):
        stop_on(when="step")
    with pytest.raises(ValueError, match="key: expected a metric name"):
        stop_on("")
    with pytest.raises(TypeError, match=r"transforms\[1\]: expected a callable GradStep -> outcome \| None, got 1.0"):
        chain(skip_nonfinite(), 1.0)
    state, batch = linear_state(), TensorDict({"x": torch.zeros(2)}, [2])
    with pytest.raises(TypeError, match="transform: expected a callable"):
        update(state, batch, const_grad([1.0, 1.0]), transform=[skip_nonfinite()])
    with pytest.raises(ValueError, match="transform: more than one stop_on in the chain"):
        update(state, batch, const_grad([1.0, 1.0]), transform=chain(stop_on(), chain(stop_on("kl"))))
    with pytest.raises(ValueError, match=r"transform: returned 'maybe' at epoch 0, rows 0:2; expected None or one "
                                         r"of \['skipped', 'stopped'\]"):
        update(state, batch, const_grad([1.0, 1.0]), transform=lambda s: "maybe")
    assert all(p.grad is None for p in state.model().parameters())


# --- autocast ------------------------------------------------------------------------------------------
def test_bf16_autocast_runs_on_cpu():
    dtypes = []

    def loss_fn(state, mb, **denominators):
        ids = torch.cat([mb[K.PROMPT_IDS], mb[K.RESPONSE_IDS]], -1)
        logits = state.model()(ids).logits
        dtypes.append(logits.dtype)
        return make_loss("token_mean")(state, mb, **denominators)

    model = MockLM()
    state = init_state(model, optimizer=make_optimizer(model, lr=1e-3), seed=0)
    before = flat_params(state)
    new, metrics = update(state, rollout(dtype=torch.float32), loss_fn, mask_key=K.RESPONSE_MASK,
                          autocast_dtype=torch.bfloat16)
    assert dtypes == [torch.bfloat16]  # the forward ran under autocast
    assert math.isfinite(float(metrics["loss"])) and new.optimizer_steps == 1
    assert all(p.dtype == torch.float32 for p in model.parameters())  # master weights stay fp32
    assert not torch.equal(flat_params(new), before)
    # bf16 loss within a loose tolerance of the fp32 one (bf16 has ~3 significant digits)
    _, m32 = update(init_state(MockLM(), optimizer=make_optimizer(MockLM(), lr=1e-3)), rollout(dtype=torch.float32),
                    make_loss("token_mean"), mask_key=K.RESPONSE_MASK)
    torch.testing.assert_close(metrics["loss"], m32["loss"], rtol=2e-2, atol=0)


# --- argument errors ---------------------------------------------------------------------------------
def test_bad_arguments_name_themselves():
    state, batch, fn = sgd_state(), rollout(), make_loss("token_mean")
    with pytest.raises(ValueError, match=r"minibatch_size: expected an int in \[1, 8\].*got 9"):
        update(state, batch, fn, minibatch_size=9)
    with pytest.raises(ValueError, match=r"micro_batch_size: expected an int in \[1, 4\].*got 5"):
        update(state, batch, fn, minibatch_size=4, micro_batch_size=5)
    with pytest.raises(ValueError, match="epochs: expected a positive int, got 0"):
        update(state, batch, fn, epochs=0)
    with pytest.raises(TypeError, match="transform: expected a callable"):
        update(state, batch, fn, transform="clip")
    with pytest.raises(ValueError, match="state.optimizer: update needs an optimiser"):
        update(TrainState(models={"policy": MockLM()}), batch, fn)
    with pytest.raises(ValueError, match="state.rng: shuffling"):
        m = MockLM()
        update(TrainState(models={"policy": m}, optimizer=torch.optim.SGD(m.parameters(), lr=1.0)), batch, fn,
               minibatch_size=4)
    with pytest.raises(ValueError, match="batch: expected a TensorDict with batch_size"):
        update(state, TensorDict({}, []), fn)


# --- optimiser and schedules -----------------------------------------------------------------------
def test_make_optimizer_groups():
    model = MockLM()
    model.pos.weight.requires_grad_(False)
    opt = make_optimizer({"a": model, "b": model}, lr=0.1, weight_decay=0.05, betas=(0.8, 0.9), eps=1e-6)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.05 and no_decay["weight_decay"] == 0.0
    assert all(p.ndim >= 2 for p in decay["params"]) and all(p.ndim < 2 for p in no_decay["params"])
    ids = [id(p) for g in opt.param_groups for p in g["params"]]
    assert len(ids) == len(set(ids)) == sum(1 for p in model.parameters() if p.requires_grad)
    assert decay["betas"] == (0.8, 0.9) and decay["eps"] == 1e-6 and isinstance(opt, torch.optim.AdamW)
    single = make_optimizer(list(model.parameters()), lr=0.1, weight_decay=0.1)
    assert len(single.param_groups) == 1 and len(single.param_groups[0]["params"]) == 4
    with pytest.raises(ValueError, match="params: no trainable parameter"):
        make_optimizer(nn.Linear(2, 2).requires_grad_(False), lr=0.1)


def test_schedules_golden():
    lin = [SCHEDULES["linear"](s, warmup_steps=2, total_steps=10) for s in (0, 1, 2, 6, 10, 12)]
    assert lin == [0.0, 0.5, 1.0, 0.5, 0.0, 0.0]
    cos = [SCHEDULES["cosine"](s, warmup_steps=0, total_steps=4) for s in (0, 1, 2, 4, 5)]
    assert cos == pytest.approx([1.0, 0.5 * (1 + math.cos(math.pi / 4)), 0.5, 0.0, 0.0])
    assert [SCHEDULES["constant"](s, warmup_steps=4, total_steps=0) for s in (0, 2, 4, 100)] == [0.0, 0.5, 1.0, 1.0]
    with pytest.raises(ValueError, match=r"kind: unknown schedule 'step'; valid: \['constant', 'cosine', 'linear'\]"):
        make_scheduler(make_optimizer(nn.Linear(2, 2), lr=1.0), total_steps=3, kind="step")
    with pytest.raises(ValueError, match="total_steps: the 'linear' schedule needs"):
        make_scheduler(make_optimizer(nn.Linear(2, 2), lr=1.0))


def test_scheduler_steps_once_per_optimizer_step_and_lr_metric():
    m = Linear()
    opt = make_optimizer(m, lr=2.0)
    state = init_state(m, optimizer=opt, scheduler=make_scheduler(opt, total_steps=8, warmup_steps=2), seed=0)
    batch = TensorDict({"x": torch.zeros(4)}, [4])
    lrs = []
    for _ in range(3):
        state, metrics = update(state, batch, const_grad([1.0, 0.0]), minibatch_size=2)
        lrs.append(float(metrics["lr"]))
    # optimiser steps 0..5, two per update: the lr of the last step taken is reported
    assert lrs == [2.0 * 0.5, 2.0 * SCHEDULES["linear"](3, warmup_steps=2, total_steps=8),
                   2.0 * SCHEDULES["linear"](5, warmup_steps=2, total_steps=8)]
    assert opt.param_groups[0]["lr"] == 2.0 * SCHEDULES["linear"](6, warmup_steps=2, total_steps=8)


def test_enable_gradient_checkpointing():
    class HasIt(nn.Module):
        enabled = False

        def gradient_checkpointing_enable(self):
            self.enabled = True

    m = HasIt()
    assert enable_gradient_checkpointing(m) and m.enabled
    assert not enable_gradient_checkpointing(MockLM())


def test_trained_models_are_in_train_mode_inside_update_only():
    """Dropout as the model defines it while it learns (TRL); eval mode restored for everything else."""
    state = linear_state()
    frozen = torch.nn.Dropout(0.5).eval()
    state = dataclasses.replace(state, models={**state.models, "frozen": frozen})
    state.model().eval()
    seen = []

    def loss_fn(state, mb):
        seen.append((state.model().training, state.model("frozen").training))
        return (state.model().w * 1.0).sum(), {}

    update(state, TensorDict({"x": torch.zeros(4)}, [4]), loss_fn, minibatch_size=2)
    assert seen == [(True, False)] * 2
    assert not state.model().training and not frozen.training


def test_a_chain_holds_one_clip_and_transforms_pickle():
    """Two clips would each scale by the norm from before any transform (compounding): refused,
    nested chains included. The built-in transforms survive pickling (sent to Ray actors)."""
    import pickle

    from rlcore.loops.update import chain, clip_by_global_norm, skip_nonfinite, stop_on

    with pytest.raises(ValueError, match="more than one clip_by_global_norm"):
        chain(clip_by_global_norm(1.0), clip_by_global_norm(0.5))
    with pytest.raises(ValueError, match="more than one clip_by_global_norm"):
        chain(chain(skip_nonfinite(), clip_by_global_norm(1.0)), clip_by_global_norm(0.5))
    full = chain(skip_nonfinite(), stop_on("early_stop"), clip_by_global_norm(0.5))
    assert pickle.loads(pickle.dumps(full)) == full
