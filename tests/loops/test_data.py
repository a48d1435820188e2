"""Tests of loops/data.py: formats, local loading, tokenisation, truncation, collation, packing."""

import json

import datasets
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore import keys as K
from rlcore.loops.data import FORMATS, detect_format, load_local, load_source
from rlcore.loops.collate import (COLLATORS, collate, collate_mismatched, collate_preference, collate_prompts,
                                  collate_sequences, iterate_batches, pack_sequences, pad_sequences)
from rlcore.loops.tokenization import TRUNCATIONS, split_implicit_prompt, tokenize_dataset, tokenize_example
from rlcore.loops.models import build_model, build_tokenizer
from rlcore.loops.score import token_logprobs_from_model

datasets.disable_progress_bars()

ROWS = {
    "preference": {"prompt": "1+1=", "chosen": "2", "rejected": "11"},
    "implicit_preference": {"chosen": "1+1=2", "rejected": "1+1=11"},
    "unpaired": {"prompt": "1+1=", "completion": "2", "label": True},
    "prompt_completion": {"prompt": "1+1=", "completion": "2"},
    "conversational": {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
    "language_modeling": {"text": "abc"},
    "prompt_only": {"prompt": "1+1="},
}


def ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# --- formats and loading ---------------------------------------------------------------------
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_detect_format(fmt):
    assert detect_format(list(ROWS[fmt]) + ["extra"]) == fmt


def test_detect_format_error_lists_formats():
    with pytest.raises(ValueError, match=r"columns \['question'\] match no known format.*preference: prompt, "
                                         r"chosen, rejected.*prompt_only: prompt.*formatting_func"):
        detect_format(["question"])


def test_explicit_format_with_missing_columns(tokenizer):
    with pytest.raises(ValueError, match=r"row: format 'preference' needs columns \['prompt', 'chosen', 'rejected'\], "
                                         r"missing \['rejected'\].*formats: \[preference"):
        tokenize_example({"prompt": "a", "chosen": "b"}, tokenizer, format="preference")
    with pytest.raises(ValueError, match="format: unknown format 'dpo'"):
        tokenize_example({"prompt": "a"}, tokenizer, format="dpo")


def test_load_local_files_and_memory(tmp_path):
    rows = [{"prompt": "a", "completion": "b"}, {"prompt": "c", "completion": "d"}]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (tmp_path / "d.json").write_text(json.dumps(rows))
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "d.parquet"))
    (tmp_path / "d.csv").write_text("prompt,completion\na,b\nc,d\n")
    for name in ("d.jsonl", "d.json", "d.parquet", "d.csv"):
        assert load_local(tmp_path / name).to_list() == rows, name
    assert load_local(rows).to_list() == rows
    assert load_local({"prompt": ["a", "c"], "completion": ["b", "d"]}).to_list() == rows
    ds = load_local(rows)
    assert load_local(ds) is ds
    with pytest.raises(ValueError, match=r"unsupported file type '.txt'.*'.jsonl'"):
        load_local(tmp_path / "d.txt")
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_local(tmp_path / "missing.jsonl")


# --- tokenisation ----------------------------------------------------------------------------
def test_tokenize_each_format(tokenizer):
    eos = tokenizer.eos_token_id
    assert tokenize_example(ROWS["prompt_only"], tokenizer) == {"prompt_ids": ids(tokenizer, "1+1=")}
    pc = tokenize_example(ROWS["prompt_completion"], tokenizer)
    assert pc == {"prompt_ids": ids(tokenizer, "1+1="), "completion_ids": ids(tokenizer, "2") + [eos]}
    assert tokenize_example(ROWS["unpaired"], tokenizer) == pc  # the label stays a column
    pref = tokenize_example(ROWS["preference"], tokenizer)
    assert pref == {"prompt_ids": ids(tokenizer, "1+1="), "chosen_ids": ids(tokenizer, "2") + [eos],
                    "rejected_ids": ids(tokenizer, "11") + [eos]}
    lm = tokenize_example(ROWS["language_modeling"], tokenizer)
    assert lm == {"prompt_ids": [], "completion_ids": ids(tokenizer, "abc") + [eos]}
    conv = tokenize_example(ROWS["conversational"], tokenizer)
    assert tokenizer.decode(conv["prompt_ids"]) == "<s><|user|>hi</s><|assistant|>"
    assert tokenizer.decode(conv["completion_ids"]) == "yo</s>"  # the template's EOS, not a second one
    assert conv["completion_ids"].count(eos) == 1


