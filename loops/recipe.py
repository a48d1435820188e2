"""Scaffolding shared by every recipe: models from a config, data splits and sources, the run.

A recipe module (``loops/recipes/sft.py``, ``loops/recipes/dpo.py``, ...) is a frozen ``Config`` dataclass, a
``step(state, batch) -> (state, metrics)`` that reads collect → score → update, and
``train(config) -> (state, history)`` built from these pieces:

- :func:`build_policy`: ``(model, tokenizer)`` from ``config.model`` (``"tiny-llama"`` /
  ``"tiny-gpt2"``: an offline model from the config's size fields with the character tokenizer;
  anything else: a local path or hub name), optionally with the weights of a checkpoint
  (``config.init_from``);
- :func:`init_train_state`: AdamW over the trainable model(s) and the learning-rate schedule;
- :func:`load_splits` and :func:`batch_source`: the train / held-out datasets (a built-in task
  or local files) and a deterministic, resumable stream of collated batches over epochs;
- :func:`mean_metrics`: row-weighted means of per-batch metrics over an evaluation split;
- :func:`run`: ``fold`` with the standard callbacks wired from the config: evaluation every
  ``eval_every`` steps (merged into the metrics as ``eval/<name>``), a ``Checkpointer`` every
  ``save_every`` steps keeping ``keep_last``, JSONL + progress logging, and a resume from the
  latest checkpoint of ``run_dir`` when ``resume``;
- :func:`load_config` / :func:`config_dict`: configs from safe YAML plus overrides (unknown keys
  raise, values are coerced to the field types) and back to a plain dict.

Fields read from a config, with the defaults used when a recipe's ``Config`` lacks them:
``model``, ``hidden_size`` (64), ``num_layers`` (2), ``num_heads`` (4),
``max_position_embeddings`` (256), ``init_from`` (None), ``device`` ("cpu"), ``seed``, ``lr``,
``weight_decay`` (0), ``warmup_steps`` (0), ``schedule`` ("constant"), ``task``, ``dataset``,
``eval_dataset`` (None), ``num_train`` (256), ``num_eval`` (64), ``run_dir``, ``save_every``,
``keep_last``, ``eval_every``, ``log_every``, ``resume``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import itertools
import json
import math
import random
import types
import typing
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import yaml
from datasets import Dataset
from torch import nn

from rlcore.loops.collect import check_length_range
from rlcore.loops.checkpoint import (Checkpointer, check_resume, latest_checkpoint, resume, run_dir_lock,
                                     verify_checkpoint)
from rlcore.loops.data import load_source
from rlcore.loops.scale.distributed import is_main, shard_source
from rlcore.loops.fold import every, fold, to_floats
from rlcore.loops.logging import check_trackers, make_loggers
from rlcore.loops.lora import adapter_off, apply_lora, is_adapter_dir, is_peft, with_adapter
from rlcore.loops.models import (build_model, build_tokenizer, disable_dropout, load_model, load_tokenizer,
                                 make_reference)
from rlcore.loops.state import TrainState, init_state
from rlcore.loops.update import enable_gradient_checkpointing, make_optimizer, make_scheduler

__all__ = ["ModelLoading", "DTYPES", "loading_kwargs", "quantization_kwargs", "check_quantization", "autocast_dtype", "TINY_MODELS", "FIELD_DOCS", "build_reference", "FIELD_RULES",
           "TRL_NAMES", "check_config", "build_policy", "policy_tokenizer", "checkpoint_model_dir", "init_train_state",
           "load_splits", "batch_source", "mean_metrics", "run", "load_config", "config_dict"]

# What the fields shared by the recipes' configs mean (a field's own comment, where written, wins).
FIELD_DOCS: dict[str, str] = {
    "model": '"tiny-llama" / "tiny-gpt2" (offline, char tokenizer) or a local path / hub name',
    "hidden_size": "tiny models: width", "num_layers": "tiny models: decoder blocks",
    "num_heads": "tiny models: attention heads", "max_position_embeddings": "tiny models: context length",
    "init_from": "start from the policy weights of a checkpoint or run directory",
    "device": "where models and batches live (cpu, cuda)",
    "task": "a built-in task (loops.tasks) when no dataset is given",
    "dataset": "a local jsonl / json / parquet / csv file or folder, or a hub name[:split]",
    "eval_dataset": "held-out file or hub name[:split] (default: split off dataset)",
    "num_train": "built-in task: training examples", "num_eval": "held-out examples",
    "max_length": "tokens kept per sequence", "max_prompt_length": "prompt tokens kept",
    "seed": "model init, data order, sampling", "steps": "fold steps", "batch_size": "examples per step",
    "micro_batch_size": "rows per forward/backward (gradient accumulation); None: all",
    "lr": "AdamW peak learning rate", "weight_decay": "AdamW decoupled weight decay (matrices only)",
    "warmup_steps": "optimiser steps of linear warm-up", "schedule": "linear | cosine | constant (loops.update.SCHEDULES)",
    "max_grad_norm": "global gradient-norm clip; None: off", "agg": "token aggregation (rlcore.masked.AGGREGATIONS)",
    "eval_batch_size": "held-out examples per evaluation batch",
    "run_dir": "checkpoints and metrics.jsonl; None writes nothing", "save_every": "checkpoint period in steps (0: at the end)",
    "keep_last": "checkpoints kept (None: all)", "eval_every": "evaluation period in steps (0: never during training)",
    "log_every": "progress line period in steps",
    "resume": "continue from the latest checkpoint of run_dir",
    "report_to": 'trackers besides metrics.jsonl: "tensorboard" (run_dir/tensorboard), "wandb" (TRL report_to)',
}

@dataclasses.dataclass(frozen=True)
class ModelLoading:
    """How a recipe loads its models: one declaration the recipes' configs share (TRL's
    ``ModelConfig`` names). ``build_policy``, ``build_reference`` and the online recipes' reward
    model read it."""

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


DTYPES = ("float32", "bfloat16", "float16", "auto")


def loading_kwargs(config: Any) -> dict[str, Any]:
    """The ``from_pretrained`` keywords of ``config``'s ``ModelLoading`` fields (those it has)."""
    kwargs = {"dtype": _get(config, "dtype", "float32"), "trust_remote_code": _get(config, "trust_remote_code", False)}
    for name in ("attn_implementation", "revision"):
        if _get(config, name) is not None:
            kwargs[name] = _get(config, name)
    return kwargs


