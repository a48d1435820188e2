"""Reward functions as TRL users write them: called by keyword, combined with weights, named in a config."""

import dataclasses
import json
import math
import textwrap

import numpy as np
import pytest
from rlcore import keys as K
import torch

from rlcore.loops import cli

from rlcore.loops.recipes import grpo
from rlcore.loops.reward_fns import call_reward_fn, import_reward_fn
from rlcore.loops.reward_fns import make_reward_fn
from tests.loops.online_helpers import TINY, collect_rollout, updated_batches

PROMPTS, COMPLETIONS, ANSWERS = ["1+1=", "2+2=", "3+3="], ["2", "5", " 6"], ["2", "4", "6"]


def test_trl_style_functions_are_called_by_keyword():
    def correct(completions, answer, **kwargs):  # TRL's GRPO docs: the dataset columns arrive by name
        assert kwargs["prompts"] == PROMPTS
        return [float(c.strip() == a) for c, a in zip(completions, answer)]

    def no_kwargs(completions, answer):  # no **kwargs: only what it names is passed
        return [float(c == a) for c, a in zip(completions, answer)]

    def prompts_second(completions, prompts):
        return [len(p) + len(c) for c, p in zip(completions, prompts)]

    assert call_reward_fn(correct, PROMPTS, COMPLETIONS, answer=ANSWERS).tolist() == [1.0, 0.0, 1.0]
    assert call_reward_fn(no_kwargs, PROMPTS, COMPLETIONS, answer=ANSWERS).tolist() == [1.0, 0.0, 0.0]
    assert call_reward_fn(prompts_second, PROMPTS, COMPLETIONS).tolist() == [5.0, 5.0, 6.0]


def test_every_function_is_called_by_keyword_and_other_forms_are_refused_by_name():
    def positional(p, c):
        return [0.0] * len(c)

    with pytest.raises(ValueError, match=r"reward function positional: its parameters \['p', 'c'\] name none of "
                                         r"prompts, completions, completion_ids, trainer_state, trajectories"):
        call_reward_fn(positional, PROMPTS, COMPLETIONS)
    with pytest.raises(ValueError, match=r"<lambda>: requires \['p', 'c'\], which it is not given: reward functions "
                                         r"receive prompts, completions, completion_ids, trainer_state, trajectories and the "
                                         r"dataset's columns \(\['answer'\]\) by keyword"):
        call_reward_fn(lambda p, c, **kw: [0.0] * len(c), PROMPTS, COMPLETIONS, answer=ANSWERS)
    with pytest.raises(ValueError, match=r"reward function len: positional-only parameters \['obj'\]"):
        make_reward_fn(grpo.Config(**TINY), [len])  # refused when the run's reward is built, before any model
    seen = {}
    assert call_reward_fn(lambda **kw: seen.update(kw) or [0.5] * 3, PROMPTS, COMPLETIONS, answer=ANSWERS,
                          completion_ids=[[1], [2], [3]]).tolist() == [0.5] * 3
    assert seen == {"prompts": PROMPTS, "completions": COMPLETIONS, "answer": ANSWERS, "completion_ids": [[1], [2], [3]]}


def write_module(tmp_path, monkeypatch):
    (tmp_path / "user_rewards.py").write_text(textwrap.dedent("""
        def correct(completions, answer, **kwargs):
            return [float(c.strip() == a) for c, a in zip(completions, answer)]

        def length(completions, **kwargs):
            return [float(len(c)) for c in completions]

        NOT_CALLABLE = 3
    """))
    monkeypatch.syspath_prepend(str(tmp_path))


