"""Padding-free forwards (``padding_free``) and micro-batches by token budget
(``max_tokens_per_micro_batch``): packed equals padded for every loss (values and gradients), with
sequences of very different lengths and either padding side; the budget's partition; every recipe
that offers them trains with them."""

import functools
import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from rlcore import keys as K
from rlcore.algorithms.dpo import dpo
from rlcore.algorithms.policy_gradient import grpo_loss
from rlcore.loops.collate import row_tokens, token_budget
from rlcore.loops.models import (ValueHead, build_model, pack_rows, build_reward_model, build_tokenizer, build_value_model,
                                 policy_and_values, reward_model_scores, token_values, trunk_hidden)
from rlcore.loops.online import with_policy_logprobs
from rlcore.loops.recipes import dpo as dpo_recipe
from rlcore.loops.recipes import grpo, online_dpo, ppo, reward, rloo
from rlcore.loops.recipes.reft_recipes import ReftDpoConfig, ReftGrpoConfig, ReftRewardConfig
from rlcore.loops.score import concatenated_forward, packed_logprobs, score_sequences
from rlcore.loops.state import init_state
from rlcore.loops.update import make_optimizer, token_micro_batches, update
from tests.loops.online_helpers import TINY

TOL = dict(rtol=1e-4, atol=1e-5)  # float32 sums in another order (one packed row against padded rows)
LENGTHS = (2, 11, 5, 17)  # real tokens per row: very different lengths


def _masked(lengths, width, *, left: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 60, (len(lengths), width), generator=g)
    t = torch.arange(width)
    mask = torch.stack([(t >= width - n) if left else (t < n) for n in lengths])
    return ids.masked_fill(~mask, 0), mask


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def _lm(tokenizer, build=build_model, seed=0):
    return build("llama", tokenizer=tokenizer, hidden_size=32, num_layers=2, num_heads=4, seed=seed)


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same_grads(model, a, b):
    assert a.keys() == b.keys() and a
    for name in a:
        torch.testing.assert_close(a[name], b[name], **TOL, msg=name)


def _packed_vs_padded(model, compute):
    """``compute(packed) -> (value, loss)`` both ways: the values and every gradient agree."""
    out = {}
    for packed in (False, True):
        model.zero_grad(set_to_none=True)
        value, loss = compute(packed)
        loss.backward()
        out[packed] = value.detach(), _grads(model)
    torch.testing.assert_close(out[True][0], out[False][0], **TOL)
    _assert_same_grads(model, out[False][1], out[True][1])


def test_pack_rows_lays_sequences_first_fit_into_rows_of_the_longest():
    ids = torch.tensor([[0, 7, 8, 9], [5, 0, 0, 0], [0, 0, 3, 4], [6, 6, 0, 0]])
    mask = ids != 0
    packing = pack_rows(ids, mask)
    # widths of 3: [7 8 9] | [5 3 4] ([5] first, then [3 4] fits after it) | [6 6 .]
    assert packing.input_ids.tolist() == [[7, 8, 9], [5, 3, 4], [6, 6, 0]]
    assert packing.position_ids.tolist() == [[0, 1, 2], [0, 0, 1], [0, 1, 0]]
    assert packing.dest.tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    flat = packing.input_ids.reshape(-1)[packing.dest]
    assert torch.equal(flat, ids[mask])


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "logits"])
def test_packed_logprobs_equal_the_padded_path(tokenizer, chunked):
    model = _lm(tokenizer).eval()
    ids, mask = _masked(LENGTHS, 20, left=False)
    scored = mask & (torch.arange(20) >= 1)
    with torch.no_grad():
        got = packed_logprobs(model, ids, mask, scored, chunked=chunked, with_stats=True)
        want = score_sequences(model, TensorDict({K.INPUT_IDS: ids, K.ATTENTION_MASK: mask, K.LOSS_MASK: scored},
                                                 batch_size=[4]), chunked=chunked, with_stats=True)
    torch.testing.assert_close(got.logprobs, want[K.LOGPROBS], **TOL)
    torch.testing.assert_close(got.entropy, want[K.ENTROPY], **TOL)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("left", [True, False], ids=["left-padded", "right-padded"])
