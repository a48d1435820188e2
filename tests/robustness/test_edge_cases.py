"""Documented exceptions to "finite in, finite out", and regressions for the bugs the fuzzing found.

The fuzz entries keep these inputs out of their domains; here each one is pinned exactly, so a
change of behaviour is a decision, not an accident.
"""

import dataclasses
import importlib
import math
import shutil

import pytest
import torch
from tensordict import TensorDict

from rlcore import keys as K
from rlcore.kl import kl_estimate, kl_k3
from rlcore.masked import masked_var, masked_whiten, seq_sum_norm
from rlcore.rewards import compute_rewards
from rlcore.testing import make_preference_batch
from rlcore.transforms import adaptive_kl_init, adaptive_kl_update, observed_kl

dpo = importlib.import_module("rlcore.algorithms.dpo")
preference = importlib.import_module("rlcore.algorithms.preference")
online = importlib.import_module("rlcore.algorithms.online")
ddpo = importlib.import_module("rlcore.algorithms.ddpo")
reward = importlib.import_module("rlcore.algorithms.reward")
sft = importlib.import_module("rlcore.algorithms.sft")

DTYPES = [torch.float64, torch.float32, torch.bfloat16]


# --- documented exceptions ---------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_k3_saturates_instead_of_overflowing_and_clamp_bounds_it(dtype):
    """rlcore.kl: k3 grows like e^(ref − lp): past the dtype's range it is the largest finite value
    (computed in float64, the exponent capped at 700, cast back saturating), never inf or NaN, and
    its gradient stays finite; ``clamp`` bounds it."""
    lp = torch.tensor([-1000.0, -1.0], dtype=dtype, requires_grad=True)
    ref = torch.tensor([-1.0, -1.0], dtype=dtype)
    value = kl_k3(lp, ref)
    big = torch.finfo(dtype).max
    assert torch.isfinite(value).all() and value[1] == 0
    assert value[0] == big if dtype != torch.float64 else value[0] > 1e300
    assert torch.isfinite(torch.autograd.grad(value.sum(), lp)[0]).all()
    assert torch.equal(kl_estimate(lp, ref, "low_var_kl"), value)
    assert kl_k3(lp, ref, clamp=20.0)[0] < 1e9
    rewards, kl = compute_rewards(torch.tensor([1.0], dtype=dtype), lp[None].detach(), ref[None],
                                  torch.ones(1, 2, dtype=torch.bool), kl="k3")
    assert torch.isfinite(rewards).all() and rewards[0, 0] < -1e30
    rewards, _ = compute_rewards(torch.tensor([1.0], dtype=dtype), lp[None].detach(), ref[None],
                                 torch.ones(1, 2, dtype=torch.bool), kl="k3", clamp=20.0)
    assert torch.isfinite(rewards).all() and rewards[0, 0] > -1e9


def test_log1mexp_at_and_above_zero():
    """rlcore.algorithms.preference.log1mexp: −inf at 0, NaN above (not a log-probability)."""
    out = preference.log1mexp(torch.tensor([0.0, 1.0, -1e-30, -1e4], dtype=torch.float64))
    assert out[0] == -math.inf and torch.isnan(out[1]) and torch.isfinite(out[2:]).all()


def test_a_deterministic_ddim_step_has_no_density():
    """rlcore.algorithms.ddpo: σ = 0 (η = 0, t = 0 with ᾱ' = ᾱ_0, or ᾱ' = 1 at the last step)."""
    x = torch.zeros(1, 1, 2, 2)
    assert not torch.isfinite(ddpo.ddim_step_logprob(x + 1, x, 0.0)).all()
    alphas = torch.cumprod(1 - torch.linspace(1e-4, 0.02, 10), 0)
    common = dict(alphas_cumprod=alphas, num_train_timesteps=10, num_inference_steps=5, prev_sample=x)
    assert torch.isnan(ddpo.ddim_step(x, 0, x, final_alpha_cumprod=alphas[0], **common)[1]).all()
    assert not torch.isfinite(ddpo.ddim_step(x + 1, 1, x, final_alpha_cumprod=1.0, **common)[1]).all()
    assert not torch.isfinite(ddpo.ddim_step(x + 1, 5, x, final_alpha_cumprod=alphas[0], eta=0.0, **common)[1]).all()
    assert torch.isfinite(ddpo.ddim_step(x + 1, 1, x, final_alpha_cumprod=alphas[0], **common)[1]).all()


def test_sft_perplexity_overflows_but_the_loss_does_not():
    batch = TensorDict({K.LOGPROBS: torch.full((1, 2), -1e3), K.LOSS_MASK: torch.ones(1, 2, dtype=torch.bool)}, [1])
    loss, metrics = sft.sft_loss(batch)
    assert loss == 1e3 and metrics["perplexity"] == math.inf


