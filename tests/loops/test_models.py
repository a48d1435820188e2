"""Tests of loops/models.py: tokenizers, tiny models, trunk/value/reward forwards, reward helpers."""

import warnings

import pytest
import torch
from torch import nn

from rlcore.loops.models import (ARCHS, TOKENIZER_KINDS, ValueHead, build_model, build_reward_model, build_tokenizer,
                                 build_value_model, disable_dropout, last_token_index, load_model, load_tokenizer,
                                 make_reference, pad_token_id, policy_and_values, position_ids_from_mask,
                                 reward_model_scores, token_values, trunk_hidden)
from rlcore.loops.reward_fns import call_reward_fn, combine_rewards, missing_eos_penalty
from rlcore.testing import assert_pure, left_padded_mask, right_padded_mask

TEXTS = ["the cat sat on the mat", "2 + 2 = 4", "Hello, World!"]


def _padded(tokenizer, texts, side):
    enc = tokenizer(texts, padding=True, padding_side=side, return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"].bool()


# --- tokenizers ------------------------------------------------------------------------------
def test_char_tokenizer_round_trip_and_specials(tokenizer):
    for text in TEXTS + ["a\nb  c"]:
        ids = tokenizer(text)["input_ids"]
        assert len(ids) == len(text)  # one token per character, nothing added implicitly
        assert tokenizer.decode(ids) == text
    specials = [tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id]
    assert specials == [0, 1, 2, 3]
    assert tokenizer("é")["input_ids"] == [tokenizer.unk_token_id]
    assert len(tokenizer.convert_tokens_to_ids(["<|user|>"])) == 1
    assert tokenizer("<|user|>x")["input_ids"][0] == tokenizer.convert_tokens_to_ids("<|user|>")


def test_char_tokenizer_custom_vocab_and_padding_side():
    tok = build_tokenizer(vocab="ab", padding_side="left")
    assert len(tok) == 9 and tok.padding_side == "left"
    ids = tok(["a", "abb"], padding=True, return_tensors="pt")["input_ids"]
    assert ids[0, 0].item() == tok.pad_token_id and ids[0, -1].item() == tok.convert_tokens_to_ids("a")


def test_chat_template_prompt_is_prefix(tokenizer):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    prompt = tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert full == "<s><|user|>hi</s><|assistant|>yo</s>"
    assert full.startswith(prompt) and prompt.endswith("<|assistant|>")


def test_bpe_tokenizer_trains_and_round_trips():
    tok = build_tokenizer("bpe", texts=TEXTS * 20, vocab_size=300)
    assert len(tok) <= 300 and tok.eos_token_id == 2
    for text in TEXTS:
        ids = tok(text)["input_ids"]
        assert len(ids) < len(text)  # merges learned
        assert tok.decode(ids) == text


def test_tokenizer_errors():
    with pytest.raises(ValueError, match=r"kind: unknown 'word'; valid: \['bpe', 'char'\]"):
        build_tokenizer("word")
    with pytest.raises(ValueError, match="texts"):
        build_tokenizer("bpe")
    assert sorted(TOKENIZER_KINDS) == ["bpe", "char"]


def test_tokenizer_save_load_round_trip(tmp_path, tokenizer):
    build_tokenizer(save_dir=str(tmp_path))
    loaded = load_tokenizer(str(tmp_path), padding_side="left")
    assert loaded.padding_side == "left"
    for text in TEXTS:
        assert loaded(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert loaded.chat_template == tokenizer.chat_template
    assert (loaded.pad_token_id, loaded.eos_token_id) == (0, 2)


def test_load_tokenizer_without_pad_uses_eos(tmp_path, tokenizer):
    tok = build_tokenizer()
    tok.pad_token = None
    tok.save_pretrained(tmp_path)
    with pytest.warns(UserWarning, match="no pad token"):
        loaded = load_tokenizer(str(tmp_path))
    assert loaded.pad_token_id == loaded.eos_token_id == 2


def test_pad_token_id_fallback_and_error():
    tok = build_tokenizer()
    assert pad_token_id(tok) == 0
    tok.pad_token = None
    with pytest.warns(UserWarning, match="no pad token"):
        assert pad_token_id(tok) == 2
    tok.eos_token = None
    with pytest.raises(ValueError, match="neither a pad token nor an eos token"):
        pad_token_id(tok)


# --- models ----------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_build_model_ids_seed_and_rng(arch, tokenizer):
    state = torch.get_rng_state()
    a = build_model(arch, tokenizer=tokenizer, hidden_size=16, num_layers=1, num_heads=2, seed=3)
    assert torch.equal(torch.get_rng_state(), state), "build_model touched the global RNG"
    b = build_model(arch, tokenizer=tokenizer, hidden_size=16, num_layers=1, num_heads=2, seed=3)
    c = build_model(arch, tokenizer=tokenizer, hidden_size=16, num_layers=1, num_heads=2, seed=4)
    pa, pb, pc = (torch.cat([p.flatten() for p in m.parameters()]) for m in (a, b, c))
    assert torch.equal(pa, pb) and not torch.equal(pa, pc)
    assert a.config.vocab_size == len(tokenizer)
    for name in ("pad", "bos", "eos"):
        expected = getattr(tokenizer, f"{name}_token_id")
        assert getattr(a.config, f"{name}_token_id") == expected
        assert getattr(a.generation_config, f"{name}_token_id") == expected
    assert a.get_output_embeddings().weight is a.get_input_embeddings().weight  # tied by default
    for model in (a, build_value_model(arch, tokenizer=tokenizer, hidden_size=16, num_layers=1, num_heads=2)):
        assert not any(isinstance(m, nn.Dropout) and m.p > 0 for m in model.modules())


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_model_save_load_round_trip(tmp_path, arch, tokenizer):
    model = build_model(arch, tokenizer=tokenizer, hidden_size=16, num_layers=1, num_heads=2,
                        tie_word_embeddings=False)
    model.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path))
    assert type(loaded) is type(model)
    saved, restored = model.state_dict(), loaded.state_dict()
    assert saved.keys() == restored.keys() and all(torch.equal(saved[k], restored[k]) for k in saved)  # bitwise
    ids = torch.tensor([[5, 6, 7, 8]])
    # the same weights, but the loaded ones are not 64-byte aligned (buffers from safetensors, not torch) and BLAS
    # kernels can sum in another order for another alignment: float32 rounding, bound 1e-6
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=1e-6, atol=1e-6)
    half = load_model(str(tmp_path), dtype="bfloat16")
    assert next(half.parameters()).dtype == torch.bfloat16


