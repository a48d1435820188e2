"""Every registry of rlcore and rlcore.algorithms: plain dicts of functions, one signature each.

Each registry lives beside its functions; ``REGISTRIES`` lists them all by name, so one table shows
what can be chosen by name. ``rlcore.lookup(registry, name, what=...)`` reads any of them, naming
the valid keys on a miss.

The core (``rlcore``):

- ``ADVANTAGE_ESTIMATORS`` (``rlcore.baselines``): ``(batch, **hyper) -> batch`` adding
  ``advantages`` and ``returns`` ``[B, R]``; the policy-gradient recipes select one by name
  (``advantage:``) with its keywords (``advantage_kwargs``).
- ``GRPO_SCALES`` (``rlcore.baselines``): ``(scores, centred, count, group_sum, eps) -> advantages``,
  the divisor of the group-centred scores (``grpo_advantage(scale=)``).
- ``KL_ESTIMATORS`` (``rlcore.kl``): ``(logprobs, ref_logprobs, *, clamp=None) -> kl`` per token
  ``[..., T]`` (``KL_ALIASES`` there gives the peers' names for them).
- ``AGGREGATIONS`` (``rlcore.masked``):
  ``(values, mask, *, num_tokens=None, num_seqs=None, max_length=None) -> []``.
- ``KL_CONTROLLERS`` (``rlcore.transforms``): ``(init, update)`` pairs of the KL coefficient state.
- ``KL_REDUCTIONS`` (``rlcore.transforms``): ``(kl [..., T], mask) -> []``, the controller's observed KL.

The losses (``rlcore.algorithms``):

- ``POLICY_LOSSES`` (``policy_gradient``): ``(batch, **hyper) -> (loss, metrics)``.
- ``RATIO_LEVELS`` (``ratios``): ``(logprobs, old_logprobs, mask) -> log_ratio [..., T]``.
- ``SURROGATES`` (``ppo``): ``(log_ratio, logprobs, advantages, *, clip_eps_low, clip_eps_high,
  clip_ratio_c, **surrogate_keywords) -> Surrogate``.
- ``DPO_LOSSES`` (``dpo_variants``): ``(chosen_logps, rejected_logps, ref_chosen_logps,
  ref_rejected_logps, *, beta, ...) -> losses [B]``.
- ``F_DIVERGENCES`` (``dpo_variants``): ``(logratio, *, alpha) -> score``, f-DPO's ``f'(π/π_ref)``
  as a function of ``ρ = log π − log π_ref``.
- ``PREFERENCE_LOSSES`` (``preference``): ``(batch, **hyper) -> (loss, metrics)``, the DPO family
  by TRL's ``loss_type`` and ORPO / SimPO / CPO / AlphaPO / KTO.
- ``DDIM_PREDICTIONS`` (``ddpo``): ``(model_output, sample, alpha_t) -> (x_0, ε)``.
- ``REFT_INTERVENTIONS`` (``reft``): ``(h, rotation, weight, bias, *, act) -> h'``, or
  ``(h, rotation, bias)`` for those of ``CONSTANT_SOURCE``.

>>> from rlcore import lookup
>>> sorted(lookup(REGISTRIES, "RATIO_LEVELS", what="registry"))
['sequence', 'sequence_sum', 'token']
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rlcore.algorithms.ddpo import DDIM_PREDICTIONS
from rlcore.algorithms.dpo_variants import DPO_LOSSES, F_DIVERGENCES
from rlcore.algorithms.policy_gradient import POLICY_LOSSES
from rlcore.algorithms.ppo import SURROGATES
from rlcore.algorithms.preference import PREFERENCE_LOSSES
from rlcore.algorithms.ratios import RATIO_LEVELS
from rlcore.algorithms.reft import REFT_INTERVENTIONS
from rlcore.baselines import ADVANTAGE_ESTIMATORS, GRPO_SCALES
from rlcore.kl import KL_ESTIMATORS
from rlcore.masked import AGGREGATIONS
from rlcore.transforms import KL_CONTROLLERS, KL_REDUCTIONS

__all__ = ["REGISTRIES"]

REGISTRIES: dict[str, Mapping[str, Any]] = {
    "ADVANTAGE_ESTIMATORS": ADVANTAGE_ESTIMATORS,
    "GRPO_SCALES": GRPO_SCALES,
    "KL_ESTIMATORS": KL_ESTIMATORS,
    "AGGREGATIONS": AGGREGATIONS,
    "KL_CONTROLLERS": KL_CONTROLLERS,
    "KL_REDUCTIONS": KL_REDUCTIONS,
    "POLICY_LOSSES": POLICY_LOSSES,
    "RATIO_LEVELS": RATIO_LEVELS,
    "SURROGATES": SURROGATES,
    "DPO_LOSSES": DPO_LOSSES,
    "F_DIVERGENCES": F_DIVERGENCES,
    "PREFERENCE_LOSSES": PREFERENCE_LOSSES,
    "DDIM_PREDICTIONS": DDIM_PREDICTIONS,
    "REFT_INTERVENTIONS": REFT_INTERVENTIONS,
}
