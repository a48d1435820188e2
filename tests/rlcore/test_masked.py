"""Masked reductions, whitening and aggregation against plain loops, golden values and properties."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore.masked import AGGREGATIONS, aggregate, masked_mean, masked_sum, masked_var, masked_whiten
from rlcore.testing import assert_padding_invariant, assert_pure, make_rollout, right_padded_mask


def rows(values, mask):
    """The selected values of each row, as Python lists."""
    return [[float(v) for v, m in zip(vr, mr) if m] for vr, mr in zip(values.tolist(), mask.tolist())]


def random_case(B=5, T=7, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, generator=g, dtype=dtype)
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    lengths[0] = T  # one full row
    lengths[-1] = 0  # one empty row
    mask = right_padded_mask(lengths, T)
    return torch.where(mask, x, torch.tensor(float("nan"), dtype=dtype)), mask


def plain_var(vals, unbiased):
    n = len(vals)
    if n == 0:
        return 0.0
    mu = sum(vals) / n
    denom = max(n - 1, 1) if unbiased else n
    return sum((v - mu) ** 2 for v in vals) / denom


def test_golden_values():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, float("nan")]])
    m = torch.tensor([[True, True, True], [True, False, False]])
    assert masked_sum(x, m) == 10.0
    assert masked_mean(x, m) == 2.5
    torch.testing.assert_close(masked_mean(x, m, dim=-1), torch.tensor([2.0, 4.0]))
    torch.testing.assert_close(masked_var(x, m, dim=-1), torch.tensor([1.0, 0.0]))
    torch.testing.assert_close(masked_var(x, m, unbiased=False), torch.tensor(1.25))
    torch.testing.assert_close(masked_var(x, m), torch.tensor(5.0 / 3.0))


@pytest.mark.parametrize("unbiased", [True, False])
def test_reductions_against_loops(unbiased):
    x, m = random_case()
    per_row = rows(x, m)
    torch.testing.assert_close(masked_sum(x, m, dim=-1),
                               torch.tensor([sum(r) for r in per_row], dtype=x.dtype))
    torch.testing.assert_close(masked_mean(x, m, dim=-1),
                               torch.tensor([sum(r) / len(r) if r else 0.0 for r in per_row], dtype=x.dtype))
    torch.testing.assert_close(masked_var(x, m, dim=-1, unbiased=unbiased),
                               torch.tensor([plain_var(r, unbiased) for r in per_row], dtype=x.dtype))
    flat = [v for r in per_row for v in r]
    torch.testing.assert_close(masked_var(x, m, unbiased=unbiased),
                               torch.tensor(plain_var(flat, unbiased), dtype=x.dtype))


def test_matches_torch_var_mean_on_full_mask():
    x = torch.randn(4, 6, dtype=torch.float64)
    m = torch.ones_like(x, dtype=torch.bool)
    var, mean = torch.var_mean(x, dim=1)
    torch.testing.assert_close(masked_var(x, m, dim=1), var)
    torch.testing.assert_close(masked_mean(x, m, dim=1), mean)


def test_empty_mask_is_zero_not_nan():
    x = torch.full((3, 4), float("nan"))
    m = torch.zeros(3, 4, dtype=torch.bool)
    for out in (masked_sum(x, m), masked_mean(x, m), masked_var(x, m), masked_mean(x, m, dim=-1),
                masked_whiten(x, m), aggregate(x, m, "seq_mean_token_mean")):
        assert torch.isfinite(out).all() and (out == 0).all()


@settings(max_examples=40, deadline=None)
@given(B=st.integers(1, 6), T=st.integers(1, 9), seed=st.integers(0, 10_000), unbiased=st.booleans())
def test_whiten_gives_mean_zero_variance_one(B, T, seed, unbiased):
    x, m = random_case(B, T, seed)
    n = int(m.sum())
    w = masked_whiten(x * 5 + 3, m, unbiased=unbiased, eps=0.0 if n > 1 else 1e-8)
    assert torch.isfinite(w).all() and (w[~m] == 0).all()
    if n > 1 and float(masked_var(x, m)) > 1e-6:
        assert abs(float(masked_mean(w, m))) < 1e-9
        assert abs(float(masked_var(w, m, unbiased=unbiased)) - 1.0) < 1e-9


def test_whiten_keeps_mean_when_asked():
    x, m = random_case()
    w = masked_whiten(x, m, shift_mean=False)
    torch.testing.assert_close(masked_mean(w, m), masked_mean(x, m))
    expected = (x - masked_mean(x, m)) / torch.sqrt(masked_var(x, m) + 1e-8) + masked_mean(x, m)
    torch.testing.assert_close(w[m], expected[m])


def test_whiten_per_row():
    x, m = random_case()
    w = masked_whiten(x, m, dim=-1)
    for b, r in enumerate(rows(x, m)):
        if len(r) > 1:
            mu, var = sum(r) / len(r), plain_var(r, True)
            ref = torch.tensor([(v - mu) / math.sqrt(var + 1e-8) for v in r], dtype=x.dtype)
            torch.testing.assert_close(w[b][m[b]], ref)


def plain_aggregate(values, mask, mode, max_length=None):
    per_row = [r for r in rows(values, mask) if r]
    if mode == "token_mean":
        flat = [v for r in per_row for v in r]
        return sum(flat) / max(len(flat), 1)
    if mode == "seq_mean_token_sum":
        return sum(sum(r) for r in per_row) / max(len(per_row), 1)
    if mode == "seq_mean_token_mean":
        return sum(sum(r) / len(r) for r in per_row) / max(len(per_row), 1)
    if mode == "local_token_mean":  # alone (no step counts): the batch's token mean
        flat = [v for r in per_row for v in r]
        return sum(flat) / max(len(flat), 1)
    L = values.shape[-1] if max_length is None else max_length
    return sum(sum(r) for r in per_row) / (max(len(per_row), 1) * L)


@pytest.mark.parametrize("mode", sorted(AGGREGATIONS))
def test_aggregate_against_loops(mode):
    x, m = random_case(6, 8, seed=3)
    got = aggregate(x, m, mode, max_length=16)
    torch.testing.assert_close(got, torch.tensor(plain_aggregate(x, m, mode, 16), dtype=x.dtype))


@pytest.mark.parametrize("mode", sorted(set(AGGREGATIONS) - {"local_token_mean"}))
def test_global_denominators_make_microbatches_add_up(mode):
    """Summing micro-batch losses computed with the step's global counts gives the full loss."""
    x, m = random_case(8, 6, seed=5)
    full = aggregate(x, m, mode, max_length=6)
    num_tokens, num_seqs = m.sum(), m.any(-1).sum()
    parts = [aggregate(x[i:i + 2], m[i:i + 2], mode, num_tokens=num_tokens, num_seqs=num_seqs,
                       max_length=6) for i in range(0, 8, 2)]
    torch.testing.assert_close(sum(parts), full)


