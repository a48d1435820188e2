"""Models and tokenizers, offline: tiny ones built from configs, real ones loaded from a path.

What lives here: a small tokenizer built with ``tokenizers`` (character level, or a small BPE),
tiny Llama-/GPT-2-style causal LMs, value and reward models from configs, the loading code for
hub names or local checkpoints, the trunk forward shared by log-probs, values and rewards
(``trunk_hidden``), value heads, reward-model scores read at the last real token, Python reward
functions and their combination, and the frozen reference policy.

Positions are always derived from the attention mask (``position_ids_from_mask``), so a left
padded row and a right padded row of the same tokens give the same outputs on real tokens.
Nothing here downloads: ``build_*`` works from configs, ``load_*`` reads whatever path or hub
name it is given (set ``HF_HUB_OFFLINE=1`` to forbid the network).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import math
import string
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from torch import nn
from transformers import (AutoModelForCausalLM, AutoModelForSequenceClassification, AutoModelForTokenClassification,
                          AutoTokenizer, GPT2Config, LlamaConfig, PreTrainedModel, PreTrainedTokenizerFast)

from rlcore.checks import check_mask, check_ndim, lookup
from rlcore.loops.dist import gathered, release_gathered, sharded_root

__all__ = ["build_tokenizer", "load_tokenizer", "pad_token_id", "TOKENIZER_KINDS", "CHAT_TEMPLATE", "build_model",
           "build_value_model", "build_reward_model", "load_model", "ARCHS", "TASKS", "disable_dropout",
           "position_ids_from_mask", "last_token_index", "Packing", "pack_rows", "packed_trunk", "trunk_hidden", "cache_keyword", "cache_length", "ValueHead",
           "policy_and_values", "token_values", "reward_model_scores", "make_reference", "mix_into_reference",
           "model_device", "saved_task", "load_exact", "check_saved_model", "check_weights_fit",
           "safetensors_shapes", "vocabulary_size", "check_vocabulary"]

# --- tokenizers ------------------------------------------------------------------------------
SPECIAL_TOKENS = {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]
DEFAULT_CHARS = string.digits + string.ascii_letters + string.punctuation + " \n"

# Each turn is ``<|role|>content</s>``; the generation prompt is ``<|assistant|>``, so a prompt
# rendered with ``add_generation_prompt=True`` is a prefix of the full conversation.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def _char_tokenizer(*, vocab: str | None, texts: Sequence[str] | None, vocab_size: int) -> Tokenizer:
    chars = list(dict.fromkeys(vocab if vocab is not None else DEFAULT_CHARS))
    specials = [*SPECIAL_TOKENS.values(), *ROLE_TOKENS]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(specials + chars)},
                                     unk_token=SPECIAL_TOKENS["unk_token"]))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # one char each
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(specials)
    return tok


def _bpe_tokenizer(*, vocab: str | None, texts: Sequence[str] | None, vocab_size: int) -> Tokenizer:
    if not texts:
        raise ValueError("texts: a BPE tokenizer is trained on texts; pass a non-empty list of strings")
    tok = Tokenizer(models.BPE(unk_token=SPECIAL_TOKENS["unk_token"]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[*SPECIAL_TOKENS.values(), *ROLE_TOKENS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(list(texts), trainer=trainer)
    return tok


TOKENIZER_KINDS: dict[str, Callable[..., Tokenizer]] = {"char": _char_tokenizer, "bpe": _bpe_tokenizer}


def build_tokenizer(kind: str = "char", *, vocab: str | None = None, texts: Sequence[str] | None = None,
                    vocab_size: int = 512, padding_side: str = "right", model_max_length: int = 256,
                    save_dir: str | None = None) -> PreTrainedTokenizerFast:
    """A tiny tokenizer built offline with ``tokenizers``, with pad/bos/eos/unk and a chat template.

    ``char``: one token per character of ``vocab`` (default: digits, ASCII letters, punctuation,
    space and newline; anything else maps to ``<unk>``). ``bpe``: byte-level BPE trained on
    ``texts`` up to ``vocab_size``. Both put ``<pad> <s> </s> <unk>`` at ids 0-3 and the role
    markers ``<|system|> <|user|> <|assistant|>`` next, as single special tokens. No special token
    is added implicitly when encoding; the chat template writes ``<s>`` and ``</s>`` itself.

    Args:
        kind: ``"char"`` | ``"bpe"`` (``TOKENIZER_KINDS``).
        padding_side: ``"right"`` | ``"left"``; per call ``tokenizer(..., padding_side=...)`` wins.
        save_dir: when given, ``save_pretrained`` there (``load_tokenizer(save_dir)`` reads it back).
    Returns:
        A ``PreTrainedTokenizerFast``.

    >>> tok = build_tokenizer()
    >>> tok.decode(tok("Hi 2!")["input_ids"])
    'Hi 2!'
    """
    make = lookup(TOKENIZER_KINDS, kind, what="kind")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=make(vocab=vocab, texts=texts, vocab_size=vocab_size),
                                        padding_side=padding_side, model_max_length=model_max_length,
                                        chat_template=CHAT_TEMPLATE, **SPECIAL_TOKENS)
    if save_dir is not None:
        tokenizer.save_pretrained(save_dir)
    return tokenizer


def load_tokenizer(name_or_path: str, *, trust_remote_code: bool = False, padding_side: str | None = None,
                   pad_to_eos: bool = True, **kwargs) -> PreTrainedTokenizerFast:
    """``AutoTokenizer.from_pretrained`` for a hub name or a local directory.

    A tokenizer without a pad token gets ``pad_token = eos_token`` when ``pad_to_eos`` (with a
    warning: rlcore never infers validity from pad ids, masks are explicit, so reusing EOS as the
    pad id is harmless here).
    """
    tokenizer = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code, **kwargs)
    if padding_side is not None:
        tokenizer.padding_side = padding_side
    if tokenizer.pad_token is None and pad_to_eos and tokenizer.eos_token is not None:
        warnings.warn(f"{name_or_path}: tokenizer has no pad token; using eos {tokenizer.eos_token!r} as pad "
                      "(masks are explicit, so this changes no result)", stacklevel=2)
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def pad_token_id(tokenizer) -> int:
    """The id used to fill padding: ``pad_token_id``, else ``eos_token_id`` (with a warning).

    Raises ``ValueError`` when the tokenizer has neither, explaining how to set one. The
    tokenizer is not modified.
    """
    if tokenizer.pad_token_id is not None:
        return int(tokenizer.pad_token_id)
    if tokenizer.eos_token_id is not None:
        warnings.warn("tokenizer has no pad token: padding with eos_token_id "
                      f"{tokenizer.eos_token_id} (masks are explicit, so this changes no result; "
                      "set tokenizer.pad_token to silence this)", stacklevel=2)
        return int(tokenizer.eos_token_id)
    raise ValueError("tokenizer: has neither a pad token nor an eos token; set one, e.g. tokenizer.pad_token = "
                     "tokenizer.unk_token or tokenizer.add_special_tokens({'pad_token': '<pad>'})")


# --- models from configs ---------------------------------------------------------------------
def _llama_config(*, vocab_size, hidden_size, num_layers, num_heads, max_position_embeddings,
                  tie_word_embeddings, **ids) -> LlamaConfig:
    return LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=4 * hidden_size,
                       num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_heads,
                       max_position_embeddings=max_position_embeddings, tie_word_embeddings=tie_word_embeddings,
                       attention_dropout=0.0, **ids)


def _gpt2_config(*, vocab_size, hidden_size, num_layers, num_heads, max_position_embeddings,
                 tie_word_embeddings, **ids) -> GPT2Config:
    return GPT2Config(vocab_size=vocab_size, n_embd=hidden_size, n_layer=num_layers, n_head=num_heads,
                      n_positions=max_position_embeddings, tie_word_embeddings=tie_word_embeddings,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0, **ids)


ARCHS: dict[str, Callable[..., object]] = {"llama": _llama_config, "gpt2": _gpt2_config}
TASKS: dict[str, type] = {"causal_lm": AutoModelForCausalLM, "reward": AutoModelForSequenceClassification,
                          "value": AutoModelForTokenClassification}


def build_model(arch: str = "llama", *, vocab_size: int | None = None, tokenizer=None, hidden_size: int = 64,
                num_layers: int = 2, num_heads: int = 4, max_position_embeddings: int = 256, seed: int = 0,
                tie_word_embeddings: bool = True, dtype: torch.dtype = torch.float32,
                attn_implementation: str = "sdpa", task: str = "causal_lm") -> PreTrainedModel:
    """A tiny randomly initialised causal LM (``AutoModelForCausalLM.from_config``), offline.

    ``llama`` (RMSNorm, rotary, SwiGLU) or ``gpt2`` (LayerNorm, learned positions); every
    dropout off (``disable_dropout``); pad/bos/eos ids (config and generation config) from
    ``tokenizer`` when given, and ``vocab_size = len(tokenizer)`` unless set. Initialised under
    ``seed`` without touching the global RNG. ``save_pretrained(dir)`` then ``load_model(dir)``
    round-trips. ``task`` (``TASKS``) picks the Auto class; ``build_value_model`` and
    ``build_reward_model`` are this with one-label heads.

    >>> model = build_model(vocab_size=40, hidden_size=16, num_layers=1, num_heads=2)
    >>> model(torch.tensor([[1, 2, 3]])).logits.shape
    torch.Size([1, 3, 40])
    """
    if vocab_size is None:
        if tokenizer is None:
            raise ValueError("vocab_size: pass vocab_size or a tokenizer to take it from")
        vocab_size = len(tokenizer)
    auto = lookup(TASKS, task, what="task")
    ids = {f"{n}_token_id": getattr(tokenizer, f"{n}_token_id", None) for n in ("pad", "bos", "eos")}
    ids = {k: v for k, v in ids.items() if v is not None}
    config = lookup(ARCHS, arch, what="arch")(
        vocab_size=vocab_size, hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
        max_position_embeddings=max_position_embeddings, tie_word_embeddings=tie_word_embeddings,
        **ids, **({} if task == "causal_lm" else {"num_labels": 1}))
    with torch.random.fork_rng(devices=[]):  # seeded init without touching the caller's global RNG
        torch.manual_seed(seed)
        model = auto.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    disable_dropout(model)  # e.g. the classifier dropout of token-classification heads
    if task == "causal_lm":
        for k, v in ids.items():
            setattr(model.generation_config, k, v)
    return model


def build_value_model(arch: str = "llama", **kwargs) -> PreTrainedModel:
    """A separate critic: ``AutoModelForTokenClassification`` with one label, one value per token.

    Keywords as ``build_model``. Read it with ``token_values(model, input_ids, attention_mask)``
    → ``[B, T]``.
    """
    return build_model(arch, task="value", **{"tie_word_embeddings": False, **kwargs})


def build_reward_model(arch: str = "llama", **kwargs) -> PreTrainedModel:
    """A reward model: ``AutoModelForSequenceClassification`` with ``num_labels=1``, pad id set.

    Keywords as ``build_model``. Score it with ``reward_model_scores`` (reads the last real
    token from the mask, whatever the padding side; HF's own pooling guesses it from pad ids).
    """
    return build_model(arch, task="reward", **{"tie_word_embeddings": False, **kwargs})


def load_model(name_or_path: str, *, task: str = "causal_lm", trust_remote_code: bool = False,
               dtype: torch.dtype | str | None = None, **kwargs) -> PreTrainedModel:
    """``from_pretrained`` for a hub name or a local directory, with the Auto class of ``task``.

    Args:
        task: ``causal_lm`` | ``reward`` (sequence classification) | ``value`` (token classification).
        dtype: a ``torch.dtype``, its name (``"bfloat16"``), ``"auto"``, or ``None`` (the default, fp32).
        kwargs: passed to ``from_pretrained`` (``num_labels``, ``attn_implementation``, ``revision`` …).
    """
    if isinstance(dtype, str) and dtype != "auto":
        dtype = getattr(torch, dtype)
    try:
        return lookup(TASKS, task, what="task").from_pretrained(name_or_path, trust_remote_code=trust_remote_code,
                                                            dtype=dtype, **kwargs)
    except ValueError as e:
        if trust_remote_code or "trust_remote_code" not in str(e):
            raise
        raise ValueError(f"model: {name_or_path} ships its own modelling code (its config's auto_map), which is "
                         "not run by default; read it, then set trust_remote_code: true (--trust_remote_code true) "
                         "to run it") from e


# The head an architecture's class name ends with -> the task (``TASKS``) it serves.
_HEADS = {"ForCausalLM": "causal_lm", "LMHeadModel": "causal_lm", "ForSequenceClassification": "reward",
          "ForTokenClassification": "value"}


def saved_task(directory: str | Path) -> str | None:
    """The task (``TASKS``) of the model saved in ``directory``: its ``config.json``'s
    ``architectures`` read as data (bounded, ``loops.checkpoint_codec.read_json``); ``None`` when it
    names no head of ``_HEADS``."""
    from rlcore.loops.checkpoint_codec import read_json

    path = Path(directory) / "config.json"
    archs = read_json(path, expect=dict).get("architectures") if path.is_file() else None
    names = archs if isinstance(archs, list) else []
    found = {task for name in names if isinstance(name, str) for head, task in _HEADS.items() if name.endswith(head)}
    return found.pop() if len(found) == 1 else None


@contextlib.contextmanager
def _quiet_loading():
    """transformers' load report off (missing and unexpected keys are checked by the caller)."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def safetensors_shapes(directory: str | Path) -> tuple[dict[str, list[int]], dict[str, Path]]:
    """``(key -> shape, key -> file)`` of every ``*.safetensors`` file in ``directory``, each header
    checked (``check_safetensors``), no tensor read; of a sharded folder (``loops.checkpoint_shards``)
    the full shapes its checked index gives, each key's file its ``shards.json``."""
    from rlcore.loops.checkpoint_codec import check_safetensors
    from rlcore.loops.checkpoint_shards import INDEX, is_sharded_folder, read_index

    if is_sharded_folder(directory):
        index = read_index(Path(directory))["tensors"]
        return {k: e["shape"] for k, e in index.items()}, {k: Path(directory) / INDEX for k in index}
    shapes, files = {}, {}
    for f in sorted(Path(directory).glob("*.safetensors")):
        for key, entry in check_safetensors(f).items():
            shapes[key], files[key] = entry["shape"], f
    return shapes, files


def check_weights_fit(model: nn.Module, shapes: dict[str, list[int]], where: str | Path, *,
                      new_head: bool = False) -> None:
    """Whether ``model`` (built on the meta device: nothing allocated) has exactly the weights
    ``shapes`` (a safetensors header's key -> shape) describes: every key of its state dict present
    (a weight tied to a present one may be absent), no other key, every shape equal. With
    ``new_head``, keys outside the trunk (``base_model_prefix``) may be missing or unused.

    Raises:
        CheckpointError (also a ``ValueError``): naming ``where`` and the keys at fault.
    """
    from rlcore.loops.checkpoint_codec import CheckpointMismatch

    own = model.state_dict(keep_vars=True)
    present = {id(own[k]) for k in own if k in shapes}
    trunk = f"{getattr(model, 'base_model_prefix', '')}."
    keep = (lambda k: k.startswith(trunk)) if new_head else (lambda k: True)  # noqa: E731
    missing = sorted(k for k in own if k not in shapes and id(own[k]) not in present and keep(k))
    unexpected = sorted(k for k in shapes if k not in own and keep(k))
    other = sorted(k for k in own if k in shapes and list(own[k].shape) != list(shapes[k]))
    if missing or unexpected or other:
        raise CheckpointMismatch(f"{where}: the saved weights do not fill a {type(model).__name__}: missing "
                                 f"{missing[:8]}, unexpected {unexpected[:8]}, other shapes "
                                 f"{[(k, shapes[k], list(own[k].shape)) for k in other[:8]]}")


def _layer_bound(shapes: dict[str, list[int]]) -> int:
    """One more than the largest numeric component of any key (``model.layers.7.…`` -> 8): no model
    built from these weights has more layers."""
    import re

    return max((int(n) + 1 for k in shapes for n in re.findall(r"(?:^|\.)(\d{1,9})(?=\.|$)", k)), default=0)


def check_saved_model(directory: str | Path, *, task: str = "causal_lm", new_head: bool = False,
                      num_labels: int | None = None) -> None:
    """A saved model folder's ``config.json`` checked against its safetensors headers before any
    model is built from it: its layer count no larger than the layer indices the weights hold, then
    the model built on the meta device (nothing allocated) compared key by key, shape by shape
    (``check_weights_fit``). A folder without safetensors files (a hub name) is not checked here.

    Raises:
        CheckpointError: naming the file and the field or keys at fault.
    """
    from transformers import AutoConfig

    from rlcore.loops.checkpoint_codec import CheckpointError, CheckpointMismatch, read_json

    directory = Path(directory)
    shapes, _ = safetensors_shapes(directory) if directory.is_dir() else ({}, {})
    if not shapes:
        return
    read_json(directory / "config.json", expect=dict)  # bounded before transformers reads it
    try:
        config = AutoConfig.from_pretrained(str(directory), **({"num_labels": num_labels} if num_labels else {}))
        text = config.get_text_config()
    except (ValueError, OSError, TypeError, KeyError) as e:
        raise CheckpointError(f"{directory / 'config.json'}: not a model configuration transformers reads without "
                              f"remote code ({type(e).__name__}: {e})") from e
    bound = _layer_bound(shapes)
    for name in ("num_hidden_layers", "n_layer", "num_layers"):
        layers = getattr(text, name, None)
        if isinstance(layers, int) and layers > bound:
            raise CheckpointMismatch(f"{directory / 'config.json'}: {name}: {layers} layers, but the saved weights "
                                     f"hold at most {bound} (layer indices of their keys)")
    try:
        with torch.device("meta"), _quiet_loading():
            model = lookup(TASKS, task, what="task").from_config(config)
    except (ValueError, RuntimeError, TypeError) as e:
        raise CheckpointError(f"{directory / 'config.json'}: cannot build its model ({type(e).__name__}: {e})") from e
    check_weights_fit(model, shapes, f"{directory}", new_head=new_head)


def load_exact(directory: str | Path, *, task: str = "causal_lm", new_head: bool = False, **kwargs) -> PreTrainedModel:
    """``load_model`` of a saved model folder that must fill the model it builds: a weight the
    folder lacks (left at its random init) or holds without a place in the model is an error
    naming the keys, not a load report on stderr.

    Args:
        task: the Auto class, as ``load_model``.
        new_head: the folder holds another task's model (a causal LM read as a reward or value
            model): keys outside the shared trunk (``base_model_prefix``), the old and the new
            head, may be missing or unused; the trunk must still match exactly.
        kwargs: passed to ``load_model``.
    A local folder's ``config.json`` is first checked against its safetensors headers, nothing
    allocated (``check_saved_model``).

    Raises:
        ValueError: naming the folder and the missing, unexpected or differently shaped keys
            (``CheckpointMismatch``, also a ``CheckpointError``, when found before loading), or
            transformers' own error loading them.
    """
    check_saved_model(directory, task=task, new_head=new_head, num_labels=kwargs.get("num_labels"))
    try:
        with _quiet_loading():
            model, info = load_model(str(directory), task=task, output_loading_info=True, **kwargs)
    except RuntimeError as e:  # e.g. "You set ignore_mismatched_sizes ...": weights of other shapes
        raise ValueError(f"{directory}: the saved weights do not load into the model its config.json describes "
                         f"({type(e).__name__}: {str(e)[:500]})") from e
    trunk = f"{model.base_model_prefix}."
    keep = (lambda k: k.startswith(trunk)) if new_head else (lambda k: True)  # noqa: E731
    missing = sorted(k for k in info.get("missing_keys", ()) if keep(k))
    unexpected = sorted(k for k in info.get("unexpected_keys", ()) if keep(k))
    shapes = sorted(str(k[0] if isinstance(k, tuple) else k) for k in info.get("mismatched_keys", ()))
    if missing or unexpected or shapes:
        raise ValueError(f"{directory}: the saved weights do not fill a {type(model).__name__}: missing "
                         f"{missing[:8]}, unexpected {unexpected[:8]}, other shapes {shapes[:8]}")
    return model


def vocabulary_size(model: nn.Module) -> int:
    """Rows of ``model``'s input embedding: the token ids it can read."""
    return model.get_input_embeddings().weight.shape[0]


def check_vocabulary(model: nn.Module, expected: int, where: str, other: str) -> None:
    """Raise ``ValueError`` unless ``model`` reads exactly ``expected`` token ids (those of
    ``other``, e.g. "the policy"): a model of another vocabulary would index tokens it does not
    have, or score other tokens than its partner's."""
    found = vocabulary_size(model)
    if found != expected:
        raise ValueError(f"{where} has a vocabulary of {found} tokens, {other} {expected}; it must share "
                         f"{other}'s tokenizer")


def disable_dropout(model: nn.Module) -> nn.Module:
    """Set ``p = 0`` on every ``nn.Dropout`` of ``model`` (in place; returns it). RL needs
    deterministic log-probs: the same tokens must score the same in collect, score and update."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    return model


# --- forwards --------------------------------------------------------------------------------
def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that count real tokens only: ``pos_t = max(Σ_{s≤t} m_s − 1, 0)``.

    Args:
        attention_mask: ``[..., T]`` bool.
    Returns:
        ``[..., T]`` long; left padding gets position 0, right padding repeats the last position.

    >>> position_ids_from_mask(torch.tensor([[False, True, True, False]]))
    tensor([[0, 0, 1, 1]])
    """
    check_mask("attention_mask", attention_mask)
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """Index of the last True of each row, under left or right padding: ``max{t : m_t}`` (0 if none).

    Args:
        attention_mask: ``[..., T]`` bool.
    Returns:
        ``[...]`` long.
    """
    check_mask("attention_mask", attention_mask)
    t = torch.arange(attention_mask.shape[-1], device=attention_mask.device)
    return torch.where(attention_mask, t, 0).amax(-1)


def _decoder(model: nn.Module) -> nn.Module:
    if hasattr(model, "get_decoder"):
        decoder = model.get_decoder()
        if decoder is not None:
            return decoder
    if hasattr(model, "base_model") and model.base_model is not model:
        return model.base_model
    raise TypeError(f"model: cannot find the trunk of {type(model).__name__} (no get_decoder() or base_model); "
                    "pass a Hugging Face model or use the logits path")


@functools.cache
def _cache_keyword_of(module_type: type) -> str | None:
    names = inspect.signature(module_type.forward).parameters
    return next((name for name in ("cache", "past_key_values") if name in names), None)


def cache_keyword(model: nn.Module) -> str:
    """The keyword under which ``model``'s forward takes a KV cache.

    Transformers names it ``cache`` from 5.24 on (``past_key_values`` stays as a deprecated alias
    that warns on every call) and ``past_key_values`` before. Read off ``model.forward``'s
    signature, else its trunk's, so wrappers whose forward takes ``**kwargs`` (``ReftModel``,
    PEFT) answer for the model they wrap; ``past_key_values`` when neither names one.
    """
    model = getattr(model, "wrapped", model)  # a pass-through wrapper (loops.lora.AdapterOff) answers for its module
    found = _cache_keyword_of(type(model))
    if found is None:
        with contextlib.suppress(TypeError):
            found = _cache_keyword_of(type(_decoder(model)))
    return found or "past_key_values"


def cache_length(args: Sequence, kwargs: dict) -> int | None:
    """The number of cached columns a forward starts after: its cache's ``get_seq_length()``.

    The cache is found by type (any argument with ``get_seq_length``), not by name, so it is
    found under ``cache`` and ``past_key_values`` alike. ``None`` when the forward has no cache.
    """
    for value in (*kwargs.values(), *args):
        if callable(getattr(value, "get_seq_length", None)):
            return int(value.get_seq_length())
    return None


class Packing(NamedTuple):
    """Where the real tokens of a padded ``[B, T]`` batch sit once packed into ``rows × width`` rows.

    Attributes:
        input_ids, position_ids: ``[rows, width]``: the sequences laid end to end, positions
            restarting at 0 with each; the tail of a row is pad id 0 at position 0 (each such token
            a sequence of its own, which attends only to itself).
        dest: ``[N]`` long, the flat index (``row·width + column``) of each real token, in the order
            of ``mask``'s True entries (row-major).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    dest: torch.Tensor


def pack_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Packing:
    """Pack the real tokens of each row of ``input_ids`` into rows as long as the longest sequence.

    Sequences go first-fit, in order, into rows of ``width = max_b Σ_t mask[b, t]`` tokens (no
    sequence is split): a forward then computes about ``Σ_b len_b`` positions instead of ``B·T``,
    and attention, kept within each sequence by the restarting positions, spans at most ``width``
    keys, as on the padded rows. A row's real tokens are taken in order, so rows should hold them
    contiguously (left or right padding).

    Returns:
        A :class:`Packing`.
    """
    check_mask("attention_mask", attention_mask, like=input_ids, like_name="input_ids")
    lengths = attention_mask.sum(-1).tolist()
    width = max(max(lengths, default=1), 1)
    free: list[int] = []  # tokens left in each packed row
    starts = []
    for n in lengths:
        row = next((r for r, left in enumerate(free) if left >= n), None)
        if row is None:
            free.append(width)
            row = len(free) - 1
        starts.append(row * width + width - free[row])
        free[row] -= n
    device = input_ids.device
    counts = torch.tensor(lengths, device=device)
    first = torch.tensor(starts, device=device)
    within = torch.arange(int(counts.sum()), device=device) - (counts.cumsum(0) - counts).repeat_interleave(counts)
    dest = first.repeat_interleave(counts) + within
    size = len(free) * width
    ids = input_ids.new_zeros(size).index_put((dest,), input_ids[attention_mask])
    pos = torch.zeros(size, dtype=torch.long, device=device).index_put((dest,), within)
    return Packing(ids.view(-1, width), pos.view(-1, width), dest)


def packed_trunk(model: nn.Module, packing: Packing) -> torch.Tensor:
    """The trunk's last hidden states of a :class:`Packing`, flat: ``[rows·width, H]`` (index with ``dest``)."""
    hidden = trunk_hidden(model, packing.input_ids, None, position_ids=packing.position_ids)
    return hidden.reshape(-1, hidden.shape[-1])


def trunk_hidden(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, *,
                 position_ids: torch.Tensor | None = None, packed: bool = False) -> torch.Tensor:
    """Last hidden states of the model's trunk (the input of its head): ``[B, T, H]``.

    The trunk is ``model.get_decoder()`` (``model.model`` for Llama, ``model.transformer`` for
    GPT-2), else ``model.base_model``; no logits are computed. Positions come from the mask
    unless given; no KV cache is built.

    Args:
        input_ids: ``[B, T]`` long.
        attention_mask: ``[B, T]`` bool, or ``None`` for unpadded (or packed) rows.
        position_ids: ``[B, T]`` long, default ``position_ids_from_mask(attention_mask)``.
        packed: padding-free: the trunk runs on the real tokens packed into rows (:func:`pack_rows`,
            positions restarting with each sequence, so transformers keeps attention within each;
            ``position_ids`` is then not read), and the states are put back in place, zeros at
            padding. Equal to the padded forward up to float rounding for rows whose real tokens
            are contiguous.
    """
    check_ndim("input_ids", input_ids, ndim=2, layout="[B, T]")
    if packed and attention_mask is not None:
        packing = pack_rows(input_ids, attention_mask)
        flat = packed_trunk(model, packing)[packing.dest]
        return flat.new_zeros((*input_ids.shape, flat.shape[-1])).index_put((attention_mask,), flat)
    if attention_mask is not None:
        check_mask("attention_mask", attention_mask, like=input_ids, like_name="input_ids")
        if position_ids is None:
            position_ids = position_ids_from_mask(attention_mask)
        attention_mask = attention_mask.long()
    if sharded_root(model) is not None:
        return _hidden_through_root(model, input_ids, attention_mask, position_ids)
    out = _decoder(model)(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          use_cache=False)
    return out.last_hidden_state


def _hidden_through_root(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                         position_ids: torch.Tensor | None) -> torch.Tensor:
    """The trunk's last hidden states of an FSDP2 model, read by a hook while the model's own forward
    runs: its root gathers the parameters outside the blocks (embeddings, final norm, a tied head)
    and arms their gradient reduction, which calling the trunk alone would skip. The head computes
    one position's logits at most (``logits_to_keep=1``), which are dropped; the root's parameters
    stay gathered after the forward, so the head's weight can be read for the chunked log-probs. A
    LoRA model's (or its adapter-off view's) trunk is the base model's, read the same way.

    FSDP2 arms the root's gradient reduction from a hook on its forward's outputs, which are
    dropped here: so the states come back tied to the logits (:class:`_ThroughRoot`), whose zero
    gradient fires that hook even when no block's output needs a gradient (ReFT's interventions on
    the last block of a frozen model, beside a trained score head)."""
    seen: list[torch.Tensor] = []
    trunk = _decoder(model)
    trunk = trunk.__dict__.get("wrapped", trunk)  # an adapter-off view of the trunk: the trunk it runs
    hook = trunk.register_forward_hook(lambda module, args, out: seen.append(out.last_hidden_state))
    base = model.__dict__.get("peft_model", model)
    base = base.get_base_model() if callable(getattr(base, "get_base_model", None)) else base
    extra = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(base.forward).parameters else {}
    try:
        out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False,
                    **extra)
    finally:
        hook.remove()
    hidden, logits = seen[-1], getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor) and logits.requires_grad:  # a trained head over a frozen trunk too
        return _ThroughRoot.apply(hidden, logits)
    return hidden


