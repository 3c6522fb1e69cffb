"""Constrained output through `viasd serve` and the official openai client: JSON answers validate
against their schemas, vendor grammars hold, a tool call makes the round trip in OpenAI's shape,
streamed tool calls accumulate (in the client) to the non-streamed answer's."""

import json
import re

import jsonschema
import openai
import pytest

from support.serve_support import byte_session, client, raw, running  # noqa: F401 (fixture)
from viasd_core.speculation.engine import GenerationConfig

SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["city", "n"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "weather", "description": "the weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1,
                                                                                   "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "clock", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"], "additionalProperties": False}}}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


def serve(byte_session):
    return running(byte_session, GenerationConfig(mode="sd", max_new_tokens=60))


def test_json_answers_validate_and_sd_equals_ar(byte_session, viasd_home):
    with serve(byte_session) as (base, _):
        c = client(base)
        for extra in ({"response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}},
                      {"extra_body": {"guided_json": SCHEMA}}, {"extra_body": {"json_schema": SCHEMA}}):
            answers = [c.chat.completions.create(model="target", messages=USER, extra_body={"mode": mode, **extra.get(
                "extra_body", {})}, **{k: v for k, v in extra.items() if k != "extra_body"}) for mode in ("ar", "sd")]
            for a in answers:
                assert a.choices[0].finish_reason == "stop"
                jsonschema.validate(json.loads(a.choices[0].message.content), SCHEMA)
            assert answers[0].choices[0].message.content == answers[1].choices[0].message.content
        obj = c.chat.completions.create(model="target", messages=USER, response_format={"type": "json_object"})
        if obj.choices[0].finish_reason == "stop":  # an object may run past the budget; what came is its start
            assert isinstance(json.loads(obj.choices[0].message.content), dict)
        else:
            assert obj.choices[0].message.content.startswith("{")
        regex = c.completions.create(model="target", prompt="Say yes or no:", extra_body={"guided_regex": "(yes|no)!"})
        assert re.fullmatch(r"(yes|no)!", regex.choices[0].text)
        choice = c.chat.completions.create(model="target", messages=USER, extra_body={"guided_choice": ["sun", "rain"]})
        assert choice.choices[0].message.content in ("sun", "rain")
        gbnf = c.chat.completions.create(model="target", messages=USER, extra_body={"grammar": 'root ::= "a" [0-9] [0-9]'})
        assert re.fullmatch(r"a[0-9][0-9]", gbnf.choices[0].message.content)


def test_a_tool_call_round_trip(byte_session, viasd_home):
    with serve(byte_session) as (base, _):
        c = client(base)
        for choice in ({"type": "function", "function": {"name": "weather"}}, "required"):
            first = c.chat.completions.create(model="target", messages=USER, tools=[WEATHER, CLOCK], tool_choice=choice,
                                              max_tokens=150, parallel_tool_calls=False)
            assert first.choices[0].finish_reason == "tool_calls"
            calls = first.choices[0].message.tool_calls
            assert len(calls) == 1 and calls[0].id.startswith("call_") and calls[0].type == "function"
            assert calls[0].function.name in ("weather", "clock")
            if choice != "required":
                assert calls[0].function.name == "weather"
            jsonschema.validate(json.loads(calls[0].function.arguments),
                                {"weather": WEATHER, "clock": CLOCK}[calls[0].function.name]["function"]["parameters"])
        messages = USER + [first.choices[0].message.model_dump(exclude_none=True),
                           {"role": "tool", "tool_call_id": calls[0].id, "content": "sunny"}]
        after = c.chat.completions.create(model="target", messages=messages, tools=[WEATHER, CLOCK], tool_choice="none",
                                          max_tokens=5)
        assert after.choices[0].message.tool_calls is None and after.choices[0].finish_reason in ("stop", "length")
        assert after.usage.prompt_tokens > first.usage.prompt_tokens  # the call and its result reached the template


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}}, None),
    ({"guided_regex": "a("}, None),
    ({"guided_json": SCHEMA, "guided_regex": "a+"}, "guided_regex"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
])
def test_bad_constraints_are_a_400_naming_the_field(byte_session, viasd_home, extra, param):
    with serve(byte_session) as (base, _):
        status, _, answer = raw(base, "POST", "/v1/chat/completions", {"messages": USER, **extra})
        assert status == 400, answer
        assert answer["error"]["param"] == param and "\n" not in answer["error"]["message"], answer
        assert param is None or param in answer["error"]["message"]
        if param is None:
            assert "grammar is not valid" in answer["error"]["message"]


def test_the_tool_convention_is_the_templates():
    from viasd_core.frontends.serve_tools import Tools, parse_tool_calls

    qwen = Tools((WEATHER,), ("weather",), "qwen", True)
    content, calls = parse_tool_calls('ok <tool_call>\n{"name": "weather", "arguments": {"city": "Rome", "days": 2}}\n'
                                      '</tool_call>\n<tool_call>\n{"name": "weather", "arguments": {"city": "Paris", '
                                      '"days": 1}}\n</tool_call>', qwen)
    assert content == "ok" and [json.loads(c["function"]["arguments"])["city"] for c in calls] == ["Rome", "Paris"]
    mistral = Tools((WEATHER,), ("weather",), "mistral", True)
    assert len(parse_tool_calls('[TOOL_CALLS][{"name": "weather", "arguments": {"city": "Rome"}}]', mistral)[1]) == 1
    llama = Tools((WEATHER,), ("weather",), "llama3", True)
    assert json.loads(parse_tool_calls('{"name": "weather", "parameters": {"days": 3}}', llama)[1][0]["function"]
                      ["arguments"]) == {"days": 3}
    assert parse_tool_calls('{"name": "other", "parameters": {}}', llama) == ('{"name": "other", "parameters": {}}', [])


