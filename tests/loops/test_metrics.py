"""The metrics a run logs: TRL's names (per reward function, zero-std groups, completion lengths,
num_tokens across a resume) and the table of docs/metrics.md that explains every logged name."""

import re
import statistics
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

from rlcore import keys as K
from rlcore.loops.logging import read_jsonl
from rlcore.loops.online import group_metrics, rollout_metrics
from rlcore.loops.recipes import dpo, grpo, online_dpo, ppo, reward, rloo, sft
from rlcore.loops.reward_fns import call_reward_terms, combine_rewards

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def correct(completions, answer, **kwargs):
    return [float(c == a) for c, a in zip(completions, answer)]


def brevity(completions, **kwargs):
    return [None if c == "skip" else -len(c) for c in completions]


def rollout_of(score, group_id, lengths, truncated, terms):
    R = max(lengths)
    mask = torch.tensor([[t < n for t in range(R)] for n in lengths])
    return TensorDict({K.SCORE: torch.tensor(score), K.GROUP_ID: torch.tensor(group_id), K.RESPONSE_MASK: mask,
                       K.TRUNCATED: torch.tensor(truncated),
                       K.REWARD_TERMS: TensorDict(terms, batch_size=[len(score)])}, batch_size=[len(score)])


def test_per_function_mean_and_std_are_the_unweighted_scores_written_out():
    completions, answers = ["4", "5", "skip", "12"], ["4", "4", "4", "12"]
    combined = combine_rewards([correct, brevity], weights=[2.0, 0.5])
    total, terms = call_reward_terms(combined, ["q"] * 4, completions, answer=answers)
    assert list(terms) == ["correct", "brevity"]
    written = {"correct": [1.0, 0.0, 0.0, 1.0], "brevity": [-1.0, -1.0, -2.0]}  # brevity abstains on "skip"
    torch.testing.assert_close(total, torch.tensor([2 * 1 - 0.5, 0 - 0.5, 0.0, 2 * 1 - 1.0]))
    metrics = rollout_metrics(rollout_of(total.tolist(), [0, 0, 1, 1], [1, 1, 4, 2], [False] * 4, terms))
    for name, scores in written.items():
        assert metrics[f"rewards/{name}/mean"].item() == pytest.approx(statistics.mean(scores))
        assert metrics[f"rewards/{name}/std"].item() == pytest.approx(statistics.stdev(scores))
    # one function alone is named too
    _, alone = call_reward_terms(correct, ["q"] * 4, completions, answer=answers)
    assert list(alone) == ["correct"]


def test_frac_reward_zero_std_on_a_hand_built_batch():
    everyone = torch.ones(8, dtype=torch.bool)
    # groups 0 (1, 1) and 2 (0, 0) have zero std, groups 1 and 3 do not
    score = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5, 0.25])
    group = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    assert group_metrics(score, group, everyone)["frac_reward_zero_std"].item() == 0.5
    # an unscored sample takes no part: group 1 is then a group of one equal score
    scored = everyone.clone()
    scored[2] = False
    assert group_metrics(score, group, scored)["frac_reward_zero_std"].item() == 0.75


def test_completion_lengths_as_trl_s():
    terms = {"correct": torch.zeros(4)}
    m = rollout_metrics(rollout_of([0.0] * 4, [0, 0, 1, 1], [2, 5, 3, 5], [False, True, False, True], terms))
    assert (m["completions/mean_length"].item(), m["completions/min_length"].item(),
            m["completions/max_length"].item()) == (3.75, 2.0, 5.0)
    assert m["completions/clipped_ratio"].item() == 0.5
    assert (m["completions/mean_terminated_length"].item(), m["completions/min_terminated_length"].item(),
            m["completions/max_terminated_length"].item()) == (2.5, 2.0, 3.0)


TINY = dict(hidden_size=32, num_layers=1, num_heads=4, num_train=16, num_eval=4, eval_every=2)
ONLINE = dict(TINY, max_new_tokens=6, batch_size=2)
OFFLINE = dict(TINY, batch_size=4, max_length=24)


def test_num_tokens_is_cumulative_and_continues_after_a_resume(tmp_path):
    config = grpo.Config(**ONLINE, num_samples=2, steps=2, run_dir=str(tmp_path))
    grpo.train(config)
    state, _ = grpo.train(grpo.Config(**ONLINE, num_samples=2, steps=3, run_dir=str(tmp_path), resume=True))
    lines = read_jsonl(tmp_path / "metrics.jsonl")
    counts = [line["num_tokens"] for line in lines]
    assert [line["step"] for line in lines] == [1, 2, 3] and counts[-1] == state.tokens_seen
    rows = config.batch_size * config.num_samples
    for before, after, line in zip([0, *counts], counts, lines):  # each step adds its prompts and completions
        assert after - before > line["completions/mean_length"] * rows


def documented_names() -> list[re.Pattern]:
    """A pattern per name in the first two columns of docs/metrics.md's tables, rlcore's and TRL's (the
    logs carry TRL's name beside some of rlcore's; ``<name>`` matches any text)."""
    patterns = []
    for line in DOC.read_text().splitlines():
        if line.startswith("| `"):
            for name in re.findall(r"`([^`]+)`", " ".join(line.split(" | ")[:2])):
                patterns.append(re.compile("".join(".+" if part.startswith("<") else re.escape(part)
                                                   for part in re.split(r"(<[a-z]+>)", name)) + "$"))
    return patterns


RECIPES = {"grpo": (grpo, dict(ONLINE, num_samples=2, kl_coef=0.1)), "rloo": (rloo, dict(ONLINE, num_samples=2)),
           "ppo": (ppo, ONLINE), "online_dpo": (online_dpo, dict(ONLINE, num_samples=2)),
           "sft": (sft, OFFLINE), "dpo": (dpo, OFFLINE), "reward": (reward, OFFLINE)}


@pytest.mark.parametrize("name", list(RECIPES))
def test_every_logged_metric_is_explained_in_the_docs(name, tmp_path):
    module, settings = RECIPES[name]
    extra = {"reward_fn": [correct, brevity]} if name in ("grpo", "rloo") else {}
    module.train(module.Config(**settings, steps=2, run_dir=str(tmp_path)), **extra)
    logged = {k for line in read_jsonl(tmp_path / "metrics.jsonl") for k in line} - {"step", "time"}
    patterns = documented_names()
    missing = sorted(k for k in logged if not any(p.match(k) for p in patterns)
                     and not (k.startswith("eval/") and any(p.match(k[5:]) for p in patterns)))
    assert not missing, f"{name} logs metrics docs/metrics.md does not explain: {missing}"
    if extra:
        assert {"rewards/correct/mean", "rewards/brevity/std", "frac_reward_zero_std", "num_tokens",
                "clip_ratio/region_mean"} <= logged
