"""Config values are checked when the config is read (CLI, YAML) and before any model is built or
step taken (Python): every error names the field, the value seen and what is allowed."""

import dataclasses

import pytest

from rlcore.loops import cli

from rlcore.loops.recipes import dpo, grpo, ppo, sft
from rlcore.loops.recipes import RECIPES
from rlcore.loops.config import KEYWORD_RULES, check_config, load_config


@pytest.mark.parametrize("recipe,flag,value,message", [
    ("grpo", "steps", "-3", r"steps: expected >= 0, got -3"),
    ("grpo", "batch_size", "0", r"batch_size: expected >= 1, got 0"),
    ("grpo", "kl_coef", "-5", r"kl_coef: expected >= 0, got -5.0"),
    ("grpo", "top_p", "1.5", r"top_p: expected in \(0, 1\], got 1.5"),
    ("grpo", "temperature", "0", r"temperature: expected > 0, got 0.0"),
    ("grpo", "lr", "nan", r"lr: expected >= 0, got nan"),
    ("dpo", "beta", "0", r"beta: expected > 0, got 0.0"),
    ("dpo", "beta", "-1", r"beta: expected > 0, got -1.0"),
    ("sft", "keep_last", "-1", r"keep_last: expected >= 1, got -1"),
    ("ppo", "lam", "1.5", r"lam: expected in \[0, 1\], got 1.5"),
    ("grpo", "engine", "fast", r"engine: expected one of \['hf', 'loop', 'vllm'\], got 'fast'"),
    ("rloo", "sampler", "top", r"sampler: expected one of \['gumbel', 'inverse_cdf', 'multinomial'\], got 'top'"),
    ("grpo", "engine_options", "{max_model_len: 64}", r"engine_options: only for engine='vllm', got engine='loop'"),
])
def test_the_cli_refuses_out_of_range_values_before_building_anything(recipe, flag, value, message, capsys):
    with pytest.raises(ValueError, match=message):
        cli.main(["train", recipe, f"--{flag}", value, "--run_dir", "null"])


def test_every_fault_is_named_at_once_and_none_is_allowed():
    with pytest.raises(ValueError, match=r"Config: batch_size: expected >= 1, got 0; "
                                         r"max_new_tokens: expected >= 1, got 0"):
        check_config(grpo.Config(batch_size=0, max_new_tokens=0))
    config = grpo.Config(top_k=None, top_p=None, minibatch_size=None, keep_last=None)
    assert check_config(config) is config


def test_python_api_fails_before_a_model_is_built(monkeypatch):
    from rlcore.loops import recipe
    built = []
    monkeypatch.setattr(recipe, "build_model", lambda *a, **k: built.append(1))
    with pytest.raises(ValueError, match=r"num_samples: expected >= 1, got 0"):
        grpo.train(grpo.Config(num_samples=0, run_dir=None))
    with pytest.raises(ValueError, match=r"steps: expected >= 0, got -1"):
        sft.train(sft.Config(steps=-1, run_dir=None))
    assert built == []


def test_every_recipe_default_passes_and_every_keyword_rule_names_a_real_keyword():
    import inspect

    from rlcore.algorithms.preference import PREFERENCE_LOSSES
    from rlcore.baselines import ADVANTAGE_ESTIMATORS

    fields = set()
    for name in RECIPES:
        config_cls = RECIPES[name].config
        check_config(config_cls())
        fields |= {f.name for f in dataclasses.fields(config_cls)}
    keywords = {p for fn in [*PREFERENCE_LOSSES.values(), *ADVANTAGE_ESTIMATORS.values()]
                for p in inspect.signature(fn).parameters}  # loss_kwargs / advantage_kwargs entries
    assert set(KEYWORD_RULES) <= keywords, sorted(set(KEYWORD_RULES) - keywords)


