"""Logging callbacks: JSONL lines, the progress line (TTY and not), sample tables, optional writers."""

import dataclasses
import io
import json
import math

import pytest
import torch

from rlcore.loops.fold import every, fold
from rlcore.loops.logging import (TRL_METRIC_NAMES, CompletionsToTrackers, ImagesToTrackers, JsonlLogger, PeakMemory,
                                  ProgressDisplay, SampleTable, TensorBoardLogger, TrlNames, WandbLogger, check_trackers,
                                  make_loggers, read_jsonl, tracker_tag, trl_names)


@dataclasses.dataclass(frozen=True)
class S:
    step: int = 0


def step(state, x):
    return state, {"loss": torch.tensor(float(x)), "reward": torch.tensor(x / 10), "n": torch.tensor(3)}


def strict(line):
    def no_constants(name):
        raise ValueError(f"non-standard JSON constant {name}")
    return json.loads(line, parse_constant=no_constants)


class FakeTTY(io.StringIO):
    def isatty(self):
        return True


class Clock:
    """Each call returns the next value."""
    def __init__(self, *values):
        self.values = list(values)

    def __call__(self):
        return self.values.pop(0)


# --- JSONL -------------------------------------------------------------------------------------
def test_jsonl_one_strict_line_per_step(tmp_path):
    _, hist = fold(step, S(), [1, 2, 3], callbacks=[JsonlLogger(tmp_path)])
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    records = [strict(line) for line in lines]
    assert [r["step"] for r in records] == [1, 2, 3]
    for r, h in zip(records, hist):
        assert {k: v for k, v in r.items() if k not in ("step", "time")} == h
        assert all(isinstance(v, float) for k, v in r.items() if k != "step")
    assert read_jsonl(tmp_path / "metrics.jsonl") == records


def test_jsonl_non_finite_values_become_null(tmp_path):
    logger = JsonlLogger(tmp_path, filename="m.jsonl")
    logger(S(step=1), {"loss": math.nan, "grad_norm": math.inf, "ok": 1.0})
    record = strict((tmp_path / "m.jsonl").read_text())
    assert record["loss"] is None and record["grad_norm"] is None and record["ok"] == 1.0


