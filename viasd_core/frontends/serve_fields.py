"""Every request field's fate, in one table per fate (docs/serve.md lists the same; a test holds
them equal):

  READ         honoured: serve_schema reads them (per endpoint)
  NEUTRAL      refused (400, naming the field) unless at the value that asks for nothing the
               engine does not do (n: 1, presence_penalty: 0, ...): what clients send by default
  CONSTRAINED  constrained output (tools, JSON, grammars): refused (400) until the server can
               constrain decoding, unless trivially satisfied (response_format text, no tools)
  IGNORED      accepted and ignored, each with the reason it cannot change an answer here

Any other field is refused (400) as OpenAI does ("unrecognized request argument"): nothing a client
asks for is silently dropped. A message's own fields are checked the same way (MESSAGE_*).
"""

from __future__ import annotations

from viasd_core.frontends.serve_errors import bad_request

BOTH = frozenset({"model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stream",
                  "stream_options", "mode", "draft"})
READ = {"chat": BOTH | {"messages", "max_completion_tokens", "chat_template_kwargs"}, "completion": BOTH | {"prompt"}}


def _absent_or(*neutral):
    return lambda v: v is None or any(v == n and type(v) is type(n) for n in neutral)


def _empty(v) -> bool:
    return v is None or v == [] or v == {}


NEUTRAL = {  # name -> (is it neutral?, the neutral value as the message says it)
    "n": (_absent_or(1), "1"),
    "best_of": (_absent_or(1), "1"),
    "logprobs": (_absent_or(False, 0), "false"),
    "top_logprobs": (_absent_or(0), "0"),
    "prompt_logprobs": (_absent_or(0), "0"),
    "echo": (_absent_or(False), "false"),
    "suffix": (_absent_or(""), "''"),
    "presence_penalty": (_absent_or(0, 0.0), "0"),
    "frequency_penalty": (_absent_or(0, 0.0), "0"),
    "repetition_penalty": (_absent_or(1, 1.0), "1"),
    "length_penalty": (_absent_or(1, 1.0), "1"),
    "use_beam_search": (_absent_or(False), "false"),
    "logit_bias": (_empty, "{}"),
    "min_tokens": (_absent_or(0), "0"),
    "ignore_eos": (_absent_or(False), "false"),
    "stop_token_ids": (_empty, "[]"),
    "bad_words": (_empty, "[]"),
    "allowed_token_ids": (_absent_or(), "null"),
    "include_stop_str_in_output": (_absent_or(False), "false"),
    "skip_special_tokens": (_absent_or(True), "true"),
    "spaces_between_special_tokens": (_absent_or(True), "true"),
    "add_generation_prompt": (_absent_or(True), "true"),
    "continue_final_message": (_absent_or(False), "false"),
    "truncate_prompt_tokens": (_absent_or(), "null"),
    "priority": (_absent_or(0), "0"),
    "modalities": (lambda v: v is None or v == ["text"], "['text']"),
    "audio": (_absent_or(), "null"),
    "prediction": (_absent_or(), "null"),
    "store": (_absent_or(False), "false"),
    "reasoning_effort": (_absent_or(), "null (switch Qwen3's thinking with chat_template_kwargs)"),
    "web_search_options": (_absent_or(), "null"),
}

CONSTRAINED = {  # name -> is it trivially satisfied?
    "tools": _empty,
    "functions": _empty,
    "tool_choice": _absent_or("none", "auto"),  # no tools: nothing to call
    "function_call": _absent_or("none", "auto"),
    "response_format": lambda v: v is None or v == {"type": "text"},
    "guided_json": _absent_or(),
    "guided_regex": _absent_or(),
    "guided_choice": _absent_or(),
    "guided_grammar": _absent_or(),
    "guided_decoding_backend": _absent_or(),
    "guided_whitespace_pattern": _absent_or(),
    "structured_outputs": _absent_or(),
    "grammar": lambda v: v in (None, ""),
    "json_schema": _empty,
}

IGNORED = {  # name -> why it cannot change an answer here
    "user": "an end-user id for OpenAI's abuse monitoring: no effect on the answer",
    "safety_identifier": "an end-user id for OpenAI's abuse monitoring: no effect on the answer",
    "metadata": "tags for completions OpenAI stores: nothing is stored here",
    "service_tier": "OpenAI's processing tiers: there is one here",
    "prompt_cache_key": "a routing hint for OpenAI's prompt cache: this server keeps what it may re-use exactly",
    "cache_prompt": "llama.cpp's prompt cache switch: the server re-uses cached positions only where the answer "
                    "stays what a fresh server gives, so the flag cannot change an answer",
    "parallel_tool_calls": "with no tools (tools are refused) there is nothing to call",
    "request_id": "vLLM's caller-chosen id: the server makes its own response ids",
}

MESSAGE_READ = frozenset({"role", "content"})
MESSAGE_NEUTRAL = {"tool_calls": _empty, "refusal": _absent_or(), "audio": _absent_or(), "tool_call_id": _absent_or()}
MESSAGE_IGNORED = {"name": "a participant's name: the chat template gets each message's role and content only"}


def check_fields(body: dict, kind: str) -> None:
    """A 400 naming the first field (in the body's order) the server would not honour."""
    read = READ[kind]
    for name, value in body.items():
        if name in read or name in IGNORED:
            continue
        if name in NEUTRAL:
            neutral, shown = NEUTRAL[name]
            if not neutral(value):
                raise bad_request(f"'{name}' is not supported by this server: leave it out or at {shown}", name)
        elif name in CONSTRAINED:
            if not CONSTRAINED[name](value):
                raise bad_request(f"'{name}' asks for constrained output (tools, JSON, a grammar), which this server "
                                  "does not support yet: leave it out", name, code="constrained_output_unsupported")
        elif any(name in other for other in READ.values()):
            where = "/v1/chat/completions" if kind == "completion" else "/v1/completions"
            raise bad_request(f"'{name}' belongs to {where}, not to this endpoint", name)
        else:
            raise bad_request(f"unrecognized request field '{name}' (docs/serve.md lists every field this server "
                              "reads, refuses or ignores)", name)


def check_message(message: dict, i: int) -> None:
    """The same for one chat message's fields; the param is 'messages'."""
    for name, value in message.items():
        if name in MESSAGE_READ or name in MESSAGE_IGNORED:
            continue
        if name in MESSAGE_NEUTRAL:
            if not MESSAGE_NEUTRAL[name](value):
                raise bad_request(f"messages[{i}].{name}: tool calls are not supported yet (constrained output)",
                                  "messages", code="constrained_output_unsupported")
        else:
            raise bad_request(f"messages[{i}]: unrecognized field '{name}' (a message has role and content)", "messages")