def test_a_config_names_reward_functions_and_their_weights(tmp_path, monkeypatch):
    write_module(tmp_path, monkeypatch)
    config = grpo.Config(**TINY, reward_funcs=("user_rewards:correct", "user_rewards:length"),
                         reward_weights=(1.0, 0.5))
    fn = make_reward_fn(config)
    assert call_reward_fn(fn, PROMPTS, COMPLETIONS, answer=ANSWERS).tolist() == [1.5, 0.5, 2.0]
    # functions given in Python come first, then the config's; one weight each, in that order
    both = make_reward_fn(grpo.Config(**TINY, reward_funcs=("user_rewards:correct",), reward_weights=(2.0, 1.0)),
                          lambda prompts, completions, **kw: [1.0] * len(completions))
    assert call_reward_fn(both, PROMPTS, COMPLETIONS, answer=ANSWERS).tolist() == [3.0, 2.0, 3.0]  # 2·1 + correct
    one = lambda completions, **kw: [1.0] * len(completions)  # noqa: E731
    assert make_reward_fn(grpo.Config(**TINY), [one]) is one  # one function, no weights: itself


@pytest.mark.parametrize("spec,message", [
    ("user_rewards", r"expected 'package.module:function', got 'user_rewards'"),
    ("no_such_module_xyz:f", r"cannot load 'no_such_module_xyz:f' \(ModuleNotFoundError"),
    ("user_rewards:missing", r"cannot load 'user_rewards:missing' \(AttributeError"),
    ("user_rewards:NOT_CALLABLE", r"'user_rewards:NOT_CALLABLE' is not callable \(a int\)"),
])
def test_bad_reward_specs_name_the_spec(tmp_path, monkeypatch, spec, message):
    write_module(tmp_path, monkeypatch)
    with pytest.raises(ValueError, match=rf"reward_funcs: {message}"):
        import_reward_fn(spec)


def test_weights_must_match_the_functions(tmp_path, monkeypatch):
    write_module(tmp_path, monkeypatch)
    config = grpo.Config(**TINY, reward_funcs=("user_rewards:correct",), reward_weights=(1.0, 2.0))
    with pytest.raises(ValueError, match=r"reward_weights: expected one weight per reward function \(1\), got 2"):
        make_reward_fn(config)


def test_grpo_runs_from_the_cli_with_a_named_reward(tmp_path, monkeypatch, capsys):
    write_module(tmp_path, monkeypatch)
    run = tmp_path / "run"
    assert cli.main(["train", "grpo", "--steps", "2", "--batch_size", "2", "--num_samples", "2", "--hidden_size", "32",
                     "--num_layers", "1", "--num_train", "8", "--num_eval", "4", "--max_new_tokens", "4",
                     "--reward_funcs", "user_rewards:correct,user_rewards:length", "--reward_weights", "1,0.25",
                     "--run_dir", str(run), "--save_every", "1"]) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    scores = [r["rollout/score"] for r in rows if "rollout/score" in r]
    assert len(scores) == 2 and all(math.isfinite(s) and s > 0 for s in scores)  # length > 0 on every sample
    saved = json.loads((run / "checkpoint-2" / "config.json").read_text())
    assert saved["reward_funcs"] == ["user_rewards:correct", "user_rewards:length"]


# --- untrusted scores --------------------------------------------------------------------------------
@pytest.mark.parametrize("out,message", [
    ([1.0, float("nan")], r"non-finite scores \[nan\] at rows \[1\]; return None"),
    ([float("inf"), 0.0], r"non-finite scores \[inf\] at rows \[0\]"),
    (torch.tensor([[1.0], [2.0]]), r"expected 2 scores \[B\], got shape \[2, 1\]"),
    (torch.ones(4), r"expected 2 scores \[B\], got shape \[4\]"),
    (["high", 1.0], r"every score must be a number or None"),
    (3.0, r"expected a list of 2 scores or a \[B\] tensor, got float"),
])
def test_bad_scores_are_clear_errors(out, message):
    def judge(prompts, completions, **kw):
        return out
    with pytest.raises(ValueError, match=rf"reward function judge: {message}"):
        call_reward_fn(judge, ["a", "b"], ["x", "y"])


