"""Scale-out: ``distributed`` / ``dist_sync`` (``torchrun``, DDP and FSDP2), ``async_rl`` /
``async_learners`` (generation in its own process, off-policy correction), ``placement`` /
``workers`` (generator, scorer and learner as Ray actors) and ``vllm_engine`` (vLLM as the
sampler). Each runs the recipes' own functions; nothing here imports a recipe."""
