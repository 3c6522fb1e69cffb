"""Every request field's fate, in one table per fate (docs/serve.md lists the same; a test holds
them equal):

  READ         honoured: serve_schema reads them (per endpoint)
  NEUTRAL      refused (400, naming the field) unless at the value that asks for nothing the
               engine does not do (n: 1, presence_penalty: 0, ...): what clients send by default
  CONSTRAINED  constrained-output options the server does not take (serve_tools reads tools, JSON and
               grammars): refused (400) unless trivially satisfied
  IGNORED      accepted and ignored, each with the reason it cannot change an answer here

Any other field is refused (400) as OpenAI does ("unrecognized request argument"): nothing a client
asks for is silently dropped. A message's own fields are checked the same way (MESSAGE_*).
"""

from __future__ import annotations

from viasd_core.frontends.serve_errors import bad_request

BOTH = frozenset({"model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "stop",
                  "stream", "stream_options", "mode", "draft"})
GRAMMARS = frozenset({"response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "json_schema",
                      "grammar"})  # serve_tools.GRAMMAR_FIELDS: constrained decoding (llguidance)
READ = {"chat": BOTH | GRAMMARS | {"messages", "max_completion_tokens", "chat_template_kwargs", "tools", "tool_choice",
                                   "parallel_tool_calls"},
        "completion": BOTH | GRAMMARS | {"prompt"}}


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

CONSTRAINED = {  # name -> (is it trivially satisfied?, what to send instead)
    "functions": (_empty, "use 'tools' (functions is OpenAI's deprecated form)"),
    "function_call": (_absent_or("none", "auto"), "use 'tool_choice' (function_call is OpenAI's deprecated form)"),
    "guided_decoding_backend": (lambda v: v in (None, "auto", "llguidance", "guidance"),
                                "this server constrains through llguidance: leave it out"),
    "guided_whitespace_pattern": (_absent_or(), "JSON is written in json.dumps' layout here: leave it out"),
    "structured_outputs": (_absent_or(), "send guided_json, guided_regex, guided_choice or guided_grammar"),
}

IGNORED = {  # name -> why it cannot change an answer here
    "user": "an end-user id for OpenAI's abuse monitoring: no effect on the answer",
    "safety_identifier": "an end-user id for OpenAI's abuse monitoring: no effect on the answer",
    "metadata": "tags for completions OpenAI stores: nothing is stored here",
    "service_tier": "OpenAI's processing tiers: there is one here",
    "prompt_cache_key": "a routing hint for OpenAI's prompt cache: this server keeps what it may re-use exactly",
    "cache_prompt": "llama.cpp's prompt cache switch: the server re-uses cached positions only where the answer "
                    "stays what a fresh server gives, so the flag cannot change an answer",
    "request_id": "vLLM's caller-chosen id: the server makes its own response ids",
}

MESSAGE_READ = frozenset({"role", "content", "tool_calls", "tool_call_id"})
MESSAGE_NEUTRAL = {"refusal": _absent_or(), "audio": _absent_or()}
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
            trivial, instead = CONSTRAINED[name]
            if not trivial(value):
                raise bad_request(f"'{name}' is not supported by this server: {instead}", name,
                                  code="constrained_output_unsupported")
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
                raise bad_request(f"messages[{i}].{name} is not supported by this server: leave it out or null",
                                  "messages")
        else:
            raise bad_request(f"messages[{i}]: unrecognized field '{name}' (a message has role and content)", "messages")