def test_the_packed_trunk_equals_the_padded_one(tokenizer, left, attention):
    model = build_model("llama", tokenizer=tokenizer, hidden_size=32, num_layers=2, num_heads=4, seed=0,
                        attn_implementation=attention).eval()
    ids, mask = _masked(LENGTHS, 20, left=left)
    padded, packed = (trunk_hidden(model, ids, mask, packed=p) for p in (False, True))
    torch.testing.assert_close(packed[mask], padded[mask], **TOL)
    assert torch.equal(packed[~mask], torch.zeros_like(packed[~mask]))


def _rollout(P=12, R=14, seed=0):
    g = torch.Generator().manual_seed(seed)
    prompt_len, response_len = torch.tensor([3, 12, 1, 7]), torch.tensor([14, 2, 9, 1])
    t_p, t_r = torch.arange(P), torch.arange(R)
    prompt_mask = t_p >= P - prompt_len[:, None]
    response_mask = t_r < response_len[:, None]
    return TensorDict({
        K.PROMPT_IDS: torch.randint(3, 60, (4, P), generator=g).masked_fill(~prompt_mask, 0), K.PROMPT_MASK: prompt_mask,
        K.RESPONSE_IDS: torch.randint(3, 60, (4, R), generator=g).masked_fill(~response_mask, 0),
        K.RESPONSE_MASK: response_mask, K.ADVANTAGES: torch.randn(4, 1, generator=g).expand(4, R).clone(),
        K.OLD_LOGPROBS: -torch.rand(4, R, generator=g) - 1,
    }, batch_size=[4])


def test_the_policy_gradient_loss_packed_equals_padded(tokenizer):
    model, batch = _lm(tokenizer), _rollout()
    mask = batch[K.RESPONSE_MASK]

    def compute(packed):
        scored = with_policy_logprobs(model, batch, with_entropy=True, packed=packed)
        loss, _ = grpo_loss(scored)
        lp = torch.where(mask, scored[K.LOGPROBS], 0)
        assert not scored[K.ENTROPY].requires_grad
        return torch.stack([*lp[mask], *scored[K.ENTROPY][mask]]), loss

    _packed_vs_padded(model, compute)


@pytest.mark.parametrize("critic", ["shared", "separate"])
def test_the_ppo_forwards_packed_equal_padded(tokenizer, critic):
    policy, batch = _lm(tokenizer), _rollout()
    value = ValueHead(32, seed=0) if critic == "shared" else _lm(tokenizer, build_value_model, seed=1)
    state = init_state({"policy": policy, "value": value})
    from rlcore.loops.score import sequences

    ids, mask = sequences(batch)
    response = batch[K.RESPONSE_MASK]

    def compute(packed):
        out = ppo.CRITICS[critic].forward(state, batch, ids, mask, 1.0, packed=packed)
        values = torch.stack([*out[K.LOGPROBS][response], *out[K.VALUE_PREDS][response]])
        return values, values.square().sum()

    for model in (policy, value):
        model.zero_grad(set_to_none=True)
    _packed_vs_padded(policy, compute)


def _pairs(seed=0):
    def side(lengths, width, s):
        ids, mask = _masked(lengths, width, left=False, seed=s)
        loss = mask & (torch.arange(width) >= 2)  # the first two tokens are the prompt
        return TensorDict({K.INPUT_IDS: ids, K.ATTENTION_MASK: mask, K.LOSS_MASK: loss}, batch_size=[len(lengths)])

    return TensorDict({K.CHOSEN: side((4, 19, 6, 3), 19, seed), K.REJECTED: side((12, 3, 8, 5), 12, seed + 1)},
                      batch_size=[4])


def test_the_dpo_loss_packed_equals_padded(tokenizer):
    model, ref = _lm(tokenizer), _lm(tokenizer, seed=1)
    pairs = _pairs()
    with torch.no_grad():
        refs = {p: concatenated_forward(ref, pairs, reference=True, packed=p) for p in (False, True)}
    for s in (K.CHOSEN, K.REJECTED):
        torch.testing.assert_close(refs[True][s, K.REF_LOGPS], refs[False][s, K.REF_LOGPS], **TOL)
    pairs = refs[False]

    def compute(packed):
        loss, metrics = dpo_recipe.preference_loss_fn(init_state({"policy": model}), pairs,
                                                      loss=functools.partial(dpo, beta=0.1), packed=packed,
                                                      with_stats=True)
        return torch.stack([loss.detach(), metrics["entropy"], metrics["mean_token_accuracy"]]), loss

    _packed_vs_padded(model, compute)


