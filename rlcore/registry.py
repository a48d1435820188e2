"""Registries: plain dicts of functions, one signature per registry, and a lookup that helps.

- ``ADVANTAGE_ESTIMATORS``: ``(batch, **hyper) -> batch`` adding ``advantages`` and ``returns``
  ``[B, R]`` (hyper-parameters bound once with ``functools.partial``; no caller branches on names).
- ``KL_ESTIMATORS``: ``(logprobs, ref_logprobs, *, clamp=None) -> kl`` per token ``[..., T]``.
- ``AGGREGATIONS``: ``(values, mask, *, num_tokens=None, num_seqs=None, max_length=None) -> []``.
- ``KL_CONTROLLERS``: ``(init, update)`` pairs of the KL coefficient state.
"""

from __future__ import annotations

from rlcore.checks import lookup  # noqa: F401 -- re-exported
from rlcore.baselines import (with_dr_grpo_advantage, with_grpo_advantage, with_reinforce_pp_advantage,
                              with_remax_advantage, with_rloo_advantage)
from rlcore.kl import KL_ESTIMATORS  # noqa: F401 -- re-exported
from rlcore.masked import AGGREGATIONS  # noqa: F401 -- re-exported
from rlcore.returns import with_gae
from rlcore.transforms import KL_CONTROLLERS  # noqa: F401 -- re-exported

# KL_ESTIMATORS, AGGREGATIONS, KL_CONTROLLERS and lookup are re-exported from their home modules.
__all__ = ["ADVANTAGE_ESTIMATORS"]

ADVANTAGE_ESTIMATORS = {
    "gae": with_gae,
    "rloo": with_rloo_advantage,
    "grpo": with_grpo_advantage,
    "dr_grpo": with_dr_grpo_advantage,
    "reinforce_pp": with_reinforce_pp_advantage,
    "remax": with_remax_advantage,
}