def test_conversational_prompt_completion_and_prompt_only(tokenizer):
    user = [{"role": "user", "content": "hi"}]
    out = tokenize_example({"prompt": user, "completion": [{"role": "assistant", "content": "yo"}]}, tokenizer)
    assert out == tokenize_example(ROWS["conversational"], tokenizer)
    prompt_only = tokenize_example({"prompt": user}, tokenizer)
    assert tokenizer.decode(prompt_only["prompt_ids"]) == "<s><|user|>hi</s><|assistant|>"
    with pytest.raises(ValueError, match="completion is a conversation but prompt is plain text"):
        tokenize_example({"prompt": "hi", "completion": [{"role": "assistant", "content": "yo"}]}, tokenizer)
    with pytest.raises(ValueError, match="must end with an assistant message"):
        tokenize_example({"messages": user}, tokenizer)


def test_formatting_func(tokenizer):
    def as_text(row):
        return f"Q: {row['q']} A: {row['a']}"

    def as_pair(row):
        return {"prompt": row["q"], "completion": row["a"]}

    row = {"q": "1+1", "a": "2"}
    text = tokenize_example(row, tokenizer, formatting_func=as_text)
    assert text["completion_ids"][:-1] == ids(tokenizer, "Q: 1+1 A: 2")
    assert tokenize_example(row, tokenizer, formatting_func=as_pair) == {
        "prompt_ids": ids(tokenizer, "1+1"), "completion_ids": ids(tokenizer, "2") + [tokenizer.eos_token_id]}


def test_add_eos_false(tokenizer):
    out = tokenize_example(ROWS["prompt_completion"], tokenizer, add_eos=False)
    assert out["completion_ids"] == ids(tokenizer, "2")


def test_truncation_golden(tokenizer):
    row = {"prompt": "abcdef", "completion": "xyz"}  # 6 + 3 + EOS = 10 tokens
    eos = tokenizer.eos_token_id
    start = tokenize_example(row, tokenizer, max_length=8, truncation="keep_start")
    assert start == {"prompt_ids": ids(tokenizer, "abcdef"), "completion_ids": ids(tokenizer, "xy")}
    end = tokenize_example(row, tokenizer, max_length=8, truncation="keep_end")
    assert end == {"prompt_ids": ids(tokenizer, "cdef"), "completion_ids": ids(tokenizer, "xyz") + [eos]}
    short = tokenize_example(row, tokenizer, max_prompt_length=2)
    assert short["prompt_ids"] == ids(tokenizer, "ef")  # keep_end by default: the end of the prompt
    assert tokenize_example(row, tokenizer, max_prompt_length=2, prompt_truncation="keep_start")["prompt_ids"] == \
        ids(tokenizer, "ab")
    with pytest.raises(ValueError, match="row: prompt: 6 tokens exceed the limit of 2"):
        tokenize_example(row, tokenizer, max_prompt_length=2, prompt_truncation="error")
    with pytest.raises(ValueError, match=r"prompt \+ completion: 10 tokens exceed the limit of 8"):
        tokenize_example(row, tokenizer, max_length=8, truncation="error")
    with pytest.raises(ValueError, match=r"truncation: unknown 'middle'; valid: \['error', 'keep_end', "):
        tokenize_example(row, tokenizer, max_length=8, truncation="middle")


def test_preference_truncation_shares_one_prompt(tokenizer):
    row = {"prompt": "abcdef", "chosen": "x", "rejected": "xyz"}
    out = tokenize_example(row, tokenizer, max_length=7, truncation="keep_end")
    assert len(out["prompt_ids"]) + len(out["rejected_ids"]) <= 7
    assert len(out["prompt_ids"]) + len(out["chosen_ids"]) <= 7
    assert out["prompt_ids"] == ids(tokenizer, "def")  # cut for the longer side, shared by both


