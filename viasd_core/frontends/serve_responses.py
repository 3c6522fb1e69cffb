"""OpenAI response bodies (chat.completion, text_completion and their stream chunks), with the
token counts in `usage` and the request's speculative statistics in the extension field `viasd`:

  "viasd": {"mode": "sd", "draft": "...", "tokens_per_target_pass": 3.1, "acceptance_rate": 0.62,
            "acceptance_by_position": [0.9, 0.7, ...], "tier_counts": {...}, "tier_shares": {...},
            "target_passes": 12, "slim_passes": 0, "draft_tokens": 40, "prefill_cached": 35,
            "prefill_processed": 4, "time_s": 0.41, "tokens_per_s": 92.6, "fidelity": null, "seed": 7}

`fidelity` is measured (the target teacher-forced over the answer: speculation/fidelity.py) in viasd mode when the server runs with
--fidelity, null elsewhere. `seed` is the sampling seed the request ran with (send it back as
`seed` to repeat a sampled answer), null when none was set. The finish
reason is OpenAI's: 'stop' (end of text or a stop string), 'length', or 'tool_calls' (the answer
parsed as tool calls).

A streamed answer whose tool calls are parsed holds back its text from the point a call could
start (serve_tools.HeldCalls); when it ends, each call goes out in OpenAI's delta shape, two chunks
per call: `{"index", "id", "type": "function", "function": {"name", "arguments": ""}}`, then
`{"index", "function": {"arguments": "<the whole JSON text>"}}`.
"""

from __future__ import annotations

import json
import time
import uuid

from viasd_core.speculation.engine import Generation
from viasd_core.frontends.serve_tools import HeldCalls, Tools, parse_tool_calls

EXTENSION = "viasd"
OBJECTS = {"chat": ("chat.completion", "chat.completion.chunk", "chatcmpl-"),
           "completion": ("text_completion", "text_completion", "cmpl-")}


def finish_reason(gen: Generation) -> str:
    return "stop" if gen.finish_reason in ("eos", "stop") else gen.finish_reason


def usage(gen: Generation) -> dict:
    s = gen.stats
    return {"prompt_tokens": s.prompt_tokens, "completion_tokens": len(gen.tokens),
            "total_tokens": s.prompt_tokens + len(gen.tokens),
            "prompt_tokens_details": {"cached_tokens": s.prefill_cached}}


def statistics(gen: Generation, draft: str, seed: int | None) -> dict:
    s = gen.stats
    return {
        "mode": s.mode, "draft": draft if s.mode != "ar" else "none",
        "tokens_per_target_pass": s.mean_accepted_length, "acceptance_rate": s.acceptance_rate,
        "acceptance_by_position": s.acceptance_by_position, "position_attempts": list(s.position_attempts),
        "position_accepts": list(s.position_accepts), "tier_counts": dict(s.tier_counts), "tier_shares": s.tier_shares,
        "target_passes": s.target_passes, "slim_passes": s.slim_passes, "steps": s.steps, "draft_tokens": s.draft_tokens,
        "prefill_cached": s.prefill_cached, "prefill_processed": s.prefill_processed,
        "time_s": s.time_total, "time_to_first_token_s": s.time_first_token, "tokens_per_s": s.tokens_per_s,
        "fidelity": s.fidelity, "seed": seed,
    }


class Reply:
    """The bodies of one answer: the whole response, or its stream's chunks."""

    def __init__(self, kind: str, model: str, seed: int | None = None, tools: Tools | None = None):
        self.kind = kind
        self.tools = tools  # a chat answer's tool calls are parsed from its text (unless tool_choice none)
        self.model = model
        self.seed = seed  # the request's sampling seed, reported in the statistics
        self.object, self.chunk_object, prefix = OBJECTS[kind]
        self.id = prefix + uuid.uuid4().hex
        self.created = int(time.time())
        self.held = HeldCalls(tools) if kind == "chat" and tools is not None and tools.parse else None

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _choice(self, text: str | None, finish: str | None, whole: bool) -> dict:
        if self.kind == "completion":
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        if whole:
            return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": finish}
        return {"index": 0, "delta": {} if text is None else {"content": text}, "logprobs": None, "finish_reason": finish}

    def whole(self, gen: Generation, draft: str) -> dict:
        choice = self._choice(gen.text, finish_reason(gen), True)
        if self.held is not None and _ended(gen):
            content, calls = parse_tool_calls(gen.text, self.tools)
            if calls:
                choice["message"] = {"role": "assistant", "content": content, "tool_calls": calls}
                choice["finish_reason"] = "tool_calls"
        return {**self._head(self.object), "choices": [choice], "usage": usage(gen),
                EXTENSION: statistics(gen, draft, self.seed)}

    def first_chunk(self) -> str | None:
        """A chat stream opens with the assistant's role (a completion stream has no such chunk)."""
        if self.kind != "chat":
            return None
        body = {**self._head(self.chunk_object), "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                              "logprobs": None, "finish_reason": None}]}
        return sse(body)

    def text_chunk(self, text: str) -> str | None:
        """The chunk for a streamed piece of text (None: held back, as a tool call may start here)."""
        if self.held is not None:
            text = self.held.feed(text)
            if not text:
                return None
        return sse({**self._head(self.chunk_object), "choices": [self._choice(text, None, False)]})

    def _delta_chunk(self, delta: dict) -> str:
        return sse({**self._head(self.chunk_object), "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                                                  "finish_reason": None}]})

    def last_chunks(self, gen: Generation, draft: str, include_usage: bool) -> list[str]:
        """What was held back (content, or the tool calls' deltas), the chunk with the finish reason
        and the statistics, the usage chunk if asked, [DONE]."""
        out, finish = [], finish_reason(gen)
        if self.held is not None:
            rest, calls = self.held.finish(gen.text, _ended(gen))
            if rest:
                out.append(self._delta_chunk({"content": rest}))
            for i, call in enumerate(calls):
                fn = call["function"]
                out.append(self._delta_chunk({"tool_calls": [{"index": i, "id": call["id"], "type": "function",
                                                              "function": {"name": fn["name"], "arguments": ""}}]}))
                out.append(self._delta_chunk({"tool_calls": [{"index": i, "function": {"arguments": fn["arguments"]}}]}))
            finish = "tool_calls" if calls else finish
        out.append(sse({**self._head(self.chunk_object), "choices": [self._choice(None, finish, False)],
                        EXTENSION: statistics(gen, draft, self.seed)}))
        if include_usage:
            out.append(sse({**self._head(self.chunk_object), "choices": [], "usage": usage(gen)}))
        return out + [DONE]


def _ended(gen: Generation) -> bool:
    """The answer ended by itself: only such an answer's text is read as tool calls."""
    return gen.finish_reason in ("eos", "stop")


DONE = "data: [DONE]\n\n"


def sse(body: dict) -> str:
    """One server-sent event carrying a JSON body."""
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"
