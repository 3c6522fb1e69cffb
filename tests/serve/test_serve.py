"""`viasd serve` through the official openai client: answers equal `viasd generate`, streamed or
not; multi-turn KV-cache re-use; models, auth and health; every kind of bad input with its
status; /metrics read by Prometheus' parser equals what the requests did."""

import logging
import socket

import openai
import pytest
from typer.testing import CliRunner

from support.serve_support import N, assert_clean_log, client, generate_texts, metric_samples, raw, running, session, total  # noqa: F401
from viasd_cli.app import get_app
from viasd_core.speculation.engine import GenerationConfig
from viasd_core.errors import ViasdError
from viasd_core.frontends import serve_server
from viasd_core.frontends.serve_app import ServeSettings
from viasd_core.frontends.serve_server import is_loopback
from viasd_core.loading.profile import Profile, profile_path, save_profile
from viasd_core.loading.prompts import encode
from viasd_core.session import build_session
from viasd_core.loading.options import ModelOptions

PROMPTS = ["w1 w2 w3 w4 w5 w6", "w9 w8 w7"]
FINISH = {"eos": "stop", "stop": "stop", "length": "length"}


def chat_args(prompt, **extra):
    return {"model": "target", "messages": [{"role": "user", "content": prompt}], **extra}


def streamed_chat(c, prompt, **extra):
    chunks = list(c.chat.completions.create(**chat_args(prompt, stream=True, **extra)))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    return text, chunks


def test_answers_equal_generate_streamed_or_not(session, tiny_dirs, viasd_home):  # noqa: F811
    sd, raw_sd, ar = (generate_texts(tiny_dirs, PROMPTS, *args) for args in ((), ("--raw",), ("--mode", "ar")))
    with running(session) as (base, _):
        c = client(base)
        for i, prompt in enumerate(PROMPTS):
            whole = c.chat.completions.create(**chat_args(prompt))
            text, chunks = streamed_chat(c, prompt, stream_options={"include_usage": True})
            assert whole.choices[0].message.content == text == sd[i]["text"] and text
            assert whole.choices[0].finish_reason == FINISH[sd[i]["finish_reason"]]
            assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (sd[i]["prompt_tokens"], sd[i]["new_tokens"])
            assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
            # the stream: the role first, the finish reason and statistics last, then the usage
            assert chunks[0].choices[0].delta.role == "assistant"
            assert sum(1 for ch in chunks if ch.choices and ch.choices[0].delta.content) >= 2  # step by step
            assert chunks[-2].choices[0].finish_reason == whole.choices[0].finish_reason
            assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
            for ext in (whole.model_extra["viasd"], chunks[-2].model_extra["viasd"]):
                assert ext["mode"] == "sd" and ext["draft"] == "draft" and ext["fidelity"] is None
                assert sum(ext["tier_counts"].values()) == whole.usage.completion_tokens
                assert ext["tokens_per_target_pass"] == pytest.approx(whole.usage.completion_tokens / ext["target_passes"])
                assert ext["draft_tokens"] == sum(ext["position_attempts"]) > 0
                assert len(ext["acceptance_by_position"]) == len(ext["position_attempts"])
            # completions: no chat template, as `generate --raw`
            comp = c.completions.create(model="target", prompt=prompt)
            comp_text = "".join(ch.choices[0].text for ch in c.completions.create(model="target", prompt=prompt, stream=True))
            assert comp.choices[0].text == comp_text == raw_sd[i]["text"]
            assert comp.usage.prompt_tokens == raw_sd[i]["prompt_tokens"]
            # the mode and the draft per request
            plain = c.chat.completions.create(**chat_args(prompt), extra_body={"mode": "ar"})
            assert plain.choices[0].message.content == ar[i]["text"] == sd[i]["text"]
            assert plain.model_extra["viasd"]["mode"] == "ar" and plain.model_extra["viasd"]["target_passes"] == ar[i]["new_tokens"]
            lookup = c.chat.completions.create(**chat_args(prompt), extra_body={"draft": "ngram"})
            assert lookup.choices[0].message.content == sd[i]["text"] and lookup.model_extra["viasd"]["draft"] == "ngram"
            back = c.chat.completions.create(**chat_args(prompt))  # the model draft again, from an empty cache
            assert back.choices[0].message.content == sd[i]["text"] and back.model_extra["viasd"]["draft_tokens"] > 0