def test_prompt_longer_than_the_limit_and_empty_completion(tokenizer):
    with pytest.raises(ValueError, match=r"row: prompt of 6 tokens leaves no room for the completion under "
                                         r"max_length=6"):
        tokenize_example({"prompt": "abcdef", "completion": "x"}, tokenizer, max_length=6)
    with pytest.raises(ValueError, match="row: empty rejected"):
        tokenize_example({"prompt": "a", "chosen": "b", "rejected": ""}, tokenizer)


def test_tokenize_dataset_keeps_columns_and_names_rows(tokenizer):
    ds = load_local([{"prompt": "q1", "completion": "a", "answer": "4"},
                     {"prompt": "q2", "completion": "", "answer": "5"}])
    with pytest.raises(ValueError, match="row 1: empty completion"):
        tokenize_dataset(ds, tokenizer)
    ok = tokenize_dataset(ds.select([0]), tokenizer)
    assert set(ok.column_names) == {"prompt", "completion", "answer", "prompt_ids", "completion_ids"}
    with pytest.raises(ValueError, match="match no known format"):
        tokenize_dataset(load_local([{"question": "q"}]), tokenizer)


@settings(max_examples=40, deadline=None)
@given(p=st.integers(0, 8), c=st.integers(0, 8), limit=st.integers(1, 12),
       mode=st.sampled_from(["keep_start", "keep_end"]))
def test_truncation_properties(p, c, limit, mode):
    prompt, completion = list(range(p)), list(range(100, 100 + c))
    new_p, new_c = TRUNCATIONS[mode](prompt, completion, limit, "row")
    assert len(new_p) + len(new_c) == min(p + c, limit)
    whole, kept = prompt + completion, new_p + new_c
    assert kept == (whole[:limit] if mode == "keep_start" else whole[len(whole) - len(kept):])
    assert new_p == [x for x in kept if x < 100] and new_c == [x for x in kept if x >= 100]


# --- collation -------------------------------------------------------------------------------
def test_pad_sequences_golden():
    ids_, mask = pad_sequences([[5], [6, 7], []], pad_value=9)
    assert ids_.tolist() == [[5, 9], [6, 7], [9, 9]] and mask.tolist() == [[True, False], [True, True], [False, False]]
    ids_, mask = pad_sequences([[5], [6, 7]], side="left")
    assert ids_.tolist() == [[0, 5], [6, 7]] and mask.dtype == torch.bool
    with pytest.raises(ValueError, match="side: expected 'right' or 'left', got 'up'"):
        pad_sequences([[1]], side="up")


@settings(max_examples=30, deadline=None)
@given(st.lists(st.lists(st.integers(1, 50), max_size=6), min_size=1, max_size=5), st.sampled_from(["left", "right"]))
def test_pad_sequences_round_trip(seqs, side):
    ids_, mask = pad_sequences(seqs, side=side)
    assert ids_.shape == (len(seqs), max(map(len, seqs)))
    assert [row[m].tolist() for row, m in zip(ids_, mask)] == seqs


def test_collate_sequences_golden():
    rows = [{"prompt_ids": [1, 2], "completion_ids": [3]}, {"prompt_ids": [4], "completion_ids": [5, 6, 7]}]
    batch = collate_sequences(rows, pad_id=0)
    assert batch.batch_size == torch.Size([2])
    assert batch[K.INPUT_IDS].tolist() == [[1, 2, 3, 0], [4, 5, 6, 7]]
    assert batch[K.ATTENTION_MASK].tolist() == [[True, True, True, False], [True, True, True, True]]
    assert batch[K.LOSS_MASK].tolist() == [[False, False, True, False], [False, True, True, True]]
    columns = {"prompt_ids": [[1, 2], [4]], "completion_ids": [[3], [5, 6, 7]]}
    assert (collate_sequences(columns, pad_id=0) == batch).all()


