"""Run configs: YAML + overrides → a config checked once, against the ranges declared on its fields.

- :class:`RunConfig`: the sections every language-model recipe shares (``loops.settings``: the
  model and its loading, data, optimisation, the run); each recipe's ``Config`` adds its own;
- :func:`check_config`: every field in its declared range and of its type, every ``*_kwargs``
  entry in its keyword's range (:data:`KEYWORD_RULES`) and type, devices this machine has;
- :func:`load_config` / :func:`config_dict`: configs from safe YAML plus overrides (unknown keys
  raise, naming the nearest field or TRL's name; values are coerced to the field types) and back
  to a plain dict;
- :func:`parse_yaml` / :func:`read_config_file`: YAML read with bounds on size, nesting and
  aliases (expanded), so no file or flag can make reading it take unbounded time or memory."""

from __future__ import annotations

import dataclasses
import os
import functools
import difflib
import math
import types
import typing
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import yaml
from pydantic import ConfigDict, TypeAdapter, ValidationError

from rlcore.checks import MIN_DIVISOR
from rlcore.loops.collect import check_length_range
from rlcore.loops.engines import ENGINES, SAMPLERS
from rlcore.loops.envs import resolve_env
from rlcore.loops.tools import TOOL_CALL_FORMATS
from rlcore.loops.reward_fns import NONFINITE_REWARDS
from rlcore.loops.logging import check_trackers
from rlcore.loops.settings import (AT_LEAST_0, DataSettings, LanguageModelSettings, ModelSettings, OptimSettings, Rule,
                                   RunSettings, ShardingSettings, field_rule, is_divisor)
from rlcore.loops.trl_config import TABLES as TRL_TABLES, Accept
from rlcore.loops.trl_config import translate as translate_trl_names

__all__ = ["ConfigError", "RunConfig", "coerce_tuples", "DTYPES", "TINY_MODELS", "loading_kwargs", "quantization_kwargs", "check_quantization",
           "autocast_dtype", "KEYWORD_RULES", "DIVISOR_KEYWORDS", "try_loss", "check_config", "is_checked", "ensure_checked", "trl_hints", "load_config", "trl_translated",
           "config_dict", "parse_yaml", "read_config_file", "YAML_MAX_BYTES", "YAML_MAX_DEPTH", "YAML_MAX_ALIASES", "YAML_MAX_NODES"]


class ConfigError(ValueError):
    """A setting that cannot run: an unknown field, a value outside its type or range, a config file
    that is not a small YAML mapping. The message names the field (or file) and what is allowed. A
    ``ValueError``, so code that catches those catches it; the ``rlcore`` command prints it without a
    traceback and exits with status 2 (``loops.cli.main``)."""


@functools.lru_cache(maxsize=None)
def _tuple_fields(cls: type) -> dict[str, bool]:
    """``{field: takes text items}`` of each field of ``cls`` annotated with a tuple (or an optional one)."""
    try:
        hints = typing.get_type_hints(cls)
    except (NameError, TypeError):
        return {}
    out = {}
    for f in dataclasses.fields(cls):
        tp = hints.get(f.name)
        parts = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
        tuples = [p for p in parts if typing.get_origin(p) is tuple]
        if tuples and str not in parts:
            out[f.name] = any(typing.get_args(p)[:1] == (str,) for p in tuples)
    return out


def coerce_tuples(config: Any) -> None:
    """Give each tuple field of the frozen dataclass ``config`` a tuple, in place (for ``__post_init__``):
    one string given to a ``tuple[str, ...]`` field becomes a one-item tuple
    (``lora_target_modules="all-linear"`` → ``("all-linear",)``, ``reward_funcs="my.mod:fn"``), and a
    list becomes a tuple. A string is a sequence of characters, so taken as it is it would become a
    tuple of one-letter names; anything else is left for ``check_config`` to judge."""
    for name, text_items in _tuple_fields(type(config)).items():
        value = getattr(config, name)
        if isinstance(value, str) and text_items:
            object.__setattr__(config, name, (value,))
        elif isinstance(value, list):
            object.__setattr__(config, name, tuple(value))


@dataclasses.dataclass(frozen=True)
class RunConfig(OptimSettings, DataSettings, ShardingSettings, LanguageModelSettings, ModelSettings, RunSettings):
    """The sections every language-model recipe shares (``loops.settings``): the model and how it is
    loaded, the data, the optimiser and the run. A recipe's ``Config`` adds its algorithm's sections
    and gives inherited fields other defaults with ``defaults=`` (never a second declaration)."""

    def __post_init__(self):
        coerce_tuples(self)  # lora_target_modules="all-linear" is one name, not ten characters


