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
  latest checkpoint of ``run_dir`` when ``resume``.

Each reads the fields of ``rlcore.loops.config.RunConfig``, the base of every language-model
recipe's ``Config`` (``run`` only its run fields, which the DDPO config has too).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
import random
import re
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import torch
from datasets import Dataset
from torch import nn
from transformers import GenerationConfig, PreTrainedModel

from rlcore.loops.checkpoint import Checkpointer, latest_checkpoint, resume, verify_checkpoint
from rlcore.loops.run_dir import LOCK_NAME, check_resume, open_run_dir
from rlcore.loops.config import RunConfig, TINY_MODELS, config_dict, ensure_checked, loading_kwargs, quantization_kwargs
from rlcore.loops.data import load_source, split_held_out
from rlcore.loops.fold import Interrupted, every, fold, follow_live_memory, to_floats
from rlcore.loops.logging import make_loggers
from rlcore.loops.lora import adapter_off, apply_lora, check_adapter_fits, is_adapter_dir, is_peft, with_adapter
from rlcore.loops.checkpoint_codec import CheckpointError, check_safetensors, read_json
from rlcore.loops.checkpoint_shards import is_sharded_folder, plain_folder, split_rows
from rlcore.loops.reft_model import ReftModel
from rlcore.loops.plan import backward_prefetch
from rlcore.loops.models import (build_model, build_tokenizer, check_vocabulary, check_weights_fit, disable_dropout,
                                 load_exact, load_model, load_tokenizer, make_reference, safetensors_shapes, saved_task,
                                 vocabulary_size)
from rlcore.loops.dist import barrier, dist_info, gathered, is_fsdp2, is_main, shard_source, wrap_model
from rlcore.loops.dist.sync import all_ranks_ok
from rlcore.loops.settings import field_rule
from rlcore.loops.state import TrainState, init_state
from rlcore.loops.trl_defaults import report_defaults
from rlcore.loops.update import enable_gradient_checkpointing, make_optimizer, make_scheduler
from rlcore.seeding import set_seed

__all__ = ["build_reference", "build_policy", "check_tiny_fits", "policy_tokenizer", "checkpoint_model_dir",
           "shard_models", "whole_copy", "init_train_state",
           "load_splits", "holds_out", "require_held_out", "batch_source", "mean_metrics", "run"]


def _as_loaded(model: nn.Module, config: Any) -> nn.Module:
    """A model built from a config (the tiny ones) given the loading fields a checkpoint folder
    would get from ``from_pretrained``: dtype, attention implementation, gradient checkpointing."""
    dtype = config.dtype
    if dtype not in ("float32", "auto"):
        model = model.to(getattr(torch, dtype))
    if config.attn_implementation is not None:
        model.set_attn_implementation(config.attn_implementation)
    return model


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
    path, device = getattr(config, "ref_model", None), getattr(config, "ref_device", None)
    if not path:
        if is_peft(policy):
            if device is not None and torch.device(device) != next(policy.parameters()).device:
                raise ValueError(f"ref_device: {device!r}: the reference of a LoRA policy is the policy itself with "
                                 "its adapter off, on the policy's device; give a ref_model to place one elsewhere")
            return adapter_off(policy)
        if _sharding(config) and isinstance(policy, PreTrainedModel):
            return _sharded_reference(policy, config) if device is None else whole_copy(policy, device).eval() \
                .requires_grad_(False)
        return make_reference(policy).to(device) if device is not None else make_reference(policy)
    source = Path(path)
    if (source / "manifest.json").is_file() or latest_checkpoint(source) is not None:
        source = checkpoint_model_dir(source)
    ref = load_model(str(source), task="causal_lm", **loading_kwargs(config))
    check_vocabulary(ref, vocabulary_size(policy), f"ref_model: {path}", "the policy")
    disable_dropout(ref)
    return ref.to(device or next(policy.parameters()).device).eval().requires_grad_(False)


def policy_tokenizer(config: Any) -> Any:
    """The tokenizer of ``config.model``: the character tokenizer for ``TINY_MODELS``, else
    ``load_tokenizer(config.model)`` (pad token set)."""
    name = config.model
    if name in TINY_MODELS:
        return build_tokenizer()
    revision = config.revision
    return load_tokenizer(name, trust_remote_code=config.trust_remote_code,
                          **({"revision": revision} if revision else {}))


