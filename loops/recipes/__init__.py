"""The trainers: one module per recipe, each a ``Config``, ``train(config)`` and ``evaluate(state, config)``.

Offline: ``sft``, ``reward``, ``dpo`` (every pairwise and unpaired preference loss), ``ddpo``
(diffusion); online, each step ``sample → score_samples → learn``: ``ppo``, ``rloo``, ``grpo``,
``online_dpo``; ``reft`` and ``reft_recipes`` run the language-model recipes with
representation interventions. Import one by name: ``from rlcore.loops.recipes import grpo``.

``RECIPES`` (``table``) holds one ``Recipe`` value per trainer, by the name ``rlcore train`` runs it
by: its ``Config`` type, ``train``, ``evaluate`` and, as explicit fields, what the command line and
the asynchronous learners need of it (``build_state``, ``step``, ``learn``, ``checkpoint_state``,
``ratio_level``, ...); ``by_config`` finds one from its ``Config`` type. A new recipe is a module
here and its entry in that table.
"""

from rlcore.loops.recipes.table import RECIPES, Recipe, by_config

__all__ = ["Recipe", "RECIPES", "by_config"]
