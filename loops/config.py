"""Run configs: the shared model-loading fields, field documentation and ranges, YAML + overrides → a checked config.

- :class:`RunConfig`: the one declaration of the fields every language-model recipe shares
  (model and its loading, data, optimisation, evaluation, run); each recipe's ``Config``
  subclasses it and adds its own;
- :data:`FIELD_RULES`: the allowed range of fields by name (``check_config`` applies every rule
  whose field a config has);
- :func:`load_config` / :func:`config_dict`: configs from safe YAML plus overrides (unknown keys
  raise, naming the nearest field or TRL's name; values are coerced to the field types) and back
  to a plain dict."""

from __future__ import annotations

import dataclasses
import functools
import difflib
import math
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import yaml
from pydantic import ConfigDict, TypeAdapter, ValidationError

from rlcore.loops.collect import check_length_range
from rlcore.loops.engines import ENGINES, SAMPLERS
from rlcore.loops.logging import check_trackers

__all__ = ["RunConfig", "DTYPES", "TINY_MODELS", "loading_kwargs", "quantization_kwargs", "check_quantization",
           "autocast_dtype", "FIELD_RULES", "check_config", "TRL_NAMES", "load_config", "config_dict"]


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """The one declaration of the fields every language-model recipe shares: the model and how it
    is loaded (TRL's ``ModelConfig`` names), the data, the optimiser, evaluation and the run.

    A recipe's ``Config`` subclasses it and adds only its own fields, redeclaring a shared one
    only to change its default (DPO's ``lr``, the online recipes' ``batch_size``, each recipe's
    ``run_dir``); the comment after each field is its ``--help`` text (``cli.field_docs``).
    """

    # --- model (loops.recipe.build_policy) ---
    model: str = "tiny-llama"                 # "tiny-llama" / "tiny-gpt2" (offline, char tokenizer) or a local path / hub name
    hidden_size: int = 64                     # tiny models: width
    num_layers: int = 2                       # tiny models: decoder blocks
    num_heads: int = 4                        # tiny models: attention heads
    max_position_embeddings: int = 256        # tiny models: context length
    init_from: str | None = None              # start from the policy weights of a checkpoint or run directory (e.g. an SFT run)
    device: str = "cpu"                       # where models and batches live (cpu, cuda)
    dtype: str = "float32"                    # the weights' dtype: float32 | bfloat16 | float16 | auto (TRL dtype)
    attn_implementation: str | None = None    # eager | sdpa | flash_attention_2 ... (None: transformers' choice)
    revision: str | None = None               # hub revision (branch, tag or commit) of `model`
    trust_remote_code: bool = False           # run code shipped with a hub model (off: such a model is refused)
    gradient_checkpointing: bool = False      # recompute activations in the backward pass: less memory, more compute
    mixed_precision: str | None = None        # "bf16": forward and loss under torch.autocast, weights stay float32 (TRL bf16)
    use_peft: bool = False                    # train a LoRA adapter, not the weights; the reference is the base (adapter off)
    lora_r: int = 16                          # LoRA rank r
    lora_alpha: int = 32                      # LoRA scale α: the update is (α/r)·B·A
    lora_dropout: float = 0.05                # dropout on the adapter's input (only where dropout is on: disable_dropout false)
    lora_target_modules: tuple[str, ...] | None = None  # module names, or all-linear (None: peft's default for the architecture)
    lora_modules_to_save: tuple[str, ...] | None = None  # modules trained in full beside the adapter (e.g. lm_head)
    load_in_4bit: bool = False                # base weights quantised to 4 bits (bitsandbytes, CUDA; needs use_peft)
    load_in_8bit: bool = False                # base weights quantised to 8 bits (bitsandbytes, CUDA; needs use_peft)
    # --- data (loops.recipe.load_splits) ---
    task: str | None = "add"                  # a built-in task (loops.tasks) when `dataset` is None
    dataset: str | None = None                # local jsonl / json / parquet / csv file or folder, or hub name[:split]
    eval_dataset: str | None = None           # held-out file or hub name[:split]; None: `num_eval` rows split off `dataset`
    num_train: int = 256                      # built-in task: training examples (pairs, prompts)
    num_eval: int = 64                        # held-out examples
    max_prompt_length: int | None = None      # prompt tokens kept: the last ones of a longer prompt
    # --- optimisation (loops.recipe.init_train_state, loops.update.update) ---
    seed: int = 0                             # model init, data order, sampling
    steps: int = 100                          # fold steps (offline: one optimiser step each; online: prompt batches)
    batch_size: int = 16                      # rows per step: examples, pairs, or prompts (online)
    micro_batch_size: int | None = None       # rows per forward/backward (gradient accumulation); None: all
    lr: float = 1e-3                          # AdamW peak learning rate
    weight_decay: float = 0.0                 # AdamW decoupled weight decay (matrices only)
    warmup_steps: int = 0                     # optimiser steps of linear warm-up
    schedule: str = "constant"                # learning-rate schedule after warm-up: linear | cosine | constant (loops.update.SCHEDULES)
    max_grad_norm: float | None = 1.0         # global gradient-norm clip; None: off
    # --- evaluation and the run (loops.recipe.run) ---
    eval_batch_size: int = 32                 # held-out rows per evaluation batch
    run_dir: str | None = None                # checkpoints and metrics.jsonl; None writes nothing
    save_every: int = 0                       # checkpoint period in steps (0: only at the end)
    keep_last: int | None = 2                 # checkpoints kept (None: all)
    eval_every: int = 0                       # evaluation period in steps (0: never during training)
    log_every: int = 10                       # progress line period in steps
    report_to: tuple[str, ...] = ()           # trackers besides metrics.jsonl: tensorboard (run_dir/tensorboard), wandb (TRL report_to)
    resume: bool = False                      # continue from the latest checkpoint of run_dir


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


