"""rlcore.checks: the validated scope (checks skipped inside, once at the boundary)."""

import threading
from collections import Counter

import pytest
import torch
from tensordict import TensorDict

import rlcore.algorithms.ppo as ppo
import rlcore.checks as checks
import rlcore.kl as kl
import rlcore.masked as masked
from rlcore.checks import check_float, check_mask, validated
from rlcore.testing import make_rollout


def test_validated_skips_checks_nests_and_restores_on_error():
    bad = torch.zeros(2)
    with validated():
        with validated():
            check_mask("m", bad)
        check_mask("m", bad)
    with pytest.raises(TypeError, match="m: expected a torch.bool mask"):
        check_mask("m", bad)
    with pytest.raises(RuntimeError), validated():
        raise RuntimeError("inside")
    with pytest.raises(TypeError, match="x: expected a floating-point tensor"):
        check_float("x", torch.zeros(2, dtype=torch.long))


def test_validated_is_per_thread():
    seen = []

    def other():
        try:
            check_mask("m", torch.zeros(2))
        except TypeError as e:
            seen.append(e)

    with validated():
        t = threading.Thread(target=other)
        t.start()
        t.join()
    assert len(seen) == 1


def _counting(monkeypatch):
    """Count the checks that run (outside a validated scope) per argument name, in the modules
    ppo_loss reaches."""
    counts = Counter()

    def spy(fn):
        def wrapped(name, *args, **kwargs):
            if not checks._trusted():
                for checked in ([*kwargs] if fn is checks.check_same_shape else [name]):
                    counts[(fn.__name__, checked)] += 1
            return fn(name, *args, **kwargs)
        return wrapped

    for module in (ppo, masked, kl):
        for fn in (checks.check_float, checks.check_mask, checks.check_same_shape, checks.check_ndim):
            if hasattr(module, fn.__name__):
                monkeypatch.setattr(module, fn.__name__, spy(fn))
    return counts


def test_ppo_loss_checks_each_input_once(monkeypatch):
    batch = make_rollout(3, 5).update({"advantages": torch.randn(3, 5), "entropy": torch.rand(3, 5),
                                       "value_preds": torch.randn(3, 5), "returns": torch.randn(3, 5)})
    batch["logprobs"] = batch["old_logprobs"] + 0.1
    counts = _counting(monkeypatch)
    ppo.ppo_loss(batch, kl_coef=0.1, entropy_coef=0.01)
    floats = {name for (fn, name) in counts if fn == "check_float"}
    assert floats == {"logprobs", "old_logprobs", "advantages", "entropy", "ref_logprobs", "value_preds",
                      "returns", "values"}
    assert all(n == 1 for n in counts.values()), counts
    assert counts[("check_mask", "response_mask")] == 1


def test_ppo_loss_still_names_a_bad_key_after_the_boundary_moved():
    batch = make_rollout(3, 5).exclude("value_preds").update({"advantages": torch.randn(3, 5)})
    with pytest.raises(ValueError, match=r"advantages: expected shape \[3, 5\]"):
        ppo.ppo_loss(batch.copy().set("advantages", torch.randn(3, 4)))
    with pytest.raises(TypeError, match="entropy: expected a floating-point tensor"):
        ppo.ppo_loss(batch.copy().set("entropy", torch.ones(3, 5, dtype=torch.long)))
    with pytest.raises(KeyError, match="ref_logprobs"):
        ppo.ppo_loss(batch.exclude("ref_logprobs"), kl_coef=0.1)
    with pytest.raises(ValueError, match=r"response_mask: expected at least 1 dims \[B, R\]"):
        ppo.ppo_loss(TensorDict({k: v.reshape(-1)[0] for k, v in batch.items()}, batch_size=[]))