def _empty_preference_batch():
    return make_preference_batch(2)[:0]


@pytest.mark.parametrize("name, call", [
    ("dpo", lambda: dpo.dpo(_empty_preference_batch())),
    ("simpo", lambda: preference.simpo(_empty_preference_batch())),
    ("cpo", lambda: preference.cpo(_empty_preference_batch())),
    ("kto", lambda: preference.kto(TensorDict({k: torch.zeros(0) for k in (K.LOGPS, K.REF_LOGPS, K.KL_LOGPS,
                                                                            K.REF_KL_LOGPS)}
                                              | {K.LABELS: torch.zeros(0, dtype=torch.bool)}, [0]))),
    ("reward_loss", lambda: reward.reward_loss(TensorDict({K.CHOSEN: {K.REWARD: torch.zeros(0)},
                                                          K.REJECTED: {K.REWARD: torch.zeros(0)}}, [0]))),
    ("ddpo_loss", lambda: ddpo.ddpo_loss(TensorDict({K.LOGPROBS: torch.zeros(0), K.OLD_LOGPROBS: torch.zeros(0),
                                                     K.ADVANTAGES: torch.zeros(0)}, [0]))),
])
def test_batch_mean_losses_of_an_empty_batch_are_nan(name, call):
    """Losses that average over the rows of the batch (not over a mask) give 0/0 = NaN for B = 0,
    as torch's own reductions do; ``update``'s guard then skips the step. A loop that can build an
    empty batch (online DPO when every group ties) should skip it instead."""
    loss, metrics = call()
    assert loss.shape == () and torch.isnan(loss)


def test_masked_losses_of_an_empty_batch_are_zero():
    batch = TensorDict({K.LOGPROBS: torch.zeros(0, 3), K.LOSS_MASK: torch.zeros(0, 3, dtype=torch.bool)}, [0])
    assert sft.sft_loss(batch)[0] == 0
    assert preference.orpo(_empty_preference_batch())[0] == 0  # NLL and odds ratio are masked means


def test_adaptive_kl_coefficient_can_turn_negative_past_five_horizons():
    """Documented in adaptive_kl_update: β·(1 + e·n/h) with e = −0.2 is negative once n > 5h."""
    state = adaptive_kl_update(adaptive_kl_init(0.2), torch.tensor(0.0), 60000, target=6.0, horizon=10000)
    assert state.coef < 0
    lp, mask = torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"^kl_coef: expected a finite number >= 0, got -"):  # never used as a β
        compute_rewards(torch.zeros(1), lp, lp, mask, kl_coef=state.coef)
    assert adaptive_kl_update(adaptive_kl_init(0.2), torch.tensor(0.0), 40000, horizon=10000).coef > 0


# --- regressions: bugs found and fixed ---------------------------------------------------------
def test_masked_var_and_whiten_reject_a_broadcastable_mask():
    x, mask = torch.randn(5), torch.ones(3, 5, dtype=torch.bool)
    for fn in (masked_var, masked_whiten):
        with pytest.raises(ValueError, match=r"mask: expected shape \[5\] \(the shape of values\), got \[3, 5\]"):
            fn(x, mask)
        with pytest.raises(TypeError, match="mask: expected a torch.bool mask"):
            fn(x, torch.ones(5))


def test_seq_sum_norm_of_a_width_zero_batch_is_zero():
    assert seq_sum_norm(torch.zeros(3, 0), torch.zeros(3, 0, dtype=torch.bool)) == 0


def test_observed_kl_names_its_argument():
    with pytest.raises(ValueError, match=r"mask: expected shape \[2, 3\] \(the shape of kl\)"):
        observed_kl(torch.zeros(2, 3), torch.ones(2, 4, dtype=torch.bool))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge", "discopop", "sigmoid_norm"])