def test_jsonl_resume_drops_steps_after_the_checkpoint_and_torn_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    fold(step, S(), [1, 2, 3, 4], callbacks=[JsonlLogger(tmp_path)])
    with open(path, "a") as f:
        f.write('{"step": 5, "loss"')  # the killed run's torn last line
    fold(step, S(step=2), [1, 2, 3, 4], callbacks=[JsonlLogger(tmp_path)])  # resumed from step 2
    assert [strict(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3, 4]


def test_jsonl_every(tmp_path):
    fold(step, S(), range(1, 8), callbacks=[JsonlLogger(tmp_path, every=3)])
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [3, 6]
    assert read_jsonl(tmp_path / "nothing.jsonl") == []


# --- progress ------------------------------------------------------------------------------------
def test_progress_plain_lines_when_not_a_tty():
    out = io.StringIO()
    display = ProgressDisplay(5, stage="sft", keys=("loss", "missing"), every=2, stream=out,
                              clock=Clock(0.0, 4.0, 8.0, 10.0, 12.0, 14.0))
    fold(step, S(), [1, 2, 3, 4, 5], callbacks=[display])
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert [line.split()[1] for line in lines] == ["2/5", "4/5", "5/5"]
    # step 2 at t=8: 0.25 it/s, 3 steps left -> 12 s
    assert lines[0] == "sft 2/5  loss=2  0.25 it/s, 0:00:12 left"


def test_progress_keeps_the_last_held_out_value_between_evaluations():
    out = io.StringIO()
    display = ProgressDisplay(3, stage="grpo", keys=("rollout/score", "eval/exact_match"), every=1, stream=out,
                              clock=Clock(0.0, 1.0, 2.0, 3.0))
    display.on_start(S())
    for step, metrics in enumerate([{"rollout/score": 0.5}, {"rollout/score": 0.6, "eval/exact_match": 0.25},
                                    {"rollout/score": 0.7}], start=1):
        display(S(step=step), metrics)
    shown = [line.split("  ")[1] for line in out.getvalue().splitlines()]
    assert shown == ["rollout/score=0.5", "rollout/score=0.6 eval/exact_match=0.25",
                     "rollout/score=0.7 eval/exact_match=0.25"]


def test_an_online_run_shows_reward_and_held_out_accuracy(tmp_path, capsys):
    """The live line of an online recipe names the reward, the held-out accuracy and the clip
    fractions, not only loss terms (a group-normalised loss is about 0)."""
    from rlcore.loops.recipes import grpo
    from tests.loops.online_helpers import TINY
    config = grpo.Config(**{**TINY, "run_dir": str(tmp_path / "run")}, batch_size=2, num_samples=2, steps=2,
                         eval_every=1, log_every=1)
    grpo.train(config)
    line = [x for x in capsys.readouterr().err.splitlines() if x.startswith("grpo 2/2")][-1]
    for name in ("rollout/score=", "eval/exact_match=", "eval/reward=", "clipfrac_high=", "loss="):
        assert name in line, line


def test_progress_redraws_one_line_on_a_tty():
    out = FakeTTY()
    fold(step, S(), [1, 2, 3], callbacks=[ProgressDisplay(3, stream=out, every=100)])
    text = out.getvalue()
    assert text.count("\r") == 3 and text.endswith("\n") and text.count("\n") == 1
    assert "train 3/3" in text and "loss=3" in text and "reward=0.3" in text


def test_progress_without_total():
    out = io.StringIO()
    display = ProgressDisplay(None, every=1, stream=out, clock=Clock(0.0, 1.0, 2.0))
    fold(step, S(), [1, 2], callbacks=[display])
    assert out.getvalue().splitlines()[1].startswith("train 2  loss=2 reward=0.2 n=3  1 it/s, ? left")


# --- samples -------------------------------------------------------------------------------------
def test_sample_table_every_n(tmp_path):
    calls = []

    def sample_fn(state):
        calls.append(state.step)
        return [{"prompt": "2+2=", "completion": "4 | four\nok", "reward": 1.0}, {"prompt": "x" * 300}]

    fold(step, S(), range(1, 6), callbacks=[SampleTable(tmp_path, sample_fn, every=2, max_chars=50)])
    assert calls == [2, 4]
    records = [strict(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 4]
    assert records[0]["samples"][0]["completion"] == "4 | four\nok" and len(records[0]["samples"][1]["prompt"]) == 300
    md = (tmp_path / "samples.md").read_text()
    assert md.count("## step") == 2
    assert "| prompt | completion | reward |" in md and "| 2+2= | 4 \\| four<br>ok | 1 |" in md
    assert "x" * 49 + "…" in md and "x" * 51 not in md


# --- optional writers ------------------------------------------------------------------------------
def test_tensorboard_and_wandb_are_guarded(tmp_path):
    for module, cls, kwargs in (("tensorboard", TensorBoardLogger, {"log_dir": tmp_path}),
                                ("wandb", WandbLogger, {"mode": "disabled"})):
        try:
            __import__(module)
        except ImportError:
            with pytest.raises(ImportError, match=f"needs the '{module}' package"):
                cls(**kwargs)
        else:  # installed: it works as a callback
            cb = cls(**kwargs)
            cb(S(step=1), {"loss": 1.0})
            cb.on_end(S(step=1))


def tensorboard_scalars(log_dir):
    """``{tag: [(step, value), ...]}`` read back from the event files (TensorBoard's own reader)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_report_to_tensorboard_writes_every_metric_at_its_step(tmp_path):
    pytest.importorskip("tensorboard")
    callbacks = make_loggers(tmp_path, progress=False, report_to=["tensorboard"])
    assert [type(c) for c in callbacks] == [PeakMemory, CompletionsToTrackers, ImagesToTrackers]
    assert [type(c) for c in callbacks[0].loggers] == [TrlNames]
    assert [type(c) for c in callbacks[0].loggers[0].loggers] == [JsonlLogger, TensorBoardLogger]
    fold(step, S(), [1, 2, 3], callbacks=callbacks)
    scalars = tensorboard_scalars(tmp_path / "tensorboard")
    assert set(scalars) == {"train/loss", "train/reward", "train/n", "train/memory/peak_rss_gib"}
    assert scalars["train/loss"] == [(1, 1.0), (2, 2.0), (3, 3.0)]
    assert [v for _, v in scalars["train/reward"]] == pytest.approx([0.1, 0.2, 0.3])


def test_tracker_tags_are_grouped_as_trl_s_and_metrics_jsonl_keeps_the_names(tmp_path):
    pytest.importorskip("tensorboard")

    def train_then_evaluate(state, x):  # 7 tokens a step
        return dataclasses.replace(state, tokens_seen=state.tokens_seen + 7), {
            "loss": torch.tensor(float(x)), "clipfrac_low": torch.tensor(0.25),
                       "clipfrac_high": torch.tensor(0.5)}

    evaluate = every(2, lambda s, m: {"eval/reward": 0.5})
    callbacks = [evaluate, *make_loggers(tmp_path, progress=False, report_to=["tensorboard"])]
    fold(train_then_evaluate, TokenState(), [1, 2], callbacks=callbacks)
    scalars = tensorboard_scalars(tmp_path / "tensorboard")
    assert scalars["eval/reward"] == [(2, 0.5)] and "train/eval/reward" not in scalars
    assert scalars["train/clip_ratio/region_mean"] == [(1, 0.75), (2, 0.75)]
    assert scalars["train/num_tokens"] == [(1, 7.0), (2, 14.0)]
    assert {"train/loss", "train/clipfrac_low", "train/clip_ratio/low_mean", "train/clip_ratio/high_mean"} <= set(scalars)
    lines = read_jsonl(tmp_path / "metrics.jsonl")
    assert lines[1]["eval/reward"] == 0.5 and lines[1]["loss"] == 2.0 and "train/loss" not in lines[1]
    assert [line["num_tokens"] for line in lines] == [7.0, 14.0]
    assert (tracker_tag("loss"), tracker_tag("eval/loss"), tracker_tag("rewards/correct/mean")) == \
        ("train/loss", "eval/loss", "train/rewards/correct/mean")


@dataclasses.dataclass(frozen=True)
class TokenState:
    step: int = 0
    tokens_seen: int = 0


def test_trl_names_map_rlcore_metrics_and_keep_what_is_there():
    out = trl_names({"rollout/score": 1.5, "rollout/score_std": 0.5, "clipfrac_low": 0.1, "clipfrac_high": 0.2,
                     "kl_ref": 0.03, "loss": 2.0, "lr": 1e-5}, TokenState(tokens_seen=40))
    assert out["reward"] == 1.5 and out["reward_std"] == 0.5 and out["kl"] == 0.03 and out["num_tokens"] == 40.0
    assert out["clip_ratio/low_mean"] == 0.1 and out["clip_ratio/high_mean"] == 0.2
    assert out["clip_ratio/region_mean"] == pytest.approx(0.3) and out["loss"] == 2.0
    assert set(TRL_METRIC_NAMES.values()) - {"clip_ratio/low_min", "clip_ratio/high_max"} <= set(out)
    # a name the step already logs is left as it is; no token count, no num_tokens
    assert trl_names({"reward": 9.0, "rollout/score": 1.0}, TokenState()) == {"reward": 9.0, "rollout/score": 1.0}


class FakeWandb:
    """Records what the logger asks of the ``wandb`` module (init, log, finish)."""
    def __init__(self):
        self.calls = []

    def init(self, **kwargs):
        self.calls.append(("init", kwargs))
        return self

    def log(self, metrics, step):
        self.calls.append(("log", step, metrics))

    def finish(self):
        self.calls.append(("finish",))


def test_report_to_wandb_starts_a_run_named_after_the_run_dir_with_the_config(tmp_path, monkeypatch):
    import sys
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: object())
    run_dir = tmp_path / "grpo-run"
    callbacks = make_loggers(run_dir, progress=False, report_to=("wandb",), config={"lr": 1e-3},
                             wandb_kwargs={"project": "rlhf"})
    fold(step, S(), [1, 2], callbacks=callbacks)
    assert fake.calls[0] == ("init", {"project": "rlhf", "config": {"lr": 1e-3}, "name": "grpo-run",
                                      "dir": str(run_dir)})
    assert [c[:2] for c in fake.calls[1:3]] == [("log", 1), ("log", 2)]
    logged = fake.calls[2][2]
    assert logged.pop("train/memory/peak_rss_gib") > 0 and fake.calls[-1] == ("finish",)
    assert logged == pytest.approx({"train/loss": 2.0, "train/reward": 0.2, "train/n": 3.0})


def test_completions_reach_the_trackers_as_tables_once(tmp_path):
    """Rows an evaluation appends to completions.jsonl go to every tracker at that step; rows of an
    earlier run in the same folder (a resume) are not sent again."""
    path = tmp_path / "completions.jsonl"
    path.write_text(json.dumps({"step": 0, "prompt": "old", "completion": "x", "reward": 0.0}) + "\n")
    tables = []

    class Tracker:
        def log_table(self, name, rows, step):
            tables.append((name, step, [r["prompt"] for r in rows]))

    def evaluate_then_step(state, x):  # what an eval callback does: append this step's rows
        with open(path, "a") as f:
            for i in range(x):
                f.write(json.dumps({"step": state.step + 1, "prompt": f"p{i}", "completion": "c|d", "reward": 1.0})
                        + "\n")
        return step(state, x)

    fold(evaluate_then_step, S(), [2, 0, 1], callbacks=[CompletionsToTrackers(path, [Tracker()])])
    assert tables == [("completions", 1, ["p0", "p1"]), ("completions", 3, ["p0"])]


def test_report_to_tensorboard_gets_the_completion_table(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    callbacks = make_loggers(tmp_path, progress=False, report_to=["tensorboard"])
    path = tmp_path / "completions.jsonl"

    def evaluate_then_step(state, x):
        with open(path, "a") as f:
            f.write(json.dumps({"step": state.step + 1, "prompt": "2+2=", "completion": "4", "reward": 1.0}) + "\n")
        return step(state, x)

    fold(evaluate_then_step, S(), [1], callbacks=callbacks)
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    [event] = events.Tensors("completions/text_summary")
    text = event.tensor_proto.string_val[0].decode()
    assert event.step == 1 and "| step | prompt | completion | reward |" in text and "| 1 | 2+2= | 4 | 1 |" in text


def test_report_to_names_are_checked_before_anything_is_built(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"report_to: expected names from \['tensorboard', 'wandb'\] \(or 'none'\), "
                                         r"got 'mlflow'"):
        make_loggers(tmp_path, report_to=["mlflow"])
    assert len(make_loggers(tmp_path, progress=False, report_to=["none"])) == 1
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    with pytest.raises(ImportError, match=r"report_to: 'wandb' needs the 'wandb' package \(pip install "
                                          r"'rlcore\[trackers\]' or pip install wandb\)"):
        check_trackers(["wandb"])
    assert not (tmp_path / "metrics.jsonl").exists()


def test_make_loggers(tmp_path):
    out = io.StringIO()
    callbacks = make_loggers(tmp_path, total=4, stage="dpo", progress_every=2, stream=out)
    assert [type(c) for c in callbacks] == [PeakMemory, ProgressDisplay]
    _, history = fold(step, S(), [1, 2, 3, 4], callbacks=callbacks)
    assert len(read_jsonl(tmp_path / "metrics.jsonl")) == 4 and out.getvalue().startswith("dpo 2/4")
    assert all("memory/peak_rss_gib" not in h for h in history)  # the history keeps the run's maths only
    assert len(make_loggers(tmp_path, progress=False)) == 1


def test_peak_memory_is_each_step_s_own():
    """A step that holds 256 MiB for a moment shows it in its peak; the next step, which does not,
    no longer does (where the peak can be reset: Linux)."""
    import os

    import torch

    from rlcore.loops.logging import peak_memory
    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("the RSS peak cannot be reset here")
    peaks = []

    def busy(state, x):
        if x:
            big = torch.ones(2 ** 26)  # 256 MiB of float32, written
            del big
        return step(state, x)

    class Record:
        def __call__(self, state, metrics):
            peaks.append(metrics["memory/peak_rss_gib"])

    fold(busy, S(), [0, 1, 0], callbacks=[PeakMemory([Record()])])
    assert peaks[1] > peaks[0] + 0.2 and peaks[2] < peaks[1] - 0.2, peaks
    assert set(peak_memory("cpu")) == {"memory/peak_rss_gib"}


def test_images_written_to_the_run_directory_reach_the_trackers(tmp_path):
    """A grid written under run_dir/images during a step is sent once, named by its file name's stem;
    one there before the run started is not."""
    pytest.importorskip("PIL")
    from PIL import Image

    class Tracker:
        def __init__(self):
            self.images = []

        def log_image(self, name, image, step):
            self.images.append((name, image.size, step))

    (tmp_path / "images").mkdir()
    Image.new("RGB", (4, 4)).save(tmp_path / "images" / "epoch-00000.png")
    tracker = Tracker()
    cb = ImagesToTrackers(tmp_path / "images", [tracker])
    cb.on_start(S(step=0))
    Image.new("RGB", (6, 5)).save(tmp_path / "images" / "samples-00001.png")
    cb(S(step=1), {})
    cb(S(step=2), {})
    assert tracker.images == [("images/samples", (6, 5), 1)]
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = TensorBoardLogger(tmp_path / "tb")
    board.log_image("images/samples", Image.new("RGB", (6, 5)), 3)
    board.on_end(S(step=3))
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert events.Tags()["images"] == ["images/samples"] and events.Images("images/samples")[0].step == 3