def test_the_rules_reach_the_keywords_of_a_loss_or_an_estimator():
    with pytest.raises(ValueError, match=r"loss_kwargs.label_smoothing: expected in \[0, 0.5\] \(past 0.5 .*\), got 1.5; "
                                         r"loss_kwargs.rpo_alpha: expected >= 0, got -1"):
        check_config(dpo.Config(loss_kwargs={"label_smoothing": 1.5, "rpo_alpha": -1}))
    with pytest.raises(ValueError, match=r"advantage_kwargs.eps: expected >= 0, got -0.5"):
        check_config(grpo.Config(advantage_kwargs={"eps": -0.5}))
    with pytest.raises(ValueError, match=r"loss_kwargs.label_smoothing: expected in \[0, 0.5\]"):
        check_config(dpo.Config(loss_kwargs={"label_smoothing": 0.7}))  # the cDPO losses refuse it too
    assert check_config(dpo.Config(loss_kwargs={"label_smoothing": 0.1})).loss_kwargs == {"label_smoothing": 0.1}


@pytest.mark.parametrize("text", ["- steps: 3\n- lr: 0.1\n", "3\n", "just a string\n"])
def test_a_yaml_file_must_be_a_mapping(tmp_path, text):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=r"bad.yaml: expected a mapping of field: value, got (list|int|str)"):
        load_config(dpo.Config, path)


# --- bounded YAML ------------------------------------------------------------------------------------
def _alias_bomb(levels: int = 9) -> str:
    """About 1 KB of YAML that stands for 10**levels values: nested anchors under loss_kwargs."""
    lines = ["loss_kwargs:", "  a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"  a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def test_a_yaml_alias_bomb_is_refused_at_once(tmp_path):
    import time

    path = tmp_path / "bomb.yaml"
    path.write_text(_alias_bomb())
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"bomb.yaml: more than 10000 values once aliases are expanded"):
        load_config(dpo.Config, path)
    with pytest.raises(ValueError, match=r"bomb.yaml: more than 10000 values once aliases are expanded"):
        cli.main(["train", "dpo", "--config", str(path), "--run_dir", "null"])
    with pytest.raises(ValueError, match=r"--loss_kwargs: more than 10000 values once aliases are expanded"):
        cli.main(["train", "dpo", "--loss_kwargs", "{" + _alias_bomb().split("\n", 1)[1].replace("\n", ", ") + "}",
                  "--run_dir", "null"])
    assert time.perf_counter() - start < 5


@pytest.mark.parametrize("text,message", [
    ("loss_kwargs: " + "[" * 40 + "]" * 40 + "\n", r"nested deeper than 32 levels"),
    ("a: &a [1]\n" + "".join(f"a{i}: &a{i} [*a{i - 1 if i else ''}]\n" for i in range(40)),
     r"nested deeper than 32 levels once aliases are expanded"),
    ("loss_kwargs: &a {x: *a}\n", r"an alias refers to a value that contains it \(a cycle\)"),
    ("x: &x 1\n" + "".join(f"k{i}: *x\n" for i in range(101)), r"more than 100 alias uses"),
    ("lr: [1, 2\n", r"not valid YAML"),
])
def test_yaml_past_its_bounds_is_refused_naming_the_file(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=r"bad.yaml: " + message):
        load_config(dpo.Config, path)


def test_yaml_size_and_encoding_are_bounded(tmp_path):
    from rlcore.loops.config import YAML_MAX_BYTES

    big = tmp_path / "big.yaml"
    big.write_text("# " + "x" * YAML_MAX_BYTES + "\n")
    with pytest.raises(ValueError, match=rf"big.yaml: a config file of more than {YAML_MAX_BYTES} bytes"):
        load_config(dpo.Config, big)
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"lr: \xff\xfe\n")
    with pytest.raises(ValueError, match=r"binary.yaml: not UTF-8 text"):
        load_config(dpo.Config, binary)


