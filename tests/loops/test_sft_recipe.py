"""Tests of the SFT recipe (loops/recipes/sft.py) on tiny offline models."""

import copy
import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

from rlcore import keys as K
from rlcore.loops.data import load_local
from rlcore.loops.collate import collate_sequences, pack_sequences
from rlcore.loops.tokenization import tokenize_dataset
from rlcore.loops.fold import stop_when
from rlcore.loops.logging import read_jsonl
from rlcore.loops.models import build_tokenizer, pad_token_id
from rlcore.loops.recipe import build_policy, init_train_state
from rlcore.loops.config import load_config
from rlcore.loops.recipes.sft import Config, evaluate, scoring_mask, sft_loss_fn, sft_step, train
from rlcore.loops.tasks import task_dataset
from rlcore.testing import assert_padding_invariant, assert_pure

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
TINY = dict(hidden_size=32, num_layers=1, num_heads=4, num_train=64, num_eval=16, batch_size=16, max_length=24,
            lr=1e-2, max_new_tokens=4, run_dir=None, log_every=100)


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def _rows(n=6):
    tok = build_tokenizer()
    return tokenize_dataset(task_dataset("add", n), tok), tok


@pytest.mark.slow
def test_sft_loss_goes_down_and_held_out_loss_improves():
    config = Config(steps=12, eval_every=12, **TINY)
    model, _ = build_policy(config)
    before = evaluate(init_train_state({"policy": model}, config), config)
    state, hist = train(config)
    first, last = sum(h["loss"] for h in hist[:3]) / 3, sum(h["loss"] for h in hist[-3:]) / 3
    assert last < 0.6 * first, (first, last)
    assert state.step == 12 and state.optimizer_steps == 12 and state.samples_seen == 12 * 16
    after = hist[-1]
    assert after["eval/loss"] < 0.6 * before["loss"]
    assert 0.0 <= after["eval/exact_match"] <= 1.0 and before["exact_match"] == 0.0
    assert evaluate(state, config) == pytest.approx({k[5:]: v for k, v in after.items() if k.startswith("eval/")})


def test_scoring_mask_golden():
    mask = torch.tensor([[True, True, True, False], [False, True, True, True]])
    batch = TensorDict({K.ATTENTION_MASK: mask, K.LOSS_MASK: torch.tensor([[True, True, True, True],
                                                                          [True, True, False, True]])}, [2])
    out = assert_pure(scoring_mask, batch)
    # the first real token of a row has no predecessor; padding never counts
    assert out[K.LOSS_MASK].tolist() == [[False, True, True, False], [False, False, False, True]]
    assert batch[K.LOSS_MASK][0, 0]  # the input is untouched
    packed = batch.copy().update({K.POSITION_IDS: torch.tensor([[0, 1, 0, 0], [0, 0, 1, 2]])})
    assert scoring_mask(packed)[K.LOSS_MASK].tolist() == [[False, True, False, False], [False, False, False, True]]


def test_packed_loss_equals_padded_loss():
    rows, tok = _rows(6)
    model, _ = build_policy(Config(**TINY))
    state = init_train_state({"policy": model}, Config(**TINY))
    cols = rows[:]
    padded = scoring_mask(collate_sequences(cols, pad_id=pad_token_id(tok)))
    packed = scoring_mask(pack_sequences(cols, 24, pad_id=pad_token_id(tok)))
    assert packed.batch_size[0] < padded.batch_size[0]
    assert packed[K.LOSS_MASK].sum() == padded[K.LOSS_MASK].sum()
    for chunked in (True, False):
        a, ma = sft_loss_fn(state, padded, chunked=chunked)
        b, mb = sft_loss_fn(state, packed, chunked=chunked)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        assert ma["num_tokens"] == mb["num_tokens"]


def test_loss_fn_ignores_extra_right_padding():
    rows, tok = _rows(4)
    model, _ = build_policy(Config(**TINY))
    state = init_train_state({"policy": model}, Config(**TINY))
    batch = collate_sequences(rows[:], pad_id=pad_token_id(tok))
    for chunked in (True, False):
        assert_padding_invariant(lambda b: sft_loss_fn(state, scoring_mask(b), chunked=chunked)[0].detach(), batch,
                                 mask_key=K.ATTENTION_MASK, rtol=1e-5, atol=1e-5)


def test_loss_fn_matches_a_plain_reference():
    rows, tok = _rows(3)
    model, _ = build_policy(Config(**TINY))
    state = init_train_state({"policy": model}, Config(**TINY))
    batch = scoring_mask(collate_sequences(rows[:], pad_id=pad_token_id(tok)))
    loss, _ = sft_loss_fn(state, batch)
    with torch.no_grad():
        logits = model(input_ids=batch[K.INPUT_IDS], attention_mask=batch[K.ATTENTION_MASK].long()).logits
    total, count = 0.0, 0
    for b in range(batch.batch_size[0]):
        for t in range(1, batch[K.INPUT_IDS].shape[1]):
            if batch[K.LOSS_MASK][b, t]:
                total -= torch.log_softmax(logits[b, t - 1].double(), -1)[batch[K.INPUT_IDS][b, t]].item()
                count += 1
    assert loss.item() == pytest.approx(total / count, rel=1e-5)