_NONE = ("none", "null", "~", "")


@functools.lru_cache(maxsize=None)
def _adapter(tp: Any) -> TypeAdapter:
    return TypeAdapter(tp, config=ConfigDict(coerce_numbers_to_str=True))


def _from_text(value: Any, tp: Any) -> Any:
    """The command line's conventions pydantic lacks: ``none`` / ``null`` / ``~`` / an empty string
    for ``None`` of an optional field, comma-separated items for a tuple or list, YAML text for a
    mapping."""
    if not isinstance(value, str):
        return value
    origin = typing.get_origin(tp)
    parts = typing.get_args(tp) if origin in (typing.Union, types.UnionType) else (tp,)
    if type(None) in parts and value.strip().lower() in _NONE:
        return None
    kinds = {typing.get_origin(p) or p for p in parts}
    if kinds & {tuple, list}:
        return [item.strip() for item in value.split(",")]
    return yaml.safe_load(value) if dict in kinds else value


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """``value`` as type ``tp``: pydantic's lax validation (numbers from text, ``true`` / ``no`` as
    bools, lists as tuples, numbers as text) after :func:`_from_text`; a bool is no number."""
    value = _from_text(value, tp)
    origin = typing.get_origin(tp)
    parts = typing.get_args(tp) if origin in (typing.Union, types.UnionType) else (tp,)
    if isinstance(value, bool) and bool not in parts and {int, float} & set(parts):
        raise ValueError(f"{where}: expected a number, got {value!r}")
    try:
        return _adapter(tp).validate_python(value)
    except ValidationError as e:
        raise ValueError(f"{where}: cannot read {value!r} as {tp}: {e.errors()[0]['msg']}") from None


# The ranges of the fields recipes share, by name: ``(allowed?, what is allowed)``. ``None`` of an
# optional field is always allowed; ``check_config`` applies every rule whose field a config has.
_AT_LEAST_1 = (lambda v: v >= 1, ">= 1")


_AT_LEAST_0 = (lambda v: v >= 0, ">= 0")


_POSITIVE = (lambda v: v > 0, "> 0")


_UNIT = (lambda v: 0 <= v <= 1, "in [0, 1]")


