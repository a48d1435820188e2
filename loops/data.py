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

Rows remember where they came from: errors about a row read from a file name the file and its
line (``.jsonl``) or row (other formats), also after the train / held-out split
(:func:`split_held_out`, :func:`row_origin`). A ``.jsonl`` file holds one JSON object per line
(blank lines are skipped); a NUL byte, a line that is not an object (``[1, 2]``, ``5``) or one
nested deeper than ``MAX_JSON_DEPTH`` (64, ``loops.checkpoint_codec``: the one bound of every JSON
rlcore reads) lists and objects is refused naming the file and line.
A numeric column rlcore reads (a reward ``margin_key`` column, ``ref_*_logps``, the unpaired
``label``) holding NaN, ``Infinity``, a number past float32's range or null is refused at load,
naming the file, line and column (:func:`check_number_column`).

Any text field may be a conversation (a list of ``{"role", "content"}`` dicts): it is rendered
with ``tokenizer.apply_chat_template`` (prompt with ``add_generation_prompt=True``, completion as
the continuation of the rendered conversation). Sequence batches are right padded; prompt
batches are left padded (ready for generation).
"""

from __future__ import annotations

import codecs
import dataclasses
from array import array
import json
import math
import numbers
import re
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any
from pathlib import Path

import datasets
from datasets import Dataset

from rlcore.loops.checkpoint_codec import MAX_JSON_DEPTH, json_depth

__all__ = ["formats_help", "FORMATS", "detect_format", "load_local", "load_source", "split_held_out", "row_origin",
           "row_origins", "check_number_cell", "check_label_cell", "check_number_column"]

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


def _jsonl_lines(path: Path) -> array:
    """The line (from 1) of each row of a ``.jsonl`` file, blank lines skipped as ``datasets`` does;
    a ``ValueError`` naming the file and line for a NUL byte or a line that is not a JSON object."""
    lines = array("q")
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if b"\x00" in line:
                raise ValueError(f"source: {path}, line {number}: holds a NUL byte (at column {line.index(0) + 1}); "
                                 "JSON text has none (write it as \\u0000 inside a string)")
            text = line.strip().removeprefix(b"\xef\xbb\xbf") if number == 1 else line.strip()
            if not text:
                continue
            if not text.startswith(b"{"):
                raise ValueError(f"source: {path}, line {number}: expected a JSON object ({{\"column\": value, ...}}) "
                                 f"per line, got {text[:40].decode(errors='replace')!r}")
            if text.count(b"[") + text.count(b"{") > MAX_JSON_DEPTH and json_depth(text) > MAX_JSON_DEPTH:
                raise ValueError(f"source: {path}, line {number}: nested deeper than {MAX_JSON_DEPTH} levels of lists "
                                 "and objects (the JSON reader would overflow its stack)")
            lines.append(number)
    return lines


# The deepest nesting of lists and objects a ``.jsonl`` line may hold: far past any dataset's (a
# conversation is 3 deep), far below the depth at which the JSON readers overflow their stack
# (pyarrow's crashes the process at some 20,000; Python's ``json`` raises RecursionError at ~1,000).

_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')


def _check_json_depth(path: Path) -> None:
    """A ``ValueError`` naming the line of a ``.json`` file (one document or JSON lines) where its
    nesting of lists and objects passes ``MAX_JSON_DEPTH``; each line scanned once (strings
    removed, brackets counted), bracket by bracket only where the depth could pass the bound."""
    depth = 0
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            text = _JSON_STRING.sub(b'""', line)
            opens = text.count(b"[") + text.count(b"{")
            if depth + opens > MAX_JSON_DEPTH and json_depth(text, depth) > MAX_JSON_DEPTH:
                raise ValueError(f"source: {path}, line {number}: nested deeper than {MAX_JSON_DEPTH} levels of lists "
                                 "and objects (the JSON reader would overflow its stack)")
            depth += opens - text.count(b"]") - text.count(b"}")


def _json_kind(value) -> str:
    return {bool: "bool", int: "number", float: "number", str: "str", list: "list", dict: "object"}.get(
        type(value), type(value).__name__)


def _overflowing_number(line: str) -> str | None:
    """The first number of a JSON line too large for a float64 (``1e400``), or ``None``."""
    found: list[str] = []

    def number(text: str) -> float:
        value = float(text)
        if math.isinf(value) and not found:
            found.append(text)
        return value
    json.loads(line, parse_float=number)
    return found[0] if found else None


def _bad_json_line(path: Path) -> str:
    """Where and why the first line of a ``.jsonl`` file that ``datasets`` cannot read fails ("" if
    none is found): not JSON, not an object, or a column holding another kind of value (text,
    number, list, object) than on the lines before (one column has one type)."""
    kinds: dict[str, tuple[str, int]] = {}
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except (ValueError, RecursionError) as e:
                return f", line {number}: not valid JSON ({type(e).__name__}: {e})"
            if (big := _overflowing_number(line)) is not None:
                return f", line {number}: the number {big} does not fit a float64 (it reads as infinite)"
            if not isinstance(row, dict):
                return f", line {number}: expected a JSON object, got {type(row).__name__}"
            for column, value in row.items():
                if value is None:
                    continue
                kind, first = kinds.setdefault(column, (_json_kind(value), number))
                if _json_kind(value) != kind:
                    return (f", line {number}: column {column!r} holds {_json_kind(value)} {value!r:.40} where line "
                            f"{first} holds {kind} (a column holds one type)")
    return ""


def _read_file(path: Path) -> Dataset:
    """One data file as a ``Dataset``: text formats checked to be UTF-8 first (and ``.jsonl`` to hold
    one object per line), and a file without rows refused (all with the file named), before any
    model is built. The dataset remembers its rows' file and lines (:func:`row_origin`)."""
    if path.suffix != ".parquet":
        _check_utf8(path)
    lines = _jsonl_lines(path) if path.suffix == ".jsonl" else None
    if path.suffix == ".json":
        _check_json_depth(path)
    try:
        data = _LOADERS[path.suffix](str(path), keep_in_memory=True)
    except StopIteration:  # what datasets raises for a file without a row (json) ...
        data = None
    except (ValueError, datasets.exceptions.DatasetGenerationError) as e:
        if "corresponds to no data" not in str(e):  # a csv of a header alone has no data
            where = _bad_json_line(path) if path.suffix == ".jsonl" else ""
            raise ValueError(f"source: {path}{where}: datasets cannot read it "
                             f"({type(e.__cause__ or e).__name__}: {e.__cause__ or e})") from e
        data = None
    if data is None or data.num_rows == 0:
        raise ValueError(f"source: {path} holds no rows")
    if lines is not None and any(isinstance(f, datasets.features.Json) for f in data.features.values()):
        mixed = _bad_json_line(path)  # datasets keeps such a column as JSON text and decodes "11" to 11
        if mixed:
            raise ValueError(f"source: {path}{mixed}")
    if lines is not None and len(lines) != data.num_rows:
        lines = None  # rows and lines do not pair up: name rows, not lines
    _ORIGINS[data] = _Origin(files=((path, lines, data.num_rows),))
    return data


