"""`viasd serve` request by request: the chat template (one that refuses, none at all, template
variables), every field's fate, seeds, and max_tokens left out."""

import contextlib

import openai
import pytest

from conftest import CHAT_TEMPLATE
from support.serve_support import N, client, raw, running, session  # noqa: F401
from viasd_core.speculation.engine import GenerationConfig

CHAT = "/v1/chat/completions"
LONG = [{"role": "user", "content": " ".join(f"w{i % 200 + 1}" for i in range(280))}]  # a whole prefill chunk to keep
GEMMA_LIKE = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
              + CHAT_TEMPLATE)
THINKING = CHAT_TEMPLATE + "{% if enable_thinking is defined and not enable_thinking %}<x> {% endif %}"


def chat_args(prompt="w1 w2 w3", **extra):
    return {"model": "target", "messages": [{"role": "user", "content": prompt}], **extra}


@contextlib.contextmanager
def chat_template(session, text):  # noqa: F811
    """The session's tokenizer with another chat template (None: none) for the block."""
    tokenizer = session.tokenizer
    old = tokenizer.chat_template
    tokenizer.chat_template = text
    try:
        yield
    finally:
        tokenizer.chat_template = old


def test_a_template_that_refuses_is_a_400_and_keeps_the_engine_and_cache(session, viasd_home):  # noqa: F811
    with running(session) as (base, _), chat_template(session, GEMMA_LIKE):
        c = client(base)
        first = c.chat.completions.create(model="target", messages=LONG)
        committed = list(session.engine.tokens)
        system = [{"role": "system", "content": "w1"}] + LONG
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="target", messages=system)
        assert e.value.param == "messages" and e.value.code == "chat_template_error"
        assert "System role not supported" in e.value.message
        status, _, answer = raw(base, "POST", CHAT, {"messages": system, "stream": True})  # a stream: the 400 itself
        assert status == 400 and answer["error"]["code"] == "chat_template_error"
        assert session.engine.tokens == committed  # nothing ran, nothing was reset
        again = c.chat.completions.create(model="target", messages=LONG)
    assert again.choices[0].message.content == first.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens == 256  # the cache is still there (a reset keeps 0)


def test_a_model_without_a_chat_template(session, viasd_home):  # noqa: F811
    with running(session) as (base, _), chat_template(session, None):
        c = client(base)
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(**chat_args())
        assert e.value.param == "messages" and e.value.code == "no_chat_template" and "chat template" in e.value.message
        assert c.completions.create(model="target", prompt="w1 w2 w3").choices[0].text  # no template needed


