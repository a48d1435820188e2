"""Tests of loops/collect.py: generation into rollouts, stop handling, groups, behaviour log-probs."""

import math

import pytest
import torch
from tensordict import TensorDict

from rlcore import keys as K
from rlcore.loops.collect import generate_rollout, left_align, response_mask_from_ids, uniform_length_sampler
from rlcore.loops.engines import BEHAVIOUR_LOGPROBS, SAMPLERS, gumbel_max_sample, sample_responses, truncate_logits
from rlcore.loops.collate import collate_prompts
from rlcore.loops.tokenization import tokenize_example
from rlcore.loops.models import build_model
from rlcore.loops.score import score_rollout
from rlcore.testing import assert_pure

PROMPTS = ["2+2=", "Hello", "x"]


@pytest.fixture(scope="module")
def chatty(small_tokenizer):
    """A tiny model over a 9-token vocabulary: EOS comes often."""
    return build_model(tokenizer=small_tokenizer, hidden_size=16, num_layers=1, num_heads=2).eval()


@pytest.fixture(scope="module")
def llama(tokenizer):
    """One architecture for the tests that are about the loop, not the model."""
    return build_model(tokenizer=tokenizer, hidden_size=16, num_layers=1, num_heads=2).eval()


# --- helpers ---------------------------------------------------------------------------------
def test_response_mask_golden_and_reference():
    ids = torch.tensor([[5, 2, 2, 7], [5, 6, 7, 8], [2, 5, 9, 9], [5, 9, 2, 0]])
    assert response_mask_from_ids(ids, [2]).tolist() == [
        [True, True, False, False], [True, True, True, True], [True, False, False, False], [True, True, True, False]]
    stops = [2, 9]
    got = assert_pure(response_mask_from_ids, ids, torch.tensor(stops))
    for b in range(4):  # the definition, plainly
        first = next((t for t in range(4) if ids[b, t].item() in stops), 4)
        assert got[b].tolist() == [t <= first for t in range(4)]


def test_left_align_golden():
    ids = torch.tensor([[1, 2, 0, 0], [0, 3, 4, 5], [6, 0, 7, 0]])
    mask = ids > 0
    new_ids, new_mask = assert_pure(left_align, ids, mask)
    assert new_ids.tolist() == [[0, 0, 1, 2], [0, 3, 4, 5], [0, 0, 6, 7]]
    assert new_mask.tolist() == [[False, False, True, True], [False, True, True, True], [False, False, True, True]]
    with pytest.raises(TypeError, match="prompt_mask: expected a torch.bool mask"):
        left_align(ids, mask.long())


def test_uniform_length_sampler():
    a, b = uniform_length_sampler(3, 7, seed=1), uniform_length_sampler(3, 7, seed=1)
    draws = [a() for _ in range(50)]
    assert draws == [b() for _ in range(50)] and set(draws) == {3, 4, 5, 6}


def _response_logits(lm, rollout):
    """The logits that predicted each response token, from one full forward of prompt + response."""
    ids = torch.cat([rollout[K.PROMPT_IDS], rollout[K.RESPONSE_IDS]], -1)
    attn = torch.cat([rollout[K.PROMPT_MASK], rollout[K.RESPONSE_MASK]], -1)
    with torch.no_grad():
        pos = (attn.long().cumsum(-1) - 1).clamp(min=0)
        return lm(ids, attention_mask=attn.long(), position_ids=pos).logits[:, rollout[K.PROMPT_IDS].shape[1] - 1:-1]


def _top2_gap(logits):
    """How far the largest logit leads the second: a greedy choice flips under rounding only near 0."""
    top = logits.topk(2, dim=-1).values
    return top[..., 0] - top[..., 1]


