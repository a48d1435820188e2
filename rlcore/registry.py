"""Registries: plain dicts of functions, one signature per registry, and a lookup that helps.

Each registry lives beside its functions and is re-exported here, the one place that lists them:

- ``ADVANTAGE_ESTIMATORS`` (``rlcore.baselines``): ``(batch, **hyper) -> batch`` adding
  ``advantages`` and ``returns`` ``[B, R]``; the policy-gradient recipes select one by name
  (``advantage:``) with its keywords (``advantage_kwargs``).
- ``KL_ESTIMATORS`` (``rlcore.kl``): ``(logprobs, ref_logprobs, *, clamp=None) -> kl`` per token ``[..., T]``.
- ``AGGREGATIONS`` (``rlcore.masked``): ``(values, mask, *, num_tokens=None, num_seqs=None, max_length=None) -> []``.
- ``KL_CONTROLLERS`` (``rlcore.transforms``): ``(init, update)`` pairs of the KL coefficient state.

``lookup`` (``rlcore.checks``) reads any of them, naming the valid keys on a miss.
"""

from __future__ import annotations

from rlcore.baselines import ADVANTAGE_ESTIMATORS  # noqa: F401 -- re-exported
from rlcore.checks import lookup  # noqa: F401 -- re-exported
from rlcore.kl import KL_ESTIMATORS  # noqa: F401 -- re-exported
from rlcore.masked import AGGREGATIONS  # noqa: F401 -- re-exported
from rlcore.transforms import KL_CONTROLLERS  # noqa: F401 -- re-exported

__all__: list[str] = []  # every name here is re-exported from its home module