def test_collate_prompts_left_padded_to_batch_longest():
    batch = collate_prompts([{"prompt_ids": [1]}, {"prompt_ids": [2, 3, 4]}], pad_id=9)
    assert batch[K.PROMPT_IDS].tolist() == [[9, 9, 1], [2, 3, 4]]
    assert batch[K.PROMPT_MASK].tolist() == [[False, False, True], [True, True, True]]


def test_collate_preference_and_reference_columns():
    rows = [{"prompt_ids": [1], "chosen_ids": [2, 3], "rejected_ids": [4], "ref_chosen_logps": -1.0,
             "ref_rejected_logps": -2.0}]
    batch = collate_preference(rows, pad_id=0)
    assert batch[K.CHOSEN, K.INPUT_IDS].tolist() == [[1, 2, 3]] and batch[K.REJECTED, K.INPUT_IDS].tolist() == [[1, 4]]
    assert batch[K.CHOSEN, K.LOSS_MASK].tolist() == [[False, True, True]]
    assert batch[K.CHOSEN, K.REF_LOGPS].tolist() == [-1.0] and batch[K.REJECTED, K.REF_LOGPS].tolist() == [-2.0]
    plain = collate_preference([{k: v for k, v in rows[0].items() if not k.startswith("ref")}], pad_id=0)
    assert K.REF_LOGPS not in plain[K.CHOSEN].keys()


def test_collate_unpaired_labels_and_errors():
    rows = [{"prompt_ids": [1], "completion_ids": [2], "label": True},
            {"prompt_ids": [1], "completion_ids": [3], "label": False}]
    batch = collate("unpaired", rows, pad_id=0)
    assert batch[K.LABELS].tolist() == [True, False] and batch[K.LABELS].dtype == torch.bool
    with pytest.raises(KeyError, match=r"collate_unpaired: rows are missing \['label'\]"):
        collate("unpaired", [{"prompt_ids": [1], "completion_ids": [2]}], pad_id=0)
    with pytest.raises(ValueError, match=r"format: unknown 'kto'; valid: \['conversational', "):
        collate("kto", rows, pad_id=0)
    assert set(COLLATORS) == set(FORMATS)


def test_collate_mismatched_golden():
    rows = {"prompt_ids": [[1], [2, 2], [3]], "completion_ids": [[7], [8], [9, 9]]}
    batch = collate_mismatched(rows, pad_id=0)
    assert batch[K.INPUT_IDS].tolist() == [[1, 9, 9], [2, 2, 7], [3, 8, 0]]
    assert batch[K.LOSS_MASK].tolist() == [[False, True, True], [False, False, True], [False, True, False]]
    single = collate_mismatched({"prompt_ids": [[1]], "completion_ids": [[7]]}, pad_id=0)
    assert single[K.INPUT_IDS].tolist() == [[1, 7]]


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_end_to_end_each_format(fmt, tokenizer):
    ds = tokenize_dataset(load_local([ROWS[fmt]] * 3), tokenizer)
    (batch,) = list(iterate_batches(ds, tokenizer, 4, format=fmt))
    assert batch.batch_size == torch.Size([3])
    keys = {k if isinstance(k, str) else k[-1] for k in batch.keys(True, True)}
    expected = {"prompt_only": {K.PROMPT_IDS, K.PROMPT_MASK}, "unpaired": {K.INPUT_IDS, K.ATTENTION_MASK,
                K.LOSS_MASK, K.LABELS}}.get(fmt, {K.INPUT_IDS, K.ATTENTION_MASK, K.LOSS_MASK})
    assert keys == expected


def test_iterate_batches_shuffle_and_drop_last(tokenizer):
    ds = tokenize_dataset(load_local({"prompt": [str(i) for i in range(7)]}), tokenizer)
    sizes = [b.batch_size[0] for b in iterate_batches(ds, tokenizer, 3, format="prompt_only")]
    assert sizes == [3, 3, 1]
    assert [b.batch_size[0] for b in iterate_batches(ds, tokenizer, 3, format="prompt_only", drop_last=True)] == [3, 3]

    def order(seed):
        return [tokenizer.decode(row[m]) for b in iterate_batches(ds, tokenizer, 3, format="prompt_only", shuffle=True,
                                                                   seed=seed)
                for row, m in zip(b[K.PROMPT_IDS], b[K.PROMPT_MASK])]

    assert order(1) == order(1) and sorted(order(1)) == [str(i) for i in range(7)] and order(1) != order(2)


