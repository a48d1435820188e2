"""ReFT in the loops: spec and positions, hooks on HF models, save/load, SFT/DPO/generation recipes."""

import dataclasses
import doctest
import functools
import inspect
import json
import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from rlcore import keys as K
from rlcore.loops.checkpoint import load_checkpoint, save_checkpoint
from rlcore.loops.collate import collate
from rlcore.loops.tokenization import tokenize_example
from rlcore.loops.models import build_model
from rlcore.algorithms.dpo import dpo
from rlcore.loops.recipes import grpo, rloo
from rlcore.loops.collect import generate_rollout
from rlcore.loops.recipes.reft import (ReftConfig, evaluate, init_reft_state, load_config, reft_dpo_step,
                                       reft_grpo_step, reft_rloo_step, reft_sft_step, reft_spec, trainable_fraction,
                                       train_reft_online, train_reft_sft)
from rlcore.loops import reft_data, reft_model
from rlcore.loops.reft_data import (REFT_COMPONENTS, ReftSpec, collate_reft, parse_positions, reft_locations,
                                    with_intervention_locations)
from rlcore.loops.reft_model import (COMPONENT_HOOKS, ReftModel, find_blocks, intervene, intervened, load_interventions,
                                     make_interventions, reft_interventions, save_interventions)
from rlcore.loops.score import concatenated_forward, score_rollout, token_logprobs_from_model
from rlcore.loops.state import init_state
from rlcore.testing import assert_padding_invariant, assert_pure, left_padded_mask, right_padded_mask

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "reft_sft.yaml"
H = 32


