"""Offline models shaped like real families: Qwen2.5 and Llama-3 geometry, built from configs.

Real checkpoints cannot be downloaded in tests or benchmarks, but their shapes decide what a
recipe costs: grouped-query attention, a 128k-152k vocabulary (the LM head dominates the
logits' memory), tied or untied embeddings, RoPE with a large base. :func:`family_config` gives
a family's config at a size (``"tiny"`` for tests, or a real model's geometry: ``"0.5b"`` is
Qwen2.5-0.5B's, 494M parameters), :func:`family_tokenizer` a byte-level BPE trained offline with
the family's special tokens and chat template, and :func:`save_family_model` writes both as a
``from_pretrained`` folder, which the recipes load through the same path as a real checkpoint
(``--model PATH``).

The tokenizer learns a few hundred merges; the model keeps the family's full vocabulary (ids
past the tokenizer's are never produced, as the padding rows of real checkpoints).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, PreTrainedModel
from transformers import PreTrainedTokenizerFast

from rlcore.checks import lookup

__all__ = ["Family", "FAMILIES", "SIZES", "family_config", "family_tokenizer", "build_family_model",
           "save_family_model"]


@dataclasses.dataclass(frozen=True)
class Family:
    """What a model family fixes, whatever its size."""

    model_type: str                  # transformers' model_type (AutoConfig.for_model)
    vocab_size: int                  # rows of the embedding and the LM head
    rope_theta: float                # RoPE base
    rms_norm_eps: float
    bos: str                         # special tokens, as the family's tokenizer names them
    eos: str
    pad: str
    chat_template: str               # Jinja, the family's turn format
    pretokenize: str                 # the regex that splits text before BPE (numbers: 1 digit for Qwen, 1-3 for Llama-3)
    extra: tuple[tuple[str, Any], ...] = ()  # further config fields


# Qwen2.5: ChatML turns; Llama-3: header tokens. The generation prompt is a prefix of the full turn.
_CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
           "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
_LLAMA3 = ("{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
           "'<|end_header_id|>\\n\\n' + message['content'] + '<|eot_id|>' }}{% endfor %}"
           "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")

_WORDS = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|"""
_REST = r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
FAMILIES: dict[str, Family] = {
    "qwen2.5": Family("qwen2", 151_936, 1_000_000.0, 1e-6, bos="<|endoftext|>", eos="<|im_end|>",
                      pad="<|endoftext|>", chat_template=_CHATML, pretokenize=_WORDS + r"\p{N}" + _REST,
                      extra=(("use_sliding_window", False), ("attention_bias", True))),
    "llama3": Family("llama", 128_256, 500_000.0, 1e-5, bos="<|begin_of_text|>", eos="<|eot_id|>",
                     pad="<|finetune_right_pad_id|>", chat_template=_LLAMA3, pretokenize=_WORDS + r"\p{N}{1,3}" + _REST),
}
_SPECIALS = {"qwen2.5": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
             "llama3": ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                        "<|eot_id|>", "<|finetune_right_pad_id|>"]}

# (hidden, intermediate, layers, attention heads, key-value heads, tied embeddings) per family and size
SIZES: dict[tuple[str, str], tuple[int, int, int, int, int, bool]] = {
    ("qwen2.5", "tiny"): (64, 128, 2, 4, 2, True),
    ("qwen2.5", "0.5b"): (896, 4864, 24, 14, 2, True),       # Qwen2.5-0.5B
    ("qwen2.5", "1.5b"): (1536, 8960, 28, 12, 2, True),      # Qwen2.5-1.5B
    ("llama3", "tiny"): (64, 128, 2, 4, 2, False),
    ("llama3", "1b"): (2048, 8192, 16, 32, 8, True),         # Llama-3.2-1B
    ("llama3", "8b"): (4096, 14336, 32, 32, 8, False),       # Llama-3.1-8B
}

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.", "12 + 34 = 46", "reverse: abc -> cba", "sort: 3 1 2 -> 1 2 3",
    "Question: what is 7 times 8? Answer: 56", "def add(a, b):\n    return a + b\n",
    "Once upon a time there was a small model that learned to count.", "user\nassistant\nsystem\n",
    "0123456789 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ .,;:!?'\"()[]{}<>+-*/=_",
]


def _lookup(family: str, size: str) -> tuple[Family, tuple[int, int, int, int, int, bool]]:
    spec = lookup(FAMILIES, family, what="family")
    if (family, size) not in SIZES:
        raise ValueError(f"size: {family} has sizes {sorted(s for f, s in SIZES if f == family)}, got {size!r}")
    return spec, SIZES[(family, size)]


def family_tokenizer(family: str, *, vocab_size: int = 1024, texts: list[str] | None = None) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained offline (on ``texts``, default a small built-in corpus)
    with ``family``'s special tokens at the lowest ids, its bos / eos / pad and chat template."""
    spec, specials = _lookup(family, "tiny")[0], _SPECIALS[family]
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([  # the family's split, then bytes (GPT-2 style)
        pre_tokenizers.Split(Regex(spec.pretokenize), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(texts or _CORPUS), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=spec.bos, eos_token=spec.eos, pad_token=spec.pad,
                                   chat_template=spec.chat_template, padding_side="left", model_max_length=32768)


def family_config(family: str, size: str = "tiny", *, tokenizer: Any = None, model_type: str | None = None,
                  **overrides: Any) -> Any:
    """``family``'s transformers config at ``size`` (``SIZES``), special-token ids from
    ``tokenizer`` when given; ``overrides`` win (e.g. ``num_hidden_layers=1``). ``model_type``
    builds the same geometry in another architecture (``"llama"`` for a Qwen2.5 shape whose
    folder must load a tokenizer of its own choosing: transformers gives a ``qwen2`` folder
    Qwen's tokenizer class whatever the folder holds)."""
    spec, (hidden, inter, layers, heads, kv, tied) = _lookup(family, size)
    ids = {} if tokenizer is None else {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
                                        "pad_token_id": tokenizer.pad_token_id}
    fields = dict(vocab_size=spec.vocab_size, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv, tie_word_embeddings=tied,
                  rope_theta=spec.rope_theta, rms_norm_eps=spec.rms_norm_eps, max_position_embeddings=32768,
                  attention_dropout=0.0, **dict(spec.extra), **ids)
    return AutoConfig.for_model(model_type or spec.model_type, **{**fields, **overrides})


def build_family_model(family: str, size: str = "tiny", *, tokenizer: Any = None, seed: int = 0,
                       task: str = "causal_lm", dtype: torch.dtype = torch.float32, **overrides: Any) -> PreTrainedModel:
    """A randomly initialised ``family`` model at ``size`` (seeded, the global RNG untouched):
    a causal LM, or with ``task="reward"`` a one-label sequence classifier."""
    config = family_config(family, size, tokenizer=tokenizer, **overrides,
                           **({"num_labels": 1} if task == "reward" else {}))
    auto = {"causal_lm": AutoModelForCausalLM, "reward": AutoModelForSequenceClassification}[task]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return auto.from_config(config, dtype=dtype)


def save_family_model(directory: str | Path, family: str, size: str = "tiny", *, seed: int = 0,
                      task: str = "causal_lm", dtype: torch.dtype = torch.float32, **overrides: Any) -> Path:
    """Write a ``family`` model at ``size`` and its tokenizer as one ``from_pretrained`` folder."""
    directory = Path(directory)
    tokenizer = family_tokenizer(family)
    build_family_model(family, size, tokenizer=tokenizer, seed=seed, task=task, dtype=dtype,
                       **overrides).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
