"""Config sections: every field declared once, with its help and range on the declaration."""

from __future__ import annotations

import collections
import dataclasses
import inspect

import pytest

from rlcore.loops.config import ConfigError, RunConfig, check_config, load_config
from rlcore.loops.online import OnlineConfig
from rlcore.loops.recipes import RECIPES
from rlcore.loops.settings import (AT_LEAST_1, GenerationSettings, KLSettings, RunSettings, Section, declared,
                                   describe, field_rule, setting)

CONFIGS = sorted({recipe.config for recipe in RECIPES.values()} | {RunConfig, OnlineConfig}, key=lambda c: f"{c.__module__}.{c.__qualname__}")


def _sections() -> set[type]:
    return {klass for cls in CONFIGS for klass in cls.__mro__ if dataclasses.is_dataclass(klass)}


def test_every_field_is_declared_in_exactly_one_section():
    declarations = collections.defaultdict(list)
    for klass in _sections():
        overrides = klass.__dict__.get("__defaults__", {})
        for name in inspect.get_annotations(klass):
            if name in klass.__dataclass_fields__ and name not in overrides:
                declarations[name].append(f"{klass.__module__}.{klass.__qualname__}")
    twice = {name: owners for name, owners in declarations.items() if len(owners) > 1}
    assert not twice, twice
    # and every field of every recipe's config has one
    for cls in CONFIGS:
        assert set(declared(cls)) == {f.name for f in dataclasses.fields(cls)}, cls


@pytest.mark.parametrize("cls", CONFIGS, ids=lambda c: f"{c.__module__}.{c.__qualname__}")
def test_every_field_has_help_from_its_declaration(cls):
    for f in dataclasses.fields(cls):
        assert f.metadata.get("help"), f"{cls.__qualname__}.{f.name} is declared without help (loops.settings.setting)"
        assert describe(cls, f.name).startswith(f.metadata["help"])


def test_defaults_change_the_default_and_keep_the_declaration():
    grpo = RECIPES["grpo"].config
    assert grpo().num_samples == 8 and GenerationSettings().num_samples == 1
    assert declared(grpo)["num_samples"] is GenerationSettings
    assert dict(grpo.__dataclass_fields__["num_samples"].metadata) == dict(GenerationSettings.__dataclass_fields__[
        "num_samples"].metadata)
    rloo = RECIPES["rloo"].config
    assert (rloo().kl_coef, rloo().kl, grpo().kl_coef, grpo().kl) == (0.05, "k1", 0.0, "k3")
    assert declared(rloo)["kl_coef"] is declared(grpo)["kl_coef"] is KLSettings
    # a mutable default is copied per instance
    a, b = grpo(), grpo()
    assert a.advantage_kwargs == {} and a.advantage_kwargs is not b.advantage_kwargs


def test_defaults_refuse_what_is_not_an_inherited_field():
    with pytest.raises(TypeError, match="'nope' is no field"):
        @dataclasses.dataclass(frozen=True)
        class Bad(RunSettings, defaults={"nope": 1}):
            pass
    with pytest.raises(TypeError, match="both declared and given a default"):
        @dataclasses.dataclass(frozen=True)
        class Twice(RunSettings, defaults={"seed": 1}):
            seed: int = setting(2, help="again")


def test_ranges_come_from_the_declarations():
    grpo = RECIPES["grpo"].config
    assert field_rule(grpo, "num_samples") is AT_LEAST_1
    with pytest.raises(ConfigError, match=r"temperature: expected > 0, got 0"):
        check_config(grpo(temperature=0.0))
    with pytest.raises(ConfigError, match=r"temperature: expected >= 1e-12"):
        check_config(grpo(temperature=1e-300))  # declared divisor=True
    with pytest.raises(ConfigError, match=r"keep_last: expected >= 1"):
        load_config(RECIPES["ddpo"].config, None, {"keep_last": 0})
    with pytest.raises(ConfigError, match=r"loss_kwargs.label_smoothing: expected in \[0, 0.5\]"):
        load_config(RECIPES["dpo"].config, None, {"loss_kwargs": {"label_smoothing": 0.7}})


def test_a_language_model_recipe_needs_a_model_name():
    with pytest.raises(ConfigError, match="model: expected a model name"):
        check_config(RECIPES["sft"].config(model=None))


@pytest.mark.parametrize("name", ["rloo", "ppo"])
def test_a_clip_range_without_a_preset_is_refused(name):
    with pytest.raises(ValueError, match="clip_eps_low: expected a number"):
        RECIPES[name].config(clip_eps_low=None)


def test_a_section_is_a_plain_frozen_dataclass():
    section = GenerationSettings(max_new_tokens=4, temperature=0.5)
    assert isinstance(section, Section) and section.max_new_tokens == 4
    assert isinstance(RECIPES["grpo"].config(), GenerationSettings)  # a recipe's config is each of its sections
    with pytest.raises(dataclasses.FrozenInstanceError):
        section.temperature = 1.0  # type: ignore[misc]


def test_an_inherited_field_written_again_keeps_its_declaration():
    """``lr: float = 1e-2`` in a subclass changes the default only: the range, divisor flag and help
    stay the section's (a field written again never loses its checks)."""
    @dataclasses.dataclass(frozen=True)
    class Cfg(RunConfig):
        hidden_size: int = 16
        lr: float = 1e-2

    assert (Cfg().hidden_size, Cfg().lr) == (16, 1e-2) and set(Cfg.__defaults__) == {"hidden_size", "lr"}
    assert declared(Cfg)["hidden_size"] is declared(RunConfig)["hidden_size"]
    assert describe(Cfg, "hidden_size") == describe(RunConfig, "hidden_size")
    with pytest.raises(ConfigError, match=r"hidden_size: expected >= 1, got 0; lr: expected >= 0, got -1.0"):
        check_config(Cfg(hidden_size=0, lr=-1.0))

    @dataclasses.dataclass(frozen=True)
    class Hot(RECIPES["grpo"].config):
        temperature: float = 0.7

    with pytest.raises(ConfigError, match=r"temperature: expected >= 1e-12"):
        check_config(Hot(temperature=1e-300))
    with pytest.raises(TypeError, match="'num_samples' is declared in GenerationSettings already"):
        @dataclasses.dataclass(frozen=True)
        class Again(RECIPES["grpo"].config):
            num_samples: int = setting(4, help="redeclared")


def test_a_configs_defaults_are_its_own():
    assert RECIPES["reft_grpo"].config.__defaults__ == {"run_dir": "runs/reft_grpo"}
    assert RECIPES["grpo"].config.__defaults__["num_samples"] == 8
    assert RECIPES["reft_grpo"].config().num_samples == 8  # inherited through grpo.Config


@pytest.mark.parametrize("name,field", [("kl_penalty", "kl"), ("init_kl_coef", "kl_coef"), ("ppo_epochs", "epochs"),
                                        ("num_generations", "num_samples")])
def test_trl_names_are_hinted_for_recipes_without_a_table(name, field):
    with pytest.raises(ConfigError, match=rf"{name}: did you mean '{field}'"):
        load_config(RECIPES["reft_grpo"].config, None, {name: 1, "run_dir": None})