FIELD_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    **dict.fromkeys(["batch_size", "num_samples", "max_new_tokens", "epochs", "num_epochs", "eval_batch_size",
                     "hidden_size", "num_layers", "num_heads", "max_position_embeddings", "num_train",
                     "minibatch_size", "micro_batch_size", "max_length", "max_prompt_length", "top_k", "keep_last",
                     "rank", "sample_batch_size", "sample_num_batches_per_epoch", "sample_num_steps",
                     "train_batch_size", "train_num_inner_epochs", "num_train_timesteps", "max_workers",
                     "sample_size", "ref_model_sync_steps", "lora_r", "generation_batch_size",
                     "forward_batch_size", "overlong_buffer", "max_sampling_rounds"], _AT_LEAST_1),
    **dict.fromkeys(["steps", "num_eval", "save_every", "eval_every", "log_every", "log_completions", "warmup_steps",
                     "pretrain_steps", "lr", "weight_decay", "kl_coef", "vf_coef", "clip_eps_low", "clip_eps_high", "cliprange_value",
                     "ratio_threshold", "train_learning_rate", "pretrain_learning_rate", "train_clip_range",
                     "train_adv_clip_max", "train_adam_weight_decay", "sample_eta", "eps", "rpo_alpha", "cpo_alpha",
                     "missing_eos_penalty", "overlong_penalty_factor",
                     "center_rewards_coefficient", "per_prompt_stat_tracking_buffer_size",
                     "per_prompt_stat_tracking_min_count"], _AT_LEAST_0),
    **dict.fromkeys(["temperature", "beta", "max_grad_norm", "train_max_grad_norm", "horizon", "target",
                     "train_adam_epsilon", "discopop_tau", "desirable_weight", "undesirable_weight", "lora_alpha"],
                    _POSITIVE),
    **dict.fromkeys(["lam", "label_smoothing", "train_adam_beta1", "train_adam_beta2", "ref_model_mixup_alpha"],
                    _UNIT),
    "top_p": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "dropout": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "lora_dropout": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "train_timestep_fraction": (lambda v: 0 < v <= 1, "in (0, 1]"),
}


def check_config(config: Any) -> Any:
    """``config`` itself when every field it shares with ``FIELD_RULES`` is in range, and every entry
    of its ``loss_kwargs`` / ``advantage_kwargs`` that a rule names; else a ``ValueError`` naming
    each field (or ``loss_kwargs.<name>``) at fault, its value and what is allowed (all at once).

    ``load_config`` runs it on every config it builds and ``run`` on the config of every recipe it
    starts, so a bad value fails before any model is built (CLI, YAML) or any step is taken (Python).
    """
    faults = []
    values = [(f.name, f.name, getattr(config, f.name)) for f in dataclasses.fields(config)]
    for kwargs in ("loss_kwargs", "advantage_kwargs"):  # a loss's or an estimator's keywords by their names
        given = getattr(config, kwargs, None)
        if isinstance(given, Mapping):
            values += [(str(k), f"{kwargs}.{k}", v) for k, v in given.items()]
    for name, where, value in values:
        rule = FIELD_RULES.get(name)
        if rule is None or value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        allowed, what = rule
        if not (math.isfinite(value) and allowed(value)):
            faults.append(f"{where}: expected {what}, got {value!r}")
    for name in ("device", "ref_device", "reward_device"):
        value = getattr(config, name, None)
        if value is not None:
            try:
                torch.device(value)
            except (RuntimeError, TypeError):
                faults.append(f"{name}: expected a device such as 'cpu', 'cuda' or 'cuda:1', got {value!r}")
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
    for name, registry in (("engine", ENGINES), ("sampler", SAMPLERS)):  # the generation engine and its rule
        value = getattr(config, name, None)
        if value is not None and value not in registry:
            faults.append(f"{name}: expected one of {sorted(registry)}, got {value!r}")
    if getattr(config, "engine_options", None) and getattr(config, "engine", None) != "vllm":
        faults.append(f"engine_options: only for engine='vllm', got engine={config.engine!r}")
    if faults:
        raise ValueError(f"{type(config).__name__}: " + "; ".join(faults))
    if getattr(config, "mixed_precision", None) not in (None, "bf16"):
        raise ValueError(f"{type(config).__name__}: mixed_precision: expected 'bf16' or None, got "
                         f"{config.mixed_precision!r} (float16 autocast needs loss scaling, which is not offered)")
    if getattr(config, "dtype", "float32") not in DTYPES:
        raise ValueError(f"{type(config).__name__}: dtype: expected one of {list(DTYPES)}, got {config.dtype!r}")
    check_trackers(getattr(config, "report_to", ()))
    if isinstance(config, RunConfig):  # a language-model recipe's (DDPO's config loads no such model)
        check_quantization(config)
    return config