def quantization_kwargs(config: Any) -> dict[str, Any]:
    """The ``from_pretrained`` ``quantization_config`` of ``load_in_4bit`` / ``load_in_8bit``
    (bitsandbytes; 4 bits as NF4 with the compute in ``dtype``, bfloat16 for float32 / auto), or
    ``{}``. ``check_config`` has refused the cases bitsandbytes cannot serve."""
    if not (_get(config, "load_in_4bit", False) or _get(config, "load_in_8bit", False)):
        return {}
    from transformers import BitsAndBytesConfig

    dtype = _get(config, "dtype", "float32")
    compute = getattr(torch, dtype) if dtype in ("bfloat16", "float16") else torch.bfloat16
    return {"quantization_config": BitsAndBytesConfig(
        load_in_4bit=config.load_in_4bit, load_in_8bit=config.load_in_8bit, bnb_4bit_quant_type="nf4",
        bnb_4bit_compute_dtype=compute)}


def check_quantization(config: Any) -> None:
    """Refuse ``load_in_4bit`` / ``load_in_8bit`` where they cannot work, before any model is built:
    both at once, without ``use_peft`` (quantised weights do not train), on a model built from a
    config (``TINY_MODELS``: nothing to quantise on load), off CUDA, or without bitsandbytes."""
    four, eight = _get(config, "load_in_4bit", False), _get(config, "load_in_8bit", False)
    if not (four or eight):
        return
    where = f"{type(config).__name__}: load_in_{4 if four else 8}bit"
    if four and eight:
        raise ValueError(f"{type(config).__name__}: load_in_4bit and load_in_8bit: choose one")
    if not _get(config, "use_peft", False):
        raise ValueError(f"{where}: quantised weights do not train; set use_peft to train a LoRA adapter on them")
    if _get(config, "model", "tiny-llama") in TINY_MODELS:
        raise ValueError(f"{where}: {config.model!r} is built from a config, not loaded; quantisation applies to a "
                         "model folder or hub name")
    if not str(_get(config, "device", "cpu")).startswith("cuda"):
        raise ValueError(f"{where}: bitsandbytes quantisation runs on CUDA here; device is {config.device!r}")
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise ValueError(f"{where}: needs the bitsandbytes package (pip install bitsandbytes)") from None