def test_none_is_no_opinion_and_leaves_the_group_statistics():
    from rlcore import keys as K
    from rlcore.baselines import grpo_advantage
    from rlcore.loops.online import build_online_state, prompt_source
    from rlcore.loops.recipe import load_splits
    from rlcore.loops.tasks import task_dataset

    def judge(prompts, completions, **kw):  # no opinion on the first sample of each prompt
        return [None if i % 4 == 0 else float(len(c)) + 0.1 * i for i, c in enumerate(completions)]

    config = grpo.Config(**TINY, steps=1, batch_size=2, num_samples=4, lr=1e-3)
    state, tokenizer = build_online_state(config)
    rows = next(iter(prompt_source(load_splits(config, task_dataset)[0], config)(0)))
    seen, real = [], grpo.update

    def spy(state, batch, loss_fn, **kw):  # the rollout grpo.learn's loss closure trains on
        seen.append(batch)
        return real(state, batch, loss_fn, **kw)
    import unittest.mock
    with unittest.mock.patch.object(grpo, "update", spy):
        new_state, metrics = grpo.step(state, rows, config=config, tokenizer=tokenizer, reward_fn=judge)
    assert new_state.optimizer_steps == 1 and math.isfinite(float(metrics["loss"]))
    assert float(metrics["rollout/unscored"]) == 2.0
    batch = seen[0]
    mask = batch[K.RESPONSE_MASK]
    assert not mask[0].any() and not mask[4].any() and mask[1:4].any(-1).all()
    per_sample = torch.where(mask, batch[K.ADVANTAGES], 0.0).sum(-1) / mask.sum(-1).clamp(min=1)
    expected = grpo_advantage(batch[K.SCORE][1:4][None])[0]  # the three scored samples of prompt 0 alone
    torch.testing.assert_close(per_sample[1:4], expected, rtol=1e-5, atol=1e-6)


def test_datasets_are_checked_for_the_columns_the_run_reads_before_any_model(tmp_path, monkeypatch):
    from rlcore.loops import online
    from rlcore.loops.reward_fns import reward_columns
    built = []
    monkeypatch.setattr(online, "build_online_state", lambda *a, **k: built.append(1))
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"question": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(40)))
    config = grpo.Config(**TINY, dataset=str(rows))
    with pytest.raises(ValueError, match=r"dataset: the train split has columns \['question', 'answer'\] but the run "
                                         r"needs \['prompt'\]"):
        grpo.train(config)
    rows.write_text("".join(json.dumps({"prompt": f"{i}+1="}) + "\n" for i in range(40)))
    with pytest.raises(ValueError, match=r"needs \['answer'\] \('prompt' to generate from; the others are read by "
                                         r"add_reward\)"):
        grpo.train(config)  # the built-in task reward reads `answer`

    def correct(completions, solution, **kwargs):  # TRL style: the column it reads is a parameter
        return [0.0] * len(completions)
    assert reward_columns(correct) == ("solution",)
    with pytest.raises(ValueError, match=r"needs \['solution'\] .* read by correct"):
        grpo.train(config, reward_fn=correct)
    assert built == []


def test_prompts_past_the_models_context_are_refused_with_the_fix():
    from rlcore.loops.collect import generate_rollout
    from rlcore.loops.models import build_model, build_tokenizer
    tokenizer = build_tokenizer()
    for arch in ("llama", "gpt2"):
        model = build_model(arch, tokenizer=tokenizer, hidden_size=16, num_layers=1, num_heads=2,
                            max_position_embeddings=32).eval()
        with pytest.raises(ValueError, match=r"prompts: the longest has 40 tokens, which with max_new_tokens=4 exceeds "
                                             r"the model's context of 32 .* set max_prompt_length <= 28"):
            generate_rollout(model, tokenizer, ["x" * 40], max_new_tokens=4, engine="loop")
        kept = generate_rollout(model, tokenizer, ["x" * 40], max_new_tokens=4, max_prompt_length=28, engine="loop")
        assert kept[K.PROMPT_IDS].shape[1] == 28