def test_chat_template_kwargs_reach_the_template(session, viasd_home):  # noqa: F811
    with running(session) as (base, _), chat_template(session, THINKING):
        c = client(base)
        plain = c.chat.completions.create(**chat_args())
        off = c.chat.completions.create(**chat_args(), extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        on = c.chat.completions.create(**chat_args(), extra_body={"chat_template_kwargs": {"enable_thinking": True}})
        assert off.usage.prompt_tokens == plain.usage.prompt_tokens + 1 == on.usage.prompt_tokens + 1
        for bad in ([1], {"tokenize": True}, {"add_generation_prompt": False, "x": 1}):
            status, _, answer = raw(base, "POST", CHAT, {**chat_args(), "chat_template_kwargs": bad})
            assert status == 400 and answer["error"]["param"] == "chat_template_kwargs", (bad, answer)


def test_seeds_per_request(session, viasd_home):  # noqa: F811
    """A server --seed gives request k the seed --seed + k (answers differ); a request's own seed wins
    and repeats its answer; a restarted server repeats its sequence. (sd with fixed blocks: adaptive
    blocks follow measured time, and where a block ends decides which draw a token takes.)"""
    config = GenerationConfig(mode="sd", max_new_tokens=N, temperature=1.0, seed=7, adaptive=False)
    with running(session, config) as (base, _):
        c = client(base)
        answers = [c.chat.completions.create(**chat_args()) for _ in range(3)]
        assert [a.model_extra["viasd"]["seed"] for a in answers] == [7, 8, 9]
        texts = [a.choices[0].message.content for a in answers]
        assert len(set(texts)) == 3, texts
        again = c.chat.completions.create(**chat_args(seed=8))
        assert again.choices[0].message.content == texts[1] and again.model_extra["viasd"]["seed"] == 8
        plain = [c.chat.completions.create(**chat_args(seed=3), extra_body={"mode": "ar"}) for _ in range(2)]
        assert plain[0].choices[0].message.content == plain[1].choices[0].message.content
        greedy = c.chat.completions.create(**chat_args(temperature=0))
        assert greedy.model_extra["viasd"]["seed"] == 7 + 6  # the 7th request: counted all the same
    with running(session, config) as (base, _):
        assert client(base).chat.completions.create(**chat_args()).choices[0].message.content == texts[0]
    with running(session, GenerationConfig(mode="sd", max_new_tokens=N, temperature=1.0)) as (base, _):
        assert client(base).chat.completions.create(**chat_args()).model_extra["viasd"]["seed"] is None


def test_min_p_reaches_the_sampler(session, viasd_home):  # noqa: F811
    """min_p 1 keeps only the most likely token: a sampled answer is then the greedy one, in ar and
    in sd (draft and target filtered alike); without it the sampled answers differ from greedy."""
    with running(session, GenerationConfig(mode="sd", max_new_tokens=N, adaptive=False)) as (base, _):
        c = client(base)
        greedy = c.chat.completions.create(**chat_args()).choices[0].message.content
        for mode in ("ar", "sd"):
            for seed in (1, 2):
                args = chat_args(temperature=1.5, seed=seed)
                kept = c.chat.completions.create(**args, extra_body={"mode": mode, "min_p": 1.0})
                assert kept.choices[0].message.content == greedy, (mode, seed)
        free = {c.chat.completions.create(**chat_args(temperature=1.5, seed=s)).choices[0].message.content
                for s in (1, 2, 3)}
        assert free != {greedy}


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
REFUSED = [  # (path, fields over a good body, param, code)
    (CHAT, {"min_p": 1.5}, "min_p", None),
    (CHAT, {"repetition_penalty": 0}, "repetition_penalty", None),  # honoured (test_repetition_penalty.py), > 0
    (CHAT, {"min_p": "0.1"}, "min_p", None),
    (CHAT, {"presence_penalty": 0.5}, "presence_penalty", None),
    (CHAT, {"ignore_eos": True}, "ignore_eos", None),
    (CHAT, {"reasoning_effort": "low"}, "reasoning_effort", None),
    (CHAT, {"functions": [TOOL["function"]]}, "functions", "constrained_output_unsupported"),
    (CHAT, {"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend", "constrained_output_unsupported"),
    (CHAT, {"structured_outputs": {"regex": "a+"}}, "structured_outputs", "constrained_output_unsupported"),
    (CHAT, {"tool_choice": "required"}, "tool_choice", None),  # no tools to call
    (CHAT, {"guided_json": 3}, "guided_json", None),
    (CHAT, {"frobnicate": 1}, "frobnicate", None),
    (CHAT, {"prompt": "w1"}, "prompt", None),
    (CHAT, {"messages": [{"role": "assistant", "content": "w1", "tool_calls": [{"id": "1"}]}]}, "messages", None),
    (CHAT, {"messages": [{"role": "user", "content": "w1", "colour": "red"}]}, "messages", None),
    ("/v1/completions", {"messages": [{"role": "user", "content": "w1"}]}, "messages", None),
    ("/v1/completions", {"chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs", None),
    ("/v1/completions", {"max_completion_tokens": 4}, "max_completion_tokens", None),
]
NEUTRAL_BODY = {  # what clients send by default, or asks for what greedy decoding with no tools does anyway
    "n": 1, "presence_penalty": 0, "frequency_penalty": 0.0, "logprobs": False, "repetition_penalty": 1.0, "min_p": 0.2,
    "tools": [], "tool_choice": "none", "parallel_tool_calls": False, "response_format": {"type": "text"},
    "user": "someone", "metadata": {"a": "b"}, "cache_prompt": True, "skip_special_tokens": True, "store": False,
}


def test_every_field_is_honoured_refused_or_ignored(session, viasd_home):  # noqa: F811
    good = {"chat": chat_args(max_tokens=4), "completion": {"prompt": "w1 w2 w3", "max_tokens": 4}}
    with running(session) as (base, _):
        for path, extra, param, code in REFUSED:
            body = {**good["completion" if path.endswith("/completions") and "chat" not in path else "chat"], **extra}
            status, _, answer = raw(base, "POST", path, body)
            case = (path, extra)
            assert status == 400 and answer["error"]["param"] == param and answer["error"]["code"] == code, (case, answer)
            assert param in answer["error"]["message"] or param == "messages", (case, answer)
        plain = raw(base, "POST", CHAT, good["chat"])
        named = {**good["chat"], "messages": [{"role": "user", "content": "w1 w2 w3", "name": "ann"}]}
        for body in ({**good["chat"], **NEUTRAL_BODY}, named):
            status, _, answer = raw(base, "POST", CHAT, body)
            assert status == 200 and answer["choices"] == plain[2]["choices"], answer


def test_the_docs_give_every_fields_fate():
    """docs/serve.md names every field the server reads, refuses unless neutral, refuses, or ignores."""
    from pathlib import Path

    from viasd_core.frontends import serve_fields as f

    docs = (Path(__file__).resolve().parents[2] / "docs" / "serve.md").read_text(encoding="utf-8")
    names = set().union(*f.READ.values(), f.NEUTRAL, f.CONSTRAINED, f.IGNORED, f.MESSAGE_READ, f.MESSAGE_NEUTRAL,
                        f.MESSAGE_IGNORED)
    assert sorted(n for n in names if f"`{n}`" not in docs) == []
    for name, why in {**f.IGNORED, **f.MESSAGE_IGNORED}.items():
        assert why in docs.replace("\n", " "), name  # each with its reason
