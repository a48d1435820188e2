"""The ``rlcore`` command: recipes listed, options documented, a recipe trained and evaluated."""

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rlcore.loops import cli
from rlcore.loops.recipes import RECIPES, Recipe, by_config

ROOT = Path(__file__).resolve().parents[2]


CLI_RECIPES = ["ddpo", "dpo", "grpo", "online_dpo", "ppo", "reft", "reft_dpo", "reft_grpo", "reft_reward", "reft_rloo",
               "reward", "rloo", "sft"]


def test_every_recipe_is_one_entry_of_the_table(capsys):
    """``rlcore train`` runs exactly the table's recipes; each entry's Config type maps back to it."""
    assert sorted(RECIPES) == CLI_RECIPES
    for name, recipe in RECIPES.items():
        assert isinstance(recipe, Recipe) and recipe.name == name
        assert by_config(recipe.config) is recipe and dataclasses.is_dataclass(recipe.config), name
        assert callable(recipe.train) and callable(recipe.evaluate) and recipe.doc, name
        assert (ROOT / "configs" / f"{'reft_sft' if name == 'reft' else name}.yaml").exists(), name
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    assert "{" + ",".join(CLI_RECIPES) + "}" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["train", "trpo"])
    assert "invalid choice: 'trpo'" in capsys.readouterr().err


def test_every_recipe_module_has_a_table_entry():
    """Each module of loops/recipes (but the table) trains the table's recipes: one of its own name, or
    (``reft_recipes``) the ReFT recipes beside ``reft``."""
    modules = {p.stem for p in (ROOT / "loops" / "recipes").glob("*.py")} - {"__init__", "table"}
    assert modules == {r.train.__module__.rsplit(".", 1)[-1] for r in RECIPES.values()}
    assert modules - {"reft_recipes"} <= set(RECIPES)


def test_help_lists_every_field_with_its_default_and_doc(capsys):
    with pytest.raises(SystemExit):
        cli.main(["train", "sft", "--help"])
    text = capsys.readouterr().out
    for field in ("--lr", "--steps", "--packing", "--agg", "--max_grad_norm", "--resume"):
        assert field in text
    assert "[default: 0.001]" in text and "rlcore.masked.AGGREGATIONS" in text  # default and doc of a field
    for recipe in RECIPES.values():  # every field of every recipe says what it is
        config, name = recipe.config, recipe.name
        assert set(cli.field_docs(config)) == {f.name for f in dataclasses.fields(config)}, name


