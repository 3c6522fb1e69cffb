"""A request's prompt as token ids, or the 400 that says why it has none: a chat's messages through
the model's chat template, a completion's text (no template) or its token ids, and the context's
bound. Called on the engine's thread when the engine takes the request, before anything runs, so a
refused prompt leaves the engine and its caches untouched."""

from __future__ import annotations

from viasd_core.frontends.serve_errors import bad_request
from viasd_core.frontends.serve_schema import GenRequest
from viasd_core.loading.prompts import encode


def prompt_ids(tokenizer, request: GenRequest, context: int) -> list[int]:
    """The request's prompt tokens; a 400 where the prompt and at least one new token do not fit the
    `context`."""
    if request.kind == "chat":
        ids, param = chat_ids(tokenizer, request), "messages"
    elif isinstance(request.prompt, str):
        ids, param = encode(tokenizer, request.prompt, raw=True), "prompt"
    else:
        ids, param = list(request.prompt), "prompt"
    if len(ids) >= context:
        raise bad_request(f"the prompt has {len(ids)} tokens but the context holds {context} (prompt and answer): "
                          "shorten it, or restart the server with a larger --max-context", param,
                          code="context_length_exceeded")
    return ids


def chat_ids(tokenizer, request: GenRequest) -> list[int]:
    """The messages through the model's chat template; a model without one, or a template that
    refuses the messages (Gemma's "System role not supported"), is a 400."""
    if not getattr(tokenizer, "chat_template", None):
        raise bad_request("this model has no chat template, so chat messages cannot be laid out for it: "
                          "send the text to /v1/completions (no template)", "messages", code="no_chat_template")
    try:
        return encode(tokenizer, request.messages, template_kwargs=request.template_kwargs)
    except Exception as e:  # raised by the template (jinja's raise_exception, an undefined variable, ...)
        raise bad_request(f"the model's chat template refused these messages: {type(e).__name__}: {e}",
                          "messages", code="chat_template_error")
