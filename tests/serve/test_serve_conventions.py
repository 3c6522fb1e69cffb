"""`viasd serve` and the conventions clients and operators expect: max_tokens left out runs to the
end of the context, CORS for browser pages (off by default), a one-line access log, and the
command's options reaching the server."""

import logging
import re

from typer.testing import CliRunner

from support.serve_support import client, raw, running, session  # noqa: F401
from viasd_cli.app import get_app
from viasd_cli.serve import UNTIL_CONTEXT_END
from viasd_core.speculation.engine import GenerationConfig
from viasd_core.frontends import serve_server

CHAT = "/v1/chat/completions"
UI = "http://ui.example:3000"
PREFLIGHT = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization, content-type"}


def chat_body(prompt="w1 w2 w3", **extra):
    return {"messages": [{"role": "user", "content": prompt}], **extra}


def test_max_tokens_left_out_runs_to_the_end_of_the_context(session, viasd_home):  # noqa: F811
    context = session.engine.context_len
    prompt = " ".join(f"w{i * 3 % 200 + 1}" for i in range(context - 12))  # no end of text before the context ends
    with running(session, GenerationConfig(mode="sd", max_new_tokens=UNTIL_CONTEXT_END)) as (base, _):
        c = client(base)
        assert c.models.list().data[0].model_extra["viasd"]["max_tokens"] == context
        answer = c.completions.create(model="target", prompt=prompt)
        assert answer.usage.prompt_tokens + answer.usage.completion_tokens == context
        assert answer.choices[0].finish_reason == "length" and answer.usage.completion_tokens > 8
        assert c.completions.create(model="target", prompt=prompt, max_tokens=3).usage.completion_tokens == 3


def test_cors_only_for_the_origins_given(session, viasd_home):  # noqa: F811
    with running(session, cors=(UI,), api_key="k") as (base, _):
        status, h, _ = raw(base, "OPTIONS", CHAT, headers={"Origin": UI, **PREFLIGHT})  # a preflight needs no key
        assert status == 200 and h["access-control-allow-origin"] == UI and "POST" in h["access-control-allow-methods"]
        assert "authorization" in h["access-control-allow-headers"].lower()
        status, h, body = raw(base, "POST", CHAT, chat_body(max_tokens=2), headers={"Origin": UI, "Authorization": "Bearer k"})
        assert status == 200 and h["access-control-allow-origin"] == UI and body["choices"]
        status, h, _ = raw(base, "OPTIONS", CHAT, headers={"Origin": "http://elsewhere.example", **PREFLIGHT})
        assert status == 400 and "access-control-allow-origin" not in h
    with running(session) as (base, _):  # off by default: no CORS headers, no preflight
        status, h, _ = raw(base, "OPTIONS", CHAT, headers={"Origin": UI, **PREFLIGHT})
        assert status == 405 and "access-control-allow-origin" not in h
        status, h, _ = raw(base, "POST", CHAT, chat_body(max_tokens=2), headers={"Origin": UI})
        assert status == 200 and "access-control-allow-origin" not in h


def test_one_access_log_line_per_request(session, viasd_home, caplog):  # noqa: F811
    caplog.set_level(logging.INFO, logger="viasd.serve.access")
    with running(session) as (base, _):
        c = client(base)
        whole = c.chat.completions.create(model="target", **chat_body(max_tokens=5))
        chunks = list(c.chat.completions.create(model="target", stream=True, stream_options={"include_usage": True},
                                                **chat_body("w4 w5", max_tokens=4)))
        assert raw(base, "POST", CHAT, "{")[0] == 400
        assert raw(base, "GET", "/health")[0] == 200
    lines = [r.getMessage() for r in caplog.records if r.name == "viasd.serve.access"]
    expected = [f"POST {CHAT} 200 {whole.usage.completion_tokens} tokens", f"POST {CHAT} 200 {chunks[-1].usage.completion_tokens} tokens",
                f"POST {CHAT} 400 0 tokens", "GET /health 200 0 tokens"]
    assert len(lines) == len(expected), lines
    for line, start in zip(lines, expected):
        assert re.fullmatch(re.escape(start) + r" \d+\.\d{3} s", line), (line, start)
    caplog.clear()
    with running(session, access_log=False) as (base, _):
        assert raw(base, "GET", "/health")[0] == 200
    assert not [r for r in caplog.records if r.name == "viasd.serve.access"]


def test_the_command_passes_its_options(tiny_dirs, viasd_home, monkeypatch):
    got = {}
    monkeypatch.setattr(serve_server, "serve", lambda session, config, settings, *a, **k: got.update(config=config,
                                                                                                    settings=settings))

    def serve(*args):
        return CliRunner().invoke(get_app(), ["serve", "-m", str(tiny_dirs["target"]), "-d", "ngram", *args])

    r = serve("--cors", UI, "--cors", "*", "--no-access-log", "--fidelity")
    assert r.exit_code == 0, r.stderr
    assert got["settings"].cors == (UI, "*") and not got["settings"].access_log and got["settings"].fidelity
    assert got["config"].max_new_tokens == UNTIL_CONTEXT_END  # max_tokens left out: the context's end
    r = serve("-n", "7")
    assert r.exit_code == 0 and got["config"].max_new_tokens == 7, r.stderr
    assert got["settings"].cors == () and got["settings"].access_log and not got["settings"].fidelity
    r = serve("--cors", "http://ui.example/")
    assert r.exit_code == 2 and "--cors takes an origin" in r.stderr and r.stderr.count("\n") == 1, r.stderr
    help_text = CliRunner().invoke(get_app(), ["serve", "--help"], env={"COLUMNS": "200"}).stdout
    assert "[default: the context's end]" in help_text
