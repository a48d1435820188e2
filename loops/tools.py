"""Tools a model can call: their schemas, the calls read from its text, and running them safely.

Three pieces, each usable alone:

- :func:`tool_schema`: a typed Python function with a Google-style docstring → the JSON schema a
  chat template takes (``tokenizer.apply_chat_template(messages, tools=[tool_schema(f), ...])``);
  built by ``transformers.utils.get_json_schema``, whose errors come back naming the function;
- :func:`parse_tool_calls`: a model's text → ``(calls, errors)`` in the template's own format, one
  parser per format in :data:`TOOL_CALL_FORMATS`. A parser never raises on model output: malformed
  JSON, a missing name, arguments that are not an object, an unclosed tag or an oversized text
  each become an entry of ``errors``, which a loop can show the model;
- :func:`call_tool`: one :class:`ToolCall` → the result string the model sees. An unknown tool,
  arguments that do not fit the signature, an exception inside the tool and a time-out all
  become an ``"error: ..."`` string, never an exception.

Adding a format: write ``parse(text: str) -> tuple[list[ToolCall], list[str]]`` (linear in
``len(text)``, returning errors instead of raising; start it with ``_oversized(text)`` to refuse
texts past :data:`MAX_TOOL_TEXT_CHARS`) and add one entry to :data:`TOOL_CALL_FORMATS`.

>>> calls, errors = parse_tool_calls('<tool_call>\\n{"name": "add", "arguments": {"a": 1, "b": 2}}\\n</tool_call>')
>>> calls, errors
([ToolCall(name='add', arguments={'a': 1, 'b': 2})], [])
>>> def add(a: int, b: int) -> int:
...     '''Add two integers.
...
...     Args:
...         a: the first.
...         b: the second.
...     '''
...     return a + b
>>> call_tool(calls[0], {"add": add})
'3'
>>> call_tool(ToolCall("mul", {}), {"add": add})
"error: unknown tool 'mul'; available: ['add']"
"""

from __future__ import annotations

import inspect
import json
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rlcore.checks import lookup

__all__ = ["ToolCall", "tool_schema", "parse_qwen_tool_calls", "parse_llama3_tool_calls", "TOOL_CALL_FORMATS",
           "parse_tool_calls", "call_tool", "format_tool_result", "MAX_TOOL_TEXT_CHARS", "MAX_TOOL_CALLS"]

MAX_TOOL_TEXT_CHARS = 256 * 1024
"""Longest model text a parser reads; a longer one gives one error and no call."""
MAX_TOOL_CALLS = 32
"""Most calls a parser returns from one text; the rest give one error."""


