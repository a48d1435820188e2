"""The trainers: one module per recipe, each a ``Config``, ``train(config)`` and ``evaluate(state, config)``.

Offline: ``sft``, ``reward``, ``dpo`` (every pairwise and unpaired preference loss), ``ddpo``
(diffusion); online, each step ``collect_rollout → learn``: ``ppo``, ``rloo``, ``grpo``,
``online_dpo``; ``reft`` and ``reft_recipes`` run the language-model recipes with
representation interventions. Import one by name: ``from rlcore.loops.recipes import grpo``.
A new recipe is a module here with those three names (and ``build_state`` / ``learn`` for an
online one, which the asynchronous learners then run unchanged) plus a line in ``rlcore.loops.cli.RECIPES``.
"""