def test_iterate_batches_without_pad_token_warns():
    tok = build_tokenizer()
    tok.pad_token = None
    ds = tokenize_dataset(load_local({"prompt": ["a", "bb"]}), tok)
    with pytest.warns(UserWarning, match="no pad token"):
        (batch,) = list(iterate_batches(ds, tok, 2, format="prompt_only"))
    assert batch[K.PROMPT_IDS][0, 0].item() == tok.eos_token_id


# --- packing ---------------------------------------------------------------------------------
def test_pack_sequences_golden():
    rows = {"prompt_ids": [[1], [2, 2], [3, 3, 3]], "completion_ids": [[9], [8, 8], [7, 7, 7, 7]]}
    packed = pack_sequences(rows, 10, pad_id=0)
    # first-fit decreasing: 7 tokens, then 4 (does not fit in 3 left), then 2 (fits the first row)
    assert packed[K.INPUT_IDS].tolist() == [[1, 9, 3, 3, 3, 7, 7, 7, 7, 0], [2, 2, 8, 8, 0, 0, 0, 0, 0, 0]]
    assert packed[K.SEGMENT_IDS].tolist() == [[1, 1, 2, 2, 2, 2, 2, 2, 2, 0], [1, 1, 1, 1, 0, 0, 0, 0, 0, 0]]
    assert packed[K.POSITION_IDS].tolist() == [[0, 1, 0, 1, 2, 3, 4, 5, 6, 0], [0, 1, 2, 3, 0, 0, 0, 0, 0, 0]]
    assert packed[K.LOSS_MASK].tolist()[0] == [False, True, False, False, False, True, True, True, True, False]
    assert packed[K.ATTENTION_MASK].tolist()[1] == [True] * 4 + [False] * 6


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 6)), min_size=1, max_size=10), st.integers(6, 12))
def test_pack_sequences_keeps_every_example(lengths, seq_length):
    rows = {"prompt_ids": [[10 + i] * p for i, (p, c) in enumerate(lengths)],
            "completion_ids": [[50 + i] * c for i, (p, c) in enumerate(lengths)]}
    packed = pack_sequences(rows, seq_length, pad_id=0)
    found = []
    for r in range(packed.batch_size[0]):
        seg = packed[K.SEGMENT_IDS][r]
        assert seg.max() <= seq_length
        for s in range(1, int(seg.max()) + 1):
            cols = seg == s
            toks, pos = packed[K.INPUT_IDS][r][cols].tolist(), packed[K.POSITION_IDS][r][cols].tolist()
            assert pos == list(range(len(toks)))
            found.append(toks)
    expected = [(p + c)[:seq_length] for p, c in zip(rows["prompt_ids"], rows["completion_ids"])]
    assert sorted(found) == sorted(expected)
    assert packed[K.LOSS_MASK].sum() == sum(min(len(c), max(seq_length - len(p), 0))
                                            for p, c in zip(rows["prompt_ids"], rows["completion_ids"]))


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_packed_rows_score_like_separate_examples(arch, tokenizer):
    """A packed row through a model (position_ids restarting, attention_mask=None) gives the
    log-probs of each example scored alone."""
    model = build_model(arch, tokenizer=tokenizer, hidden_size=16, num_layers=2, num_heads=2)
    ds = tokenize_dataset(load_local({"prompt": ["ab", "xyz", "q"], "completion": ["cd", "w", "rst"]}), tokenizer)
    packed = pack_sequences(ds[:], 16, pad_id=0)
    assert packed.batch_size[0] == 1
    with torch.no_grad():
        lp = token_logprobs_from_model(model, packed[K.INPUT_IDS], None, position_ids=packed[K.POSITION_IDS])[0]
        seg = packed[K.SEGMENT_IDS][0]
        for s in range(1, 4):
            cols = (seg == s).nonzero()[:, 0]
            one = torch.ones(1, len(cols), dtype=torch.bool)
            alone = token_logprobs_from_model(model, packed[K.INPUT_IDS][:, cols], one)[0]
            torch.testing.assert_close(lp[cols[1:] - 1], alone, rtol=1e-5, atol=1e-5)