def test_a_few_aliases_still_load(tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text("lr: &lr 0.002\nsteps: &n 3\nloss_kwargs: &kw {label_smoothing: 0.1}\nsave_every: *n\n")
    config = load_config(dpo.Config, path)
    assert (config.lr, config.steps, config.save_every, config.loss_kwargs) == (0.002, 3, 3, {"label_smoothing": 0.1})


@pytest.mark.parametrize("text,kind", [("- steps: 3\n- lr: 0.1\n", "list"), ("3\n", "int"), ("just a string\n", "str")])
def test_the_cli_refuses_a_yaml_config_that_is_not_a_mapping(tmp_path, text, kind):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=rf"bad.yaml: expected a mapping of field: value, got {kind}"):
        cli.main(["train", "sft", "--config", str(path), "--run_dir", "null"])


def test_every_shipped_yaml_config_loads():
    from pathlib import Path

    from rlcore.loops.config import read_config_file

    configs = sorted((Path(__file__).parents[2] / "configs").glob("*.yaml"))
    assert configs
    for path in configs:
        assert isinstance(read_config_file(path), dict), path


# --- types, loss_kwargs / advantage_kwargs against the signature -----------------------------------------
@pytest.mark.parametrize("recipe,kwargs,message", [
    ("dpo", {"loss_kwargs": {"label_smoothing": "abc"}}, r"loss_kwargs.label_smoothing: expected float, got 'abc'"),
    ("dpo", {"loss_kwargs": {"rpo_alpha": True}}, r"loss_kwargs.rpo_alpha: expected float \| None, got True"),
    ("dpo", {"loss_kwargs": {"reference_free": "yes"}}, r"loss_kwargs.reference_free: expected bool, got 'yes'"),
    ("dpo", {"loss_kwargs": {"gamma": 1.0}}, r"loss_kwargs: 'sigmoid' takes no \['gamma'\]"),
    ("dpo", {"loss_type": "simpo", "loss_kwargs": {"gamma": [1, 2]}}, r"loss_kwargs.gamma: expected float, got \[1, 2\]"),
    ("online_dpo", {"loss_kwargs": {"label_smoothing": "0.1"}},
     r"loss_kwargs.label_smoothing: expected float, got '0.1'"),
    ("grpo", {"advantage_kwargs": {"eps": "small"}}, r"advantage_kwargs.eps: expected float, got 'small'"),
    ("rloo", {"advantage": "reinforce_pp", "advantage_kwargs": {"group_baseline": 1}},
     r"advantage_kwargs.group_baseline: expected bool, got 1"),
])
def test_loss_and_estimator_keywords_are_type_checked_at_load(recipe, kwargs, message):
    with pytest.raises(ValueError, match=message):
        load_config(RECIPES[recipe].config, None, kwargs)


def test_a_wrong_type_inside_loss_kwargs_fails_before_any_model_is_built(monkeypatch):
    from rlcore.loops import recipe
    built = []
    monkeypatch.setattr(recipe, "build_model", lambda *a, **k: built.append(1))
    with pytest.raises(ValueError, match=r"loss_kwargs.label_smoothing: expected float, got 'abc'"):
        cli.main(["train", "dpo", "--loss_kwargs", "{label_smoothing: abc}", "--run_dir", "null"])
    with pytest.raises(ValueError, match=r"loss_kwargs.label_smoothing: expected float, got 'abc'"):
        dpo.train(dpo.Config(loss_kwargs={"label_smoothing": "abc"}, run_dir=None))
    assert built == []


def test_fields_set_in_python_are_type_checked():
    with pytest.raises(ValueError, match=r"lr: expected float, got '1e-3'"):
        check_config(sft.Config(lr="1e-3"))
    with pytest.raises(ValueError, match=r"report_to: expected tuple\[str, \.\.\.\], got 5"):
        check_config(sft.Config(report_to=5))  # (one name, "wandb", is a one-item tuple: coerce_tuples)
    assert check_config(sft.Config(lr=1, report_to=[])).lr == 1  # an int is a float, a list a tuple


