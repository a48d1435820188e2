"""Tests of loops/score.py: log-probs through models, rollout scoring, concatenated preference forward."""

import functools

import pytest
import torch
from tensordict import TensorDict

from rlcore import keys as K
from rlcore.loops.data import load_local
from rlcore.loops.collate import iterate_batches
from rlcore.loops.tokenization import tokenize_dataset
from rlcore.loops.models import (ValueHead, build_model, build_reward_model, build_value_model, reward_model_scores,
                                 token_values)
from rlcore.loops.score import (concatenated_forward, precompute_reference_logps, score_rollout, score_sequences,
                                sequences, token_logprobs_from_model)
from rlcore.testing import MockLM, assert_padding_invariant, assert_pure, left_padded_mask, right_padded_mask

TEXTS = ["the cat sat", "2 + 2 = 4", "Hi!", "abcdefgh"]


def padded(tokenizer, texts, side):
    enc = tokenizer(texts, padding=True, padding_side=side, return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"].bool()


def reference_logprobs(model, ids, mask, temperature=1.0):
    """The formula, plainly: each row alone and unpadded, ``log softmax(z_t / τ)[x_{t+1}]`` in a
    loop over t. Returns ``{(row, label column): log-prob}``."""
    out = {}
    with torch.no_grad():
        for b in range(ids.shape[0]):
            cols = [t for t in range(ids.shape[1]) if mask[b, t]]
            logits = model(ids[b, cols][None]).logits[0].double()
            for i in range(1, len(cols)):
                out[b, cols[i]] = torch.log_softmax(logits[i - 1] / temperature, -1)[ids[b, cols[i]]].item()
    return out


def assert_matches_reference(lp, reference, offset=1, atol=1e-5):
    """``lp[b, c - offset]`` scores the token at column ``c``."""
    assert reference
    for (b, c), expected in reference.items():
        if c - offset >= 0:
            assert abs(lp[b, c - offset].item() - expected) < atol, (b, c, lp[b, c - offset].item(), expected)


# --- token_logprobs_from_model ---------------------------------------------------------------
@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("chunked", [True, False])
def test_logprobs_match_the_formula(lm, tokenizer, side, chunked):
    ids, mask = padded(tokenizer, TEXTS, side)
    with torch.no_grad():
        lp = token_logprobs_from_model(lm, ids, mask, temperature=0.7, chunked=chunked)
    assert lp.shape == (ids.shape[0], ids.shape[1] - 1) and lp.dtype == torch.float32
    assert_matches_reference(lp, reference_logprobs(lm, ids, mask, temperature=0.7))


def test_left_and_right_padding_agree(lm, tokenizer):
    (ri, rm), (li, lmask) = padded(tokenizer, TEXTS, "right"), padded(tokenizer, TEXTS, "left")
    with torch.no_grad():
        right = token_logprobs_from_model(lm, ri, rm)
        left = token_logprobs_from_model(lm, li, lmask)
    torch.testing.assert_close(right[rm[:, 1:]], left[lmask[:, 1:] & lmask[:, :-1]], rtol=1e-5, atol=1e-5)


def test_chunked_equals_plain_with_gradients(lm, tokenizer):
    ids, mask = padded(tokenizer, TEXTS, "right")
    weights = torch.randn(ids.shape[0], ids.shape[1] - 1, generator=torch.Generator().manual_seed(0))
    results = []
    for chunked in (True, False):
        lm.zero_grad(set_to_none=True)
        lp = token_logprobs_from_model(lm, ids, mask, temperature=0.9, chunked=chunked, chunk_size=16)
        (torch.where(mask[:, 1:], lp, 0.0) * weights).sum().backward()
        results.append((lp.detach(), {n: p.grad.clone() for n, p in lm.named_parameters()}))
    lm.zero_grad(set_to_none=True)
    (lp_a, grad_a), (lp_b, grad_b) = results
    torch.testing.assert_close(lp_a[mask[:, 1:]], lp_b[mask[:, 1:]], rtol=1e-5, atol=1e-5)
    for name in grad_a:
        torch.testing.assert_close(grad_a[name], grad_b[name], rtol=1e-4, atol=1e-5, msg=name)


def test_response_length_slices_the_tail(lm, tokenizer):
    ids, mask = padded(tokenizer, TEXTS, "left")
    with torch.no_grad():
        full = token_logprobs_from_model(lm, ids, mask)
        for chunked in (True, False):
            tail = token_logprobs_from_model(lm, ids, mask, response_length=3, chunked=chunked)
            torch.testing.assert_close(tail, full[:, -3:], rtol=1e-5, atol=1e-5)
        assert token_logprobs_from_model(lm, ids, mask, response_length=0).shape == (len(TEXTS), 0)


def test_float64_model(tokenizer):
    model = build_model(tokenizer=tokenizer, hidden_size=16, num_layers=1, num_heads=2, dtype=torch.float64)
    ids, mask = padded(tokenizer, TEXTS, "right")
    with torch.no_grad():
        a = token_logprobs_from_model(model, ids, mask)
        b = token_logprobs_from_model(model, ids, mask, chunked=False)
    assert a.dtype == b.dtype == torch.float64
    torch.testing.assert_close(a[mask[:, 1:]], b[mask[:, 1:]], rtol=1e-10, atol=1e-10)


def test_bf16_model_close_to_float32(tokenizer):
    model = build_model(tokenizer=tokenizer, hidden_size=16, num_layers=1, num_heads=2)
    ids, mask = padded(tokenizer, TEXTS, "right")
    with torch.no_grad():
        ref = token_logprobs_from_model(model, ids, mask)
        low = token_logprobs_from_model(model.to(torch.bfloat16), ids, mask)
    assert low.dtype == torch.float32  # half-precision matmul, float32 log-sum-exp
    torch.testing.assert_close(low[mask[:, 1:]], ref[mask[:, 1:]], rtol=0, atol=0.05)


def test_mock_lm_plain_path_and_chunked_error(tokenizer):
    mock = MockLM(vocab_size=len(tokenizer), hidden_size=8)
    ids, mask = padded(tokenizer, TEXTS, "left")
    with torch.no_grad():
        lp = token_logprobs_from_model(mock, ids, mask, chunked=False)
        expected = torch.log_softmax(mock(ids, mask).logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    torch.testing.assert_close(lp, expected)
    with pytest.raises(TypeError, match="cannot find the trunk of MockLM"):
        token_logprobs_from_model(mock, ids, mask)


def test_bad_inputs(lm, tokenizer):
    ids, mask = padded(tokenizer, TEXTS, "right")
    with pytest.raises(TypeError, match="attention_mask: expected a torch.bool mask, got dtype torch.int64"):
        token_logprobs_from_model(lm, ids, mask.long())
    with pytest.raises(ValueError, match=r"attention_mask: expected shape \[4, \d+\] \(the shape of input_ids\)"):
        token_logprobs_from_model(lm, ids, mask[:, 1:])
    with pytest.raises(ValueError, match=r"response_length: expected 0 <= R < T"):
        token_logprobs_from_model(lm, ids, mask, response_length=ids.shape[1])
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs_from_model(lm, ids, mask, temperature=0.0)


# --- score_rollout ---------------------------------------------------------------------------
def make_model_rollout(tokenizer, *, B=4, P=5, R=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    plen, rlen = torch.tensor([5, 2, 3, 1])[:B], torch.tensor([6, 1, 4, 0])[:B]
    return TensorDict({
        K.PROMPT_IDS: torch.randint(7, len(tokenizer), (B, P), generator=g),
        K.PROMPT_MASK: left_padded_mask(plen, P),
        K.RESPONSE_IDS: torch.randint(7, len(tokenizer), (B, R), generator=g),
        K.RESPONSE_MASK: right_padded_mask(rlen, R),
    }, batch_size=[B])


def test_score_rollout_logprobs_values_and_scores(lm, tokenizer):
    rollout = make_model_rollout(tokenizer)
    ref = build_model(tokenizer=tokenizer, hidden_size=16, num_layers=1, num_heads=2, seed=5)
    critic = build_value_model(tokenizer=tokenizer, hidden_size=16, num_layers=1, num_heads=2)
    rm = build_reward_model(tokenizer=tokenizer, hidden_size=16, num_layers=1, num_heads=2)
    out = assert_pure(score_rollout, rollout, policy=lm, ref=ref, value_fn=functools.partial(token_values, critic),
                      reward_model=rm, temperature=0.8, atol=1e-6, rtol=1e-6)
    P, R = rollout[K.PROMPT_IDS].shape[1], rollout[K.RESPONSE_IDS].shape[1]
    ids = torch.cat([rollout[K.PROMPT_IDS], rollout[K.RESPONSE_IDS]], -1)
    mask = torch.cat([rollout[K.PROMPT_MASK], rollout[K.RESPONSE_MASK]], -1)
    rmask = rollout[K.RESPONSE_MASK]
    for key, model in ((K.OLD_LOGPROBS, lm), (K.REF_LOGPROBS, ref)):
        got = out[key]
        assert got.shape == (4, R) and (got[~rmask] == 0).all()
        assert_matches_reference(got, {k: v for k, v in reference_logprobs(model, ids, mask, 0.8).items() if k[1] >= P},
                                 offset=P)
    with torch.no_grad():
        for b in range(4):  # value of the state before each response token, from the row alone
            cols = mask[b].nonzero()[:, 0]
            v = critic(ids[b, cols][None]).logits[0, :, 0]
            n_prompt = int(rollout[K.PROMPT_MASK][b].sum())
            for j in range(int(rmask[b].sum())):
                assert abs(out[K.VALUES][b, j].item() - v[n_prompt - 1 + j].item()) < 1e-5
        torch.testing.assert_close(out[K.SCORE], reward_model_scores(rm, ids, mask))
    assert (out[K.VALUES][~rmask] == 0).all()
    assert set(rollout.keys()) == set(make_model_rollout(tokenizer).keys())  # the input is untouched


def test_score_rollout_reward_fn_gets_decoded_text(tokenizer):
    rollout = make_model_rollout(tokenizer)
    seen = {}

    def reward_fn(prompts, completions, answer):
        seen.update(prompts=prompts, completions=completions, answer=answer)
        return [float(len(c)) for c in completions]

    out = score_rollout(rollout, reward_fn=reward_fn, tokenizer=tokenizer, reward_columns={"answer": list("abcd")})
    expected = [tokenizer.decode(r[m], skip_special_tokens=True) for r, m in
                zip(rollout[K.RESPONSE_IDS], rollout[K.RESPONSE_MASK])]
    assert seen["completions"] == expected and seen["answer"] == list("abcd")
    assert seen["prompts"][1] == tokenizer.decode(rollout[K.PROMPT_IDS][1, -2:])
    assert out[K.SCORE].tolist() == [float(len(c)) for c in expected]
    assert K.OLD_LOGPROBS not in out.keys()


def test_score_rollout_sums_reward_model_and_functions(tokenizer):
    rollout = make_model_rollout(tokenizer)
    rm = build_reward_model(tokenizer=tokenizer, hidden_size=16, num_layers=1, num_heads=2)
    both = score_rollout(rollout, reward_model=rm, reward_fn=lambda completions, **kw: [1.0] * len(completions), tokenizer=tokenizer)
    alone = score_rollout(rollout, reward_model=rm)
    torch.testing.assert_close(both[K.SCORE], alone[K.SCORE] + 1.0)


def test_score_rollout_padding_invariant(lm, tokenizer):
    rollout = make_model_rollout(tokenizer)
    head = ValueHead(lm.config.hidden_size)
    fn = functools.partial(score_rollout, policy=lm, value_fn=functools.partial(token_values, lm, head=head))
    assert_padding_invariant(fn, rollout, time_keys=[K.RESPONSE_IDS, K.RESPONSE_MASK], mask_key=K.RESPONSE_MASK,
                             atol=1e-5, rtol=1e-5)


def test_score_rollout_errors(lm, tokenizer):
    rollout = make_model_rollout(tokenizer)
    with pytest.raises(KeyError, match=r"score_rollout: batch is missing 'response_mask' \[B, R\] bool"):
        score_rollout(rollout.exclude(K.RESPONSE_MASK), policy=lm)
    with pytest.raises(ValueError, match="tokenizer: reward_fn scores decoded text"):
        score_rollout(rollout, reward_fn=lambda completions, **kw: [0.0] * len(completions))
    bad = rollout.copy().update({K.PROMPT_MASK: rollout[K.PROMPT_MASK].long()})
    with pytest.raises(TypeError, match="prompt_mask: expected a torch.bool mask"):
        score_rollout(bad, policy=lm)


# --- concatenated_forward --------------------------------------------------------------------
def preference_batch(tokenizer, side="right"):
    rows = [{"prompt": "1+1=", "chosen": "2", "rejected": "eleven"},
            {"prompt": "capital?", "chosen": "Paris is it", "rejected": "Rome"},
            {"prompt": "x", "chosen": "yz", "rejected": "zy"}]
    ds = tokenize_dataset(load_local(rows), tokenizer)
    (batch,) = list(iterate_batches(ds, tokenizer, 8, format="preference"))
    if side == "left":  # re-pad each side on the left: same tokens, other layout
        for s in (K.CHOSEN, K.REJECTED):
            order = torch.sort(batch[s, K.ATTENTION_MASK].to(torch.uint8), dim=-1, stable=True).indices
            batch[s] = batch[s].apply(lambda x: x.gather(-1, order))
    return batch


def separate_forward(model, batch, side, temperature=1.0):
    """Reference: one side alone, per-token log-probs aligned with input_ids, summed over loss_mask."""
    ids, mask, loss = batch[side, K.INPUT_IDS], batch[side, K.ATTENTION_MASK], batch[side, K.LOSS_MASK]
    lp = token_logprobs_from_model(model, ids, mask, temperature=temperature)
    lp = torch.cat([torch.zeros(ids.shape[0], 1), lp], -1)
    return torch.where(loss, lp, 0.0).sum(-1), torch.where(loss, lp, 0.0)


@pytest.mark.parametrize("packed", [False, True])
def test_concatenated_forward_equals_two_forwards(lm, tokenizer, packed):
    batch = preference_batch(tokenizer)
    out = assert_pure(concatenated_forward, lm, batch, temperature=0.9, packed=packed, atol=1e-6, rtol=1e-6)
    for side in (K.CHOSEN, K.REJECTED):
        logps, per_token = separate_forward(lm, batch, side, temperature=0.9)
        torch.testing.assert_close(out[side, K.LOGPS], logps, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out[side, K.LOGPROBS], per_token, rtol=1e-5, atol=1e-5)
        assert out[side, K.LOGPROBS].shape == batch[side, K.INPUT_IDS].shape
    # and the reference formula, loop over the completion tokens
    reference = reference_logprobs(lm, batch[K.CHOSEN, K.INPUT_IDS], batch[K.CHOSEN, K.ATTENTION_MASK], 0.9)
    for b in range(3):
        expected = sum(v for (r, c), v in reference.items() if r == b and batch[K.CHOSEN, K.LOSS_MASK][b, c])
        assert abs(out[K.CHOSEN, K.LOGPS][b].item() - expected) < 1e-4


def test_concatenated_forward_gradients_match_two_forwards(tokenizer):
    model = build_model(tokenizer=tokenizer, hidden_size=16, num_layers=2, num_heads=2)
    batch = preference_batch(tokenizer)
    grads = []
    for run in ("concat", "separate", "packed"):
        model.zero_grad(set_to_none=True)
        if run == "separate":
            chosen, rejected = (separate_forward(model, batch, s)[0] for s in (K.CHOSEN, K.REJECTED))
            loss = chosen.sum() - 2 * rejected.sum()
        else:
            out = concatenated_forward(model, batch, packed=run == "packed")
            loss = out[K.CHOSEN, K.LOGPS].sum() - 2 * out[K.REJECTED, K.LOGPS].sum()
        loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(grads[2], grads[1], rtol=1e-4, atol=1e-5)


def test_concatenated_forward_padding_side_and_reference(lm, tokenizer):
    right, left = preference_batch(tokenizer, "right"), preference_batch(tokenizer, "left")
    a, b = concatenated_forward(lm, right), concatenated_forward(lm, left, reference=True)
    for side in (K.CHOSEN, K.REJECTED):
        torch.testing.assert_close(b[side, K.REF_LOGPS], a[side, K.LOGPS].detach(), rtol=1e-5, atol=1e-5)
        assert not b[side, K.REF_LOGPS].requires_grad and a[side, K.LOGPS].requires_grad
        assert K.LOGPS not in b[side].keys()


def test_concatenated_forward_errors(lm, tokenizer):
    batch = preference_batch(tokenizer)
    with pytest.raises(KeyError, match=r"concatenated_forward: batch is missing .*rejected.*loss_mask.* \[B, T\] bool"):
        concatenated_forward(lm, batch.exclude((K.REJECTED, K.LOSS_MASK)))
    bad = batch.clone()
    bad[K.CHOSEN, K.LOSS_MASK] = bad[K.CHOSEN, K.LOSS_MASK].long()
    with pytest.raises(TypeError, match="chosen.loss_mask: expected a torch.bool mask"):
        concatenated_forward(lm, bad)


@pytest.mark.parametrize("packed", [False, True])
def test_score_sequences_unpaired_and_mismatched(tokenizer, packed):
    """The KTO scoring: a sequence batch and its mismatched pairs, each against the formula."""
    from rlcore.loops.collate import collate_mismatched
    model = build_model(tokenizer=tokenizer, hidden_size=16, num_layers=1, num_heads=2)
    rows = [{"prompt": "1+1=", "completion": "2", "label": True},
            {"prompt": "hi", "completion": "bye!", "label": False},
            {"prompt": "x", "completion": "yz", "label": True}]
    ds = tokenize_dataset(load_local(rows), tokenizer)
    (batch,) = list(iterate_batches(ds, tokenizer, 3, format="unpaired"))
    mismatched = collate_mismatched(ds[:], pad_id=0)
    for b_ in (batch, mismatched):
        out = assert_pure(score_sequences, model, b_, packed=packed, atol=1e-6, rtol=1e-6)
        reference = reference_logprobs(model, b_[K.INPUT_IDS], b_[K.ATTENTION_MASK])
        for b in range(3):
            expected = sum(v for (r, c), v in reference.items() if r == b and b_[K.LOSS_MASK][b, c])
            assert abs(out[K.LOGPS][b].item() - expected) < 1e-4
        assert out[K.LOGPROBS].shape == b_[K.INPUT_IDS].shape and out[K.LOGPS].requires_grad
    ref = score_sequences(model, mismatched, reference=True)
    assert K.REF_LOGPS in ref.keys() and not ref[K.REF_LOGPS].requires_grad
    with pytest.raises(KeyError, match="score_sequences: batch is missing 'loss_mask'"):
        score_sequences(model, batch.exclude(K.LOSS_MASK))


def test_precompute_reference_logps_round_trip(tokenizer):
    ref = build_model(tokenizer=tokenizer, hidden_size=16, num_layers=1, num_heads=2)
    rows = [{"prompt": str(i), "chosen": "ab" * (i + 1), "rejected": "c" * (5 - i)} for i in range(5)]
    ds = tokenize_dataset(load_local(rows), tokenizer)
    out = precompute_reference_logps(ref, iterate_batches(ds, tokenizer, 2, format="preference"))
    assert out.batch_size == torch.Size([5])
    whole = concatenated_forward(ref, next(iterate_batches(ds, tokenizer, 5, format="preference")), reference=True)
    torch.testing.assert_close(out[K.CHOSEN, K.REF_LOGPS], whole[K.CHOSEN, K.REF_LOGPS], rtol=1e-5, atol=1e-5)
    ds = ds.add_column("ref_chosen_logps", out[K.CHOSEN, K.REF_LOGPS].tolist())
    ds = ds.add_column("ref_rejected_logps", out[K.REJECTED, K.REF_LOGPS].tolist())
    batch = next(iterate_batches(ds, tokenizer, 5, format="preference"))
    torch.testing.assert_close(batch[K.REJECTED, K.REF_LOGPS], whole[K.REJECTED, K.REF_LOGPS], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="batches: empty"):
        precompute_reference_logps(ref, [])


def test_the_rollout_is_concatenated_once_per_step(lm, tokenizer):
    """score_rollout stores [prompt | response] as input_ids / attention_mask; the step's later
    forwards (the policy's log-probs per micro-batch) read them instead of concatenating again, with
    the same result; exclude_unscored keeps the stored mask in step with the response mask."""
    from rlcore.loops.online import with_policy_logprobs
    from rlcore.loops.filters import exclude_unscored
    rollout = make_model_rollout(tokenizer)
    ids = torch.cat([rollout[K.PROMPT_IDS], rollout[K.RESPONSE_IDS]], -1)
    mask = torch.cat([rollout[K.PROMPT_MASK], rollout[K.RESPONSE_MASK]], -1)
    torch.testing.assert_close(sequences(rollout), (ids, mask), rtol=0, atol=0)
    scored = score_rollout(rollout, reward_fn=lambda completions, **kw: [1.0, None, 2.0, 3.0], tokenizer=tokenizer)
    assert scored[K.INPUT_IDS].equal(ids) and scored[K.ATTENTION_MASK].equal(mask)
    stored = sequences(scored)
    assert stored[0] is scored[K.INPUT_IDS] and stored[1] is scored[K.ATTENTION_MASK]
    with torch.no_grad():
        torch.testing.assert_close(with_policy_logprobs(lm, scored)[K.LOGPROBS],
                                   with_policy_logprobs(lm, rollout)[K.LOGPROBS], rtol=0, atol=0)
    kept = exclude_unscored(scored.set(K.GROUP_ID, torch.tensor([0, 0, 1, 1])))
    assert not kept[K.RESPONSE_MASK][1].any()
    assert kept[K.ATTENTION_MASK].equal(torch.cat([kept[K.PROMPT_MASK], kept[K.RESPONSE_MASK]], -1))
