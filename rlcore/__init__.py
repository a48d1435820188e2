"""rlcore: post-training with RL and preference optimisation as pure functions on TensorDicts.

The functional core: masked reductions and loss aggregation, log-probs, KL estimators, returns and
advantage estimators, per-token rewards, and ``(init, update)`` state transforms. Everything here
is pure; models and data are touched only in ``rlcore.loops``; losses live in ``rlcore.algorithms``.
"""

from rlcore import keys
from rlcore import checks as _checks
from rlcore import masked as _masked
from rlcore import logprobs as _logprobs
from rlcore import kl as _kl
from rlcore import returns as _returns
from rlcore import baselines as _baselines
from rlcore import rewards as _rewards
from rlcore import transforms as _transforms
from rlcore import registry as _registry
from rlcore import seeding as _seeding
from rlcore.checks import *  # noqa: F401,F403
from rlcore.masked import *  # noqa: F401,F403
from rlcore.logprobs import *  # noqa: F401,F403
from rlcore.kl import *  # noqa: F401,F403
from rlcore.returns import *  # noqa: F401,F403
from rlcore.baselines import *  # noqa: F401,F403
from rlcore.rewards import *  # noqa: F401,F403
from rlcore.transforms import *  # noqa: F401,F403
from rlcore.registry import *  # noqa: F401,F403
from rlcore.seeding import *  # noqa: F401,F403

__version__ = "0.1.0"
__all__ = [
    "keys",
    *_checks.__all__,
    *_masked.__all__,
    *_logprobs.__all__,
    *_kl.__all__,
    *_returns.__all__,
    *_baselines.__all__,
    *_rewards.__all__,
    *_transforms.__all__,
    *_registry.__all__,
    *_seeding.__all__,
]
