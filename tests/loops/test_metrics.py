"""The metrics a run logs: TRL's names (per reward function, zero-std groups, completion lengths,
num_tokens across a resume) and the table of docs/metrics.md that explains every logged name."""

import math
import re
import statistics
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

from rlcore import keys as K
from rlcore.loops.logging import read_jsonl, trl_names
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


# --- TRL's token diagnostics: each against a naive computation from the full logits ------------
def naive_token_stats(model, side):
    """Per scored token of a side (full [B, T, V] logits, float64): entropy, argmax == token, mean logit."""
    from rlcore.loops.models import position_ids_from_mask
    ids, mask = side[K.INPUT_IDS], side[K.ATTENTION_MASK]
    pos = position_ids_from_mask(mask)
    scored = (side[K.LOSS_MASK] & mask & (pos > 0))[:, 1:]
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask.long(), position_ids=pos).logits.double()[:, :-1]
    logp = logits.log_softmax(-1)
    entropy, top1, mean = -(logp.exp() * logp).sum(-1), logits.argmax(-1) == ids[:, 1:], logits.mean(-1)
    return entropy[scored], top1[scored].double(), mean[scored]


@pytest.fixture(scope="module")
def pair_batch(tokenizer):
    from rlcore.loops.collate import iterate_batches
    from rlcore.loops.data import load_local
    from rlcore.loops.tokenization import tokenize_dataset
    rows = [{"prompt": "1+1=", "chosen": "2", "rejected": "eleven"},
            {"prompt": "capital?", "chosen": "Paris is it", "rejected": "Rome"},
            {"prompt": "x", "chosen": "yz yz", "rejected": "zy"}]
    (batch,) = list(iterate_batches(tokenize_dataset(load_local(rows), tokenizer), tokenizer, 8, format="preference"))
    return batch


@pytest.fixture(scope="module")
def tiny_lm(tokenizer):
    from rlcore.loops.models import build_model
    torch.manual_seed(0)
    return build_model(tokenizer=tokenizer, hidden_size=16, num_layers=1, num_heads=2).eval()


class Policy:
    def __init__(self, model):
        self._model = model

    def model(self, name):
        return self._model


@pytest.mark.parametrize("chunked", [True, False])
def test_sft_entropy_and_mean_token_accuracy_against_full_logits(tiny_lm, pair_batch, chunked):
    side = sft.scoring_mask(pair_batch[K.CHOSEN])
    ent, top1, _ = naive_token_stats(tiny_lm, side)
    with torch.no_grad():
        loss, m = sft.sft_loss_fn(Policy(tiny_lm), side, chunked=chunked)
        _, plain = sft.sft_loss_fn(Policy(tiny_lm), side, chunked=chunked, with_stats=False)
    assert m["entropy"].item() == pytest.approx(ent.mean().item(), rel=1e-5)
    assert m["mean_token_accuracy"].item() == pytest.approx(top1.mean().item(), abs=1e-7)
    assert {"entropy", "mean_token_accuracy"}.isdisjoint(plain.keys())
    torch.testing.assert_close(m["loss_nll"], plain["loss_nll"])  # the loss's own metrics unchanged
    # a model that predicts some tokens right: accuracy strictly between 0 and 1 on a forced case
    forced = side.clone()
    forced[K.INPUT_IDS][:, 1:] = torch.where(side[K.LOSS_MASK][:, 1:], tiny_lm(
        input_ids=side[K.INPUT_IDS], attention_mask=side[K.ATTENTION_MASK].long()).logits[:, :-1].argmax(-1),
        side[K.INPUT_IDS][:, 1:]).detach()
    _, top1_forced, _ = naive_token_stats(tiny_lm, forced)
    with torch.no_grad():
        _, mf = sft.sft_loss_fn(Policy(tiny_lm), forced, chunked=chunked)
    assert mf["mean_token_accuracy"].item() == pytest.approx(top1_forced.mean().item(), abs=1e-7)
    assert mf["mean_token_accuracy"].item() > 0


