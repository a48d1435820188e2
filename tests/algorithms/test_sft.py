"""Tests of rlcore.algorithms.sft: token NLL, aggregation, next-token shift, packing helpers."""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from rlcore import keys as K
from rlcore.algorithms.sft import packed_position_ids, segment_causal_mask, sft_loss, sft_token_nll, shift_for_causal_lm
from rlcore.testing import MockLM, assert_padding_invariant, assert_pure, right_padded_mask
from tests.algorithms.conformance import check_loss_conformance


def _batch(B=4, T=6, dtype=torch.float64, seed=0, empty_rows=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    if empty_rows:
        lengths[B - empty_rows:] = 0
    mask = right_padded_mask(lengths, T)
    lp = -torch.rand(B, T, generator=g, dtype=torch.float64).to(dtype) * 3
    lp = torch.where(mask, lp, torch.full_like(lp, float("nan")))  # padding holds garbage
    return TensorDict({K.LOGPROBS: lp, K.LOSS_MASK: mask}, batch_size=[B])


# --- plain references written from the formula ------------------------------------------------
def _ref_token_mean(lp, mask):
    total, n = 0.0, 0
    for b in range(lp.shape[0]):
        for t in range(lp.shape[1]):
            if mask[b, t]:
                total += -float(lp[b, t])
                n += 1
    return total / max(n, 1)


def _ref_seq_mean_token_mean(lp, mask):
    per_seq = []
    for b in range(lp.shape[0]):
        vals = [-float(lp[b, t]) for t in range(lp.shape[1]) if mask[b, t]]
        if vals:
            per_seq.append(sum(vals) / len(vals))
    return sum(per_seq) / max(len(per_seq), 1)


def _ref_positions(seg):
    out = []
    for row in seg.tolist():
        pos, prev, p = [], None, 0
        for s in row:
            if s < 0:
                pos.append(0)
                prev = None
                continue
            p = p + 1 if s == prev else 0
            pos.append(p)
            prev = s
        out.append(pos)
    return torch.tensor(out)


def _ref_mask(seg):
    B, T = seg.shape
    out = torch.zeros(B, 1, T, T, dtype=torch.bool)
    for b in range(B):
        for i in range(T):
            for j in range(i + 1):
                if seg[b, i] < 0 or seg[b, j] < 0:
                    continue
                # same segment: equal ids with no other id (or padding) in between
                if all(seg[b, k] == seg[b, i] for k in range(j, i + 1)):
                    out[b, 0, i, j] = True
    return out


# --- sft_token_nll / sft_loss -----------------------------------------------------------------
def test_token_nll_matches_formula_and_zeroes_padding():
    batch = _batch()
    nll = sft_token_nll(batch[K.LOGPROBS], batch[K.LOSS_MASK])
    lp, m = batch[K.LOGPROBS], batch[K.LOSS_MASK]
    for b in range(lp.shape[0]):
        for t in range(lp.shape[1]):
            assert nll[b, t] == (-lp[b, t] if m[b, t] else 0.0)
    assert torch.isfinite(nll).all()


def test_golden_values():
    lp = torch.tensor([[-1.0, -2.0, -3.0], [-4.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True], [True, False, False]])
    batch = TensorDict({K.LOGPROBS: lp, K.LOSS_MASK: mask}, [2])
    loss, m = sft_loss(batch)
    assert loss.item() == pytest.approx(10 / 4)          # (1 + 2 + 3 + 4) / 4 tokens
    loss_seq, _ = sft_loss(batch, agg="seq_mean_token_mean")
    assert loss_seq.item() == pytest.approx((2 + 4) / 2)  # mean(2, 4)
    loss_sum, _ = sft_loss(batch, agg="seq_mean_token_sum")
    assert loss_sum.item() == pytest.approx(10 / 2)
    assert m["num_tokens"].item() == 4
    assert m["perplexity"].item() == pytest.approx(math.exp(2.5))
    assert m["loss_nll"].item() == pytest.approx(2.5)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_loss_against_loops(seed):
    batch = _batch(B=5, T=7, seed=seed, empty_rows=1)
    lp, mask = batch[K.LOGPROBS], batch[K.LOSS_MASK]
    loss, m = sft_loss(batch)
    assert loss.item() == pytest.approx(_ref_token_mean(lp, mask), rel=1e-12)
    loss_seq, _ = sft_loss(batch, agg="seq_mean_token_mean")
    assert loss_seq.item() == pytest.approx(_ref_seq_mean_token_mean(lp, mask), rel=1e-12)
    assert m["perplexity"].item() == pytest.approx(math.exp(_ref_token_mean(lp, mask)), rel=1e-12)


def test_metrics_are_detached_scalars_summing_to_loss():
    batch = _batch()
    lp = batch[K.LOGPROBS].clone().requires_grad_(True)
    loss, m = sft_loss(batch.copy().update({K.LOGPROBS: lp}))
    assert m.batch_size == torch.Size([])
    assert all(v.ndim == 0 and not v.requires_grad for v in m.values())
    loss_keys = [k for k in m.keys() if k.startswith("loss_")]
    assert sum(m[k] for k in loss_keys) == loss.detach()


def test_gradient_is_minus_one_over_tokens_and_ignores_nan_padding():
    batch = _batch(empty_rows=1)
    lp = batch[K.LOGPROBS].clone().requires_grad_(True)
    loss, _ = sft_loss(batch.copy().update({K.LOGPROBS: lp}))
    loss.backward()
    mask = batch[K.LOSS_MASK]
    expected = torch.where(mask, -1.0 / mask.sum(), 0.0).to(lp.dtype)
    torch.testing.assert_close(lp.grad, expected)


def test_gradcheck_float64():
    batch = _batch(B=3, T=4)
    mask = batch[K.LOSS_MASK]
    lp = torch.where(mask, batch[K.LOGPROBS], 0.0).requires_grad_(True)

    def f(x):
        return sft_loss(TensorDict({K.LOGPROBS: x, K.LOSS_MASK: mask}, [3]), agg="seq_mean_token_mean")[0]

    assert torch.autograd.gradcheck(f, (lp,))


def test_empty_mask_gives_zero_loss_not_nan():
    batch = _batch(B=2, T=3, empty_rows=2)
    loss, m = sft_loss(batch)
    assert loss.item() == 0.0 and m["perplexity"].item() == 1.0 and m["num_tokens"].item() == 0


def test_global_denominators_make_micro_batches_sum_to_the_full_loss():
    batch = _batch(B=6, T=5, seed=3)
    full, _ = sft_loss(batch)
    n_tok = batch[K.LOSS_MASK].sum()
    parts = sum(sft_loss(batch[i:i + 2], num_tokens=n_tok)[0] for i in range(0, 6, 2))
    torch.testing.assert_close(parts, full)
    full_seq, _ = sft_loss(batch, agg="seq_mean_token_mean")
    parts_seq = sum(sft_loss(batch[i:i + 3], agg="seq_mean_token_mean", num_seqs=6)[0] for i in (0, 3))
    torch.testing.assert_close(parts_seq, full_seq)


def test_pure_and_padding_invariant():
    batch = _batch(empty_rows=1)
    assert_pure(sft_loss, batch)
    assert_pure(sft_loss, batch, agg="seq_mean_token_mean")
    assert_pure(sft_token_nll, batch[K.LOGPROBS], batch[K.LOSS_MASK])
    for agg in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum"):
        assert_padding_invariant(lambda b, a=agg: sft_loss(b, agg=a), batch, mask_key=K.LOSS_MASK,
                                 fill=float("nan"))
        assert_padding_invariant(lambda b, a=agg: sft_loss(b, agg=a), batch, mask_key=K.LOSS_MASK)


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean"])
def test_conformance(agg):
    check_loss_conformance(partial(sft_loss, agg=agg), _batch(empty_rows=1), mask_key=K.LOSS_MASK,
                           grad_keys=[K.LOGPROBS])


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float64, 1e-12), (torch.bfloat16, 1e-2)])
def test_dtypes(dtype, tol):
    batch64 = _batch(dtype=torch.float64)
    batch = _batch(dtype=dtype)
    loss, m = sft_loss(batch)
    assert loss.dtype == dtype and m["perplexity"].dtype == dtype
    ref, _ = sft_loss(batch64)
    assert loss.double().item() == pytest.approx(ref.item(), rel=tol)