# --- devices -------------------------------------------------------------------------------------------
def test_devices_are_checked_against_this_machine():
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"device: got 'cuda', but this torch build .* sees no CUDA device"):
            cli.main(["train", "sft", "--device", "cuda", "--run_dir", "null"])
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(ValueError, match=rf"ref_device: got 'cuda:{count}'"):
        check_config(grpo.Config(ref_device=f"cuda:{count}"))
    with pytest.raises(ValueError, match=r"device: got 'meta', which holds shapes but no data"):
        cli.main(["train", "sft", "--device", "meta", "--run_dir", "null"])
    with pytest.raises(ValueError, match=r"reward_device: expected 'cpu' or 'cuda\[:N\]', got 'ipu'"):
        check_config(grpo.Config(reward_device="ipu"))
    with pytest.raises(ValueError, match=r"device: expected a device such as 'cpu', 'cuda' or 'cuda:1', got 'gpu'"):
        check_config(sft.Config(device="gpu"))


# --- integers and floats -------------------------------------------------------------------------------
@pytest.mark.parametrize("recipe,flag,value,message", [
    ("sft", "seed", str(2**70), r"seed: expected an integer within int64 \[-2\*\*63, 2\*\*63\), got 1180591620717411303424"),
    ("sft", "seed", "-1", r"seed: expected in \[0, 2\*\*63\), got -1"),
    ("sft", "steps", str(2**64), r"steps: expected an integer within int64"),
    ("grpo", "stop_token_ids", f"1,{2**64}", r"stop_token_ids: expected an integer within int64"),
    ("ppo", "target_kl", "nan", r"target_kl: expected a finite number, got nan"),
    ("grpo", "reward_weights", "1.0,inf", r"reward_weights: expected a finite number, got inf"),
    ("dpo", "loss_kwargs", "{alpha: .nan}", r"loss_kwargs.alpha: expected a finite number, got nan"),
])
def test_numbers_out_of_range_are_refused_naming_the_field(recipe, flag, value, message):
    with pytest.raises(ValueError, match=message):
        cli.main(["train", recipe, f"--{flag}", value, "--run_dir", "null"])


# --- combinations a recipe cannot run --------------------------------------------------------------------
@pytest.mark.parametrize("recipe,estimator,missing", [
    ("grpo", "remax", r"baseline_score \[B\]"),
    ("grpo", "gae", r"values \[B, R\]"),
    ("grpo", "reinforce_pp", r"rewards \[B, R\]"),
    ("rloo", "remax", r"baseline_score \[B\]"),
    ("rloo", "gae", r"values \[B, R\]"),
])
def test_an_estimator_without_its_inputs_is_refused_at_load(recipe, estimator, missing):
    with pytest.raises(ValueError, match=rf"advantage: the {recipe} recipe cannot run '{estimator}': it reads .*"
                                         rf"{missing}.*which the {recipe} recipe's rollout does not hold; choose one of"):
        cli.main(["train", recipe, "--advantage", estimator, "--num_samples", "2", "--run_dir", "null"])


def test_the_estimator_table_matches_what_each_estimator_reads():
    """Each recipe's learner batch (its table entry's ``advantage_inputs``) feeds exactly the estimators
    ``runnable_estimators`` names: the others fail on that batch for a key it lacks."""
    import torch
    from tensordict import TensorDict

    from rlcore import keys as K
    from rlcore.baselines import ADVANTAGE_ESTIMATORS
    from rlcore.loops.online import runnable_estimators

    values = {K.SCORE: torch.tensor([1.0, 0.0, 2.0, 1.0]), K.RESPONSE_MASK: torch.ones(4, 3, dtype=torch.bool),
              K.REWARDS: torch.rand(4, 3), K.VALUES: torch.rand(4, 3), K.BASELINE_SCORE: torch.rand(4)}
    for recipe in (RECIPES["grpo"], RECIPES["rloo"]):
        held = recipe.advantage_inputs
        batch = TensorDict({k: values[k] for k in held} | {K.GROUP_ID: torch.tensor([0, 0, 1, 1])}, batch_size=[4])
        runnable = runnable_estimators(held)
        for name, estimator in ADVANTAGE_ESTIMATORS.items():
            if name in runnable:
                assert K.ADVANTAGES in estimator(batch).keys(), (recipe.name, name)
            else:
                with pytest.raises(KeyError, match="missing"):
                    estimator(batch)


