"""Constrained output for the server: the request's grammar (response_format, vLLM's guided_*, llama.cpp's
json_schema / grammar, a required tool call) and tool calls, written and parsed in the model's own
template conventions:

  qwen     <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>   (Qwen 2.5/3, Hermes; parallel)
  mistral  [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]          (the control token is special)
  llama3   {"name": ..., "parameters": {...}}                             (Llama 3.1-3.3 JSON calls; one)
  json     {"name": ..., "arguments": {...}}                              (a template with no convention; one)
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from viasd_core.speculation.grammar import JSON_LAYOUT, Grammar
from viasd_core.frontends.serve_errors import bad_request

STYLES = ("qwen", "mistral", "llama3", "json")
# Each source of a grammar, and how its value becomes one; at most one per request.
GRAMMAR_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "json_schema",
                  "grammar")


def tool_style(tokenizer) -> str:
    """The tool-call convention the model's chat template writes (json when it names none)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    template = template if isinstance(template, str) else " ".join(map(str, dict(template).values()))
    if "<tool_call>" in template:
        return "qwen"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3"
    return "json"


@dataclass(frozen=True)
class Tools:
    """A request's tools: the chat template gets `specs`; calls are parsed unless tool_choice is none."""

    specs: tuple  # the request's tool objects (JSON-able dicts), for apply_chat_template
    names: tuple[str, ...]
    style: str
    parse: bool  # tool_choice is not "none"


def _schema(value, name: str) -> dict | bool:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise bad_request(f"'{name}' must be a JSON schema (an object, or its JSON text)", name)
    if not isinstance(value, (dict, bool)):
        raise bad_request(f"'{name}' must be a JSON schema object", name)
    return value


def _text(value, name: str) -> str:
    if not isinstance(value, str) or not value:
        raise bad_request(f"'{name}' must be a non-empty string", name)
    return value


def _grammar_of(name: str, value) -> Grammar | None:
    if name == "response_format":
        if not isinstance(value, dict) or value.get("type") not in ("text", "json_object", "json_schema"):
            raise bad_request("'response_format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                              "{\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}}", name)
        if value["type"] == "text":
            return None
        if value["type"] == "json_object":
            return Grammar.json_schema({"type": "object"})
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise bad_request("'response_format' json_schema needs {\"name\": ..., \"schema\": {...}}", name)
        return Grammar.json_schema(_schema(spec["schema"], name))
    if name in ("guided_json", "json_schema"):
        return Grammar.json_schema(_schema(value, name))
    if name == "guided_regex":
        return Grammar("regex", _text(value, name))
    if name == "guided_choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise bad_request("'guided_choice' must be a non-empty array of non-empty strings", name)
        return Grammar("choice", json.dumps(value))
    return Grammar("gbnf", _text(value, name))  # guided_grammar, grammar: GBNF or Lark (llguidance reads both)


def _tools(body: dict, style: str) -> tuple[Tools | None, str | None]:
    """The request's tools and the one function a call must name (None: any; '' : no call required)."""
    specs = body.get("tools") or []
    if not isinstance(specs, list) or not all(
            isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str) and t["function"]["name"] for t in specs):
        raise bad_request("'tools' must be an array of {\"type\": \"function\", \"function\": {\"name\": ..., "
                          "\"parameters\": {...}}}", "tools")
    names = tuple(t["function"]["name"] for t in specs)
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        named = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if named not in names:
            raise bad_request(f"'tool_choice' must name one of the request's tools ({', '.join(names) or 'none given'})",
                              "tool_choice")
        required = named
    elif choice in (None, "auto", "none", "required"):
        if choice == "required" and not names:
            raise bad_request("'tool_choice' is 'required' but the request has no tools", "tool_choice")
        required = None if choice == "required" else ""
    else:
        raise bad_request("'tool_choice' must be 'none', 'auto', 'required' or {\"type\": \"function\", "
                          "\"function\": {\"name\": ...}}", "tool_choice")
    if not names:
        return None, ""
    return Tools(tuple(specs), names, style, parse=choice != "none"), required


def _call_grammar(tools: Tools, required: str | None, parallel: bool) -> Grammar:
    """A grammar for tool calls only: to `required` (None: any of the tools), several if `parallel`."""
    key = "parameters" if tools.style == "llama3" else "arguments"
    calls = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                               key: t["function"].get("parameters") or {"type": "object"}},
              "required": ["name", key], "additionalProperties": False}
             for t in tools.specs if required is None or t["function"]["name"] == required]
    one = {"anyOf": calls} if len(calls) > 1 else calls[0]
    if tools.style == "mistral":
        array = {"type": "array", "items": one, "minItems": 1, **({} if parallel else {"maxItems": 1})}
        return Grammar.json_schema(array)
    obj = json.dumps({**one, "x-guidance": JSON_LAYOUT})
    if tools.style != "qwen":
        return Grammar("lark", f"start: call\ncall: %json {obj}\n")
    more = ' ("\\n" call)*' if parallel else ""
    return Grammar("lark", f'start: call{more}\ncall: "<tool_call>\\n" obj "\\n</tool_call>"\nobj: %json {obj}\n')