def _same_answer(streamed, whole) -> None:
    """A stream the openai client accumulated equals the non-streamed answer (the call ids aside)."""
    s, w = streamed.choices[0], whole.choices[0]
    assert s.finish_reason == w.finish_reason
    assert (s.message.content or None) == w.message.content
    got = [(c.type, c.function.name, c.function.arguments) for c in s.message.tool_calls or []]
    assert got == [(c.type, c.function.name, c.function.arguments) for c in w.message.tool_calls or []]
    assert all(c.id.startswith("call_") for c in s.message.tool_calls or [])


def test_streamed_tool_calls_accumulate_to_the_non_streamed_answer(byte_session, viasd_home):
    with serve(byte_session) as (base, _):
        c = client(base)
        cases = [dict(tool_choice={"type": "function", "function": {"name": "weather"}}, parallel_tool_calls=False),
                 dict(tool_choice="required"),  # parallel: one call or more
                 dict(tool_choice="auto"), dict(tool_choice="none")]  # free text (the tiny model writes no call)
        for case in cases:
            args = dict(model="target", messages=USER, tools=[WEATHER, CLOCK], max_tokens=150, **case)
            whole = c.chat.completions.create(**args)
            with c.chat.completions.stream(**args) as stream:
                events = list(stream)
                streamed = stream.get_final_completion()
            _same_answer(streamed, whole)
            if case["tool_choice"] in ("auto", "none"):
                continue
            assert whole.choices[0].finish_reason == "tool_calls"
            # OpenAI's delta shape: index, id, type and name first, then the arguments' text
            deltas = [d for e in events if e.type == "chunk" for d in e.chunk.choices[0].delta.tool_calls or []]
            first = deltas[0]
            assert first.index == 0 and first.id.startswith("call_") and first.type == "function"
            assert first.function.name == whole.choices[0].message.tool_calls[0].function.name
            assert "".join(d.function.arguments or "" for d in deltas if d.index == 0) == \
                whole.choices[0].message.tool_calls[0].function.arguments
            assert not [e for e in events if e.type == "content.delta" and "<tool_call>" in e.delta]


QWEN_CALL = '<tool_call>\n{"name": "weather", "arguments": {"city": "Rome", "days": 2}}\n</tool_call>'


@pytest.mark.parametrize("style, text", [
    ("qwen", "ok " + QWEN_CALL + "\n" + QWEN_CALL.replace("Rome", "Paris")),  # content, two calls
    ("qwen", "  \n" + QWEN_CALL + " trailing"),  # blank content: null
    ("qwen", "a <tool_cal but no call, then <tool_call> unclosed"),  # no call: all of it is content
    ("qwen", "x <tool_call>\n{\"name\": \"nope\", \"arguments\": {}}\n</tool_call>"),  # unknown tool: content
    ("qwen", "plain text < with <b>tags</b>  "),
    ("json", ' {"name": "weather", "arguments": {"city": "Paris"}}'),
    ("json", '{"name": "weather", "arguments": '),  # broken JSON: content
    ("json", "  words, then {\"name\": \"weather\"}"),
    ("mistral", '[TOOL_CALLS][{"name": "weather", "arguments": {"days": 1}}, {"name": "weather", "arguments": {}}]'),
])
def test_held_calls_stream_the_parse_of_the_whole_answer(style, text):
    """Any split of an answer into pieces: the content sent piece by piece and at the end is the
    non-streamed content, a prefix of it goes out before the end, and the calls are the same."""
    from viasd_core.frontends.serve_tools import HeldCalls, Tools, parse_tool_calls

    tools = Tools((WEATHER,), ("weather",), style, True)
    content, calls = parse_tool_calls(text, tools)
    strip = [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
    for cuts in [list(range(1, len(text))), [len(text) // 3, len(text) // 2], []]:
        pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
        held, sent = HeldCalls(tools), ""
        for piece in pieces:
            sent += held.feed(piece)
            assert (content or "").startswith(sent) if calls else text.startswith(sent)
            assert "<tool_call>" not in sent or not calls
        rest, got = held.finish(text, parse=True)
        assert sent + rest == (content or "")
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in got] == strip
    if style == "qwen" and "<tool_call>" not in text and "<" not in text[-12:]:
        held = HeldCalls(tools)
        assert held.feed(text) == text.rstrip()  # no call possible: the text goes out as it comes
    cut = HeldCalls(tools)  # an answer cut at max_tokens: all of it is content, as non-streamed
    sent = cut.feed(text)
    rest, got = cut.finish(text, parse=False)
    assert sent + rest == text and got == []
