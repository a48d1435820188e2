"""The decode loop's fast parts (loops/engines.py): the inverse-CDF sampler, the preallocated KV
cache and the trunk-then-head decode forward, each against the plain way of doing the same."""

import copy

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from rlcore.loops import engines as E
from rlcore.loops.models import build_model, cache_keyword, position_ids_from_mask

PROMPTS = ["2+2=", "Hello", "x"]


def test_inverse_cdf_against_a_plain_reference():
    """The same uniforms through a Python loop over the cumulative probabilities."""
    z = torch.randn(16, 11, generator=torch.Generator().manual_seed(0))
    z[:, 3] = -float("inf")
    ours = E.inverse_cdf_sample(z, generator=torch.Generator().manual_seed(5))
    u = torch.rand(16, 1, generator=torch.Generator().manual_seed(5))[:, 0]
    p = z.double().softmax(-1)
    for b in range(16):
        total, pick = 0.0, None
        for v in range(11):
            total += float(p[b, v])
            if total > float(u[b]) and pick is None:
                pick = v
        assert int(ours[b]) == pick and pick != 3


def test_inverse_cdf_never_draws_a_masked_entry_at_the_edges():
    z = torch.full((4, 6), -float("inf"))
    z[:, 0] = 0.0  # one entry left: every draw is it, whatever the uniform
    z[2:, :] = -float("inf")
    z[2:, 5] = 3.0  # the last entry only
    assert E.inverse_cdf_sample(z).tolist() == [0, 0, 5, 5]


def test_preallocated_layer_equals_concatenation():
    g = torch.Generator().manual_seed(0)
    keys, values = torch.randn(2, 3, 4, 5, generator=g), torch.randn(2, 3, 4, 6, generator=g)
    plain, ours = DynamicLayer(), DynamicLayer()
    plain.update(keys, values)
    ours.update(keys, values)
    ours = E._PreallocatedLayer(ours, capacity=6)  # grows past its capacity after two steps
    for t in range(5):
        k, v = torch.randn(2, 3, 1 + t % 2, 5, generator=g), torch.randn(2, 3, 1 + t % 2, 6, generator=g)
        expected, got = plain.update(k, v), ours.update(k, v)
        assert all(torch.equal(a, b) for a, b in zip(expected, got))
        assert ours.get_seq_length() == plain.get_seq_length()
    assert ours.key_buffer.shape[-2] >= ours.get_seq_length() > 6


def _prefilled(model, tokenizer):
    enc = tokenizer(PROMPTS, return_tensors="pt", padding=True, padding_side="left")
    mask = enc["attention_mask"].bool()
    cache, logits, attention, position = E._prefill(model, enc["input_ids"], mask, 2)
    return cache, attention, position


def _peft_llama(tokenizer):
    from peft import LoraConfig, get_peft_model

    model = build_model("llama", tokenizer=tokenizer, hidden_size=32, num_layers=2, num_heads=4)
    lora = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    return lora.eval()


@pytest.mark.parametrize("kind", ["llama", "gpt2", "peft_llama"])
def test_decode_forward_agrees_with_the_models_forward(kind, tokenizer):
    """The trunk-then-head step (Llama, LoRA on Llama) and the fallback (GPT-2): the model's logits."""
    model = _peft_llama(tokenizer) if kind == "peft_llama" else build_model(
        kind, tokenizer=tokenizer, hidden_size=32, num_layers=2, num_heads=4).eval()
    forward = E._decode_forward(model)
    assert (forward.__name__ == "forward") == (kind != "gpt2")  # the fast path is taken where it applies
    with torch.no_grad():
        cache, attention, position = _prefilled(model, tokenizer)
        token = torch.arange(attention.shape[0])[:, None] + 5
        attention = torch.cat([attention, attention.new_ones(attention.shape[0], 1)], -1)
        theirs = model(input_ids=token, attention_mask=attention, position_ids=position[:, None] + 1,
                       use_cache=True, **{cache_keyword(model): copy.deepcopy(cache)}).logits[:, -1]
        ours = forward(token, attention, position[:, None] + 1, E._preallocate(cache, attention.shape[-1] + 4))
    assert ours.is_contiguous() and ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_loop_is_the_same_with_and_without_its_fast_parts(tokenizer, monkeypatch):
    """The preallocated cache and the trunk-then-head forward change no draw: the tokens of the plain
    loop (concatenated cache, the model's own forward) and its log-probs to float32 rounding."""
    model = build_model("llama", tokenizer=tokenizer, hidden_size=32, num_layers=2, num_heads=4).eval()
    enc = tokenizer(PROMPTS, return_tensors="pt", padding=True, padding_side="left")
    kw = dict(max_new_tokens=12, stop_token_ids=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id,
              num_samples=2, temperature=0.9)

    def run():
        return E.sample_responses(model, enc["input_ids"], enc["attention_mask"].bool(), **kw,
                                  generator=torch.Generator().manual_seed(0))
    fast = run()
    monkeypatch.setattr(E, "_preallocate", lambda cache, capacity: cache)
    monkeypatch.setattr(E, "_PLAIN_HEADS", frozenset())
    plain = run()
    assert torch.equal(fast[0], plain[0])
    for a, b in zip(fast[1:], plain[1:]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_position_ids_helper_is_what_the_prefill_uses(tokenizer):
    enc = tokenizer(PROMPTS, return_tensors="pt", padding=True, padding_side="left")
    model = build_model("llama", tokenizer=tokenizer, hidden_size=16, num_layers=1, num_heads=2).eval()
    with torch.no_grad():
        _, _, attention, position = E._prefill(model, enc["input_ids"], enc["attention_mask"].bool(), 1)
    assert torch.equal(position, position_ids_from_mask(enc["attention_mask"].bool())[:, -1])
    assert isinstance(DynamicCache(config=model.config), DynamicCache)
