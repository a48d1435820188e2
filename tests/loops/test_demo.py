"""The demo (loops/demo.py): RL beats SFT on held-out prompts; table, plot, options, run directory."""

import argparse
import io
import json
import re
import sys

import pytest
import torch

from rlcore.loops import demo
from rlcore.loops.logging import read_jsonl


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models run fastest on one thread (and a shared machine is not oversubscribed)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


ROWS = [{"stage": "baseline", "steps": 0, "exact_match": 0.0, "reward": 0.03125, "kl_ref": 6.5},
        {"stage": "sft", "steps": 90, "exact_match": 0.3046875, "reward": 0.54, "kl_ref": -1e-4},
        {"stage": "grpo", "steps": 200, "exact_match": 0.734375, "reward": 0.838, "kl_ref": 1.96}]


def parse(*argv):
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    return parser.parse_args(list(argv))


# --- table and plot --------------------------------------------------------------------------------
def test_format_table_golden():
    assert demo.format_table(ROWS[:2]) == (
        "| stage | steps | held-out exact match | mean reward | KL to SFT policy |\n"
        "| --- | --- | --- | --- | --- |\n"
        "| baseline | 0 | 0.000 | 0.031 | 6.500 |\n"
        "| sft | 90 | 0.305 | 0.540 | 0.000 |")


def test_write_table_writes_the_table_and_note(tmp_path):
    path = tmp_path / "sub" / "table.md"
    text = demo.write_table(ROWS, path, note="task reverse")
    assert path.read_text() == text and text.endswith("\n\ntask reverse\n")
    assert text.count("\n|") == 4 and "| grpo | 200 | 0.734 | 0.838 | 1.960 |" in text


def test_plot_curves_writes_a_small_png(tmp_path):
    pytest.importorskip("matplotlib")
    curves = {"sft": [{"loss": 2.0}, {"loss": 1.0, "eval/exact_match": 0.3, "eval/reward": 0.5}],
              "grpo": [{"rollout/score": 0.4}, {"rollout/score": 0.6, "eval/exact_match": 0.5, "eval/reward": 0.7,
                                                "eval/kl_ref": 0.4}]}
    path = demo.plot_curves(curves, tmp_path / "curves.png", baseline=ROWS[0], title="t")
    assert path == tmp_path / "curves.png"
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) < 200_000


def test_plot_curves_without_matplotlib_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert demo.plot_curves({"sft": [{"eval/exact_match": 0.1}]}, tmp_path / "c.png") is None
    assert not (tmp_path / "c.png").exists()


# --- options -----------------------------------------------------------------------------------------
def test_options_map_to_the_config():
    config = demo.config_from_args(parse("--algo", "rloo", "--task", "sort", "--steps", "7", "--sft-steps", "3",
                                         "--out", "x/y", "--seed", "2", "--quick"))
    assert config == demo.Config(algo="rloo", task="sort", steps=7, sft_steps=3, out="x/y", seed=2, quick=True)
    defaults = demo.config_from_args(parse())
    assert defaults == demo.Config() and defaults.algo == "grpo" and not defaults.quick
    assert demo.stage_steps(defaults) == (demo.SFT_STEPS["reverse"], 300)
    assert demo.stage_steps(demo.Config(quick=True, task="sort")) == (demo.SFT_STEPS["sort"], 100)
    assert demo.stage_steps(demo.Config(sft_steps=5, steps=7, quick=True)) == (5, 7)


@pytest.mark.parametrize("argv", [["--algo", "sac"], ["--task", "chess"], ["--steps", "many"]])
def test_bad_options_exit_with_usage(argv, capsys):
    with pytest.raises(SystemExit):
        parse(*argv)
    assert "invalid" in capsys.readouterr().err


def test_every_algo_is_offered_and_the_cli_reaches_the_demo():
    from rlcore.loops import cli

    assert set(demo.ALGOS) == {"grpo", "rloo", "ppo", "online_dpo", "dpo"}
    args = cli.build_parser(["demo", "--algo", "dpo"]).parse_args(["demo", "--algo", "dpo", "--quick"])
    assert args.command == "demo" and demo.config_from_args(args).algo == "dpo"


def test_bad_config_fails_before_any_work(tmp_path):
    (tmp_path / "sft").mkdir()
    with pytest.raises(ValueError, match=r"algo: unknown 'sac'; valid: \['dpo', 'grpo'"):
        demo.run_demo(demo.Config(algo="sac", out=str(tmp_path)))
    with pytest.raises(ValueError, match=r"sft_steps, steps: expected at least 1 step per stage, got 0, 300"):
        demo.run_demo(demo.Config(sft_steps=0, out=str(tmp_path)))
    with pytest.raises(ValueError, match=r"num_eval: expected >= 1 \(the demo evaluates every stage"):
        demo.run_demo(demo.Config(num_eval=0, out=str(tmp_path)))
    assert [p.name for p in tmp_path.iterdir()] == ["sft"]  # nothing removed, nothing written


