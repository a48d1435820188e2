"""TRL's config names as input (loops.trl_config), and docs/from_trl.md's examples run as written (tiny models)."""

import dataclasses
import json
import os
import re
from pathlib import Path

import pytest
import yaml

from rlcore.loops import cli, recipes, trl_config
from rlcore.loops.recipes import dpo, grpo, ppo, reward, rloo, sft
from rlcore.loops.config import load_config

DOC = Path(__file__).resolve().parents[1] / "docs" / "from_trl.md"
TINY = {"model": "tiny-llama", "hidden_size": 16, "num_layers": 1, "num_heads": 2, "steps": 2}


def blocks(kind):
    return re.findall(rf"```{kind}\n(.*?)```", DOC.read_text(), flags=re.DOTALL)


def test_the_grpo_example_runs_with_its_trl_reward_function(tmp_path, monkeypatch):
    python = next(b for b in blocks("python") if "def correct" in b)
    (tmp_path / "my_rewards.py").write_text(python)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "math.jsonl").write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n"
                                                 for i in range(40)))
    grpo_yaml = next(b for b in blocks("yaml") if "grpo" in b)
    (tmp_path / "grpo_math.yaml").write_text(grpo_yaml)
    config = load_config(grpo.Config, tmp_path / "grpo_math.yaml",
                         {**TINY, "max_new_tokens": 4, "num_samples": 2, "num_eval": 4, "run_dir": str(tmp_path / "g")})
    assert config.reward_funcs == ("my_rewards:correct",) and config.kl_coef == 0.04
    state, history = grpo.train(config)
    assert state.step == 2 and "rollout/score" in history[-1]


