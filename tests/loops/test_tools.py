"""loops.tools: schemas from typed functions, tool calls parsed from model text, and call_tool's error paths."""

import json
import threading
import time
from typing import Literal, Optional

import pytest

from rlcore.loops.tools import (MAX_TOOL_CALLS, MAX_TOOL_TEXT_CHARS, TOOL_CALL_FORMATS, ToolCall, call_tool,
                                format_tool_result, parse_llama3_tool_calls, parse_qwen_tool_calls, parse_tool_calls,
                                tool_schema)


def get_weather(city: str, days: int, unit: Literal["celsius", "fahrenheit"] = "celsius",
                hourly: Optional[bool] = None, tags: list[str] | None = None, scale: float = 1.0) -> str:
    """Get the weather forecast.

    Args:
        city: The city's name.
        days: How many days ahead.
        unit: The temperature unit.
        hourly: Whether to give hourly values.
        tags: Labels to filter by.
        scale: A factor.
    """
    return f"{city}: sunny for {days} days in {unit}"


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


# --- schemas -------------------------------------------------------------------------------------------
def test_schema_of_a_typical_signature():
    schema = tool_schema(get_weather)
    assert schema["type"] == "function"
    fn = schema["function"]
    assert fn["name"] == "get_weather" and fn["description"] == "Get the weather forecast."
    params = fn["parameters"]
    assert params["type"] == "object" and params["required"] == ["city", "days"]
    props = params["properties"]
    assert props["city"] == {"type": "string", "description": "The city's name."}
    assert props["days"]["type"] == "integer" and props["scale"]["type"] == "number"
    assert props["unit"]["enum"] == ["celsius", "fahrenheit"]
    assert props["hourly"]["type"] == "boolean" and props["hourly"].get("nullable") is True
    assert props["tags"]["type"] == "array" and props["tags"]["items"] == {"type": "string"}
    json.dumps(schema)  # plain JSON


def test_schema_goes_through_a_chat_template(tokenizer):
    template = "{% for t in tools %}[{{ t.function.name }}:{{ t.function.parameters.required | join(',') }}]{% endfor %}"
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=[tool_schema(add)],
                                         chat_template=template, tokenize=False)
    assert text == "[add:a,b]"


def test_schema_of_the_python_tool():
    from rlcore.loops.sandbox import python_tool
    fn = tool_schema(python_tool)["function"]
    assert fn["name"] == "python_tool" and fn["parameters"]["required"] == ["code"]


def no_hints(a, b):
    """Add.

    Args:
        a: x
        b: y
    """


def no_doc(a: int) -> int:
    return a


def missing_arg_doc(a: int, b: int) -> int:
    """Add.

    Args:
        a: x
    """


@pytest.mark.parametrize("fn, missing", [(no_hints, "type hint"), (no_doc, "docstring"), (missing_arg_doc, "'b'")])
def test_schema_errors_name_the_function_and_what_is_missing(fn, missing):
    with pytest.raises(ValueError, match=rf"tool_schema\({fn.__name__}\)") as info:
        tool_schema(fn)
    assert missing in str(info.value)


def test_schema_of_a_non_function_is_a_type_error():
    with pytest.raises(TypeError, match="expected a function"):
        tool_schema(3)


# --- parsing: qwen -------------------------------------------------------------------------------------
def qwen(*objs: object) -> str:
    return "".join(f"<tool_call>\n{o if isinstance(o, str) else json.dumps(o)}\n</tool_call>" for o in objs)