def test_micro_batches_give_the_full_batch_step():
    rows, tok = _rows(8)
    batch = collate_sequences(rows[:], pad_id=pad_token_id(tok))
    config = Config(**TINY)
    model, _ = build_policy(config)
    results = []
    for micro in (None, 3):
        m = copy.deepcopy(model)
        # SGD: the step is linear in the gradient, so the micro-batches' float32 summation order (which differs
        # by CPU and kernel) moves weights by lr x rounding; Adam's g/sqrt(v) can flip the sign of a near-0 gradient
        state = dataclasses.replace(init_train_state({"policy": m}, config), scheduler=None,
                                    optimizer=torch.optim.SGD(m.parameters(), lr=0.1))
        state, metrics = sft_step(state, batch, micro_batch_size=micro)
        results.append((_params(m), metrics["loss"]))
    torch.testing.assert_close(results[0][1], results[1][1], rtol=1e-5, atol=1e-6)
    for a, b in zip(results[0][0], results[1][0]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert state.tokens_seen == int(batch[K.ATTENTION_MASK].sum()) and state.samples_seen == 8


def test_packing_recipe_trains():
    config = Config(steps=6, packing=True, **TINY)
    state, hist = train(config)
    assert hist[-1]["loss"] < hist[0]["loss"] and state.samples_seen == 6 * 16
    with pytest.raises(ValueError, match="packing needs"):
        train(dataclasses.replace(config, max_length=None))


@pytest.mark.slow
def test_resume_is_bitwise_exact(tmp_path):
    base = Config(steps=6, save_every=3, schedule="linear", warmup_steps=1, micro_batch_size=8,
                  **{**TINY, "num_train": 32})
    straight, hist = train(dataclasses.replace(base, run_dir=str(tmp_path / "a")))
    cut = dataclasses.replace(base, run_dir=str(tmp_path / "b"))
    first, _ = train(cut, callbacks=[stop_when(lambda s, m: s.step == 3)])  # killed after step 3
    assert first.step == 3
    resumed, hist2 = train(dataclasses.replace(cut, resume=True))
    assert resumed.step == 6 and len(hist2) == 3
    for a, b in zip(straight.model().parameters(), resumed.model().parameters()):
        assert torch.equal(a, b)
    assert [h["loss"] for h in hist2] == [h["loss"] for h in hist[3:]]
    assert [r["step"] for r in read_jsonl(tmp_path / "b" / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]


def test_local_dataset_and_exact_match(tmp_path):
    # a completion the model can learn in a few steps: always "7", so greedy decoding gets it exactly
    rows = [{"prompt": f"{a}+{b}=", "completion": "7"} for a in range(6) for b in range(4)]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = Config(steps=12, task=None, dataset=str(path), **{**TINY, "num_eval": 8, "batch_size": 8})
    model, _ = build_policy(config)
    assert evaluate(init_train_state({"policy": model}, config), config)["exact_match"] == 0.0
    state, hist = train(config)
    result = evaluate(state, config)
    assert set(result) == {"loss", "perplexity", "exact_match"} and result["exact_match"] == 1.0


def test_yaml_config_loads_and_runs(tmp_path):
    config = load_config(Config, CONFIGS / "sft.yaml", {"steps": "2", "run_dir": str(tmp_path), "eval_every": "2",
                                                        "num_train": 32, "num_eval": 8})
    assert config.model == "tiny-llama" and config.lr == 3e-3
    state, hist = train(config)
    assert state.step == 2 and "eval/exact_match" in hist[-1]
    assert (tmp_path / "checkpoint-2").is_dir() and len(read_jsonl(tmp_path / "metrics.jsonl")) == 2


def test_completion_only_loss_and_dataset_text_field_as_trl():
    from rlcore.loops.recipes import sft
    from rlcore.loops.data import load_local
    from rlcore.loops.models import build_tokenizer
    tok = build_tokenizer()
    data = load_local([{"prompt": "1+1=", "completion": "2"}, {"prompt": "10+1=", "completion": "11"}])
    rows = sft._prepare(data, tok, sft.Config())
    only = sft._collate_fn(rows, tok, sft.Config())(rows[:])
    whole = sft._collate_fn(rows, tok, sft.Config(completion_only_loss=False))(rows[:])
    assert only[K.LOSS_MASK].sum() < whole[K.LOSS_MASK].sum()
    assert torch.equal(whole[K.LOSS_MASK], whole[K.ATTENTION_MASK]) and torch.equal(only[K.INPUT_IDS], whole[K.INPUT_IDS])
    packed = sft._collate_fn(rows, tok, sft.Config(completion_only_loss=False, packing=True, max_length=32))(rows[:])
    assert torch.equal(packed[K.LOSS_MASK], packed[K.ATTENTION_MASK])
    texts = load_local([{"content": "hello world", "id": 1}])
    prepared = sft._prepare(texts, tok, sft.Config(dataset_text_field="content"))
    assert prepared[0]["completion_ids"][:5] == tok("hello", add_special_tokens=False)["input_ids"]
    with pytest.raises(ValueError, match=r"dataset_text_field: no column 'body' in the dataset \(columns \['content', 'id'\]\)"):
        sft._prepare(texts, tok, sft.Config(dataset_text_field="body"))


def test_assistant_only_loss_trains_on_every_assistant_turn(tmp_path):
    """TRL's assistant_only_loss: a multi-turn conversation is one example whose targets are every reply."""
    from rlcore.loops.recipes import sft
    chats = [{"messages": [{"role": "user", "content": f"{a}+1="}, {"role": "assistant", "content": str(a + 1)},
                           {"role": "user", "content": "again"}, {"role": "assistant", "content": str(a + 1)}]}
             for a in range(12)]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in chats))
    config = Config(steps=6, task=None, dataset=str(path), assistant_only_loss=True,
                    **{**TINY, "num_eval": 4, "batch_size": 4, "max_length": 64})
    tok = build_tokenizer()
    rows = sft._prepare(load_local(str(path)), tok, config)
    batch = scoring_mask(sft._collate_fn(rows, tok, config)(rows[:2]))
    targets = [tok.decode(ids[m]) for ids, m in zip(batch[K.INPUT_IDS], batch[K.LOSS_MASK])]
    assert targets == ["1</s>1</s>", "2</s>2</s>"]  # both replies of each conversation, nothing else
    last_only = scoring_mask(sft._collate_fn(rows, tok, config)(
        sft._prepare(load_local(str(path)), tok, dataclasses.replace(config, assistant_only_loss=False))[:2]))
    assert [tok.decode(ids[m]) for ids, m in zip(last_only[K.INPUT_IDS], last_only[K.LOSS_MASK])] == ["1</s>", "2</s>"]
    state, history = train(config)
    assert history[-1]["loss"] < history[0]["loss"]
    with pytest.raises(ValueError, match=r"assistant_only_loss: scores the assistant turns only, while "
                                         r"completion_only_loss=False"):
        train(dataclasses.replace(config, completion_only_loss=False))


