"""Environments for multi-turn rollouts: a small protocol, a tool-calling environment and built-ins.

An environment is a plain object with two methods (the Gym / OpenEnv shape):

- ``reset(row) -> messages``: the opening conversation of an episode from one dataset row (a
  list of ``{"role", "content"}``), the prompt the model answers first;
- ``step(text) -> EnvStep``: the model's last assistant turn (its text) in, the environment's
  answer out: the messages it adds (tool results, a user's reply), an optional reward for the turn
  and whether the episode is over.

It is the only stateful part of a rollout and is made per episode by a factory (``() ->
environment``), so episodes share nothing. An environment may have ``schemas()`` (the JSON schemas
of its tools, which the chat template shows the model) and ``final_reward()`` (a reward read once
the episode ends). Every method runs on untrusted model text: a well-behaved environment answers
anything, and an exception one of its methods raises ends the run naming the environment, the
method and the episode (``loops.episodes``).

- :class:`ToolEnv`: tools as plain Python functions; each assistant turn's tool calls are parsed in
  the template's format (``loops.tools``) and run with a time limit, their results (or errors) sent
  back as ``tool`` messages; a turn with no call ends the episode.
- Built-ins (:data:`ENVS`): ``calculator`` (:func:`calculate`, exact arithmetic on integers and decimals, without ``eval``),
  ``lookup`` (facts the environment holds, :class:`LookupEnv`), ``python`` (code run in
  ``loops.sandbox``). :func:`resolve_env` turns a config's ``env`` (a built-in name or
  ``package.module:factory``) and ``tools`` (``package.module:function`` names) into a factory.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import json
import math
import operator
from collections.abc import Callable, Mapping, Sequence
from fractions import Fraction
from typing import Any, Protocol, runtime_checkable

from rlcore.checks import lookup
from rlcore.loops.reward_fns import import_callable
from rlcore.loops.tools import TOOL_CALL_FORMATS, call_tool, parse_tool_calls, tool_schema

__all__ = ["EnvStep", "Environment", "EnvFactory", "ToolEnv", "calculate", "CALCULATOR_SYSTEM", "calculator_env",
           "calculator_conversations", "LookupEnv", "ENVS", "resolve_env", "import_object"]


@dataclasses.dataclass(frozen=True)
class EnvStep:
    """An environment's answer to one assistant turn."""

    messages: tuple[Mapping[str, Any], ...] = ()
    reward: float | None = None
    done: bool = False


@runtime_checkable
class Environment(Protocol):
    def reset(self, row: Mapping[str, Any]) -> list[Mapping[str, Any]]: ...

    def step(self, text: str) -> EnvStep: ...


EnvFactory = Callable[[], Environment]


def _opening(row: Mapping[str, Any], system: str | None) -> list[dict[str, Any]]:
    """The opening conversation of a row: its ``prompt`` (text, or a conversation kept as it is),
    after ``system`` when given."""
    prompt = row["prompt"]
    messages = [dict(m) for m in prompt] if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]
    if system and not (messages and messages[0].get("role") == "system"):
        messages.insert(0, {"role": "system", "content": system})
    return messages


class ToolEnv:
    """An environment of tools: the model calls them, each call's result comes back as a ``tool``
    message, and an assistant turn with no call (and no malformed one) ends the episode.

    Args:
        tools: the functions the model may call, by their ``__name__`` (each with type hints and a
            docstring: ``loops.tools.tool_schema`` shows them to the chat template).
        format: how calls are written (a key of ``loops.tools.TOOL_CALL_FORMATS``).
        timeout_s: seconds one call may take (past it the model reads an error).
        max_result_chars: characters of a result the model reads.
        system: a system message put first in every episode (``None``: none).
    """

    def __init__(self, tools: Sequence[Callable[..., Any]], *, format: str = "qwen", timeout_s: float = 10.0,
                 max_result_chars: int = 2_000, system: str | None = None):
        lookup(TOOL_CALL_FORMATS, format, what="tool_format")
        self.tools = list(tools)
        self.by_name = {fn.__name__: fn for fn in self.tools}
        if len(self.by_name) != len(self.tools):
            raise ValueError(f"tools: two tools share a name: {[fn.__name__ for fn in self.tools]}")
        self.format, self.timeout_s, self.max_result_chars, self.system = format, timeout_s, max_result_chars, system
        self.calls = 0

    def schemas(self) -> list[dict[str, Any]]:
        """The tools' JSON schemas for the chat template's ``tools=``."""
        return [tool_schema(fn) for fn in self.tools]

    def reset(self, row: Mapping[str, Any]) -> list[Mapping[str, Any]]:
        self.calls = 0
        return _opening(row, self.system)

    def step(self, text: str) -> EnvStep:
        calls, errors = parse_tool_calls(text, self.format)
        if not calls and not errors:
            return EnvStep(done=True)
        self.calls += len(calls)
        results = [call_tool(c, self.by_name, timeout_s=self.timeout_s, max_chars=self.max_result_chars)
                   for c in calls]
        results += [f"error: {e}" for e in errors]
        return EnvStep(messages=tuple({"role": "tool", "content": r} for r in results))


