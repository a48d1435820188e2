"""rlcore.loops: collect, score, update and the fold; the only code that touches models and data.

Laid out by role:

- the loop's pieces, here: ``fold`` and ``state`` (the fold and what it threads), ``collect``,
  ``engines``, ``vllm_engine`` and ``chunks`` (generation), ``score``, ``update`` (the one impure step),
  ``online`` (what the online recipes share: collect → score), ``evaluate`` (their held-out metrics),
  ``reward_fns`` (calling, checking and combining reward functions), ``config`` (the run-config
  base: shared fields, YAML, checks), ``recipe`` (models, data splits, the run), ``data`` →
  ``tokenization`` → ``collate`` (datasets to batches),
  ``tasks``, ``models``, ``lora``, ``shapes``, ``checkpoint`` (with ``checkpoint_codec``, its
  pickle-free storage, ``checkpoint_config``, its stored config read as data, and ``run_dir``,
  one run per folder), ``logging``, ``diffusion`` (with
  ``images``: JPEG rewards, grids; ``sd``: Stable Diffusion pipelines; ``aesthetic``: an
  aesthetic-style image reward),
  ``reft_data`` / ``reft_model``; ``tools`` (tool schemas, tool calls parsed from a model's text,
  running them) and ``sandbox`` (model-written Python in a limited subprocess); ``trl_defaults``
  (TRL's defaults where rlcore's differ); the ``cli`` and the ``demo``;
- ``rlcore.loops.recipes``: one module per trainer (``sft``, ``reward``, ``dpo``, ``ppo``,
  ``rloo``, ``grpo``, ``online_dpo``, ``ddpo``, ``reft``), each with a ``Config``,
  ``train(config)`` and ``evaluate(state, config)``; the ``rlcore`` command runs them
  (``rlcore train RECIPE``);
- ``rlcore.loops.scale``: orchestration above the recipes: asynchronous off-policy training
  (``async_rl``, ``async_learners``) and Ray placement (``placement``, ``workers``). It imports the
  recipes; nothing here imports it.

- ``rlcore.loops.dist``, the layer below the pieces: ``torch.distributed`` (process groups,
  DDP / FSDP2 wrapping, collectives, gathered weights); it imports nothing from ``rlcore.loops``.

The pieces are exported here; recipes are imported by name
(``from rlcore.loops.recipes import grpo``), and so is orchestration (``from rlcore.loops.scale
import async_rl``). docs/architecture.md draws the layers.

Importing it silences, by their exact text, the warnings of third-party packages that say nothing
to a user of rlcore (``loops/_quiet.py``): transformers' note that an image processor falls back
to its PIL backend without torchvision (diffusers' Stable Diffusion pipeline names CLIP's image
processor on import; the fallback is what a torchvision-free install uses). Every other warning passes."""

from importlib import import_module as _import_module

from rlcore.loops import _quiet  # noqa: F401  (first: its filter is in place before transformers logs)

from rlcore.loops.aesthetic import *  # noqa: F401,F403
from rlcore.loops.checkpoint import *  # noqa: F401,F403
from rlcore.loops.checkpoint_codec import *  # noqa: F401,F403
from rlcore.loops.checkpoint_config import *  # noqa: F401,F403
from rlcore.loops.chunks import *  # noqa: F401,F403
from rlcore.loops.collate import *  # noqa: F401,F403
from rlcore.loops.collect import *  # noqa: F401,F403
from rlcore.loops.config import *  # noqa: F401,F403
from rlcore.loops.data import *  # noqa: F401,F403
from rlcore.loops.diffusion import *  # noqa: F401,F403
from rlcore.loops.engines import *  # noqa: F401,F403
from rlcore.loops.evaluate import *  # noqa: F401,F403
from rlcore.loops.filters import *  # noqa: F401,F403
from rlcore.loops.fold import *  # noqa: F401,F403
from rlcore.loops.images import *  # noqa: F401,F403
from rlcore.loops.logging import *  # noqa: F401,F403
from rlcore.loops.lora import *  # noqa: F401,F403
from rlcore.loops.models import *  # noqa: F401,F403
from rlcore.loops.online import *  # noqa: F401,F403
from rlcore.loops.recipe import *  # noqa: F401,F403
from rlcore.loops.reft_data import *  # noqa: F401,F403
from rlcore.loops.reft_model import *  # noqa: F401,F403
from rlcore.loops.reward_fns import *  # noqa: F401,F403
from rlcore.loops.run_dir import *  # noqa: F401,F403
from rlcore.loops.sandbox import *  # noqa: F401,F403
from rlcore.loops.vllm_engine import *  # noqa: F401,F403
from rlcore.loops.score import *  # noqa: F401,F403
from rlcore.loops.sd import *  # noqa: F401,F403
from rlcore.loops.shapes import *  # noqa: F401,F403
from rlcore.loops.state import *  # noqa: F401,F403
from rlcore.loops.tasks import *  # noqa: F401,F403
from rlcore.loops.tokenization import *  # noqa: F401,F403
from rlcore.loops.tools import *  # noqa: F401,F403
from rlcore.loops.trl_defaults import *  # noqa: F401,F403
from rlcore.loops.update import *  # noqa: F401,F403

_MODULES = ("aesthetic", "checkpoint", "checkpoint_codec", "checkpoint_config", "chunks", "collate", "collect", "config", "data",
            "diffusion", "engines", "evaluate", "filters", "fold", "images", "logging", "lora", "models", "online",
            "recipe", "reft_data", "reft_model", "reward_fns", "run_dir", "sandbox", "score", "sd",
            "shapes", "state", "tasks", "tokenization", "tools", "trl_defaults", "update", "vllm_engine")
__all__ = [name for m in _MODULES for name in _import_module(f"rlcore.loops.{m}").__all__]
