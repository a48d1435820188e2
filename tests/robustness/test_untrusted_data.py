"""Datasets and rewards as untrusted input: bad bytes, empty files, rows of the wrong type, rows far
longer than any budget, prompts past the model's context and rewards too large for float32 losses
are refused before training with the file, row and column named (or, for long rows, read with
bounded memory)."""

import dataclasses
import json
import re

import pytest
import torch

from rlcore.logprobs import token_logprobs
from rlcore.lm_head import hidden_logprobs
from rlcore.loops.recipes import RECIPES, grpo, sft
from rlcore.loops.data import load_local
from rlcore.loops.tokenization import max_token_chars, text_window, tokenize_example
from rlcore.loops.models import build_tokenizer
from rlcore.loops.reward_fns import MAX_ABS_REWARD, call_reward_fn
from tests.loops.online_helpers import TINY

SFT_TINY = dict(hidden_size=16, num_layers=1, num_heads=2, num_eval=4, batch_size=4, max_length=24, log_every=100,
                run_dir=None)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# --- files ---------------------------------------------------------------------------------------
def test_bytes_that_are_not_utf8_are_named_by_line_before_any_model(tmp_path, monkeypatch):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"prompt": "1+1=", "completion": "2"}\n{"prompt": "\xff\xfe", "completion": "3"}\n')
    with pytest.raises(ValueError, match=r"source: .*bad.jsonl is not UTF-8 text: byte 50 \(line 2\) is b'\\xff'"):
        load_local(path)
    built = []
    monkeypatch.setattr(sft, "build_policy", lambda *a, **k: built.append(1))
    with pytest.raises(ValueError, match=r"is not UTF-8 text"):
        sft.train(sft.Config(task=None, dataset=str(path), **SFT_TINY))
    assert built == []


def test_an_empty_file_or_folder_is_refused_by_name(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match=r"source: .*empty.jsonl holds no rows"):
        load_local(tmp_path / "empty.jsonl")
    (tmp_path / "blank.csv").write_text("prompt,completion\n")
    with pytest.raises(ValueError, match=r"source: .*blank.csv holds no rows"):
        load_local(tmp_path / "blank.csv")


# --- rows ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("value,shown", [(123, "int 123"), (None, "NoneType None"), ({"a": 1}, "dict"),
                                         ([{"role": "user"}], "list")])
def test_a_field_that_is_not_text_names_the_row_and_column(value, shown):
    tokenizer = build_tokenizer()
    with pytest.raises(ValueError, match=rf"row 3: column 'completion' must hold text \(a string\) or a conversation "
                                         rf".*got {shown}"):
        tokenize_example({"prompt": "1+1=", "completion": value}, tokenizer, where="row 3")


def test_online_prompts_must_be_non_empty_text_before_any_model(tmp_path, monkeypatch):
    from rlcore.loops import online
    built = []
    monkeypatch.setattr(online, "build_online_state", lambda *a, **k: built.append(1))
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(20)]
    for bad, message in ((None, r"line 8: column 'prompt' must hold text"), ("", r"line 8: empty prompt")):
        path = write_jsonl(tmp_path / "p.jsonl", rows[:7] + [{"prompt": bad, "answer": "1"}] + rows[8:])
        with pytest.raises(ValueError, match=rf"dataset: .*p\.jsonl, {message}"):  # the file's line
            grpo.train(grpo.Config(**TINY, dataset=str(path), eval_dataset=str(path)))
    assert built == []


def test_a_huge_row_is_tokenised_within_its_budget():
    """A 5,000,000-character completion under max_length=64: only a window of the text reaches the
    tokenizer, and the kept tokens are those of the whole text."""
    tokenizer = build_tokenizer()
    seen = []

    class Recording:
        def __getattr__(self, name):
            return getattr(tokenizer, name)

        def __call__(self, text, **kwargs):
            seen.append(len(text))
            return tokenizer(text, **kwargs)

    huge = "0123456789" * 500_000
    out = tokenize_example({"prompt": "count:", "completion": huge}, Recording(), max_length=64)
    assert max(seen) <= 2 * (64 + 8) * max_token_chars(tokenizer) < 10_000
    assert len(out["prompt_ids"]) + len(out["completion_ids"]) == 64
    small = tokenize_example({"prompt": "count:", "completion": huge[:20_000]}, tokenizer, max_length=64)
    assert out == small  # the window changes nothing that is kept
    end = tokenize_example({"prompt": huge, "completion": "x"}, Recording(), max_length=64, truncation="keep_end")
    assert tokenizer.decode(end["prompt_ids"]).endswith("6789") and len(end["prompt_ids"]) == 62
    assert text_window("short", tokenizer, 4, "keep_end") == "short"