def test_build_errors(tokenizer):
    with pytest.raises(ValueError, match=r"arch: unknown 'mamba'; valid: \['gpt2', 'llama'\]"):
        build_model("mamba", tokenizer=tokenizer)
    with pytest.raises(ValueError, match="vocab_size"):
        build_model()
    with pytest.raises(ValueError, match=r"task: unknown 'vision'; valid: \['causal_lm', 'reward', 'value'\]"):
        load_model("unused", task="vision")


def test_disable_dropout():
    model = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.3), nn.Sequential(nn.Dropout(0.1)))
    assert disable_dropout(model) is model
    assert all(m.p == 0.0 for m in model.modules() if isinstance(m, nn.Dropout))


# --- positions and trunk ---------------------------------------------------------------------
def test_position_ids_and_last_index_golden():
    mask = torch.tensor([[False, False, True, True], [True, True, True, False], [False] * 4])
    assert position_ids_from_mask(mask).tolist() == [[0, 0, 0, 1], [0, 1, 2, 2], [0, 0, 0, 0]]
    assert last_token_index(mask).tolist() == [3, 2, 0]
    assert_pure(position_ids_from_mask, mask)
    assert_pure(last_token_index, mask)
    with pytest.raises(TypeError, match="attention_mask: expected a torch.bool mask"):
        position_ids_from_mask(mask.long())


def test_last_token_index_matches_loop():
    lengths = torch.tensor([1, 4, 2, 6])
    for mask in (right_padded_mask(lengths, 6), left_padded_mask(lengths, 6)):
        expected = [max(t for t in range(6) if mask[b, t]) for b in range(4)]
        assert last_token_index(mask).tolist() == expected