@pytest.fixture(autouse=True)
def _one_thread():
    """These tiny models run faster on one thread than on an oversubscribed pool."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny(tokenizer, arch="llama", dtype=torch.float32, seed=0):
    return build_model(arch, tokenizer=tokenizer, hidden_size=H, num_layers=2, num_heads=4, dtype=dtype,
                       seed=seed).eval()


def sft_batch(tokenizer, spec, rows=None):
    rows = rows or [{"prompt": "spell: abc\n", "completion": "A-B-C"}, {"prompt": "hi\n", "completion": "yo there"},
                    {"prompt": "a long prompt here\n", "completion": "ok"}]
    tokenized = [tokenize_example(r, tokenizer) for r in rows]
    return collate_reft("prompt_completion", tokenized, pad_id=tokenizer.pad_token_id, spec=spec)


def to_left_padding(batch):
    """The same rows, left padded: each row rolled right by its padding."""
    mask = batch[K.ATTENTION_MASK]
    shift = (~mask).sum(-1)
    cols = (torch.arange(mask.shape[1]) - shift[:, None]) % mask.shape[1]
    return TensorDict({k: batch[k].gather(1, cols) for k in (K.INPUT_IDS, K.ATTENTION_MASK, K.LOSS_MASK)},
                      batch_size=batch.batch_size)


def logits(model, batch):
    with torch.no_grad():
        return model(batch[K.INPUT_IDS], attention_mask=batch[K.ATTENTION_MASK].long()).logits


# --- spec and positions -----------------------------------------------------------------------
def test_parse_positions_and_errors():
    assert parse_positions("f5+l5") == (5, 5)
    assert parse_positions("f3") == (3, 0)
    assert parse_positions("l2") == (0, 2)
    for bad in ("", "f5+", "5", "l5+f5", "f0+l0", "f-1", "x3", None):
        with pytest.raises(ValueError, match="positions"):
            parse_positions(bad)


def test_spec_json_round_trip_groups_and_errors():
    spec = ReftSpec(layers=[2, 0], positions="f2+l3", rank=3, variant="direft", act="relu")
    assert spec.layers == (2, 0) and spec.num_positions == 5
    assert ReftSpec.from_dict(json.loads(spec.to_json())) == spec
    assert spec.groups == (("first", slice(0, 2)), ("last", slice(2, 5)))
    assert spec.names() == ["layer2_first", "layer2_last", "layer0_first", "layer0_last"]
    assert dataclasses.replace(spec, share_weights=True).groups == (("all", slice(0, 5)),)
    assert ReftSpec(positions="l4").groups == (("all", slice(0, 4)),)
    with pytest.raises(ValueError, match=r"variant: unknown 'lora'; valid: \['consreft', 'direft', 'lobireft', "
                                         r"'loreft', 'nodireft', 'noreft'\]"):
        ReftSpec(variant="lora")
    with pytest.raises(ValueError, match="component"):
        ReftSpec(component="mlp")
    assert set(REFT_COMPONENTS) == set(COMPONENT_HOOKS)
    with pytest.raises(ValueError, match="layers"):
        ReftSpec(layers=(1, 1))
    with pytest.raises(ValueError, match="rank"):
        ReftSpec(rank=0)
    with pytest.raises(ValueError, match=r"unknown fields \['bogus'\]"):
        ReftSpec.from_dict({"bogus": 1})


def reference_locations(mask, first_n, last_n):
    out = []
    for row in mask.tolist():
        cols = [t for t, m in enumerate(row) if m]
        L = len(cols)
        cap = L // 2 if first_n and last_n else L
        a, c = min(first_n, cap), min(last_n, cap)
        out.append([cols[j] if j < a else -1 for j in range(first_n)]
                   + [cols[L - c + k] if k < c else -1 for k in range(last_n)])
    return torch.tensor(out, dtype=torch.long).reshape(len(out), first_n + last_n)


def test_locations_golden_left_and_right_padding():
    lengths = torch.tensor([7, 3, 1, 0])
    right = reft_locations(right_padded_mask(lengths, 9), first_n=5, last_n=5)
    assert right.tolist() == [[0, 1, 2, -1, -1, 4, 5, 6, -1, -1],
                              [0, -1, -1, -1, -1, 2, -1, -1, -1, -1],
                              [-1] * 10, [-1] * 10]
    left = reft_locations(left_padded_mask(lengths, 9), first_n=5, last_n=5)
    shift = (9 - lengths)[:, None]
    assert torch.equal(left, torch.where(right >= 0, right + shift, -1))
    assert reft_locations(right_padded_mask(lengths, 9), first_n=0, last_n=2).tolist() == \
        [[5, 6], [1, 2], [0, -1], [-1, -1]]


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), st.integers(0, 10), st.integers(0, 4), st.integers(0, 4), st.integers(0, 2**31 - 1))
def test_locations_match_reference(B, T, first_n, last_n, seed):
    if first_n + last_n == 0:
        first_n = 1
    mask = torch.rand(B, T, generator=torch.Generator().manual_seed(seed)) < 0.6
    got = reft_locations(mask, first_n=first_n, last_n=last_n)
    assert got.dtype == torch.long
    assert torch.equal(got, reference_locations(mask, first_n, last_n))


def test_locations_pure_padding_invariant_compiles_and_checks():
    mask = left_padded_mask(torch.tensor([4, 6, 2]), 7)
    assert_pure(reft_locations, mask, first_n=2, last_n=3)
    batch = TensorDict({K.PROMPT_MASK: mask}, batch_size=[3])
    assert_padding_invariant(lambda b: reft_locations(b[K.PROMPT_MASK], first_n=2, last_n=3), batch,
                             mask_key=K.PROMPT_MASK)
    compiled = torch.compile(reft_locations, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(mask, first_n=2, last_n=3), reft_locations(mask, first_n=2, last_n=3))
    with pytest.raises(TypeError, match=r"prompt_mask: expected a torch.bool mask, got dtype torch.int64"):
        reft_locations(mask.long(), first_n=1, last_n=1)
    with pytest.raises(ValueError, match=r"prompt_mask: expected a 2-d tensor \[B, T\], got shape \[7\]"):
        reft_locations(mask[0], first_n=1, last_n=1)


def test_collation_positions_follow_padding_and_truncation(tokenizer):
    spec = ReftSpec(positions="f2+l2")
    batch = sft_batch(tokenizer, spec)
    assert_pure(with_intervention_locations, batch.exclude(K.INTERVENTION_LOCATIONS), spec)
    prompts = [tokenize_example(r, tokenizer)["prompt_ids"] for r in
               [{"prompt": "spell: abc\n", "completion": "x"}, {"prompt": "hi\n", "completion": "x"},
                {"prompt": "a long prompt here\n", "completion": "x"}]]
    for b, p in enumerate(prompts):
        loc = batch[K.INTERVENTION_LOCATIONS][b]
        n = min(2, len(p) // 2)  # "hi\n": 3 tokens, one per block
        assert batch[K.INPUT_IDS][b, loc[loc >= 0]].tolist() == p[:n] + p[len(p) - n:]
    left = with_intervention_locations(to_left_padding(batch), spec)
    def ids_at(bt):
        loc = bt[K.INTERVENTION_LOCATIONS]
        return torch.where(loc >= 0, bt[K.INPUT_IDS].gather(1, loc.clamp(min=0)), -1)

    assert torch.equal(ids_at(left), ids_at(batch))
    assert not torch.equal(left[K.INTERVENTION_LOCATIONS], batch[K.INTERVENTION_LOCATIONS])
    # keep_end truncation drops the prompt's start: positions are those of the tokens kept
    row = tokenize_example({"prompt": "abcdefgh", "completion": "xyz"}, tokenizer, max_length=7, truncation="keep_end")
    cut = collate_reft("prompt_completion", [row], pad_id=0, spec=spec)
    assert row["prompt_ids"] == tokenizer("fgh")["input_ids"]  # 8 + 4 tokens cut to 7
    assert cut[K.INTERVENTION_LOCATIONS].tolist() == [[0, -1, 2, -1]]  # L = 3: one token per block
    # preference batches get locations per side; prompt batches use prompt_mask
    pair = collate_reft("preference", [tokenize_example({"prompt": "abc", "chosen": "d", "rejected": "ef"}, tokenizer)],
                        pad_id=0, spec=spec)
    assert pair["chosen", K.INTERVENTION_LOCATIONS].tolist() == [[0, -1, 2, -1]] == \
        pair["rejected", K.INTERVENTION_LOCATIONS].tolist()
    prompt = collate("prompt_only", [{"prompt_ids": [5, 6, 7, 8]}, {"prompt_ids": [5]}], pad_id=0)
    assert with_intervention_locations(prompt, spec)[K.INTERVENTION_LOCATIONS].tolist() == [[0, 1, 2, 3],
                                                                                           [-1] * 4]  # L // 2 = 0
    with pytest.raises(KeyError, match="prompt_mask"):
        with_intervention_locations(TensorDict({K.INPUT_IDS: torch.zeros(1, 2)}, [1]), spec)


# --- hooks -------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_find_blocks(tokenizer, arch):
    model = tiny(tokenizer, arch)
    owner, blocks = find_blocks(model)
    expected = (model.model, model.model.layers) if arch == "llama" else (model.transformer, model.transformer.h)
    assert owner is expected[0] and blocks is expected[1]
    path = "model.layers" if arch == "llama" else "transformer.h"
    assert find_blocks(model, path)[1] is blocks
    with pytest.raises(ValueError, match="spec.blocks"):
        find_blocks(model, "model.nope" if arch == "llama" else "transformer.nope")


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_zero_init_is_identity_and_removal_restores_base(tokenizer, arch):
    model, spec = tiny(tokenizer, arch), ReftSpec(layers=(0, 1), positions="f2+l2", rank=4)
    batch = sft_batch(tokenizer, spec)
    base = logits(model, batch)
    zero = make_interventions(spec, H, zero_init=True, generator=torch.Generator().manual_seed(0))
    with reft_interventions(model, spec, zero, batch[K.INTERVENTION_LOCATIONS]):
        torch.testing.assert_close(logits(model, batch), base, rtol=0, atol=1e-6)  # W h + b − R h rounds to ~1e-8
    rand = make_interventions(spec, H, generator=torch.Generator().manual_seed(0))
    with reft_interventions(model, spec, rand, batch[K.INTERVENTION_LOCATIONS]):
        assert (logits(model, batch) - base).abs().max() > 1e-2
    assert torch.equal(logits(model, batch), base)  # bit-identical after removal
    with pytest.raises(RuntimeError, match="boom"):
        with reft_interventions(model, spec, rand, batch[K.INTERVENTION_LOCATIONS]):
            raise RuntimeError("boom")
    owner, blocks = find_blocks(model)
    assert not owner._forward_pre_hooks and not any(b._forward_hooks or b._forward_pre_hooks for b in blocks)
    assert torch.equal(logits(model, batch), base)


@pytest.mark.parametrize("component", ["block_output", "block_input"])
def test_loreft_formula_on_the_hooked_hidden_state(tokenizer, component):
    model, spec = tiny(tokenizer), ReftSpec(layers=(1,), positions="f2+l1", rank=3, component=component)
    batch = sft_batch(tokenizer, spec)
    iv = make_interventions(spec, H, generator=torch.Generator().manual_seed(1))
    block = model.model.layers[1]
    seen = []

    def record_output(module, args, output):
        seen.append(output.detach().clone())

    def record_input(module, args, kwargs):
        seen.append((args[0] if args else kwargs["hidden_states"]).detach().clone())

    def run():
        handle = block.register_forward_hook(record_output) if component == "block_output" \
            else block.register_forward_pre_hook(record_input, with_kwargs=True)
        try:
            logits(model, batch)
        finally:
            handle.remove()

    run()
    with reft_interventions(model, spec, iv, batch[K.INTERVENTION_LOCATIONS]):
        run()  # the recorder, registered after the intervention, sees the edited state
    h, edited = seen
    expected = h.clone().double()
    loc = batch[K.INTERVENTION_LOCATIONS]
    for b in range(loc.shape[0]):
        for j in range(loc.shape[1]):
            p = int(loc[b, j])
            if p < 0:
                continue
            m = iv["layer1_first" if j < 2 else "layer1_last"]
            R, W, bias = m.rotation.double(), m.weight.double(), m.bias.double()
            x = h[b, p].double()
            expected[b, p] = x + R.T @ (W @ x + bias - R @ x)
    torch.testing.assert_close(edited.double(), expected, rtol=1e-5, atol=1e-5)
    untouched = torch.ones(h.shape[:2], dtype=torch.bool)
    for b in range(loc.shape[0]):
        untouched[b, loc[b][loc[b] >= 0]] = False
    assert torch.equal(edited[untouched], h[untouched]) and not torch.equal(edited, h)


def test_intervene_kernel_pure_offset_nan_padding_and_errors():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, 5, 3, generator=g)
    loc = torch.tensor([[0, 3], [4, -1]])
    edits = [(slice(0, 1), lambda x: x * 2), (slice(1, 2), lambda x: x + 1)]
    out = assert_pure(intervene, h, loc, edits)
    expected = h.clone()
    expected[0, 0] *= 2
    expected[0, 3] += 1
    expected[1, 4] *= 2
    assert torch.equal(out, expected)
    # a forward starting at column 3 (KV cache) sees columns 3, 4 only
    tail = intervene(h[:, 3:], loc, edits, offset=3)
    assert torch.equal(tail, expected[:, 3:])
    # garbage in extra columns (past T) does not reach the edited positions
    padded = torch.cat([h, torch.full((2, 2, 3), math.nan)], 1)
    assert torch.equal(intervene(padded, loc, edits)[:, :5], expected)
    compiled = torch.compile(intervene, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(h, loc, edits), expected)
    with pytest.raises(ValueError, match=r"locations: expected shape \[2, n\] .* got \[3, 2\]"):
        intervene(h, loc.repeat(2, 1)[:3], edits)
    with pytest.raises(TypeError, match="locations: expected an integer tensor"):
        intervene(h, loc.float(), edits)
    with pytest.raises(ValueError, match=r"hidden: expected a 3-d tensor \[B, T, H\]"):
        intervene(h[0], loc, edits)


def test_install_errors(tokenizer):
    model, spec = tiny(tokenizer), ReftSpec(layers=(0,), positions="f2+l2")
    iv = make_interventions(spec, H)
    loc = torch.zeros(2, 4, dtype=torch.long)
    with pytest.raises(ValueError, match=r"locations: expected shape \[B, 4\] for positions 'f2\+l2', got \[2, 3\]"):
        with reft_interventions(model, spec, iv, loc[:, :3]):
            pass
    with reft_interventions(model, spec, iv, loc):
        with pytest.raises(RuntimeError, match="already installed"):
            with reft_interventions(model, spec, iv, loc):
                pass
    far = ReftSpec(layers=(5,), positions="f2+l2")
    with pytest.raises(ValueError, match=r"spec.layers: \[5\] out of range for a model of 2 blocks"):
        with reft_interventions(model, far, make_interventions(far, H), loc):
            pass
    with pytest.raises(ValueError, match="interventions: missing"):
        with reft_interventions(model, far, iv, loc):
            pass
    with pytest.raises(ValueError, match=r"locations: expected shape \[3, n\]"):
        with reft_interventions(model, spec, iv, loc):
            logits(model, sft_batch(tokenizer, spec))


def test_positions_correct_under_left_and_right_padding(tokenizer):
    model, spec = tiny(tokenizer), ReftSpec(layers=(0, 1), positions="f2+l2", rank=4)
    iv = make_interventions(spec, H, generator=torch.Generator().manual_seed(3))
    right = sft_batch(tokenizer, spec)
    left = with_intervention_locations(to_left_padding(right), spec)
    out = []
    for batch in (right, left):
        with torch.no_grad(), reft_interventions(model, spec, iv, batch[K.INTERVENTION_LOCATIONS]):
            lp = token_logprobs_from_model(model, batch[K.INPUT_IDS], batch[K.ATTENTION_MASK])
        out.append(lp[batch[K.ATTENTION_MASK][:, 1:] & batch[K.ATTENTION_MASK][:, :-1]])
    torch.testing.assert_close(out[0], out[1], rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # and the interventions matter there
        base = token_logprobs_from_model(model, right[K.INPUT_IDS], right[K.ATTENTION_MASK])
    assert (base[right[K.ATTENTION_MASK][:, 1:] & right[K.ATTENTION_MASK][:, :-1]] - out[0]).abs().max() > 1e-3


@pytest.mark.parametrize("dtype,atol", [(torch.float64, 1e-12), (torch.bfloat16, 0.0)])
def test_dtypes(tokenizer, dtype, atol):
    model, spec = tiny(tokenizer, dtype=dtype), ReftSpec(layers=(1,), positions="f1+l1", rank=2)
    batch = sft_batch(tokenizer, spec)
    base = logits(model, batch)
    for zero_init in (True, False):  # parameters in float64 for a float64 model, float32 for bf16
        iv = make_interventions(spec, H, zero_init=zero_init, generator=torch.Generator().manual_seed(0),
                                dtype=torch.promote_types(dtype, torch.float32))
        with reft_interventions(model, spec, iv, batch[K.INTERVENTION_LOCATIONS]):
            out = logits(model, batch)
        assert out.dtype == dtype and torch.isfinite(out).all()
        if zero_init:  # W h + b − R h rounds to ~1e-16 in float64, and away entirely in bf16
            torch.testing.assert_close(out, base, rtol=0, atol=atol)
        else:
            assert not torch.equal(out, base)


# --- wrapper, save / load ----------------------------------------------------------------------
def test_wrapper_forward_generate_and_frozen_base(tokenizer):
    model, spec = tiny(tokenizer), ReftSpec(layers=(0,), positions="f2+l2", rank=2)
    batch = sft_batch(tokenizer, spec)
    base = logits(model, batch)
    wrapped = ReftModel(model, spec, generator=torch.Generator().manual_seed(0))
    assert not any(p.requires_grad for p in model.parameters())
    assert {id(p) for p in wrapped.trainable_parameters()} == {id(p) for p in wrapped.interventions.parameters()}
    loc = batch[K.INTERVENTION_LOCATIONS]
    with torch.no_grad():
        out = wrapped(batch[K.INPUT_IDS], attention_mask=batch[K.ATTENTION_MASK].long(), intervention_locations=loc)
        plain = wrapped(batch[K.INPUT_IDS], attention_mask=batch[K.ATTENTION_MASK].long()).logits
    with reft_interventions(model, spec, wrapped.interventions, loc):
        assert torch.equal(out.logits, logits(model, batch))
    assert torch.equal(plain, base) and not torch.equal(out.logits, base)
    prompt = with_intervention_locations(collate("prompt_only", [{"prompt_ids": [7, 8, 9, 10]}, {"prompt_ids": [7, 8]}],
                                                 pad_id=0), spec)
    seqs = wrapped.generate(prompt[K.PROMPT_IDS], attention_mask=prompt[K.PROMPT_MASK].long(), max_new_tokens=3,
                            do_sample=True, num_return_sequences=2, pad_token_id=0,
                            intervention_locations=prompt[K.INTERVENTION_LOCATIONS])
    assert seqs.shape == (4, 7)
    with pytest.raises(ValueError, match="differs"):
        ReftModel(model, dataclasses.replace(spec, rank=3), wrapped.interventions)


@pytest.mark.parametrize("variant", ["loreft", "direft", "nodireft", "consreft", "lobireft"])
def test_save_load_identical_outputs(tokenizer, tmp_path, variant):
    model, spec = tiny(tokenizer), ReftSpec(layers=(0, 1), positions="f2+l2", rank=3, variant=variant)
    batch = sft_batch(tokenizer, spec)
    state = init_reft_state(model, spec, lr=5e-2, seed=0)
    for _ in range(2):  # move R off its initialisation
        state, _ = reft_sft_step(state, batch)
    iv = state.model("interventions")
    save_interventions(tmp_path / "reft", spec, iv)
    assert sorted(p.name for p in (tmp_path / "reft").iterdir()) == ["interventions.safetensors", "reft_config.json"]
    spec2, iv2 = load_interventions(tmp_path / "reft")
    assert spec2 == spec
    outs = []
    for interventions in (iv, iv2):
        with reft_interventions(model, spec, interventions, batch[K.INTERVENTION_LOCATIONS]):
            outs.append(logits(model, batch))
    assert torch.equal(outs[0], outs[1])
    wrapped = ReftModel.load(model, tmp_path / "reft")
    with torch.no_grad():
        again = wrapped(batch[K.INPUT_IDS], attention_mask=batch[K.ATTENTION_MASK].long(),
                        intervention_locations=batch[K.INTERVENTION_LOCATIONS]).logits
    assert torch.equal(again, outs[0])


def test_checkpoint_round_trip_stores_interventions_only(tokenizer, tmp_path):
    spec = ReftSpec(layers=(1,), positions="f1+l1", rank=2)
    state = init_reft_state(tiny(tokenizer), spec, lr=1e-2, seed=0)
    state, _ = reft_sft_step(state, sft_batch(tokenizer, spec))
    path = save_checkpoint(tmp_path, state)
    assert sorted(p.name for p in (path / "models").iterdir()) == ["interventions"]
    fresh = init_reft_state(tiny(tokenizer), spec, lr=1e-2, seed=1)
    restored = load_checkpoint(path, fresh, restore_global_rng=False)
    for (k, a), b in zip(state.model("interventions").state_dict().items(),
                         restored.model("interventions").state_dict().values()):
        assert torch.equal(a, b), k


# --- training ----------------------------------------------------------------------------------
def test_reft_sft_recipe_lowers_loss_with_under_one_percent_trainable(tmp_path):
    config = load_config(CONFIG, steps=24, eval_every=12, num_train=96, num_eval=16, run_dir=str(tmp_path),
                         save_every=24)
    state, history = train_reft_sft(config)
    trainable, total = trainable_fraction(state)
    assert trainable / total < 0.01, (trainable, total)  # 2064 / 271376 = 0.76 %
    first, last = history[0]["loss"], sum(h["loss"] for h in history[-4:]) / 4
    assert last < first - 0.15, (first, last)
    assert history[-1]["eval/loss"] < history[11]["eval/loss"]
    assert state.optimizer_steps == 24 and all(math.isfinite(h["grad_norm"]) for h in history)
    assert sorted(p.name for p in (tmp_path / "checkpoint-24" / "models").iterdir()) == ["interventions"]
    assert evaluate(state, config)["loss"] == pytest.approx(history[-1]["eval/loss"], rel=1e-6)


def test_training_keeps_base_frozen_and_R_orthonormal(tokenizer):
    # block 0: every intervention there reaches the completion's predictions (at the last block,
    # an edit of the first prompt tokens only changes their own next-token logits, not scored)
    model, spec = tiny(tokenizer), ReftSpec(layers=(0,), positions="f2+l2", rank=4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = init_reft_state(model, spec, lr=5e-2, seed=0)
    R0 = {k: m.rotation.detach().clone() for k, m in state.model("interventions").items()}
    batch = sft_batch(tokenizer, spec)
    for _ in range(5):
        state, metrics = reft_sft_step(state, batch, micro_batch_size=2)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    for name, m in state.model("interventions").items():
        R = m.rotation.detach()
        assert (R - R0[name]).abs().max() > 1e-3, name  # R trained ...
        torch.testing.assert_close(R @ R.T, torch.eye(spec.rank), rtol=0, atol=1e-5)  # ... and stays orthonormal


def test_reft_dpo_reference_is_base_and_loss_decreases(tokenizer):
    spec = ReftSpec(layers=(0, 1), positions="f2+l2", rank=4)
    rows = [tokenize_example({"prompt": f"q{i}: {w}\n", "chosen": w.upper(), "rejected": w[::-1]}, tokenizer)
            for i, w in enumerate(["abc", "hello", "dog", "tree"])]
    batch = collate_reft("preference", rows, pad_id=0, spec=spec)
    model = tiny(tokenizer)
    state = init_reft_state(model, spec, lr=2e-2, zero_init=True, seed=0)
    losses = []
    assert state.model("ref") is model  # the reference is the base model itself: no copy
    for _ in range(8):
        state, metrics = reft_dpo_step(state, batch, loss=functools.partial(dpo, beta=0.5))
        losses.append(float(metrics["loss"]))
    assert abs(losses[0] - math.log(2)) < 1e-5  # zero-init: policy = reference = base model
    assert losses[-1] < losses[0] - 0.05, losses
    ref = concatenated_forward(model, batch, reference=True)  # the base model, interventions off
    with intervened(state, batch):
        pol = concatenated_forward(model, batch)
    assert not torch.allclose(pol["chosen", K.LOGPS], ref["chosen", K.REF_LOGPS])


@pytest.mark.parametrize("engine", ["hf", "loop"])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_generation_with_interventions_matches_rescoring(tokenizer, arch, engine):
    """Both KV-cached paths (``generate`` and the decode loop) against a full forward inside ``intervened``.

    Guards the cache offset on every transformers version (the cache argument was renamed
    ``past_key_values`` → ``cache`` in 5.24: a hook reading it by name edited every decoding step)
    and the decode loop's prefill (it must run with the interventions on).
    """
    model, spec = tiny(tokenizer, arch), ReftSpec(layers=(0, 1), positions="f2+l2", rank=4)
    policy = ReftModel(model, spec, generator=torch.Generator().manual_seed(0))
    state = init_state({"policy": policy, "ref": model})
    prompts = ["spell: abc\n", "hi\n", "a longer prompt\n"]
    generate = functools.partial(generate_rollout, policy, tokenizer, prompts, num_samples=2, max_new_tokens=6, seed=3,
                                 engine=engine)
    rollout = with_intervention_locations(generate(), spec)
    assert rollout[K.INTERVENTION_LOCATIONS].shape == (6, 4)
    assert torch.equal(rollout[K.INTERVENTION_LOCATIONS][::2], rollout[K.INTERVENTION_LOCATIONS][1::2])
    with intervened(state, rollout):
        rescored = score_rollout(rollout, policy=policy)
    mask = rollout[K.RESPONSE_MASK]
    # decoding steps (KV cache) are not intervened, prompt positions are: a full forward agrees to float32 rounding
    # of a different batching (measured ≤ 1e-6; a wrong offset moves tokens by 0.2 nats)
    torch.testing.assert_close(rescored[K.OLD_LOGPROBS][mask], rollout[K.OLD_LOGPROBS][mask], rtol=1e-4, atol=1e-4)
    base = score_rollout(rollout, policy=model)  # interventions off: the base model differs
    assert (base[K.OLD_LOGPROBS][mask] - rollout[K.OLD_LOGPROBS][mask]).abs().max() > 1e-3
    if engine == "hf":  # generate without a KV cache: every step is a full forward over [prompt | response so far]
        no_cache = generate(use_cache=False)
        # the same seeded draws; a flip would need two log-probs within float rounding of a sampling boundary
        assert torch.equal(no_cache[K.RESPONSE_IDS], rollout[K.RESPONSE_IDS])
        torch.testing.assert_close(no_cache[K.OLD_LOGPROBS], rollout[K.OLD_LOGPROBS], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_decoding_steps_are_not_edited(tokenizer, arch, monkeypatch):
    """Only the prefill forward edits anything: every decoding step starts past the prompt."""
    policy = ReftModel(tiny(tokenizer, arch), ReftSpec(layers=(0,), positions="f1+l1", rank=2),
                       generator=torch.Generator().manual_seed(0))
    calls = []

    def spy(hidden, locations, edits, *, offset=0):
        out = intervene(hidden, locations, edits, offset=offset)
        calls.append((hidden.shape[1], bool((out != hidden).any())))
        return out
    monkeypatch.setattr(reft_model, "intervene", spy)
    for engine in ("hf", "loop"):
        calls.clear()
        generate_rollout(policy, tokenizer, ["abc\n", "hello\n"], num_samples=2, max_new_tokens=4, seed=0,
                         engine=engine, **({"min_new_tokens": 4} if engine == "hf" else {}))
        (prefill_width, prefill_edited), *decoding = calls
        assert prefill_width > 1 and prefill_edited, calls
        # generate keeps the hooks on while decoding (they must edit nothing); the decode loop installs them
        # for its prefill only
        assert all(width == 1 and not edited for width, edited in decoding), (engine, calls)
        assert (len(decoding) == 3) if engine == "hf" else not decoding, (engine, calls)


def test_forward_offset_finds_the_cache_under_any_name():
    from transformers import DynamicCache
    from rlcore.loops.reft_model import forward_offset

    def trunk(input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None, **kwargs):
        pass
    signature = inspect.signature(trunk)
    cache = DynamicCache()
    cache.update(torch.zeros(2, 1, 5, 4), torch.zeros(2, 1, 5, 4), layer_idx=0)
    ids, mask = torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 6, dtype=torch.long)
    assert forward_offset(signature, (), {"input_ids": ids, "cache": cache}) == 5
    assert forward_offset(signature, (), {"input_ids": ids, "past_key_values": cache}) == 5  # before 5.24
    assert forward_offset(signature, (ids, None, None, cache), {}) == 5  # positional
    # no cache object: the 2-D attention mask covers past and current columns
    assert forward_offset(signature, (), {"input_ids": ids, "attention_mask": mask}) == 5
    assert forward_offset(signature, (), {"inputs_embeds": torch.zeros(2, 6, 4), "attention_mask": mask}) == 0
    assert forward_offset(signature, (ids,), {}) == 0


def test_the_vllm_engine_refuses_a_reft_policy(tokenizer):
    policy = ReftModel(tiny(tokenizer), ReftSpec(layers=(0,), positions="f1", rank=2))
    with pytest.raises(ValueError, match="vLLM engine cannot run"):
        generate_rollout(policy, tokenizer, ["abc"], max_new_tokens=2, engine="vllm")


@pytest.mark.parametrize("recipe,step", [(grpo, reft_grpo_step), (rloo, reft_rloo_step)])
def test_reft_online_recipes_train_the_interventions_only(recipe, step):
    config = recipe.Config(task="add", steps=2, batch_size=2, num_samples=2, max_new_tokens=4, num_train=8, num_eval=4,
                           lr=5e-2, run_dir=None, seed=0)
    spec = ReftSpec(layers=(0, 1), positions="f2+l2", rank=2)
    seen = []
    def reward_fn(prompts, completions, **columns):  # varies within a group, so advantages are not all 0
        return [float(len(c)) for c in completions]

    state, history = train_reft_online(config, step, spec, reward_fn=reward_fn, callbacks=[lambda s, m: seen.append(
        {k: v.detach().clone() for k, v in s.model("policy").state_dict().items()})])
    policy = state.model("policy")
    assert isinstance(policy, ReftModel) and state.model("ref") is policy.model
    assert state.optimizer_steps == 2 and all(math.isfinite(h["loss"]) for h in history)
    before, after = seen
    changed = {k for k in after if not torch.equal(before[k], after[k])}
    assert changed and all(k.startswith("interventions.") for k in changed), changed
    trainable, total = trainable_fraction(state)
    assert trainable == sum(p.numel() for p in policy.trainable_parameters()) and trainable < total


@pytest.mark.parametrize("module", [reft_data, reft_model])
def test_doctests(module):
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


def test_config():
    cfg = load_config(CONFIG)
    assert reft_spec(cfg) == ReftSpec(layers=(1, 2), positions="f3+l3", rank=4) and cfg.steps == 60
    assert reft_spec(ReftConfig()) == reft_spec(cfg)
    assert load_config(CONFIG, layers="0,3", rank="2").layers == (0, 3)
    with pytest.raises(ValueError, match=r"unknown keys \['nope'\]"):
        load_config(CONFIG, nope=1)


def test_a_format_1_direft_loads_as_nodireft_and_a_bad_dtype_is_refused(tokenizer, tmp_path):
    """Format 1's DiReFT trained R freely: it is NodiReFT now that DiReFT keeps R orthonormal (pyreft)."""
    model, spec = tiny(tokenizer), ReftSpec(layers=(0,), positions="f2+l2", rank=3, variant="nodireft")
    iv = make_interventions(spec, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    save_interventions(tmp_path / "old", spec, iv)
    meta = json.loads((tmp_path / "old" / "reft_config.json").read_text())
    (tmp_path / "old" / "reft_config.json").write_text(json.dumps(
        {**meta, "format": 1, "spec": {**meta["spec"], "variant": "direft"}}))
    spec2, iv2 = load_interventions(tmp_path / "old")
    assert spec2.variant == "nodireft"
    assert all(torch.equal(a, b) for a, b in zip(iv.state_dict().values(), iv2.state_dict().values()))
    (tmp_path / "old" / "reft_config.json").write_text(json.dumps({**meta, "dtype": "load"}))
    with pytest.raises(ValueError, match=r"dtype: expected a floating-point torch dtype name .* got 'load'"):
        load_interventions(tmp_path / "old")


def test_reft_dpo_from_a_config_trains_the_interventions_on_a_frozen_base():
    from rlcore.loops.recipe import build_policy
    from rlcore.loops.recipes.reft_recipes import ReftDpoConfig, train_reft_dpo
    config = ReftDpoConfig(hidden_size=32, num_layers=2, num_train=32, num_eval=8, batch_size=8, max_length=32,
                           steps=4, lr=2e-2, beta=0.5, run_dir=None, eval_every=4)
    base = build_policy(config)[0]
    state, history = train_reft_dpo(config)
    assert abs(history[0]["loss"] - math.log(2)) < 1e-5  # zero_init: the policy starts as its reference
    assert history[-1]["loss"] < history[0]["loss"] and "eval/rewards/accuracies" in history[-1]
    assert all(torch.equal(a, b) for a, b in zip(state.model("policy").parameters(), base.parameters()))
    assert state.model("ref") is state.model("policy")
    with pytest.raises(ValueError, match=r"loss_type: 'kto' trains on unpaired rows"):
        train_reft_dpo(dataclasses.replace(config, loss_type="kto"))
    with pytest.raises(ValueError, match=r"sync_ref_model: the ReFT reference is the frozen base model"):
        train_reft_dpo(dataclasses.replace(config, sync_ref_model=True))


def test_reft_reward_trains_interventions_and_the_score_head_only(tmp_path):
    """pyreft's reward example: a frozen classifier, interventions at prompt positions, the head trained."""
    from rlcore.loops.recipe import build_policy
    from rlcore.loops.recipes import RECIPES
    from rlcore.loops.recipes.reft_recipes import ReftRewardConfig, train_reft_reward
    config = ReftRewardConfig(hidden_size=32, num_layers=2, num_train=64, num_eval=16, batch_size=16, max_length=32,
                              steps=12, lr=3e-2, run_dir=None, eval_every=12, positions="f1+l1", zero_init=False)
    base = build_policy(config, task=RECIPES["reft_reward"].model_task)[0]
    state, history = train_reft_reward(config)
    assert history[-1]["loss"] < history[0]["loss"] and "eval/accuracy" in history[-1]
    changed = {n for (n, a), b in zip(state.model("policy").named_parameters(), base.parameters())
               if not torch.equal(a, b)}
    assert changed and all(n.startswith("score.") for n in changed), changed
    rows = [{"input_ids_chosen": [5, 6, 7], "input_ids_rejected": [5, 6, 8]}] * 20
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match=r"dataset: the interventions edit prompt positions, and these pairs have "
                                         r"no prompt"):
        train_reft_reward(dataclasses.replace(config, task=None, dataset=str(path), num_eval=4))