def test_a_prompt_past_the_context_is_refused_before_the_first_step(tmp_path):
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(20)]
    rows[11]["prompt"] = "1+" * 500_000 + "1="  # a million characters: read with bounded memory, then refused
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    run = tmp_path / "run"
    config = grpo.Config(**{**TINY, "run_dir": str(run), "num_eval": 4}, dataset=str(path), max_position_embeddings=64)
    with pytest.raises(ValueError, match=r"dataset: .*p\.jsonl, line 12: its prompt has \d+ tokens, "
                                         r"which with a response budget of 8 exceeds the model's context of 64 "
                                         r"\(max_position_embeddings\); set max_prompt_length <= 56"):
        grpo.train(config)
    assert not list(run.glob("checkpoint-*"))  # nothing ran
    state, _ = grpo.train(grpo.Config(**{**TINY, "run_dir": None, "num_eval": 4}, dataset=str(path), steps=1,
                                      max_position_embeddings=64, max_prompt_length=56, batch_size=2, num_samples=2))
    assert state.step == 1


# --- rewards and labels --------------------------------------------------------------------------
def test_rewards_too_large_for_float32_losses_are_refused():
    def huge(prompts, completions):
        return [1e38, 0.0, None]
    with pytest.raises(ValueError, match=r"reward function huge: scores \[[0-9.]+e\+37\] at rows \[0\] exceed "
                                         + re.escape(f"±{MAX_ABS_REWARD:g}") + ", where the losses' squares and sums "
                                         "overflow float32"):
        call_reward_fn(huge, ["a"] * 3, ["b"] * 3)
    ok = call_reward_fn(lambda completions, **kw: [MAX_ABS_REWARD, -MAX_ABS_REWARD], ["a"] * 2, ["b"] * 2)
    assert ok.tolist() == [MAX_ABS_REWARD, -MAX_ABS_REWARD]


def test_ppo_with_the_largest_accepted_rewards_keeps_its_losses_finite():
    from rlcore.loops.recipes import ppo

    def largest(prompts, completions):
        return [MAX_ABS_REWARD * (1 if len(c) % 2 else -1) for c in completions]
    _, history = ppo.train(ppo.Config(**TINY, steps=2, batch_size=4, num_samples=2), reward_fn=largest)
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in history)


def test_labels_outside_the_vocabulary_are_named():
    logits = torch.randn(2, 3, 5)
    for labels in (torch.tensor([[0, 1, 5], [0, 0, 0]]), torch.tensor([[0, 1, -100], [0, 0, 0]])):
        with pytest.raises(ValueError, match=r"labels: expected ids in \[0, 5\) \(the vocabulary V\)"):
            token_logprobs(logits, labels)
    with pytest.raises(ValueError, match=r"labels: expected ids in \[0, 5\)"):
        hidden_logprobs(torch.randn(2, 3, 4), torch.randn(5, 4), labels=torch.tensor([[0, 1, 9], [0, 0, 0]]))


def test_group_baselines_are_finite_at_the_edge_of_float32():
    """Group statistics in float64: grpo_advantage([2e38, 2e38, 0, 0]) was NaN (the sum overflowed);
    an advantage past the range saturates at the largest finite value instead of ±inf."""
    from rlcore.baselines import grpo_advantage, group_mean, rloo_advantage
    edge = torch.tensor([[2e38, 2e38, 0.0, 0.0]])
    torch.testing.assert_close(grpo_advantage(edge), torch.tensor([[1.0, 1.0, -1.0, -1.0]]) * 0.75 ** 0.5)
    in_bf16 = grpo_advantage(edge.bfloat16())
    assert in_bf16.dtype == torch.bfloat16 and torch.isfinite(in_bf16).all()
    torch.testing.assert_close(group_mean(edge), torch.full((1, 4), 1e38))
    big = torch.finfo(torch.float32).max
    assert rloo_advantage(torch.tensor([[3e38, -3e38]])).tolist() == [[big, -big]]  # 6e38 saturates