def trl_dpo_truncation(prompt, chosen, rejected, max_length, max_prompt_length, mode):
    """TRL DPOTrainer's rule, written out: cut the prompt only when prompt + the longer answer is too long,
    then, if still too long, both answers to max_length − max_prompt_length."""
    longer = max(len(chosen), len(rejected))
    if len(prompt) + longer > max_length:
        prompt = prompt[:max_prompt_length] if mode == "keep_start" else prompt[-max_prompt_length:]
    if len(prompt) + longer > max_length:
        chosen, rejected = chosen[:max_length - max_prompt_length], rejected[:max_length - max_prompt_length]
    return prompt, chosen, rejected


@settings(max_examples=60, deadline=None)
@given(p=st.integers(1, 12), c=st.integers(1, 10), r=st.integers(1, 10), limit=st.integers(6, 24),
       max_prompt=st.integers(1, 5), mode=st.sampled_from(["keep_end", "keep_start"]))
def test_if_too_long_is_trls_dpo_truncation(p, c, r, limit, max_prompt, mode):
    from rlcore.loops.models import build_tokenizer
    tokenizer = build_tokenizer()
    row = {"prompt": "abcdefghijkl"[:p], "chosen": "xyzxyzxyzx"[:c], "rejected": "uvwuvwuvwu"[:r]}
    full = tokenize_example(row, tokenizer)
    expected = trl_dpo_truncation(full["prompt_ids"], full["chosen_ids"], full["rejected_ids"], limit, max_prompt, mode)
    out = tokenize_example(row, tokenizer, max_length=limit, max_prompt_length=max_prompt, prompt_truncation=mode,
                           prompt_cut="if_too_long")
    assert (out["prompt_ids"], out["chosen_ids"], out["rejected_ids"]) == expected


def test_if_too_long_leaves_a_prompt_that_fits(tokenizer):
    row = {"prompt": "abcdef", "chosen": "x", "rejected": "y"}  # prompt + answer + EOS fit in 9 tokens
    kept = tokenize_example(row, tokenizer, max_length=9, max_prompt_length=2, prompt_cut="if_too_long")
    assert kept["prompt_ids"] == tokenize_example(row, tokenizer)["prompt_ids"]  # fits: not cut
    always = tokenize_example(row, tokenizer, max_length=9, max_prompt_length=2)
    assert len(always["prompt_ids"]) == 2  # the other rule cuts whenever the prompt is longer
    with pytest.raises(ValueError, match=r"prompt_cut: unknown 'never'; valid: \['always', 'if_too_long'\]"):
        tokenize_example(row, tokenizer, prompt_cut="never")


def test_implicit_prompt_is_the_shared_start(tokenizer):
    text = split_implicit_prompt("Q: 1+1? A: 2", "Q: 1+1? A: 11")
    assert text == {"prompt": "Q: 1+1? A:", "chosen": " 2", "rejected": " 11"}
    user = [{"role": "user", "content": "1+1?"}]
    chat = split_implicit_prompt(user + [{"role": "assistant", "content": "2"}],
                                 user + [{"role": "assistant", "content": "3"}])
    assert chat["prompt"] == user and chat["chosen"] == [{"role": "assistant", "content": "2"}]
    with pytest.raises(ValueError, match=r"row: chosen and rejected share no start"):
        split_implicit_prompt("yes", "no")
    with pytest.raises(ValueError, match=r"share all of their start"):
        split_implicit_prompt("ab", "abc")
    assert detect_format(["chosen", "rejected"]) == "implicit_preference"
    assert detect_format(["prompt", "chosen", "rejected"]) == "preference"
    explicit = tokenize_example({"prompt": "Q: 1+1? A:", "chosen": " 2", "rejected": " 11"}, tokenizer)
    assert tokenize_example({"chosen": "Q: 1+1? A: 2", "rejected": "Q: 1+1? A: 11"}, tokenizer) == explicit


