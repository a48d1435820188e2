"""Datasets to TensorDict batches: format detection, tokenisation, truncation, collation, packing.

Three steps, each a function:

1. ``load_local(source)``: a ``datasets.Dataset`` from a jsonl/json/parquet/csv file, a
   directory, or an in-memory list of rows / dict of columns; ``load_source`` also resolves a hub
   dataset name through ``datasets`` (its cache when offline).
2. ``tokenize_dataset(dataset, tokenizer, ...)``: detects the format from the columns
   (``FORMATS``), renders conversations with the chat template, tokenises prompt and completion
   separately, appends EOS to completions, truncates, and adds id columns (``prompt_ids``,
   ``completion_ids`` or ``chosen_ids`` / ``rejected_ids``). Other columns are kept (a reward
   function may want ``answer``).
3. ``collate(format, rows, pad_id=...)`` (or ``iterate_batches``): pads each batch to its own
   longest row and returns a TensorDict with the keys of ``rlcore.keys`` (``COLLATORS``);
   ``pack_sequences`` packs short SFT examples into fixed-length rows instead.

Formats (columns → batch):

================== ================================ ==============================================
format             columns                          batch
================== ================================ ==============================================
preference         prompt, chosen, rejected         nested chosen/rejected: input_ids,
                                                    attention_mask, loss_mask (+ ref_logps when the
                                                    dataset has ref_chosen_logps/ref_rejected_logps)
unpaired           prompt, completion, label        input_ids, attention_mask, loss_mask, labels
prompt_completion  prompt, completion               input_ids, attention_mask, loss_mask
conversational     messages                         as prompt_completion; the completion is the last
                                                    (assistant) message
language_modeling  text                             as prompt_completion, loss on every token
prompt_only        prompt                           prompt_ids (left padded), prompt_mask
================== ================================ ==============================================

Any text field may be a conversation (a list of ``{"role", "content"}`` dicts): it is rendered
with ``tokenizer.apply_chat_template`` (prompt with ``add_generation_prompt=True``, completion as
the continuation of the rendered conversation). Sequence batches are right padded; prompt
batches are left padded (ready for generation).
"""

from __future__ import annotations

import codecs
import functools
import random
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import datasets
from datasets import Dataset
from tensordict import TensorDict

from rlcore import keys as K
from rlcore.loops.models import pad_token_id

__all__ = ["FORMATS", "detect_format", "check_text", "max_token_chars", "text_window", "split_implicit_prompt",
           "preference_format", "load_local", "load_source", "TRUNCATIONS", "tokenize_example", "tokenize_dataset",
           "pad_sequences", "COLLATORS", "collate", "collate_prompts", "collate_sequences", "collate_preference",
           "collate_unpaired", "collate_mismatched", "iterate_batches", "pack_sequences"]

# Required columns per format, most specific first: detection takes the first whose columns are
# all present.
FORMATS: dict[str, tuple[str, ...]] = {
    "preference": ("prompt", "chosen", "rejected"),
    "implicit_preference": ("chosen", "rejected"),  # the prompt is the answers' shared start (TRL)
    "unpaired": ("prompt", "completion", "label"),
    "prompt_completion": ("prompt", "completion"),
    "conversational": ("messages",),
    "language_modeling": ("text",),
    "prompt_only": ("prompt",),
}


def _formats_help() -> str:
    return "; ".join(f"{name}: {', '.join(cols)}" for name, cols in FORMATS.items())


def detect_format(columns: Sequence[str]) -> str:
    """The first format of ``FORMATS`` whose columns are all in ``columns``.

    Raises ``ValueError`` listing the expected formats and the columns seen.

    >>> detect_format(["prompt", "completion", "id"])
    'prompt_completion'
    """
    for name, required in FORMATS.items():
        if all(c in columns for c in required):
            return name
    raise ValueError(f"dataset: columns {sorted(columns)} match no known format; expected one of "
                     f"[{_formats_help()}], or pass formatting_func=row -> str | dict of those columns")


def load_local(source: str | Path | Sequence[Mapping] | Mapping[str, Sequence] | Dataset) -> Dataset:
    """A ``datasets.Dataset`` from a local file (``.jsonl``, ``.json``, ``.parquet``, ``.csv``), a
    directory (``save_to_disk``'s, or one of data files such as a downloaded hub dataset), a list
    of row dicts, or a dict of columns. Nothing is downloaded.

    >>> load_local([{"prompt": "1+1=", "completion": "2"}]).column_names
    ['prompt', 'completion']
    """
    if isinstance(source, Dataset):
        return source
    if isinstance(source, Mapping):
        return Dataset.from_dict(dict(source))
    if isinstance(source, Sequence) and not isinstance(source, str):
        return Dataset.from_list(list(source))
    path = Path(source)
    if path.is_dir():
        return _load_directory(path)
    if path.suffix not in _LOADERS:
        raise ValueError(f"source: unsupported file type {path.suffix!r} for {path}; valid: {sorted(_LOADERS)} "
                         "or a directory")
    if not path.exists():
        raise FileNotFoundError(f"source: no such file {path}")
    return _read_file(path)