def test_evaluations_write_the_completions_table(tmp_path):
    run = tmp_path / "run"
    config = grpo.Config(**{**TINY, "max_new_tokens": 4, "run_dir": str(run)}, steps=2, batch_size=2, num_samples=2,
                         eval_every=1,
                         log_completions=3)
    grpo.train(config)
    rows = [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 1, 1, 2, 2, 2]
    assert all(set(r) == {"step", "prompt", "completion", "reward"} and isinstance(r["completion"], str) for r in rows)
    assert rows[0]["prompt"] == rows[3]["prompt"]  # the same held-out prompts at every evaluation


def test_missing_eos_penalty_and_stop_tokens():
    from rlcore.loops.online import build_online_state, prompt_source
    from rlcore.loops.recipe import load_splits
    from rlcore.loops.tasks import task_dataset

    def one(prompts, completions, **kw):
        return [1.0] * len(completions)
    base = grpo.Config(**{**TINY, "max_new_tokens": 3}, batch_size=4, num_samples=2)
    state, tokenizer = build_online_state(base)
    rows = next(iter(prompt_source(load_splits(base, task_dataset)[0], base)(0)))
    _, plain = collect_rollout(state, rows, config=base, tokenizer=tokenizer, reward_fn=one)
    config = dataclasses.replace(base, missing_eos_penalty=0.5)
    _, penalised = collect_rollout(state, rows, config=config, tokenizer=tokenizer, reward_fn=one)
    assert torch.equal(plain[K.RESPONSE_IDS], penalised[K.RESPONSE_IDS])  # same draws
    ended = (plain[K.RESPONSE_IDS] == tokenizer.eos_token_id).any(-1)
    torch.testing.assert_close(penalised[K.SCORE], torch.where(ended, 1.0, 0.5))
    assert (~ended).any()  # 3 tokens: most responses are cut
    stop = int(plain[K.RESPONSE_IDS][0, 0])  # the first token drawn becomes a stop token: that row ends there
    _, stopped = collect_rollout(state, rows, config=dataclasses.replace(config, stop_token_ids=(stop,)),
                                 tokenizer=tokenizer, reward_fn=one)
    assert int(stopped[K.RESPONSE_MASK][0].sum()) == 1 and float(stopped[K.SCORE][0]) == 1.0  # ended: no penalty