def test_stop_strings_are_never_streamed(session, tiny_dirs, viasd_home):  # noqa: F811
    [free] = generate_texts(tiny_dirs, PROMPTS[:1], "-n", 16)
    words = free["text"].split()
    stops = [words[3], words[4] + " " + words[5]]  # one word, and a two-word stop held back across steps
    [ref] = generate_texts(tiny_dirs, PROMPTS[:1], "-n", 16, *[a for s in stops for a in ("--stop", s)])
    assert ref["finish_reason"] == "stop" and len(ref["text"]) < len(free["text"])
    with running(session) as (base, _):
        c = client(base)
        whole = c.chat.completions.create(**chat_args(PROMPTS[0], max_tokens=16, stop=stops))
        text, chunks = streamed_chat(c, PROMPTS[0], max_tokens=16, stop=stops)
        assert whole.choices[0].message.content == text == ref["text"]
        assert not any(s in text for s in stops)
        assert whole.choices[0].finish_reason == chunks[-1].choices[0].finish_reason == "stop"
        comp = c.completions.create(model="target", prompt="w5 w4 w3", max_tokens=16, stop=" ")
        assert comp.choices[0].text.strip() and " " not in comp.choices[0].text.strip()
    # the server's --stop holds for every request without a `stop` of its own; `stop: []` asks for none
    with running(session, GenerationConfig(mode="sd", max_new_tokens=16, stop=tuple(stops))) as (base, _):
        c = client(base)
        assert c.chat.completions.create(**chat_args(PROMPTS[0])).choices[0].message.content == ref["text"]
        assert streamed_chat(c, PROMPTS[0])[0] == ref["text"]
        assert c.chat.completions.create(**chat_args(PROMPTS[0], stop=[])).choices[0].message.content == free["text"]


def test_a_multi_turn_client_reuses_the_kv_cache(session, tiny_dirs, viasd_home):  # noqa: F811
    with running(session) as (base, _):
        c = client(base)
        messages = [{"role": "user", "content": " ".join(f"w{i % 200 + 1}" for i in range(280))}]
        first = c.chat.completions.create(model="target", messages=messages)
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "w5 w6"}]
        second = c.chat.completions.create(model="target", messages=messages)
    assert first.usage.prompt_tokens > 256 + 17 and first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    # Only the first prompt's whole prefill chunk is re-used: its last positions and the answer were
    # computed by passes a fresh server's prefill does not make (serve_cache.py).
    assert cached == 256
    assert second.model_extra["viasd"]["prefill_processed"] == second.usage.prompt_tokens - cached
    fresh = build_session(ModelOptions(model=str(tiny_dirs["target"]), draft=str(tiny_dirs["draft"])), mode="sd").engine
    ids = encode(fresh.tokenizer, messages)
    assert len(ids) == second.usage.prompt_tokens
    again = fresh.generate(ids, GenerationConfig(mode="sd", max_new_tokens=N))
    assert again.text == second.choices[0].message.content


def test_models_auth_and_health(session, viasd_home):  # noqa: F811
    with running(session, name="tiny", api_key="s3cret") as (base, _):
        assert raw(base, "GET", "/health")[:1] == (200,)  # no key needed
        assert raw(base, "GET", "/metrics")[0] == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            status, h, body = raw(base, "GET", "/v1/models", headers=headers)
            assert status == 401 and body["error"]["code"] == "invalid_api_key" and h["www-authenticate"] == "Bearer"
        status, _, body = raw(base, "POST", "/v1/chat/completions", chat_args("w1", model="tiny"))
        assert status == 401
        with pytest.raises(openai.AuthenticationError):
            client(base, key="wrong").models.list()
        c = client(base, key="s3cret")
        [card] = c.models.list().data
        assert card.id == "tiny" and card.model_extra["viasd"]["modes"] == ["ar", "sd"]
        assert card.model_extra["viasd"]["drafts"] == ["draft", "ngram", "none"]
        assert c.models.retrieve("tiny").id == "tiny"
        answer = c.chat.completions.create(**chat_args("w1 w2", model="tiny"))
        assert answer.model == "tiny" and answer.choices[0].message.content
        assert c.chat.completions.create(**chat_args("w1 w2", model="target")).choices  # the model id is an alias
        with pytest.raises(openai.NotFoundError) as e:
            c.chat.completions.create(**chat_args("w1", model="gpt-4"))
        assert e.value.code == "model_not_found"