def test_score_sequences_stats_packed_equal_padded(tiny_lm, pair_batch):
    from rlcore.loops.score import STAT_KEYS, score_sequences
    side = pair_batch[K.CHOSEN]
    with torch.no_grad():
        a, b = (score_sequences(tiny_lm, side, with_stats=True, packed=p) for p in (False, True))
    for key in STAT_KEYS:
        torch.testing.assert_close(a[key].double(), b[key].double(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunked", [True, False])
def test_dpo_logits_entropy_and_accuracy_against_full_logits(tiny_lm, pair_batch, chunked):
    from rlcore.loops.score import concatenated_forward
    (ent_c, top1_c, mean_c), (ent_r, _, mean_r) = (naive_token_stats(tiny_lm, pair_batch[s])
                                                   for s in (K.CHOSEN, K.REJECTED))

    def loss(scored):  # the loss sees no stat keys; its metrics are kept
        assert all(k not in scored[s].keys() for s in (K.CHOSEN, K.REJECTED) for k in ("entropy", "top1", "mean_logit"))
        return scored[K.CHOSEN, K.LOGPS].sum(), TensorDict({"loss_x": torch.tensor(1.0)}, batch_size=[])

    with torch.no_grad():
        _, m = dpo.preference_loss_fn(Policy(tiny_lm), pair_batch, loss=loss, chunked=chunked, with_stats=True)
        _, plain = dpo.preference_loss_fn(Policy(tiny_lm), pair_batch, loss=loss, chunked=chunked)
        scored = concatenated_forward(tiny_lm, pair_batch, chunked=chunked, with_stats=True)
    assert set(plain.keys()) == {"loss_x"} and m["loss_x"] == 1
    expect = {"entropy": torch.cat([ent_c, ent_r]).mean(), "logits/chosen": mean_c.mean(),
              "logits/rejected": mean_r.mean(), "mean_token_accuracy": top1_c.mean()}
    for name, value in expect.items():
        assert m[name].item() == pytest.approx(value.item(), rel=1e-5, abs=1e-6), name
        assert dpo.pair_stat_metrics(scored)[name].item() == pytest.approx(value.item(), rel=1e-5, abs=1e-6)


def test_clip_ratio_low_min_high_max_against_a_loop():
    from rlcore.algorithms.policy_gradient import grpo_loss
    g = torch.Generator().manual_seed(0)
    B, R = 5, 6
    old = -torch.rand(B, R, generator=g, dtype=torch.float64)
    lp = old + 0.6 * torch.randn(B, R, generator=g, dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0, 1.0, -0.5, 2.0], dtype=torch.float64)[:, None].expand(B, R).clone()
    mask = torch.tensor([[t < n for t in range(R)] for n in (6, 4, 1, 5, 0)])
    batch = TensorDict({K.LOGPROBS: lp, K.OLD_LOGPROBS: old, K.ADVANTAGES: adv, K.RESPONSE_MASK: mask}, [B])
    _, m = grpo_loss(batch)
    low, high = [], []
    for b in range(B):
        n = int(mask[b].sum())
        if n == 0:
            continue  # no token: no fraction (TRL's nanmin / nanmax skip the 0/0)
        ratios = [math.exp(lp[b, t] - old[b, t]) for t in range(n)]
        low.append(sum(r < 0.8 and adv[b, t] < 0 for t, r in enumerate(ratios)) / n)
        high.append(sum(r > 1.2 and adv[b, t] > 0 for t, r in enumerate(ratios)) / n)
    assert m["clipfrac_low_min"].item() == pytest.approx(min(low))
    assert m["clipfrac_high_max"].item() == pytest.approx(max(high)) and max(high) > 0
    named = trl_names({k: v.item() for k, v in m.items()})
    assert named["clip_ratio/low_min"] == m["clipfrac_low_min"].item()
    assert named["clip_ratio/high_max"] == m["clipfrac_high_max"].item()
    _, none = grpo_loss(batch.update({K.RESPONSE_MASK: torch.zeros_like(mask)}))
    assert none["clipfrac_low_min"] == 0 and none["clipfrac_high_max"] == 0


def test_rloo_kl_is_the_token_mean_of_k1():
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -9.0, -9.0]])
    ref = torch.tensor([[-1.5, -1.0, -0.5], [-0.1, 0.0, 0.0]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    rollout = TensorDict({K.OLD_LOGPROBS: old, K.REF_LOGPROBS: ref, K.RESPONSE_MASK: mask}, [2])
    k1 = [0.5, -1.0, 0.0, -0.2]  # old − ref on the four response tokens
    assert rloo.token_kl_metric(rollout)["kl"].item() == pytest.approx(sum(k1) / 4)
    assert rloo.token_kl_metric(rollout.exclude(K.REF_LOGPROBS)) == {}


TRL_DIAGNOSTICS = {"sft": {"entropy", "mean_token_accuracy"},
                   "dpo": {"entropy", "mean_token_accuracy", "logits/chosen", "logits/rejected",
                           "eval/logits/chosen", "eval/mean_token_accuracy"},
                   "grpo": {"clip_ratio/low_min", "clip_ratio/high_max", "kl"},
                   "rloo": {"clip_ratio/low_min", "clip_ratio/high_max", "kl"}}


@pytest.mark.parametrize("name", list(TRL_DIAGNOSTICS))
def test_tiny_runs_log_trl_token_diagnostics(name, tmp_path):
    module, settings = RECIPES[name]
    extra = {"reward_fn": [correct, brevity]} if name in ("grpo", "rloo") else {}
    module.train(module.Config(**settings, steps=2, run_dir=str(tmp_path)), **extra)
    lines = read_jsonl(tmp_path / "metrics.jsonl")
    logged = {k for line in lines for k in line}
    assert TRL_DIAGNOSTICS[name] <= logged, sorted(TRL_DIAGNOSTICS[name] - logged)
    for line in lines:
        for key in ("mean_token_accuracy", "clip_ratio/low_min", "clip_ratio/high_max"):
            if line.get(key) is not None:
                assert 0.0 <= line[key] <= 1.0
        if "clip_ratio/low_min" in line:
            assert line["clip_ratio/low_min"] <= line["clip_ratio/low_mean"] + 1e-9
            assert line["clip_ratio/high_max"] >= line["clip_ratio/high_mean"] - 1e-9