def test_a_reward_module_in_the_working_directory_is_found(tmp_path, monkeypatch):
    """``rlcore train ... --reward_funcs my_task:correct`` from the project's folder: the console
    script's path does not hold the working directory, so the import looks there too (and leaves
    ``sys.path`` as it was)."""
    import sys
    (tmp_path / "cwd_task_rewards.py").write_text("def correct(prompts, completions, **_):\n"
                                                  "    return [1.0] * len(completions)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    before = list(sys.path)
    fn = import_reward_fn("cwd_task_rewards:correct")
    assert fn(["p"], ["c"]) == [1.0] and sys.path == before


# --- what a reward function may return ---------------------------------------------------------------
@pytest.mark.parametrize("out,message", [
    ({0: 5.0, 1: 5.0}, r"expected a list of 2 scores or a \[B\] tensor, got dict \(a mapping is not read by position"),
    (["1.0", "2"], r"every score must be a number or None \(int, float or bool\); score 0 is str '1.0'"),
    ([[1.0], [2.0]], r"every score must be a number or None .*score 0 is list \[1.0\]"),
    ([1.0, "x"], r"every score .*; score 1 is str 'x'"),
    ("ab", r"expected a list of 2 scores or a \[B\] tensor, got str"),
    ((s for s in [1.0, 2.0]), r"expected a list of 2 scores or a \[B\] tensor, got generator"),
    ({1.0, 2.0}, r"expected a list of 2 scores .*, got set"),
    ([1.0, 2.0, 3.0], r"expected 2 scores \[B\], got shape \[3\] \(a list of 3; one score per completion\)"),
    (np.array(["a", "b"]), r"expected 2 real scores, got a NumPy array of dtype <U1"),
    (np.ones((2, 2)), r"expected 2 scores \[B\], got shape \[2, 2\]"),
    (torch.ones(2, dtype=torch.complex64), r"expected 2 real scores, got a tensor of dtype torch.complex64"),
])
def test_return_types_are_checked_and_named(out, message):
    def judge(prompts, completions, **kw):
        return out
    with pytest.raises(ValueError, match=rf"reward function judge: {message}"):
        call_reward_fn(judge, ["a", "b"], ["x", "y"])


@pytest.mark.parametrize("out", [(1, 0.5), [True, False], [np.float32(1.0), np.int64(0)], [np.bool_(True), None],
                                 np.array([1.0, 0.0]), np.array([True, False]), [torch.tensor(1.0), 0],
                                 torch.tensor([1, 0])])
def test_real_numbers_in_a_sequence_tensor_or_array_are_scores(out):
    got = call_reward_fn(lambda completions, **kw: out, ["a", "b"], ["x", "y"])
    assert got.dtype == torch.float32 and got[0] == 1.0 and (got[1] in (0.0, 0.5) or math.isnan(got[1]))


# --- non-finite scores: one policy -------------------------------------------------------------------
def test_nonfinite_scores_raise_or_drop_by_the_setting():
    def judge(prompts, completions, **kw):
        return [1.0, float("nan"), None, float("-inf")]
    args = (["q"] * 4, ["a"] * 4)
    with pytest.raises(ValueError, match=r"reward function judge: non-finite scores \[nan, -inf\] at rows \[1, 3\]; "
                                         r"return None .*or set nonfinite_rewards: drop"):
        call_reward_fn(judge, *args)
    dropped = call_reward_fn(judge, *args, nonfinite_rewards="drop")
    assert dropped[0] == 1.0 and torch.isnan(dropped[1:]).all()  # dropped as None is: NaN, "no opinion"
    tensor = call_reward_fn(lambda completions, **kw: torch.tensor([0.5, float("inf"), 1.0, 2.0]), *args, nonfinite_rewards="drop")
    assert tensor[1].isnan() and tensor[[0, 2, 3]].tolist() == [0.5, 1.0, 2.0]
    with pytest.raises(ValueError, match=r"nonfinite_rewards: expected one of \['raise', 'drop'\], got 'skip'"):
        call_reward_fn(judge, *args, nonfinite_rewards="skip")


def test_combined_functions_are_named_and_drop_a_row_whole():
    from rlcore.loops.reward_fns import combine_rewards

    def ok(prompts, completions):
        return [1.0, 1.0, None]

    def broken(prompts, completions):
        return [float("nan"), 2.0, 3.0]
    combined = combine_rewards([ok, broken])
    with pytest.raises(ValueError, match=r"reward function broken: non-finite scores \[nan\] at rows \[0\]"):
        call_reward_fn(combined, ["q"] * 3, ["a"] * 3)
    out = call_reward_fn(combined, ["q"] * 3, ["a"] * 3, nonfinite_rewards="drop")
    assert math.isnan(out[0]) and out[1:].tolist() == [3.0, 3.0]  # row 0 dropped, not scored 1.0 by `ok` alone


def test_reward_settings_are_checked_with_the_config():
    from rlcore.loops.config import check_config
    with pytest.raises(ValueError, match=r"reward_timeout: expected >= 0, got -1.*nonfinite_rewards: expected one of "
                                         r"\['drop', 'raise'\], got 'skip'"):
        check_config(grpo.Config(**TINY, reward_timeout=-1, nonfinite_rewards="skip"))
    assert grpo.Config().reward_timeout == 300.0 and grpo.Config().nonfinite_rewards == "raise"


# --- a per-call time limit ---------------------------------------------------------------------------
def test_a_reward_function_that_never_returns_fails_the_call_by_name():
    import threading
    import time
    release = threading.Event()

    def stuck(prompts, completions):
        release.wait()
        return [0.0] * len(completions)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"reward function stuck: no result after reward_timeout=0.2 s; .*background"):
        call_reward_fn(stuck, ["q"], ["a"], reward_timeout=0.2)
    assert time.monotonic() - start < 5
    left = [t for t in threading.enumerate() if t.name == "rlcore reward function stuck"]
    assert left and all(t.daemon for t in left)  # still running, and never keeps the process alive
    release.set()
    from rlcore.loops.reward_fns import combine_rewards
    combined = combine_rewards([lambda completions, **kw: [1.0], stuck])
    release.clear()
    with pytest.raises(TimeoutError, match=r"reward function stuck: no result after reward_timeout=0.2 s"):
        call_reward_fn(combined, ["q"], ["a"], reward_timeout=0.2)  # the function of the combination is named
    release.set()