@pytest.mark.parametrize("left", [True, False], ids=["left-padded", "right-padded"])
def test_the_reward_loss_packed_equals_padded(tokenizer, left):
    model = _lm(tokenizer, build_reward_model)
    ids, mask = _masked(LENGTHS, 20, left=left)
    scores = {p: reward_model_scores(model, ids, mask, packed=p) for p in (False, True)}
    torch.testing.assert_close(scores[True], scores[False], **TOL)
    pairs = _pairs()

    def compute(packed):
        loss, _ = reward.reward_loss_fn(init_state({"policy": model}), pairs, packed=packed)
        return loss.detach(), loss

    _packed_vs_padded(model, compute)


def test_token_values_and_the_shared_trunk_packed_equal_padded(tokenizer):
    critic, policy = _lm(tokenizer, build_value_model), _lm(tokenizer).eval()
    ids, mask = _masked(LENGTHS, 20, left=True)
    with torch.no_grad():
        values = [token_values(critic, ids, mask, packed=p) for p in (False, True)]
        both = [policy_and_values(policy, ValueHead(32, seed=0), ids, mask, packed=p) for p in (False, True)]
    torch.testing.assert_close(values[1][mask], values[0][mask], **TOL)
    torch.testing.assert_close(both[1][0][mask], both[0][0][mask], **TOL)
    torch.testing.assert_close(both[1][1][mask], both[0][1][mask], **TOL)


# --- the token budget --------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(tokens=st.lists(st.integers(1, 50), min_size=1, max_size=30), budget=st.integers(1, 120),
       max_rows=st.integers(1, 8))
def test_token_micro_batches_cover_the_rows_in_order_within_the_budget(tokens, budget, max_rows):
    groups = token_micro_batches(torch.tensor(tokens), budget=budget, max_rows=max_rows)
    assert torch.cat(groups).tolist() == list(range(len(tokens)))
    for g in groups:
        cost = sum(tokens[i] for i in g.tolist())
        assert len(g) <= max_rows and (cost <= budget or len(g) == 1)
    for a, b in itertools.pairwise(groups):  # greedy: the next row did not fit
        assert len(a) == max_rows or sum(tokens[i] for i in a.tolist()) + tokens[int(b[0])] > budget


def test_fsdp2_ranks_halve_their_largest_micro_batches_to_agree_on_the_count():
    from rlcore.loops.update import _Again, _split_to

    groups = [torch.tensor([0, 1, 2, 3]), torch.tensor([4])]
    assert [g.tolist() for g in _split_to(groups, 4)] == [[0], [1], [2, 3], [4]]
    assert _split_to(groups, 2) == groups
    # fewer rows than forwards: the last row again, at weight zero
    more = _split_to(groups, 7)
    assert [g.tolist() for g in more] == [[0], [1], [2], [3], [4], [4], [4]]
    assert [isinstance(g, _Again) for g in more] == [False] * 5 + [True] * 2


def test_row_tokens_for_each_layout():
    rollout = _rollout()
    assert row_tokens(rollout, packed=True).tolist() == [3 + 14, 12 + 2, 1 + 9, 7 + 1]
    assert row_tokens(rollout, packed=False).tolist() == [26] * 4
    pairs = _pairs()
    assert row_tokens(pairs, packed=True).tolist() == [4 + 12, 19 + 3, 6 + 8, 3 + 5]
    assert row_tokens(pairs, packed=False).tolist() == [38] * 4
    seqs = pairs[K.CHOSEN]
    assert row_tokens(seqs, packed=True).tolist() == [4, 19, 6, 3]
    with pytest.raises(KeyError, match="row_tokens: expected attention_mask"):
        row_tokens(TensorDict({"x": torch.zeros(2)}, batch_size=[2]), packed=True)
    assert token_budget(grpo.Config()) == {}