# --- generate_rollout ------------------------------------------------------------------------
def test_rollout_layout_and_groups(lm, tokenizer):
    G = 3
    rollout = generate_rollout(lm, tokenizer, PROMPTS, max_new_tokens=5, num_samples=G, seed=0, policy_version=7)
    B = len(PROMPTS) * G
    assert rollout.batch_size == torch.Size([B])
    assert rollout[K.GROUP_ID].tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    prompts = collate_prompts([tokenize_example({"prompt": p}, tokenizer) for p in PROMPTS], pad_id=0)
    torch.testing.assert_close(rollout[K.PROMPT_IDS], prompts[K.PROMPT_IDS].repeat_interleave(G, 0))
    torch.testing.assert_close(rollout[K.PROMPT_MASK], prompts[K.PROMPT_MASK].repeat_interleave(G, 0))
    assert rollout[K.PROMPT_MASK][:, -1].all()  # left padded
    assert rollout[K.RESPONSE_IDS].shape == rollout[K.RESPONSE_MASK].shape == rollout[K.OLD_LOGPROBS].shape == (B, 5)
    assert rollout[K.RESPONSE_MASK].dtype == torch.bool and rollout[K.OLD_LOGPROBS].dtype == torch.float32
    assert (rollout[K.POLICY_VERSION] == 7).all()
    samples = rollout[K.RESPONSE_IDS].view(len(PROMPTS), G, -1)
    assert all(not torch.equal(samples[p, 0], samples[p, 1]) for p in range(len(PROMPTS)))  # they are samples


def test_generation_stops_at_eos_and_masks_after(chatty, small_tokenizer):
    eos = small_tokenizer.eos_token_id
    rollout = generate_rollout(chatty, small_tokenizer, ["a", "ab", "b"], max_new_tokens=20, num_samples=4, seed=1)
    ids, mask, old = rollout[K.RESPONSE_IDS], rollout[K.RESPONSE_MASK], rollout[K.OLD_LOGPROBS]
    stopped = 0
    for b in range(ids.shape[0]):
        hits = (ids[b] == eos).nonzero()[:, 0].tolist()
        if hits:
            stopped += 1
            first = hits[0]
            assert mask[b].tolist() == [t <= first for t in range(ids.shape[1])]
            assert (ids[b, first + 1:] == small_tokenizer.pad_token_id).all()  # generate pads after EOS
        else:
            assert mask[b].all() and ids.shape[1] == 20
        assert (old[b][~mask[b]] == 0).all() and (old[b][mask[b]] < 0).all()
    assert stopped > 0  # the test exercised EOS


def test_pad_equal_to_eos_keeps_the_eos_token(chatty, small_tokenizer):
    import copy
    tok = copy.deepcopy(small_tokenizer)
    tok.pad_token = tok.eos_token
    rollout = generate_rollout(chatty, tok, ["a", "b"], max_new_tokens=20, num_samples=4, seed=1)
    ids, mask = rollout[K.RESPONSE_IDS], rollout[K.RESPONSE_MASK]
    lengths = mask.sum(-1)
    ended = lengths < ids.shape[1]
    assert ended.any()
    assert (ids[ended, lengths[ended] - 1] == tok.eos_token_id).all()  # the EOS itself is in the response


@pytest.mark.parametrize("behaviour", sorted(BEHAVIOUR_LOGPROBS))
def test_behaviour_logprobs_match_recomputation(lm, tokenizer, behaviour):
    rollout = generate_rollout(lm, tokenizer, PROMPTS, max_new_tokens=6, num_samples=2, temperature=0.7, seed=3,
                               behaviour=behaviour)
    for chunked in (True, False):
        rescored = score_rollout(rollout, policy=lm, temperature=0.7, chunked=chunked)
        torch.testing.assert_close(rescored[K.OLD_LOGPROBS], rollout[K.OLD_LOGPROBS], rtol=1e-5, atol=1e-5)
    at_one = score_rollout(rollout, policy=lm, temperature=1.0)
    assert not torch.allclose(at_one[K.OLD_LOGPROBS], rollout[K.OLD_LOGPROBS], atol=1e-3)  # τ matters


