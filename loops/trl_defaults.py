"""TRL's defaults beside rlcore's: each field of a recipe whose default differs from the default of
its TRL counterpart, with what the difference does to a run.

rlcore's defaults are tuned for its built-in tiny models (``tiny-llama``, ``tiny-gpt2``: a few
thousand parameters, a character tokenizer, answers of a few tokens), which the tests, the demo and
the examples run on: a learning rate of 1e-3, rows of 64 tokens, a constant schedule. A model of
real size trains with TRL's values (2e-5, 1024 tokens, a linear decay). Those defaults are kept,
and said out loud instead: a run on any other model (a local folder or a hub name) prints, before
its first step, one block naming each field still at rlcore's default whose TRL default differs
(:func:`report_defaults`, called by ``loops.recipe.run``), so nothing changes without a word.

- :data:`TRL_CONFIGS`: the TRL config class each recipe mirrors (``module:Class``). PPO has none in
  TRL 1.x (its ``PPOConfig`` left TRL), DDPO and the ReFT recipes have none either;
- :data:`TRL_DEFAULTS`: ``recipe -> {rlcore field: TrlDefault(TRL name, TRL default, meaning)}``,
  TRL's default as TRL's dataclass declares it (``tests/test_from_trl.py`` checks each against
  the installed TRL);
- :func:`differing_defaults` / :func:`report_defaults`: the entries a config still holds at
  rlcore's default, and the block that lists them.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, NamedTuple, TextIO

__all__ = ["TrlDefault", "TRL_CONFIGS", "TRL_DEFAULTS", "differing_defaults", "report_defaults"]


class TrlDefault(NamedTuple):
    """One default of a TRL config that differs from rlcore's field."""

    trl_name: str      # the field of TRL's config class
    trl_default: Any   # its default, as TRL's dataclass declares it (TRL's units)
    meaning: str       # what rlcore's default does differently


TRL_CONFIGS: dict[str, str] = {
    "sft": "trl:SFTConfig",
    "dpo": "trl:DPOConfig",
    "reward": "trl:RewardConfig",
    "grpo": "trl:GRPOConfig",
    "rloo": "trl:RLOOConfig",
    "online_dpo": "trl.experimental.online_dpo:OnlineDPOConfig",
}

# What every recipe shares (``loops.config.RunConfig``): the run, the optimiser, checkpoints, precision.
_SHARED: dict[str, TrlDefault] = {
    "schedule": TrlDefault("lr_scheduler_type", "linear",
                           "the learning rate stays at lr after warm-up; TRL decays it linearly to 0 by the last step"),
    "steps": TrlDefault("num_train_epochs", 3.0,
                        "the run ends after `steps` steps; TRL makes 3 passes over the training data (max_steps -1)"),
    "seed": TrlDefault("seed", 42, "a different random stream: data order, samples, a fresh adapter's weights"),
    "gradient_checkpointing": TrlDefault("gradient_checkpointing", True,
                                         "activations are kept for the backward pass: faster, more memory"),
    "mixed_precision": TrlDefault("bf16", None,
                                  "float32 compute; TRL's bf16=None turns on bf16 mixed precision where the GPU has it"),
    "save_every": TrlDefault("save_steps", 500, "one checkpoint, after the last step; TRL saves every 500 steps"),
    "keep_last": TrlDefault("save_total_limit", None, "the last 2 checkpoints are kept; TRL keeps every one"),
    "eval_batch_size": TrlDefault("per_device_eval_batch_size", 8, "rows per evaluation forward (memory, not results)"),
}

# The offline recipes: a batch is rows (examples, pairs) per optimiser step, over every rank.
_OFFLINE_BATCH = TrlDefault("per_device_train_batch_size", 8,
                            "rows (examples, pairs) per optimiser step over every rank; TRL's 8 are per device, times "
                            "gradient_accumulation_steps (1) and the devices")

# The online recipes: a batch is prompts per step, each sampled num_samples times.
_ONLINE_BATCH = TrlDefault("per_device_train_batch_size", 8,
                           "prompts per step, num_samples completions each; TRL's 8 counts completions per device "
                           "(8 / num_generations prompts)")

_TINY_LR = "a learning rate sized for the tiny models, far above what a pretrained model takes"

_MAX_LENGTH = TrlDefault("max_length", 1024,
                         "prompt + completion cut to max_length tokens: longer rows of real data lose their end")