def _check_utf8(path: Path) -> None:
    """A ``ValueError`` naming the line and byte offset of the first byte of ``path`` that is not
    UTF-8, read in 1 MiB blocks (bounded memory whatever the file's size)."""
    decoder, line, offset = codecs.getincrementaldecoder("utf-8")(), 1, 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            try:
                decoder.decode(block)
            except UnicodeDecodeError as e:
                at_line = line + block[:e.start].count(b"\n")
                raise ValueError(f"source: {path} is not UTF-8 text: byte {offset + e.start} (line {at_line}) is "
                                 f"{block[e.start:e.start + 1]!r}; re-save the file as UTF-8") from None
            line, offset = line + block.count(b"\n"), offset + len(block)
        try:
            decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            raise ValueError(f"source: {path} is not UTF-8 text: it ends inside a multi-byte character") from None


def _read_file(path: Path) -> Dataset:
    """One data file as a ``Dataset``: text formats checked to be UTF-8 first, and a file without
    rows refused (both with the file named), before any model is built."""
    if path.suffix != ".parquet":
        _check_utf8(path)
    try:
        data = _LOADERS[path.suffix](str(path), keep_in_memory=True)
    except StopIteration:  # what datasets raises for a file without a row (json) ...
        data = None
    except ValueError as e:  # ... and for a csv of a header alone
        if "corresponds to no data" not in str(e):
            raise
        data = None
    if data is None or data.num_rows == 0:
        raise ValueError(f"source: {path} holds no rows")
    return data


# A hub dataset name, ``name`` or ``namespace/name``, with an optional ``:split``.
_HUB_NAME = re.compile(r"(?P<name>[A-Za-z0-9][\w.-]*(?:/[A-Za-z0-9][\w.-]*)?)(?::(?P<split>[\w.-]+))?")


def load_source(source: str | Path | Sequence[Mapping] | Mapping[str, Sequence] | Dataset) -> Dataset:
    """``load_local(source)`` for anything local; a name that is no local path, ``namespace/name``
    with an optional ``:split`` (default ``train``), is a hub dataset loaded by
    ``datasets.load_dataset`` (from its cache when ``HF_HUB_OFFLINE=1``; datasets runs no dataset
    scripts). Errors name the source and what was tried.

    >>> load_source([{"prompt": "1+1="}]).num_rows
    1
    """
    if not isinstance(source, (str, Path)) or Path(source).exists() or Path(source).suffix in _LOADERS:
        return load_local(source)
    match = _HUB_NAME.fullmatch(str(source))
    if match is None:
        raise FileNotFoundError(f"source: {str(source)!r} is no local file or directory, nor a hub dataset name "
                                "(namespace/name, optionally :split)")
    name, split = match["name"], match["split"] or "train"
    try:
        loaded = datasets.load_dataset(name, split=split)
    except Exception as e:  # noqa: BLE001 -- every failure becomes one message naming the source
        raise ValueError(f"source: {str(source)!r} is no local file or directory, and datasets could not load "
                         f"split {split!r} of the hub dataset {name!r}: {type(e).__name__}: {e}") from e
    return loaded


_LOADERS = {".jsonl": Dataset.from_json, ".json": Dataset.from_json, ".parquet": Dataset.from_parquet,
            ".csv": Dataset.from_csv}


def _load_directory(path: Path) -> Dataset:
    """A directory written by ``save_to_disk`` (a ``DatasetDict`` gives its ``train`` split), or a
    directory of data files of one type (a hub dataset's folder), concatenated in name order."""
    if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
        loaded = datasets.load_from_disk(str(path), keep_in_memory=True)
        if isinstance(loaded, datasets.DatasetDict):
            if "train" not in loaded:
                raise ValueError(f"source: {path} holds splits {sorted(loaded)} and no 'train'; pass the split's "
                                 f"directory ({path}/<split>)")
            return loaded["train"]
        return loaded
    files = sorted(f for f in path.rglob("*") if f.is_file() and f.suffix in _LOADERS)
    kinds = {_LOADERS[f.suffix] for f in files}
    if len(kinds) != 1:
        raise ValueError(f"source: {path} holds {'no' if not files else 'mixed'} data files "
                         f"({sorted({f.suffix for f in files})}); expected files of one type of {sorted(_LOADERS)}, "
                         "or a save_to_disk directory")
    return datasets.concatenate_datasets([_read_file(f) for f in files])