@dataclass(frozen=True)
class ToolCall:
    """One call a model asked for: the tool's ``name`` and its keyword ``arguments``."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


# --- schemas -----------------------------------------------------------------------------------------
def tool_schema(fn: Callable[..., Any]) -> dict[str, Any]:
    """The chat-template schema of ``fn``: ``{"type": "function", "function": {"name", "description",
    "parameters": {"type": "object", "properties", "required"}}}``.

    ``fn`` needs a type hint on every argument (``int``, ``float``, ``str``, ``bool``, ``list[...]``,
    ``dict``, ``Literal[...]``, ``Optional[...]`` / ``X | None``) and a Google-style docstring whose
    first paragraph describes it and whose ``Args:`` section describes every argument. Arguments
    with a default are not ``required``.

    Raises:
        TypeError: ``fn`` is not a function.
        ValueError: a hint or the docstring (or one argument's entry in it) is missing; the message
            names the function.
    """
    from transformers.utils import get_json_schema  # transformers is heavy; only schemas need it
    from transformers.utils.chat_template_utils import DocstringParsingException, TypeHintParsingException

    name = getattr(fn, "__name__", None)
    if not callable(fn) or name is None:
        raise TypeError(f"tool_schema: expected a function, got {type(fn).__name__}")
    try:
        return get_json_schema(fn)
    except (DocstringParsingException, TypeHintParsingException, TypeError, ValueError) as e:
        raise ValueError(f"tool_schema({name}): {str(e).rstrip('.!')}. A tool needs a type hint on every argument and a "
                         "Google-style docstring: a description, then an 'Args:' entry per argument") from None


# --- parsing -------------------------------------------------------------------------------------------
def _oversized(text: str) -> list[str]:
    """``[error]`` when ``text`` is past :data:`MAX_TOOL_TEXT_CHARS` (or not a string), else ``[]``."""
    if not isinstance(text, str):
        return [f"expected the model's text as a string, got {type(text).__name__}"]
    if len(text) > MAX_TOOL_TEXT_CHARS:
        return [f"text of {len(text)} characters is past the limit of {MAX_TOOL_TEXT_CHARS}; not parsed"]
    return []


def _snippet(text: str, n: int = 80) -> str:
    return repr(text[:n] + ("..." if len(text) > n else ""))


def _decode(body: str) -> tuple[Any, str | None]:
    """``(value, None)`` or ``(None, error)``: ``json.loads`` that never raises (deep nesting included)."""
    try:
        return json.loads(body), None
    except (ValueError, RecursionError) as e:
        return None, f"malformed JSON ({type(e).__name__}: {str(e)[:120]}) in {_snippet(body)}"


def _to_call(obj: Any, arguments_keys: tuple[str, ...]) -> tuple[ToolCall | None, str | None]:
    """A decoded JSON value → a :class:`ToolCall`, or the reason it is not one.

    The arguments are read from the first of ``arguments_keys`` present (absent: ``{}``); a JSON
    string holding an object is accepted in their place."""
    if not isinstance(obj, dict):
        return None, f"a tool call must be a JSON object, got {type(obj).__name__}"
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return None, f"a tool call needs a non-empty string 'name', got {_snippet(json.dumps(name))}"
    key = next((k for k in arguments_keys if k in obj), None)
    arguments = obj[key] if key else {}
    if isinstance(arguments, str):
        decoded, _ = _decode(arguments)
        arguments = decoded if isinstance(decoded, dict) else arguments
    if not isinstance(arguments, dict):
        return None, f"tool call {name!r}: '{key}' must be a JSON object, got {type(arguments).__name__}"
    return ToolCall(name.strip(), arguments), None


def _collect(calls: list[ToolCall], errors: list[str], obj: Any, arguments_keys: tuple[str, ...]) -> bool:
    """Adds ``obj`` to ``calls`` (or its error to ``errors``); ``False`` once :data:`MAX_TOOL_CALLS` is reached."""
    if len(calls) >= MAX_TOOL_CALLS:
        errors.append(f"more than {MAX_TOOL_CALLS} tool calls; the rest are ignored")
        return False
    call, error = _to_call(obj, arguments_keys)
    if call is not None:
        calls.append(call)
    else:
        errors.append(error)
    return True


def parse_qwen_tool_calls(text: str) -> tuple[list[ToolCall], list[str]]:
    """Qwen2.5 / Hermes calls: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, any number.

    Text outside the tags is the model's message and is ignored. Each tag's body is one JSON object;
    a body that is not one, a nested ``<tool_call>`` and an unclosed tag are errors."""
    errors = _oversized(text)
    if errors:
        return [], errors
    open_, close = "<tool_call>", "</tool_call>"
    calls: list[ToolCall] = []
    start = text.find(open_)
    while start != -1:
        end = text.find(close, start + len(open_))
        if end == -1:
            errors.append(f"unclosed {open_} at character {start}")
            break
        body = text[start + len(open_):end].strip()
        if open_ in body:
            errors.append(f"nested {open_} at character {start}")
        else:
            obj, error = _decode(body)
            if error is not None:
                errors.append(error)
            elif not _collect(calls, errors, obj, ("arguments", "parameters")):
                break
        start = text.find(open_, end + len(close))
    return calls, errors


def parse_llama3_tool_calls(text: str) -> tuple[list[ToolCall], list[str]]:
    """Llama 3.1 JSON calls: the message is ``{"name": ..., "parameters": {...}}``, optionally after
    ``<|python_tag|>`` and before ``<|eom_id|>`` / ``<|eot_id|>``.

    A message that does not start with ``{`` (after the tag) is plain text: no call, no error. Several
    objects separated by whitespace or ``;`` are several calls; text after them is an error.
    ``"arguments"`` is read where ``"parameters"`` is absent."""
    errors = _oversized(text)
    if errors:
        return [], errors
    body = text.strip()
    tagged = body.startswith("<|python_tag|>")
    body = body.removeprefix("<|python_tag|>").strip()
    for stop in ("<|eom_id|>", "<|eot_id|>"):
        body = body.removesuffix(stop).rstrip()
    if not body.startswith("{"):
        return [], ([f"<|python_tag|> not followed by a JSON tool call: {_snippet(body)}"] if tagged else [])
    calls: list[ToolCall] = []
    decoder, i = json.JSONDecoder(), 0
    while i < len(body):
        try:
            obj, i = decoder.raw_decode(body, i)
        except (ValueError, RecursionError) as e:
            errors.append(f"malformed JSON ({type(e).__name__}: {str(e)[:120]}) in {_snippet(body[i:])}")
            break
        if not _collect(calls, errors, obj, ("parameters", "arguments")):
            break
        while i < len(body) and (body[i].isspace() or body[i] == ";"):
            i += 1
        if i < len(body) and body[i] != "{":
            errors.append(f"text after the tool call: {_snippet(body[i:])}")
            break
    return calls, errors


TOOL_CALL_FORMATS: dict[str, Callable[[str], tuple[list[ToolCall], list[str]]]] = {
    "qwen": parse_qwen_tool_calls,
    "llama3": parse_llama3_tool_calls,
}
"""Tool-call formats by name: ``text -> (calls, errors)``, each never raising on model output."""


def parse_tool_calls(text: str, format: str = "qwen") -> tuple[list[ToolCall], list[str]]:
    """The calls in a model's ``text`` and the errors met reading them, in ``format``
    (a key of :data:`TOOL_CALL_FORMATS`; an unknown one is a ``ValueError`` listing the valid names)."""
    return lookup(TOOL_CALL_FORMATS, format, what="format")(text)


# --- calling -------------------------------------------------------------------------------------------
def format_tool_result(value: Any, max_chars: int = 10_000) -> str:
    """A tool's return value as the model reads it: strings as they are, ``dict`` / ``list`` / ``tuple``
    as JSON, ``None`` as ``""``, anything else through ``str``; cut to ``max_chars`` with a marker."""
    if value is None:
        text = ""
    elif isinstance(value, str):
        text = value
    elif isinstance(value, (dict, list, tuple)):
        try:
            text = json.dumps(value, ensure_ascii=False, default=str)
        except (ValueError, TypeError, RecursionError):
            text = str(value)
    else:
        text = str(value)
    if len(text) > max_chars:
        text = f"{text[:max_chars]}\n... [truncated: {len(text) - max_chars} more characters]"
    return text


def call_tool(call: ToolCall, tools: Mapping[str, Callable[..., Any]], *, timeout_s: float = 10.0,
              max_chars: int = 10_000) -> str:
    """Runs ``tools[call.name](**call.arguments)`` and returns its result for the model (see
    :func:`format_tool_result`); every failure is returned as an ``"error: ..."`` string instead.

    The tool runs in a daemon thread, and the call stops waiting after ``timeout_s`` seconds. A
    Python thread cannot be killed: a tool past its limit keeps running in the background until it
    returns (its result is dropped). A tool that must be stopped hard belongs in a subprocess, as
    :func:`rlcore.loops.sandbox.run_python` does.
    """
    fn = tools.get(call.name) if isinstance(call.name, str) else None
    if fn is None:
        return f"error: unknown tool {call.name!r}; available: {sorted(tools)}"
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        signature = None  # a builtin without one: the call itself checks its arguments
    try:
        if signature is not None:
            signature.bind(**call.arguments)
    except TypeError as e:
        return f"error: bad arguments for tool {call.name!r}: {e}; expected {call.name}{signature}"
    outcome: list[str] = []

    def run() -> None:
        try:
            outcome.append(format_tool_result(fn(**call.arguments), max_chars))
        except BaseException as e:  # noqa: BLE001 (SystemExit too: the tool's failure, reported to the model)
            outcome.append(format_tool_result(f"error: tool {call.name!r} raised {type(e).__name__}: {e}",
                                              max_chars))

    worker = threading.Thread(target=run, name=f"tool-{call.name}", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if not outcome:
        return f"error: tool {call.name!r} timed out after {timeout_s:g} s"
    return outcome[0]