def build_policy(config: Any, *, task: str | None = None, depth: int = 0,
                 base_from: str | None = None) -> tuple[nn.Module, Any]:
    """The model and tokenizer a config names, offline for the tiny ones.

    ``config.model`` in ``TINY_MODELS``: ``build_model(arch, tokenizer=build_tokenizer(),
    hidden_size=, num_layers=, num_heads=, max_position_embeddings=, seed=)`` (dropout off).
    Otherwise ``load_model(config.model, task=task)`` and its tokenizer. With ``config.init_from``
    (a checkpoint directory, or a run directory: its latest checkpoint) the weights of the
    checkpoint's ``policy`` are loaded instead (same tokenizer, architecture from the stored
    config; a checkpoint holding a LoRA adapter: the adapter merged into the base its run
    started from, as the caller vouches for it: ``_vouched_base``; ``base_from`` is the checkpoint
    the caller names as that run's start). A checkpoint is data: its safetensors headers are
    checked, a classifier is refused as a policy, every weight must be loaded (missing or extra
    keys are an error naming them) and its vocabulary must be that of ``config.model`` (the check
    ``build_reference`` makes of a ``ref_model``). With ``config.use_peft`` the model then gets a fresh LoRA adapter
    (``loops.lora.apply_lora``; a policy or reward model, not a value model), so a run started
    from a checkpoint has that checkpoint's policy as its reference. Dropout is set to 0
    (``disable_dropout``, the adapter's included) unless ``config.disable_dropout`` is False
    (the SFT and reward recipes' default, as TRL's trainers: ``update`` then trains with the
    model's dropout). The model is moved to ``config.device``.

    Args:
        config: any object with the fields above (a recipe's ``Config``).
        task: ``"causal_lm"`` (policy), ``"reward"`` (one-label sequence classifier) or
            ``"value"`` (one-label token classifier), as ``loops.models.TASKS``; ``None``:
            ``"causal_lm"`` (a recipe's own is its ``Recipe.model_task``: the reward recipe's ``"reward"``).
    Returns:
        ``(model, tokenizer)``; the tokenizer has a pad token.
    """
    if dataclasses.is_dataclass(config):
        ensure_checked(config)  # before any model is built (once per config: a checked one is not checked again)
    task = task or "causal_lm"
    name = config.model
    init_from = config.init_from
    tokenizer = policy_tokenizer(config)
    loading = loading_kwargs(config)
    if init_from:
        model = _checkpoint_policy(config, checkpoint_model_dir(init_from), task, depth, base_from)
        check_vocabulary(model, _vocabulary(config, tokenizer), f"init_from: {init_from}", f"the model {name!r}")
    elif name in TINY_MODELS:
        model = build_model(TINY_MODELS[name], tokenizer=tokenizer, hidden_size=config.hidden_size,
                            num_layers=config.num_layers, num_heads=config.num_heads,
                            max_position_embeddings=config.max_position_embeddings,
                            seed=config.seed, task=task, tie_word_embeddings=task == "causal_lm")
        model = _as_loaded(model, config)
    elif _loads_sharded(config, task):
        model = _load_sharded(Path(name), config)
    else:
        model = load_model(name, task=task, **_head_kwargs(task), **loading, **quantization_kwargs(config))
    if task != "causal_lm" and model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    if config.gradient_checkpointing and not enable_gradient_checkpointing(model):
        raise ValueError(f"gradient_checkpointing: {type(model).__name__} offers no gradient checkpointing "
                         "(gradient_checkpointing_enable)")
    if config.use_peft and task in _LORA_TASKS and not is_peft(model):  # a sharded load has it already
        model = apply_lora(model, config, task=task)
    if getattr(config, "disable_dropout", True):
        disable_dropout(model)  # after the adapter: its dropout too
    return (model if is_fsdp2(model) else model.to(config.device)), tokenizer  # FSDP2 shards sit where they belong


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

    def __init__(self, config: Any, stored: Mapping[str, Any], where: Path, base_from: str | None = None):
        self._config = config
        base = {k: stored.get(k) for k in _BASE_FIELDS}
        for name, value in base.items():  # the stored config is a file: typed and ranged before use
            if value is None:
                continue
            if name in ("model", "revision", "init_from"):
                ok, what = isinstance(value, str), "a string"
            else:
                rule = field_rule(RunConfig, name)
                ok = isinstance(value, int) and not isinstance(value, bool) and (rule is None or rule.allowed(value))
                what = f"an int {rule.what if rule else ''}".strip()
            if not ok:
                raise ValueError(f"init_from: {where}: {name}: expected {what}, got {value!r}")
        base.update(_vouched_base(config, base, where, base_from))
        self._fields = {**{k: v for k, v in base.items() if v is not None or k in ("revision", "init_from")},
                        "use_peft": False, "gradient_checkpointing": False, "disable_dropout": True}

    def __getattr__(self, name: str) -> Any:
        fields = self.__dict__["_fields"]
        return fields[name] if name in fields else getattr(self.__dict__["_config"], name)


def _vouched_base(config: Any, base: Mapping[str, Any], where: Path, base_from: str | None) -> dict[str, Any]:
    """The base-model location of an adapter checkpoint, as the caller vouches for it: a location
    stored in a checkpoint is never loaded on its own word.

    - ``model``: a built-in offline name (``TINY_MODELS``) is taken as stored (it names no
      location); any other stored model must be the caller's ``model`` (and its ``revision`` the
      caller's ``revision``);
    - ``init_from`` (the adapter's run started from a checkpoint): followed only when it is the
      checkpoint the caller names as that start, ``base_from`` (``rlcore eval`` / ``export``'s
      ``--init_from``).

    Raises ``ValueError`` naming the stored value, the caller's, and how to give it."""
    model, revision, start = base.get("model"), base.get("revision"), base.get("init_from")
    if model is not None and model not in TINY_MODELS and model != config.model:
        raise ValueError(f"init_from: {where}: model: the adapter was trained on {model!r}, the model given is "
                         f"{config.model!r}; a base model named only by a checkpoint is not loaded: give --model "
                         f"{model!r} (model: in the config) if you trust it")
    if model is not None and model not in TINY_MODELS and revision != config.revision:
        raise ValueError(f"init_from: {where}: revision: the adapter was trained on revision {revision!r} of "
                         f"{model!r}, the revision given is {config.revision!r}; give --revision {revision!r}")
    if start is not None and (base_from is None or Path(start).resolve() != Path(base_from).resolve()):
        raise ValueError(f"init_from: {where}: init_from: the adapter's run started from {start!r}, a path stored "
                         f"in a checkpoint, which is not followed (given: {base_from!r}): name it yourself "
                         f"(rlcore eval / export --init_from {start!r}) if you trust it, or start from a merged "
                         "export of that run (rlcore export)")
    return {"init_from": base_from} if start is not None else {}