def autocast_dtype(config: Any) -> torch.dtype | None:
    """The ``update(autocast_dtype=)`` of ``config.mixed_precision``: ``torch.bfloat16`` for ``"bf16"``,
    else ``None``. (float16 autocast without loss scaling underflows gradients: not offered.)"""
    return torch.bfloat16 if _get(config, "mixed_precision") == "bf16" else None


def _as_loaded(model: nn.Module, config: Any) -> nn.Module:
    """A model built from a config (the tiny ones) given the loading fields a checkpoint folder
    would get from ``from_pretrained``: dtype, attention implementation, gradient checkpointing."""
    dtype = _get(config, "dtype", "float32")
    if dtype not in ("float32", "auto"):
        model = model.to(getattr(torch, dtype))
    if _get(config, "attn_implementation") is not None:
        model.set_attn_implementation(config.attn_implementation)
    return model


# Offline model names -> architecture of ``build_model`` (with the character tokenizer).
TINY_MODELS: dict[str, str] = {"tiny-llama": "llama", "tiny-gpt2": "gpt2"}


def _get(config: Any, name: str, default: Any = None) -> Any:
    return getattr(config, name, default)


# --- models ------------------------------------------------------------------------------------
def checkpoint_model_dir(path: str | Path, name: str = "policy") -> Path:
    """The weights directory of model ``name`` in a checkpoint (``checkpoint-N``) or in the latest
    checkpoint of a run directory, after ``verify_checkpoint``. Raises ``FileNotFoundError`` saying
    what was looked for, ``CheckpointError`` for a checkpoint that fails verification."""
    path = Path(path)
    if not (path / "manifest.json").is_file():
        latest = latest_checkpoint(path)
        if latest is None:
            raise FileNotFoundError(f"init_from: {path} is neither a checkpoint (no manifest.json) nor a "
                                    "run directory holding one")
        path = latest
    model_dir = path / "models" / name
    if not model_dir.is_dir():
        raise FileNotFoundError(f"init_from: {path} stores no model {name!r} (looked for {model_dir})")
    verify_checkpoint(path)  # sizes and SHA-256 of every file, nothing outside the folder
    return model_dir


def build_reference(config: Any, policy: nn.Module) -> nn.Module:
    """The frozen reference of a run, on ``config.ref_device`` (default: the policy's device): a
    copy of ``policy`` (``make_reference``; for a LoRA policy
    the policy itself with its adapters disabled, ``loops.lora.adapter_off``: no copy), or the model
    ``config.ref_model`` names (TRL's ``ref_model``: a local model folder, a checkpoint or a run
    directory, its policy verified), frozen, dropout off, on the policy's device.

    Raises:
        ValueError: a reference whose vocabulary differs from the policy's (their log-probs
            would not be of the same tokens).
    """
    path, device = _get(config, "ref_model"), _get(config, "ref_device")
    if not path:
        if is_peft(policy):
            if device is not None and torch.device(device) != next(policy.parameters()).device:
                raise ValueError(f"ref_device: {device!r}: the reference of a LoRA policy is the policy itself with "
                                 "its adapter off, on the policy's device; give a ref_model to place one elsewhere")
            return adapter_off(policy)
        return make_reference(policy).to(device) if device is not None else make_reference(policy)
    source = Path(path)
    if (source / "manifest.json").is_file() or latest_checkpoint(source) is not None:
        source = checkpoint_model_dir(source)
    ref = load_model(str(source), task="causal_lm", **loading_kwargs(config))
    sizes = [m.get_output_embeddings().weight.shape[0] for m in (policy, ref)]
    if sizes[0] != sizes[1]:
        raise ValueError(f"ref_model: {path} has a vocabulary of {sizes[1]} tokens, the policy {sizes[0]}; the "
                         "reference must share the policy's tokenizer")
    disable_dropout(ref)
    return ref.to(device or next(policy.parameters()).device).eval().requires_grad_(False)


