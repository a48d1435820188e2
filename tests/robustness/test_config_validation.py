"""Config values are checked when the config is read (CLI, YAML) and before any model is built or
step taken (Python): every error names the field, the value seen and what is allowed."""

import dataclasses

import pytest

from rlcore.loops import cli

from rlcore.loops.recipes import dpo, grpo, sft
from rlcore.loops.cli import RECIPES, recipe_module
from rlcore.loops.config import FIELD_RULES, check_config, load_config


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


def test_every_recipe_default_passes_and_every_rule_names_a_real_field():
    import inspect

    from rlcore.algorithms.preference import PREFERENCE_LOSSES
    from rlcore.baselines import ADVANTAGE_ESTIMATORS

    fields = set()
    for name in RECIPES:
        config_cls = recipe_module(name).Config
        check_config(config_cls())
        fields |= {f.name for f in dataclasses.fields(config_cls)}
    keywords = {p for fn in [*PREFERENCE_LOSSES.values(), *ADVANTAGE_ESTIMATORS.values()]
                for p in inspect.signature(fn).parameters}  # loss_kwargs / advantage_kwargs entries
    assert set(FIELD_RULES) <= fields | keywords, sorted(set(FIELD_RULES) - fields - keywords)


def test_the_rules_reach_the_keywords_of_a_loss_or_an_estimator():
    with pytest.raises(ValueError, match=r"loss_kwargs.label_smoothing: expected in \[0, 1\], got 1.5; "
                                         r"loss_kwargs.rpo_alpha: expected >= 0, got -1"):
        check_config(dpo.Config(loss_kwargs={"label_smoothing": 1.5, "rpo_alpha": -1}))
    with pytest.raises(ValueError, match=r"advantage_kwargs.eps: expected >= 0, got -0.5"):
        check_config(grpo.Config(advantage_kwargs={"eps": -0.5}))
    assert check_config(dpo.Config(loss_kwargs={"label_smoothing": 0.1})).loss_kwargs == {"label_smoothing": 0.1}


@pytest.mark.parametrize("text", ["- steps: 3\n- lr: 0.1\n", "3\n", "just a string\n"])
def test_a_yaml_file_must_be_a_mapping(tmp_path, text):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=r"bad.yaml: expected a mapping of field: value, got (list|int|str)"):
        load_config(dpo.Config, path)