# --- rows named by their file and line -----------------------------------------------------------
@pytest.mark.parametrize("line,shown", [(b"[1, 2]", r"'\[1, 2\]'"), (b"5", r"'5'"), (b'"text"', r"'\"text\"'")])
def test_a_jsonl_line_that_is_not_an_object_is_named(tmp_path, line, shown):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b'{"prompt": "1+1=", "answer": "2"}\n\n' + line + b"\n")
    with pytest.raises(ValueError, match=rf"source: .*rows.jsonl, line 3: expected a JSON object .* per line, "
                                         rf"got {shown}"):
        load_local(path)


def test_nul_bytes_and_broken_json_lines_are_named(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": "a\x00b", "answer": "3"}\n')
    with pytest.raises(ValueError, match=r"source: .*rows.jsonl, line 2: holds a NUL byte \(at column 14\)"):
        load_local(path)
    path.write_bytes(b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": oops}\n')
    with pytest.raises(ValueError, match=r"source: .*rows.jsonl, line 2: not valid JSON .*: datasets cannot read it"):
        load_local(path)
    path.write_text('{"prompt": "1+1=", "answer": "2"}\n\n{"prompt": 7, "answer": "3"}\n')
    with pytest.raises(ValueError, match=r"source: .*rows.jsonl, line 3: column 'prompt' holds number 7 where line 1 "
                                         r"holds str \(a column holds one type\): datasets cannot read it"):
        load_local(path)
    path.write_text('{"prompt": "a\\u0000b", "answer": "3"}\n')  # an escaped NUL is JSON text: read as is
    assert load_local(path)["prompt"] == ["a\x00b"]


def test_rows_are_named_by_file_and_line_after_the_held_out_split(tmp_path, monkeypatch):
    """The held-out rows are split off with a shuffle: the error names the file's line (blank lines
    counted), not the row's place in the shuffled split."""
    from rlcore.loops import online
    monkeypatch.setattr(online, "build_online_state", lambda *a, **k: pytest.fail("a model was built"))
    lines = [json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) for i in range(30)]
    lines[20] = json.dumps({"prompt": "", "answer": "1"})
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(lines[:10]) + "\n\n" + "\n".join(lines[10:]) + "\n")  # a blank line 11
    with pytest.raises(ValueError, match=r"dataset: .*p\.jsonl, line 22: empty prompt"):
        grpo.train(grpo.Config(**{**TINY, "num_eval": 10}, dataset=str(path)))


def test_sft_rows_are_named_by_file_and_line_after_the_held_out_split(tmp_path):
    rows = [{"prompt": f"{i}+1=", "completion": str(i + 1)} for i in range(30)]
    rows[13]["completion"] = ""
    path = write_jsonl(tmp_path / "s.jsonl", rows)
    with pytest.raises(ValueError, match=r"s\.jsonl, line 14: empty completion"):
        sft.train(sft.Config(task=None, dataset=str(path), **SFT_TINY))
    rows[13]["completion"] = ["not", "text"]  # a column of text and lists: datasets would read "11" as 11
    path = write_jsonl(tmp_path / "s.jsonl", rows)
    with pytest.raises(ValueError, match=r"s\.jsonl, line 14: column 'completion' holds list \['not', 'text'\] where "
                                         r"line 1 holds str \(a column holds one type\)"):
        sft.train(sft.Config(task=None, dataset=str(path), **SFT_TINY))


def test_a_null_answer_is_refused_not_graded_zero(tmp_path, monkeypatch):
    from rlcore.loops import online
    built = []
    monkeypatch.setattr(online, "build_online_state", lambda *a, **k: built.append(1))
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(20)]
    rows[4]["answer"] = None
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    with pytest.raises(ValueError, match=r"dataset: .*p\.jsonl, line 5: column 'answer' is null, and add_reward "
                                         r"requires it \(a row without it would be graded as wrong\)"):
        grpo.train(grpo.Config(**TINY, dataset=str(path)))
    assert built == []

    def lenient(completions, answer=None, **kw):  # a default: rows without an answer are its to judge
        return [0.0 if a is None else float(c == a) for c, a in zip(completions, answer)]
    from rlcore.loops.online import check_prompt_data
    check_prompt_data(lenient, train=load_local(path))


# --- numbers and nesting in data files -------------------------------------------------------------
@pytest.mark.parametrize("margin,shown", [("NaN", "float nan"), ("Infinity", "float inf"), ("-Infinity", "float -inf"),
                                          ("1e39", "float 1e+39"), ("null", "null")])