def _vocabulary(config: Any, tokenizer: Any) -> int:
    """Token ids of the model ``config.model`` names: the tokenizer's for a built-in offline model,
    else its configuration's ``vocab_size`` (``AutoConfig``, the caller's loading settings)."""
    if config.model in TINY_MODELS:
        return len(tokenizer)
    from transformers import AutoConfig

    loaded = AutoConfig.from_pretrained(config.model, trust_remote_code=config.trust_remote_code,
                                        **({"revision": config.revision} if config.revision else {}))
    return loaded.get_text_config().vocab_size


# What a model of each task (``loops.models.TASKS``) is, in messages.
_TASK_NAMES = {"causal_lm": "a causal language model (a policy)", "reward": "a sequence classifier (a reward model)",
               "value": "a token classifier (a value model)"}


def _checkpoint_weights(model_dir: Path, task: str, loading: Mapping[str, Any]) -> nn.Module:
    """A checkpoint's full weights as a model of ``task``, every weight accounted for: a classifier
    (reward, value) is refused as a policy (its LM head would be random); a policy's trunk may
    start a reward or value model (the new head is the only weight not loaded)."""
    saved = saved_task(model_dir)
    if task == "causal_lm" and saved not in (None, "causal_lm"):
        raise ValueError(f"init_from: {model_dir} holds {_TASK_NAMES[saved]}; this recipe trains "
                         f"{_TASK_NAMES[task]} and would start from a random LM head: start from a policy "
                         "checkpoint (an SFT run, or a model folder)")
    try:
        if is_sharded_folder(model_dir):  # the full tensors, one file at a time, into a plain folder first
            with tempfile.TemporaryDirectory() as plain:
                return load_exact(plain_folder(model_dir, Path(plain)), task=task,
                                  new_head=saved is not None and saved != task, **_head_kwargs(task), **loading)
        return load_exact(model_dir, task=task, new_head=saved is not None and saved != task,
                          **_head_kwargs(task), **loading)
    except ValueError as e:  # a CheckpointMismatch stays one
        raise (type(e) if isinstance(e, CheckpointError) else ValueError)(f"init_from: {e}") from e


def _checkpoint_policy(config: Any, model_dir: Path, task: str, depth: int, base_from: str | None = None) -> nn.Module:
    """The weights of a checkpoint's model folder, every safetensors header checked first: full
    weights as saved (``_checkpoint_weights``), or an adapter merged into the base its run was
    trained on, as the caller vouches for it (``_vouched_base``)."""
    for f in sorted(model_dir.glob("*.safetensors")):
        check_safetensors(f)  # crafted headers refused before transformers reads a byte of data
    loading = {k: v for k, v in loading_kwargs(config).items() if k != "revision"}  # the hub model's, not ours
    if not is_adapter_dir(model_dir):
        return _checkpoint_weights(model_dir, task, loading)
    if depth >= _MAX_ADAPTER_CHAIN:
        raise ValueError(f"init_from: {model_dir} is an adapter whose base is an adapter, {depth} deep; "
                         "export the chain merged (rlcore export) and start from that")
    stored_path = model_dir.parent.parent / "config.json"
    try:
        stored = read_json(stored_path)
    except CheckpointError as e:
        raise ValueError(f"init_from: {model_dir} holds an adapter but {stored_path} (its run's config, naming "
                         f"the base model) is unreadable: {e}") from e
    if not isinstance(stored, dict):
        raise ValueError(f"init_from: {stored_path}: expected a mapping, got {type(stored).__name__}")
    base_config = _BaseOf(config, stored, stored_path, base_from)
    check_tiny_fits(base_config, model_dir, task)  # stored sizes against the adapter's header, nothing built
    base, _ = build_policy(base_config, task=task, depth=depth + 1)
    return with_adapter(base, model_dir)


_MAX_ADAPTER_CHAIN = 8


