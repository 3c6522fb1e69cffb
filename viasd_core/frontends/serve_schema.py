"""What an OpenAI request may say, checked field by field before it waits for the engine.

`parse_json` reads a body; `parse_chat` / `parse_completion` turn a body into a GenRequest: the
prompt (chat messages for the chat template, or raw text / token ids) and the request's own
GenerationConfig (the server's, with the request's sampling values, mode and draft over it).
Every refusal is an ApiError 400 naming the field (`param`), or 404 for an unknown model.

Which fields are read, refused unless neutral, refused, or ignored (and why): serve_fields. The
extension fields are `mode`, `draft`, `top_k`, `min_p`, `repetition_penalty` and `chat_template_kwargs`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass

from viasd_core.speculation.engine import MODES, GenerationConfig
from viasd_core.speculation.router import Thresholds
from viasd_core.errors import UsageError
from viasd_core.frontends.serve_errors import ApiError, bad_request
from viasd_core.frontends.serve_fields import check_fields, check_message
from viasd_core.frontends.serve_tools import Tools, request_output

MAX_STOPS = 4  # as OpenAI
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


@dataclass(frozen=True)
class ServedModel:
    """What the server offers: its name(s), defaults, and which modes and drafts a request may pick."""

    name: str  # the id /v1/models lists (--served-model-name, else the model id)
    aliases: frozenset[str]  # other names a request may use for it (the model id and reference)
    config: GenerationConfig  # the server's generation options: every request's defaults
    draft: str  # the loaded draft's id ('none' without one)
    calibrated: bool  # a slim verifier is loaded: exact and viasd can run (with the loaded draft)
    thresholds: Thresholds | None  # the profile's, for viasd
    vocab_size: int  # token ids a prompt may hold: [0, vocab_size)
    tool_style: str = "json"  # the chat template's tool-call convention (serve_tools.tool_style)

    @property
    def drafts(self) -> tuple[str, ...]:
        """Per-request `draft` values: the loaded draft, 'ngram' (prompt lookup, free) and 'none'."""
        return tuple(dict.fromkeys((self.draft, "ngram", "none")))

    @property
    def modes(self) -> tuple[str, ...]:
        return tuple(m for m in MODES if self.calibrated or m not in ("exact", "viasd"))


@dataclass
class GenRequest:
    kind: str  # 'chat' or 'completion'
    messages: list[dict] | None  # chat: [{role, content}] with text content, for the chat template
    prompt: str | list[int] | None  # completion: raw text (no template) or token ids
    config: GenerationConfig
    draft: str  # one of ServedModel.drafts
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage
    model: str
    template_kwargs: dict | None = None  # chat: chat_template_kwargs, extra variables for the template
    tools: Tools | None = None  # chat: the request's tools (the template gets them; calls parsed unless 'none')


def parse_json(raw: bytes) -> dict:
    def no_constant(name):
        raise ValueError(f"{name} is not JSON")

    try:
        body = json.loads(raw, parse_constant=no_constant)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad_request(f"the request body is not valid JSON ({e})")
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, not {_kind(body)}")
    return body


# ---------------------------------------------------------------------- fields
def _kind(value) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
            dict: "an object", type(None): "null"}.get(type(value), type(value).__name__)


def _int(body: dict, name: str, default, lo: int | None = None, hi: int | None = None):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"'{name}' must be an integer, not {_kind(value)}", name)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = f"at least {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise bad_request(f"'{name}' must be {bounds} (got {value})", name)
    return value


def _number(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad_request(f"'{name}' must be a number, not {_kind(value)}", name)
    if not math.isfinite(value) or value > hi or value < lo or (lo_open and value == lo):
        if hi == math.inf:
            raise bad_request(f"'{name}' must be a finite number {'>' if lo_open else '>='} {lo:g} (got {value})", name)
        raise bad_request(f"'{name}' must be in {'(' if lo_open else '['}{lo:g}, {hi:g}] (got {value})", name)
    return float(value)


def _choice(body: dict, name: str, default: str, allowed: tuple[str, ...], why: str) -> str:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, str):
        raise bad_request(f"'{name}' must be a string, not {_kind(value)}", name)
    if value not in allowed:
        raise bad_request(f"'{name}' '{value}' is not served: use one of {', '.join(allowed)} ({why})", name)
    return value


def _bool(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"'{name}' must be true or false, not {_kind(value)}", name)
    return value


def _stops(body: dict, default: tuple[str, ...]) -> tuple[str, ...]:
    """The request's own `stop` (an empty array: none), else the server's --stop."""
    value = body.get("stop")
    if value is None:
        return default
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad_request("'stop' must be a string or an array of strings", "stop")
    if len(stops) > MAX_STOPS or not all(stops):
        raise bad_request(f"'stop' holds at most {MAX_STOPS} non-empty strings", "stop")
    return tuple(stops)


def _common(body: dict, served: ServedModel, kind: str, messages, prompt) -> GenRequest:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request(f"'model' must be a string, not {_kind(model)}", "model")
    if model and model != served.name and model not in served.aliases:
        raise ApiError(404, f"model '{model}' is not served here: use '{served.name}' (GET /v1/models)",
                       param="model", code="model_not_found")
    check_fields(body, kind)
    base = served.config
    mode = _choice(body, "mode", base.mode, MODES, "ar, sd, exact or viasd")
    draft = _choice(body, "draft", served.draft, served.drafts, "the loaded draft, 'ngram' or 'none'")
    if mode != "ar" and draft == "none":
        raise bad_request(f"mode '{mode}' needs a draft: ask for draft 'ngram' or mode 'ar'", "draft")
    if mode in ("exact", "viasd"):
        if not served.calibrated:
            raise bad_request(f"mode '{mode}' needs a calibration profile for this pair, and the server has none: "
                              "run `viasd calibrate`, then restart the server", "mode")
        if draft != served.draft:
            raise bad_request(f"mode '{mode}' runs with the draft its profile was calibrated for ('{served.draft}')", "draft")
    limit = "max_completion_tokens" if kind == "chat" and body.get("max_completion_tokens") is not None else "max_tokens"
    stream_options = body.get("stream_options")
    if stream_options is not None and not isinstance(stream_options, dict):
        raise bad_request("'stream_options' must be an object", "stream_options")
    config = dataclasses.replace(
        base, mode=mode, max_new_tokens=_int(body, limit, base.max_new_tokens, lo=1),
        temperature=_number(body, "temperature", base.temperature, 0.0, 2.0),
        top_p=_number(body, "top_p", base.top_p, 0.0, 1.0, lo_open=True),
        top_k=_int(body, "top_k", base.top_k, lo=0), min_p=_number(body, "min_p", base.min_p, 0.0, 1.0),
        repetition_penalty=_number(body, "repetition_penalty", base.repetition_penalty, 0.0, math.inf, lo_open=True),
        seed=_int(body, "seed", None, lo=-(2**63), hi=2**64 - 1),
        stop=_stops(body, base.stop), thresholds=served.thresholds,
    )
    config.grammar, tools = request_output(body, kind, served.tool_style)
    try:
        config.validate()  # the engine's own rules (viasd is greedy-only, ...)
    except UsageError as e:
        raise bad_request(e.message)
    return GenRequest(kind, messages, prompt, config, draft, _bool(body, "stream", False),
                      _bool(stream_options or {}, "include_usage", False), model or served.name, tools=tools)


def request_seed(own: int | None, server: int | None, number: int) -> int | None:
    """A request's sampling seed: its own `seed` (the same request with the same seed gives the same
    answer); else, with a server --seed, that seed plus the request's number (0, 1, ... in the order
    the server accepted them), so sampled answers differ from request to request while a restarted
    server repeats its sequence; else None (fresh randomness)."""
    if own is not None:
        return own
    return None if server is None else (server + number) % 2**64


# ---------------------------------------------------------------------- endpoints
def _text_content(content, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise bad_request(f"messages[{i}].content: only text parts are supported", "messages")
            parts.append(part["text"])
        return "\n".join(parts)
    raise bad_request(f"messages[{i}].content must be a string or an array of text parts, not {_kind(content)}", "messages")


def parse_chat(body: dict, served: ServedModel) -> GenRequest:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty array of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad_request(f"messages[{i}] must be an object, not {_kind(m)}", "messages")
        check_message(m, i)
        role = m.get("role")
        if role not in ROLES:
            raise bad_request(f"messages[{i}].role must be one of {', '.join(ROLES)} (got {role!r})", "messages")
        calls = m.get("tool_calls")
        content = "" if calls and m.get("content") is None else _text_content(m.get("content"), i)
        out.append({"role": ROLES[role], "content": content, **_tool_fields(m, i)})
    if not any(m["content"].strip() or m.get("tool_calls") for m in out):
        raise bad_request("every message is empty: give some text", "messages")
    request = _common(body, served, "chat", out, None)
    request.template_kwargs = _template_kwargs(body)
    if request.tools is not None:
        request.template_kwargs = {**(request.template_kwargs or {}), "tools": list(request.tools.specs)}
    return request


def _tool_fields(m: dict, i: int) -> dict:
    """An assistant message's tool calls (arguments as objects, as chat templates expect) and a tool
    message's call id, for the template."""
    out = {}
    if m.get("tool_call_id") is not None:
        out["tool_call_id"] = m["tool_call_id"]
    calls = m.get("tool_calls")
    if calls:
        if m.get("role") != "assistant" or not isinstance(calls, list):
            raise bad_request(f"messages[{i}].tool_calls: an assistant message's array of calls", "messages")
        out["tool_calls"] = []
        for call in calls:
            fn = call.get("function") if isinstance(call, dict) else None
            try:
                args = fn["arguments"]
                args = json.loads(args) if isinstance(args, str) else args
                out["tool_calls"].append({"id": call.get("id"), "type": "function",
                                          "function": {"name": fn["name"], "arguments": args}})
            except (TypeError, KeyError, ValueError):
                raise bad_request(f"messages[{i}].tool_calls: each is {{\"id\", \"type\": \"function\", "
                                  "\"function\": {\"name\", \"arguments\": JSON text}}}", "messages")
    return out


# apply_chat_template's own parameters: chat_template_kwargs may not set them (only template variables)
TEMPLATE_PARAMETERS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message",
    "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs"})


def _template_kwargs(body: dict) -> dict | None:
    """chat_template_kwargs: variables for the chat template, such as Qwen3's `enable_thinking: false`."""
    value = body.get("chat_template_kwargs")
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad_request(f"'chat_template_kwargs' must be an object, not {_kind(value)}", "chat_template_kwargs")
    taken = sorted(TEMPLATE_PARAMETERS & value.keys())
    if taken:
        raise bad_request(f"'chat_template_kwargs' may set template variables only, not {', '.join(taken)}",
                          "chat_template_kwargs")
    return dict(value)


def parse_completion(body: dict, served: ServedModel) -> GenRequest:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt.strip():
            raise bad_request("'prompt' is empty: give some text", "prompt")
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not all(0 <= t < served.vocab_size for t in prompt):
            raise bad_request(f"'prompt' token ids must be in [0, {served.vocab_size})", "prompt")
    else:
        raise bad_request("'prompt' must be a string or an array of token ids (one prompt per request)", "prompt")
    return _common(body, served, "completion", None, prompt)
