"""What the online-recipe tests share: a tiny configuration and a trivially learnable reward."""

import torch

TINY = dict(hidden_size=32, num_layers=1, num_heads=4, num_train=64, num_eval=16, max_new_tokens=8, run_dir=None)


def collect_rollout(state, rows, *, config, tokenizer, reward_fn, reference=True, num_samples=None):
    """``online.sample`` then ``online.score_samples``, as the online recipes' steps write them out."""
    from rlcore.loops.online import sample, score_samples

    state, rollout = sample(state, rows, generation=config, tokenizer=tokenizer,
                            max_prompt_length=config.max_prompt_length, num_samples=num_samples, agent=config)
    return score_samples(state, rows, rollout, generation=config, rewards=config, tokenizer=tokenizer,
                         reward_fn=reward_fn, total_steps=config.steps, num_samples=num_samples, reference=reference)


def updated_batches(recipe, monkeypatch) -> list:
    """The batches ``recipe``'s ``learn`` hands to ``update`` (advantages, rewards, masks: what its
    loss closure trains on), recorded while the real ``update`` runs. RLOO updates through
    ``grpo.update_policy``, so GRPO's ``update`` is the one watched for it."""
    from rlcore.loops.recipes import grpo

    recipe = recipe if hasattr(recipe, "update") else grpo
    seen, real = [], recipe.update

    def spy(state, batch, loss_fn, **kw):
        seen.append(batch)
        return real(state, batch, loss_fn, **kw)

    monkeypatch.setattr(recipe, "update", spy)
    return seen


def digit_fraction(prompts, completions, **_):
    """Reward: the fraction of a completion's characters that are digits.

    A random tiny model spreads its mass over ~95 characters, so it starts near 0.1; the reward is
    dense (every character counts) and reachable by moving mass onto ten tokens, so a few steps of
    a working recipe raise it clearly, while a broken one (wrong sign, no gradient, advantages of
    the wrong samples) does not. As a judge it nearly always separates a group's best and worst.
    """
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


def flat_models(state):
    """Every model's parameters (policy, reference, critic), in name order."""
    return torch.cat([p.detach().reshape(-1) for name in sorted(state.models)
                      for p in state.models[name].parameters()])


def step_and_trained_batch(recipe, config, monkeypatch):
    """One ``recipe.step`` on the first prompt batch of ``config``'s task: ``(state, metrics, batch)``,
    ``batch`` the rollout as the loss closure saw it (advantages, rewards, ...)."""
    from rlcore.loops.online import build_online_state, prompt_source
    from rlcore.loops.recipe import load_splits
    from rlcore.loops.tasks import task_dataset

    state, tokenizer = build_online_state(config)
    rows = next(iter(prompt_source(load_splits(config, task_dataset)[0], config)(0)))
    seen = updated_batches(recipe, monkeypatch)  # the rollout the loss closure trains on
    state, metrics = recipe.step(state, rows, config=config, tokenizer=tokenizer, reward_fn=digit_fraction)
    return state, metrics, seen[0]