def check_tiny_fits(config: Any, model_dir: Path, task: str) -> None:
    """When ``config`` builds a tiny model from its sizes (``config.model`` in ``TINY_MODELS``, no
    ``init_from``): that model, built on the meta device (nothing allocated), checked against the
    weights of checkpoint model folder ``model_dir``: an adapter must fit it as its base
    (``loops.lora.check_adapter_fits``), full weights must be exactly its weights
    (``check_weights_fit``). So sizes taken from a stored config (``hidden_size``, ``num_layers``,
    ...) are those of the checkpoint's own weights before a model of those sizes is built (the base
    of an adapter; ``rlcore eval``'s reference). Anything else is left to its own loader.

    Raises:
        CheckpointError: naming the file and the keys that do not fit.
    """
    if config.model not in TINY_MODELS or getattr(config, "init_from", None):
        return
    with torch.device("meta"):
        model = build_model(TINY_MODELS[config.model], tokenizer=build_tokenizer(), hidden_size=config.hidden_size,
                            num_layers=config.num_layers, num_heads=config.num_heads,
                            max_position_embeddings=config.max_position_embeddings, seed=config.seed, task=task,
                            tie_word_embeddings=task == "causal_lm")
    if is_adapter_dir(model_dir):
        check_adapter_fits(model, model_dir)
        return
    saved = saved_task(model_dir)
    shapes, _ = safetensors_shapes(model_dir)
    check_weights_fit(model, shapes, model_dir, new_head=saved is not None and saved != task)


def shard_models(models: Mapping[str, nn.Module], config: Any) -> dict[str, nn.Module]:
    """The models as the config's ``strategy`` places them on the ranks of a ``torchrun`` job.

    ``none`` (and any run in one process): as they are, every rank holding each model whole
    (``update`` sums the gradients after the backward). ``ddp``: whole too, each model through
    ``loops.dist.wrap_model(strategy="bucketed")``: its weights broadcast from rank 0 and ``update``
    all-reducing its gradients bucket by bucket during the backward. ``fsdp2``: each Hugging Face
    model (policy, reference, critic, reward model; not a reference or reward model given a device
    of its own, ``ref_device`` / ``reward_device`` (:data:`PLACED`), which stays whole there on
    every rank) goes through ``loops.dist.wrap_model(strategy="fsdp2")``: ``fully_shard`` on each
    block and on the root, ``reshard_after_forward=fsdp_reshard_after_forward``,
    ``backward_prefetch=fsdp_backward_prefetch`` (``None``: on unless ``device`` is a CPU), with
    ``fsdp_param_dtype`` torch's ``MixedPrecisionPolicy(param_dtype, reduce_dtype=float32)`` and, with
    ``fsdp_cpu_offload``, torch's ``CPUOffloadPolicy``. The shards of a frozen model carry no
    optimiser state. A model shared under two names (the ReFT recipes' policy and reference) is
    sharded once; small heads of no Hugging Face class (PPO's shared ``ValueHead``) and ReFT's
    interventions stay whole (a ``ReftModel``'s base is sharded in place); a diffusers UNet (DDPO's
    policy, with or without its LoRA adapter) is sharded block by block (``_unet_blocks``).
    Call before the optimiser is made: sharding replaces the parameters.
    """
    if getattr(config, "strategy", "none") == "ddp" and dist_info().distributed:
        return {name: wrap_model(model, strategy="bucketed") for name, model in models.items()}
    if not _sharding(config):
        return dict(models)
    done: dict[int, nn.Module] = {}
    for name, model in models.items():
        if id(model) in done:
            continue
        if getattr(config, PLACED.get(name, ""), None) is not None and not is_fsdp2(model):
            done[id(model)] = model  # a reference or reward model given a device of its own: whole there
            continue
        if isinstance(model, ReftModel):  # the frozen base sharded in place, the interventions whole
            if not is_fsdp2(model.model):
                model.model = done.setdefault(id(model.model), wrap_model(model.model, strategy="fsdp2",
                                                                          **_fsdp_kwargs(config)))
            done[id(model)] = model
            continue
        unet = _unet_blocks(model)
        whole = not (isinstance(model, PreTrainedModel) or is_peft(model) or unet) or is_fsdp2(model)  # a head
        done[id(model)] = model if whole else wrap_model(model, strategy="fsdp2", **_fsdp_kwargs(config),
                                                         **({"blocks": unet} if unet else {}))
    return {name: done[id(model)] for name, model in models.items()}


PLACED = {"ref": "ref_device", "reward": "reward_device"}  # a frozen model -> the setting that places it whole


def _unet_blocks(model: nn.Module) -> list[type] | None:
    """A diffusers UNet's blocks to shard one by one (the classes of its down, mid and up blocks), for
    a UNet whose class names none (``_no_split_modules``); ``None`` for any other model."""
    inner = model.get_base_model() if is_peft(model) else model
    if not (hasattr(inner, "down_blocks") and hasattr(inner, "up_blocks") and hasattr(inner, "save_config")):
        return None
    named = getattr(inner, "_no_split_modules", None)
    parts = [*inner.down_blocks, *([inner.mid_block] if getattr(inner, "mid_block", None) is not None else []),
             *inner.up_blocks]
    return [*dict.fromkeys(named or [type(m) for m in parts])]


def _loads_sharded(config: Any, task: str) -> bool:
    """Whether ``build_policy`` reads each rank's rows of the model folder ``config.model`` onto a
    model built on the meta device: an fsdp2 run's causal LM from a local folder of safetensors
    weights, not quantised, no code of its own (full parameters, or the base of a LoRA adapter)."""
    folder = Path(config.model)
    return (_sharding(config) and task == "causal_lm" and folder.is_dir() and saved_task(folder) == "causal_lm"
            and any(folder.glob("*.safetensors")) and not is_sharded_folder(folder)
            and not config.trust_remote_code
            and not (config.load_in_4bit or config.load_in_8bit))