def test_top_k_behaviour_logprobs_are_of_the_truncated_distribution(lm, tokenizer):
    kw = dict(max_new_tokens=6, num_samples=2, temperature=0.8, top_k=4, seed=3)
    sampled = generate_rollout(lm, tokenizer, PROMPTS, behaviour="sampled", **kw)
    tempered = generate_rollout(lm, tokenizer, PROMPTS, behaviour="tempered", **kw)
    assert torch.equal(sampled[K.RESPONSE_IDS], tempered[K.RESPONSE_IDS])  # same draws
    full = score_rollout(sampled, policy=lm, temperature=0.8)[K.OLD_LOGPROBS]
    torch.testing.assert_close(tempered[K.OLD_LOGPROBS], full, rtol=1e-5, atol=1e-5)
    mask = sampled[K.RESPONSE_MASK]
    # renormalised over the top 4: log p_top4 = log p − log Σ_{top 4} p > log p
    assert (sampled[K.OLD_LOGPROBS][mask] > full[mask] + 1e-4).all()
    # and exactly that, recomputed by hand from the model's logits
    ids = torch.cat([sampled[K.PROMPT_IDS], sampled[K.RESPONSE_IDS]], -1)
    attn = torch.cat([sampled[K.PROMPT_MASK], mask], -1)
    P = sampled[K.PROMPT_IDS].shape[1]
    with torch.no_grad():
        pos = (attn.long().cumsum(-1) - 1).clamp(min=0)
        logits = lm(ids, attention_mask=attn.long(), position_ids=pos).logits[:, P - 1:-1] / 0.8
    top = logits.topk(4, dim=-1).values
    expected = logits.gather(-1, sampled[K.RESPONSE_IDS][..., None])[..., 0] - top.logsumexp(-1)
    torch.testing.assert_close(sampled[K.OLD_LOGPROBS][mask], expected[mask], rtol=1e-4, atol=1e-4)


def test_seed_generator_and_global_rng(llama, tokenizer):
    state = torch.get_rng_state()
    a = generate_rollout(llama, tokenizer, PROMPTS, max_new_tokens=4, seed=11)
    assert torch.equal(torch.get_rng_state(), state), "a seeded generation advanced the global RNG"
    b = generate_rollout(llama, tokenizer, PROMPTS, max_new_tokens=4, seed=11)
    c = generate_rollout(llama, tokenizer, PROMPTS, max_new_tokens=4, seed=12)
    assert (a == b).all() and not torch.equal(a[K.RESPONSE_IDS], c[K.RESPONSE_IDS])
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    d = generate_rollout(llama, tokenizer, PROMPTS, max_new_tokens=4, generator=g1)
    e = generate_rollout(llama, tokenizer, PROMPTS, max_new_tokens=4, generator=g2)
    f = generate_rollout(llama, tokenizer, PROMPTS, max_new_tokens=4, generator=g1)  # g1 has advanced
    assert (d == e).all() and not torch.equal(d[K.RESPONSE_IDS], f[K.RESPONSE_IDS])


def test_prompt_tensordict_any_padding(llama, tokenizer):
    rows = [tokenize_example({"prompt": p}, tokenizer) for p in PROMPTS]
    left = collate_prompts(rows, pad_id=0)
    ids = torch.zeros_like(left[K.PROMPT_IDS])
    mask = torch.zeros_like(left[K.PROMPT_MASK])
    for b, r in enumerate(rows):  # the same prompts, right padded
        ids[b, :len(r["prompt_ids"])] = torch.tensor(r["prompt_ids"])
        mask[b, :len(r["prompt_ids"])] = True
    right = TensorDict({K.PROMPT_IDS: ids, K.PROMPT_MASK: mask}, batch_size=[len(rows)])
    from_text = generate_rollout(llama, tokenizer, PROMPTS, max_new_tokens=4, seed=2)
    from_right = generate_rollout(llama, tokenizer, right, max_new_tokens=4, seed=2)
    assert (from_text == from_right).all()
    with pytest.raises(KeyError, match="generate_rollout: batch is missing 'prompt_mask'"):
        generate_rollout(llama, tokenizer, right.exclude(K.PROMPT_MASK), max_new_tokens=4)