def test_qwen_one_call_with_text_around():
    text = "Let me check.\n" + qwen({"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}) + "\nDone."
    assert parse_qwen_tool_calls(text) == ([ToolCall("get_weather", {"city": "Paris", "days": 2})], [])


def test_qwen_several_calls_and_no_call():
    text = qwen({"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "add", "arguments": {"a": 3, "b": 4}})
    calls, errors = parse_qwen_tool_calls(text)
    assert [c.arguments for c in calls] == [{"a": 1, "b": 2}, {"a": 3, "b": 4}] and errors == []
    assert parse_qwen_tool_calls("just an answer: 42") == ([], [])
    assert parse_qwen_tool_calls("") == ([], [])


def test_qwen_arguments_may_be_absent_or_a_json_string():
    calls, errors = parse_qwen_tool_calls(qwen({"name": "now"}, {"name": "add", "arguments": '{"a": 1, "b": 2}'}))
    assert calls == [ToolCall("now", {}), ToolCall("add", {"a": 1, "b": 2})] and errors == []


@pytest.mark.parametrize("body, expected", [
    ('{"name": "add", "arguments": {"a": 1,', "malformed JSON"),
    ('{"arguments": {"a": 1}}', "non-empty string 'name'"),
    ('{"name": 5, "arguments": {}}', "non-empty string 'name'"),
    ('{"name": "  ", "arguments": {}}', "non-empty string 'name'"),
    ('{"name": "add", "arguments": [1, 2]}', "must be a JSON object"),
    ('{"name": "add", "arguments": "not json"}', "must be a JSON object"),
    ('[{"name": "add"}]', "must be a JSON object, got list"),
    ('null', "got NoneType"),
    ("", "malformed JSON"),
])
def test_qwen_malformed_bodies_are_errors(body, expected):
    calls, errors = parse_qwen_tool_calls(qwen(body))
    assert calls == [] and len(errors) == 1 and expected in errors[0]


def test_qwen_a_bad_call_does_not_hide_a_good_one():
    calls, errors = parse_qwen_tool_calls(qwen("{oops", {"name": "add", "arguments": {"a": 1, "b": 2}}))
    assert calls == [ToolCall("add", {"a": 1, "b": 2})] and len(errors) == 1


def test_qwen_unclosed_and_nested_tags():
    good = qwen({"name": "add", "arguments": {"a": 1, "b": 2}})
    calls, errors = parse_qwen_tool_calls(good + '<tool_call>\n{"name": "add"')
    assert len(calls) == 1 and errors == [f"unclosed <tool_call> at character {len(good)}"]
    calls, errors = parse_qwen_tool_calls('<tool_call><tool_call>{"name": "add"}</tool_call></tool_call>')
    assert calls == [] and "nested" in errors[0]
    assert parse_qwen_tool_calls("</tool_call> stray") == ([], [])


def test_qwen_adversarial_inputs_are_errors_and_fast():
    start = time.perf_counter()
    huge = "x" * (1 << 20)
    assert parse_qwen_tool_calls(huge)[1][0].startswith(f"text of {1 << 20} characters")
    many_open = "<tool_call>" * (MAX_TOOL_TEXT_CHARS // 12)
    calls, errors = parse_qwen_tool_calls(many_open)
    assert calls == [] and len(errors) == 1
    deep = qwen("[" * 100_000)
    calls, errors = parse_qwen_tool_calls(deep)
    assert calls == [] and "malformed JSON" in errors[0]
    flood = qwen(*[{"name": "f", "arguments": {}}] * (MAX_TOOL_CALLS + 5))
    calls, errors = parse_qwen_tool_calls(flood)
    assert len(calls) == MAX_TOOL_CALLS and len(errors) == 1 and "more than" in errors[0]
    assert parse_qwen_tool_calls(b"<tool_call>")[1]  # not a string: an error, not a crash
    assert time.perf_counter() - start < 1.0


# --- parsing: llama3 -----------------------------------------------------------------------------------
def test_llama3_plain_and_tagged_calls():
    body = '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}'
    expected = ([ToolCall("get_weather", {"city": "Paris", "days": 2})], [])
    assert parse_llama3_tool_calls(body) == expected
    assert parse_llama3_tool_calls(f"<|python_tag|>{body}<|eom_id|>") == expected
    assert parse_llama3_tool_calls(f"  {body}\n<|eot_id|>") == expected
    alt = parse_llama3_tool_calls('{"name": "add", "arguments": {"a": 1, "b": 2}}')
    assert alt == ([ToolCall("add", {"a": 1, "b": 2})], [])


def test_llama3_several_calls_and_plain_text():
    text = '{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "add", "parameters": {"a": 3, "b": 4}}'
    calls, errors = parse_llama3_tool_calls(text)
    assert [c.arguments["a"] for c in calls] == [1, 3] and errors == []
    assert parse_llama3_tool_calls("The answer is 42.") == ([], [])
    assert parse_llama3_tool_calls("") == ([], [])


@pytest.mark.parametrize("text, expected", [
    ('{"name": "add", "parameters": {"a": 1', "malformed JSON"),
    ('{"parameters": {}}', "non-empty string 'name'"),
    ('{"name": ["add"], "parameters": {}}', "non-empty string 'name'"),
    ('{"name": "add", "parameters": 3}', "must be a JSON object"),
    ("<|python_tag|>brave_search.call(query='x')", "not followed by a JSON tool call"),
])
def test_llama3_malformed_messages_are_errors(text, expected):
    calls, errors = parse_llama3_tool_calls(text)
    assert calls == [] and len(errors) == 1 and expected in errors[0]


def test_llama3_text_after_a_call_is_an_error_and_the_call_kept():
    calls, errors = parse_llama3_tool_calls('{"name": "add", "parameters": {}} and then some prose')
    assert calls == [ToolCall("add", {})] and len(errors) == 1 and "text after the tool call" in errors[0]


def test_llama3_adversarial_inputs_are_errors_and_fast():
    start = time.perf_counter()
    assert "characters is past the limit" in parse_llama3_tool_calls("{" * (1 << 20))[1][0]
    assert "malformed JSON" in parse_llama3_tool_calls('{"name": "f", "parameters": ' + "[" * 100_000)[1][0]
    flood = " ".join(['{"name": "f", "parameters": {}}'] * (MAX_TOOL_CALLS + 5))
    calls, errors = parse_llama3_tool_calls(flood)
    assert len(calls) == MAX_TOOL_CALLS and len(errors) == 1
    assert parse_llama3_tool_calls(None)[1]
    assert time.perf_counter() - start < 1.0


# --- the registry --------------------------------------------------------------------------------------
@pytest.mark.parametrize("format", sorted(TOOL_CALL_FORMATS))
def test_every_format_survives_garbage(format):
    import random
    rng = random.Random(0)
    alphabet = '{}[]":,<>/|_ \n' + "tool_call" + "python_tag" + "name" + "arguments" + "parameters" + "0123456789"
    for _ in range(200):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(200)))
        calls, errors = TOOL_CALL_FORMATS[format](text)
        assert all(isinstance(c, ToolCall) and isinstance(c.arguments, dict) for c in calls)
        assert all(isinstance(e, str) for e in errors)


def test_parse_tool_calls_looks_the_format_up():
    assert parse_tool_calls(qwen({"name": "add", "arguments": {}}))[0] == [ToolCall("add", {})]
    assert parse_tool_calls('{"name": "add", "parameters": {}}', "llama3")[0] == [ToolCall("add", {})]
    with pytest.raises(ValueError, match=r"format: unknown 'mistral'; valid: \['llama3', 'qwen'\]"):
        parse_tool_calls("", "mistral")


# --- calling -------------------------------------------------------------------------------------------
TOOLS = {"add": add, "get_weather": get_weather}


def test_call_tool_runs_the_tool():
    assert call_tool(ToolCall("add", {"a": 2, "b": 3}), TOOLS) == "5"
    assert call_tool(ToolCall("get_weather", {"city": "Oslo", "days": 1}), TOOLS) == "Oslo: sunny for 1 days in celsius"


def test_call_tool_error_paths_are_strings():
    assert call_tool(ToolCall("mul", {}), TOOLS) == "error: unknown tool 'mul'; available: ['add', 'get_weather']"
    missing = call_tool(ToolCall("add", {"a": 1}), TOOLS)
    assert missing.startswith("error: bad arguments for tool 'add'") and "(a: int, b: int)" in missing
    assert call_tool(ToolCall("add", {"a": 1, "b": 2, "c": 3}), TOOLS).startswith("error: bad arguments")
    raised = call_tool(ToolCall("add", {"a": 1, "b": "x"}), TOOLS)
    assert raised.startswith("error: tool 'add' raised TypeError")

    def leave() -> None:
        """Exit."""
        raise SystemExit(3)
    assert call_tool(ToolCall("leave", {}), {"leave": leave}) == "error: tool 'leave' raised SystemExit: 3"


def test_call_tool_stops_waiting_at_the_time_limit():
    release = threading.Event()

    def slow() -> str:
        """Sleep."""
        release.wait(10)
        return "late"
    start = time.perf_counter()
    assert call_tool(ToolCall("slow", {}), {"slow": slow}, timeout_s=0.2) == "error: tool 'slow' timed out after 0.2 s"
    assert time.perf_counter() - start < 0.6
    release.set()


def test_results_become_strings_and_are_truncated():
    assert format_tool_result({"a": [1, 2], "b": "é"}) == '{"a": [1, 2], "b": "é"}'
    assert format_tool_result((1, 2)) == "[1, 2]" and format_tool_result(None) == "" and format_tool_result(1.5) == "1.5"
    loop: list = []
    loop.append(loop)
    assert format_tool_result(loop) == "[[...]]"
    cut = format_tool_result("x" * 50, max_chars=10)
    assert cut == "x" * 10 + "\n... [truncated: 40 more characters]"

    def big() -> str:
        """Big."""
        return "y" * 100
    assert call_tool(ToolCall("big", {}), {"big": big}, max_chars=5).startswith("yyyyy\n... [truncated: 95")
