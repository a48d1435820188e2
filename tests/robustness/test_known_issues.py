"""Bugs found by the fuzzing in modules still being written by their owners: reported, not fixed here.

Each is a strict xfail: when the owner fixes it the test passes, the xfail turns into a failure,
and the mark (and the matching ``known=`` / domain restriction in the fuzz entries) should go.
"""

import importlib

import pytest
import torch
from tensordict import TensorDict

from rlcore import keys as K

ppo = importlib.import_module("rlcore.algorithms.ppo")
ratios = importlib.import_module("rlcore.algorithms.ratios")
baselines = importlib.import_module("rlcore.baselines")
logprobs = importlib.import_module("rlcore.logprobs")
lm_head = importlib.import_module("rlcore.lm_head")

F32 = torch.float32


def reported(reason: str):
    return pytest.mark.xfail(strict=True, reason=f"reported: {reason}")


def test_clipped_surrogate_zero_advantage_and_huge_ratio_is_not_nan():
    """Fixed: each side of the surrogate is evaluated on the log-ratio clamped to its active bound."""
    log_ratio = torch.tensor([100.0, 100.0], requires_grad=True)
    out = ppo.clipped_surrogate(log_ratio, torch.tensor([0.0, 1.0]))
    out.loss.sum().backward()
    assert torch.isfinite(out.loss).all() and torch.isfinite(log_ratio.grad).all()


def test_ppo_loss_zero_advantage_and_huge_log_ratio_is_not_nan():
    mask = torch.ones(1, 2, dtype=torch.bool)
    batch = TensorDict({K.LOGPROBS: torch.tensor([[-1.0, -2.0]]), K.OLD_LOGPROBS: torch.tensor([[-200.0, -2.0]]),
                        K.ADVANTAGES: torch.tensor([[0.0, 1.0]]), K.RESPONSE_MASK: mask}, [1])
    loss, _ = ppo.ppo_loss(batch)
    assert torch.isfinite(loss)


def test_ppo_loss_on_an_empty_rollout():
    z = torch.zeros(2, 0)
    batch = TensorDict({K.LOGPROBS: z, K.OLD_LOGPROBS: z, K.ADVANTAGES: z,
                        K.RESPONSE_MASK: torch.zeros(2, 0, dtype=torch.bool)}, [2])
    loss, metrics = ppo.ppo_loss(batch)
    assert loss == 0


@pytest.mark.parametrize("level", ["token", "sequence", "sequence_sum"])
def test_ratio_levels_check_their_inputs(level):
    fn = ratios.RATIO_LEVELS[level]
    with pytest.raises(ValueError, match="old_logprobs"):
        fn(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(TypeError, match="mask"):
        fn(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3))


def test_ratio_stats_checks_its_mask():
    with pytest.raises(ValueError, match="mask"):
        ppo.ratio_stats(torch.zeros(2, 3, 1), torch.ones(2, 3, 3, dtype=torch.bool))
    with pytest.raises(TypeError, match="mask"):
        ppo.ratio_stats(torch.zeros(2, 3), torch.ones(2, 3))


def test_explained_variance_checks_predictions():
    with pytest.raises(ValueError, match="predictions"):
        ppo.explained_variance(torch.zeros(3), torch.zeros(2), torch.ones(2, dtype=torch.bool))


def test_ppo_metrics_finite_with_log_ratio_clamp():
    mask = torch.ones(1, 2, dtype=torch.bool)
    batch = TensorDict({K.LOGPROBS: torch.tensor([[-1.0, -2.0]]), K.OLD_LOGPROBS: torch.tensor([[-1.0, -500.0]]),
                        K.ADVANTAGES: torch.tensor([[1.0, -1.0]]), K.RESPONSE_MASK: mask}, [1])
    loss, metrics = ppo.ppo_loss(batch, log_ratio_clamp=20.0)
    assert torch.isfinite(loss)
    assert all(torch.isfinite(v) for v in metrics.values())


def test_broadcast_to_tokens_needs_a_time_dim():
    with pytest.raises(ValueError, match="mask"):
        baselines.broadcast_to_tokens(torch.tensor(1.0), torch.tensor(True))


def test_remax_names_baseline_scores():
    with pytest.raises(ValueError, match="baseline_scores"):
        baselines.remax_advantage(torch.zeros(2, 3), torch.zeros(3), torch.ones(2, 3, dtype=torch.bool))


def test_token_logprobs_empty_vocabulary():
    with pytest.raises(ValueError, match="logits"):
        logprobs.token_logprobs(torch.zeros(2, 0), torch.zeros(2, dtype=torch.long))


def test_hidden_logprobs_zero_rows():
    out = lm_head.hidden_logprobs(torch.zeros(0, 3), torch.zeros(4, 3), torch.zeros(0, dtype=torch.long))
    assert out.shape == (0,)