def test_bad_inputs_name_the_argument_and_shapes():
    batch = _batch()
    with pytest.raises(TypeError, match="loss_mask.*bool"):
        sft_loss(batch.copy().update({K.LOSS_MASK: batch[K.LOSS_MASK].float()}))
    with pytest.raises(KeyError, match="loss_mask"):
        sft_loss(batch.exclude(K.LOSS_MASK))
    with pytest.raises(ValueError, match=r"agg.*valid.*token_mean"):
        sft_loss(batch, agg="mean")
    with pytest.raises(ValueError, match=r"loss_mask: expected shape \[4, 6\].*got \[4, 5\]"):
        sft_token_nll(batch[K.LOGPROBS], batch[K.LOSS_MASK][:, :5])
    with pytest.raises(TypeError, match="logprobs.*floating"):
        sft_token_nll(torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.bool))


def test_with_mock_lm_matches_cross_entropy():
    """logits → shifted targets → gathered log-probs → sft_loss equals F.cross_entropy."""
    g = torch.Generator().manual_seed(0)
    model = MockLM(vocab_size=16, hidden_size=8)
    B, T = 3, 7
    ids = torch.randint(0, 16, (B, T), generator=g)
    attn = right_padded_mask(torch.tensor([7, 5, 3]), T)
    loss_mask = attn & (torch.arange(T) >= 2)            # completion-only: prompt of 2 tokens
    logits = model(ids, attn).logits.double()
    labels, label_mask = shift_for_causal_lm(ids, loss_mask, attention_mask=attn)
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, labels[..., None]).squeeze(-1)
    loss, _ = sft_loss(TensorDict({K.LOGPROBS: lp, K.LOSS_MASK: label_mask}, [B]))
    targets = torch.where(label_mask, labels, torch.full_like(labels, -100))
    ref = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 16), targets.reshape(-1))
    torch.testing.assert_close(loss, ref)