def policy_tokenizer(config: Any) -> Any:
    """The tokenizer of ``config.model``: the character tokenizer for ``TINY_MODELS``, else
    ``load_tokenizer(config.model)`` (pad token set)."""
    name = _get(config, "model", "tiny-llama")
    if name in TINY_MODELS:
        return build_tokenizer()
    revision = _get(config, "revision")
    return load_tokenizer(name, trust_remote_code=_get(config, "trust_remote_code", False),
                          **({"revision": revision} if revision else {}))


def build_policy(config: Any, *, task: str | None = None, depth: int = 0) -> tuple[nn.Module, Any]:
    """The model and tokenizer a config names, offline for the tiny ones.

    ``config.model`` in ``TINY_MODELS``: ``build_model(arch, tokenizer=build_tokenizer(),
    hidden_size=, num_layers=, num_heads=, max_position_embeddings=, seed=)`` (dropout off).
    Otherwise ``load_model(config.model, task=task)`` and its tokenizer. With ``config.init_from``
    (a checkpoint directory, or a run directory: its latest checkpoint) the weights of the
    checkpoint's ``policy`` are loaded instead (same tokenizer, architecture from the stored
    config; a checkpoint holding a LoRA adapter: the adapter merged into the base its run
    started from). With ``config.use_peft`` the model then gets a fresh LoRA adapter
    (``loops.lora.apply_lora``; a policy or reward model, not a value model), so a run started
    from a checkpoint has that checkpoint's policy as its reference. Dropout is set to 0
    (``disable_dropout``, the adapter's included) unless ``config.disable_dropout`` is False
    (the SFT and reward recipes' default, as TRL's trainers: ``update`` then trains with the
    model's dropout). The model is moved to ``config.device``.

    Args:
        config: any object with the fields above (a recipe's ``Config``).
        task: ``"causal_lm"`` (policy), ``"reward"`` (one-label sequence classifier) or
            ``"value"`` (one-label token classifier), as ``loops.models.TASKS``; default: the
            config class's ``MODEL_TASK`` attribute (a ``ClassVar``, not a field; the reward
            recipe sets ``"reward"``), else ``"causal_lm"``.
    Returns:
        ``(model, tokenizer)``; the tokenizer has a pad token.
    """
    if dataclasses.is_dataclass(config):
        check_config(config)  # before any model is built
    task = task or getattr(type(config), "MODEL_TASK", "causal_lm")
    name = _get(config, "model", "tiny-llama")
    init_from = _get(config, "init_from")
    tokenizer = policy_tokenizer(config)
    loading = loading_kwargs(config)
    if init_from:
        model = _checkpoint_policy(config, checkpoint_model_dir(init_from), task, depth)
    elif name in TINY_MODELS:
        model = build_model(TINY_MODELS[name], tokenizer=tokenizer, hidden_size=_get(config, "hidden_size", 64),
                            num_layers=_get(config, "num_layers", 2), num_heads=_get(config, "num_heads", 4),
                            max_position_embeddings=_get(config, "max_position_embeddings", 256),
                            seed=_get(config, "seed", 0), task=task, tie_word_embeddings=task == "causal_lm")
        model = _as_loaded(model, config)
    else:
        model = load_model(name, task=task, **_head_kwargs(task), **loading, **quantization_kwargs(config))
    if task != "causal_lm" and model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    if _get(config, "gradient_checkpointing", False) and not enable_gradient_checkpointing(model):
        raise ValueError(f"gradient_checkpointing: {type(model).__name__} offers no gradient checkpointing "
                         "(gradient_checkpointing_enable)")
    if _get(config, "use_peft", False) and task in _LORA_TASKS:
        model = apply_lora(model, config, task=task)
    if _get(config, "disable_dropout", True):
        disable_dropout(model)  # after the adapter: its dropout too
    return model.to(_get(config, "device", "cpu")), tokenizer


def _head_kwargs(task: str) -> dict[str, Any]:
    """``from_pretrained`` keywords of a task's head: one label for a reward or value model."""
    return {} if task == "causal_lm" else {"num_labels": 1}