DTYPES = ("float32", "bfloat16", "float16", "auto")


def loading_kwargs(config: Any) -> dict[str, Any]:
    """The ``from_pretrained`` keywords of ``config``'s loading fields (``RunConfig``)."""
    kwargs = {"dtype": config.dtype, "trust_remote_code": config.trust_remote_code}
    for name in ("attn_implementation", "revision"):
        if getattr(config, name) is not None:
            kwargs[name] = getattr(config, name)
    return kwargs


def quantization_kwargs(config: Any) -> dict[str, Any]:
    """The ``from_pretrained`` ``quantization_config`` of ``load_in_4bit`` / ``load_in_8bit``
    (bitsandbytes; 4 bits as NF4 with the compute in ``dtype``, bfloat16 for float32 / auto), or
    ``{}``. ``check_config`` has refused the cases bitsandbytes cannot serve."""
    if not (config.load_in_4bit or config.load_in_8bit):
        return {}
    from transformers import BitsAndBytesConfig

    dtype = config.dtype
    compute = getattr(torch, dtype) if dtype in ("bfloat16", "float16") else torch.bfloat16
    return {"quantization_config": BitsAndBytesConfig(
        load_in_4bit=config.load_in_4bit, load_in_8bit=config.load_in_8bit, bnb_4bit_quant_type="nf4",
        bnb_4bit_compute_dtype=compute)}


def check_quantization(config: Any) -> None:
    """Refuse ``load_in_4bit`` / ``load_in_8bit`` where they cannot work, before any model is built:
    both at once, without ``use_peft`` (quantised weights do not train), on a model built from a
    config (``TINY_MODELS``: nothing to quantise on load), off CUDA, or without bitsandbytes."""
    four, eight = config.load_in_4bit, config.load_in_8bit
    if not (four or eight):
        return
    where = f"{type(config).__name__}: load_in_{4 if four else 8}bit"
    if four and eight:
        raise ValueError(f"{type(config).__name__}: load_in_4bit and load_in_8bit: choose one")
    if not config.use_peft:
        raise ValueError(f"{where}: quantised weights do not train; set use_peft to train a LoRA adapter on them")
    if config.model in TINY_MODELS:
        raise ValueError(f"{where}: {config.model!r} is built from a config, not loaded; quantisation applies to a "
                         "model folder or hub name")
    if not str(config.device).startswith("cuda"):
        raise ValueError(f"{where}: bitsandbytes quantisation runs on CUDA here; device is {config.device!r}")
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise ValueError(f"{where}: needs the bitsandbytes package (pip install bitsandbytes)") from None


def autocast_dtype(config: Any) -> torch.dtype | None:
    """The ``update(autocast_dtype=)`` of ``config.mixed_precision``: ``torch.bfloat16`` for ``"bf16"``,
    else ``None``. (float16 autocast without loss scaling underflows gradients: not offered.)"""
    return torch.bfloat16 if config.mixed_precision == "bf16" else None


# --- bounded YAML ---------------------------------------------------------------------------------
# A config is a small mapping: these bounds hold every real one many times over, and refuse what
# would take unbounded time or memory to read. Aliases are allowed (``lr: &lr 1e-4`` ... ``*lr``),
# but counted, and the document they stand for once every alias is expanded is bounded too: ten
# nested anchors of ten aliases each are 90 alias uses but 10^10 values (a "billion laughs").
YAML_MAX_BYTES = 1 << 20      # size of a config file or of a value's YAML text
YAML_MAX_DEPTH = 32           # nesting of mappings and sequences, aliases expanded
YAML_MAX_ALIASES = 100        # alias uses (``*name``)
YAML_MAX_NODES = 10_000       # values (scalars, mappings, sequences), aliases expanded