def test_load_local_reads_directories(tmp_path):
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(6)]
    saved = load_local(rows)
    saved.save_to_disk(str(tmp_path / "saved"))
    assert load_local(tmp_path / "saved")[:] == saved[:]
    datasets.DatasetDict({"train": saved, "test": saved.select([0])}).save_to_disk(str(tmp_path / "dict"))
    assert len(load_local(tmp_path / "dict")) == 6
    datasets.DatasetDict({"test": saved}).save_to_disk(str(tmp_path / "nodict"))
    with pytest.raises(ValueError, match=r"holds splits \['test'\] and no 'train'"):
        load_local(tmp_path / "nodict")
    (tmp_path / "files" / "data").mkdir(parents=True)  # a hub dataset's folder: shards of one type
    for k in range(2):
        saved.select(range(3 * k, 3 * k + 3)).to_json(str(tmp_path / "files" / "data" / f"part-{k}.jsonl"))
    assert load_local(tmp_path / "files")["prompt"] == saved["prompt"]
    (tmp_path / "files" / "data" / "extra.csv").write_text("prompt\nx\n")
    with pytest.raises(ValueError, match=r"holds mixed data files \(\['.csv', '.jsonl'\]\)"):
        load_local(tmp_path / "files")


# --- assistant_only_loss: every assistant turn of a conversation ---------------------------------
CHAT = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+1="},
                     {"role": "assistant", "content": "2"}, {"role": "user", "content": "2+2="},
                     {"role": "assistant", "content": "4"}]}


def test_assistant_only_loss_marks_every_assistant_turn(tokenizer):
    out = tokenize_example(CHAT, tokenizer, assistant_only_loss=True)
    assert tokenizer.decode(out["prompt_ids"]) == "<s><|system|>be brief</s><|user|>1+1=</s><|assistant|>"
    completion = out["completion_ids"]
    assert tokenizer.decode(completion) == "2</s><|user|>2+2=</s><|assistant|>4</s>"
    targets = [t for t, m in zip(completion, out["completion_mask"]) if m]
    assert tokenizer.decode(targets) == "2</s>4</s>"  # each reply and its end of turn, no user text, no role tags
    # the whole conversation is the template's rendering, token for token
    rendered = tokenizer.apply_chat_template(CHAT["messages"], tokenize=False)
    assert tokenizer.decode(out["prompt_ids"] + completion) == rendered
    # without the flag: the last reply is the completion (loss on it alone)
    assert tokenizer.decode(tokenize_example(CHAT, tokenizer)["completion_ids"]) == "4</s>"
    with pytest.raises(ValueError, match=r"assistant_only_loss: needs conversations \(a 'messages' column\), got "
                                         r"format 'prompt_completion'"):
        tokenize_example(ROWS["prompt_completion"], tokenizer, assistant_only_loss=True)


def test_assistant_masks_survive_truncation_collation_and_packing(tokenizer):
    rows = [tokenize_example(CHAT, tokenizer, assistant_only_loss=True),
            tokenize_example(ROWS["conversational"], tokenizer, assistant_only_loss=True)]
    batch = collate_sequences(rows, pad_id=0)
    for b, row in enumerate(rows):
        P = len(row["prompt_ids"])
        want = [False] * P + row["completion_mask"]
        assert batch[K.LOSS_MASK][b, :len(want)].tolist() == want and not batch[K.LOSS_MASK][b, len(want):].any()
    packed = pack_sequences(rows, seq_length=64, pad_id=0)
    assert sorted(packed[K.INPUT_IDS][packed[K.LOSS_MASK]].tolist()) == \
        sorted(batch[K.INPUT_IDS][batch[K.LOSS_MASK]].tolist())
    full = rows[0]
    cut = tokenize_example(CHAT, tokenizer, assistant_only_loss=True, max_length=len(full["prompt_ids"]) + 3)
    assert cut["completion_ids"] == full["completion_ids"][:3]
    assert cut["completion_mask"] == full["completion_mask"][:3]
    end = tokenize_example(CHAT, tokenizer, assistant_only_loss=True, truncation="keep_end",
                           max_length=len(full["completion_ids"]) + 2)
    assert end["completion_ids"] == full["completion_ids"] and end["completion_mask"] == full["completion_mask"]
    assert len(end["prompt_ids"]) == 2