# The models ``use_peft`` puts an adapter on: the policy and a reward model. A separate PPO value
# model trains in full, as TRL's.
_LORA_TASKS = ("causal_lm", "reward")

# The fields that say which base model a checkpoint's weights (or adapter) belong to.
_BASE_FIELDS = ("model", "revision", "hidden_size", "num_layers", "num_heads", "max_position_embeddings", "seed",
                "init_from")


class _BaseOf:
    """``config`` with the base-model fields of a checkpoint's stored config (the model an adapter
    was trained on; each checked for its type and range, an absent one the caller's), no adapter
    and no gradient checkpointing of its own. Everything that runs code or moves data
    (``trust_remote_code``, ``device``, dtype) stays the caller's."""

    def __init__(self, config: Any, stored: Mapping[str, Any], where: Path):
        self._config = config
        base = {k: stored.get(k) for k in _BASE_FIELDS}
        for name, value in base.items():  # the stored config is a file: typed and ranged before use
            if value is None:
                continue
            if name in ("model", "revision", "init_from"):
                ok, what = isinstance(value, str), "a string"
            else:
                rule, what = FIELD_RULES.get(name, (lambda v: True, ""))
                ok = isinstance(value, int) and not isinstance(value, bool) and rule(value)
                what = f"an int {what}".strip()
            if not ok:
                raise ValueError(f"init_from: {where}: {name}: expected {what}, got {value!r}")
        self._fields = {**{k: v for k, v in base.items() if v is not None or k in ("revision", "init_from")},
                        "use_peft": False, "gradient_checkpointing": False, "disable_dropout": True}

    def __getattr__(self, name: str) -> Any:
        fields = self.__dict__["_fields"]
        return fields[name] if name in fields else getattr(self.__dict__["_config"], name)


def _checkpoint_policy(config: Any, model_dir: Path, task: str, depth: int) -> nn.Module:
    """The weights of a checkpoint's model folder: full weights as saved (``from_pretrained``), or
    an adapter merged into the base its run was trained on (that run's own ``init_from`` followed,
    at most ``_MAX_ADAPTER_CHAIN`` deep)."""
    loading = {k: v for k, v in loading_kwargs(config).items() if k != "revision"}  # the hub model's, not ours
    if not is_adapter_dir(model_dir):
        return load_model(str(model_dir), task=task, **_head_kwargs(task), **loading)
    if depth >= _MAX_ADAPTER_CHAIN:
        raise ValueError(f"init_from: {model_dir} is an adapter whose base is an adapter, {depth} deep; "
                         "export the chain merged (rlcore export) and start from that")
    stored_path = model_dir.parent.parent / "config.json"
    try:
        stored = json.loads(stored_path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"init_from: {model_dir} holds an adapter but {stored_path} (its run's config, naming "
                         f"the base model) is unreadable: {e}") from e
    if not isinstance(stored, dict):
        raise ValueError(f"init_from: {stored_path}: expected a mapping, got {type(stored).__name__}")
    base, _ = build_policy(_BaseOf(config, stored, stored_path), task=task, depth=depth + 1)
    return with_adapter(base, model_dir)


_MAX_ADAPTER_CHAIN = 8


def init_train_state(models: Mapping[str, nn.Module], config: Any, *, trainable: Sequence[str] = ("policy",),
                     total_steps: int | None = None) -> TrainState:
    """A fresh ``TrainState``: AdamW (``lr``, ``weight_decay``) over the trainable models and a
    warm-up + ``schedule`` learning-rate scheduler over ``total_steps`` optimiser steps
    (default ``config.steps``); the loop generator (on the CPU) seeded with ``config.seed``.

    Models not in ``trainable`` (a frozen reference) are stored as they are.
    """
    optimizer = make_optimizer({n: models[n] for n in trainable}, lr=config.lr,
                               weight_decay=_get(config, "weight_decay", 0.0))
    scheduler = make_scheduler(optimizer, total_steps=total_steps or config.steps,
                               warmup_steps=_get(config, "warmup_steps", 0), kind=_get(config, "schedule", "constant"))
    return init_state(dict(models), optimizer=optimizer, scheduler=scheduler, seed=_get(config, "seed", 0))


