"""rlcore.algorithms: pure losses, one module per family (TensorDict in, ``(loss, metrics)`` out)."""

from rlcore.algorithms import ddpo as _ddpo
from rlcore.algorithms import dpo as _dpo
from rlcore.algorithms import online as _online
from rlcore.algorithms import policy_gradient as _policy_gradient
from rlcore.algorithms import ppo as _ppo
from rlcore.algorithms import preference as _preference
from rlcore.algorithms import reft as _reft
from rlcore.algorithms import reward as _reward
from rlcore.algorithms import sft as _sft
from rlcore.algorithms.ddpo import *  # noqa: F401,F403
from rlcore.algorithms.dpo import *  # noqa: F401,F403
from rlcore.algorithms.online import *  # noqa: F401,F403
from rlcore.algorithms.policy_gradient import *  # noqa: F401,F403
from rlcore.algorithms.ppo import *  # noqa: F401,F403
from rlcore.algorithms.preference import *  # noqa: F401,F403
from rlcore.algorithms.reft import *  # noqa: F401,F403
from rlcore.algorithms.reward import *  # noqa: F401,F403
from rlcore.algorithms.sft import *  # noqa: F401,F403

__all__ = [
    *_ddpo.__all__,
    *_dpo.__all__,
    *_online.__all__,
    *_policy_gradient.__all__,
    *_ppo.__all__,
    *_preference.__all__,
    *_reft.__all__,
    *_reward.__all__,
    *_sft.__all__,
]