@pytest.mark.parametrize("recipe,kwargs,message", [
    ("grpo", {"kl": "bogus", "kl_coef": 0.1}, r"kl: expected one of \['k1', .*\], got 'bogus'"),
    ("rloo", {"kl": "full"}, r"kl: expected one of .*got 'full' \('full' needs the vocabulary-wide KL, which only "
                             r"the PPO recipe computes\)"),
    ("grpo", {"advantage_kwargs": {"group_size": 3}, "num_samples": 2},
     r"advantage_kwargs.group_size: the rollout's groups are its prompts' samples"),
    ("rloo", {"advantage_kwargs": {"group_size": 2}}, r"advantage_kwargs.group_size"),
    ("grpo", {"num_samples": 1}, r"num_samples: the 'grpo' advantage compares the samples of one prompt, so GRPO "
                                 r"needs at least 2"),
])
def test_other_combinations_an_online_recipe_cannot_run_are_refused_at_load(recipe, kwargs, message):
    with pytest.raises(ValueError, match=message):
        load_config(RECIPES[recipe].config, None, kwargs)


@pytest.mark.parametrize("recipe", ["sft", "dpo", "reward", "grpo", "ppo", "reft"])
def test_num_eval_0_with_evaluation_is_refused_at_load(recipe):
    """num_eval 0 holds nothing out: evaluation every eval_every steps has nothing to run on."""
    cls = RECIPES[recipe].config
    with pytest.raises(ValueError, match=r"eval_every: got 5, but num_eval is 0 and no eval_dataset is given"):
        load_config(cls, None, {"num_eval": 0, "eval_every": 5})
    assert load_config(cls, None, {"num_eval": 0}).num_eval == 0  # no evaluation: fine
    assert load_config(cls, None, {"num_eval": 0, "eval_every": 5, "eval_dataset": "held_out.jsonl"}).eval_every == 5


@pytest.mark.parametrize("make,field,value", [
    (lambda **kw: sft.Config(**kw), "lora_target_modules", "all-linear"),
    (lambda **kw: sft.Config(**kw), "lora_modules_to_save", "lm_head"),
    (lambda **kw: sft.Config(**kw), "report_to", "tensorboard"),
    (lambda **kw: grpo.Config(**kw), "reward_funcs", "my_rewards:correct"),
    (lambda **kw: grpo.Config(**kw), "lora_target_modules", "q_proj"),
])
def test_one_name_given_to_a_tuple_of_names_is_a_one_item_tuple(make, field, value):
    """From Python, a string where a tuple of strings is expected is one name, not its letters."""
    config = make(**{field: value})
    assert getattr(config, field) == (value,)
    assert check_config(config) is config
    assert getattr(dataclasses.replace(config, seed=1), field) == (value,)
    assert getattr(make(**{field: [value, "x"]}), field) == (value, "x")  # a list is a tuple


def test_one_prompt_given_to_ddpo_is_one_prompt():
    from rlcore.loops.recipes import ddpo

    assert ddpo.Config(prompts="a cat", lora_target_modules="to_q").prompts == ("a cat",)
    assert ddpo.Config(lora_target_modules="to_q").lora_target_modules == ("to_q",)


def test_a_string_where_numbers_are_expected_is_still_refused():
    with pytest.raises(ValueError, match=r"stop_token_ids: expected tuple\[int, \.\.\.\], got '2'"):
        check_config(grpo.Config(stop_token_ids="2"))