def test_length_sampler_and_stop_tokens(llama, tokenizer):
    rollout = generate_rollout(llama, tokenizer, PROMPTS, max_new_tokens=50, length_sampler=lambda: 3, seed=0)
    assert rollout[K.RESPONSE_IDS].shape[1] == 3
    stops = list(range(7, len(tokenizer)))  # every ordinary character stops
    stopped = generate_rollout(llama, tokenizer, PROMPTS, max_new_tokens=6, stop_token_ids=stops, seed=0)
    lengths = stopped[K.RESPONSE_MASK].sum(-1)
    ids = stopped[K.RESPONSE_IDS]
    for b in range(len(PROMPTS)):
        n = int(lengths[b])
        assert ids[b, n - 1].item() in stops + [tokenizer.eos_token_id] or n == 6
        assert all(t not in stops for t in ids[b, :n - 1].tolist())


def test_greedy_decoding(lm, tokenizer):
    a = generate_rollout(lm, tokenizer, PROMPTS, max_new_tokens=4, do_sample=False)
    b = generate_rollout(lm, tokenizer, PROMPTS, max_new_tokens=4, do_sample=False, seed=99)
    assert (a == b).all()
    ids = torch.cat([a[K.PROMPT_IDS], a[K.RESPONSE_IDS]], -1)
    attn = torch.cat([a[K.PROMPT_MASK], a[K.RESPONSE_MASK]], -1)
    P = a[K.PROMPT_IDS].shape[1]
    with torch.no_grad():
        pos = (attn.long().cumsum(-1) - 1).clamp(min=0)
        logits = lm(ids, attention_mask=attn.long(), position_ids=pos).logits[:, P - 1:-1]
    mask = a[K.RESPONSE_MASK]
    # KV-cache decode vs one full forward: logits agree to float32 rounding (~1e-6), not bitwise; the ids
    # are compared exactly because no step is a near-tie (top-2 logit gap > 1e-3, seen >= 5.5e-3)
    assert (_top2_gap(logits)[mask] > 1e-3).all()
    assert torch.equal(logits.argmax(-1)[mask], a[K.RESPONSE_IDS][mask])
    rescored = score_rollout(a, policy=lm)  # greedy: behaviour log-probs at temperature 1
    torch.testing.assert_close(rescored[K.OLD_LOGPROBS], a[K.OLD_LOGPROBS], rtol=1e-5, atol=1e-5)


def test_max_prompt_length_and_conversations(llama, tokenizer):
    rollout = generate_rollout(llama, tokenizer, ["abcdefgh"], max_new_tokens=2, max_prompt_length=3, seed=0)
    assert tokenizer.decode(rollout[K.PROMPT_IDS][0]) == "fgh"
    chat = generate_rollout(llama, tokenizer, [[{"role": "user", "content": "hi"}]], max_new_tokens=2, seed=0)
    assert tokenizer.decode(chat[K.PROMPT_IDS][0]) == "<s><|user|>hi</s><|assistant|>"


def test_without_behaviour_logprobs(llama, tokenizer):
    plain = generate_rollout(llama, tokenizer, PROMPTS, max_new_tokens=3, seed=0, behaviour=None)
    recorded = generate_rollout(llama, tokenizer, PROMPTS, max_new_tokens=3, seed=0)
    assert K.OLD_LOGPROBS not in plain.keys()
    assert torch.equal(plain[K.RESPONSE_IDS], recorded[K.RESPONSE_IDS])


def test_errors(llama, tokenizer):
    with pytest.raises(ValueError, match=r"behaviour: unknown 'model'; valid: \['sampled', 'tempered'\]"):
        generate_rollout(llama, tokenizer, PROMPTS, behaviour="model")
    with pytest.raises(ValueError, match="temperature: expected > 0"):
        generate_rollout(llama, tokenizer, PROMPTS, temperature=0.0)
    with pytest.raises(TypeError, match="prompts: expected a list of strings"):
        generate_rollout(llama, tokenizer, "one prompt")
    with pytest.raises(ValueError, match=r"prompts: prompts \[1\] encode to no token"):
        generate_rollout(llama, tokenizer, ["a", ""])