# --- runs --------------------------------------------------------------------------------------------
def test_a_tiny_run_writes_its_directory_and_replaces_stale_stages(tmp_path, capsys):
    stream = io.StringIO()
    small = dict(out=str(tmp_path), num_eval=8, num_train=64, hidden_size=32, num_layers=1, batch_size=4,
                 sft_batch_size=8)
    demo.run_demo(demo.Config(**small, sft_steps=3, steps=2), stream=stream)
    result = demo.run_demo(demo.Config(**small, sft_steps=2, steps=1), stream=stream)
    assert sorted(p.name for p in (tmp_path / "sft").iterdir()) == ["checkpoint-2", "metrics.jsonl"]
    assert [p.name for p in (tmp_path / "grpo").glob("checkpoint-*")] == ["checkpoint-1"]
    assert [r["step"] for r in read_jsonl(tmp_path / "grpo" / "metrics.jsonl")] == [1]
    assert "eval/exact_match" in read_jsonl(tmp_path / "sft" / "metrics.jsonl")[-1]
    saved = json.loads((tmp_path / "results.json").read_text())
    assert [r["stage"] for r in saved["rows"]] == ["baseline", "sft", "grpo"] == [r["stage"] for r in result["rows"]]
    assert saved["rows"][1]["kl_ref"] == pytest.approx(0.0, abs=1e-5)  # the SFT policy against itself
    assert (tmp_path / "table.md").read_text() == result["table"]
    assert result["table"] in capsys.readouterr().out
    lines = stream.getvalue()  # the live lines: the last evaluation's accuracy, no policy-gradient loss
    assert re.search(r"^sft 2/2  reward=\S+ acc=\S+ loss=\S+  .* left$", lines, flags=re.M), lines
    assert re.search(r"^grpo 1/1  reward=\S+ kl=\S+ acc=\S+  .* left$", lines, flags=re.M), lines


def test_a_tiny_calculator_run_plays_episodes_at_every_stage(tmp_path):
    small = dict(out=str(tmp_path), num_eval=4, num_train=32, hidden_size=32, num_layers=1, batch_size=2,
                 sft_batch_size=8, task="add", env="calculator")
    result = demo.run_demo(demo.Config(**small, sft_steps=2, steps=1), stream=io.StringIO())
    rows = [json.loads(line) for line in (tmp_path / "sft.jsonl").read_text().splitlines()]
    assert len(rows) == 32 and sum(len(r["messages"]) == 5 for r in rows) == 16  # half call the tool
    assert "rollout/turns" in read_jsonl(tmp_path / "grpo" / "metrics.jsonl")[-1]
    assert [r["stage"] for r in result["rows"]] == ["baseline", "sft", "grpo"]
    with pytest.raises(ValueError, match=r"env: the demo plays the calculator on an arithmetic task"):
        demo.run_demo(demo.Config(**{**small, "task": "reverse"}))
    args = __import__("rlcore.loops.cli", fromlist=["cli"]).build_parser(["demo"]).parse_args(
        ["demo", "--env", "calculator", "--task", "add"])
    assert demo.config_from_args(args).env == "calculator"


@pytest.mark.slow
def test_quick_demo_rl_beats_sft_on_held_out_prompts(tmp_path):
    # sort, seed 0, 150 RL steps: SFT 0.35 -> GRPO 0.59 held-out exact match on an AMD EPYC (docs/demo.md);
    # at --quick's 100 steps the margin is CPU-dependent (0.22 on an Intel Xeon, 0.086 on that EPYC)
    result = demo.run_demo(demo.Config(task="sort", out=str(tmp_path), quick=True, steps=150), stream=io.StringIO())
    baseline, after_sft, after_rl = result["rows"]
    assert after_sft["exact_match"] > baseline["exact_match"] + 0.1  # SFT taught a partial skill ...
    assert after_sft["exact_match"] < 0.6  # ... only partial
    assert after_rl["exact_match"] > after_sft["exact_match"] + 0.1, result["table"]  # RL improved on it
    assert after_rl["reward"] > after_sft["reward"] + 0.05
    assert after_rl["kl_ref"] > 0.05  # it moved away from the SFT policy
    assert (tmp_path / "curves.png").exists() or result["plot"] is None
