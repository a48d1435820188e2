"""rlcore.loops: collect, score, update and the fold; the only code that touches models and data.

The building blocks are exported here. Each trainer is a recipe module with a ``Config``,
``train(config)`` and ``evaluate(state, config)``: ``rlcore.loops.sft``, ``reward``, ``dpo``,
``ppo``, ``rloo``, ``grpo``, ``online_dpo``, ``ddpo`` (the ``diffusion`` extra) and ``reft``; the
``rlcore`` command runs them (``rlcore train RECIPE``)."""

from rlcore.loops import checkpoint as _checkpoint
from rlcore.loops import collect as _collect
from rlcore.loops import data as _data
from rlcore.loops import fold as _fold
from rlcore.loops import logging as _logging
from rlcore.loops import models as _models
from rlcore.loops import recipe as _recipe
from rlcore.loops import reft_data as _reft_data
from rlcore.loops import reft_model as _reft_model
from rlcore.loops import score as _score
from rlcore.loops import state as _state
from rlcore.loops import tasks as _tasks
from rlcore.loops import update as _update
from rlcore.loops.checkpoint import *  # noqa: F401,F403
from rlcore.loops.collect import *  # noqa: F401,F403
from rlcore.loops.data import *  # noqa: F401,F403
from rlcore.loops.fold import *  # noqa: F401,F403
from rlcore.loops.logging import *  # noqa: F401,F403
from rlcore.loops.models import *  # noqa: F401,F403
from rlcore.loops.recipe import *  # noqa: F401,F403
from rlcore.loops.reft_data import *  # noqa: F401,F403
from rlcore.loops.reft_model import *  # noqa: F401,F403
from rlcore.loops.score import *  # noqa: F401,F403
from rlcore.loops.state import *  # noqa: F401,F403
from rlcore.loops.tasks import *  # noqa: F401,F403
from rlcore.loops.update import *  # noqa: F401,F403

__all__ = [
    *_checkpoint.__all__,
    *_collect.__all__,
    *_data.__all__,
    *_fold.__all__,
    *_logging.__all__,
    *_models.__all__,
    *_recipe.__all__,
    *_reft_data.__all__,
    *_reft_model.__all__,
    *_score.__all__,
    *_state.__all__,
    *_tasks.__all__,
    *_update.__all__,
]
