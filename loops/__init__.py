"""rlcore.loops: collect, score, update and the fold; the only code that touches models and data.

The building blocks are exported here. Each trainer is a recipe module with a ``Config``,
``train(config)`` and ``evaluate(state, config)``: ``rlcore.loops.sft``, ``reward``, ``dpo``,
``ppo``, ``rloo``, ``grpo``, ``online_dpo``, ``ddpo`` (the ``diffusion`` extra) and ``reft``; the
``rlcore`` command runs them (``rlcore train RECIPE``)."""

from importlib import import_module as _import_module

from rlcore.loops.async_learners import *  # noqa: F401,F403
from rlcore.loops.async_rl import *  # noqa: F401,F403
from rlcore.loops.checkpoint import *  # noqa: F401,F403
from rlcore.loops.chunks import *  # noqa: F401,F403
from rlcore.loops.collect import *  # noqa: F401,F403
from rlcore.loops.data import *  # noqa: F401,F403
from rlcore.loops.diffusion import *  # noqa: F401,F403
from rlcore.loops.distributed import *  # noqa: F401,F403
from rlcore.loops.fold import *  # noqa: F401,F403
from rlcore.loops.logging import *  # noqa: F401,F403
from rlcore.loops.lora import *  # noqa: F401,F403
from rlcore.loops.models import *  # noqa: F401,F403
from rlcore.loops.online import *  # noqa: F401,F403
from rlcore.loops.placement import *  # noqa: F401,F403
from rlcore.loops.recipe import *  # noqa: F401,F403
from rlcore.loops.reft_data import *  # noqa: F401,F403
from rlcore.loops.reft_model import *  # noqa: F401,F403
from rlcore.loops.score import *  # noqa: F401,F403
from rlcore.loops.shapes import *  # noqa: F401,F403
from rlcore.loops.state import *  # noqa: F401,F403
from rlcore.loops.tasks import *  # noqa: F401,F403
from rlcore.loops.update import *  # noqa: F401,F403
from rlcore.loops.vllm_engine import *  # noqa: F401,F403
from rlcore.loops.workers import *  # noqa: F401,F403

_MODULES = ('async_learners', 'async_rl', 'checkpoint', 'chunks', 'collect', 'data', 'diffusion', 'distributed', 'fold', 'logging', 'lora', 'models', 'online',
            'placement', 'recipe', 'reft_data', 'reft_model', 'score', 'shapes', 'state', 'tasks', 'update', 'vllm_engine',
            'workers')
__all__ = [name for m in _MODULES for name in _import_module(f"rlcore.loops.{m}").__all__]