# --- hub dataset names ---------------------------------------------------------------------------
def _hub_cache(root, rows):
    """The datasets cache a download of the hub dataset ``acme/adds`` leaves (train and test
    splits prepared by datasets' json builder), built from local files: nothing is downloaded."""
    import shutil
    from pathlib import Path
    from datasets.packaged_modules.json.json import Json
    files = {}
    for split, part in (("train", rows[:-2]), ("test", rows[-2:])):
        files[split] = [str(root / f"{split}.jsonl")]
        (root / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    builder = Json(cache_dir=str(root / "build"), dataset_name="adds", data_files=files, hash="0123abcd")
    builder.download_and_prepare()
    cache = root / "cache"
    shutil.move(str(Path(builder.cache_dir).parents[1]), str(cache / "acme___adds" / "default"))
    return cache


def test_a_hub_dataset_name_loads_from_the_cache_offline(tmp_path):
    import os
    import subprocess
    import sys
    rows = [{"prompt": f"{a}+1=", "completion": str(a + 1)} for a in range(10)]
    cache = _hub_cache(tmp_path, rows)
    script = """
import sys
from rlcore.loops.data import load_source
from rlcore.loops.recipe import load_splits
from rlcore.loops.recipes.sft import Config
train, held_out = load_splits(Config(task=None, dataset="acme/adds", eval_dataset="acme/adds:test"), None)
print(len(train), len(held_out), train[0]["prompt"], held_out[0]["prompt"])
try:
    load_source("acme/nothing")
except ValueError as e:
    print("ERR", e)
"""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_DATASETS_CACHE": str(cache),
           "HF_HOME": str(tmp_path / "home")}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "8 2 0+1= 8+1="
    assert lines[1].startswith("ERR source: 'acme/nothing' is no local file or directory, and datasets could not "
                               "load split 'train' of the hub dataset 'acme/nothing'")


def test_load_source_keeps_local_paths_local(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"source: no such file .*missing.jsonl"):
        load_source(str(tmp_path / "missing.jsonl"))
    with pytest.raises(FileNotFoundError, match=r"is no local file or directory, nor a hub dataset name"):
        load_source(str(tmp_path / "no" / "such" / "dir"))
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "1+1="}\n')
    assert load_source(str(path))[0] == {"prompt": "1+1="}


def test_split_held_out_is_train_test_split_and_rows_keep_their_file_and_line(tmp_path):
    import json
    from rlcore.loops.data import row_origin, split_held_out
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.jsonl").write_text("".join(json.dumps({"prompt": f"a{i}"}) + "\n\n" for i in range(6)))
    (tmp_path / "d" / "b.jsonl").write_text("".join(json.dumps({"prompt": f"b{i}"}) + "\n" for i in range(6)))
    data = load_local(tmp_path / "d")
    train, held_out = split_held_out(data, 4, seed=3)
    parts = data.train_test_split(test_size=4, seed=3, shuffle=True)
    assert train.to_list() == parts["train"].to_list() and held_out.to_list() == parts["test"].to_list()
    for split in (train, held_out):
        for i, prompt in enumerate(split["prompt"]):
            name, k = prompt[0], int(prompt[1:])
            line = 2 * k + 1 if name == "a" else k + 1  # a.jsonl has a blank line after each row
            assert row_origin(split, i) == f"{tmp_path / 'd' / f'{name}.jsonl'}, line {line}"
    assert row_origin(load_local([{"prompt": "x"}]), 0) is None  # rows in memory: no file to name