def test_a_token_budget_gives_the_gradient_of_fixed_micro_batches(tokenizer):
    """The partition changes how much one forward holds, never the step: parameters after one update
    with a budget equal those with micro-batches of rows (and of the whole minibatch)."""
    batch = _rollout()

    def loss_fn(state, mb, **denominators):
        mb = with_policy_logprobs(state.model("policy"), mb, packed=True)
        return grpo_loss(mb, **denominators)

    after = {}
    for name, kw in {"rows": dict(micro_batch_size=2), "whole": {},
                     "budget": dict(max_tokens_per_micro_batch=20,
                                    row_tokens=functools.partial(row_tokens, packed=True))}.items():
        model = _lm(tokenizer)
        state = init_state({"policy": model}, optimizer=make_optimizer(model, lr=1e-2), seed=0)
        seen = []

        def counting(state, mb, **d):
            seen.append(mb.batch_size[0])
            return loss_fn(state, mb, **d)

        update(state, batch, counting, mask_key=K.RESPONSE_MASK, **kw)
        after[name] = [p.detach().clone() for p in model.parameters()]
        if name == "budget":
            assert seen == [1, 1, 2]  # rows of 17, 14, 10 and 8 tokens under 20: [17] [14] [10 + 8]
    for a, b in zip(after["rows"], after["budget"]):
        torch.testing.assert_close(a, b, **TOL)
    for a, b in zip(after["whole"], after["budget"]):
        torch.testing.assert_close(a, b, **TOL)


def test_bad_budgets_are_refused(tokenizer):
    model = _lm(tokenizer)
    state = init_state({"policy": model}, optimizer=make_optimizer(model, lr=1e-2))
    fn = lambda s, mb: (mb[K.ADVANTAGES].sum() * 0, {})  # noqa: E731
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch: expected a positive int"):
        update(state, _rollout(), fn, max_tokens_per_micro_batch=0)
    with pytest.raises(ValueError, match="row_tokens: a token budget"):
        update(state, _rollout(), fn, max_tokens_per_micro_batch=10)
    from rlcore.loops.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="max_tokens_per_micro_batch"):
        load_config(grpo.Config, overrides={"max_tokens_per_micro_batch": 0})


# --- the recipes ---------------------------------------------------------------------------------
PACKED = dict(padding_free=True, max_tokens_per_micro_batch=40)


@pytest.mark.parametrize("recipe", [grpo, rloo, ppo, online_dpo], ids=["grpo", "rloo", "ppo", "online_dpo"])
def test_the_online_recipes_train_padding_free_as_they_train_padded(recipe):
    extra = dict(num_samples=2, batch_size=4, steps=2, eval_every=0, seed=1)
    if recipe is ppo:
        extra["value_model"] = "separate"
    padded, packed = (recipe.train(recipe.Config(**TINY, **extra, **kw))[0] for kw in ({}, PACKED))
    moved = False
    for a, b in zip(padded.model("policy").parameters(), packed.model("policy").parameters()):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)
    for a, b in zip(recipe.build_state(recipe.Config(**TINY, **extra))[0].model("policy").parameters(),
                    packed.model("policy").parameters()):
        moved = moved or not torch.equal(a, b)
    assert moved


@pytest.mark.parametrize("recipe", [dpo_recipe, reward], ids=["dpo", "reward"])
def test_the_offline_recipes_train_padding_free_as_they_train_padded(recipe):
    config = dict(hidden_size=32, num_layers=1, num_heads=4, num_train=32, num_eval=16, batch_size=8, max_length=24,
                  steps=2, eval_every=2, run_dir=None)
    (padded, hist_padded), (packed, hist_packed) = (recipe.train(recipe.Config(**config, **kw)) for kw in ({}, PACKED))
    for a, b in zip(padded.model("policy").parameters(), packed.model("policy").parameters()):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)
    # the token diagnostics are means of per-micro-batch ratios, which another partition changes
    per_token = {"entropy", "logits/chosen", "logits/rejected", "mean_token_accuracy"}
    for row, other in zip(hist_padded, hist_packed):
        assert row.keys() == other.keys()
        for k in row.keys() - per_token:
            assert row[k] == pytest.approx(other[k], rel=1e-3, abs=1e-4), k


@pytest.mark.parametrize("config", [ReftGrpoConfig, ReftDpoConfig, ReftRewardConfig])
@pytest.mark.parametrize("field", ["padding_free", "max_tokens_per_micro_batch"])
def test_the_reft_recipes_refuse_packing(config, field):
    with pytest.raises(ValueError, match=f"{field}: a ReFT policy's interventions"):
        config(**{field: True if field == "padding_free" else 64})


def test_trls_padding_free_is_the_same_field():
    from rlcore.loops.config import load_config

    assert load_config(dpo_recipe.Config, overrides={"padding_free": True, "run_dir": None}).padding_free is True