# TRL's names for the fields of rlcore's recipes (a config written for TRL gets "did you mean" for them).
# Batch sizes are absent on purpose: TRL's count completions per device, rlcore's ``batch_size`` prompts
# (docs/from_trl.md); gradient accumulation maps to ``micro_batch_size``, which sets rows per forward.
TRL_NAMES: dict[str, tuple[str, ...]] = {
    "learning_rate": ("lr",), "max_steps": ("steps",), "num_train_epochs": ("steps", "num_epochs"),
    "save_steps": ("save_every",), "eval_steps": ("eval_every",), "logging_steps": ("log_every",),
    "output_dir": ("run_dir",), "save_total_limit": ("keep_last",), "num_generations": ("num_samples",),
    "max_completion_length": ("max_new_tokens", "max_length"), "response_length": ("max_new_tokens",),
    "beta": ("kl_coef", "beta"), "model_name_or_path": ("model",), "resume_from_checkpoint": ("resume",),
    "lr_scheduler_type": ("schedule",), "num_iterations": ("epochs",), "ppo_epochs": ("epochs",),
    "cliprange": ("clip_eps_low", "clip_eps_high"), "epsilon": ("clip_eps_low", "clip_eps_high"),
    "kl_penalty": ("kl",), "init_kl_coef": ("kl_coef",), "adap_kl_ctrl": ("kl_controller",),
    "dataset_name": ("dataset",), "loss_type": ("loss_type", "loss"), "reward_model_path": ("reward_model",),
    "sft_model_path": ("init_from",), "gradient_accumulation_steps": ("micro_batch_size",),
    "epsilon_high": ("clip_eps_high",), "train_dataset": ("dataset",), "num_completions_to_print": ("log_completions",),
    "torch_dtype": ("dtype",), "model_revision": ("revision",), "bf16": ("mixed_precision",),
}


def _did_you_mean(key: str, fields: Mapping[str, Any]) -> str:
    """A hint for an unknown config key: the field TRL's name maps to, else the closest field names."""
    mapped = [f for f in TRL_NAMES.get(key, ()) if f in fields and f != key]
    if mapped:
        return f"did you mean {' or '.join(repr(f) for f in mapped)} (TRL's {key})?"
    close = difflib.get_close_matches(key, list(fields), n=2, cutoff=0.75)
    return f"did you mean {' or '.join(repr(f) for f in close)}?" if close else ""


def load_config(cls: type, path: str | Path | None = None, overrides: Mapping[str, Any] | None = None) -> Any:
    """A ``cls`` (frozen dataclass) from a YAML file (``yaml.safe_load``) and overrides.

    ``overrides`` (e.g. parsed ``--field value`` pairs, strings allowed) win over the file; both
    may give any subset of the fields, the rest keep their defaults. Values are coerced to the
    field types (``"1e-4"`` → float, ``"true"`` → bool, ``"null"`` → None for optional fields).

    Raises:
        ValueError: an unknown key (the message lists the valid fields), a value that does not fit
            its field's type, or a YAML file whose top level is not a mapping.
    """
    raw: dict[str, Any] = {}
    if path is not None:
        loaded = yaml.safe_load(Path(path).read_text())
        if loaded is not None and not isinstance(loaded, Mapping):
            raise ValueError(f"{path}: expected a mapping of field: value, got {type(loaded).__name__}")
        raw.update(loaded or {})
    raw.update(overrides or {})
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        hints = "".join(f"; {k}: {hint}" for k in unknown if (hint := _did_you_mean(k, fields)))
        raise ValueError(f"{path or cls.__name__}: unknown keys {unknown}{hints}; valid fields of {cls.__name__}: "
                         f"{sorted(fields)}")
    hints = typing.get_type_hints(cls)
    return check_config(cls(**{k: _coerce(v, hints[k], f"{cls.__name__}.{k}") for k, v in raw.items()}))


def config_dict(config: Any) -> dict[str, Any]:
    """The fields of a config dataclass as a plain dict (tuples become lists: JSON / YAML ready)."""
    def plain(v: Any) -> Any:
        return [plain(x) for x in v] if isinstance(v, (tuple, list)) else v
    return {k: plain(v) for k, v in dataclasses.asdict(config).items()}


# Offline model names -> architecture of ``build_model`` (with the character tokenizer).
TINY_MODELS: dict[str, str] = {"tiny-llama": "llama", "tiny-gpt2": "gpt2"}