def request_output(body: dict, kind: str, style: str) -> tuple[Grammar | None, Tools | None]:
    """The grammar a request's answer must match and its tools (chat only), or a 400 naming the field."""
    given = [name for name in GRAMMAR_FIELDS if body.get(name) is not None]
    grammars = [(name, _grammar_of(name, body[name])) for name in given]
    grammars = [(name, g) for name, g in grammars if g is not None]
    if len(grammars) > 1:
        raise bad_request(f"'{grammars[1][0]}' and '{grammars[0][0]}' both constrain the answer: send one", grammars[1][0])
    grammar = grammars[0][1] if grammars else None
    if kind != "chat":
        return grammar, None
    tools, required = _tools(body, style)
    if tools is not None and tools.parse and required != "":
        if grammar is not None:
            raise bad_request(f"'{grammars[0][0]}' and a required tool call both constrain the answer: send one",
                              "tool_choice")
        parallel = body.get("parallel_tool_calls")
        if parallel is not None and not isinstance(parallel, bool):
            raise bad_request("'parallel_tool_calls' must be true or false", "parallel_tool_calls")
        grammar = _call_grammar(tools, required, parallel is not False)
    return grammar, tools


# ---------------------------------------------------------------------- parsing
QWEN_START = "<tool_call>"


def _call(obj, tools: Tools) -> dict | None:
    if not isinstance(obj, dict) or obj.get("name") not in tools.names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args)}}


def parse_tool_calls(text: str, tools: Tools) -> tuple[str | None, list[dict]]:
    """(content, tool calls) from an answer in the model's convention; no calls when any is malformed."""
    objects, content = [], text
    if tools.style == "qwen":
        found = list(re.finditer(QWEN_START + r"\s*(.*?)\s*</tool_call>", text, re.DOTALL))
        if not found:
            return text, []
        content = text[: found[0].start()]
        raw = [m.group(1) for m in found]
    else:
        stripped = text.strip()
        stripped = stripped[len("[TOOL_CALLS]"):].strip() if stripped.startswith("[TOOL_CALLS]") else stripped
        if not stripped.startswith(("{", "[")):
            return text, []
        raw, content = [stripped], ""
    for piece in raw:
        try:
            value = json.loads(piece)
        except ValueError:
            return text, []
        objects.extend(value if isinstance(value, list) else [value])
    calls = [_call(obj, tools) for obj in objects]
    if not calls or None in calls:
        return text, []
    return content.rstrip() or None, calls


class HeldCalls:
    """A streamed chat answer's content when tool calls are parsed from it, as vLLM's streaming
    tool parsers do: text goes out as content until a call could start, and from there it is held
    back. At the end `parse_tool_calls` reads the whole answer (the non-streamed rule, once): its
    calls go out as `tool_calls` deltas, or, when it finds none, the held text as content. Where a
    call can start: qwen, at `<tool_call>` (a possible start of it at the end, and whitespace before
    it, wait for the next piece); the other styles, at an answer whose first non-blank character is
    `{` or `[` (leading blanks wait). What went out is always a prefix of the content the
    non-streamed answer has."""

    def __init__(self, tools: Tools):
        self.tools = tools
        self.text = ""  # the answer's text so far
        self.sent = 0  # characters of it sent as content

    def feed(self, piece: str) -> str:
        """The content that may go out now ('' if none)."""
        self.text += piece
        if self.tools.style == "qwen":
            start = self.text.find(QWEN_START)
            if start < 0:
                start = len(self.text) - next((n for n in range(len(QWEN_START) - 1, 0, -1)
                                               if self.text.endswith(QWEN_START[:n])), 0)
            end = len(self.text[:start].rstrip())
        else:
            head = self.text.lstrip()
            end = 0 if not head or head[0] in "{[" else len(self.text)
        if end <= self.sent:
            return ""
        out, self.sent = self.text[self.sent:end], end
        return out

    def finish(self, text: str, parse: bool) -> tuple[str, list[dict]]:
        """(the rest of the content, the calls) for the whole answer `text`; `parse`: it ended by
        itself (an answer cut at max_tokens is content, as non-streamed)."""
        content, calls = parse_tool_calls(text, self.tools) if parse else (text, [])
        content = content or ""
        rest, self.sent = content[self.sent:], len(content)
        return rest, calls