def test_a_margin_that_is_not_a_finite_number_is_named_by_file_line_and_column(tmp_path, monkeypatch, margin, shown):
    """NaN margins gave loss NaN, every step skipped, exit 0; inf margins a 3.4e38 loss and no gradient."""
    from rlcore.loops.recipes import reward
    path = tmp_path / "pairs.jsonl"
    path.write_text('{"prompt": "a", "chosen": "b", "rejected": "c", "margin": 1.0}\n'
                    f'{{"prompt": "a", "chosen": "bb", "rejected": "c", "margin": {margin}}}\n'
                    '{"prompt": "a", "chosen": "b", "rejected": "cc", "margin": 2.0}\n')
    built = []
    monkeypatch.setattr(reward, "build_policy", lambda *a, **k: built.append(1))
    with pytest.raises(ValueError, match=rf"dataset: .*pairs.jsonl, line 2: column 'margin' holds {re.escape(shown)}; "
                                         r"expected a finite number"):
        reward.train(reward.Config(task=None, dataset=str(path), eval_dataset=str(path), margin_key="margin",
                                   run_dir=None))
    assert built == []


def test_a_margin_key_the_data_lacks_is_named_at_load(tmp_path):
    from rlcore.loops.recipes import reward
    path = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "a", "chosen": "b", "rejected": "c"}] * 3)
    with pytest.raises(ValueError, match=r"margin_key: the dataset has no column 'gap'"):
        reward.train(reward.Config(task=None, dataset=str(path), eval_dataset=str(path), margin_key="gap",
                                   run_dir=None))


def test_a_number_too_large_for_a_double_names_its_line(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text('{"prompt": "a", "margin": 1.0}\n{"prompt": "b", "margin": 1e400}\n')
    with pytest.raises(ValueError, match=r"pairs.jsonl, line 2: the number 1e400 does not fit a float64"):
        load_local(path)


@pytest.mark.parametrize("label,shown", [(float("nan"), "float nan"), (0.5, "float 0.5"), ("no", "str 'no'")])
def test_an_unpaired_label_that_is_not_true_or_false_is_named(label, shown):
    tok = build_tokenizer()
    with pytest.raises(ValueError, match=rf"dataset: f.jsonl, line 3: column 'label' holds {re.escape(shown)}; "
                                         "expected true or false"):
        tokenize_example({"prompt": "a", "completion": "b", "label": label}, tok, format="unpaired",
                         where="f.jsonl, line 3")
    for ok in (True, False, 1, 0):
        tokenize_example({"prompt": "a", "completion": "b", "label": ok}, tok, format="unpaired")


def test_precomputed_reference_logps_must_be_finite():
    tok = build_tokenizer()
    row = {"prompt": "a", "chosen": "b", "rejected": "c", "ref_chosen_logps": -1.0, "ref_rejected_logps": float("inf")}
    with pytest.raises(ValueError, match=r"row 0: column 'ref_rejected_logps' holds float inf"):
        tokenize_example(row, tok, format="preference", where="row 0")


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_a_line_nested_past_the_readers_stack_is_named_not_a_crash(tmp_path, suffix):
    """200,000 nested lists crashed pyarrow's JSON reader (the process died) or raised RecursionError."""
    path = tmp_path / f"deep{suffix}"
    path.write_text('{"prompt": "a", "completion": "b"}\n{"x": ' + "[" * 200_000 + "]" * 200_000 + "}\n")
    with pytest.raises(ValueError, match=rf"deep{re.escape(suffix)}, line 2: nested deeper than 64 levels"):
        load_local(path)
    brackets = tmp_path / f"text{suffix}"  # brackets inside strings are text, not nesting
    write_jsonl(brackets, [{"prompt": "[" * 500 + "{" * 500, "completion": "b"}])
    assert load_local(brackets).num_rows == 1


def test_the_final_line_of_a_run_is_strict_json(monkeypatch, capsys):
    """A NaN loss printed ``{"final": {"loss": NaN}}``, which is not JSON."""
    from rlcore.loops import cli
    def train(config, callbacks=()):
        return None, [{"loss": float("nan"), "lr": 1e-3, "x": [float("inf")]}]
    monkeypatch.setitem(RECIPES, "sft", dataclasses.replace(RECIPES["sft"], train=train))
    assert cli.main(["train", "sft", "--run_dir", "null", "--steps", "1"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(line) == {"final": {"loss": None, "lr": 1e-3, "x": [None]}}