# --- truncation ------------------------------------------------------------------------------
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


# --- tokenisation ----------------------------------------------------------------------------
def _is_conversation(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(m, Mapping) for m in x)


def _render(tokenizer, prompt: Any, completion: Any | None, where: str) -> tuple[str, str | None, bool]:
    """(prompt text, completion text, templated?) with conversations rendered by the chat template."""
    if not _is_conversation(prompt):
        if _is_conversation(completion):
            raise ValueError(f"{where}: completion is a conversation but prompt is plain text; use both or neither")
        return prompt, completion, False
    prompt_text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    if completion is None:
        return prompt_text, None, True
    if not _is_conversation(completion):
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
    conversation = _is_conversation(chosen)
    if conversation != _is_conversation(rejected):
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
        ValueError: unknown columns (the message lists the formats), an empty completion, or a
            prompt that leaves no room for the completion under ``max_length``.
    """
    if formatting_func is not None:
        out = formatting_func(row)
        row = {"text": out} if isinstance(out, str) else out
    fmt = detect_format(list(row)) if format is None else format
    if fmt not in FORMATS:
        raise ValueError(f"format: unknown format {fmt!r}; valid: [{_formats_help()}]")
    missing = [c for c in FORMATS[fmt] if c not in row]
    if missing:
        raise ValueError(f"{where}: format {fmt!r} needs columns {list(FORMATS[fmt])}, missing {missing} "
                         f"(have {sorted(row)}); formats: [{_formats_help()}]")
    cut_prompt = _lookup_truncation(prompt_truncation, "prompt_truncation")
    cut = _lookup_truncation(truncation, "truncation")
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


def _lookup_truncation(name: str, arg: str):
    try:
        return TRUNCATIONS[name]
    except KeyError:
        raise ValueError(f"{arg}: unknown truncation {name!r}; valid: {sorted(TRUNCATIONS)}") from None


def tokenize_dataset(dataset: Dataset, tokenizer, *, format: str | None = None,
                     formatting_func: Callable[[Mapping], str | Mapping] | None = None,
                     max_prompt_length: int | None = None, max_length: int | None = None,
                     truncation: str = "keep_start", prompt_truncation: str = "keep_end",
                     prompt_cut: str = "always", add_eos: bool = True, assistant_only_loss: bool = False) -> Dataset:
    """``tokenize_example`` over a dataset: adds the id columns, keeps every other column.

    The format is detected once from ``dataset.column_names`` (or from the first formatted row
    with ``formatting_func``). Error messages name the failing row index.
    """
    if formatting_func is None and format is None:
        format = detect_format(dataset.column_names)

    def fn(row, index):
        return tokenize_example(row, tokenizer, format=format, formatting_func=formatting_func,
                                max_prompt_length=max_prompt_length, max_length=max_length, truncation=truncation,
                                prompt_truncation=prompt_truncation, prompt_cut=prompt_cut, add_eos=add_eos,
                                assistant_only_loss=assistant_only_loss, where=f"row {index}")

    return dataset.map(fn, with_indices=True, keep_in_memory=True, load_from_cache_file=False)


# --- collation -------------------------------------------------------------------------------
def pad_sequences(seqs: Sequence[Sequence[int]], *, side: str = "right", pad_value: int = 0
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad token lists to the longest: ids ``[B, T]`` long and mask ``[B, T]`` bool (True on tokens).

    >>> pad_sequences([[5], [6, 7]], side="left")
    (tensor([[0, 5],
            [6, 7]]), tensor([[False,  True],
            [ True,  True]]))
    """
    if side not in ("right", "left"):
        raise ValueError(f"side: expected 'right' or 'left', got {side!r}")
    width = max((len(s) for s in seqs), default=0)
    ids = torch.full((len(seqs), width), pad_value, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.bool)
    for i, s in enumerate(seqs):
        cols = slice(0, len(s)) if side == "right" else slice(width - len(s), width)
        ids[i, cols] = torch.as_tensor(list(s), dtype=torch.long)
        mask[i, cols] = True
    return ids, mask


def _as_columns(rows: Sequence[Mapping] | Mapping[str, Sequence]) -> Mapping[str, Sequence]:
    if isinstance(rows, Mapping):
        return rows
    return {k: [r[k] for r in rows] for k in rows[0]} if rows else {}


