"""`viasd serve` request by request: the chat template (one that refuses, none at all, template
variables), every field's fate, seeds, and max_tokens left out."""

import contextlib

import openai
import pytest

from conftest import CHAT_TEMPLATE
from test_serve_support import N, client, raw, running, session  # noqa: F401
from viasd_core.decoding.engine import GenerationConfig

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