def test_forward_kl_dpo_is_finite_for_very_unlikely_completions(dtype, loss_type):
    lw = torch.tensor([-1e4, -5.0, -1e4], dtype=dtype, requires_grad=True)
    ll = torch.tensor([-1e4, -1e4, -3.0], dtype=dtype, requires_grad=True)
    ref = torch.full((3,), -4.0, dtype=dtype)
    losses, _, _ = dpo.dpo_loss(lw, ll, ref, ref, loss_type=loss_type, divergence="forward_kl",
                                chosen_lengths=torch.tensor([9, 3, 9]), rejected_lengths=torch.tensor([9, 9, 2]))
    losses.sum().backward()
    assert torch.isfinite(lw.grad).all() and torch.isfinite(ll.grad).all()
    if loss_type == "ipo" and dtype != torch.float64:  # documented: the square of a capped score overflows
        assert not torch.isnan(losses).any()
    else:
        assert torch.isfinite(losses).all()
    unchanged, _, _ = dpo.dpo_loss(lw[1:2].detach(), ll[2:3].detach(), ref[:1], ref[:1], divergence="forward_kl")
    s = lambda r: 1 - math.exp(-r)  # noqa: E731 - the uncapped score where it does not overflow
    torch.testing.assert_close(unchanged.double(), -torch.nn.functional.logsigmoid(
        torch.tensor(0.1 * (s(-1.0) - s(1.0)), dtype=torch.float64))[None], rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_alphapo_rewards_are_finite_for_very_negative_log_probs(dtype):
    lp = torch.tensor([-1e4, -1e4, -2.0], dtype=dtype, requires_grad=True)
    assert torch.isfinite(preference.alphapo_reward(lp, alpha=1.0)).all()
    loss = preference.cpo_loss(lp, lp.flip(0), alpha=0.5).sum() + preference.simpo_loss(lp, lp.flip(0), alpha=0.5).sum()
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(lp.grad).all()
    torch.testing.assert_close(preference.alphapo_reward(torch.tensor([-1.0]), alpha=0.5), torch.tensor([-1.2974]),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES)
def test_odds_ratio_of_certain_completions_is_finite(dtype):
    """A mean log-prob of exactly 0 (all tokens certain) gave inf − inf = NaN."""
    w = torch.tensor([0.0, 0.0, -0.5], dtype=dtype, requires_grad=True)
    l = torch.tensor([0.0, -2.0, 0.0], dtype=dtype, requires_grad=True)
    losses, log_odds = preference.odds_ratio_loss(w, l, beta=1.0)
    losses.sum().backward()
    assert torch.isfinite(losses).all() and torch.isfinite(log_odds).all()
    assert torch.isfinite(w.grad).all() and torch.isfinite(l.grad).all()
    assert losses[1] < 1e-3 < losses[2]  # certain chosen: no loss; certain rejected: a large one
    ref, _ = preference.odds_ratio_loss(torch.tensor([-0.5]), torch.tensor([-2.0]), beta=1.0)
    torch.testing.assert_close(ref, torch.tensor([0.0967]), rtol=1e-3, atol=1e-4)  # unchanged elsewhere


def test_dpo_helpers_check_their_shapes_and_keys():
    with pytest.raises(ValueError, match=r"rejected_rewards: expected shape \[3\]"):
        dpo.preference_metrics(torch.zeros(3), torch.zeros(2), torch.zeros(3), torch.zeros(3))
    batch = make_preference_batch(2)
    flat = batch.clone()
    flat.set((K.CHOSEN, K.LOSS_MASK), batch.get((K.CHOSEN, K.LOSS_MASK))[:, 0])
    with pytest.raises(ValueError, match=r"chosen.loss_mask: expected a 2-d tensor \[B, T\], got shape \[2\]"):
        dpo.completion_lengths(flat, K.CHOSEN)
    with pytest.raises(KeyError, match="loss_mask"):
        dpo.completion_lengths(batch.exclude((K.REJECTED, K.LOSS_MASK)), K.REJECTED)


def test_online_preference_batch_checks_the_rollout_shapes():
    from rlcore.testing import make_rollout
    rollout = make_rollout(4, 3, 2, group_size=2)
    rollout.set(K.SCORE, torch.arange(4.0))
    bad = rollout.clone()
    bad.set(K.PROMPT_IDS, rollout.get(K.PROMPT_IDS)[:, :1])
    with pytest.raises(ValueError, match=r"prompt_mask: expected shape \[4, 1\] \(the shape of prompt_ids\)"):
        online.online_preference_batch(bad)
    bad = rollout.clone()
    bad.set(K.RESPONSE_IDS, rollout.get(K.RESPONSE_IDS)[:, 0])
    with pytest.raises(ValueError, match="response_ids: expected a 2-d tensor"):
        online.online_preference_batch(bad)
    assert online.online_preference_batch(rollout).batch_size == (2,)


def test_ddim_step_checks_timestep_and_final_alpha_shapes():
    alphas = torch.cumprod(1 - torch.linspace(1e-4, 0.02, 10), 0)
    x = torch.zeros(2, 1, 2, 2)
    common = dict(alphas_cumprod=alphas, num_train_timesteps=10, num_inference_steps=5, prev_sample=x)
    with pytest.raises(ValueError, match=r"timestep: expected a scalar or the leading shape \[2\], got \[3\]"):
        ddpo.ddim_step(x, torch.tensor([1, 2, 3]), x, final_alpha_cumprod=alphas[0], **common)
    with pytest.raises(ValueError, match=r"final_alpha_cumprod: expected a float or a 0-d tensor, got shape \[1\]"):
        ddpo.ddim_step(x, 3, x, final_alpha_cumprod=alphas[:1], **common)
    one = ddpo.ddim_step(x, torch.tensor([3]), x, final_alpha_cumprod=alphas[0], **common)[1]  # [1] broadcasts
    torch.testing.assert_close(one, ddpo.ddim_step(x, 3, x, final_alpha_cumprod=alphas[0], **common)[1])


def test_ddim_step_logprob_std_may_not_widen_the_sample():
    x = torch.zeros(1, 1, 2, 2)
    with pytest.raises(ValueError, match=r"std: shape \[2, 1, 1, 1\] does not broadcast to the sample shape "
                                         r"\[1, 1, 2, 2\]"):
        ddpo.ddim_step_logprob(x, x, torch.ones(2))
    assert ddpo.ddim_step_logprob(x, x, torch.ones(1)).shape == (1,)


# --- hyper-parameters checked by the functions themselves; DDPO's ratio bounded -------------------
def test_ddpo_ratio_of_far_apart_log_probs_is_finite():
    """exp(lp − old) overflowed: ddpo_ratio_loss([100.], [0.], [0.]) was NaN, loss and gradient."""
    lp = torch.tensor([100.0], requires_grad=True)
    loss = ddpo.ddpo_ratio_loss(lp, torch.zeros(1), torch.zeros(1))
    loss.sum().backward()
    assert loss.item() == 0 and lp.grad.item() == 0
    batch = TensorDict({K.LOGPROBS: torch.tensor([0.0, -3e38]), K.OLD_LOGPROBS: torch.tensor([-3e38, 0.0]),
                        K.ADVANTAGES: torch.tensor([-1.0, 1.0])}, [2])
    loss, metrics = ddpo.ddpo_loss(batch)
    assert torch.isfinite(loss) and all(torch.isfinite(v) for v in metrics.values())


def test_compute_rewards_refuses_a_per_token_or_nan_kl_coef():
    """A [T] β was broadcast over the tokens; a NaN one made every reward NaN."""
    lp, mask = torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"^kl_coef: expected a float or a 0-d tensor, got a tensor of shape \[3\]"):
        compute_rewards(torch.zeros(2), lp, lp, mask, kl_coef=torch.full((3,), 0.1))
    for bad in (float("nan"), torch.tensor(float("nan"))):
        with pytest.raises(ValueError, match=r"^kl_coef: expected a finite number >= 0, got nan"):
            compute_rewards(torch.zeros(2), lp, lp, mask, kl_coef=bad)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge", "apo_zero"])