# --- where rows come from --------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Origin:
    """The files a dataset was read from (path, line of each row or ``None``, rows), in order, and
    for a split, the row of the read data each of its rows is (``None``: the same)."""

    files: tuple[tuple[Path, Sequence[int] | None, int], ...]
    rows: Sequence[int] | None = None


_ORIGINS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Dataset -> _Origin


def row_origin(dataset: Dataset, i: int) -> str | None:
    """Where row ``i`` of ``dataset`` was read: ``"<file>, line <n>"`` for a ``.jsonl`` file (lines
    from 1), ``"<file>, row <r>"`` for other files (rows from 0), through :func:`split_held_out`;
    ``None`` for a dataset not read from a file by :func:`load_local` (or transformed since)."""
    return row_origins(dataset)(i)


def row_origins(dataset: Dataset) -> Callable[[int], str | None]:
    """``i -> row_origin(dataset, i)``, holding what it needs of the origin but not ``dataset``
    (cheap to hash in a ``Dataset.map`` function)."""
    origin = _ORIGINS.get(dataset)

    def where(i: int) -> str | None:
        if origin is None:
            return None
        r = origin.rows[i] if origin.rows is not None else i
        for path, lines, n in origin.files:
            if r < n:
                return f"{path}, line {lines[r]}" if lines is not None else f"{path}, row {r}"
            r -= n
        return None

    return where