def test_within_the_limit_errors_pass_through_and_none_means_this_thread():
    import threading

    def failing(prompts, completions):
        raise KeyError("missing column")
    with pytest.raises(KeyError, match="missing column"):
        call_reward_fn(failing, ["q"], ["a"], reward_timeout=5)
    where = []
    call_reward_fn(lambda completions, **kw: where.append(threading.current_thread()) or [1.0], ["q"], ["a"], reward_timeout=None)
    assert where == [threading.main_thread()]
    with torch.no_grad():  # the caller's grad mode holds inside the worker thread
        modes = []
        call_reward_fn(lambda completions, **kw: modes.append(torch.is_grad_enabled()) or [1.0], ["q"], ["a"], reward_timeout=5)
    assert modes == [False]


def test_a_stuck_reward_function_fails_the_grpo_step_by_name():
    import threading
    release = threading.Event()

    def stuck(prompts, completions, **kw):
        release.wait()
        return [0.0] * len(completions)
    try:
        with pytest.raises(TimeoutError, match=r"reward function stuck: no result after reward_timeout=0.5 s"):
            grpo.train(grpo.Config(**TINY, steps=1, batch_size=2, num_samples=2, reward_timeout=0.5), reward_fn=stuck)
    finally:
        release.set()


# --- non-finite scores in a step: drop is "no opinion" -----------------------------------------------
def _spied_step(config, reward_fn, monkeypatch, state_models=None):
    from rlcore.loops.online import build_online_state, prompt_source
    from rlcore.loops.recipe import load_splits
    from rlcore.loops.tasks import task_dataset
    state, tokenizer = build_online_state(config)
    if state_models:
        state = dataclasses.replace(state, models={**state.models, **state_models})
    rows = next(iter(prompt_source(load_splits(config, task_dataset)[0], config)(0)))
    seen = updated_batches(grpo, monkeypatch)
    new_state, metrics = grpo.step(state, rows, config=config, tokenizer=tokenizer, reward_fn=reward_fn)
    return new_state, metrics, seen[0]


def _assert_first_of_each_group_left_out(new_state, metrics, batch):
    from rlcore.baselines import grpo_advantage
    assert new_state.optimizer_steps == 1 and math.isfinite(float(metrics["loss"]))
    assert float(metrics["rollout/unscored"]) == 2.0
    mask = batch[K.RESPONSE_MASK]
    assert not mask[0].any() and not mask[4].any() and mask[1:4].any(-1).all()
    per_sample = torch.where(mask, batch[K.ADVANTAGES], 0.0).sum(-1) / mask.sum(-1).clamp(min=1)
    expected = grpo_advantage(batch[K.SCORE][1:4][None])[0]  # the three scored samples of prompt 0 alone
    torch.testing.assert_close(per_sample[1:4], expected, rtol=1e-5, atol=1e-6)