def _need(columns: Mapping, names: Sequence[str], where: str) -> None:
    missing = [n for n in names if n not in columns]
    if missing:
        raise KeyError(f"{where}: rows are missing {missing} (have {sorted(columns)}); "
                       "run tokenize_dataset / tokenize_example first")


def _sequence_batch(prompts: Sequence[list], completions: Sequence[list], pad_id: int,
                    completion_masks: Sequence[list] | None = None) -> TensorDict:
    ids, mask = pad_sequences([p + c for p, c in zip(prompts, completions)], pad_value=pad_id)
    if completion_masks is None:
        starts = torch.tensor([len(p) for p in prompts], dtype=torch.long)
        loss_mask = mask & (torch.arange(ids.shape[-1]) >= starts[:, None])
    else:  # the completion's own mask (assistant turns)
        loss_mask = pad_sequences([[0] * len(p) + [int(b) for b in m] for p, m in zip(prompts, completion_masks)],
                                  pad_value=0)[0].bool()
    return TensorDict({K.INPUT_IDS: ids, K.ATTENTION_MASK: mask, K.LOSS_MASK: loss_mask}, batch_size=[len(ids)])


def collate_prompts(rows, *, pad_id: int) -> TensorDict:
    """Prompts for generation: ``prompt_ids [B, P]`` left padded, ``prompt_mask [B, P]``."""
    cols = _as_columns(rows)
    _need(cols, ["prompt_ids"], "collate_prompts")
    ids, mask = pad_sequences(cols["prompt_ids"], side="left", pad_value=pad_id)
    return TensorDict({K.PROMPT_IDS: ids, K.PROMPT_MASK: mask}, batch_size=[len(ids)])


def collate_sequences(rows, *, pad_id: int) -> TensorDict:
    """SFT batch: ``input_ids`` (prompt + completion, right padded), ``attention_mask``,
    ``loss_mask`` (completion tokens, or where rows carry ``completion_mask``, the tokens it marks),
    all ``[B, T]`` with ``T`` the batch's longest row."""
    cols = _as_columns(rows)
    _need(cols, ["prompt_ids", "completion_ids"], "collate_sequences")
    return _sequence_batch(cols["prompt_ids"], cols["completion_ids"], pad_id, cols.get("completion_mask"))


def collate_preference(rows, *, pad_id: int) -> TensorDict:
    """Preference batch ``[B]`` with nested ``chosen`` / ``rejected`` sequence batches (each padded
    to its own longest); ``ref_logps [B]`` per side when the rows carry precomputed
    ``ref_chosen_logps`` / ``ref_rejected_logps``."""
    cols = _as_columns(rows)
    _need(cols, ["prompt_ids", "chosen_ids", "rejected_ids"], "collate_preference")
    sides = {}
    for side in (K.CHOSEN, K.REJECTED):
        td = _sequence_batch(cols["prompt_ids"], cols[f"{side}_ids"], pad_id)
        if f"ref_{side}_logps" in cols:
            td[K.REF_LOGPS] = torch.as_tensor(cols[f"ref_{side}_logps"], dtype=torch.float32)
        sides[side] = td
    return TensorDict(sides, batch_size=[len(cols["prompt_ids"])])


def collate_unpaired(rows, *, pad_id: int) -> TensorDict:
    """Unpaired (KTO) batch: the SFT layout plus ``labels [B]`` bool (True = desirable)."""
    cols = _as_columns(rows)
    _need(cols, ["prompt_ids", "completion_ids", "label"], "collate_unpaired")
    td = _sequence_batch(cols["prompt_ids"], cols["completion_ids"], pad_id)
    return td.update({K.LABELS: torch.as_tensor([bool(x) for x in cols["label"]], dtype=torch.bool)})


def collate_mismatched(rows, *, pad_id: int) -> TensorDict:
    """KTO's mismatched pairs: prompt ``i`` with the completion of row ``i − 1`` (cyclically),
    in the SFT layout. Their log-probs (``score_sequences``) give ``kl_logps`` / ``ref_kl_logps``,
    the batch estimate of the KL reference point. A batch of one pairs a row with itself.

    References:
        Ethayarajh et al., "KTO: Model Alignment as Prospect Theoretic Optimization",
        https://arxiv.org/abs/2402.01306
    """
    cols = _as_columns(rows)
    _need(cols, ["prompt_ids", "completion_ids"], "collate_mismatched")
    completions = list(cols["completion_ids"])
    return _sequence_batch(cols["prompt_ids"], completions[-1:] + completions[:-1], pad_id)