def test_chunked_hidden_state_logprobs_plug_in():
    """The loss takes log-probs, so rlcore.lm_head's logits-free path gives the same loss."""
    from rlcore.lm_head import hidden_logprobs
    from rlcore.logprobs import token_logprobs
    model = MockLM(vocab_size=16, hidden_size=8).double()
    ids = torch.randint(0, 16, (2, 6), generator=torch.Generator().manual_seed(1))
    attn = right_padded_mask(torch.tensor([6, 4]), 6)
    out = model(ids, attn)
    labels, label_mask = shift_for_causal_lm(ids, attn, attention_mask=attn)
    via_logits = token_logprobs(out.logits[:, :-1], labels)
    via_hidden = hidden_logprobs(out.hidden_states[:, :-1], model.lm_head.weight, labels, chunk_size=5)
    losses = [sft_loss(TensorDict({K.LOGPROBS: lp, K.LOSS_MASK: label_mask}, [2]))[0]
              for lp in (via_logits, via_hidden)]
    torch.testing.assert_close(losses[0], losses[1])


# --- shift_for_causal_lm ----------------------------------------------------------------------
def test_shift_aligns_targets_with_logits():
    ids = torch.tensor([[0, 0, 5, 6, 7]])
    attn = torch.tensor([[False, False, True, True, True]])   # left padded
    labels, lm = shift_for_causal_lm(ids, attn)
    assert labels.tolist() == [[0, 5, 6, 7]] and lm.tolist() == [[False, True, True, True]]
    # with the attention mask, the first real token is not predicted from a pad
    _, lm = shift_for_causal_lm(ids, attn, attention_mask=attn)
    assert lm.tolist() == [[False, False, True, True]]
    seg = torch.tensor([[0, 0, 1, 1, 1]])
    _, lm = shift_for_causal_lm(ids, torch.ones_like(attn), segment_ids=seg)
    assert lm.tolist() == [[True, False, True, True]]
    assert_pure(shift_for_causal_lm, ids, attn, attention_mask=attn, segment_ids=seg)


def test_shift_bad_inputs():
    ids = torch.zeros(2, 4, dtype=torch.long)
    with pytest.raises(TypeError, match="mask"):
        shift_for_causal_lm(ids, torch.ones(2, 4))
    with pytest.raises(ValueError, match=r"attention_mask: expected shape \[2, 4\]"):
        shift_for_causal_lm(ids, torch.ones(2, 4, dtype=torch.bool), attention_mask=torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"segment_ids: expected shape \[2, 4\]"):
        shift_for_causal_lm(ids, torch.ones(2, 4, dtype=torch.bool), segment_ids=torch.zeros(2, 5, dtype=torch.long))