def test_config_errors_are_value_errors_of_their_own_class(tmp_path):
    from rlcore.loops.config import ConfigError

    assert issubclass(ConfigError, ValueError)
    with pytest.raises(ConfigError, match=r"lr: expected >= 0"):
        check_config(sft.Config(lr=-1.0))
    with pytest.raises(ConfigError, match=r"unknown keys \['stepz'\]"):
        load_config(sft.Config, overrides={"stepz": 1})
    (tmp_path / "bad.yaml").write_text("lr: [1\n")
    with pytest.raises(ConfigError, match=r"not valid YAML"):
        load_config(sft.Config, tmp_path / "bad.yaml")
    with pytest.raises(ConfigError, match=r"cannot read 'abc'"):
        load_config(sft.Config, overrides={"lr": "abc"})


@pytest.mark.parametrize("recipe,flags,message", [
    ("dpo", ["--loss_type", "sppo_hard", "--beta", "1e-310"], r"beta: expected >= 1e-12 \(it is divided by"),
    ("online_dpo", ["--loss_type", "ipo", "--beta", "1e-310"], r"beta: expected >= 1e-12"),
    ("grpo", ["--temperature", "1e-310"], r"temperature: expected >= 1e-12"),
    ("grpo", ["--loss_type", "sapo", "--sapo_temperature_pos", "1e-310"], r"sapo_temperature_pos: expected >= 1e-12"),
    ("grpo", ["--loss_type", "sapo", "--sapo_temperature_neg", "-1"], r"sapo_temperature_neg: expected > 0"),
    ("ppo", ["--horizon", "1e-310"], r"horizon: expected >= 1e-12"),
])
def test_a_denormal_divisor_is_refused_at_load(recipe, flags, message):
    """β = 1e-310 passed "> 0": every step's loss was NaN and silently skipped."""
    with pytest.raises(ValueError, match=message):
        cli.main(["train", recipe, *flags, "--run_dir", "null"])


@pytest.mark.parametrize("recipe,flags,message", [
    ("dpo", ["--loss_type", "robust", "--loss_kwargs", "{label_smoothing: 0.5}"],
     r"Config: loss_kwargs.label_smoothing: robust needs 0 <= ε < 0.5, got 0.5"),
    ("online_dpo", ["--loss_type", "robust", "--loss_kwargs", "{label_smoothing: 0.5}"],
     r"Config: loss_kwargs.label_smoothing: robust needs 0 <= ε < 0.5, got 0.5"),
])
def test_the_bound_loss_checks_its_settings_at_load(recipe, flags, message, monkeypatch):
    """``robust`` with ε = 0.5 passed KEYWORD_RULES ([0, 0.5]) and failed at the first step, models built."""
    from rlcore.loops import recipe as recipe_lib
    built = []
    monkeypatch.setattr(recipe_lib, "build_policy", lambda *a, **k: built.append(1))
    with pytest.raises(ValueError, match=message):
        cli.main(["train", recipe, *flags, "--run_dir", "null"])
    assert built == []


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_every_default_config_passes_its_loss_trial(name):
    config = RECIPES[name].config()
    assert check_config(config) is config


def test_every_loss_of_the_registries_passes_the_trial_with_its_defaults():
    from rlcore.algorithms.policy_gradient import POLICY_LOSSES
    from rlcore.algorithms.preference import PREFERENCE_LOSSES
    for loss_type in PREFERENCE_LOSSES:
        check_config(dpo.Config(loss_type=loss_type))
    for loss_type in POLICY_LOSSES:
        check_config(grpo.Config(loss_type=loss_type, kl_coef=0.1))


# --- a run checks its config once ---------------------------------------------------------------
_TINY_FLAGS = dict(hidden_size=16, num_layers=1, num_heads=2, max_new_tokens=4, batch_size=2, num_samples=2,
                   num_train=8, num_eval=4, steps=1, log_every=0)


