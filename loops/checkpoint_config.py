"""A checkpoint's stored ``config.json`` read as data, never as code or as a permission.

``rlcore eval``, ``rlcore export`` and ``init_from`` rebuild a run's model from its checkpoint.
They may take the stored config's hyper-parameters, which only shape numbers (a tiny model's
``hidden_size``, ``max_length``, ``temperature``, a built-in ``task``), but every setting that runs
code, opens a path or widens trust comes from the caller's command line and config alone:

- the fields of :data:`CALLER_FIELDS` (reward functions, ``trust_remote_code``, model / reward
  model / reference / dataset locations, ``init_from``, devices, the run folder, trackers, the
  generation engine and its options);
- any stored value holding a path or an importable ``module:function`` name, whatever its field
  (e.g. inside ``loss_kwargs``).

A stored value of those that differs from the caller's is reported (one line on stderr naming the
field, the stored value and the value used), never obeyed. A stored ``model`` that is one of the
built-in offline models (``TINY_MODELS``) names no location: it is taken like ``hidden_size``
unless the caller gives a ``model``.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from rlcore.loops.checkpoint_codec import read_json

__all__ = ["CALLER_FIELDS", "stored_config", "is_caller_setting", "data_settings", "report_ignored"]

# Settings only the caller gives: they run code, open paths, pick devices or send data elsewhere.
CALLER_FIELDS = frozenset({
    "model", "revision", "init_from", "trust_remote_code", "attn_implementation", "load_in_4bit", "load_in_8bit",
    "device", "ref_device", "reward_device", "reward_model", "ref_model", "value_model", "reward_funcs", "reward_fn",
    "dataset", "eval_dataset", "prompt_file", "run_dir", "resume", "overwrite", "report_to", "engine", "engine_options",
})

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
        differs from the caller's.
    """
    given = set(given)
    taken, ignored = {}, []
    for name in fields:
        if name not in stored or name in given:
            continue
        value = stored[name]
        if not is_caller_setting(name, value):
            taken[name] = value
        elif value != caller.get(name):
            ignored.append((name, value, caller.get(name)))
    return taken, ignored


def report_ignored(where: str | Path, ignored: Iterable[tuple[str, Any, Any]], *, command: str) -> None:
    """One line on stderr per ignored stored setting: the file, the field, the stored value and the
    value used."""
    for name, value, used in ignored:
        print(f"{command}: {where}: {name}: the stored {value!r:.200} is not used (a checkpoint's code, paths and "
              f"permissions come from the command line); using {used!r:.200}", file=sys.stderr)