TRL_DEFAULTS: dict[str, dict[str, TrlDefault]] = {
    "sft": {
        "lr": TrlDefault("learning_rate", 2e-5, _TINY_LR),
        "max_length": _MAX_LENGTH,
        "batch_size": _OFFLINE_BATCH,
        **_SHARED,
    },
    "dpo": {
        "lr": TrlDefault("learning_rate", 1e-6, _TINY_LR),
        "max_length": _MAX_LENGTH,
        "truncation_mode": TrlDefault("truncation_mode", "keep_start",
                                      "a prompt cut to fit keeps its end (next to the answer); TRL 1.x keeps the "
                                      "start of the whole sequence"),
        "batch_size": _OFFLINE_BATCH,
        **_SHARED,
    },
    "reward": {
        "lr": TrlDefault("learning_rate", 1e-4, _TINY_LR),
        "max_length": _MAX_LENGTH,
        "disable_dropout": TrlDefault("disable_dropout", True, "the model trains with its dropout; TRL sets it to 0"),
        "batch_size": _OFFLINE_BATCH,
        **_SHARED,
    },
    "grpo": {
        "lr": TrlDefault("learning_rate", 1e-6, _TINY_LR),
        "loss_type": TrlDefault("loss_type", "dapo",
                                "GRPO's loss (each sequence's token mean, then the mean over sequences); TRL 1.x "
                                "defaults to DAPO's (token mean over the batch)"),
        "max_new_tokens": TrlDefault("max_completion_length", 512,
                                     "completions end at max_new_tokens tokens"),
        "batch_size": _ONLINE_BATCH,
        **_SHARED,
    },
    "rloo": {
        "lr": TrlDefault("learning_rate", 1e-6, _TINY_LR),
        "max_new_tokens": TrlDefault("max_completion_length", 512,
                                     "completions end at max_new_tokens tokens"),
        "batch_size": _ONLINE_BATCH,
        **_SHARED,
    },
    "online_dpo": {
        "lr": TrlDefault("learning_rate", 5e-7, _TINY_LR),
        "max_new_tokens": TrlDefault("max_new_tokens", 64, "completions end at max_new_tokens tokens"),
        "temperature": TrlDefault("temperature", 0.9, "samples drawn at a higher temperature"),
        "batch_size": TrlDefault("per_device_train_batch_size", 8,
                                 "prompts per step over every rank, a pair sampled for each; TRL's 8 are per device"),
        **_SHARED,
    },
}


def _default(cls: type, name: str) -> Any:
    field = next(f for f in dataclasses.fields(cls) if f.name == name)
    return field.default_factory() if field.default is dataclasses.MISSING else field.default


def differing_defaults(config: Any, recipe: str | None = None) -> dict[str, tuple[Any, TrlDefault]]:
    """``{field: (value, TrlDefault)}`` of each field of ``config`` still at its recipe's default
    whose TRL default differs (``TRL_DEFAULTS[recipe]``; ``recipe`` defaults to the name of the
    config class's module, so ``loops.recipes.sft.Config`` is ``"sft"``). ``{}`` for a recipe
    without a TRL counterpart."""
    cls = type(config)
    recipe = recipe or cls.__module__.rsplit(".", 1)[-1]
    names = {f.name for f in dataclasses.fields(cls)}
    return {name: (getattr(config, name), entry) for name, entry in TRL_DEFAULTS.get(recipe, {}).items()
            if name in names and getattr(config, name) == _default(cls, name)}


def report_defaults(config: Any, recipe: str | None = None, *, file: TextIO | None = None) -> str:
    """Write (to ``file``, stderr by default) and return the block listing ``differing_defaults``:
    one line per field with rlcore's value, TRL's name and value, and what the difference means.
    Nothing for a built-in tiny model (the defaults are theirs) or where nothing differs."""
    from rlcore.loops.config import TINY_MODELS

    if getattr(config, "model", None) in TINY_MODELS:
        return ""
    differing = differing_defaults(config, recipe)
    if not differing:
        return ""
    recipe = recipe or type(config).__module__.rsplit(".", 1)[-1]
    trl_class = TRL_CONFIGS[recipe].rpartition(":")[2]
    width = max(len(f"{name} = {value!r}") for name, (value, _) in differing.items())
    lines = [f"rlcore {recipe}: {len(differing)} settings are at rlcore's defaults (tuned for its tiny models), "
             f"which differ from TRL's {trl_class}; set them to choose (docs/from_trl.md, Defaults):"]
    lines += [f"  {f'{name} = {value!r}':<{width}}  TRL {entry.trl_name}={entry.trl_default!r}: {entry.meaning}"
              for name, (value, entry) in differing.items()]
    block = "\n".join(lines) + "\n"
    print(block, end="", file=file or sys.stderr, flush=True)
    return block