class _BoundedLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` (plain data only: no Python objects) that counts alias uses and nesting
    while it composes, and refuses a document whose expanded form passes the bounds above before
    any Python value is built from it."""

    def __init__(self, stream: str, where: str):
        super().__init__(stream)
        self.where, self.aliases, self.depth = where, 0, 0

    def refuse(self, what: str) -> ConfigError:
        return ConfigError(f"{self.where}: {what}; a config is a small mapping of field: value")

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            self.aliases += 1
            if self.aliases > YAML_MAX_ALIASES:
                raise self.refuse(f"more than {YAML_MAX_ALIASES} alias uses (*name)")
        self.depth += 1
        try:
            if self.depth > YAML_MAX_DEPTH:
                raise self.refuse(f"nested deeper than {YAML_MAX_DEPTH} levels")
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def construct_document(self, node: Any) -> Any:
        self.expanded(node, 1, {}, set())
        return super().construct_document(node)

    def expanded(self, node: Any, level: int, sizes: dict[int, tuple[int, int]], open_: set[int]) -> tuple[int, int]:
        """``(values, depth)`` of ``node`` with every alias expanded (memoised: shared nodes are
        walked once); refuses a cycle, a depth past ``YAML_MAX_DEPTH`` or a count past ``YAML_MAX_NODES``."""
        if level > YAML_MAX_DEPTH:
            raise self.refuse(f"nested deeper than {YAML_MAX_DEPTH} levels once aliases are expanded")
        key = id(node)
        if key in open_:
            raise self.refuse("an alias refers to a value that contains it (a cycle)")
        if key not in sizes:
            children = (node.value if isinstance(node, yaml.SequenceNode) else
                        [x for pair in node.value for x in pair] if isinstance(node, yaml.MappingNode) else [])
            open_.add(key)
            parts = [self.expanded(child, level + 1, sizes, open_) for child in children]
            open_.discard(key)
            sizes[key] = (1 + sum(n for n, _ in parts), 1 + max((d for _, d in parts), default=0))
        count, depth = sizes[key]
        if level - 1 + depth > YAML_MAX_DEPTH:
            raise self.refuse(f"nested deeper than {YAML_MAX_DEPTH} levels once aliases are expanded")
        if count > YAML_MAX_NODES:
            raise self.refuse(f"more than {YAML_MAX_NODES} values once aliases are expanded")
        return count, depth


def parse_yaml(text: str, where: str) -> Any:
    """The plain data of YAML ``text`` (safe: mappings, sequences, scalars), within the bounds above
    (``YAML_MAX_BYTES``, ``_DEPTH``, ``_ALIASES``, ``_NODES``); ``where`` (a file, a ``--field``)
    starts every error. Raises ``ValueError`` for text past a bound or that is not YAML."""
    if len(text) > YAML_MAX_BYTES:
        raise ConfigError(f"{where}: {len(text)} characters of YAML, more than {YAML_MAX_BYTES}")
    loader = _BoundedLoader(text, where)
    try:
        return loader.get_single_data()
    except yaml.YAMLError as e:
        raise ConfigError(f"{where}: not valid YAML: {e}") from None
    finally:
        loader.dispose()


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The ``field: value`` mapping of a YAML config file (``parse_yaml``; an empty file is ``{}``).
    Raises ``ValueError`` naming the file for one larger than ``YAML_MAX_BYTES``, not UTF-8, not
    YAML, past the bounds, or whose top level is not a mapping with text keys."""
    path = Path(path)
    with path.open("rb") as f:
        data = f.read(YAML_MAX_BYTES + 1)
    if len(data) > YAML_MAX_BYTES:
        raise ConfigError(f"{path}: a config file of more than {YAML_MAX_BYTES} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    loaded = parse_yaml(text, str(path))
    if loaded is None:
        return {}
    if not isinstance(loaded, Mapping):
        raise ConfigError(f"{path}: expected a mapping of field: value, got {type(loaded).__name__}")
    keys = [k for k in loaded if not isinstance(k, str)]
    if keys:
        raise ConfigError(f"{path}: expected field names as keys, got {keys[:3]!r}")
    return dict(loaded)


_NONE = ("none", "null", "~", "")


@functools.lru_cache(maxsize=None)
def _adapter(tp: Any) -> TypeAdapter:
    return TypeAdapter(tp, config=ConfigDict(coerce_numbers_to_str=True))


def _from_text(value: Any, tp: Any, where: str) -> Any:
    """The command line's conventions pydantic lacks: ``none`` / ``null`` / ``~`` / an empty string
    for ``None`` of an optional field, comma-separated items for a tuple or list, YAML text for a
    mapping (``parse_yaml``: bounded)."""
    if not isinstance(value, str):
        return value
    origin = typing.get_origin(tp)
    parts = typing.get_args(tp) if origin in (typing.Union, types.UnionType) else (tp,)
    if type(None) in parts and value.strip().lower() in _NONE:
        return None
    kinds = {typing.get_origin(p) or p for p in parts}
    if kinds & {tuple, list}:
        return [item.strip() for item in value.split(",")]
    return parse_yaml(value, where) if dict in kinds else value


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """``value`` as type ``tp``: pydantic's lax validation (numbers from text, ``true`` / ``no`` as
    bools, lists as tuples, numbers as text) after :func:`_from_text`; a bool is no number."""
    value = _from_text(value, tp, where)
    origin = typing.get_origin(tp)
    parts = typing.get_args(tp) if origin in (typing.Union, types.UnionType) else (tp,)
    if isinstance(value, bool) and bool not in parts and {int, float} & set(parts):
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    try:
        return _adapter(tp).validate_python(value)
    except ValidationError as e:
        raise ConfigError(f"{where}: cannot read {value!r} as {tp}: {e.errors()[0]['msg']}") from None


# The ranges of the keywords a ``*_kwargs`` field passes to a loss or an estimator, by name (a
# config field's range is declared on the field: ``loops.settings.setting``). A keyword named like a
# field of the same config takes that field's range.
KEYWORD_RULES: dict[str, Rule] = {
    **dict.fromkeys(["eps", "rpo_alpha", "cpo_alpha"], AT_LEAST_0),
    **dict.fromkeys(["discopop_tau", "desirable_weight", "undesirable_weight"], Rule(lambda v: v > 0, "> 0")),
    "label_smoothing": Rule(lambda v: 0 <= v <= 0.5, "in [0, 0.5] (past 0.5 the smoothed loss prefers the rejected "
                                                     "answer)"),
}

# Keywords a formula divides by (DiscoPOP's x/τ): past "> 0" they must be at least
# ``rlcore.checks.MIN_DIVISOR`` (1e-12), the floor the functions apply, as fields declared with
# ``divisor=True`` (IPO's 1/(2β), a temperature's logits/τ, the KL controller's KL/target), so a
# denormal such as 1e-310 is refused at load, not met as NaN at the first step.
DIVISOR_KEYWORDS = ("discopop_tau",)


_INT64 = 2**63

def _value_fault(value: Any, rule: Rule | None = None, divisor: bool = False) -> str | None:
    """What is wrong with one value, or ``None``: an integer outside int64 or a float that is not
    finite (any field, a keyword, an item of a tuple), else outside ``rule`` (a field's declared range
    or a keyword's ``KEYWORD_RULES`` entry); a ``divisor`` below ``MIN_DIVISOR``."""
    if isinstance(value, (tuple, list)):  # items have no rule of their own
        return next((fault for item in value if (fault := _value_fault(item))), None)
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, int) and not -_INT64 <= value < _INT64:
        return f"expected an integer within int64 [-2**63, 2**63), got {value}"
    if rule is None:
        return None if math.isfinite(value) else f"expected a finite number, got {value!r}"
    allowed, what = rule
    if not (math.isfinite(value) and allowed(value)):
        return f"expected {what}, got {value!r}"
    if divisor and value < MIN_DIVISOR:
        return f"expected >= {MIN_DIVISOR:g} (it is divided by: 1/{value!r} overflows), got {value!r}"
    return None


def _keyword_rule(cls: type, key: str) -> tuple[Rule | None, bool]:
    """The range of a ``*_kwargs`` entry ``key``: the same-named field's of ``cls``, else ``KEYWORD_RULES``'."""
    rule = field_rule(cls, key)
    if rule is not None:
        return rule, is_divisor(cls, key)
    return KEYWORD_RULES.get(key), key in DIVISOR_KEYWORDS


@functools.lru_cache(maxsize=None)
def _strict(tp: Any) -> TypeAdapter:
    return TypeAdapter(tp, config=ConfigDict(strict=True, arbitrary_types_allowed=True))


def _tuples(value: Any) -> Any:
    """``value`` with its lists as tuples (YAML and JSON have no tuples)."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def _fits(value: Any, tp: Any) -> bool:
    """Whether ``value`` is of type ``tp`` as it is (pydantic's strict mode: no text read as a
    number, no bool as a number; an int is a float; a list may stand for a tuple)."""
    try:
        adapter = _strict(tp)
    except (TypeError, NameError):  # an annotation pydantic cannot check (a forward reference): not checked
        return True
    for candidate in (value, _tuples(value)):
        try:
            adapter.validate_python(candidate)
            return True
        except ValidationError:
            pass
    return False


def _type_name(tp: Any) -> str:
    return tp.__name__ if isinstance(tp, type) else str(tp).replace("typing.", "")


def _type_hints(fn: Any) -> dict[str, Any]:
    """The resolved annotations of ``fn`` (through ``functools.partial``); ``{}`` where they cannot
    be resolved."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    try:
        return typing.get_type_hints(fn)
    except (NameError, TypeError, AttributeError):  # an annotation naming what its module does not import at run time
        return {}


def _type_faults(config: Any) -> list[str]:
    """Each field whose value is not of its declared type (a config built in Python skips
    ``load_config``'s coercion), and each entry of a ``*_kwargs`` field whose value is not of the
    type its keyword is annotated with in the function the field feeds: ``config.keyword_functions()``,
    ``{field: the bound function}``, whose binding checks the keywords' names (its error is a fault)."""
    hints = _type_hints(type(config))
    faults = [f"{f.name}: expected {_type_name(hints[f.name])}, got {getattr(config, f.name)!r}"
              for f in dataclasses.fields(config) if f.name in hints and not _fits(getattr(config, f.name), hints[f.name])]
    if faults or not hasattr(config, "keyword_functions"):
        return faults
    try:
        bound = config.keyword_functions()
    except ValueError as e:  # an unknown loss or estimator, a keyword it does not take
        return [str(e)]
    for field, fn in bound.items():
        annotations = _type_hints(fn)
        faults += [f"{field}.{key}: expected {_type_name(annotations[key])}, got {value!r}"
                   for key, value in getattr(config, field).items()
                   if key in annotations and not _fits(value, annotations[key])]
    return faults


def _device_fault(value: Any) -> str | None:
    """What keeps ``value`` from naming a device of this machine and torch build, or ``None``: 'cpu',
    'cuda' / 'cuda:N' with CUDA available and ``N`` below the device count, 'mps' where available."""
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError, ValueError):
        return f"expected a device such as 'cpu', 'cuda' or 'cuda:1', got {value!r}"
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            return (f"got {value!r}, but this torch build ({torch.__version__}) sees no CUDA device "
                    "(torch.cuda.is_available() is False); use 'cpu'")
        if device.index is not None and device.index >= count:
            return f"got {value!r}, but this machine has {count} CUDA device(s): 'cuda:0' to 'cuda:{count - 1}'"
        return None
    if device.type == "cpu" or (device.type == "mps" and torch.backends.mps.is_available()):
        return None
    if device.type == "meta":
        return "got 'meta', which holds shapes but no data: a run needs 'cpu' or 'cuda'"
    return f"expected 'cpu' or 'cuda[:N]', got {value!r} (device type {device.type!r} is not available here)"


def _run_dir_fault(run_dir: str) -> str | None:
    """Why ``run_dir`` can be no run's folder (it, or the nearest existing path above it, is a file), or None."""
    for path in (Path(run_dir), *Path(run_dir).parents):
        if path.exists() or path.is_symlink():
            return None if path.is_dir() else (f"{run_dir!r} is an existing file, not a folder" if path == Path(run_dir)
                                               else f"{run_dir!r} lies under {str(path)!r}, an existing file")
    return None


def _agent_faults(config: Any) -> list[str]:
    """What keeps a config's environment from running (``loops.envs.resolve_env``: an unknown built-in,
    a factory or tool that does not import, a tool the chat template cannot show, both ``env`` and
    ``tools``), an unknown ``tool_format``, and the single-turn settings beside it (``length_sampler``,
    ``missing_eos_penalty``, ``overlong_buffer``, ``generation_batch_size``)."""
    env, tools = getattr(config, "env", None), getattr(config, "tools", ())
    if env is None and not tools:
        return []
    faults = []
    if config.tool_format not in TOOL_CALL_FORMATS:
        faults.append(f"tool_format: expected one of {sorted(TOOL_CALL_FORMATS)}, got {config.tool_format!r}")
    try:
        resolve_env(env, tools, tool_format=config.tool_format)
    except (ValueError, TypeError) as e:
        faults.append(str(e))
    single_turn = {"length_sampler": "each turn takes max_new_tokens",
                   "missing_eos_penalty": "it reads one response's stop token, not an episode's last turn's",
                   "overlong_buffer": "it measures one response against max_new_tokens, not an episode's turns",
                   "generation_batch_size": "every episode of a step plays in one batch, turn by turn"}
    for name, why in single_turn.items():
        if getattr(config, name, None) is not None:
            faults.append(f"{name}: not with an environment ({why}); it is for single-turn rollouts (env and "
                          "tools unset)")
    return faults


SHARDING_STRATEGIES = ("none", "ddp", "fsdp2")
FSDP_CHECKPOINTS = ("sharded", "full")
FSDP_PARAM_DTYPES = (None, "bfloat16", "float16")


def _sharding_faults(config: Any) -> list[str]:
    """An unknown ``strategy`` or FSDP2 setting, and a ``batch_size`` the ranks of an ``fsdp2`` run
    cannot split evenly."""
    strategy = getattr(config, "strategy", "none")
    if strategy not in SHARDING_STRATEGIES:
        return [f"strategy: expected one of {list(SHARDING_STRATEGIES)}, got {strategy!r}"]
    if getattr(config, "fsdp_checkpoint", "sharded") not in FSDP_CHECKPOINTS:
        return [f"fsdp_checkpoint: expected one of {list(FSDP_CHECKPOINTS)}, got {config.fsdp_checkpoint!r}"]
    if getattr(config, "fsdp_param_dtype", None) not in FSDP_PARAM_DTYPES:
        return [f"fsdp_param_dtype: expected one of {list(FSDP_PARAM_DTYPES)}, got {config.fsdp_param_dtype!r}"]
    if strategy != "fsdp2":
        return []
    faults = []
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    batch = getattr(config, "batch_size", None)
    if world > 1 and isinstance(batch, int) and batch % world:
        faults.append(f"batch_size: fsdp2 runs every forward on every rank at once, so each rank needs as many rows; "
                      f"expected a multiple of the world size {world}, got {batch}")
    return faults


def try_loss(loss: Callable[[Any], Any], batch: Any, *, fields: Mapping[str, str], where: str) -> None:
    """Run a recipe's bound loss (its settings bound) once on a tiny dummy ``batch``, so the loss's
    own argument checks (robust DPO's ``ε < 0.5``, a surrogate's temperatures...) refuse a setting
    at load, before any model is built; the losses are pure, so the trial is cheap and changes
    nothing. A ``ValueError`` it raises becomes a ``ConfigError`` naming the field: the keyword that
    begins the loss's message mapped through ``fields`` (``{"label_smoothing":
    "loss_kwargs.label_smoothing"}``), else ``where`` (e.g. ``loss_type 'robust'``) leads it."""
    try:
        with torch.no_grad():
            loss(batch)
    except ValueError as e:
        key, sep, rest = str(e).partition(":")
        raise ConfigError(f"{fields[key]}:{rest}" if sep and key in fields else f"{where}: {e}") from None


def check_config(config: Any) -> Any:
    """``config`` itself when every field is in its declared range (``loops.settings.setting``), and
    every entry of its ``loss_kwargs`` / ``advantage_kwargs`` in its keyword's (``KEYWORD_RULES``); when every value is of its
    field's type, and every ``*_kwargs`` entry of the type of the keyword it feeds (the loss's or
    estimator's signature); when the recipe's bound loss runs on a tiny dummy batch (its
    ``try_loss()``, :func:`try_loss`); when every integer fits int64 and every float is finite; and when each
    device is one this machine has (``cuda`` needs a CUDA build and device, ``cuda:N`` an ``N``
    below the count; ``meta`` is refused). Else a ``ConfigError`` (a ``ValueError``) naming each field (or
    ``loss_kwargs.<name>``) at fault, its value and what is allowed (all at once).

    A config that passes is marked checked (:func:`is_checked`): an attribute of this instance outside
    its fields, so no field, ``repr``, equality or ``config_dict`` sees it, and ``dataclasses.replace``
    makes a new, unchecked config. ``load_config`` checks every config it builds; ``build_policy`` and
    ``run`` take a config through :func:`ensure_checked`, so a config built in Python is checked once,
    before any model is built or any file written, and one already checked is not checked again.
    """
    cls = type(config)
    values = [(f.name, getattr(config, f.name), field_rule(cls, f.name), is_divisor(cls, f.name))
              for f in dataclasses.fields(config)]
    for kwargs in ("loss_kwargs", "advantage_kwargs"):  # a loss's or an estimator's keywords by their names
        given = getattr(config, kwargs, None)
        if isinstance(given, Mapping):
            values += [(f"{kwargs}.{k}", v, *_keyword_rule(cls, str(k))) for k, v in given.items()]
    faults = [f"{where}: {fault}" for where, value, rule, divisor in values
              if (fault := _value_fault(value, rule, divisor))]
    if isinstance(config, RunConfig) and not isinstance(config.model, str):
        faults.append(f"model: expected a model name (a built-in tiny one, a folder or a hub name), got "
                      f"{config.model!r}")
    faults += _type_faults(config)
    if not faults and hasattr(config, "try_loss"):  # the recipe's bound loss once on a dummy batch (try_loss)
        try:
            config.try_loss()
        except ValueError as e:
            faults.append(str(e))
    for name in ("device", "ref_device", "reward_device"):
        value = getattr(config, name, None)
        if value is not None and (fault := _device_fault(value)):
            faults.append(f"{name}: {fault}")
    buffer, budget = getattr(config, "overlong_buffer", None), getattr(config, "max_new_tokens", None)
    if isinstance(buffer, int) and isinstance(budget, int) and buffer > budget:
        faults.append(f"overlong_buffer: expected at most max_new_tokens={budget}, got {buffer}")
    rows, group = getattr(config, "generation_batch_size", None), getattr(config, "num_samples", 1)
    if isinstance(rows, int) and isinstance(group, int) and group >= 1 and rows % group:
        faults.append(f"generation_batch_size: expected a multiple of num_samples={group} (whole groups per "
                      f"call), got {rows}")
    if getattr(config, "length_sampler", None) is not None:
        try:
            check_length_range(config.length_sampler)
        except ValueError as e:
            faults.append(str(e))
    # the generation engine and its rule; what a NaN or infinite reward does
    for name, registry in (("engine", ENGINES), ("sampler", SAMPLERS), ("nonfinite_rewards", NONFINITE_REWARDS)):
        value = getattr(config, name, None)
        if value is not None and value not in registry:
            faults.append(f"{name}: expected one of {sorted(registry)}, got {value!r}")
    if isinstance(run_dir := getattr(config, "run_dir", None), str) and run_dir and (fault := _run_dir_fault(run_dir)):
        faults.append(f"run_dir: {fault} (a run writes its checkpoints and metrics.jsonl into a folder); pick "
                      "another run_dir")
    faults += _agent_faults(config)
    faults += _sharding_faults(config)
    if getattr(config, "engine_options", None) and getattr(config, "engine", None) != "vllm":
        faults.append(f"engine_options: only for engine='vllm', got engine={config.engine!r}")
    every = getattr(config, "eval_every", None)
    if (getattr(config, "num_eval", None) == 0 and not getattr(config, "eval_dataset", None)
            and isinstance(every, int) and every > 0):  # num_eval 0: no held-out split (loops.recipe.load_splits)
        faults.append(f"eval_every: got {every}, but num_eval is 0 and no eval_dataset is given: nothing is held "
                      "out to evaluate on; set eval_every: 0, num_eval > 0, or eval_dataset")
    if faults:
        raise ConfigError(f"{type(config).__name__}: " + "; ".join(faults))
    if getattr(config, "mixed_precision", None) not in (None, "bf16"):
        raise ConfigError(f"{type(config).__name__}: mixed_precision: expected 'bf16' or None, got "
                         f"{config.mixed_precision!r} (float16 autocast needs loss scaling, which is not offered)")
    if getattr(config, "dtype", "float32") not in DTYPES:
        raise ConfigError(f"{type(config).__name__}: dtype: expected one of {list(DTYPES)}, got {config.dtype!r}")
    check_trackers(getattr(config, "report_to", ()))
    if isinstance(config, RunConfig):  # a language-model recipe's (DDPO's config loads no such model)
        check_quantization(config)
    _mark_checked(config)
    return config


# The configs of this process that passed ``check_config``: id -> (a weak reference to the very
# object, its repr then). Kept beside the config, not on it, so that a copy, a pickle sent to a
# worker process or an actor, or an object that cannot hold attributes is checked again where it
# lands (devices and trackers are the machine's own), and a config changed since (a dict field
# edited in place) no longer matches its repr and is checked again.
_CHECKED: dict[int, tuple[weakref.ref, str]] = {}


def _mark_checked(config: Any) -> None:
    key = id(config)
    try:
        ref = weakref.ref(config, lambda _, key=key: _CHECKED.pop(key, None))
    except TypeError:  # no weak references (a slots class): such a config is checked at every stage
        return
    _CHECKED[key] = (ref, repr(config))


def is_checked(config: Any) -> bool:
    """Whether this very ``config`` object passed ``check_config`` in this process and is unchanged since."""
    entry = _CHECKED.get(id(config))
    return entry is not None and entry[0]() is config and entry[1] == repr(config)


def ensure_checked(config: Any) -> Any:
    """``config``, checked: as is when it has passed ``check_config`` already (``load_config``'s, or one
    an earlier stage of the run took through here), else ``check_config(config)`` now. The stages of a
    run call this, so its config is validated once, on whichever path it was built."""
    return config if is_checked(config) else check_config(config)


# TRL names the recipe tables do not hold (older TRL versions, other trainers), kept as hints only.
_OTHER_TRL_NAMES: dict[str, tuple[str, ...]] = {
    "kl_penalty": ("kl",), "init_kl_coef": ("kl_coef",), "adap_kl_ctrl": ("kl_controller",), "ppo_epochs": ("epochs",),
    "train_dataset": ("dataset",), "num_train_epochs": ("num_epochs",), "sft_model_path": ("init_from",),
}


@functools.lru_cache(maxsize=None)
def trl_hints() -> dict[str, tuple[str, ...]]:
    """TRL's name -> the rlcore fields it sets in any recipe's TRL table (``loops.trl_config.TABLES``),
    and a few names of older TRL versions: the "did you mean" of a recipe without a table of its own
    (online DPO, DDPO, the ReFT recipes)."""
    out: dict[str, tuple[str, ...]] = dict(_OTHER_TRL_NAMES)
    for table in TRL_TABLES.values():
        for name, entry in table.items():
            if isinstance(entry, Accept):
                out[name] = tuple(dict.fromkeys((*out.get(name, ()), *entry.to)))
    return out


def _did_you_mean(key: str, fields: Mapping[str, Any]) -> str:
    """A hint for an unknown config key: the field TRL's name maps to, else the closest field names."""
    mapped = [f for f in trl_hints().get(key, ()) if f in fields and f != key]
    if mapped:
        return f"did you mean {' or '.join(repr(f) for f in mapped)} (TRL's {key})?"
    close = difflib.get_close_matches(key, list(fields), n=2, cutoff=0.75)
    return f"did you mean {' or '.join(repr(f) for f in close)}?" if close else ""


def trl_translated(cls: type, raw: Mapping[str, Any]) -> dict[str, Any]:
    """``raw`` with TRL's names translated to ``cls``'s fields (``loops.trl_config``: units
    converted, or refused with the reason); a TRL name and its rlcore field given with different
    values are an error."""
    hints = typing.get_type_hints(cls)
    return translate_trl_names(cls, raw, lambda k, v: _coerce(v, hints[k], f"{cls.__name__}.{k}"))


def load_config(cls: type, path: str | Path | None = None, overrides: Mapping[str, Any] | None = None) -> Any:
    """A ``cls`` (frozen dataclass) from a YAML file (``read_config_file``: safe and bounded) and overrides.

    ``overrides`` (e.g. parsed ``--field value`` pairs, strings allowed) win over the file; both
    may give any subset of the fields, the rest keep their defaults. Values are coerced to the
    field types (``"1e-4"`` → float, ``"true"`` → bool, ``"null"`` → None for optional fields).
    TRL's names are read first for the recipes of ``loops.trl_config.TABLES``: translated with TRL's
    meaning (``per_device_train_batch_size`` → ``batch_size``, ``beta`` → ``kl_coef``) or refused
    with the reason; a TRL name and its rlcore field given with different values are an error.

    Raises:
        ValueError: an unknown key (the message lists the valid fields), a value that does not fit
            its field's type or range (``check_config``), or a YAML file past the bounds of
            ``parse_yaml`` or whose top level is not a mapping.
    """
    raw: dict[str, Any] = read_config_file(path) if path is not None else {}
    raw.update(overrides or {})
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    raw = trl_translated(cls, raw)
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        hints = "".join(f"; {k}: {hint}" for k in unknown if (hint := _did_you_mean(k, fields)))
        raise ConfigError(f"{path or cls.__name__}: unknown keys {unknown}{hints}; valid fields of {cls.__name__}: "
                         f"{sorted(fields)}")
    return check_config(cls(**{k: _coerce(v, hints[k], f"{cls.__name__}.{k}") for k, v in raw.items()}))


def config_dict(config: Any) -> dict[str, Any]:
    """The fields of a config dataclass as a plain dict (tuples become lists: JSON / YAML ready)."""
    def plain(v: Any) -> Any:
        return [plain(x) for x in v] if isinstance(v, (tuple, list)) else v
    return {k: plain(v) for k, v in dataclasses.asdict(config).items()}


# Offline model names -> architecture of ``build_model`` (with the character tokenizer).
TINY_MODELS: dict[str, str] = {"tiny-llama": "llama", "tiny-gpt2": "gpt2"}