LONG = " ".join(f"w{i % 200}" for i in range(600))  # more tokens than the tiny model's 512 positions
MSG = [{"role": "user", "content": "w1 w2"}]
BAD = [  # (path, body, status, param or code)
    ("/v1/chat/completions", "{bad json", 400, None),
    ("/v1/chat/completions", "[1, 2]", 400, None),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "w1"}], "temperature": NaN}', 400, None),
    ("/v1/chat/completions", {}, 400, "messages"),
    ("/v1/chat/completions", {"messages": "w1 w2"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "w1"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": MSG, "max_tokens": "5"}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": MSG, "max_tokens": True}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": MSG, "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": MSG, "temperature": "hot"}, 400, "temperature"),
    ("/v1/chat/completions", {"messages": MSG, "temperature": -1}, 400, "temperature"),
    ("/v1/chat/completions", {"messages": MSG, "temperature": 2.5}, 400, "temperature"),
    ("/v1/chat/completions", {"messages": MSG, "top_p": 0}, 400, "top_p"),
    ("/v1/chat/completions", {"messages": MSG, "top_p": 1.5}, 400, "top_p"),
    ("/v1/chat/completions", {"messages": MSG, "seed": "x"}, 400, "seed"),
    ("/v1/chat/completions", {"messages": MSG, "stop": 5}, 400, "stop"),
    ("/v1/chat/completions", {"messages": MSG, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("/v1/chat/completions", {"messages": MSG, "stream": "yes"}, 400, "stream"),
    ("/v1/chat/completions", {"messages": MSG, "n": 2}, 400, "n"),
    ("/v1/chat/completions", {"messages": MSG, "logprobs": True}, 400, "logprobs"),
    ("/v1/chat/completions", {"messages": MSG, "mode": "fast"}, 400, "mode"),
    ("/v1/chat/completions", {"messages": MSG, "mode": "viasd"}, 400, "mode"),  # no calibration profile
    ("/v1/chat/completions", {"messages": MSG, "draft": "some/other-model"}, 400, "draft"),
    ("/v1/chat/completions", {"messages": MSG, "draft": "none"}, 400, "draft"),  # sd needs a draft
    ("/v1/chat/completions", {"messages": MSG, "mode": "ar", "draft": "none", "top_k": -1}, 400, "top_k"),
    ("/v1/chat/completions", {"messages": MSG, "model": "gpt-4"}, 404, "model_not_found"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]}, 400, "context_length_exceeded"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}], "stream": True}, 400, "context_length_exceeded"),
    ("/v1/completions", {"prompt": LONG}, 400, "context_length_exceeded"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": "  "}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, 99999]}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["w1", "w2"]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "w1", "echo": True}, 400, "echo"),
    ("/v1/completions", "x" * 70_000, 413, None),
]


def test_bad_inputs_get_their_status_and_no_traceback(session, viasd_home, capfd, caplog):  # noqa: F811
    caplog.set_level(logging.WARNING)
    with running(session, max_body=64_000) as (base, _):
        for path, body, status, where in BAD:
            got, headers, answer = raw(base, "POST", path, body)
            case = (path, str(body)[:80])
            assert got == status, (case, answer)
            assert set(answer["error"]) == {"message", "type", "param", "code"} and answer["error"]["message"], case
            assert where in (None, answer["error"]["param"], answer["error"]["code"]), (case, answer)
        assert raw(base, "GET", "/v1/chat/completions")[0] == 405
        assert raw(base, "GET", "/v1/nothing")[0] == 404
        with pytest.raises(openai.BadRequestError) as e:
            client(base).chat.completions.create(**chat_args("w1", temperature=-1))
        assert e.value.param == "temperature"
        assert client(base).chat.completions.create(**chat_args("w1 w2")).choices[0].message.content  # still serving
    assert_clean_log(capfd)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


