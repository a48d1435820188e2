"""rlcore: post-training with RL and preference optimisation as pure functions on TensorDicts.

The functional core: masked reductions and loss aggregation, log-probs, KL estimators, returns and
advantage estimators, per-token rewards, and ``(init, update)`` state transforms. Everything here
is pure; models and data are touched only in ``rlcore.loops``.
"""

from rlcore import keys
from rlcore.checks import *  # noqa: F401,F403
from rlcore.checks import __all__ as _checks_all
from rlcore.masked import *  # noqa: F401,F403
from rlcore.masked import __all__ as _masked_all
from rlcore.seeding import *  # noqa: F401,F403
from rlcore.seeding import __all__ as _seeding_all

__version__ = "0.1.0"
__all__ = ["keys", *_checks_all, *_masked_all, *_seeding_all]