@torch.no_grad()
def _load_sharded(folder: Path, config: Any) -> nn.Module:
    """The causal LM of ``folder`` sharded as ``shard_models`` shards it, never whole on a rank: built
    on the meta device from its ``config.json`` (nothing allocated), checked against its safetensors
    headers (every weight present, no other, each shape equal: ``check_weights_fit``), sharded, and
    each rank reads only its rows of each weight from the files (``safe_open(...).get_slice``). The
    rotary embeddings' frequencies, buffers no file holds, are computed again (``_init_weights``); a
    model with any other buffer outside its weights, or whose stored names transformers converts on
    loading (a mixture of experts' fused experts), is loaded whole, as without sharding. ``dtype:
    auto`` is the config's dtype, else the stored weights'. With ``use_peft`` the LoRA adapter is put
    on the meta-built model before sharding, its values drawn as on the whole model
    (``_lora_on_meta``), and sharded with the base. The model comes back in eval mode, as
    ``from_pretrained`` gives it."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    loaded = AutoConfig.from_pretrained(folder)
    shapes, files = safetensors_shapes(folder)
    stored = {e["dtype"] for f in sorted(set(files.values())) for e in check_safetensors(f).values()}
    stored_float = next((d for d in ("F32", "BF16", "F16") if d in stored), "F32")
    dtype = (getattr(loaded, "dtype", None) or {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}[stored_float]) \
        if config.dtype == "auto" else config.dtype
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    attn = {"attn_implementation": config.attn_implementation} if config.attn_implementation else {}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(loaded, dtype=dtype, **attn)
    try:
        check_weights_fit(model, shapes, folder)
    except CheckpointError:  # stored under other names (converted by from_pretrained): loaded whole, then checked
        return load_model(str(folder), task="causal_lm", **loading_kwargs(config))
    rotary = [m for m in model.modules() if "RotaryEmbedding" in type(m).__name__ and hasattr(m, "original_inv_freq")]
    others = {n for n, _ in model.named_non_persistent_buffers()} - {
        f"{n}.{b}" for n, m in model.named_modules() if m in rotary for b in ("inv_freq", "original_inv_freq")}
    if others:
        return load_model(str(folder), task="causal_lm", **loading_kwargs(config))
    base = model
    drawn: dict[str, torch.Tensor] = {}
    tied: dict[int, list[str]] = {}  # a tied weight's names: the one the folder stores serves them all
    for n, p in model.named_parameters(remove_duplicate=False):
        tied.setdefault(id(p), []).append(n)
    stored_as = {n: next((m for m in names if m in shapes), n) for names in tied.values() for n in names}
    if config.use_peft:
        if config.gradient_checkpointing:
            enable_gradient_checkpointing(model)  # before the adapter, as on a whole model
        model, drawn = _lora_on_meta(model, config)
    model = wrap_model(model, strategy="fsdp2", **_fsdp_kwargs(config))
    model.to_empty(device=torch.device("cpu" if config.fsdp_cpu_offload else config.device))  # offload: shards on CPU
    for module in rotary:
        base._init_weights(module)
    with contextlib.ExitStack() as stack:
        opened: dict[Path, Any] = {}
        for key, t in model.state_dict().items():
            rows = split_rows(t)
            if key in drawn:  # the adapter, as drawn
                piece = drawn[key] if rows is None else drawn[key][rows[0]:rows[1]]
            else:
                name = _stored_name(key) if config.use_peft else key
                name = stored_as.get(name, name)
                if name not in shapes:  # a buffer no file holds (the rotary frequencies, computed above)
                    continue
                if files[name] not in opened:
                    opened[files[name]] = stack.enter_context(safe_open(str(files[name]), "pt"))
                piece = opened[files[name]].get_slice(name)[rows[0]:rows[1]] if rows is not None \
                    else opened[files[name]].get_tensor(name)
            (t.to_local() if rows is not None else t).copy_(piece)
    model.eval()
    model.generation_config = GenerationConfig.from_pretrained(folder) \
        if (folder / "generation_config.json").is_file() else model.generation_config
    model.name_or_path = str(folder)
    return model


def _lora_on_meta(model: nn.Module, config: Any) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """``apply_lora`` on a model built on the meta device, and the adapter's initial values, drawn
    exactly as on the whole model (``A`` from ``config.seed``, in the same order). peft places each
    adapter where its base layer's weight lives, so while the adapter is made every base parameter
    is a placeholder on the CPU (one zero broadcast to its shape: no memory), then the meta
    parameters come back (their ``requires_grad`` as peft set it on the placeholders). Returns the
    peft model, its adapter on the CPU (to be sharded with the base and filled from ``drawn``), and
    ``drawn``: the adapter's values under the peft model's parameter names."""
    originals: dict[tuple[nn.Module, str], nn.Parameter] = {}
    placeholders: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                originals[(module, name)] = p
                if id(p) not in placeholders:  # tied parameters stay one parameter
                    placeholders[id(p)] = nn.Parameter(torch.zeros((), dtype=p.dtype).expand(p.shape),
                                                       requires_grad=p.requires_grad)
    for (module, name), p in originals.items():
        module._parameters[name] = placeholders[id(p)]
    try:
        model = apply_lora(model, config, task="causal_lm")
    finally:
        for (module, name), p in originals.items():
            p.requires_grad_(placeholders[id(p)].requires_grad)
            module._parameters[name] = p
    # the adapter's own tensors; a modules_to_save copy (of a placeholder here) is read from the folder, as its original
    drawn = {n: p.detach().clone() for n, p in model.named_parameters() if not p.is_meta and "lora_" in n}
    return model, drawn


def _stored_name(key: str) -> str:
    """The name in the model folder of a peft model's base tensor: peft's ``base_model.model.`` prefix
    removed, and the ``.base_layer`` of each layer it wraps, the ``.original_module`` and the
    ``.modules_to_save.<adapter>`` of each module it trains a copy of (both copies start as the stored one)."""
    key = key.removeprefix("base_model.model.").replace(".base_layer.", ".").replace(".original_module.", ".")
    return re.sub(r"\.modules_to_save\.[^.]+\.", ".", key)


def _check_shared_run_dir(run_dir: Path, config: Any) -> None:
    """Under ``fsdp_checkpoint: sharded`` every rank writes into ``run_dir``: refuse a folder some rank
    does not see (a path local to each node) before the first step, not at the first save."""
    if not (_sharding(config) and getattr(config, "fsdp_checkpoint", "full") == "sharded"):
        return
    barrier()  # rank 0 holds the folder's lock file from here on
    if not all_ranks_ok(is_main() or (run_dir / LOCK_NAME).is_file()):
        raise ValueError(f"run_dir: {run_dir} is not one folder every rank sees (rank 0's {LOCK_NAME} is missing "
                         "on some rank): with fsdp_checkpoint: sharded every rank writes its shards there; put "
                         "run_dir on a file system every node mounts, or set fsdp_checkpoint: full (rank 0 writes)")


def _sharding(config: Any) -> bool:
    return getattr(config, "strategy", "none") == "fsdp2" and dist_info().distributed


def _fsdp_kwargs(config: Any) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"reshard_after_forward": config.fsdp_reshard_after_forward,
                              "backward_prefetch": backward_prefetch(config.fsdp_backward_prefetch, config.device)}
    if config.fsdp_param_dtype is not None:
        from torch.distributed.fsdp import MixedPrecisionPolicy
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=getattr(torch, config.fsdp_param_dtype),
                                                   reduce_dtype=torch.float32)
    if config.fsdp_cpu_offload:
        from torch.distributed.fsdp import CPUOffloadPolicy
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())  # pinning needs a GPU
    return kwargs


@torch.no_grad()
def _sharded_reference(policy: PreTrainedModel, config: Any) -> nn.Module:
    """The frozen copy of ``policy`` for an fsdp2 run, never whole on a rank: the policy is sharded
    first (in place, as ``shard_models`` would), the reference is built on the meta device (nothing
    allocated), sharded alike, and each rank copies its own rows of every parameter (and the
    buffers, which stay whole) from the policy. A rank's peak while building is one whole model,
    not two."""
    if not is_fsdp2(policy):
        wrap_model(policy, strategy="fsdp2", **_fsdp_kwargs(config))
    ref = wrap_model(_on_meta(policy), strategy="fsdp2", **_fsdp_kwargs(config))
    ref.to_empty(device=next(policy.parameters()).device)
    return _filled(ref, policy, lambda t: t.to_local() if hasattr(t, "to_local") else t).eval().requires_grad_(False)


def _on_meta(policy: PreTrainedModel) -> PreTrainedModel:
    """A model of ``policy``'s class (FSDP2's subclass undone), config and dtype, on the meta device."""
    from torch.distributed.fsdp import FSDPModule

    plain = next(c for c in type(policy).__mro__ if not issubclass(c, FSDPModule))
    with torch.device("meta"):
        return plain._from_config(copy.deepcopy(policy.config), dtype=policy.dtype,
                                  attn_implementation=policy.config._attn_implementation)


def _filled(ref: nn.Module, policy: nn.Module, part: Callable[[torch.Tensor], torch.Tensor]) -> nn.Module:
    """``ref`` with each parameter and buffer copied from ``policy``'s of the same name, ``part`` of
    each tensor (a shard's rows, or the gathered whole), and the policy's generation config."""
    own = dict(policy.state_dict()) | dict(policy.named_buffers())  # the shards, even with the root gathered
    for name, t in [*ref.named_parameters(remove_duplicate=False), *ref.named_buffers()]:
        part(t).copy_(part(own[name]))
    ref.generation_config = copy.deepcopy(policy.generation_config)
    return ref


@torch.no_grad()
def whole_copy(model: nn.Module, device: str | torch.device) -> nn.Module:
    """A copy of ``model`` whole on ``device``, in its mode: of a model FSDP2 shards (a Hugging Face
    model, or a LoRA model: its base so built, the same adapter put on it), one of its class built
    on the meta device (its tied weights tied again after ``to_empty``, which gives each module its
    own tensor) and filled one gathered parameter at a time (a collective per tensor, in the
    same order on every rank), so no rank holds more than the copy and one gathered tensor, each
    dropout's ``p`` as the model has it; of any other model, a deep copy. An fsdp2 run's reference
    on its own ``ref_device``, and the asynchronous learner's generator copy."""
    if not is_fsdp2(model):
        return copy.deepcopy(model).to(device)
    if is_peft(model):  # the base's class on the meta device, the same adapter put on it by peft
        from peft import get_peft_model

        peft: Any = model
        meta = _on_meta(peft.get_base_model())
        with torch.device("meta"):
            copied = get_peft_model(meta, copy.deepcopy(peft.peft_config[peft.active_adapter]),
                                    adapter_name=peft.active_adapter)
        copied = copied.to_empty(device=device)
        copied.get_base_model().tie_weights()  # to_empty gives each module its own tensor: tied ones again
    else:
        copied = _on_meta(cast(PreTrainedModel, model)).to_empty(device=device)
        copied.tie_weights()
    _filled(copied, model, gathered)
    trains = {n: p.requires_grad for n, p in model.named_parameters(remove_duplicate=False)}
    for name, p in copied.named_parameters():
        p.requires_grad_(trains[name])
    dropout = {n: m.p for n, m in model.named_modules() if isinstance(m, nn.Dropout)}  # disable_dropout's zeros too
    for name, m in copied.named_modules():
        if isinstance(m, nn.Dropout):
            m.p = dropout[name]
    return copied.train(model.training)


def init_train_state(models: Mapping[str, nn.Module], config: Any, *, trainable: Sequence[str] = ("policy",),
                     total_steps: int | None = None) -> TrainState:
    """A fresh ``TrainState``: the models placed on the ranks (:func:`shard_models`), AdamW (``lr``,
    ``weight_decay``) over the trainable models and a warm-up + ``schedule`` learning-rate scheduler
    over ``total_steps`` optimiser steps (default ``config.steps``); the loop generator (on the CPU)
    seeded with ``config.seed``.

    Models not in ``trainable`` (a frozen reference) are stored as they are.
    """
    models = shard_models(models, config)
    optimizer = make_optimizer({n: models[n] for n in trainable}, lr=config.lr,
                               weight_decay=config.weight_decay)
    scheduler = make_scheduler(optimizer, total_steps=total_steps or config.steps,
                               warmup_steps=config.warmup_steps, kind=config.schedule)
    return init_state(dict(models), optimizer=optimizer, scheduler=scheduler, seed=config.seed)


# --- data --------------------------------------------------------------------------------------
def load_splits(config: Any, make_task: Callable[..., Dataset]) -> tuple[Dataset, Dataset]:
    """``(train, eval)`` datasets: a built-in task, local files or hub datasets.

    - ``config.dataset`` set: ``load_source(dataset)`` (a local file or directory, or a hub name
      ``namespace/name[:split]``); the held-out split is ``load_source(config.eval_dataset)`` when
      given, else ``num_eval`` rows split off the data with a seeded shuffle
      (``loops.data.split_held_out``: ``train_test_split(seed=config.seed)``).
    - otherwise ``make_task(config.task, n, seed=config.seed, split=...)`` (``task_dataset`` or
      ``preference_dataset``) with ``n = num_train`` / ``num_eval``: disjoint prompts.
    - ``num_eval`` 0 without ``eval_dataset``: nothing is held out; every row trains and the
      held-out split is empty (its columns kept), so there is nothing to evaluate on
      (``check_config`` refuses ``eval_every > 0`` then; :func:`require_held_out`).
    """
    seed, n_eval = config.seed, config.num_eval
    if config.dataset:
        data = load_source(config.dataset)
        if config.eval_dataset:
            return data, load_source(config.eval_dataset)
        if n_eval == 0:
            return data, data.select([])
        if not 0 < n_eval < len(data):
            raise ValueError(f"num_eval: expected 0 < num_eval < {len(data)} (rows of {config.dataset}) to hold "
                             f"rows out, got {n_eval}; or pass eval_dataset, or num_eval: 0 to hold nothing out "
                             "(no evaluation)")
        return split_held_out(data, n_eval, seed)  # rows keep naming their file and line
    task = config.task
    if not task:
        raise ValueError("config: set `task` (a built-in task name) or `dataset` (a local jsonl/json/parquet/csv)")
    train = make_task(task, config.num_train, seed=seed, split="train")
    return train, make_task(task, n_eval, seed=seed, split="eval") if n_eval else train.select([])


def holds_out(config: Any) -> bool:
    """Whether ``config`` has a held-out split: an ``eval_dataset``, or ``num_eval`` > 0."""
    return bool(getattr(config, "eval_dataset", None)) or getattr(config, "num_eval", 1) != 0


def require_held_out(config: Any, what: str = "evaluate") -> None:
    """Raise ``ValueError`` when ``config`` holds nothing out (``num_eval`` 0, no ``eval_dataset``):
    every row trained, so there is no split for ``what`` to evaluate on."""
    if not holds_out(config):
        raise ValueError(f"{what}: no held-out split: num_eval is 0 and no eval_dataset is given, so every row "
                         "of the data trains and none is left to evaluate on; give eval_dataset (a held-out file) "
                         "or num_eval > 0 (rows held out of the data or the built-in task; of a run that held "
                         "nothing out, rows it trained on)")


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
        save_models: Sequence[str] | None = None, live: Sequence[str] | None = None,
        restored: bool = False, sharded: bool = False) -> tuple[TrainState, list[dict[str, float]]]:
    """``fold(step, state, source)`` with the standard callbacks of a recipe, from ``config``.

    In order after each step: ``callbacks`` (extra ones, first); ``eval_fn(state)`` every
    ``eval_every`` steps, its results merged into the step's metrics as ``eval/<key>``; then, when
    ``run_dir`` is set, ``make_loggers`` (``run_dir/metrics.jsonl``, a progress line every
    ``log_every`` steps showing the metrics named in ``live`` (default: the step's first four), the trackers of ``report_to``) and a ``Checkpointer`` every
    ``save_every`` steps and after the last one, keeping ``keep_last``. With ``resume`` the state
    is first restored from the latest checkpoint of ``run_dir`` (if any; ``check_resume`` refuses
    another recipe's run or changed settings) and the fold continues from its ``step`` to
    ``num_steps``. The main rank holds ``run_dir``'s lock for the whole run (``open_run_dir``): a
    second writer gets an error, and a new run (no ``resume``) into a folder holding another run's
    files is refused before anything is written, unless ``overwrite`` (a config field) deletes them
    first; a resume into a run's files without a checkpoint, and any run into a folder holding a
    run's names that no rlcore run wrote (a ``checkpoint-N`` without rlcore's manifest, ``lora``
    with no rlcore run beside it), are refused too (``claim_run_dir``, ``run_files``). The global generators of Python, NumPy and torch are seeded with
    ``config.seed`` first (``set_seed``; a resume then restores the checkpoint's), so a reward
    function drawing random numbers repeats under the same seed. A run on a model other than a
    built-in tiny one first prints the fields still at rlcore's defaults whose TRL defaults differ
    (``loops.trl_defaults.report_defaults``). SIGINT / SIGTERM stop the fold at
    the next step boundary (``fold``): the step is saved when there is a ``run_dir``, and the
    ``Interrupted`` raised names the folder and the checkpoint a resume starts from.
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
        restored: the caller has already restored ``state`` from ``run_dir``'s latest checkpoint
            (``config.resume``: an asynchronous run, whose generator needs the weights first); the
            folder is claimed as a resume and nothing is loaded again.
        sharded: ``source`` already yields this rank's part of each global batch (an asynchronous
            run's rollouts, generated from each rank's prompts); else each item is split over the
            ranks (``shard_source``).
    Returns:
        ``(state, history)`` of ``fold``.
    """
    follow_live_memory()  # the resident set follows the live tensors (loops.fold's module doc)
    if dataclasses.is_dataclass(config):
        ensure_checked(config)  # before any file is written
        if is_main():  # a model other than a built-in tiny one: the defaults that differ from TRL's, said once
            report_defaults(config)
    name = name or type(config).__module__.rsplit(".", 1)[-1]
    run_dir = config.run_dir
    settings = {**config_dict(config), "recipe": name} if dataclasses.is_dataclass(config) else {"recipe": name}
    if getattr(config, "seed", None) is not None and not restored:
        set_seed(config.seed)  # before a resume, which restores the checkpoint's global generators (a caller's
        # resume already did: seeding now would overwrite them)
    claim = dict(resume=bool(config.resume or restored), overwrite=bool(getattr(config, "overwrite", False)))
    with open_run_dir(run_dir, **claim) if run_dir and is_main() else contextlib.nullcontext():
        if run_dir:
            _check_shared_run_dir(Path(run_dir), config)
        latest = latest_checkpoint(run_dir) if run_dir and config.resume and not restored else None
        if latest is not None:
            check_resume(latest, settings, name)
            state = resume(run_dir, state)
        cbs = list(callbacks)
        eval_every = config.eval_every
        if eval_fn is not None and eval_every:
            cbs.append(every(eval_every, lambda s, m: {f"eval/{k}": v for k, v in eval_fn(s).items()}))
        if run_dir:
            if is_main():  # under torchrun, rank 0 logs (checkpoints handle ranks themselves)
                cbs += make_loggers(run_dir, total=num_steps, stage=name,
                                    progress_every=config.log_every or 10, progress_keys=live,
                                    report_to=config.report_to, config=settings,
                                    device=config.device)
            # after the loggers: a step's line is written before its checkpoint, so a run killed between
            # the two resumes from the previous checkpoint and logs that step once
            saved = None
            if save_models:
                trainable = [n for n, m in state.models.items() if any(p.requires_grad for p in m.parameters())]
                saved = {n: state.models[n] for n in dict.fromkeys([*trainable, *save_models])}
            cbs.append(Checkpointer(run_dir, every=config.save_every or max(num_steps, 1),
                                    keep_last=config.keep_last, config=settings, tokenizer=tokenizer,
                                    models=saved, sharded=getattr(config, "fsdp_checkpoint", "full") == "sharded"))
        # Under torchrun each item of the source is the global batch and every rank takes its share.
        try:
            return fold(step, state, source if sharded else shard_source(source), num_steps=num_steps, callbacks=cbs)
        except Interrupted as stopped:  # SIGINT / SIGTERM: say where the run can continue from
            if run_dir:
                latest = latest_checkpoint(run_dir)
                stopped.run_dir, stopped.checkpoint = str(run_dir), str(latest) if latest else None
            raise