# --- numeric columns -------------------------------------------------------------------------
_FLOAT32_MAX = 3.4028234663852886e38


def check_number_cell(value: Any, column: str, where: str) -> None:
    """A ``ValueError`` naming ``where`` (file and line) and ``column`` unless ``value`` is a finite
    real number within float32's range (±3.4e38): NaN, ``Infinity``, ``1e39``, null or text in a
    numeric column rlcore reads (a reward margin, a precomputed reference log-prob) would become a
    NaN or infinite loss, every step skipped."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not abs(value) <= _FLOAT32_MAX:
        raise ValueError(f"dataset: {where}: column {column!r} holds {_cell(value)}; expected a finite number "
                         "(within float32's ±3.4e38)")


def check_label_cell(value: Any, column: str, where: str) -> None:
    """A ``ValueError`` naming ``where`` and ``column`` unless ``value`` is a label: ``true`` /
    ``false`` (or the numbers 1 / 0). NaN, 0.5 or text would each read as True."""
    if not (isinstance(value, bool) or (isinstance(value, numbers.Real) and value in (0, 1))):
        raise ValueError(f"dataset: {where}: column {column!r} holds {_cell(value)}; expected true or false "
                         "(desirable or not)")


def _cell(value: Any) -> str:
    return "null" if value is None else f"{type(value).__name__} {value!r:.40}"


def check_number_column(dataset: Dataset, column: str, *, field: str) -> None:
    """:func:`check_number_cell` on every row of ``column`` of ``dataset``, naming the row's file and
    line (:func:`row_origin`); a missing column is a ``ValueError`` naming ``field``, the setting
    that names the column. Run at load, before any model is built."""
    if column not in dataset.column_names:
        raise ValueError(f"{field}: the dataset has no column {column!r} (have {sorted(dataset.column_names)})")
    origin = row_origins(dataset)
    for i, value in enumerate(dataset[column]):
        check_number_cell(value, column, origin(i) or f"row {i}")


def split_held_out(data: Dataset, n_eval: int, seed: int) -> tuple[Dataset, Dataset]:
    """``(train, held_out)``: ``data.train_test_split(test_size=n_eval, seed=seed, shuffle=True)``,
    each part remembering which row of ``data`` each of its rows is (:func:`row_origin` then names
    the file and line of a row of either part)."""
    column = "__rlcore_row__"
    parts = data.add_column(column, list(range(len(data)))).train_test_split(test_size=n_eval, seed=seed,
                                                                             shuffle=True)
    origin, out = _ORIGINS.get(data), []
    for key in ("train", "test"):
        rows, part = parts[key][column], parts[key].remove_columns(column)
        if origin is not None:
            _ORIGINS[part] = dataclasses.replace(
                origin, rows=array("q", rows if origin.rows is None else (origin.rows[r] for r in rows)))
        out.append(part)
    return out[0], out[1]


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
    parts = [_read_file(f) for f in files]
    data = datasets.concatenate_datasets(parts)
    _ORIGINS[data] = _Origin(files=tuple(f for part in parts for f in _ORIGINS[part].files))
    return data
