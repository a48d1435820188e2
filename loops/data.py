"""Datasets to TensorDict batches: format detection and loading here, then tokenisation and collation.

Three steps, each a function (the second in ``loops.tokenization``, the third in ``loops.collate``):

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
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import datasets
from datasets import Dataset

__all__ = ["formats_help", "FORMATS", "detect_format", "load_local", "load_source"]

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


def formats_help() -> str:
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
                     f"[{formats_help()}], or pass formatting_func=row -> str | dict of those columns")


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


# --- tokenisation ----------------------------------------------------------------------------


# --- collation -------------------------------------------------------------------------------


# --- packing ---------------------------------------------------------------------------------