# --- data --------------------------------------------------------------------------------------
def load_splits(config: Any, make_task: Callable[..., Dataset]) -> tuple[Dataset, Dataset]:
    """``(train, eval)`` datasets: a built-in task, local files or hub datasets.

    - ``config.dataset`` set: ``load_source(dataset)`` (a local file or directory, or a hub name
      ``namespace/name[:split]``); the held-out split is ``load_source(config.eval_dataset)`` when
      given, else ``num_eval`` rows split off the data with a seeded shuffle
      (``train_test_split(seed=config.seed)``).
    - otherwise ``make_task(config.task, n, seed=config.seed, split=...)`` (``task_dataset`` or
      ``preference_dataset``) with ``n = num_train`` / ``num_eval``: disjoint prompts.
    """
    seed, n_eval = _get(config, "seed", 0), _get(config, "num_eval", 64)
    if _get(config, "dataset"):
        data = load_source(config.dataset)
        if _get(config, "eval_dataset"):
            return data, load_source(config.eval_dataset)
        if not 0 < n_eval < len(data):
            raise ValueError(f"num_eval: expected 0 < num_eval < {len(data)} (rows of {config.dataset}) to hold "
                             f"rows out, got {n_eval}; or pass eval_dataset")
        parts = data.train_test_split(test_size=n_eval, seed=seed, shuffle=True)
        return parts["train"], parts["test"]
    task = _get(config, "task")
    if not task:
        raise ValueError("config: set `task` (a built-in task name) or `dataset` (a local jsonl/json/parquet/csv)")
    return (make_task(task, _get(config, "num_train", 256), seed=seed, split="train"),
            make_task(task, n_eval, seed=seed, split="eval"))