@pytest.fixture
def check_calls(monkeypatch):
    """Every call of ``check_config`` (wrapped, still checking), as the list of configs it was given."""
    from rlcore.loops import config as config_lib
    calls, original = [], config_lib.check_config

    def counted(config):
        calls.append(config)
        return original(config)

    monkeypatch.setattr(config_lib, "check_config", counted)
    return calls


@pytest.mark.parametrize("extra", [[], ["--async", "--max_lag", "1"]], ids=["sync", "async"])
def test_the_cli_train_path_checks_its_config_once(extra, check_calls, tmp_path):
    flags = [part for k, v in _TINY_FLAGS.items() for part in (f"--{k}", str(v))]
    assert cli.main(["train", "grpo", *flags, *extra, "--run_dir", str(tmp_path / "run")]) == 0
    assert len(check_calls) == 1


def test_load_config_then_train_checks_once(check_calls):
    config = load_config(grpo.Config, None, {**_TINY_FLAGS, "run_dir": None})
    grpo.train(config)
    assert len(check_calls) == 1 and check_calls[0] is config


@pytest.mark.parametrize("module, extra", [(grpo, {}), (ppo, {"value_model": "separate"}), (dpo, {}), (sft, {})],
                         ids=["grpo", "ppo", "dpo", "sft"])
def test_a_config_built_in_python_is_checked_once_by_train(module, extra, check_calls):
    """The policy, the reference and a separate critic are each built from the config: still one check."""
    fields = {k: v for k, v in _TINY_FLAGS.items() if k in {f.name for f in dataclasses.fields(module.Config)}}
    config = module.Config(**fields, **extra, run_dir=None)
    module.train(config)
    assert check_calls == [config]


def test_the_async_path_checks_its_config_once(check_calls):
    from rlcore.loops.scale.async_rl import train_async

    config = grpo.Config(**_TINY_FLAGS, run_dir=None)
    train_async(config, max_lag=1)
    assert check_calls == [config]


def test_the_checked_mark_is_no_field_and_a_replaced_config_is_checked_again(check_calls):
    from rlcore.loops.config import config_dict, ensure_checked, is_checked

    config = grpo.Config(run_dir=None)
    assert not is_checked(config)
    assert ensure_checked(config) is config and is_checked(config)
    assert ensure_checked(config) is config and len(check_calls) == 1
    assert config == grpo.Config(run_dir=None) and "checked" not in repr(config) + str(config_dict(config))
    changed = dataclasses.replace(config, batch_size=0)
    assert not is_checked(changed)
    with pytest.raises(ValueError, match=r"batch_size: expected >= 1, got 0"):
        ensure_checked(changed)
    assert not is_checked(changed) and len(check_calls) == 2


def test_a_checked_config_changed_copied_or_sent_elsewhere_is_checked_again(check_calls):
    """The mark is this process's, for this object as it was: a dict field edited in place, a copy,
    a pickle (what a worker process or an actor receives) and a slots config are checked again."""
    import copy
    import pickle

    from rlcore.loops.config import ensure_checked, is_checked
    from rlcore.loops.recipes import dpo

    config = load_config(dpo.Config, None, {"run_dir": None})
    assert is_checked(config) and len(check_calls) == 1
    config.loss_kwargs["label_smoothing"] = "abc"
    assert not is_checked(config)
    with pytest.raises(ValueError, match=r"loss_kwargs.label_smoothing: expected float, got 'abc'"):
        ensure_checked(config)
    fine = ensure_checked(grpo.Config(run_dir=None))
    for other in (copy.copy(fine), copy.deepcopy(fine), pickle.loads(pickle.dumps(fine))):
        assert other == fine and not is_checked(other)

    @dataclasses.dataclass(frozen=True, slots=True)
    class Slots:
        model: str = "tiny-llama"
        lr: float = 1e-3

    assert ensure_checked(Slots()) == Slots() and not is_checked(Slots())
