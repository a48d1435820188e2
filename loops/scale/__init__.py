"""Orchestration above the recipes: ``async_rl`` / ``async_learners`` (generation in its own process,
off-policy correction) and ``placement`` / ``workers`` (generator, scorer and learner as Ray
actors). Each runs a recipe's own functions, found in the recipe table (``loops.recipes``); nothing
below imports this package. ``torch.distributed`` is the layer below the loops, ``rlcore.loops.dist``;
the vLLM sampler is a generation engine, ``loops.vllm_engine``."""