# --- packing ----------------------------------------------------------------------------------
def test_packing_golden():
    seg = torch.tensor([[0, 0, 0, 1, 1, 7, -1, -1], [3, 3, 3, 3, 3, 3, 3, 3]])
    assert packed_position_ids(seg).tolist() == [[0, 1, 2, 0, 1, 0, 0, 0], list(range(8))]
    m = segment_causal_mask(seg)
    assert m.shape == (2, 1, 8, 8) and m.dtype == torch.bool
    assert m[1, 0].equal(torch.ones(8, 8, dtype=torch.bool).tril())
    assert m[0, 0, 4].tolist() == [False, False, False, True, True, False, False, False]
    assert not m[0, 0, 6:].any() and not m[0, 0, :, 6:].any()   # padding attends nowhere


def test_attention_mask_marks_padding_too():
    seg = torch.tensor([[0, 0, 1, 1]])
    attn = torch.tensor([[True, True, True, False]])
    assert packed_position_ids(seg, attention_mask=attn).tolist() == [[0, 1, 0, 0]]
    m = segment_causal_mask(seg, attention_mask=attn)
    assert not m[0, 0, 3].any() and not m[0, 0, :, 3].any()


def test_repeated_id_after_another_segment_is_a_new_segment():
    seg = torch.tensor([[0, 0, 1, 0, 0]])
    assert packed_position_ids(seg).tolist() == [[0, 1, 0, 0, 1]]
    assert not segment_causal_mask(seg)[0, 0, 3, :2].any()


segment_rows = st.lists(st.lists(st.integers(-1, 2), min_size=1, max_size=9), min_size=1, max_size=3)


@settings(max_examples=40, deadline=None)
@given(rows=segment_rows)
def test_packing_against_loops(rows):
    T = max(len(r) for r in rows)
    seg = torch.tensor([r + [-1] * (T - len(r)) for r in rows])
    assert packed_position_ids(seg).equal(_ref_positions(seg))
    assert segment_causal_mask(seg).equal(_ref_mask(seg))


def test_packing_pure_and_bad_inputs():
    seg = torch.tensor([[0, 0, 1, -1]])
    assert_pure(packed_position_ids, seg)
    assert_pure(segment_causal_mask, seg, attention_mask=seg >= 0)
    with pytest.raises(TypeError, match="segment_ids.*integer"):
        packed_position_ids(seg.float())
    with pytest.raises(ValueError, match=r"segment_ids: expected a 2-d tensor \[B, T\], got shape \[4\]"):
        segment_causal_mask(seg[0])
    with pytest.raises(TypeError, match="attention_mask.*bool"):
        segment_causal_mask(seg, attention_mask=seg.float())


def test_compiles_without_graph_breaks():
    seg = torch.tensor([[0, 0, 1, -1]])
    pos = torch.compile(packed_position_ids, backend="eager", fullgraph=True)(seg)
    assert pos.equal(packed_position_ids(seg))
    batch = _batch()
    nll = torch.compile(sft_token_nll, backend="eager", fullgraph=True)(batch[K.LOGPROBS], batch[K.LOSS_MASK])
    assert nll.equal(sft_token_nll(batch[K.LOGPROBS], batch[K.LOSS_MASK]))


@pytest.mark.slow
def test_packed_row_equals_separate_sequences_in_a_tiny_llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    seg = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, -1, -1]])
    ids = torch.randint(0, 32, (1, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        packed = model(input_ids=ids, attention_mask=segment_causal_mask(seg),
                       position_ids=packed_position_ids(seg)).logits
        naive = model(input_ids=ids).logits                    # plain causal: segments leak
        for s, e in [(0, 3), (3, 5), (5, 8)]:
            alone = model(input_ids=ids[:, s:e]).logits
            torch.testing.assert_close(packed[:, s:e], alone, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(naive[:, 3:5], model(input_ids=ids[:, 3:5]).logits, atol=1e-4)