def test_unknown_field_is_an_error_listing_the_valid_ones(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("stepz: 3\n")
    with pytest.raises(ValueError, match="stepz"):
        cli.main(["train", "sft", "--config", str(bad)])


@pytest.mark.slow
def test_train_then_eval_from_yaml_and_flags(tmp_path, capsys):
    run = tmp_path / "run"
    args = ["train", "sft", "--config", str(ROOT / "configs" / "sft.yaml"), "--steps", "3", "--run_dir", str(run),
            "--hidden_size", "32", "--num_layers", "1", "--num_train", "32", "--num_eval", "8"]
    assert cli.main(args) == 0
    final = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["final"]
    assert "loss" in final and final["loss"] > 0
    assert cli.main(["eval", "sft", "--checkpoint", str(run)]) == 0
    metrics = json.loads(capsys.readouterr().out)
    assert {"loss", "exact_match"} <= set(metrics) and metrics["loss"] > 0


def test_console_script_lists_recipes():
    exe = Path(sys.executable).with_name("rlcore")
    out = subprocess.run([str(exe), "recipes"], capture_output=True, text=True, check=True).stdout
    assert [line.split()[0] for line in out.strip().splitlines()] == list(RECIPES)


@pytest.mark.slow
def test_a_recipe_runs_under_torchrun_with_two_ranks(tmp_path):
    """The same CLI command under torchrun: two gloo ranks, one checkpoint, one metrics log."""
    from rlcore.loops.dist import free_port

    run = tmp_path / "run"
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
           "-m", "rlcore.loops.cli", "train", "sft", "--config", str(ROOT / "configs" / "sft.yaml"), "--steps", "2",
           "--batch_size", "8", "--run_dir", str(run), "--hidden_size", "32", "--num_layers", "1",
           "--num_train", "32", "--num_eval", "8"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(list(run.glob("checkpoint-*"))) == 1
    lines = (run / "metrics.jsonl").read_text().strip().splitlines()
    assert len(lines) == 2  # rank 0 logs each step once


@pytest.mark.parametrize("recipe,key,hint", [  # (sft, dpo, reward, grpo, rloo, ppo read TRL's names: test_from_trl)
    ("online_dpo", "learning_rate", r"learning_rate: did you mean 'lr' \(TRL's learning_rate\)\?"),
    ("online_dpo", "max_completion_length",
     r"max_completion_length: did you mean 'max_new_tokens' \(TRL's max_completion_length\)\?"),
    ("online_dpo", "max_steps", r"max_steps: did you mean 'steps' \(TRL's max_steps\)\?"),
    ("sft", "stpes", r"stpes: did you mean 'steps'\?"),
])
def test_unknown_keys_answer_did_you_mean(tmp_path, recipe, key, hint):
    path = tmp_path / "trl.yaml"
    path.write_text(f"{key}: 1\n")
    with pytest.raises(ValueError, match=rf"unknown keys \['{key}'\]; {hint}; valid fields of Config"):
        cli.main(["train", recipe, "--config", str(path)])


def test_train_async_from_the_cli(tmp_path, capsys):
    run = tmp_path / "run"
    assert cli.main(["train", "rloo", "--async", "--max_lag", "1", "--steps", "2", "--batch_size", "2",
                     "--num_samples", "2", "--hidden_size", "16", "--num_layers", "1", "--num_heads", "2",
                     "--num_train", "8", "--num_eval", "4", "--max_new_tokens", "4", "--run_dir", str(run)]) == 0
    final = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["final"]
    assert "async/staleness" in final and final["optimizer_steps"] >= 1
    with pytest.raises(TypeError, match=r"config: expected the Config of an online recipe .* got rlcore.loops.recipes.sft.Config"):
        cli.main(["train", "sft", "--async", "--steps", "1", "--run_dir", "null"])


@pytest.mark.parametrize("recipe", ["reft_grpo", "reft_rloo", "reft_dpo", "reft_reward"])
def test_the_reft_recipes_train_and_evaluate_from_the_cli(recipe, tmp_path, capsys):
    """GRPO, RLOO and DPO of ReFT interventions from their YAML: only the interventions train, the
    checkpoint holds them, and eval rebuilds the policy from it."""
    run = tmp_path / "run"
    args = ["train", recipe, "--config", str(ROOT / "configs" / f"{recipe}.yaml"), "--steps", "2",
            "--run_dir", str(run), "--num_train", "16", "--num_eval", "4", "--batch_size", "4", "--eval_every", "2",
            "--variant", "lobireft"]
    assert cli.main(args) == 0
    final = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["final"]
    assert "loss" in final and any(k.startswith("eval/") for k in final)
    stored = sorted(p.name for p in (run / "checkpoint-2" / "models").iterdir())
    assert stored == {"reft_dpo": ["interventions"], "reft_reward": ["interventions", "policy"]}.get(recipe, ["policy"])
    config = json.loads((run / "checkpoint-2" / "config.json").read_text())
    assert config["variant"] == "lobireft" and config["recipe"] == recipe
    assert cli.main(["eval", recipe, "--checkpoint", str(run)]) == 0
    metrics = json.loads(capsys.readouterr().out)
    key = {"reft_dpo": "rewards/accuracies", "reft_reward": "accuracy"}.get(recipe, "reward")
    assert key in metrics


# --- errors of the settings and the data: one line, exit status 2 --------------------------------
@pytest.mark.parametrize("case,message", [
    ("bad_value", r"rlcore train sft: error: Config: lr: expected >= 0, got -1.0"),
    ("unknown_field", r"rlcore train sft: error: .*unknown keys \['stepz'\]; stepz: did you mean 'steps'\?"),
    ("bad_yaml", r"rlcore train sft: error: .*bad.yaml: not valid YAML"),
    ("missing_file", r"rlcore train sft: error: .*No such file or directory: .*absent.yaml"),
    ("bad_row", r"rlcore train sft: error: source: .*rows.jsonl, line 2: not valid JSON"),
])
def test_a_settings_or_data_error_prints_its_message_and_exits_2(tmp_path, capsys, case, message):
    (tmp_path / "bad.yaml").write_text("lr: [1\n")
    (tmp_path / "key.yaml").write_text("stepz: 3\n")
    (tmp_path / "rows.jsonl").write_text('{"prompt": "1+1=", "completion": "2"}\n{"prompt": 3\n')
    given = {"bad_value": ["--lr", "-1"], "unknown_field": ["--config", str(tmp_path / "key.yaml")],
             "bad_yaml": ["--config", str(tmp_path / "bad.yaml")],
             "missing_file": ["--config", str(tmp_path / "absent.yaml")],
             "bad_row": ["--dataset", str(tmp_path / "rows.jsonl")]}[case]
    assert cli.main(["train", "sft", *given, "--run_dir", "null"], report=True) == 2
    err = capsys.readouterr().err
    assert re.search(message, err) and "--traceback or RLCORE_TRACEBACK=1" in err
    assert "Traceback" not in err


def test_traceback_flag_or_variable_raises_the_error(monkeypatch):
    from rlcore.loops.config import ConfigError

    with pytest.raises(ConfigError, match=r"lr: expected >= 0"):
        cli.main(["train", "sft", "--lr", "-1", "--traceback"], report=True)
    monkeypatch.setenv("RLCORE_TRACEBACK", "1")
    with pytest.raises(ConfigError, match=r"lr: expected >= 0"):
        cli.main(["train", "sft", "--lr", "-1"], report=True)
    monkeypatch.delenv("RLCORE_TRACEBACK")
    with pytest.raises(ValueError, match=r"lr: expected >= 0"):  # from Python with an argument list: raised as is
        cli.main(["train", "sft", "--lr", "-1"])


def test_only_faults_before_the_first_step_lose_their_traceback(monkeypatch, capsys):
    """A ValueError before the fold's first step is the settings' or the data's (a message, status 2); once
    the run has started it is the program's, and so is any error of another kind: raised with its traceback."""
    from rlcore.loops.config import ConfigError

    def fails(error, started):  # the sft entry, its train raising error
        def train(config, *, callbacks=()):
            if started:
                for cb in callbacks:
                    cb.on_start(None)
            raise error
        return dataclasses.replace(RECIPES["sft"], train=train)

    monkeypatch.setitem(RECIPES, "sft", fails(ValueError("dataset: row 3: empty completion"), started=False))
    assert cli.main(["train", "sft"], report=True) == 2
    assert "rlcore train sft: error: dataset: row 3: empty completion" in capsys.readouterr().err
    monkeypatch.setitem(RECIPES, "sft", fails(ValueError("a shape bug"), started=True))
    with pytest.raises(ValueError, match="a shape bug"):
        cli.main(["train", "sft"], report=True)
    monkeypatch.setitem(RECIPES, "sft", fails(TypeError("a bug"), started=False))
    with pytest.raises(TypeError, match="a bug"):
        cli.main(["train", "sft"], report=True)
    monkeypatch.setitem(RECIPES, "sft", fails(ConfigError("lr: a late check"), started=True))
    assert cli.main(["train", "sft"], report=True) == 2
    monkeypatch.setitem(RECIPES, "sft", fails(KeyboardInterrupt(), started=False))
    assert cli.main(["train", "sft"], report=True) == 130
    assert "interrupted before the first step: nothing was saved" in capsys.readouterr().err


def test_the_command_prints_a_bad_value_without_a_traceback():
    exe = Path(sys.executable).with_name("rlcore")
    done = subprocess.run([str(exe), "train", "sft", "--lr", "abc"], capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr.startswith("rlcore train sft: error: Config.lr: cannot read 'abc' as <class 'float'>")
    assert "Traceback" not in done.stderr


def test_importing_rlcore_and_listing_recipes_print_no_third_party_warnings():
    exe = Path(sys.executable).with_name("rlcore")
    done = subprocess.run([str(exe), "recipes"], capture_output=True, text=True, check=True)
    assert "torchvision" not in done.stderr and "[transformers]" not in done.stderr, done.stderr


def test_the_warning_filter_drops_only_the_torchvision_fallback_notes():
    import logging

    import rlcore.loops  # noqa: F401  (installs the filter)

    logger = logging.getLogger("transformers.utils.import_utils")

    def passes(message):
        record = logger.makeRecord(logger.name, logging.WARNING, __file__, 0, message, (), None)
        return all(f.filter(record) for f in logger.filters)

    assert not passes("`CLIPImageProcessor` requires torchvision (not installed); falling back to "
                      "`CLIPImageProcessorPil` for backward compatibility.")
    assert passes("Could not import module 'X'")
    assert all(f.filter(logging.LogRecord("transformers.modeling_utils", logging.WARNING, "", 0,
                                          "requires torchvision (not installed); falling back to", (), None))
               for f in logging.getLogger("transformers.modeling_utils").filters)