@pytest.mark.parametrize("beta", [0.0, -0.1, float("nan")])
def test_dpo_refuses_a_beta_that_is_not_positive(loss_type, beta):
    """β ≤ 0 trained toward the rejected answer (the config layer refused it, the function did not)."""
    x = torch.zeros(2)
    with pytest.raises(ValueError, match=rf"^beta: expected a finite number > 0, got {beta}"):
        dpo.dpo_loss(x, x, x, x, beta=beta, loss_type=loss_type, chosen_lengths=x, rejected_lengths=x)
    with pytest.raises(ValueError, match=r"^beta: "):
        dpo.dpo(make_preference_batch(2), beta=beta, loss_type=loss_type)


def test_ddpo_and_policy_losses_refuse_negative_or_nan_clip_settings():
    x = torch.zeros(2)
    with pytest.raises(ValueError, match=r"^adv_clip_max: expected a number \(inf allowed\) >= 0, got -1.0"):
        ddpo.ddpo_ratio_loss(x, x, x, adv_clip_max=-1.0)
    with pytest.raises(ValueError, match=r"^clip_range: expected a finite number >= 0, got nan"):
        ddpo.ddpo_ratio_loss(x, x, x, clip_range=float("nan"))
    from rlcore.algorithms.policy_gradient import grpo_loss
    from rlcore.testing import make_rollout
    for kw in (dict(clip_eps_low=-0.2), dict(clip_eps_high=float("nan"))):
        with pytest.raises(ValueError, match=rf"^{next(iter(kw))}: expected"):
            grpo_loss(make_rollout(2, 3).update({K.ADVANTAGES: torch.ones(2, 3)}), **kw)


def test_a_checkpoint_set_aside_by_an_interrupted_re_save_still_counts(tmp_path):
    from rlcore.loops.checkpoint import latest_checkpoint, list_checkpoints, resume, save_checkpoint
    from tests.robustness.test_checkpoint_faults import assert_is_step, make_state
    for step in (1, 2):
        save_checkpoint(tmp_path, make_state(step))
    shutil.move(tmp_path / "checkpoint-2", tmp_path / ".old-checkpoint-2-0123abcd")  # killed between renames
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-1", ".old-checkpoint-2-0123abcd"]
    assert latest_checkpoint(tmp_path).name == ".old-checkpoint-2-0123abcd"
    assert_is_step(resume(tmp_path, make_state(), restore_global_rng=False), 2)
    save_checkpoint(tmp_path, dataclasses.replace(make_state(3)))  # the next save puts it back
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
