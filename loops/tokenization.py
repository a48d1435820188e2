"""Tokenisation of dataset rows: prompt / completion rendering (chat templates included),
truncation (``TRUNCATIONS``), assistant-only masks, bounded text windows for huge rows and the
checks that name a bad row and column (``tokenize_example``, ``tokenize_dataset``)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from datasets import Dataset

from rlcore.checks import lookup
from rlcore.loops.data import FORMATS, check_label_cell, check_number_cell, detect_format, formats_help, row_origins

__all__ = ["PROMPT_CUTS", "TRUNCATIONS", "is_conversation", "check_text", "max_token_chars", "text_window", "split_implicit_prompt",
           "preference_format", "tokenize_example", "tokenize_dataset", "model_context", "check_context", "PAIR_SIDES",
           "check_rows_fit"]


# Each entry cuts (prompt, completion) token lists to at most ``limit`` tokens in total and has
# the same signature. Prompt-only truncation passes an empty completion.
def _keep_start(prompt: list, completion: list, limit: int, where: str) -> tuple[list, list]:
    return prompt[:limit], completion[: max(limit - len(prompt), 0)]


def _keep_end(prompt: list, completion: list, limit: int, where: str) -> tuple[list, list]:
    drop = max(len(prompt) + len(completion) - limit, 0)
    return prompt[drop:], completion[max(drop - len(prompt), 0):]


def _no_truncation(prompt: list, completion: list, limit: int, where: str) -> tuple[list, list]:
    if len(prompt) + len(completion) > limit:
        raise ValueError(f"{where}: {len(prompt) + len(completion)} tokens exceed the limit of {limit} "
                         "(truncation='error'; use 'keep_start' or 'keep_end' to truncate)")
    return prompt, completion


# When the prompt is cut to ``max_prompt_length``: ``always``, or ``if_too_long`` (TRL's DPO rule).
PROMPT_CUTS = ("always", "if_too_long")


TRUNCATIONS: dict[str, Callable[[list, list, int, str], tuple[list, list]]] = {
    "keep_start": _keep_start,
    "keep_end": _keep_end,
    "error": _no_truncation,
}


def is_conversation(x: Any) -> bool:
    """Whether ``x`` is a conversation: a list of message mappings (``{"role", "content"}``)."""
    return isinstance(x, list) and all(isinstance(m, Mapping) for m in x)


def _render(tokenizer, prompt: Any, completion: Any | None, where: str) -> tuple[str, str | None, bool]:
    """(prompt text, completion text, templated?) with conversations rendered by the chat template."""
    if not is_conversation(prompt):
        if is_conversation(completion):
            raise ValueError(f"{where}: completion is a conversation but prompt is plain text; use both or neither")
        return prompt, completion, False
    prompt_text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    if completion is None:
        return prompt_text, None, True
    if not is_conversation(completion):
        return prompt_text, completion, True
    full = tokenizer.apply_chat_template(list(prompt) + list(completion), tokenize=False)
    if not full.startswith(prompt_text):
        raise ValueError(f"{where}: the chat template does not render the prompt as a prefix of the conversation, "
                         "so prompt and completion cannot be split; use plain prompt/completion text")
    return prompt_text, full[len(prompt_text):], True


def _assistant_turns(tokenizer, messages: Sequence[Mapping], add_eos: bool, where: str
                     ) -> tuple[list[int], list[int], list[bool]]:
    """(prompt ids, completion ids, completion mask) of a whole conversation, the mask True on the
    tokens of every assistant turn (its content and its end-of-turn text, as the chat template
    renders them): the prompt runs up to the first assistant turn, the completion is the rest.

    Each piece is the template's rendering of the conversation so far minus the rendering before
    it, so the template must render every turn as a continuation of the ones before."""
    pieces: list[tuple[str, bool]] = []
    done = ""
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        before = tokenizer.apply_chat_template(list(messages[:i]), tokenize=False, add_generation_prompt=True)
        after = tokenizer.apply_chat_template(list(messages[:i + 1]), tokenize=False)
        if not (before.startswith(done) and after.startswith(before)):
            raise ValueError(f"{where}: the chat template does not render each turn as a continuation of the turns "
                             "before it, so the assistant turns cannot be located; use assistant_only_loss=False")
        pieces += [(before[len(done):], False), (after[len(before):], True)]
        done = after
    prompt = tokenizer(pieces[0][0], add_special_tokens=False)["input_ids"]
    completion: list[int] = []
    mask: list[bool] = []
    for text, assistant in pieces[1:]:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
        completion += ids
        mask += [assistant] * len(ids)
    eos = tokenizer.eos_token_id
    if add_eos and eos is not None and (not completion or completion[-1] != eos):
        completion, mask = completion + [eos], mask + [True]
    return prompt, completion, mask


def check_text(name: str, value: Any, where: str) -> None:
    """A ``ValueError`` unless ``value`` is a string or a conversation (a list of ``{"role": str,
    "content": str}``), naming the row, the column and what it holds."""
    if isinstance(value, str):
        return
    if isinstance(value, list) and value and all(
            isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in value):
        return
    shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
    raise ValueError(f"{where}: column {name!r} must hold text (a string) or a conversation (a non-empty list "
                     f"of {{'role': str, 'content': str}}), got {type(value).__name__} {shown}")


@functools.lru_cache(maxsize=16)
def max_token_chars(tokenizer) -> int:
    """The most characters one token of ``tokenizer`` covers: the longest entry of its vocabulary
    (byte-level and SentencePiece spellings are at least as long as the text they stand for)."""
    return max((len(t) for t in tokenizer.get_vocab()), default=1) or 1


def text_window(text: Any, tokenizer, budget: int | None, keep: str) -> Any:
    """The part of ``text`` that can hold its first (``keep="keep_start"``) or last (``"keep_end"``)
    ``budget`` tokens: ``2·(budget + 8)·max_token_chars`` characters from that end, so tokenising a
    row costs memory bounded by the budget, not by the row's size. Shorter texts, conversations
    and ``budget=None`` are returned as they are. The window holds more than ``budget + 8`` tokens,
    so a text it cuts is still seen to be longer than ``budget``."""
    if budget is None or not isinstance(text, str):
        return text
    width = 2 * (budget + 8) * max_token_chars(tokenizer)
    if len(text) <= width:
        return text
    return text[:width] if keep == "keep_start" else text[-width:]


def _columns(format: str, row: Mapping, where: str) -> dict[str, Any]:
    """The (prompt, completion...) fields of ``row`` for ``format``, conversations unrolled, each
    checked to be text or a conversation (``check_text``)."""
    for column in FORMATS[format]:
        if column != "label":
            check_text(column, row[column], where)
    if format == "conversational":
        messages = list(row["messages"])
        if len(messages) < 1 or messages[-1].get("role") != "assistant":
            raise ValueError(f"{where}: 'messages' must end with an assistant message (the completion)")
        return {"prompt": messages[:-1], "completion": messages[-1:]}
    if format == "language_modeling":
        return {"prompt": "", "completion": row["text"]}
    if format == "implicit_preference":
        return split_implicit_prompt(row["chosen"], row["rejected"], where)
    return {c: row[c] for c in FORMATS[format]}


def split_implicit_prompt(chosen: Any, rejected: Any, where: str = "row") -> dict[str, Any]:
    """``{"prompt", "chosen", "rejected"}`` from two answers that repeat their prompt (TRL's implicit prompt).

    Conversations: the prompt is the messages both share from the start, the answers the rest.
    Text: the longest common start, less a space it ends with (the space stays with the answers).
    Raises ``ValueError`` when the two share nothing, or when one is all prompt.

    >>> split_implicit_prompt("Q: 1+1? A: 2", "Q: 1+1? A: 3")
    {'prompt': 'Q: 1+1? A:', 'chosen': ' 2', 'rejected': ' 3'}
    """
    conversation = is_conversation(chosen)
    if conversation != is_conversation(rejected):
        raise ValueError(f"{where}: chosen and rejected must both be conversations or both be text")
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    if not conversation and n > 0 and chosen[n - 1] == " ":
        n -= 1
    if n == 0 or n == len(chosen) or n == len(rejected):
        raise ValueError(f"{where}: chosen and rejected share {'no' if n == 0 else 'all of their'} start, so no "
                         "prompt can be split off; add a 'prompt' column")
    return {"prompt": chosen[:n], "chosen": chosen[n:], "rejected": rejected[n:]}


def preference_format(columns: Sequence[str]) -> str:
    """``"preference"`` with a ``prompt`` column, else ``"implicit_preference"`` (chosen / rejected only)."""
    return "preference" if "prompt" in columns else "implicit_preference"


def tokenize_example(row: Mapping, tokenizer, *, format: str | None = None,
                     formatting_func: Callable[[Mapping], str | Mapping] | None = None,
                     max_prompt_length: int | None = None, max_length: int | None = None,
                     truncation: str = "keep_start", prompt_truncation: str = "keep_end",
                     prompt_cut: str = "always", add_eos: bool = True, assistant_only_loss: bool = False,
                     where: str = "row") -> dict[str, list]:
    """Token ids of one example: ``prompt_ids`` and ``completion_ids`` (or ``chosen_ids`` /
    ``rejected_ids``; prompt-only rows give ``prompt_ids`` alone).

    ``assistant_only_loss`` (conversational rows): the whole conversation, the prompt up to the
    first assistant turn and the completion the rest, with ``completion_mask`` (a bool per
    completion token) True on every assistant turn (TRL's ``assistant_only_loss``); the collators
    turn it into the ``loss_mask``.

    Prompt and completion are tokenised separately (the prompt with the tokenizer's special
    tokens unless chat-templated, the completion without) and EOS is appended to a completion
    that does not already end with it. The prompt is cut to ``max_prompt_length`` with
    ``prompt_truncation``, then prompt + completion to ``max_length`` with ``truncation``
    (``TRUNCATIONS``: ``keep_start`` drops the completion's end, ``keep_end`` the prompt's start,
    ``error`` raises).

    ``prompt_cut="if_too_long"`` is TRL's rule for preference pairs (``DPOTrainer``): the prompt is
    cut to ``max_prompt_length`` (keeping the end ``prompt_truncation`` names) only when prompt +
    the longest completion exceed ``max_length``; if that is still too long, every completion is
    cut to ``max_length − max_prompt_length`` tokens (``max_length −`` the prompt's length without
    a ``max_prompt_length``), keeping its start.

    Raises:
        ValueError: unknown columns (the message lists the formats), an empty completion, a
            prompt that leaves no room for the completion under ``max_length``, an unpaired
            ``label`` that is not true / false, or a ``ref_chosen_logps`` / ``ref_rejected_logps``
            that is not a finite number (``loops.data.check_number_cell``).
    """
    if formatting_func is not None:
        out = formatting_func(row)
        row = {"text": out} if isinstance(out, str) else out
    fmt = detect_format(list(row)) if format is None else format
    if fmt not in FORMATS:
        raise ValueError(f"format: unknown format {fmt!r}; valid: [{formats_help()}]")
    missing = [c for c in FORMATS[fmt] if c not in row]
    if missing:
        raise ValueError(f"{where}: format {fmt!r} needs columns {list(FORMATS[fmt])}, missing {missing} "
                         f"(have {sorted(row)}); formats: [{formats_help()}]")
    if fmt == "unpaired":  # KTO's label; NaN, 0.5 or text would each read as True
        check_label_cell(row["label"], "label", where)
    for column in ("ref_chosen_logps", "ref_rejected_logps"):  # precomputed reference log-probs, read as float32
        if column in row:
            check_number_cell(row[column], column, where)
    cut_prompt = lookup(TRUNCATIONS, prompt_truncation, what="prompt_truncation")
    cut = lookup(TRUNCATIONS, truncation, what="truncation")
    if prompt_cut not in PROMPT_CUTS:
        raise ValueError(f"prompt_cut: unknown {prompt_cut!r}; valid: {list(PROMPT_CUTS)}")
    if assistant_only_loss and fmt != "conversational":
        raise ValueError(f"assistant_only_loss: needs conversations (a 'messages' column), got format {fmt!r}")
    fields = _columns(fmt, row, where)
    names = [c for c in ("completion", "chosen", "rejected") if c in fields]
    if prompt_cut == "if_too_long":  # the prompt is cut only past max_length: its window is max_length's
        prompt_window = (max_length, prompt_truncation if max_prompt_length is not None else truncation)
    elif max_prompt_length is not None:
        prompt_window = (max_prompt_length, prompt_truncation)
    else:
        prompt_window = (max_length, truncation)
    prompts, out = [], {}
    tokens, masks = {}, {}
    if assistant_only_loss:
        prompt, completion, masks["completion"] = _assistant_turns(tokenizer, list(row["messages"]), add_eos, where)
        tokens["completion"] = (prompt, completion)
    for name in [] if tokens else names or [None]:
        prompt_text, text, templated = _render(tokenizer, fields["prompt"], fields.get(name), where)
        # bounded memory: only the end of an over-long text that truncation keeps is tokenised
        prompt_text = text_window(prompt_text, tokenizer, *prompt_window)
        text = text_window(text, tokenizer, max_length, truncation)
        prompt = tokenizer(prompt_text, add_special_tokens=not templated)["input_ids"]
        if name is None:
            tokens[name] = (prompt, [])
            break
        if not text:
            raise ValueError(f"{where}: empty {name}; every example needs at least one completion token")
        completion = tokenizer(text, add_special_tokens=False)["input_ids"]
        eos = tokenizer.eos_token_id
        if add_eos and eos is not None and (not completion or completion[-1] != eos):
            completion = completion + [eos]
        tokens[name] = (prompt, completion)
    longest = max(len(c) for _, c in tokens.values())
    for name, (prompt, completion) in tokens.items():
        too_long = max_length is not None and len(prompt) + longest > max_length
        if max_prompt_length is not None and len(prompt) > max_prompt_length and (prompt_cut == "always" or too_long):
            prompt, _ = cut_prompt(prompt, [], max_prompt_length, f"{where}: prompt")
        if name is None:
            return {"prompt_ids": prompt}
        if prompt_cut == "if_too_long" and max_length is not None and len(prompt) + longest > max_length:
            room = max_length - (len(prompt) if max_prompt_length is None else max_prompt_length)
            completion = completion[:max(room, 0)]
        if max_length is not None and len(prompt) + len(completion) > max_length:
            kept = len(completion)
            prompt, completion = cut(prompt, completion, max_length, f"{where}: prompt + {name}")
            if name in masks:  # the mask follows its tokens: keep_start keeps the completion's start
                start = 0 if truncation == "keep_start" else kept - len(completion)
                masks[name] = masks[name][start:start + len(completion)]
        if not completion:
            raise ValueError(f"{where}: prompt of {len(prompt)} tokens leaves no room for the {name} under "
                             f"max_length={max_length}; raise max_length, lower max_prompt_length, or use "
                             "truncation='keep_end'")
        prompts.append(prompt)
        out[f"{name}_ids"] = completion
        if name in masks:
            out[f"{name}_mask"] = masks[name]
    # chosen and rejected share one prompt: the most cut one (every cut is a prefix or a suffix
    # of the same prompt, so the shortest keeps each side within max_length)
    return {"prompt_ids": min(prompts, key=len), **out}


def tokenize_dataset(dataset: Dataset, tokenizer, *, format: str | None = None,
                     formatting_func: Callable[[Mapping], str | Mapping] | None = None,
                     max_prompt_length: int | None = None, max_length: int | None = None,
                     truncation: str = "keep_start", prompt_truncation: str = "keep_end",
                     prompt_cut: str = "always", add_eos: bool = True, assistant_only_loss: bool = False) -> Dataset:
    """``tokenize_example`` over a dataset: adds the id columns, keeps every other column.

    The format is detected once from ``dataset.column_names`` (or from the first formatted row
    with ``formatting_func``). Error messages name the failing row: its file and line when it was
    read from a file (``loops.data.row_origin``), else its index.
    """
    if formatting_func is None and format is None:
        format = detect_format(dataset.column_names)

    origin = row_origins(dataset)

    def fn(row, index):
        return tokenize_example(row, tokenizer, format=format, formatting_func=formatting_func,
                                max_prompt_length=max_prompt_length, max_length=max_length, truncation=truncation,
                                prompt_truncation=prompt_truncation, prompt_cut=prompt_cut, add_eos=add_eos,
                                assistant_only_loss=assistant_only_loss, where=origin(index) or f"row {index}")

    return dataset.map(fn, with_indices=True, keep_in_memory=True, load_from_cache_file=False)


def model_context(model: Any) -> int | None:
    """The positions ``model`` reads: its config's ``max_position_embeddings`` (GPT-2's
    ``n_positions`` answers to that name too), or ``None`` for a model that states none."""
    context = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return context if isinstance(context, int) else None


def check_context(model: Any, tokens: int, what: str, fix: str) -> None:
    """Refuse a sequence of ``tokens`` positions past ``model``'s context (``model_context``):
    positions beyond ``max_position_embeddings`` index past GPT-2's position table (an
    ``IndexError`` mid-forward) or leave Llama's trained range. The one context check of every
    recipe: generation (``loops.collect``, and the online recipes' prompts before the first step,
    ``loops.online.check_prompt_lengths``) and the training rows of the offline recipes
    (``check_rows_fit``). Raises ``ValueError``: ``"{what} exceeds the model's context of C
    (max_position_embeddings); {fix}"``."""
    context = model_context(model)
    if context is not None and tokens > context:
        raise ValueError(f"{what} exceeds the model's context of {context} (max_position_embeddings); {fix}")


PAIR_SIDES = (("prompt_ids", "chosen_ids"), ("prompt_ids", "rejected_ids"))  # the two sequences of a tokenised pair


def check_rows_fit(model: Any, sides: Sequence[Sequence[str]], field: str = "max_length", **splits: Dataset) -> None:
    """Refuse, after the model is built and before the first step, a tokenised split whose longest
    sequence runs past ``model``'s context (``check_context``). ``sides``: the id columns that make
    one sequence, e.g. ``[("prompt_ids", "completion_ids")]`` (SFT), or one tuple per side of a
    pair. The error names the split, the row, its length, and the setting that cuts rows (``field``)."""
    context = model_context(model)
    for where, data in splits.items():
        if len(data) == 0:  # an empty held-out split (num_eval 0): no rows, and no id columns mapped onto it
            continue
        for columns in sides:
            lengths = [sum(map(len, parts)) for parts in zip(*(data[c] for c in columns))]
            if lengths:
                i = max(range(len(lengths)), key=lengths.__getitem__)
                check_context(model, lengths[i], f"dataset: the {where} split, row {i}: {' + '.join(columns)} "
                              f"of {lengths[i]} tokens", f"set {field} <= {context} to cut longer rows")