# --- samplers and the sampling loop ------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(SAMPLERS))
def test_samplers_draw_from_the_softmax(name):
    z = torch.tensor([1.0, 0.0, -1.0, 2.0, -float("inf"), 0.5])
    n = 40_000
    draws = SAMPLERS[name](z.expand(n, -1), generator=torch.Generator().manual_seed(0))
    assert draws.shape == (n,) and draws.dtype == torch.long
    freq = torch.bincount(draws, minlength=6).double() / n
    p = z.double().softmax(-1)
    assert freq[4] == 0  # a −inf logit is never drawn
    assert (freq - p).abs().max() < 0.01, (freq, p)  # 4σ of a frequency over 40k draws
    # reproducible from its generator; the global RNG is not touched
    state = torch.get_rng_state()
    a = SAMPLERS[name](z.expand(64, -1), generator=torch.Generator().manual_seed(3))
    b = SAMPLERS[name](z.expand(64, -1), generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b) and torch.equal(torch.get_rng_state(), state)


def test_gumbel_max_against_a_plain_reference():
    z = torch.randn(5, 7, generator=torch.Generator().manual_seed(1))
    got = assert_pure(lambda x: gumbel_max_sample(x, generator=torch.Generator().manual_seed(4)), z)
    u = torch.rand(5, 7, generator=torch.Generator().manual_seed(4))
    for b in range(5):  # argmax_v z_v − log(−log u_v), written plainly
        scores = [z[b, v].item() - math.log(-math.log(u[b, v].item())) for v in range(7)]
        assert got[b].item() == max(range(7), key=scores.__getitem__)


def test_truncate_logits_golden_and_hf_warpers():
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper
    z = torch.tensor([[1.0, 3.0, 2.0, 2.0, -1.0]])
    inf = float("inf")
    assert truncate_logits(z, top_k=2).tolist() == [[-inf, 3.0, 2.0, 2.0, -inf]]  # ties with the k-th are kept
    # p = softmax([1, 3, 2, 0, −1]) = [.086, .636, .234, .032, .012]; ascending cumulative .012, .043, .129, .363, 1:
    # top-p 0.7 drops the entries whose cumulative is ≤ 0.3 (−1, 0, 1), top-p 0.5 also 2; top-p 0.01 keeps the max
    y = torch.tensor([[1.0, 3.0, 2.0, 0.0, -1.0]])
    assert truncate_logits(y, top_p=0.7).tolist() == [[-inf, 3.0, 2.0, -inf, -inf]]
    assert truncate_logits(y, top_p=0.5).tolist() == [[-inf, 3.0, -inf, -inf, -inf]]
    assert truncate_logits(y, top_p=0.01).tolist() == [[-inf, 3.0, -inf, -inf, -inf]]
    assert truncate_logits(y, top_k=3, top_p=0.7).tolist() == [[-inf, 3.0, 2.0, -inf, -inf]]
    assert truncate_logits(z) is z and truncate_logits(z, top_k=0, top_p=1.0) is z
    x = torch.randn(6, 50, generator=torch.Generator().manual_seed(2)) * 3
    for k, p in [(5, None), (None, 0.9), (10, 0.5), (1, 0.3), (80, None)]:
        ours = assert_pure(lambda t: truncate_logits(t, top_k=k, top_p=p), x)
        ref = x.clone()
        if k:
            ref = TopKLogitsWarper(min(k, 50))(None, ref)
        if p is not None:
            ref = TopPLogitsWarper(p)(None, ref)
        assert torch.equal(ours, ref), (k, p)


@pytest.mark.parametrize("sampler", sorted(SAMPLERS))
@pytest.mark.parametrize("behaviour", sorted(BEHAVIOUR_LOGPROBS))
def test_sampling_loop_logprobs_match_recomputation(lm, tokenizer, sampler, behaviour):
    rollout = generate_rollout(lm, tokenizer, PROMPTS, max_new_tokens=6, num_samples=3, temperature=0.7, seed=3,
                               behaviour=behaviour, engine="loop", sampler=sampler)
    assert rollout.batch_size == (9,) and rollout[K.GROUP_ID].tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert rollout[K.OLD_LOGPROBS].dtype == torch.float32
    samples = rollout[K.RESPONSE_IDS].view(3, 3, -1)
    assert all(not torch.equal(samples[p, 0], samples[p, 1]) for p in range(3))  # a shared prefill, distinct draws
    rescored = score_rollout(rollout, policy=lm, temperature=0.7)
    torch.testing.assert_close(rescored[K.OLD_LOGPROBS], rollout[K.OLD_LOGPROBS], rtol=1e-5, atol=1e-5)


