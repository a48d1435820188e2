"""A checkpoint's stored ``config.json`` read as data, never as code or as a permission.

``rlcore eval``, ``rlcore export`` and ``init_from`` rebuild a run's model from its checkpoint.
They may take the stored config's hyper-parameters, which only shape numbers (a tiny model's
``hidden_size``, ``max_length``, ``temperature``, a built-in ``task``), but every setting that runs
code, opens a path or widens trust comes from the caller's command line and config alone:

- the fields of :data:`CALLER_FIELDS` (reward functions, ``trust_remote_code``, model / reward
  model / reference / dataset locations, ``init_from``, devices, the run folder, trackers, the
  generation engine and its options, the environment and tools of multi-turn episodes);
- any stored value holding a path or an importable ``module:function`` name, whatever its field
  (e.g. inside ``loss_kwargs``).

A stored value of those that differs from the caller's is reported (one line on stderr naming the
field, the stored value and the value used), never obeyed. A stored ``model`` that is one of the
built-in offline models (``TINY_MODELS``) names no location: it is taken like ``hidden_size``
unless the caller gives a ``model``.

Work sizes (:data:`WORK_FIELDS`: ``num_train``, ``num_eval``, ``eval_batch_size``,
``max_new_tokens``, ``num_samples``, ``batch_size``, ``steps`` ...) decide how much a command
computes, not what the weights are. A stored one is taken only when it is an int no larger than
the caller's value (the caller's flag, config or the default), so a run is evaluated on the
split it held out whenever that is no bigger than the caller's; a larger (or non-int) stored
value is reported as above and the caller's used (give ``--num_eval N`` to evaluate on more).

Model sizes (``hidden_size``, ``num_layers`` ...) are taken, then checked against the
checkpoint's own weights before a model of those sizes is built (``loops.recipe.check_tiny_fits``,
``loops.models.check_saved_model``: built on the meta device, compared key by key with the
safetensors headers).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from rlcore.loops.checkpoint_codec import read_json

__all__ = ["CALLER_FIELDS", "WORK_FIELDS", "stored_config", "is_caller_setting", "data_settings", "report_ignored"]

# Settings only the caller gives: they run code, open paths, pick devices or send data elsewhere.
CALLER_FIELDS = frozenset({
    "model", "revision", "init_from", "trust_remote_code", "attn_implementation", "load_in_4bit", "load_in_8bit",
    "device", "ref_device", "reward_device", "reward_model", "ref_model", "value_model", "reward_funcs", "reward_fn",
    "reward_weights",  # weigh the caller's reward_funcs, so they come with them
    "dataset", "eval_dataset", "prompt_file", "run_dir", "resume", "overwrite", "report_to", "engine", "engine_options",
    "env", "tools", "tool_format",  # an environment runs its tools (the python one, model-written code)
})

# Sizes of the work a command does: taken from a stored config only up to the caller's value.
WORK_FIELDS = frozenset({
    "num_train", "num_eval", "eval_batch_size", "max_new_tokens", "num_samples", "batch_size",
    "generation_batch_size", "steps", "epochs", "num_epochs", "num_inference_steps",
})


def _within(value: Any, bound: Any) -> bool:
    """Whether a stored work size is an int in ``[0, bound]`` (``bound``: the caller's int)."""
    ints = all(isinstance(v, int) and not isinstance(v, bool) for v in (value, bound))
    return ints and 0 <= value <= bound


_IMPORTABLE = re.compile(r"^\s*[A-Za-z_][\w.]*\s*:\s*[A-Za-z_][\w.]*\s*$")  # package.module:function


def _names_code_or_path(value: Any) -> bool:
    """Whether ``value`` holds, anywhere inside it, a string naming a path or a ``module:function``."""
    if isinstance(value, str):
        return "/" in value or "\\" in value or value.startswith(("~", ".")) or bool(_IMPORTABLE.match(value))
    if isinstance(value, Mapping):
        return any(_names_code_or_path(k) or _names_code_or_path(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return any(_names_code_or_path(v) for v in value)
    return False


def is_caller_setting(name: str, value: Any) -> bool:
    """Whether the stored setting ``name: value`` is one only the caller may give (see the module's
    docstring); a built-in offline model name is not."""
    if name == "model" and isinstance(value, str):
        from rlcore.loops.config import TINY_MODELS

        return value not in TINY_MODELS
    return name in CALLER_FIELDS or _names_code_or_path(value)


def stored_config(checkpoint: str | Path) -> dict[str, Any]:
    """The ``config.json`` of ``checkpoint`` as a mapping (bounded ``read_json``; ``{}`` when absent).

    Raises:
        CheckpointError: naming the file: unreadable, too big or deep, or not a JSON object.
    """
    path = Path(checkpoint) / "config.json"
    return read_json(path, expect=dict) if path.is_file() else {}


def data_settings(stored: Mapping[str, Any], fields: Iterable[str], caller: Mapping[str, Any],
                  given: Iterable[str] = ()) -> tuple[dict[str, Any], list[tuple[str, Any, Any]]]:
    """Split a stored config into the settings a rebuilt config may take and those it must not.

    Args:
        stored: the checkpoint's config (``stored_config``).
        fields: the fields of the config being built (other stored keys are dropped).
        caller: the caller's value of every field (defaults < YAML < command line).
        given: the fields the caller set explicitly (they win over any stored value).
    Returns:
        ``(taken, ignored)``: the stored hyper-parameters to use as defaults, and
        ``(field, stored value, value used)`` for each caller-only setting whose stored value
        differs from the caller's, and each work size (``WORK_FIELDS``) above the caller's.
    """
    given = set(given)
    taken, ignored = {}, []
    for name in fields:
        if name not in stored or name in given:
            continue
        value = stored[name]
        if name in WORK_FIELDS and value != caller.get(name) and not _within(value, caller.get(name)):
            ignored.append((name, value, caller.get(name)))
        elif not is_caller_setting(name, value):
            taken[name] = value
        elif value != caller.get(name):
            ignored.append((name, value, caller.get(name)))
    return taken, ignored


# What a command runs on when the caller gives none of these (their stored values never count).
_WHAT_IS_USED_INSTEAD = {
    "dataset": "the built-in task's prompts are evaluated, not the run's data",
    "eval_dataset": "the held-out rows come from --dataset (or the built-in task)",
    "reward_funcs": "the built-in task's reward scores (or the reward model given)",
    "reward_weights": "each of the caller's reward functions weighs 1",
    "env": "evaluation answers single turns, with no environment",
    "tools": "evaluation answers single turns, with no tools",
}


def report_ignored(where: str | Path, ignored: Iterable[tuple[str, Any, Any]], *, command: str) -> None:
    """One line on stderr per ignored stored setting: the file, the field, the stored value and the
    value used."""
    for name, value, used in ignored:
        why = (f"a work size above the caller's is not taken from a checkpoint; give --{name} to use it"
               if name in WORK_FIELDS else "a checkpoint's code, paths and permissions come from the command line")
        if used in (None, (), []) and name in _WHAT_IS_USED_INSTEAD:  # say what the command falls back on
            why += f"; without --{name}, {_WHAT_IS_USED_INSTEAD[name]}"
        print(f"{command}: {where}: {name}: the stored {value!r:.200} is not used ({why}); using {used!r:.200}",
              file=sys.stderr)