def batch_source(dataset: Dataset, batch_size: int, collate_fn: Callable[[dict], Any], *, seed: int = 0,
                 shuffle: bool = True) -> Callable[[int], Iterator]:
    """A resumable ``fold`` source: ``source(start)`` yields ``collate_fn(rows)`` from batch ``start`` on.

    Epoch ``e`` visits the rows in the order of ``random.Random(seed + e)`` (when ``shuffle``) in
    full batches of ``batch_size`` (the remainder of an epoch is dropped), forever; ``start``
    skips whole batches by arithmetic, without collating them. ``rows`` is a dict of columns
    (``dataset[indices]``).

    Raises ``ValueError`` when the dataset holds fewer than ``batch_size`` rows.
    """
    n = len(dataset)
    if not isinstance(batch_size, int) or not 1 <= batch_size <= n:
        raise ValueError(f"batch_size: expected an int in [1, {n}] (rows of the dataset), got {batch_size!r}")
    per_epoch = n // batch_size

    def order(epoch: int) -> list[int]:
        idx = list(range(n))
        if shuffle:
            random.Random(seed + epoch).shuffle(idx)
        return idx

    def source(start: int) -> Iterator:
        for epoch in itertools.count(start // per_epoch):
            idx = order(epoch)
            first = start % per_epoch if epoch == start // per_epoch else 0
            for b in range(first, per_epoch):
                yield collate_fn(dataset[idx[b * batch_size:(b + 1) * batch_size]])

    return source


def mean_metrics(results: Iterable[tuple[int, Mapping[str, Any]]]) -> dict[str, float]:
    """Row-weighted means of per-batch metrics, ``m = Σ_i n_i·m_i / Σ_i n_i``, as floats.

    ``results`` yields ``(rows n_i, metrics m_i)`` per batch of an evaluation split (metrics: a
    mapping or TensorDict of scalars, nested keys joined with ``/``); a key missing from some
    batches is averaged over the batches that have it. One synchronisation at the end.

    >>> mean_metrics([(1, {"acc": torch.tensor(1.0)}), (3, {"acc": torch.tensor(0.0)})])
    {'acc': 0.25}
    """
    sums: dict[str, Any] = {}
    rows: dict[str, int] = {}
    for n, metrics in results:
        items = metrics.items(include_nested=True, leaves_only=True) if hasattr(metrics, "batch_size") \
            else metrics.items()
        for key, value in items:
            name = "/".join(key) if isinstance(key, tuple) else key
            value = torch.as_tensor(value).detach().double()
            sums[name] = sums.get(name, 0.0) + n * value
            rows[name] = rows.get(name, 0) + n
    return to_floats({k: v / rows[k] for k, v in sums.items()})


# --- the run -----------------------------------------------------------------------------------
def run(step: Callable, state: TrainState, source: Iterable | Callable[[int], Iterable], *, config: Any,
        num_steps: int, eval_fn: Callable[[TrainState], Mapping[str, float]] | None = None,
        name: str | None = None, callbacks: Sequence[Callable] = (), tokenizer: Any = None,
        save_models: Sequence[str] | None = None) -> tuple[TrainState, list[dict[str, float]]]:
    """``fold(step, state, source)`` with the standard callbacks of a recipe, from ``config``.

    In order after each step: ``callbacks`` (extra ones, first); ``eval_fn(state)`` every
    ``eval_every`` steps, its results merged into the step's metrics as ``eval/<key>``; then, when
    ``run_dir`` is set, ``make_loggers`` (``run_dir/metrics.jsonl``, a progress line every
    ``log_every`` steps, the trackers of ``report_to``) and a ``Checkpointer`` every
    ``save_every`` steps and after the last one, keeping ``keep_last``. With ``resume`` the state
    is first restored from the latest checkpoint of ``run_dir`` (if any; ``check_resume`` refuses
    another recipe's run or changed settings) and the fold continues from its ``step`` to
    ``num_steps``. The main rank holds ``run_dir``'s lock (``run_dir_lock``) for the whole run: a
    second writer gets an error.
    ``eval_every`` of 0 (or None) never evaluates, ``save_every`` of 0 saves at the end only;
    ``run_dir`` None or ``""`` writes nothing (no checkpoint, no log file).

    Args:
        step: ``(state, item) -> (state, metrics)``.
        state: the fresh ``TrainState`` (the template a checkpoint is loaded into).
        source: an iterable or a resumable ``start -> iterable`` (``batch_source``).
        num_steps: the step the run ends at.
        name: the recipe's name (progress line, model card); default: the config class's module.
        tokenizer: saved in every checkpoint beside the policy (``save_checkpoint``).
        save_models: frozen models that change during the run (a TR-DPO reference), saved in every
            checkpoint and restored on resume besides the trainable ones.
    Returns:
        ``(state, history)`` of ``fold``.
    """
    if dataclasses.is_dataclass(config):
        check_config(config)
    name = name or type(config).__module__.rsplit(".", 1)[-1]
    run_dir = _get(config, "run_dir")
    settings = {**config_dict(config), "recipe": name} if dataclasses.is_dataclass(config) else {"recipe": name}
    with run_dir_lock(run_dir) if run_dir and is_main() else contextlib.nullcontext():
        latest = latest_checkpoint(run_dir) if run_dir and _get(config, "resume", False) else None
        if latest is not None:
            check_resume(latest, settings, name)
            state = resume(run_dir, state)
        cbs = list(callbacks)
        eval_every = _get(config, "eval_every", 0)
        if eval_fn is not None and eval_every:
            cbs.append(every(eval_every, lambda s, m: {f"eval/{k}": v for k, v in eval_fn(s).items()}))
        if run_dir:
            if is_main():  # under torchrun, rank 0 logs (checkpoints handle ranks themselves)
                cbs += make_loggers(run_dir, total=num_steps, stage=name,
                                    progress_every=_get(config, "log_every", 10) or 10,
                                    report_to=_get(config, "report_to", ()), config=settings,
                                    device=_get(config, "device", "cpu"))
            # after the loggers: a step's line is written before its checkpoint, so a run killed between
            # the two resumes from the previous checkpoint and logs that step once
            saved = None
            if save_models:
                trainable = [n for n, m in state.models.items() if any(p.requires_grad for p in m.parameters())]
                saved = {n: state.models[n] for n in dict.fromkeys([*trainable, *save_models])}
            cbs.append(Checkpointer(run_dir, every=_get(config, "save_every", 0) or max(num_steps, 1),
                                    keep_last=_get(config, "keep_last"), config=settings, tokenizer=tokenizer,
                                    models=saved))
        # Under torchrun each item of the source is the global batch and every rank takes its share.
        return fold(step, state, shard_source(source), num_steps=num_steps, callbacks=cbs)


# --- configs -----------------------------------------------------------------------------------
_TRUE, _FALSE, _NONE = ("true", "yes", "on", "1"), ("false", "no", "off", "0"), ("none", "null", "~", "")


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """``value`` as type ``tp`` (int, float, bool, str, Optional / unions, tuples, lists, dicts: a
    mapping, or its YAML text)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if type(None) in args and (value is None or (isinstance(value, str) and value.strip().lower() in _NONE)):
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, arg, where)
            except (TypeError, ValueError) as e:
                errors.append(str(e))
        raise ValueError(f"{where}: cannot read {value!r} as {tp}: {'; '.join(errors)}")
    if origin in (tuple, list):
        items = [s.strip() for s in value.split(",")] if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)):
            raise ValueError(f"{where}: expected a list for {tp}, got {value!r}")
        fixed = origin is tuple and args and args[-1] is not Ellipsis
        item_types = args if fixed else (args[:1] or (Any,)) * len(items)
        if len(item_types) != len(items):
            raise ValueError(f"{where}: expected {len(item_types)} items for {tp}, got {len(items)}")
        return origin(_coerce(v, t, where) for v, t in zip(items, item_types))
    if tp is Any or tp is None:
        return value
    if value is None:
        raise ValueError(f"{where}: None is not a valid {getattr(tp, '__name__', tp)}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in _TRUE or text in _FALSE:
            return text in _TRUE
        raise ValueError(f"{where}: expected a bool (true/false), got {value!r}")
    if tp in (int, float):
        try:
            if isinstance(value, bool):
                raise ValueError("a bool")
            number = float(value) if tp is float or (isinstance(value, str) and any(c in value for c in ".eE")) \
                else int(value)
            if tp is int and isinstance(number, float) and not number.is_integer():
                raise ValueError("not integral")
        except (TypeError, ValueError):
            raise ValueError(f"{where}: expected {'an int' if tp is int else 'a float'}, got {value!r}") from None
        return tp(number)
    if tp is str:
        return value if isinstance(value, str) else str(value)
    if tp is dict or origin is dict:
        loaded = yaml.safe_load(value) if isinstance(value, str) else value
        if not isinstance(loaded, Mapping):
            raise ValueError(f"{where}: expected a mapping (e.g. '{{key: value}}'), got {value!r}")
        return dict(loaded)
    return value


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
                     "forward_batch_size", "overlong_buffer"], _AT_LEAST_1),
    **dict.fromkeys(["steps", "num_eval", "save_every", "eval_every", "log_every", "log_completions", "warmup_steps",
                     "pretrain_steps", "lr", "weight_decay", "kl_coef", "vf_coef", "clip_eps_low", "clip_eps_high", "cliprange_value",
                     "ratio_threshold", "train_learning_rate", "pretrain_learning_rate", "train_clip_range",
                     "train_adv_clip_max", "train_adam_weight_decay", "sample_eta", "rpo_alpha", "cpo_alpha",
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
    """``config`` itself when every field it shares with ``FIELD_RULES`` is in range; else a
    ``ValueError`` naming each field at fault, its value and what is allowed (all of them at once).

    ``load_config`` runs it on every config it builds and ``run`` on the config of every recipe it
    starts, so a bad value fails before any model is built (CLI, YAML) or any step is taken (Python).
    """
    faults = []
    for f in dataclasses.fields(config):
        rule, value = FIELD_RULES.get(f.name), getattr(config, f.name)
        if rule is None or value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        allowed, what = rule
        if not (math.isfinite(value) and allowed(value)):
            faults.append(f"{f.name}: expected {what}, got {value!r}")
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
    if faults:
        raise ValueError(f"{type(config).__name__}: " + "; ".join(faults))
    if getattr(config, "mixed_precision", None) not in (None, "bf16"):
        raise ValueError(f"{type(config).__name__}: mixed_precision: expected 'bf16' or None, got "
                         f"{config.mixed_precision!r} (float16 autocast needs loss scaling, which is not offered)")
    if getattr(config, "dtype", "float32") not in DTYPES:
        raise ValueError(f"{type(config).__name__}: dtype: expected one of {list(DTYPES)}, got {config.dtype!r}")
    check_trackers(getattr(config, "report_to", ()))
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
