"""rlcore.algorithms: pure losses, one module per family (TensorDict in, ``(loss, metrics)`` out)."""

from importlib import import_module as _import_module

from rlcore.algorithms.ddpo import *  # noqa: F401,F403
from rlcore.algorithms.dpo import *  # noqa: F401,F403
from rlcore.algorithms.dpo_variants import *  # noqa: F401,F403
from rlcore.algorithms.online import *  # noqa: F401,F403
from rlcore.algorithms.policy_gradient import *  # noqa: F401,F403
from rlcore.algorithms.ppo import *  # noqa: F401,F403
from rlcore.algorithms.preference import *  # noqa: F401,F403
from rlcore.algorithms.ratios import *  # noqa: F401,F403
from rlcore.algorithms.reft import *  # noqa: F401,F403
from rlcore.algorithms.registry import *  # noqa: F401,F403
from rlcore.algorithms.reward import *  # noqa: F401,F403
from rlcore.algorithms.sft import *  # noqa: F401,F403

_MODULES = ('ddpo', 'dpo', 'dpo_variants', 'online', 'policy_gradient', 'ppo', 'preference', 'ratios', 'reft', 'registry', 'reward', 'sft')
__all__ = [name for m in _MODULES for name in _import_module(f"rlcore.algorithms.{m}").__all__]
