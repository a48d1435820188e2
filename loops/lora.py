"""LoRA policies: a trainable low-rank adapter on a frozen base model, the base as the reference.

A recipe whose config sets ``use_peft`` (``loops.config.RunConfig``) trains a LoRA adapter
(``peft``) instead of every weight:

- :func:`apply_lora`: ``peft.get_peft_model`` from the config's ``lora_*`` fields (TRL's
  ``ModelConfig`` names), ``"all-linear"`` included; a clear error when the target modules are
  not in the model;
- :class:`AdapterOff`: the reference of a LoRA policy, the same module with its adapters
  disabled: ``π_ref`` costs no second copy of the weights (TRL's ``ref_model=None`` with PEFT);
- :func:`load_adapter_weights`: a checkpoint's ``adapter_model.safetensors`` back into the
  adapter, every key checked (resume is exact);
- :func:`is_adapter_dir` / :func:`with_adapter`: a checkpoint's adapter folder merged into the
  base it was trained on (``init_from``, ``rlcore eval``, ``rlcore export``);
- :func:`export_merged`: a checkpoint as a plain ``from_pretrained`` folder (``W + (α/r)·B·A``).

Checkpoints of a LoRA policy hold the adapter only (``save_pretrained`` of the peft model:
``adapter_config.json`` + ``adapter_model.safetensors``, loadable with
``PeftModel.from_pretrained(base, path)``); the base is rebuilt from the run's config.

Reference: Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models",
https://arxiv.org/abs/2106.09685
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rlcore.loops.models import _decoder

__all__ = ["LORA_TASK_TYPES", "is_peft", "apply_lora", "in_use", "linear_weights", "AdapterOff", "adapter_off",
           "adapter_keys", "load_adapter_weights", "is_adapter_dir", "adapter_settings", "check_adapter_fits",
           "with_adapter", "export_merged"]

# The peft task type of each ``loops.models.TASKS`` entry: it decides which head peft trains in full
# (``modules_to_save``: the classifier of a reward or value model).
LORA_TASK_TYPES = {"causal_lm": "CAUSAL_LM", "reward": "SEQ_CLS", "value": "TOKEN_CLS"}


def _peft() -> Any:
    try:
        import peft
    except ImportError:
        raise ImportError("use_peft: LoRA needs the peft package; install rlcore[peft]") from None
    return peft


def is_peft(model: nn.Module) -> bool:
    """Whether ``model`` is a peft model (it has adapters that ``disable_adapter()`` can switch off)."""
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


def _targets(modules: Sequence[str] | None) -> str | list[str] | None:
    if modules is None:
        return None
    modules = list(modules)
    return "all-linear" if modules == ["all-linear"] else modules


def apply_lora(model: nn.Module, config: Any, *, task: str = "causal_lm") -> nn.Module:
    """``model`` wrapped with a fresh LoRA adapter from ``config``'s fields (a peft model).

    ``h = W·x + (α/r)·B·A·dropout(x)`` on each target module, ``A`` random (drawn from
    ``config.seed``), ``B = 0``: at initialisation the peft model computes exactly what ``model``
    computes. Only the adapter (and
    ``lora_modules_to_save``, plus the classifier of a reward or value model) requires grad.

    Fields read: ``lora_r`` (``r``), ``lora_alpha`` (``α``), ``lora_dropout``,
    ``lora_target_modules`` (module names, or ``["all-linear"]``: every linear layer but the
    output layer; ``None``: peft's default for the architecture), ``lora_modules_to_save``.

    Raises:
        ValueError: the target modules are not in the model (naming them and the model's linear
            layers), or ``model`` already has an adapter.
    """
    peft = _peft()
    if is_peft(model):
        raise ValueError("use_peft: the model already carries a peft adapter")
    lora = peft.LoraConfig(r=config.lora_r, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
                           target_modules=_targets(config.lora_target_modules),
                           modules_to_save=list(config.lora_modules_to_save or []) or None,
                           task_type=LORA_TASK_TYPES[task],
                           # GPT-2's projections are Conv1D, whose weight is stored transposed
                           fan_in_fan_out=any(type(m).__name__ == "Conv1D" for m in model.modules()))
    try:
        return _wrap(model, lora, seed=getattr(config, "seed", 0))
    except ValueError as e:
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                         if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"})
        raise ValueError(f"lora_target_modules: {config.lora_target_modules!r} does not fit "
                         f"{type(model).__name__} ({e}); its linear layers are named {linear}, or use "
                         "['all-linear']") from e


def _wrap(model: nn.Module, lora: Any, *, seed: int) -> nn.Module:
    """``peft.get_peft_model`` with ``A`` drawn from ``seed`` (the global RNG untouched)."""
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        torch.manual_seed(seed)
        # peft asks transformers 5 for a property it renamed; nothing for the user to do
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        return _peft().get_peft_model(model, lora)


def _base_head(head: nn.Module) -> nn.Module:
    """The base module under a peft wrapper of it (a LoRA layer or a ``modules_to_save`` copy)."""
    return getattr(head, "original_module", None) or getattr(head, "base_layer", None) or head


def in_use(module: nn.Module) -> nn.Module:
    """The module a peft ``modules_to_save`` wrapper runs now: the active adapter's trained copy,
    or the original while the adapters are disabled (or none is active); any other module itself."""
    if not (hasattr(module, "original_module") and hasattr(module, "modules_to_save")):
        return module
    adapter = next((a for a in module.active_adapters if a in module.modules_to_save), None)
    return module.original_module if module.disable_adapters or adapter is None else module.modules_to_save[adapter]


def linear_weights(layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(weight, bias)`` of the linear map ``layer`` applies, ``[out, in]``: a LoRA layer's
    ``W + Σ (α/r)·B·A`` over its active adapters (``W`` when disabled or merged), with gradient
    to ``A`` and ``B``; a plain ``nn.Linear``'s own. Raises ``TypeError`` for anything else, and
    for a LoRA layer whose adapter dropout is on in training (the map is then not one matrix)."""
    layer = in_use(layer)
    if hasattr(layer, "base_layer") and hasattr(layer, "get_delta_weight"):
        base, weight = layer.base_layer, layer.base_layer.weight
        if layer.merged or layer.disable_adapters:
            return weight, base.bias
        for adapter in (a for a in layer.active_adapters if a in layer.lora_A):
            if layer.training and layer.lora_dropout[adapter].p > 0:
                raise TypeError(f"{type(layer).__name__}: adapter {adapter!r} drops its input (lora_dropout "
                                f"{layer.lora_dropout[adapter].p}); the head is not one linear map")
            weight = weight + layer.get_delta_weight(adapter).to(weight.dtype)
        return weight, base.bias
    if not isinstance(layer, nn.Linear):
        raise TypeError(f"expected a linear layer, got {type(layer).__name__}")
    return layer.weight, layer.bias


class AdapterOff(nn.Module):
    """``module`` (a peft model or a part of it) called with the peft model's adapters disabled.

    The reference of a LoRA policy: ``AdapterOff(policy)`` computes the base model's outputs
    (each LoRA layer returns ``W·x``; ``modules_to_save`` use their originals) from the very
    tensors the policy holds. It registers no parameter of its own, so it is never trained,
    saved twice or moved apart from the policy. The pieces the scorers use answer with the
    adapters off too: ``get_decoder()`` (the hidden-state path), ``get_output_embeddings()``
    (the base head), ``generate``. Call it under ``torch.no_grad()``, as any reference.
    """

    calls_through = "peft_model"  # loops.dist.sharded_root: a sharded policy's forwards go through its root

    def __init__(self, peft_model: nn.Module, module: nn.Module | None = None):
        super().__init__()
        if not is_peft(peft_model):
            raise TypeError(f"peft_model: expected a peft model with disable_adapter(), got "
                            f"{type(peft_model).__name__}; for a plain model use make_reference(model)")
        # Plain attributes, not submodules: no parameter is registered twice.
        self.__dict__["peft_model"] = peft_model
        self.__dict__["wrapped"] = peft_model if module is None else module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self.peft_model.disable_adapter():
            return self.wrapped(*args, **kwargs)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        with self.peft_model.disable_adapter():
            return self.peft_model.generate(*args, **kwargs)

    @property
    def config(self) -> Any:
        return self.peft_model.config

    @property
    def device(self) -> torch.device:
        return next(self.peft_model.parameters()).device

    def get_decoder(self) -> nn.Module:
        return AdapterOff(self.peft_model, _decoder(self.peft_model))

    def get_output_embeddings(self) -> nn.Module:
        return _base_head(self.peft_model.get_output_embeddings())

    def extra_repr(self) -> str:
        return f"adapters of {type(self.peft_model).__name__} disabled"


def adapter_off(model: nn.Module) -> AdapterOff:
    """The reference of a LoRA policy: ``AdapterOff(model)``, in eval mode."""
    return AdapterOff(model).eval()


def adapter_keys(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's tensors under the names peft saves them (``get_peft_model_state_dict``)."""
    return _peft().get_peft_model_state_dict(model)


def load_adapter_weights(model: nn.Module, weights: dict[str, torch.Tensor], where: str) -> None:
    """Copy a saved adapter (``adapter_model.safetensors``'s tensors) into peft ``model``, in place.

    Raises ``ValueError`` naming ``where`` when a key is missing, unexpected, or of another shape,
    before any tensor is copied. A model sharded by FSDP2 keeps its shards: each rank copies its
    own rows of the full tensors.
    """
    own = adapter_keys(model)
    missing, unexpected = sorted(set(own) - set(weights)), sorted(set(weights) - set(own))
    shapes = sorted(k for k in set(own) & set(weights) if own[k].shape != weights[k].shape)
    if missing or unexpected or shapes:
        raise ValueError(f"{where}: the adapter does not fit the model: missing {missing[:8]}, unexpected "
                         f"{unexpected[:8]}, other shapes {shapes[:8]}")
    if any(hasattr(t, "to_local") for t in own.values()):  # FSDP2: each rank copies its rows of each tensor
        from rlcore.loops.checkpoint_shards import split_rows

        with torch.no_grad():
            for name, t in own.items():
                rows = split_rows(t)
                value = weights[name] if rows is None else weights[name][rows[0]:rows[1]]
                (t if rows is None else t.to_local()).copy_(value)
        return
    _peft().set_peft_model_state_dict(model, weights)


def is_adapter_dir(path: str | Path) -> bool:
    """Whether ``path`` holds a saved peft adapter (``adapter_config.json``) rather than full weights."""
    return (Path(path) / "adapter_config.json").is_file()


# ``adapter_config.json`` is data: the LoraConfig is built from these fields only, each checked;
# any other stored field must hold peft's default (regex strings, per-layer rank or alpha patterns,
# layer replication, megatron, alternative initialisations are refused, never handed to peft).
_ADAPTER_FIELDS = ("r", "lora_alpha", "lora_dropout", "target_modules", "modules_to_save", "bias", "task_type",
                   "fan_in_fan_out", "inference_mode")
_ADAPTER_IGNORED = ("peft_type", "peft_version", "base_model_name_or_path", "revision")  # strings, never used
_MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*")  # a module name or dotted path, no regex
_MAX_NAMES, _MAX_NAME_CHARS = 1024, 200


def _names(value: Any) -> bool:
    return isinstance(value, list) and len(value) <= _MAX_NAMES and all(
        isinstance(v, str) and len(v) <= _MAX_NAME_CHARS and _MODULE_NAME.fullmatch(v) for v in value)


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _adapter_checks() -> dict[str, tuple[Any, str]]:
    return {
        "r": (_positive_int, "a positive int"),
        "lora_alpha": (_positive_int, "a positive int"),
        "lora_dropout": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 1,
                         "a number in [0, 1)"),
        "target_modules": (lambda v: v == "all-linear" or (_names(v) and len(v) > 0),
                           "a non-empty list of plain module names (no regex string), or 'all-linear'"),
        "modules_to_save": (lambda v: v is None or _names(v), "null or a list of plain module names"),
        "bias": (lambda v: v in ("none", "all", "lora_only"), "one of 'none', 'all', 'lora_only'"),
        "task_type": (lambda v: v is None or v in LORA_TASK_TYPES.values(),
                      f"null or one of {sorted(LORA_TASK_TYPES.values())}"),
        "fan_in_fan_out": (lambda v: isinstance(v, bool), "a bool"),
        "inference_mode": (lambda v: isinstance(v, bool), "a bool"),
        "peft_type": (lambda v: v == "LORA", "'LORA'"),
        "peft_version": (lambda v: v is None or isinstance(v, str), "a string"),
        "base_model_name_or_path": (lambda v: v is None or isinstance(v, str), "a string"),
        "revision": (lambda v: v is None or isinstance(v, str), "a string"),
    }


def _peft_defaults() -> dict[str, Any]:
    import json

    return json.loads(json.dumps(_peft().LoraConfig().to_dict(), default=str))


def adapter_settings(directory: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The checked settings of the LoRA adapter saved in ``directory`` and its safetensors header,
    read as data before peft builds anything: ``(LoraConfig keywords, header)``.

    ``adapter_config.json`` (bounded ``read_json``) may set ``r``, ``lora_alpha`` (positive ints),
    ``lora_dropout`` (in [0, 1)), ``target_modules`` (a list of plain module names, or
    ``"all-linear"``; never a regex string), ``modules_to_save`` (module names), ``bias`` (its
    enum), ``task_type``, ``fan_in_fan_out`` and ``inference_mode`` (bools); ``peft_type`` must be
    ``"LORA"``; ``base_model_name_or_path``, ``revision`` and ``peft_version`` are ignored. Any other
    field must hold peft's default (an unknown one: null). ``r`` must be the rank of every
    ``lora_A`` / ``lora_B`` tensor in ``adapter_model.safetensors``'s header (``check_safetensors``).

    Raises:
        CheckpointError: naming the file and the field (or tensor) at fault.
    """
    from rlcore.loops.checkpoint_codec import CheckpointError, check_safetensors, read_json

    directory = Path(directory)
    where = directory / "adapter_config.json"
    try:
        stored = read_json(where, expect=dict)  # bounded in size and depth
    except CheckpointError as e:
        raise ValueError(f"{where}: unreadable ({e})") from e
    if stored.get("peft_type") != "LORA":
        raise ValueError(f"{where}: expected a LoRA adapter (peft_type 'LORA'), got {stored.get('peft_type')!r}")
    checks, defaults = _adapter_checks(), _peft_defaults()
    for name, value in stored.items():
        if name in checks:
            ok, what = checks[name]
            if not ok(value):
                raise CheckpointError(f"{where}: {name}: expected {what}, got {value!r:.200}")
        elif value != defaults.get(name):
            raise CheckpointError(f"{where}: {name}: {value!r:.200} is not taken from a checkpoint (only "
                                  f"{', '.join(_ADAPTER_FIELDS)} may differ from peft's default "
                                  f"{defaults.get(name)!r})")
    weights_file = directory / "adapter_model.safetensors"
    if not weights_file.is_file():
        raise ValueError(f"{directory}: an adapter_config.json without its adapter_model.safetensors")
    header = check_safetensors(weights_file)  # shapes read before anything is allocated
    r = stored.get("r", defaults["r"])
    ranks = {name: entry["shape"][0] if ".lora_A" in name or ".lora_embedding_A" in name else entry["shape"][1]
             for name, entry in header.items()
             if re.search(r"\.lora_(embedding_)?[AB]\b", name) and len(entry["shape"]) >= 2}
    if not ranks:
        raise CheckpointError(f"{weights_file}: holds no lora_A / lora_B tensor")
    other = sorted(name for name, rank in ranks.items() if rank != r)
    if other:
        raise CheckpointError(f"{where}: r: {r} is not the rank of the adapter's tensors in {weights_file.name} "
                              f"({', '.join(f'{n}: {ranks[n]}' for n in other[:4])})")
    settings = {name: stored[name] for name in _ADAPTER_FIELDS if name in stored and name != "inference_mode"}
    if isinstance(settings.get("target_modules"), list):
        settings["target_modules"] = list(settings["target_modules"])
    return settings, header


def _lora_config(base: nn.Module, settings: dict[str, Any]) -> Any:
    # GPT-2's projections are Conv1D, whose weight is stored transposed: the base decides, not the file
    conv = any(type(m).__name__ == "Conv1D" for m in base.modules())
    return _peft().LoraConfig(**{**settings, "fan_in_fan_out": conv})


def check_adapter_fits(base: nn.Module, directory: str | Path) -> None:
    """Whether the adapter saved in ``directory`` fits ``base`` (a model on the meta device: nothing
    is allocated), compared key by key and shape by shape with its safetensors header.

    Raises:
        CheckpointError: naming the file and the missing, unexpected or differently shaped keys
            (a stored base size, e.g. ``hidden_size`` or ``num_layers``, that its weights do not have).
    """
    from rlcore.loops.checkpoint_codec import CheckpointError

    settings, header = adapter_settings(directory)
    with torch.device("meta"):
        model = _wrap(base, _lora_config(base, settings), seed=0)
    own = {k: list(v.shape) for k, v in adapter_keys(model).items()}
    saved = {k: v["shape"] for k, v in header.items()}
    missing, unexpected = sorted(set(own) - set(saved)), sorted(set(saved) - set(own))
    shapes = sorted(k for k in set(own) & set(saved) if own[k] != saved[k])
    if missing or unexpected or shapes:
        raise CheckpointError(f"{Path(directory) / 'adapter_model.safetensors'}: the adapter does not fit the base "
                              f"model its run's config describes: missing {missing[:8]}, unexpected "
                              f"{unexpected[:8]}, other shapes "
                              f"{[(k, saved[k], own[k]) for k in shapes[:8]]}")


def with_adapter(base: nn.Module, directory: str | Path) -> nn.Module:
    """``base`` with the LoRA adapter saved in ``directory`` merged into its weights
    (``W + (α/r)·B·A``): a plain model, no peft wrapper left.

    The adapter's configuration is read as data (:func:`adapter_settings`: an allow-list of
    checked fields, ``r`` the rank of the stored tensors; peft never reads the file); its
    ``base_model_name_or_path`` is ignored (the caller supplies the base the run was trained on).
    Raises ``ValueError`` for an adapter that does not fit ``base`` or whose configuration is not a
    LoRA one, ``CheckpointError`` for a field outside the allow-list or out of range.
    """
    from rlcore.loops.checkpoint_codec import CheckpointError, load_tensors

    settings, _ = adapter_settings(directory)
    try:
        weights = load_tensors(Path(directory) / "adapter_model.safetensors")
    except CheckpointError as e:
        raise ValueError(str(e)) from e
    model = _wrap(base, _lora_config(base, settings), seed=0)  # A and B overwritten next
    load_adapter_weights(model, weights, str(directory))
    return model.merge_and_unload()


def export_merged(model: nn.Module, tokenizer: Any, out: str | Path) -> Path:
    """Save ``model`` as a plain ``from_pretrained`` folder at ``out`` (with its tokenizer): a peft
    model's adapters merged into a copy of its weights first (the model itself is unchanged).

    The folder names no code: an ``auto_map`` (a model or tokenizer class to import, as a
    checkpoint's config may carry) is dropped from every JSON file written, with one line on stderr
    each; the folder loads with ``from_pretrained`` without ``trust_remote_code``."""
    import copy
    import json
    import sys

    from rlcore.loops.checkpoint_codec import read_json

    out = Path(out)
    if is_peft(model):
        model = copy.deepcopy(model).merge_and_unload()
    model.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    for path in sorted(out.glob("*.json")):
        saved = read_json(path)
        if isinstance(saved, dict) and "auto_map" in saved:
            dropped = saved.pop("auto_map")
            path.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
            print(f"export: {path}: auto_map {dropped!r:.200} dropped (an exported folder names no code to run)",
                  file=sys.stderr)
    return out