def test_sampling_loop_truncation_logprobs(lm, tokenizer):
    kw = dict(max_new_tokens=6, num_samples=2, temperature=0.8, top_k=6, top_p=0.9, seed=5, engine="loop")
    sampled = generate_rollout(lm, tokenizer, PROMPTS, behaviour="sampled", **kw)
    tempered = generate_rollout(lm, tokenizer, PROMPTS, behaviour="tempered", **kw)
    assert torch.equal(sampled[K.RESPONSE_IDS], tempered[K.RESPONSE_IDS])  # same draws
    mask = sampled[K.RESPONSE_MASK]
    ids = torch.cat([sampled[K.PROMPT_IDS], sampled[K.RESPONSE_IDS]], -1)
    attn = torch.cat([sampled[K.PROMPT_MASK], mask], -1)
    P = sampled[K.PROMPT_IDS].shape[1]
    with torch.no_grad():
        pos = (attn.long().cumsum(-1) - 1).clamp(min=0)
        z = lm(ids, attention_mask=attn.long(), position_ids=pos).logits[:, P - 1:-1] / 0.8
    kept = truncate_logits(z.reshape(-1, z.shape[-1]), top_k=6, top_p=0.9).view_as(z)
    y = sampled[K.RESPONSE_IDS][..., None]
    assert torch.isfinite(kept.gather(-1, y))[mask].all()  # every draw inside the truncated support
    torch.testing.assert_close(sampled[K.OLD_LOGPROBS][mask], (kept.gather(-1, y)[..., 0] - kept.logsumexp(-1))[mask],
                               rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(tempered[K.OLD_LOGPROBS][mask], (z.gather(-1, y)[..., 0] - z.logsumexp(-1))[mask],
                               rtol=1e-4, atol=1e-4)
    assert (sampled[K.OLD_LOGPROBS][mask] >= tempered[K.OLD_LOGPROBS][mask] - 1e-6).all()


def test_sampling_loop_greedy_equals_generate(lm, tokenizer):
    loop = generate_rollout(lm, tokenizer, PROMPTS, max_new_tokens=5, do_sample=False, engine="loop")
    hf = generate_rollout(lm, tokenizer, PROMPTS, max_new_tokens=5, do_sample=False)
    # two decoders (the loop's cache vs generate's): logits agree to float32 rounding, not bitwise; the
    # ids are compared exactly because no greedy step is a near-tie (top-2 logit gap > 1e-3, seen >= 5.5e-3)
    assert (_top2_gap(_response_logits(lm, hf))[hf[K.RESPONSE_MASK]] > 1e-3).all()
    assert torch.equal(loop[K.RESPONSE_IDS], hf[K.RESPONSE_IDS])
    torch.testing.assert_close(loop[K.OLD_LOGPROBS], hf[K.OLD_LOGPROBS], rtol=1e-5, atol=1e-5)


def test_sampling_loop_stops_pads_and_ends_early(chatty, small_tokenizer):
    eos, pad = small_tokenizer.eos_token_id, small_tokenizer.pad_token_id
    rollout = generate_rollout(chatty, small_tokenizer, ["a", "ab", "b"], max_new_tokens=200, num_samples=4, seed=1,
                               engine="loop")
    ids, mask, old = rollout[K.RESPONSE_IDS], rollout[K.RESPONSE_MASK], rollout[K.OLD_LOGPROBS]
    lengths = mask.sum(-1)
    assert ids.shape[1] == lengths.max() < 200  # the loop ended when the last row stopped
    for b in range(ids.shape[0]):
        n = int(lengths[b])
        if n < ids.shape[1] or ids[b, n - 1] == eos:
            assert ids[b, n - 1] == eos and (ids[b, n:] == pad).all()
        assert (old[b][~mask[b]] == 0).all() and (old[b][mask[b]] < 0).all()


def test_sampling_loop_seed_generator_and_global_rng(llama, tokenizer):
    kw = dict(max_new_tokens=4, num_samples=2, engine="loop")
    state = torch.get_rng_state()
    a = generate_rollout(llama, tokenizer, PROMPTS, seed=11, **kw)
    assert torch.equal(torch.get_rng_state(), state), "a seeded generation advanced the global RNG"
    b = generate_rollout(llama, tokenizer, PROMPTS, seed=11, **kw)
    c = generate_rollout(llama, tokenizer, PROMPTS, seed=12, **kw)
    assert (a == b).all() and not torch.equal(a[K.RESPONSE_IDS], c[K.RESPONSE_IDS])
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    d = generate_rollout(llama, tokenizer, PROMPTS, generator=g1, **kw)
    e = generate_rollout(llama, tokenizer, PROMPTS, generator=g2, **kw)
    f = generate_rollout(llama, tokenizer, PROMPTS, generator=g1, **kw)
    assert (d == e).all() and not torch.equal(d[K.RESPONSE_IDS], f[K.RESPONSE_IDS])


def test_sampling_loop_errors(llama, tokenizer):
    with pytest.raises(ValueError, match=r"sampler: unknown 'fast'; valid: \['gumbel', 'inverse_cdf', 'multinomial'\]"):
        generate_rollout(llama, tokenizer, PROMPTS, engine="loop", sampler="fast")
    with pytest.raises(ValueError, match=r"engine: unknown 'vllm-fast'; valid: \['hf', 'loop', 'vllm'\]"):
        generate_rollout(llama, tokenizer, PROMPTS, engine="vllm-fast")
    with pytest.raises(ValueError, match=r"engine='loop': takes no generate_kwargs .*\['repetition_penalty'\]"):
        generate_rollout(llama, tokenizer, PROMPTS, engine="loop", repetition_penalty=1.2)
    with pytest.raises(ValueError, match=r"use_cache=False"):
        generate_rollout(llama, tokenizer, PROMPTS, engine="loop", use_cache=False)
    with pytest.raises(ValueError, match="max_new_tokens: expected >= 1, got 0"):
        generate_rollout(llama, tokenizer, PROMPTS, engine="loop", max_new_tokens=0)
    ids = torch.ones(2, 3, dtype=torch.long)
    with pytest.raises(TypeError, match="prompt_mask: expected a torch.bool mask"):
        sample_responses(llama, ids, torch.ones(2, 3), max_new_tokens=2, stop_token_ids=[2], pad_token_id=0)


def test_a_length_range_draws_the_budget_from_the_sampling_seed(llama, tokenizer):
    """(low, high): max_new_tokens ~ U[low, high) from a generator seeded with the call's seed (TRL LengthSampler)."""
    never = dict(eos_token_id=-1)  # no token stops: every response runs to the drawn budget
    widths = {}
    for seed in range(12):
        want = int(torch.randint(2, 7, (), generator=torch.Generator().manual_seed(seed)))
        rollout = generate_rollout(llama, tokenizer, PROMPTS, max_new_tokens=50, length_sampler=(2, 7), seed=seed,
                                   **never)
        widths[seed] = rollout[K.RESPONSE_IDS].shape[1]
        assert widths[seed] == want and bool(rollout[K.RESPONSE_MASK].all())
    assert set(widths.values()) <= set(range(2, 7)) and len(set(widths.values())) > 2
    again = generate_rollout(llama, tokenizer, PROMPTS, length_sampler=(2, 7), seed=5, **never)
    assert again[K.RESPONSE_IDS].shape[1] == widths[5]
    for bad in [(3, 3), (0, 4), (2.0, 4), (1, 2, 3)]:
        with pytest.raises(ValueError, match=r"length_sampler: expected \[low, high\) with 1 <= low < high"):
            generate_rollout(llama, tokenizer, PROMPTS, length_sampler=bad, seed=0)
