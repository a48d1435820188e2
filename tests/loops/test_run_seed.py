"""``seed`` seeds Python's ``random``, NumPy and torch's global generators at the start of every run
(``loops.recipe.run``), so a reward function drawing random numbers repeats under the same seed."""

import os
import random

import numpy as np
import torch

from rlcore.loops.recipes import grpo
from tests.loops.online_helpers import TINY


def drawn_scores(seed, **overrides):
    """The scores a reward function drawing from every global generator gives in a 2-step GRPO run,
    the generators scrambled before the run."""
    scores = []

    def noisy(prompts, completions, **_):
        drawn = [random.random() + float(np.random.rand()) + float(torch.rand(())) for _ in completions]
        scores.extend(drawn)
        return drawn

    random.seed(os.urandom(8))
    np.random.seed(int.from_bytes(os.urandom(4), "little"))
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    fields = {**TINY, "steps": 2, "batch_size": 2, "num_samples": 2, "eval_every": 0, **overrides}
    grpo.train(grpo.Config(**fields, seed=seed), reward_fn=noisy)
    return scores


def test_a_reward_function_drawing_random_numbers_repeats_under_the_same_seed():
    first = drawn_scores(3)
    assert len(first) == 8
    assert drawn_scores(3) == first
    assert drawn_scores(4) != first


def test_a_resumed_run_draws_what_the_uninterrupted_run_draws(tmp_path):
    whole = drawn_scores(3, run_dir=str(tmp_path / "whole"))
    part = drawn_scores(3, run_dir=str(tmp_path / "part"), steps=1)
    rest = drawn_scores(3, run_dir=str(tmp_path / "part"), resume=True)
    assert part + rest == whole
