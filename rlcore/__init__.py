"""rlcore: post-training with RL and preference optimisation as pure functions on TensorDicts.

The functional core: masked reductions and loss aggregation, log-probs, KL estimators, returns and
advantage estimators, per-token rewards, and ``(init, update)`` state transforms. Everything here
is pure; models and data are touched only in ``rlcore.loops``; losses live in ``rlcore.algorithms``.
"""

from importlib import import_module as _import_module

from rlcore import keys
from rlcore.checks import *  # noqa: F401,F403
from rlcore.masked import *  # noqa: F401,F403
from rlcore.logprobs import *  # noqa: F401,F403
from rlcore.lm_head import *  # noqa: F401,F403
from rlcore.kl import *  # noqa: F401,F403
from rlcore.returns import *  # noqa: F401,F403
from rlcore.baselines import *  # noqa: F401,F403
from rlcore.rewards import *  # noqa: F401,F403
from rlcore.transforms import *  # noqa: F401,F403
from rlcore.seeding import *  # noqa: F401,F403

__version__ = "0.1.0"
_MODULES = ('checks', 'masked', 'logprobs', 'lm_head', 'kl', 'returns', 'baselines', 'rewards', 'transforms', 'seeding')
__all__ = ["keys", *(name for m in _MODULES for name in _import_module(f"rlcore.{m}").__all__)]