def test_trunk_hidden_feeds_the_lm_head(lm, tokenizer):
    ids, mask = _padded(tokenizer, TEXTS, "left")
    hidden = trunk_hidden(lm, ids, mask)
    logits = lm(ids, attention_mask=mask.long(), position_ids=position_ids_from_mask(mask)).logits
    torch.testing.assert_close(lm.get_output_embeddings()(hidden), logits, rtol=1e-5, atol=1e-5)
    with pytest.raises(TypeError, match="attention_mask"):
        trunk_hidden(lm, ids, mask.long())
    with pytest.raises(ValueError, match=r"input_ids: expected a 2-d tensor \[B, T\], got shape \[\d+\]"):
        trunk_hidden(lm, ids[0], mask[0])


def test_policy_and_values_shared_trunk(lm, tokenizer):
    ids, mask = _padded(tokenizer, TEXTS, "right")
    head = ValueHead(lm.config.hidden_size, seed=1)
    logits, values = policy_and_values(lm, head, ids, mask)
    assert logits.shape == (*ids.shape, len(tokenizer)) and values.shape == ids.shape
    torch.testing.assert_close(values, token_values(lm, ids, mask, head=head))
    (logits.mean() + values.sum()).backward()
    assert head.summary.weight.grad is not None and lm.get_input_embeddings().weight.grad is not None
    lm.zero_grad(set_to_none=True)


def test_value_head_init_is_seeded():
    a, b, c = ValueHead(8, seed=0), ValueHead(8, seed=0), ValueHead(8, seed=1)
    assert torch.equal(a.summary.weight, b.summary.weight) and not torch.equal(a.summary.weight, c.summary.weight)
    assert torch.equal(a.summary.bias, torch.zeros(1))
    assert a(torch.zeros(2, 3, 8)).shape == (2, 3)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_value_model_padding_invariant(arch, tokenizer):
    critic = build_value_model(arch, tokenizer=tokenizer, hidden_size=16, num_layers=1, num_heads=2)
    (ri, rm), (li, lmask) = _padded(tokenizer, TEXTS, "right"), _padded(tokenizer, TEXTS, "left")
    right, left = token_values(critic, ri, rm), token_values(critic, li, lmask)
    assert right.shape == ri.shape
    torch.testing.assert_close(right[rm], left[lmask], rtol=1e-5, atol=1e-5)


# --- reward model ----------------------------------------------------------------------------
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_reward_model_reads_last_real_token_under_both_paddings(arch, tokenizer):
    rm = build_reward_model(arch, tokenizer=tokenizer, hidden_size=16, num_layers=2, num_heads=2)
    assert rm.config.num_labels == 1 and rm.config.pad_token_id == tokenizer.pad_token_id
    (ri, rmask), (li, lmask) = _padded(tokenizer, TEXTS, "right"), _padded(tokenizer, TEXTS, "left")
    right, left = reward_model_scores(rm, ri, rmask), reward_model_scores(rm, li, lmask)
    # reference: each row alone, unpadded, through HF's own pooling (the last token of the row)
    expected = torch.stack([rm(torch.tensor([tokenizer(t)["input_ids"]])).logits[0, 0] for t in TEXTS])
    torch.testing.assert_close(right, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(left, expected, rtol=1e-5, atol=1e-5)


def test_reward_model_when_pad_equals_eos(tokenizer):
    """HF's pad-id pooling stops at the first pad id; a row ending in EOS == pad must still be
    read at its last real token."""
    rm = build_reward_model(tokenizer=tokenizer, hidden_size=16, num_layers=1, num_heads=2)
    eos = tokenizer.eos_token_id
    rm.config.pad_token_id = eos
    ids = torch.tensor([[5, 6, eos, eos, eos], [5, 6, 7, eos, eos]])
    mask = torch.tensor([[True, True, True, False, False], [True, True, True, True, False]])
    got = reward_model_scores(rm, ids, mask)
    with torch.no_grad():
        hf_pooling = rm(ids, attention_mask=mask.long()).logits[:, 0]  # stops before the first EOS
        rm.config.pad_token_id = 0  # no 0 in ids: HF now pools at each unpadded row's last token
        expected = torch.stack([rm(ids[b:b + 1, :n]).logits[0, 0] for b, n in enumerate([3, 4])])
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(hf_pooling, expected, atol=1e-3)


def test_reward_model_scores_needs_a_head(lm):
    with pytest.raises(TypeError, match="no `score` or `classifier` head"):
        reward_model_scores(lm, torch.tensor([[1, 2]]), torch.tensor([[True, True]]))


# --- reward functions ------------------------------------------------------------------------
def exact_match(prompts, completions, answer, **_):
    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]