def test_formatting_func_from_python_as_trl(tmp_path):
    """TRL's SFTTrainer(formatting_func=...): each row becomes the text (or the row) to train on."""
    rows = [{"question": f"{a}+1=", "reply": str(a + 1)} for a in range(12)]
    path = tmp_path / "qa.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = Config(steps=2, task=None, dataset=str(path), **{**TINY, "num_eval": 4, "batch_size": 4})
    seen = []

    def as_pair(row):
        seen.append(dict(row))
        return {"prompt": row["question"], "completion": row["reply"]}

    state, history = train(config, formatting_func=as_pair)
    assert len(seen) == 12 and all(math.isfinite(h["loss"]) for h in history)
    tok = build_tokenizer()
    from rlcore.loops.recipes import sft
    prepared = sft._prepare(load_local(str(path)), tok, config, as_pair)
    batch = scoring_mask(sft._collate_fn(prepared, tok, config)(prepared[:1]))
    assert tok.decode(batch[K.INPUT_IDS][0][batch[K.LOSS_MASK][0]]) == rows[0]["reply"] + "</s>"
    whole = sft._prepare(load_local(str(path)), tok, config, lambda row: row["question"] + row["reply"])
    assert tok.decode(whole[0]["completion_ids"]) == "0+1=1</s>"  # a string: language modelling on all of it
    with pytest.raises(ValueError, match=r"format"):
        train(config)  # no formatting_func: the columns fit no format


def test_rows_past_the_model_context_are_refused_before_the_first_step():
    """GPT-2's position table ends at its context: a row past it would raise IndexError mid-forward."""
    config = Config(**{**TINY, "max_length": 400}, model="tiny-gpt2", max_position_embeddings=8, steps=1)
    with pytest.raises(ValueError, match=r"dataset: the train split, row \d+: prompt_ids \+ completion_ids of \d+ "
                                         r"tokens exceeds the model's context of 8 \(max_position_embeddings\); "
                                         r"set max_length <= 8"):
        train(config)
    with pytest.raises(ValueError, match=r"max_length: packed rows of 24 tokens exceeds the model's context of 16"):
        train(Config(**TINY, model="tiny-gpt2", max_position_embeddings=16, packing=True, steps=1))
