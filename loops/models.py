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
import importlib
import inspect
import math
import string
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from torch import nn
from transformers import (AutoModelForCausalLM, AutoModelForSequenceClassification,
                          AutoModelForTokenClassification, AutoTokenizer, GPT2Config, LlamaConfig,
                          PreTrainedModel, PreTrainedTokenizerFast)

from rlcore.checks import check_mask, check_ndim, check_same_shape
from rlcore.loops.lora import AdapterOff

__all__ = [
    "build_tokenizer", "load_tokenizer", "pad_token_id", "TOKENIZER_KINDS", "CHAT_TEMPLATE",
    "build_model", "build_value_model", "build_reward_model", "load_model", "ARCHS", "TASKS",
    "disable_dropout", "position_ids_from_mask", "last_token_index", "trunk_hidden", "cache_keyword", "cache_length",
    "ValueHead", "policy_and_values", "token_values", "reward_model_scores",
    "call_reward_fn", "import_reward_fn", "reward_columns", "combine_rewards", "missing_eos_penalty",
    "MAX_ABS_REWARD", "check_reward_range",
    "make_reference", "mix_into_reference", "model_device",
]

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
    try:
        make = TOKENIZER_KINDS[kind]
    except KeyError:
        raise ValueError(f"kind: unknown tokenizer kind {kind!r}; valid: {sorted(TOKENIZER_KINDS)}") from None
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