COLLATORS: dict[str, Callable[..., TensorDict]] = {
    "preference": collate_preference,
    "implicit_preference": collate_preference,
    "unpaired": collate_unpaired,
    "prompt_completion": collate_sequences,
    "conversational": collate_sequences,
    "language_modeling": collate_sequences,
    "prompt_only": collate_prompts,
}


def collate(format: str, rows, *, pad_id: int) -> TensorDict:
    """Collate tokenised rows (a list of row dicts or a dict of columns) with ``COLLATORS[format]``."""
    try:
        fn = COLLATORS[format]
    except KeyError:
        raise ValueError(f"format: unknown format {format!r}; valid: {sorted(COLLATORS)}") from None
    return fn(rows, pad_id=pad_id)


def iterate_batches(dataset: Dataset, tokenizer, batch_size: int, *, format: str, shuffle: bool = False,
                    seed: int = 0, drop_last: bool = False) -> Iterator[TensorDict]:
    """Batches of a tokenised dataset as TensorDicts, each padded to its own longest row.

    ``shuffle`` permutes the rows with a ``random.Random(seed)`` of its own (no global RNG).
    """
    order = list(range(len(dataset)))
    if shuffle:
        random.Random(seed).shuffle(order)
    pad = pad_token_id(tokenizer)
    stop = len(order) - (len(order) % batch_size if drop_last else 0)
    for start in range(0, stop, batch_size):
        yield collate(format, dataset[order[start:start + batch_size]], pad_id=pad)


# --- packing ---------------------------------------------------------------------------------
def pack_sequences(rows, seq_length: int, *, pad_id: int) -> TensorDict:
    """Pack short SFT examples into rows of ``seq_length`` tokens (first-fit decreasing).

    Each packed row holds whole examples one after another; an example longer than
    ``seq_length`` is cut to its first ``seq_length`` tokens. Besides the SFT keys it carries

    - ``segment_ids [N, L]`` long: 1, 2, … for the examples of the row, 0 on padding;
    - ``position_ids [N, L]`` long: restarting at 0 with each example (0 on padding).

    A Hugging Face model called with these ``position_ids`` and ``attention_mask=None`` attends
    within each example only (sdpa/eager/flash attention detect the restarts), so packing
    changes no log-prob: ``token_logprobs_from_model(model, input_ids, None,
    position_ids=position_ids)``.

    Args:
        rows: tokenised rows with ``prompt_ids`` and ``completion_ids`` (list of dicts or columns),
            and optionally ``completion_mask`` (the completion tokens that are targets).
    Returns:
        TensorDict ``[N]``: ``input_ids``, ``attention_mask``, ``loss_mask``, ``segment_ids``,
        ``position_ids``, all ``[N, seq_length]``.

    References:
        Krell et al., "Efficient Sequence Packing without Cross-contamination",
        https://arxiv.org/abs/2107.02027
    """
    cols = _as_columns(rows)
    _need(cols, ["prompt_ids", "completion_ids"], "pack_sequences")
    masks = cols.get("completion_mask") or [[True] * len(c) for c in cols["completion_ids"]]
    examples = [((list(p) + list(c))[:seq_length], ([False] * len(p) + [bool(b) for b in m])[:seq_length])
                for p, c, m in zip(cols["prompt_ids"], cols["completion_ids"], masks)]
    bins: list[list[int]] = []  # example indices per row
    room: list[int] = []
    for i in sorted(range(len(examples)), key=lambda i: -len(examples[i][0])):
        n = len(examples[i][0])
        j = next((j for j, r in enumerate(room) if r >= n), None)
        if j is None:
            j = len(bins)
            bins.append([])
            room.append(seq_length)
        bins[j].append(i)
        room[j] -= n
    shape = (len(bins), seq_length)
    out = {k: torch.zeros(shape, dtype=torch.long) for k in (K.SEGMENT_IDS, K.POSITION_IDS)}
    out[K.INPUT_IDS] = torch.full(shape, pad_id, dtype=torch.long)
    out[K.LOSS_MASK] = torch.zeros(shape, dtype=torch.bool)
    for r, members in enumerate(bins):
        start = 0
        for s, i in enumerate(sorted(members), start=1):
            ids, loss = examples[i]
            cols_ = slice(start, start + len(ids))
            out[K.INPUT_IDS][r, cols_] = torch.as_tensor(ids, dtype=torch.long)
            out[K.LOSS_MASK][r, cols_] = torch.as_tensor(loss, dtype=torch.bool)
            out[K.SEGMENT_IDS][r, cols_] = s
            out[K.POSITION_IDS][r, cols_] = torch.arange(len(ids))
            start += len(ids)
    out[K.ATTENTION_MASK] = out[K.SEGMENT_IDS] > 0
    return TensorDict(out, batch_size=[len(bins)])