def length_reward(prompts, completions, **_):
    return torch.tensor([float(len(c)) for c in completions])


def abstains_on_empty(prompts, completions, **_):
    return [None if not c else 0.5 for c in completions]


def test_call_reward_fn_and_errors():
    out = call_reward_fn(exact_match, ["q", "q"], ["4", " 5"], answer=["4", "4"])
    assert out.dtype == torch.float32 and out.tolist() == [1.0, 0.0]
    assert torch.isnan(call_reward_fn(abstains_on_empty, ["q"], [""]))[0]
    with pytest.raises(ValueError, match=r"reward function .*: expected 2 scores \[B\], got shape \[1\]"):
        call_reward_fn(lambda completions, **kw: [1.0], ["a", "b"], ["x", "y"])


def test_combine_rewards_golden():
    fn = combine_rewards([exact_match, length_reward, abstains_on_empty], [2.0, 0.5, 1.0])
    out = fn(["q"] * 3, ["4", "abc", ""], answer=["4", "4", "4"])
    # row 0: 2·1 + 0.5·1 + 0.5; row 1: 0 + 1.5 + 0.5; row 2: 0 + 0 + (abstains)
    torch.testing.assert_close(torch.tensor(out), torch.tensor([3.0, 2.0, 0.0]))
    all_missing = combine_rewards([abstains_on_empty])(["q"], [""])
    assert all_missing == [None]  # no opinion from any term: no opinion
    with pytest.raises(ValueError, match="weights: expected 2 weights"):
        combine_rewards([exact_match, length_reward], [1.0])


def test_missing_eos_penalty_golden_and_reference():
    ids = torch.tensor([[4, 2, 0, 0], [4, 5, 6, 7], [4, 5, 2, 9], [4, 9, 9, 2]])
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 0]], dtype=torch.bool)
    score = torch.tensor([1.0, 1.0, 1.0, 1.0])
    out = assert_pure(missing_eos_penalty, score, ids, mask, eos_token_id=2, penalty=0.5)
    # row 3's EOS lies in the padding: it does not count
    torch.testing.assert_close(out, torch.tensor([1.0, 0.5, 1.0, 0.5]))
    reference = torch.tensor([s - 0.5 * (not any(mask[b, t] and ids[b, t] in (2, 9) for t in range(4)))
                              for b, s in enumerate(score.tolist())])
    torch.testing.assert_close(missing_eos_penalty(score, ids, mask, eos_token_id=[2, 9], penalty=0.5), reference)
    with pytest.raises(TypeError, match="response_mask: expected a torch.bool mask"):
        missing_eos_penalty(score, ids, mask.long(), eos_token_id=2)
    with pytest.raises(ValueError, match=r"score: expected a 1-d tensor \[B\]"):
        missing_eos_penalty(score[:, None], ids, mask, eos_token_id=2)


def test_missing_eos_penalty_gradient_and_float64():
    score = torch.tensor([1.0, 2.0], dtype=torch.float64, requires_grad=True)
    out = missing_eos_penalty(score, torch.tensor([[2], [5]]), torch.ones(2, 1, dtype=torch.bool), eos_token_id=2)
    assert out.dtype == torch.float64
    out.sum().backward()
    assert score.grad.tolist() == [1.0, 1.0]


# --- reference policy ------------------------------------------------------------------------
def test_make_reference_is_a_frozen_copy(tokenizer):
    model = build_model(tokenizer=tokenizer, hidden_size=16, num_layers=1, num_heads=2).train()
    ref = make_reference(model)
    assert not ref.training and not any(p.requires_grad for p in ref.parameters())
    assert all(p.requires_grad for p in model.parameters()) and model.training
    ids = torch.tensor([[5, 6, 7]])
    torch.testing.assert_close(ref(ids).logits, model(ids).logits)
    with torch.no_grad():
        model.get_input_embeddings().weight.add_(1.0)
    assert not torch.allclose(ref(ids).logits, model(ids).logits)


def test_no_warnings_building_models(tokenizer):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build_reward_model(tokenizer=tokenizer, hidden_size=16, num_layers=1, num_heads=2)