def test_metrics_count_what_the_requests_did(session, viasd_home):  # noqa: F811
    with running(session) as (base, _):
        c = client(base)
        exts, usages = [], []
        for prompt, extra in (("w1 w2 w3", {}), ("w4 w5", {"mode": "ar"}), ("w6 w7 w8", {"draft": "ngram"})):
            r = c.chat.completions.create(**chat_args(prompt), extra_body=extra)
            exts.append(r.model_extra["viasd"])
            usages.append(r.usage)
        _, chunks = streamed_chat(c, "w9 w1", stream_options={"include_usage": True})
        exts.append(chunks[-2].model_extra["viasd"])
        usages.append(chunks[-1].usage)
        assert raw(base, "POST", "/v1/chat/completions", "{")[0] == 400
        name = c.models.list().data[0].id
        m = metric_samples(base)
    assert total(m, "viasd:requests_total", endpoint="/v1/chat/completions", status="200") == 4
    assert total(m, "viasd:requests_total", status="400") == 1
    assert total(m, "vllm:request_success_total") == 4
    assert total(m, "vllm:request_success_total", mode="ar") == 1
    assert total(m, "vllm:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert total(m, "vllm:prefix_cache_hits_total") == sum(u.prompt_tokens_details.cached_tokens for u in usages)
    assert total(m, "vllm:generation_tokens_total") == sum(u.completion_tokens for u in usages)
    assert total(m, "viasd:target_passes_total") == sum(e["target_passes"] for e in exts)
    assert total(m, "vllm:spec_decode_num_draft_tokens_total") == sum(e["draft_tokens"] for e in exts) > 0
    assert total(m, "vllm:spec_decode_num_accepted_tokens_total") == sum(sum(e["position_accepts"]) for e in exts)
    assert total(m, "vllm:spec_decode_num_drafts_total") == sum(e["position_attempts"][0] for e in exts if e["position_attempts"])
    for j in range(max(len(e["position_attempts"]) for e in exts)):
        tried = sum(e["position_attempts"][j] for e in exts if len(e["position_attempts"]) > j)
        assert total(m, "viasd:spec_decode_num_draft_tokens_per_pos_total", position=str(j)) == tried
    for tier in ("accept", "slim", "full", "bonus"):
        assert total(m, "viasd:tier_tokens_total", tier=tier) == sum(e["tier_counts"][tier] for e in exts)
    assert total(m, "vllm:e2e_request_latency_seconds_count") == 4
    assert total(m, "vllm:time_to_first_token_seconds_count") == 4
    assert total(m, "vllm:num_requests_running") == 0 and total(m, "vllm:num_requests_waiting") == 0
    for j in range(max(len(e["position_attempts"]) for e in exts)):
        kept = sum(e["position_accepts"][j] for e in exts if len(e["position_accepts"]) > j)
        assert total(m, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(j)) == kept
    # vLLM's names and label: every series of the server carries model_name
    assert {dict(labels).get("model_name") for _, labels in m} == {name}
    # time per output token: one observation per step after the first (every step emits), one per request
    steps = sum(e["steps"] for e in exts)
    assert total(m, "vllm:inter_token_latency_seconds_count") == total(m, "vllm:time_per_output_token_seconds_count") == steps - 4
    assert total(m, "vllm:inter_token_latency_seconds_sum") == pytest.approx(total(m, "vllm:time_per_output_token_seconds_sum"))
    assert 0 < total(m, "vllm:inter_token_latency_seconds_sum") < total(m, "vllm:e2e_request_latency_seconds_sum")
    assert total(m, "vllm:request_time_per_output_token_seconds_count") == 4  # every answer has several tokens
    assert total(m, "vllm:inter_token_latency_seconds_bucket", le="+Inf") == steps - 4


def test_calibrated_modes_per_request(tiny_dirs, viasd_home):
    """With the pair's profile saved, exact and viasd are per-request modes: exact equals sd, viasd
    reports its tiers and fidelity."""
    s = build_session(ModelOptions(model=str(tiny_dirs["target"]), draft=str(tiny_dirs["draft"])), mode="sd")
    save_profile(Profile(target_id=s.target.model_id, draft_id=s.draft_id, quant="none", device="cpu", dtype="float32",
                         layer_ids=[0, 1], n_layers=4, theta_accept=0.9, theta_slim=0.6, budget=0.05,
                         heldout_fidelity=0.97), profile_path(s.target.model_id, s.draft_id, "none", "cpu"))
    with running(s, fidelity=True) as (base, _):
        c = client(base)
        assert c.models.list().data[0].model_extra["viasd"]["modes"] == ["ar", "sd", "exact", "viasd"]
        sd = c.chat.completions.create(**chat_args(PROMPTS[0]))
        exact = c.chat.completions.create(**chat_args(PROMPTS[0]), extra_body={"mode": "exact"})
        assert exact.choices[0].message.content == sd.choices[0].message.content
        assert exact.model_extra["viasd"]["mode"] == "exact" and exact.model_extra["viasd"]["slim_passes"] > 0
        text, chunks = streamed_chat(c, PROMPTS[0], extra_body={"mode": "viasd"}, stream_options={"include_usage": True})
        ext = chunks[-2].model_extra["viasd"]
        assert ext["mode"] == "viasd" and 0 <= ext["fidelity"] <= 1 and text
        assert sum(ext["tier_counts"].values()) == chunks[-1].usage.completion_tokens > 0
        for extra, param in (({"mode": "viasd", "temperature": 0.5}, None), ({"mode": "viasd", "draft": "ngram"}, "draft")):
            with pytest.raises(openai.BadRequestError) as e:
                c.chat.completions.create(**chat_args(PROMPTS[0]), extra_body=extra)
            assert e.value.param == param and e.value.message
    with running(s) as (base, _):  # without --fidelity: no full target forward, no fidelity
        calls = []
        model = s.target.model
        forward = model.forward
        model.forward = lambda *a, **k: calls.append(1) or forward(*a, **k)
        try:
            answer = client(base).chat.completions.create(**chat_args(PROMPTS[0]), extra_body={"mode": "viasd"})
        finally:
            model.forward = forward
        assert answer.model_extra["viasd"]["mode"] == "viasd" and answer.model_extra["viasd"]["fidelity"] is None
        assert answer.choices[0].message.content and calls == []


def test_loopback_and_command_line_errors(session, tiny_dirs, viasd_home, monkeypatch):  # noqa: F811
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.0.0.2", "::1", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "192.168.1.2", "example.com"))

    def no_socket(host, port):  # stop before binding anything but loopback
        raise ViasdError("not bound")

    listen = serve_server.listen
    monkeypatch.setattr(serve_server, "listen", no_socket)
    monkeypatch.setattr(serve_server, "_setup_log", lambda: None)  # the test process's logging stays as it is
    for host, key, warned in (("0.0.0.0", None, True), ("0.0.0.0", "k", False), ("127.0.0.1", None, False)):
        notes = []
        with pytest.raises(ViasdError):
            serve_server.serve(session, GenerationConfig(), ServeSettings(api_key=key), host, 0, progress=notes.append)
        assert any(n.startswith("warning: listening on 0.0.0.0 without --api-key") for n in notes) == warned, notes
    monkeypatch.setattr(serve_server, "listen", listen)

    def serve(*args):
        return CliRunner().invoke(get_app(), ["serve", "-m", str(tiny_dirs["target"]), "-d", "ngram", *map(str, args)])

    for args, message in ((["--port", 70000], "--port must be in [0, 65535]"), (["--timeout", 0], "--timeout must be > 0"),
                          (["--max-queue", -1], "--max-queue must be >= 0"), (["--mode", "fast"], "unknown mode 'fast'")):
        r = serve(*args)
        assert r.exit_code == 2 and message in r.stderr and r.stderr.count("\n") == 1, r.stderr
    with socket.create_server(("127.0.0.1", 0)) as taken:
        r = serve("--port", taken.getsockname()[1])
    assert r.exit_code == 1 and r.stderr.splitlines()[-1].startswith("Error: cannot listen on 127.0.0.1:"), r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""