# --- the calculator -----------------------------------------------------------------------------------
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_MAX_EXPRESSION_CHARS = 200
_MAX_MAGNITUDE = 10 ** 30


def _text(value: Fraction) -> str:
    """A result as the model reads it: an integer, a finite decimal written out exactly
    (``7/2`` → ``3.5``), another fraction as ``p/q``."""
    if value.denominator == 1:
        return str(value.numerator)
    rest, twos, fives = value.denominator, 0, 0
    while rest % 2 == 0:
        rest, twos = rest // 2, twos + 1
    while rest % 5 == 0:
        rest, fives = rest // 5, fives + 1
    if rest != 1:
        return f"{value.numerator}/{value.denominator}"
    places = max(twos, fives)
    scaled = abs(value.numerator) * 10 ** places // value.denominator
    sign = "-" if value < 0 else ""
    digits = str(scaled).rjust(places + 1, "0")
    return f"{sign}{digits[:-places]}.{digits[-places:]}"


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression exactly: integers and decimals with + - * / // % ** and brackets.

    Args:
        expression: the arithmetic to do, for example "12*(3+4)".
    """
    if not isinstance(expression, str) or len(expression) > _MAX_EXPRESSION_CHARS:
        return f"error: expected an expression of at most {_MAX_EXPRESSION_CHARS} characters"
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        return f"error: not an arithmetic expression: {expression!r}"

    def value(node: ast.AST) -> Fraction:  # numbers as written, exactly: 0.1 is 1/10
        if isinstance(node, ast.Expression):
            return value(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            if isinstance(node.value, float) and not math.isfinite(node.value):
                raise ValueError("not a finite number")
            return Fraction(node.value) if type(node.value) is int else Fraction(repr(node.value))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](value(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and right.denominator != 1:
                raise ValueError("a power must be a whole number")
            if isinstance(node.op, ast.Pow) and (abs(right) > 64 or abs(left) > 10 ** 6):
                raise OverflowError("power too large")
            out = _BINARY[type(node.op)](left, right)
            if abs(out) > _MAX_MAGNITUDE:
                raise OverflowError("result too large")
            return out
        raise ValueError(f"{type(node).__name__} is not arithmetic")

    try:
        out = value(tree)
    except ZeroDivisionError:
        return "error: division by zero"
    except (OverflowError, ValueError, TypeError, RecursionError) as e:
        return f"error: {e}"
    return _text(out)


CALCULATOR_SYSTEM = "Call calculate to do arithmetic, then give the answer alone."


def calculator_env(format: str = "qwen") -> ToolEnv:
    """The built-in ``calculator``: one tool, :func:`calculate`, for the arithmetic tasks."""
    return ToolEnv([calculate], format=format, system=CALCULATOR_SYSTEM)


def calculator_conversations(prompts: Sequence[str], answers: Sequence[str], *, fraction: float = 0.5,
                             format: str = "qwen") -> list[dict[str, list[dict[str, str]]]]:
    """SFT rows (``{"messages": [...]}``) that teach the calculator: the environment's own opening,
    then for the first ``fraction`` of the rows a call of ``calculate`` on the prompt's arithmetic (the
    prompt less its ``=``), the tool's result and the answer, for the others the answer alone: a
    partial skill of calling, which RL with the calculator can turn into a habit. Only Qwen's call
    format is written (``format``). Raises ``ValueError`` for a prompt whose arithmetic the calculator
    does not answer with its ``answer``."""
    if format != "qwen":
        raise ValueError(f"format: the demonstrations write Qwen's tool calls, got {format!r}")
    rows = []
    for i, (prompt, answer) in enumerate(zip(prompts, answers)):
        opening = [{"role": "system", "content": CALCULATOR_SYSTEM}, {"role": "user", "content": prompt}]
        if i < fraction * len(prompts):
            expression = prompt.removesuffix("=")
            if calculate(expression) != answer:
                raise ValueError(f"prompt {i}: the calculator answers {expression!r} with {calculate(expression)!r}, "
                                 f"not the answer {answer!r}")
            call = json.dumps({"name": "calculate", "arguments": {"expression": expression}}, separators=(",", ":"))
            turns = [{"role": "assistant", "content": f"<tool_call>{call}</tool_call>"},
                     {"role": "tool", "content": answer}, {"role": "assistant", "content": answer}]
        else:
            turns = [{"role": "assistant", "content": answer}]
        rows.append({"messages": opening + turns})
    return rows


# --- lookups ------------------------------------------------------------------------------------------
class LookupEnv(ToolEnv):
    """Facts held by the environment, read with one tool, ``lookup(key)``: an unknown key returns an
    error the model reads. The facts of an episode are its row's ``facts`` column when it has one
    (a mapping), else ``facts`` given here; multi-step questions chain lookups."""

    def __init__(self, facts: Mapping[str, str] | None = None, **kwargs: Any):
        self.facts: dict[str, str] = dict(facts or {})
        self._row_facts: dict[str, str] | None = None

        def lookup(key: str) -> str:
            """Look a fact up by its key.

            Args:
                key: the name of the fact.
            """
            table = self.facts if self._row_facts is None else self._row_facts
            if key not in table:
                return f"error: no fact {key!r}; known keys: {sorted(table)[:20]}"
            return table[key]

        super().__init__([lookup], **kwargs)

    def reset(self, row: Mapping[str, Any]) -> list[Mapping[str, Any]]:
        facts = row.get("facts")  # a datasets struct column fills the keys other rows have with None: dropped
        self._row_facts = ({str(k): str(v) for k, v in facts.items() if v is not None}
                           if isinstance(facts, Mapping) else None)
        return super().reset(row)


def python_env(format: str = "qwen") -> ToolEnv:
    """The built-in ``python``: code run by ``loops.sandbox.python_tool`` (a limited subprocess)."""
    from rlcore.loops.sandbox import python_tool

    return ToolEnv([python_tool], format=format, timeout_s=15.0,
                   system="Run Python with python_tool; print what you need.")


ENVS: dict[str, EnvFactory] = {
    "calculator": calculator_env,
    "lookup": LookupEnv,
    "python": python_env,
}


# --- from a config -------------------------------------------------------------------------------------
def import_object(spec: str, what: str) -> Any:
    """The callable a ``package.module:name`` string names, a module of the working directory
    included (``loops.reward_fns.import_callable``; ``what`` leads the errors)."""
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"{what}: expected 'package.module:name', got {spec!r}")
    return import_callable(module, name, spec=spec, what=what)


def resolve_env(env: str | EnvFactory | None, tools: Sequence[str | Callable[..., Any]] = (), *,
                tool_format: str = "qwen") -> EnvFactory | None:
    """The environment factory of a run: ``env`` as a factory, a built-in name (:data:`ENVS`) or
    ``package.module:factory``; with ``tools`` alone (``package.module:function`` names or functions),
    a :class:`ToolEnv` of them; ``None`` without either (single-turn rollouts). ``tool_format`` is the
    call format of the built-ins and of ``tools``; a factory's environment reads calls its own way."""
    functions = [import_object(t, "tools") if isinstance(t, str) else t for t in tools]
    if env is None:
        if not functions:
            return None
        for fn in functions:
            tool_schema(fn)  # a tool the template cannot show is refused before any model is built
        return lambda: ToolEnv(functions, format=tool_format)
    if functions:
        raise ValueError("tools: give tools or an env, not both (an environment brings its own tools)")
    if callable(env):
        return env
    if env in ENVS:  # a built-in parses calls in tool_format (a factory of yours in its own)
        return functools.partial(ENVS[env], format=tool_format)
    if ":" in env:
        return import_object(env, "env")
    raise ValueError(f"env: expected one of {sorted(ENVS)} or 'package.module:factory', got {env!r}")