def test_nonfinite_function_scores_dropped_leave_the_loss_and_the_group(monkeypatch):
    def judge(prompts, completions, **kw):  # NaN on the first sample of each prompt
        return [math.nan if i % 4 == 0 else float(len(c)) + 0.1 * i for i, c in enumerate(completions)]
    config = grpo.Config(**TINY, steps=1, batch_size=2, num_samples=4, lr=1e-3, nonfinite_rewards="drop")
    _assert_first_of_each_group_left_out(*_spied_step(config, judge, monkeypatch))
    with pytest.raises(ValueError, match=r"reward function judge: non-finite scores \[nan, nan\] at rows \[0, 4\]"):
        _spied_step(dataclasses.replace(config, nonfinite_rewards="raise"), judge, monkeypatch)


def test_nonfinite_reward_model_scores_raise_or_drop_like_a_function(monkeypatch):
    """A reward model's NaN made every sample "unscored" (gradient 0, no error): it now goes through
    the same check as a reward function's scores."""
    from rlcore.loops import score
    from rlcore.loops.models import build_reward_model, build_tokenizer
    real = score.reward_model_scores

    def nan_first_of_each_group(model, ids, mask):
        out = real(model, ids, mask)
        return torch.where(torch.arange(len(out)) % 4 == 0, math.nan, out)
    monkeypatch.setattr(score, "reward_model_scores", nan_first_of_each_group)
    rm = build_reward_model(tokenizer=build_tokenizer(), hidden_size=16, num_layers=1, num_heads=2)
    config = grpo.Config(**TINY, steps=1, batch_size=2, num_samples=4, lr=1e-3)
    with pytest.raises(ValueError, match=r"reward model.*: non-finite scores \[nan, nan\] at rows \[0, 4\]; .*"
                                         r"nonfinite_rewards: drop"):
        _spied_step(config, None, monkeypatch, state_models={"reward": rm})
    dropped = dataclasses.replace(config, nonfinite_rewards="drop")
    _assert_first_of_each_group_left_out(*_spied_step(dropped, None, monkeypatch, state_models={"reward": rm}))


# --- returns that are not scores, or too large for them ---------------------------------------------
@pytest.mark.parametrize("out,message", [
    ([2**1100, 1.0], r"score 0 is an integer of 1101 bits, beyond ±1e\+10"),
    (torch.tensor([1.0, 2.0]).to_sparse(), r"got a tensor of layout torch.sparse_coo"),
    (torch.zeros(2, device="meta"), r"got a meta tensor"),
    (bytearray(b"ab"), r"got bytearray \(bytes are not scores\)"),
    (memoryview(b"ab"), r"got memoryview \(bytes are not scores\)"),
    (np.ma.array([1.0, 2.0], mask=[False, True]), r"got a NumPy masked array"),
])
def test_returns_that_are_not_scores_are_refused_by_name(out, message):
    """Each gave a raw OverflowError / NotImplementedError, or scores read from bytes or past a mask."""
    def judge(completions, **kwargs):
        return out
    with pytest.raises(ValueError, match=r"^reward function judge: .*" + message):
        call_reward_fn(judge, ["q", "q"], ["a", "b"])


@pytest.mark.parametrize("nonfinite_rewards", ["raise", "drop"])
@pytest.mark.parametrize("out", [[1e39, 1.0], np.array([1e39, 1.0]), torch.tensor([1e39, 1.0], dtype=torch.float64)])
def test_a_finite_score_past_float32_is_too_large_not_non_finite(out, nonfinite_rewards):
    """1e39 overflowed the float32 cast to inf: reported as non-finite, and dropped under ``drop``."""
    def judge(completions, **kwargs):
        return out
    with pytest.raises(ValueError, match=r"reward function judge: scores \[1e\+39\] at rows \[0\] exceed ±1e\+10"):
        call_reward_fn(judge, ["q", "q"], ["a", "b"], nonfinite_rewards=nonfinite_rewards)