def _lookup(registry: dict, name: str, what: str):
    try:
        return registry[name]
    except KeyError:
        raise ValueError(f"{what}: unknown {what} {name!r}; valid: {sorted(registry)}") from None


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
    auto = _lookup(TASKS, task, "task")
    ids = {f"{n}_token_id": getattr(tokenizer, f"{n}_token_id", None) for n in ("pad", "bos", "eos")}
    ids = {k: v for k, v in ids.items() if v is not None}
    config = _lookup(ARCHS, arch, "arch")(
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
        return _lookup(TASKS, task, "task").from_pretrained(name_or_path, trust_remote_code=trust_remote_code,
                                                            dtype=dtype, **kwargs)
    except ValueError as e:
        if trust_remote_code or "trust_remote_code" not in str(e):
            raise
        raise ValueError(f"model: {name_or_path} ships its own modelling code (its config's auto_map), which is "
                         "not run by default; read it, then set trust_remote_code: true (--trust_remote_code true) "
                         "to run it") from e


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
    model = model.wrapped if isinstance(model, AdapterOff) else model
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


def trunk_hidden(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, *,
                 position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Last hidden states of the model's trunk (the input of its head): ``[B, T, H]``.

    The trunk is ``model.get_decoder()`` (``model.model`` for Llama, ``model.transformer`` for
    GPT-2), else ``model.base_model``; no logits are computed. Positions come from the mask
    unless given; no KV cache is built.

    Args:
        input_ids: ``[B, T]`` long.
        attention_mask: ``[B, T]`` bool, or ``None`` for unpadded (or packed) rows.
        position_ids: ``[B, T]`` long, default ``position_ids_from_mask(attention_mask)``.
    """
    check_ndim("input_ids", input_ids, ndim=2, layout="[B, T]")
    if attention_mask is not None:
        check_mask("attention_mask", attention_mask, like=input_ids, like_name="input_ids")
        if position_ids is None:
            position_ids = position_ids_from_mask(attention_mask)
        attention_mask = attention_mask.long()
    out = _decoder(model)(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          use_cache=False)
    return out.last_hidden_state


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
                      attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One trunk forward feeding both the LM head and a value head (shared-trunk actor-critic).

    Args:
        head: maps hidden ``[B, T, H]`` to ``[B, T]`` (``ValueHead``).
        input_ids: ``[B, T]`` long.  attention_mask: ``[B, T]`` bool.
    Returns:
        ``logits [B, T, V]`` (``model.get_output_embeddings()`` on the hidden states) and
        ``values [B, T]`` (``head`` on the same hidden states). Both differentiable, through the
        shared trunk.
    """
    hidden = trunk_hidden(model, input_ids, attention_mask)
    return model.get_output_embeddings()(hidden), head(hidden)


def token_values(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, *,
                 head: nn.Module | None = None) -> torch.Tensor:
    """Per-position values ``[B, T]`` from a critic.

    With ``head=None``, ``model`` is a one-label token-classification model (``build_value_model``)
    and the values are its logits. With a ``head`` (e.g. ``ValueHead``), ``model`` is any causal
    LM or trunk and the values are ``head(trunk_hidden(model, ...))``. Value ``t`` is the value of
    the state after reading token ``t`` (before sampling ``t+1``). Positions come from the mask.

    Args:
        input_ids: ``[B, T]`` long.  attention_mask: ``[B, T]`` bool.
    Returns:
        ``[B, T]``, differentiable (``score_rollout`` calls it under ``no_grad``).
    """
    if head is not None:
        return head(trunk_hidden(model, input_ids, attention_mask))
    check_mask("attention_mask", attention_mask, like=input_ids, like_name="input_ids")
    out = model(input_ids=input_ids, attention_mask=attention_mask.long(),
                position_ids=position_ids_from_mask(attention_mask), use_cache=False)
    return out.logits[..., 0]


def reward_model_scores(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Sequence scores ``[B]`` of a sequence-classification reward model, read at the last real token.

    ``r_b = head(h_b[last_b])``, ``last_b = max{t : mask[b, t]}`` computed from the mask, so
    left and right padding give the same score and pad ids are never consulted (HF's pooling
    infers the last token from ``pad_token_id``, wrong when pad == eos or under left padding).
    The head (``model.score`` or ``model.classifier``) runs on the ``B`` gathered states only.

    Args:
        input_ids: ``[B, T]`` long.  attention_mask: ``[B, T]`` bool.
    Returns:
        ``[B]`` (``[B, L]`` for a model with ``L > 1`` labels). Differentiable.

    References:
        Ouyang et al., "Training language models to follow instructions with human feedback"
        (the reward read at the final token), https://arxiv.org/abs/2203.02155
    """
    head = getattr(model, "score", None) or getattr(model, "classifier", None)
    if head is None:
        raise TypeError(f"model: {type(model).__name__} has no `score` or `classifier` head; "
                        "pass a sequence-classification model (build_reward_model / load_model(task='reward'))")
    hidden = trunk_hidden(model, input_ids, attention_mask)
    last = last_token_index(attention_mask)
    scores = head(hidden[torch.arange(hidden.shape[0], device=hidden.device), last])
    return scores.squeeze(-1) if scores.shape[-1] == 1 else scores


# --- reward functions ------------------------------------------------------------------------
RewardFn = Callable[..., "Sequence[float | None] | torch.Tensor"]


def _by_keyword(fn: RewardFn) -> bool:
    """Whether ``fn`` names ``completions`` as a keyword it accepts (TRL's calling convention)."""
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # builtins and C callables: positional
        return False
    param = parameters.get("completions")
    return param is not None and param.kind in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY)


def call_reward_fn(fn: RewardFn, prompts: Sequence[str], completions: Sequence[str], **columns) -> torch.Tensor:
    """Call a reward function and return its ``[B]`` scores as float32.

    A function that names a ``completions`` parameter is called by keyword as TRL calls one,
    ``fn(prompts=..., completions=..., **columns)`` (``prompts`` and columns it does not accept are
    left out when it takes no ``**kwargs``), so ``def correct(completions, answer, **kw)`` works;
    any other is called positionally, ``fn(prompts, completions, **columns)``.

    ``fn`` returns ``B`` scores: a list whose ``None`` entries mean "no opinion" (returned as NaN:
    the online recipes leave such samples out of training and of the group statistics, and count
    them), or a ``[B]`` tensor (detached). Raises ``ValueError`` naming the function for another
    number or shape of scores, and for a NaN or infinite score (return ``None`` for no opinion).

    >>> call_reward_fn(lambda p, c: [len(x) for x in c], ["q", "q"], ["ab", ""])
    tensor([2., 0.])
    >>> def correct(completions, answer, **kwargs):
    ...     return [float(c == a) for c, a in zip(completions, answer)]
    >>> call_reward_fn(correct, ["1+1=", "2+2="], ["2", "5"], answer=["2", "4"])
    tensor([1., 0.])
    """
    if _by_keyword(fn):
        kwargs = {"prompts": list(prompts), "completions": list(completions), **columns}
        parameters = inspect.signature(fn).parameters
        if not any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
            kwargs = {k: v for k, v in kwargs.items() if k in parameters}
        out = fn(**kwargs)
    else:
        out = fn(list(prompts), list(completions), **columns)
    name = f"reward function {getattr(fn, '__name__', repr(fn))}"
    if isinstance(out, torch.Tensor):
        scores = out.detach().to(torch.float32)
        opinion = torch.ones_like(scores, dtype=torch.bool)
    else:
        try:
            values = list(out)
        except TypeError:
            raise ValueError(f"{name}: expected a list of {len(completions)} scores or a [B] tensor, got "
                             f"{type(out).__name__}") from None
        opinion = torch.tensor([v is not None for v in values], dtype=torch.bool)
        try:
            scores = torch.tensor([0.0 if v is None else float(v) for v in values], dtype=torch.float32)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{name}: every score must be a number or None, got {values[:4]!r}... ({e})") from None
    if scores.shape != (len(completions),):
        raise ValueError(f"{name}: expected {len(completions)} scores [B], got shape {list(scores.shape)}")
    bad = (~torch.isfinite(scores) & opinion).nonzero().flatten().tolist()
    if bad:
        raise ValueError(f"{name}: non-finite scores {scores[bad[:4]].tolist()} at rows {bad[:8]}; return None "
                         "for a sample it has no opinion on")
    check_reward_range(scores[opinion], name)
    return torch.where(opinion, scores, math.nan)


# The largest reward magnitude the recipes take: squares (value losses, variances) and sums over a
# rollout of such rewards stay far inside float32's range (3.4e38).
MAX_ABS_REWARD = 1e10


def check_reward_range(scores: torch.Tensor, name: str) -> None:
    """A ``ValueError`` naming ``name`` for a finite score beyond ``±MAX_ABS_REWARD``: a loss built
    on it (a squared value error, a variance over the group) would overflow to inf or NaN."""
    big = (scores.abs() > MAX_ABS_REWARD).nonzero().flatten().tolist()
    if big:
        raise ValueError(f"{name}: scores {scores[big[:4]].tolist()} at rows {big[:8]} exceed ±{MAX_ABS_REWARD:g}, "
                         "where the losses' squares and sums overflow float32; rescale the rewards")


def reward_columns(fn: RewardFn) -> tuple[str, ...]:
    """The dataset columns ``fn`` cannot run without: its ``required_columns`` attribute when set
    (``combine_rewards`` sets the union of its functions'), else the parameters its signature
    requires besides ``prompts`` and ``completions`` (no default, not ``*args`` / ``**kwargs``).

    >>> def correct(completions, answer, **kwargs): ...
    >>> reward_columns(correct)
    ('answer',)
    """
    if hasattr(fn, "required_columns"):
        return tuple(fn.required_columns)
    try:
        parameters = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return ()
    named = parameters if _by_keyword(fn) else parameters[2:]
    return tuple(p.name for p in named if p.default is p.empty and p.name not in ("prompts", "completions")
                 and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


def import_reward_fn(spec: str) -> RewardFn:
    """The reward function ``"package.module:function"`` names (a config's ``reward_funcs``).

    Naming a function in a config runs that code, as a script would: pass only configs you trust.
    Raises ``ValueError`` naming the spec when it is malformed, the module cannot be imported or
    the attribute is missing or not callable.
    """
    module_name, sep, attr = str(spec).partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"reward_funcs: expected 'package.module:function', got {spec!r}")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"reward_funcs: cannot load {spec!r} ({type(e).__name__}: {e})") from None
    if not callable(obj):
        raise ValueError(f"reward_funcs: {spec!r} is not callable (a {type(obj).__name__})")
    return obj


def combine_rewards(funcs: Sequence[RewardFn], weights: Sequence[float] | None = None) -> RewardFn:
    """A reward function returning ``Σ_k w_k r_k`` over ``funcs`` (``None`` terms left out; ``None`` if all are).

    A function that returns ``None`` for a row abstains there (weight renormalisation is not
    applied: the other terms are summed as they are). ``weights`` default to 1.

    Returns:
        A reward function with the same signature, returning ``B`` floats (``None``: no opinion).

    References:
        Lambert et al., "Tülu 3" (verifiable rewards as Python checks),
        https://arxiv.org/abs/2411.15124
    """
    weights = [1.0] * len(funcs) if weights is None else list(weights)
    if len(weights) != len(funcs):
        raise ValueError(f"weights: expected {len(funcs)} weights (one per function), got {len(weights)}")

    def combined(prompts, completions, **columns) -> list[float | None]:
        r = torch.stack([call_reward_fn(f, prompts, completions, **columns) for f in funcs])  # [K, B]
        w = torch.tensor(weights, dtype=r.dtype)[:, None]
        missing = torch.isnan(r)
        total = torch.where(missing, 0.0, w * r).sum(0)
        return [None if gone else value for gone, value in zip(missing.all(0).tolist(), total.tolist())]

    combined.required_columns = tuple(dict.fromkeys(c for f in funcs for c in reward_columns(f)))
    return combined


def missing_eos_penalty(score: torch.Tensor, response_ids: torch.Tensor, response_mask: torch.Tensor, *,
                        eos_token_id: int | Sequence[int], penalty: float = 1.0) -> torch.Tensor:
    """Subtract ``penalty`` from the score of every response without an EOS among its real tokens.

    ``s'_b = s_b − penalty · 1[no t with mask[b,t] and ids[b,t] ∈ eos]`` (truncated generations).

    Args:
        score: ``[B]`` float.  response_ids: ``[B, R]`` long.  response_mask: ``[B, R]`` bool.
        eos_token_id: one id or several stop ids.
    Returns:
        ``[B]``; gradient flows to ``score`` only.

    References:
        Huang et al., "The N+ Implementation Details of RLHF with PPO",
        https://arxiv.org/abs/2403.17031

    >>> missing_eos_penalty(torch.tensor([1.0, 1.0]), torch.tensor([[5, 2], [5, 6]]),
    ...                     torch.ones(2, 2, dtype=torch.bool), eos_token_id=2, penalty=0.5)
    tensor([1.0000, 0.5000])
    """
    check_ndim("score", score, ndim=1, layout="[B]")
    check_ndim("response_ids", response_ids, ndim=2, layout="[B, R]")
    check_mask("response_mask", response_mask, like=response_ids, like_name="response_ids")
    eos = torch.as_tensor(eos_token_id, device=response_ids.device).reshape(-1)
    has_eos = (torch.isin(response_ids, eos) & response_mask).any(-1)
    check_same_shape("score", score, has_eos=has_eos)
    return torch.where(has_eos, score, score - penalty)


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
    another architecture cannot be mixed), before any parameter changes.

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
    for name, target in ref_params.items():
        target.lerp_(params[name].to(target.dtype), alpha)
    return ref