def test_local_token_mean_is_the_mean_of_the_micro_batches_token_means():
    """TRL's bnpo: each micro-batch normalised by its own tokens, weighted by its share of the rows."""
    x, m = random_case(8, 6, seed=5)
    m[:, 0], x[:, 0] = True, x[:, 0].nan_to_num(0.5)  # no empty row: every micro-batch's share is 2 / 8
    num_tokens, num_seqs = m.sum(), m.any(-1).sum()
    parts = [aggregate(x[i:i + 2], m[i:i + 2], "local_token_mean", num_tokens=num_tokens, num_seqs=num_seqs)
             for i in range(0, 8, 2)]
    means = [plain_aggregate(x[i:i + 2], m[i:i + 2], "token_mean") for i in range(0, 8, 2)]
    torch.testing.assert_close(sum(parts), torch.tensor(sum(means) / 4, dtype=x.dtype))
    assert not torch.allclose(sum(parts), aggregate(x, m, "token_mean"))  # it depends on the cut, by definition


@pytest.mark.parametrize("mode", sorted(AGGREGATIONS))
def test_aggregate_padding_invariant_and_pure(mode):
    batch = make_rollout(6, 7, empty_rows=1, dtype=torch.float64)
    fn = lambda td: aggregate(td["rewards"], td["response_mask"], mode, max_length=7)  # noqa: E731
    assert_padding_invariant(fn, batch, fill=float("nan"))
    assert_pure(aggregate, batch["rewards"], batch["response_mask"], mode)


@pytest.mark.parametrize("fn", [masked_sum, masked_mean, masked_var, masked_whiten])
def test_pure_and_gradient_ignores_padding(fn):
    x, m = random_case()
    assert_pure(fn, x, m)
    xg = x.clone().requires_grad_(True)
    fn(xg, m).sum().backward()
    assert torch.isfinite(xg.grad).all() and (xg.grad[~m] == 0).all()


def test_dtype_kept():
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        x, m = random_case(dtype=dtype)
        assert masked_mean(x, m).dtype == dtype and masked_whiten(x, m).dtype == dtype
        assert aggregate(x, m).dtype == dtype


def test_bad_input_messages():
    x = torch.randn(3, 4)
    with pytest.raises(TypeError, match=r"mask: expected a torch.bool mask, got dtype torch.int64"):
        masked_mean(x, torch.ones(3, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"mask: expected shape \[3, 4\].*got \[3, 5\]"):
        masked_mean(x, torch.ones(3, 5, dtype=torch.bool))
    with pytest.raises(TypeError, match=r"values: expected a floating-point tensor"):
        masked_sum(torch.ones(3, 4, dtype=torch.long), torch.ones(3, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"mode: unknown 'mean'; valid: \['local_token_mean', 'seq_mean_token_mean'"):
        aggregate(x, x > 0, "mean")
    with pytest.raises(ValueError, match=r"values: expected at least 1 dims"):
        aggregate(torch.tensor(1.0), torch.tensor(True))