def test_the_dpo_example_runs_on_conversational_rows(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rows = [{"prompt": [{"role": "user", "content": f"{i}+1?"}],
             "chosen": [{"role": "assistant", "content": str(i + 1)}],
             "rejected": [{"role": "assistant", "content": str(i + 2)}]} for i in range(40)]
    (tmp_path / "prefs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    dpo_yaml = next(b for b in blocks("yaml") if "dpo" in b)
    assert yaml.safe_load(dpo_yaml)["loss_type"] == "sigmoid"
    (tmp_path / "dpo_chat.yaml").write_text(dpo_yaml)
    config = load_config(dpo.Config, tmp_path / "dpo_chat.yaml",
                         {**TINY, "max_length": 64, "max_prompt_length": 32, "batch_size": 4, "micro_batch_size": 2,
                          "num_eval": 4, "run_dir": str(tmp_path / "d")})
    state, history = dpo.train(config)
    assert state.optimizer_steps == 2 and "loss" in history[-1]


# --- every field of TRL 1.16's config classes is accepted with TRL's meaning or refused with the reason ---
transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
RECIPES = {"sft": sft, "dpo": dpo, "reward": reward, "grpo": grpo, "rloo": rloo, "ppo": ppo}
# TRL 1.16 ships no PPOConfig; its fields as the last TRL that had one (trl.experimental.ppo) declared them,
# besides the TrainingArguments it inherits
PPO_FIELDS = (
    "run_name", "dataset_num_proc", "num_mini_batches", "total_episodes", "local_rollout_forward_batch_size",
    "num_sample_generations", "response_length", "stop_token", "stop_token_id", "temperature", "missing_eos_penalty",
    "sft_model_path", "world_size", "num_total_batches", "micro_batch_size", "local_batch_size", "batch_size",
    "local_mini_batch_size", "mini_batch_size", "push_to_hub", "exp_name", "reward_model_path", "model_adapter_name",
    "ref_adapter_name", "num_ppo_epochs", "whiten_rewards", "kl_coef", "kl_estimator", "cliprange", "vf_coef",
    "cliprange_value", "gamma", "lam", "ds3_gather_for_generation", "reward_shaping_enable_length",
    "reward_shaping_enable_repetition", "reward_shaping_enable_eos", "reward_shaping_length_coef",
    "reward_shaping_repetition_coef", "reward_shaping_repetition_ngram", "reward_shaping_eos_bonus",
    "reward_shaping_eos_missing_penalty", "reward_shaping_eos_out_of_range_penalty", "reward_shaping_eos_min_len",
    "reward_shaping_eos_max_len")


def trl_fields(recipe):
    """``{name: TRL's default}`` of the TRL config class of ``recipe``, with ModelConfig's and ScriptArguments'."""
    from trl import ModelConfig, ScriptArguments

    if recipe == "ppo":
        try:
            os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
            from trl.experimental.ppo import PPOConfig
            classes = [PPOConfig]
        except ImportError:
            classes = [transformers.TrainingArguments]
    else:
        classes = [getattr(trl, {"sft": "SFTConfig", "dpo": "DPOConfig", "reward": "RewardConfig",
                                 "grpo": "GRPOConfig", "rloo": "RLOOConfig"}[recipe])]
    out = {}
    for cls in [*classes, ModelConfig, ScriptArguments]:
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else (
                f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
            out.setdefault(f.name, default)
    if recipe == "ppo" and classes == [transformers.TrainingArguments]:
        out.update({name: None for name in PPO_FIELDS if name not in out})
    return out


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_every_trl_field_is_accepted_or_refused_by_name(recipe):
    """Each field of TRL's config class (and ModelConfig / ScriptArguments) is in the recipe's table;
    TRL's default value of it loads (changing only the fields its entry names) or fails naming it."""
    Config = RECIPES[recipe].Config
    table = trl_config.TABLES[recipe]
    fields = trl_fields(recipe)
    assert sorted(set(fields) - set(table)) == []  # a field TRL adds makes this fail until it is classified
    base = load_config(Config, overrides={"run_dir": None})
    for name, default in fields.items():
        entry = table[name]
        if isinstance(entry, trl_config.Refuse):
            with pytest.raises(ValueError, match=rf"{name}: got .*; {re.escape(entry.reason[:30])}"):
                load_config(Config, overrides={"run_dir": None, name: default})
            continue
        if isinstance(entry, trl_config.Default):
            load_config(Config, overrides={"run_dir": None, name: entry.values[0]})
            with pytest.raises(ValueError, match=rf"{name}: got 'something else', accepted only as"):
                load_config(Config, overrides={"run_dir": None, name: "something else"})
            continue
        try:
            config = load_config(Config, overrides={"run_dir": None, name: default})
        except ValueError as e:  # TRL's default itself does not apply here (num_train_epochs alone, max_length None)
            assert name in str(e), (name, str(e))
            continue
        changed = {f.name for f in dataclasses.fields(Config) if getattr(config, f.name) != getattr(base, f.name)}
        allowed = set(entry.to) if isinstance(entry, trl_config.Accept) else set()
        assert changed <= allowed, (name, changed, allowed)


def test_model_and_script_arguments_translate():
    config = load_config(grpo.Config, overrides={
        "model_name_or_path": "tiny-gpt2", "model_revision": "main", "torch_dtype": "bfloat16",
        "dataset_name": "rows.jsonl", "use_peft": True, "lora_r": 4, "lora_target_modules": ["q_proj"],
        "run_dir": None})
    assert (config.model, config.revision, config.dtype, config.dataset, config.lora_r) == \
        ("tiny-gpt2", None, "bfloat16", "rows.jsonl", 4)
    config = load_config(sft.Config, overrides={"dataset_name": "org/data", "dataset_train_split": "tr",
                                                "eval_strategy": "steps", "eval_steps": 7, "run_dir": None})
    assert (config.dataset, config.eval_dataset, config.eval_every) == ("org/data:tr", "org/data:test", 7)


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_eval_strategy_no_holds_nothing_out(recipe, tmp_path):
    """TRL under eval_strategy: no trains on every row: num_eval 0, unless the config says what to hold out."""
    Config = RECIPES[recipe].Config
    (tmp_path / "x.yaml").write_text("eval_strategy: no\n")  # YAML 1.1 reads a bare no as false
    for given in (load_config(Config, tmp_path / "x.yaml", {"run_dir": None}),
                  load_config(Config, overrides={"eval_strategy": "no", "run_dir": None}),
                  load_config(Config, overrides={"evaluation_strategy": "no", "run_dir": None})):
        assert (given.eval_every, given.num_eval, given.eval_dataset) == (0, 0, None)
    kept = load_config(Config, overrides={"eval_strategy": "no", "num_eval": 8, "run_dir": None})
    assert (kept.eval_every, kept.num_eval) == (0, 8)
    kept = load_config(Config, overrides={"eval_strategy": "no", "eval_dataset": "e.jsonl", "run_dir": None})
    assert (kept.num_eval, kept.eval_dataset) == (Config().num_eval, "e.jsonl")
    assert load_config(Config, overrides={"run_dir": None}).num_eval == Config().num_eval  # not given: rlcore's
    with pytest.raises(ValueError, match=r"eval_every: got 5, but TRL's eval_strategy gives eval_every=0"):
        load_config(Config, overrides={"eval_strategy": "no", "eval_every": 5})


@pytest.mark.parametrize("recipe,world,trl,expected", [
    # offline: rows / pairs per optimiser step over all ranks; micro = per device
    ("sft", 1, {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2}, {"batch_size": 8, "micro_batch_size": 4}),
    ("dpo", 2, {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2}, {"batch_size": 16, "micro_batch_size": 4}),
    ("reward", 1, {"per_device_train_batch_size": 3}, {"batch_size": 3, "micro_batch_size": 3}),
    # GRPO counts completions: prompts = completions ÷ num_generations
    ("grpo", 1, {"per_device_train_batch_size": 16, "num_generations": 8},
     {"batch_size": 2, "num_samples": 8, "micro_batch_size": 16, "minibatch_size": None}),
    ("grpo", 2, {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 4, "num_generations": 4},
     {"batch_size": 8, "micro_batch_size": 4, "minibatch_size": None}),
    # a generation batch of 4 optimiser steps: rollout of 64 completions, 16 per optimiser step
    ("grpo", 1, {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 2, "steps_per_generation": 8,
                 "num_generations": 4}, {"batch_size": 16, "minibatch_size": 16, "micro_batch_size": 8}),
    ("rloo", 1, {"per_device_train_batch_size": 8}, {"batch_size": 4, "num_samples": 2}),  # TRL's default 2 generations
    ("ppo", 1, {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 4, "num_mini_batches": 2},
     {"batch_size": 32, "micro_batch_size": 8, "minibatch_size": 16}),
])
def test_batch_sizes_translate_with_accumulation_and_world_size(monkeypatch, recipe, world, trl, expected):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    config = load_config(RECIPES[recipe].Config, overrides={"run_dir": None, **trl})
    assert {k: getattr(config, k) for k in expected} == expected


def test_a_batch_that_splits_a_group_is_refused():
    with pytest.raises(ValueError, match=r"per_device_train_batch_size: TRL's batch counts completions; 6 per device .* "
                                         r"num_generations=4"):
        load_config(grpo.Config, overrides={"per_device_train_batch_size": 6, "num_generations": 4})


def test_steps_schedule_and_warmup_translate():
    config = load_config(sft.Config, overrides={"max_steps": 200, "warmup_ratio": 0.05, "lr_scheduler_type": "cosine",
                                                "logging_steps": 0.1, "save_steps": 50, "num_train_epochs": 3,
                                                "run_dir": None})
    assert (config.steps, config.warmup_steps, config.schedule, config.log_every, config.save_every) == \
        (200, 10, "cosine", 20, 50)
    assert load_config(sft.Config, overrides={"max_steps": 100, "warmup_steps": 0.1}).warmup_steps == 10
    assert load_config(sft.Config, overrides={"lr_scheduler_type": "constant_with_warmup"}).schedule == "constant"
    with pytest.raises(ValueError, match=r"lr_scheduler_type: expected one of .*got 'polynomial'"):
        load_config(sft.Config, overrides={"lr_scheduler_type": "polynomial"})
    with pytest.raises(ValueError, match=r"num_train_epochs: got 3 without max_steps; rlcore counts steps"):
        load_config(sft.Config, overrides={"num_train_epochs": 3})
    for steps in (0, -1):  # TRL's "the epochs decide" with no epochs given ran rlcore's default 100 steps
        with pytest.raises(ValueError, match=rf"max_steps: got {steps}; rlcore counts steps"):
            load_config(sft.Config, overrides={"max_steps": steps})
    with pytest.raises(ValueError, match=r"num_train_epochs: got 3 without max_steps"):  # -1 hands over to epochs
        load_config(sft.Config, overrides={"max_steps": -1, "num_train_epochs": 3})


def test_a_local_dataset_name_has_no_splits(tmp_path):
    """A local file named by dataset_name with eval_strategy: steps became eval_dataset 'FILE:test',
    which named no file."""
    data = tmp_path / "chat.jsonl"
    data.write_text('{"prompt": "a"}\n')
    config = load_config(sft.Config, overrides={"dataset_name": str(data), "eval_strategy": "steps", "eval_steps": 2})
    assert (config.dataset, config.eval_dataset, config.eval_every) == (str(data), None, 2)
    with pytest.raises(ValueError, match=r"dataset_test_split: .*chat.jsonl is a local file, which has no splits"):
        load_config(sft.Config, overrides={"dataset_name": str(data), "dataset_test_split": "validation"})


@pytest.mark.parametrize("value,scale", [("group", "group"), ("batch", "batch"), ("none", "none"), (True, "group"),
                                         (False, "none")])
def test_scale_rewards_is_the_grpo_advantage_scale(value, scale):
    assert load_config(grpo.Config, overrides={"scale_rewards": value}).advantage_kwargs == {"scale": scale}


def test_scale_rewards_keeps_other_advantage_keywords_and_refuses_a_different_scale():
    config = load_config(grpo.Config, overrides={"scale_rewards": "batch", "advantage_kwargs": {"eps": 1e-4}})
    assert config.advantage_kwargs == {"eps": 1e-4, "scale": "batch"}
    with pytest.raises(ValueError, match=r"scale_rewards: got 'batch' but advantage_kwargs.scale is 'group'"):
        load_config(grpo.Config, overrides={"scale_rewards": "batch", "advantage_kwargs": {"scale": "group"}})


def test_beta_and_max_completion_length_per_recipe():
    assert load_config(grpo.Config, overrides={"beta": 0.04}).kl_coef == 0.04
    assert load_config(rloo.Config, overrides={"beta": 0.1}).kl_coef == 0.1
    assert load_config(dpo.Config, overrides={"beta": 0.3}).beta == 0.3
    assert load_config(grpo.Config, overrides={"max_completion_length": 12}).max_new_tokens == 12
    assert load_config(rloo.Config, overrides={"max_completion_length": 12}).max_new_tokens == 12
    assert load_config(ppo.Config, overrides={"response_length": 12}).max_new_tokens == 12
    with pytest.raises(ValueError, match=r"max_completion_length: got 12; not a DPOConfig field of TRL 1.x; .*max_length"):
        load_config(dpo.Config, overrides={"max_completion_length": 12})


def test_loss_names_translate():
    config = load_config(grpo.Config, overrides={"loss_type": "sapo", "sapo_temperature_neg": 1.2, "epsilon": 0.1,
                                                 "epsilon_high": 0.28, "importance_sampling_level": "sequence"})
    loss = grpo.grpo_loss_fn(config)
    assert (loss.keywords["clip_eps_low"], loss.keywords["clip_eps_high"], loss.keywords["sapo_temperature_neg"]) == \
        (0.1, 0.28, 1.2)
    assert grpo.ratio_level(config) == "sequence"
    assert load_config(ppo.Config, overrides={"cliprange": 0.1, "kl_estimator": "k3"}).kl == "k3"
    config = load_config(dpo.Config, overrides={"loss_type": ["ipo"], "label_smoothing": 0.0})
    assert (config.loss_type, config.loss_kwargs) == ("ipo", {})
    with pytest.raises(ValueError, match=r"loss_type: got \['sigmoid', 'sft'\]; rlcore's DPO trains one loss"):
        load_config(dpo.Config, overrides={"loss_type": ["sigmoid", "sft"]})
    with pytest.raises(ValueError, match=r"importance_sampling_level: expected one of"):
        load_config(grpo.Config, overrides={"importance_sampling_level": "seq"})


def test_a_trl_name_and_its_rlcore_field_with_different_values_are_an_error():
    with pytest.raises(ValueError, match=r"lr: got 0.0001, but TRL's learning_rate gives lr=1e-05; give one"):
        load_config(grpo.Config, overrides={"learning_rate": 1e-5, "lr": 1e-4})
    with pytest.raises(ValueError, match=r"kl_coef: got 0.1, but TRL's beta gives kl_coef=0.04"):
        load_config(grpo.Config, overrides={"beta": 0.04, "kl_coef": 0.1})
    assert load_config(grpo.Config, overrides={"beta": 0.04, "kl_coef": "0.04"}).kl_coef == 0.04  # the same value


def test_refused_names_say_why():
    with pytest.raises(ValueError, match=r"push_to_hub: got True, .*pushes nothing"):
        load_config(sft.Config, overrides={"push_to_hub": True})
    with pytest.raises(ValueError, match=r"dataloader_num_workers: got 4, .*no worker processes"):
        load_config(sft.Config, overrides={"dataloader_num_workers": 4})
    with pytest.raises(ValueError, match=r"deepspeed: got 'ds.json', .*torchrun"):
        load_config(grpo.Config, overrides={"deepspeed": "ds.json"})


def test_cli_flags_take_trl_names_and_help_lists_them(capsys):
    args = cli.build_parser(["train", "grpo"]).parse_args(
        ["train", "grpo", "--learning_rate", "1e-5", "--per_device_train_batch_size", "4", "--num_generations", "2"])
    config = cli._config(recipes.RECIPES["grpo"], args)
    assert (config.lr, config.batch_size, config.num_samples) == (1e-5, 2, 2)
    with pytest.raises(SystemExit):
        cli.build_parser(["train", "grpo"]).parse_args(["train", "grpo", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "AdamW peak learning rate [>= 0] (TRL: learning_rate)" in text  # help and range from the declaration
    assert "--per_device_train_batch_size VALUE → batch_size" in text


def test_the_doc_lists_every_name_as_the_table_does():
    assert trl_config.markdown_table() in DOC.read_text()


TRL_GRPO_YAML = """\
model_name_or_path: {model}
dataset_name: {data}
output_dir: {out}
learning_rate: 1.0e-5
lr_scheduler_type: cosine
warmup_ratio: 0.1
per_device_train_batch_size: 4
gradient_accumulation_steps: 1
num_generations: 2
max_completion_length: 4
max_steps: 2
beta: 0.04
scale_rewards: batch
loss_type: dapo
bf16: false
gradient_checkpointing: true
use_peft: true
lora_r: 4
lora_alpha: 8
lora_target_modules: [q_proj, v_proj]
report_to: none
logging_steps: 1
save_steps: 2
save_total_limit: 1
seed: 42
do_train: true
"""


def test_a_trl_grpo_yaml_runs_end_to_end_on_a_local_model_folder(tmp_path, monkeypatch):
    from rlcore.loops.models import build_model, build_tokenizer

    monkeypatch.chdir(tmp_path)
    tokenizer = build_tokenizer()
    build_model("llama", tokenizer=tokenizer, hidden_size=16, num_layers=1, num_heads=2).save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n"
                                                 for i in range(24)))
    (tmp_path / "my_rewards.py").write_text("def correct(completions, answer, **kwargs):\n"
                                            "    return [float(c.strip() == a) for c, a in zip(completions, answer)]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "x.yaml").write_text(TRL_GRPO_YAML.format(model=tmp_path / "m", data="rows.jsonl", out=tmp_path / "run"))
    args = ["train", "grpo", "--config", str(tmp_path / "x.yaml"), "--reward_funcs", "my_rewards:correct",
            "--num_eval", "4"]
    config = cli._config(recipes.RECIPES["grpo"], cli.build_parser(args).parse_args(args))
    assert (config.batch_size, config.num_samples, config.kl_coef, config.warmup_steps, config.schedule) == \
        (2, 2, 0.04, 1, "cosine")
    assert config.use_peft and config.gradient_checkpointing and config.advantage_kwargs == {"scale": "batch"}
    assert cli.main(args) == 0
    assert (tmp_path / "run" / "metrics.jsonl").exists()


# --- rlcore's defaults where TRL's differ (loops.trl_defaults) ---------------------------------------
def _trl_class(recipe):
    import importlib

    from rlcore.loops.trl_defaults import TRL_CONFIGS

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    module, _, name = TRL_CONFIGS[recipe].partition(":")
    return getattr(importlib.import_module(module), name)


def test_the_defaults_table_matches_the_installed_trl():
    """Each TRL default of the table is the one TRL's dataclass declares, and each names an rlcore field
    whose default differs from it (so the table can neither rot nor list a default that agrees)."""
    from rlcore.loops.trl_defaults import TRL_CONFIGS, TRL_DEFAULTS

    assert set(TRL_DEFAULTS) == set(TRL_CONFIGS)
    for recipe, entries in TRL_DEFAULTS.items():
        declared = {f.name: f for f in dataclasses.fields(_trl_class(recipe))}
        Config = recipes.RECIPES[recipe].config
        ours = {f.name: f.default for f in dataclasses.fields(Config)}
        for field, entry in entries.items():
            trl_field = declared[entry.trl_name]
            assert trl_field.default == entry.trl_default, (recipe, field, trl_field.default, entry.trl_default)
            assert field in ours, (recipe, field)
            # values in the same units differ (batch_size counts prompts where TRL's counts completions
            # per device; None is TRL's "decided later": bf16, save_total_limit)
            if entry.trl_default is not None and field != "batch_size":
                assert ours[field] != entry.trl_default, (recipe, field)


def test_a_run_on_a_real_model_lists_the_defaults_that_differ(capsys):
    from rlcore.loops.trl_defaults import differing_defaults, report_defaults

    assert report_defaults(sft.Config()) == ""  # a built-in tiny model: its own defaults, said nowhere
    block = report_defaults(sft.Config(model="path/to/Qwen2.5-0.5B", lr=2e-5, schedule="linear"))
    assert block == capsys.readouterr().err and "differ from TRL's SFTConfig" in block
    assert "max_length = 64" in block and "TRL max_length=1024" in block
    assert "lr =" not in block and "schedule =" not in block  # set by the caller: not listed
    grpo_block = report_defaults(grpo.Config(model="Qwen/Qwen2.5-0.5B"))
    for line in ("lr = 1e-05", "TRL learning_rate=1e-06", "loss_type = 'grpo'", "TRL loss_type='dapo'",
                 "schedule = 'constant'", "TRL lr_scheduler_type='linear'"):
        assert line in grpo_block, line
    assert differing_defaults(ppo.Config(model="m")) == {}  # TRL 1.x has no PPOConfig