class _ThroughRoot(torch.autograd.Function):
    """``hidden`` unchanged, with the backward also giving ``logits`` a zero gradient: an FSDP2 root's
    hook on its outputs then runs (it gathers for, and reduces, the root's gradients)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.logits_shape, ctx.logits_dtype = logits.shape, logits.dtype
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        return grad, grad.new_zeros(ctx.logits_shape, dtype=ctx.logits_dtype)


class ValueHead(nn.Module):
    """A scalar head on hidden states: ``V = w·h + b``, hidden ``[..., T, H]`` → values ``[..., T]``.

    Initialised with ``w ~ N(0, 1/(H+1))`` under ``seed`` (global RNG untouched), ``b = 0``.

    References:
        Ziegler et al., "Fine-Tuning Language Models from Human Preferences" (a value head on the
        policy's trunk), https://arxiv.org/abs/1909.08593
    """

    def __init__(self, hidden_size: int, *, seed: int = 0, dtype: torch.dtype = torch.float32):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.summary = nn.Linear(hidden_size, 1, dtype=dtype)
        with torch.no_grad():
            self.summary.weight.copy_(torch.randn(1, hidden_size, generator=g) / math.sqrt(hidden_size + 1))
            self.summary.bias.zero_()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.summary(hidden.to(self.summary.weight.dtype)).squeeze(-1)


def policy_and_values(model: nn.Module, head: nn.Module, input_ids: torch.Tensor,
                      attention_mask: torch.Tensor, *, packed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One trunk forward feeding both the LM head and a value head (shared-trunk actor-critic).

    Args:
        head: maps hidden ``[B, T, H]`` to ``[B, T]`` (``ValueHead``).
        input_ids: ``[B, T]`` long.  attention_mask: ``[B, T]`` bool.
    Returns:
        ``logits [B, T, V]`` (``model.get_output_embeddings()`` on the hidden states) and
        ``values [B, T]`` (``head`` on the same hidden states). Both differentiable, through the
        shared trunk. ``packed``: the trunk padding-free (:func:`trunk_hidden`).
    """
    hidden = trunk_hidden(model, input_ids, attention_mask, packed=packed)
    return model.get_output_embeddings()(hidden), head(hidden)


def token_values(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, *,
                 head: nn.Module | None = None, packed: bool = False) -> torch.Tensor:
    """Per-position values ``[B, T]`` from a critic.

    With ``head=None``, ``model`` is a one-label token-classification model (``build_value_model``)
    and the values are its logits. With a ``head`` (e.g. ``ValueHead``), ``model`` is any causal
    LM or trunk and the values are ``head(trunk_hidden(model, ...))``. Value ``t`` is the value of
    the state after reading token ``t`` (before sampling ``t+1``). Positions come from the mask.

    Args:
        input_ids: ``[B, T]`` long.  attention_mask: ``[B, T]`` bool.
        packed: the trunk padding-free (:func:`trunk_hidden`); a token classifier's head
            (``score`` / ``classifier``) then runs on its states, without the classifier's dropout
            (the RL recipes turn dropout off).
    Returns:
        ``[B, T]``, differentiable (``score_rollout`` calls it under ``no_grad``).
    """
    if head is None and packed:
        head = _classifier_head(model)
        return head(trunk_hidden(model, input_ids, attention_mask, packed=True))[..., 0]
    if head is not None:
        return head(trunk_hidden(model, input_ids, attention_mask, packed=packed))
    check_mask("attention_mask", attention_mask, like=input_ids, like_name="input_ids")
    out = model(input_ids=input_ids, attention_mask=attention_mask.long(),
                position_ids=position_ids_from_mask(attention_mask), use_cache=False)
    return out.logits[..., 0]


def _classifier_head(model: nn.Module) -> nn.Module:
    head = getattr(model, "score", None) or getattr(model, "classifier", None)
    if head is None:
        raise TypeError(f"model: {type(model).__name__} has no `score` or `classifier` head; "
                        "pass a classification model (build_reward_model / build_value_model / load_model(task=...))")
    return head


def reward_model_scores(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, *,
                        packed: bool = False) -> torch.Tensor:
    """Sequence scores ``[B]`` of a sequence-classification reward model, read at the last real token.

    ``r_b = head(h_b[last_b])``, ``last_b = max{t : mask[b, t]}`` computed from the mask, so
    left and right padding give the same score and pad ids are never consulted (HF's pooling
    infers the last token from ``pad_token_id``, wrong when pad == eos or under left padding).
    The head (``model.score`` or ``model.classifier``) runs on the ``B`` gathered states only.

    Args:
        input_ids: ``[B, T]`` long.  attention_mask: ``[B, T]`` bool.
        packed: the trunk padding-free (:func:`trunk_hidden`).
    Returns:
        ``[B]`` (``[B, L]`` for a model with ``L > 1`` labels). Differentiable.

    References:
        Ouyang et al., "Training language models to follow instructions with human feedback"
        (the reward read at the final token), https://arxiv.org/abs/2203.02155
    """
    head = _classifier_head(model)
    hidden = trunk_hidden(model, input_ids, attention_mask, packed=packed)
    last = last_token_index(attention_mask)
    scores = head(hidden[torch.arange(hidden.shape[0], device=hidden.device), last])
    return scores.squeeze(-1) if scores.shape[-1] == 1 else scores


# --- reward functions ------------------------------------------------------------------------


def model_device(model: nn.Module) -> torch.device:
    """Where ``model``'s weights live: its first parameter's device, else its ``device`` attribute
    (a module that holds no parameter of its own, such as ``loops.lora.AdapterOff``)."""
    first = next(model.parameters(), None)
    return first.device if first is not None else torch.device(model.device)


# --- reference policy ------------------------------------------------------------------------
def make_reference(model: nn.Module) -> nn.Module:
    """A frozen deep copy of ``model`` in eval mode (no parameter requires grad)."""
    ref = copy.deepcopy(model).eval()
    ref.requires_grad_(False)
    return ref


@torch.no_grad()
def mix_into_reference(ref: nn.Module, policy: nn.Module, alpha: float) -> nn.Module:
    """Move the reference toward the policy, in place (TR-DPO's soft update): ``θ_ref ← α·θ + (1 − α)·θ_ref``
    for every parameter; ``alpha = 1`` copies the policy. Returns ``ref``.

    Raises ``ValueError`` when the two models' parameters differ in names or shapes (a reference of
    another architecture cannot be mixed), before any parameter changes. Both sharded by FSDP2: each
    rank mixes its own rows; a whole reference beside a sharded policy: the policy's parameters are
    gathered one at a time (a collective: every rank calls it).

    Reference: Gorbatovski et al., "Learn Your Reference Model for Real Good Alignment",
    https://arxiv.org/abs/2404.09656
    """
    if not 0 <= alpha <= 1:
        raise ValueError(f"alpha: expected a float in [0, 1], got {alpha!r}")
    ref_params, params = dict(ref.named_parameters()), dict(policy.named_parameters())
    shapes = lambda named: {n: tuple(p.shape) for n, p in named.items()}  # noqa: E731
    if shapes(ref_params) != shapes(params):
        differ = sorted(set(shapes(ref_params).items()) ^ set(shapes(params).items()))[:3]
        raise ValueError(f"ref_model: the reference's parameters differ from the policy's (e.g. {differ}); "
                         "only a reference of the policy's architecture can be synced")
    if sharded_root(ref) is None:  # a whole reference (of a whole policy, or on its ref_device beside a sharded one)
        for name, target in ref_params.items():
            target.lerp_(gathered(params[name]).to(target.device, target.dtype), alpha)
        return ref
    # FSDP2 (both sharded alike): each rank mixes its own rows; the reference's root, if a forward left it
    # gathered, is resharded first so that its next forward gathers the mixed rows
    release_gathered(ref)
    own, theirs = ref.state_dict(), policy.state_dict()  # the shards, even with a root gathered
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    for name in ref_params:
        target = local(own[name])
        target.lerp_(local(theirs[name]).to(target.dtype), alpha)
    return ref
