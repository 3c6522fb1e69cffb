"""`viasd serve` under load and faults: a burst of concurrent clients, a full queue, time limits,
clients that go away, and Ctrl-C on a real `viasd serve` process during a stream."""

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai

from support.serve_support import (assert_clean_log, client, generate_texts, metric_samples, raw, running, session,  # noqa: F401
                                slow_target, total)
from viasd_core.speculation.engine import GenerationConfig

PROMPTS = [f"w{i} w{i + 7} w{i + 3}" for i in range(1, 11)]
CHAT = "/v1/chat/completions"


def body(prompt, **extra):
    return {"messages": [{"role": "user", "content": prompt}], **extra}


def burst(base, n_requests: int, n_clients: int):
    """n_requests over n_clients threads (every third streamed): (index, status, text, Retry-After)."""
    def one(i):
        c = client(base)
        prompt = PROMPTS[i % len(PROMPTS)]
        try:
            if i % 3 == 0:
                chunks = c.chat.completions.create(model="target", stream=True, **body(prompt))
                return i, 200, "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices), None
            return i, 200, c.chat.completions.create(model="target", **body(prompt)).choices[0].message.content, None
        except openai.APIStatusError as e:
            return i, e.status_code, None, e.response.headers.get("retry-after")

    with ThreadPoolExecutor(n_clients) as pool:
        return list(pool.map(one, range(n_requests)))


def test_a_burst_of_50_requests_from_8_clients(session, tiny_dirs, viasd_home, capfd):  # noqa: F811
    expected = {r["prompt"]: r["text"] for r in generate_texts(tiny_dirs, PROMPTS)}
    # 1 running + 7 waiting hold 8 clients: every request is answered, each with its own prompt's answer.
    with running(session, max_queue=7) as (base, _):
        results = burst(base, 50, 8)
        assert [r[0] for r in results] == list(range(50))
        assert [(i, status, text) for i, status, text, _ in results] == [
            (i, 200, expected[PROMPTS[i % len(PROMPTS)]]) for i in range(50)]
        m = metric_samples(base)
        assert total(m, "viasd:requests_total", status="200") == 50 and total(m, "vllm:request_success_total") == 50
    # A queue of 2: what does not fit is refused with 503 and Retry-After, nothing is lost or mixed up.
    with running(session, max_queue=2) as (base, _):
        results = burst(base, 24, 8)
        ok = [r for r in results if r[1] == 200]
        busy = [r for r in results if r[1] == 503]
        assert len(ok) + len(busy) == 24 and len(ok) >= 3
        assert all(text == expected[PROMPTS[i % len(PROMPTS)]] for i, _, text, _ in ok)
        assert all(int(retry) >= 1 for *_, retry in busy)
        assert raw(base, "GET", "/health")[0] == 200
        assert client(base).chat.completions.create(model="target", **body(PROMPTS[0])).choices[0].message.content == expected[PROMPTS[0]]
        m = metric_samples(base)
        assert total(m, "viasd:requests_total", status="200") == len(ok) + 1
        assert total(m, "viasd:requests_total", status="503") == len(busy)
        assert total(m, "vllm:num_requests_running") == total(m, "vllm:num_requests_waiting") == 0
    assert_clean_log(capfd)


def wait_for(condition, seconds: float = 10.0) -> float:
    """Poll until condition() holds; returns the seconds it took."""
    t0 = time.monotonic()
    while not condition():
        assert time.monotonic() - t0 < seconds, "timed out waiting"
        time.sleep(0.005)
    return time.monotonic() - t0


def test_full_queue_and_time_limits(session, viasd_home, capfd):  # noqa: F811
    with running(session, max_queue=0) as (base, _):  # no queue: served while the engine is free
        assert [raw(base, "POST", CHAT, body("w1 w2"))[0] for _ in range(3)] == [200] * 3
    gate = threading.Event()
    inner = session.engine.steps
    session.engine.steps = lambda *a, **k: (gate.wait(20), inner(*a, **k))[1]  # the engine holds until released
    try:
        with running(session, GenerationConfig(mode="ar", max_new_tokens=8), max_queue=1, timeout=1.0) as (base, server):
            worker = server.worker
            pool = ThreadPoolExecutor(2)
            first = pool.submit(raw, base, "POST", CHAT, body("w1 w2"))
            wait_for(lambda: worker.busy and worker.waiting == 0)  # running, held
            second = pool.submit(raw, base, "POST", CHAT, body("w3 w4"))
            wait_for(lambda: worker.waiting == 1)
            status, headers, answer = raw(base, "POST", CHAT, body("w5"))
            assert status == 503 and int(headers["retry-after"]) >= 1 and answer["error"]["code"] == "queue_full"
            # The second waits past its 1 s limit: 504 without ever running.
            status, _, answer = second.result(10)
            assert status == 504 and answer["error"]["code"] == "timeout" and "before any token" in answer["error"]["message"]
            gate.set()
            # The first ran past its limit too: it stops after its first step (ar: one token).
            status, _, answer = first.result(10)
            assert status == 504 and "after 1 new tokens" in answer["error"]["message"], answer
            m = metric_samples(base)
            assert total(m, "vllm:request_success_total", finished_reason="timeout") == 1  # the one that ran
            assert total(m, "vllm:generation_tokens_total") == 1
            assert total(m, "viasd:requests_total", status="504") == 2
    finally:
        session.engine.steps = inner
    undo = slow_target(session, 0.02)
    try:
        with running(session, GenerationConfig(mode="ar", max_new_tokens=300), timeout=0.4) as (base, server):
            c = client(base)
            received = []
            try:
                for chunk in c.chat.completions.create(model="target", stream=True, **body("w1 w2 w3")):
                    received.append(chunk.choices[0].delta.content or "")
                raise AssertionError("the stream outlived its time limit")
            except openai.APIError as e:  # the stream's last event is the error object
                assert e.code == "timeout" and "time limit of 0.4 s" in e.message
            assert len(received) >= 2  # the role, then text until the limit
            try:
                c.chat.completions.create(model="target", **body("w1 w2 w3"))
                raise AssertionError("the request outlived its time limit")
            except openai.APIStatusError as e:
                assert e.status_code == 504
            assert not server.worker.busy
    finally:
        undo()
    assert_clean_log(capfd)


def test_a_client_that_goes_away_frees_the_engine_within_a_step(session, viasd_home, capfd):  # noqa: F811
    step = 0.03
    undo = slow_target(session, step)  # ar: one target pass, one token per step
    try:
        with running(session, GenerationConfig(mode="ar", max_new_tokens=300)) as (base, server):
            c = client(base)
            stream = c.chat.completions.create(model="target", stream=True, **body("w1 w2 w3"))
            got = [next(stream) for _ in range(4)]  # the role, then 3 tokens
            assert got[-1].choices[0].delta.content
            stream.close()
            freed = wait_for(lambda: not server.worker.busy)
            assert freed < 2.0, freed  # a few steps of 30 ms on a busy CPU, not the 300 tokens (9 s) asked
            # A non-streamed request whose client hangs up before its answer stops as well.
            host, port = base.removeprefix("http://").split(":")
            conn = http.client.HTTPConnection(host, int(port), timeout=10)
            conn.request("POST", CHAT, body=json.dumps(body("w4 w5")), headers={"Content-Type": "application/json"})
            wait_for(lambda: server.worker.busy)
            time.sleep(5 * step)
            conn.close()
            freed = wait_for(lambda: not server.worker.busy)
            assert freed < 2.0, freed
            m = metric_samples(base)
            assert total(m, "vllm:request_success_total", finished_reason="abort") == 2
            assert total(m, "vllm:generation_tokens_total") < 60
            answer = c.chat.completions.create(model="target", max_tokens=3, **body("w1"))  # the engine serves again
            assert answer.usage.completion_tokens >= 1
    finally:
        undo()
    assert_clean_log(capfd)


def test_ctrl_c_during_a_stream_ends_it_cleanly(tiny_dirs, tmp_path):
    env = {**os.environ, "VIASD_HOME": str(tmp_path / "home")}
    cmd = [sys.executable, "-m", "viasd_cli", "serve", "-m", str(tiny_dirs["target"]), "-d", str(tiny_dirs["draft"]),
           "--port", "0", "--mode", "ar", "-n", "400"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        found = re.search(r"http://127\.0\.0\.1:(\d+)/v1", line)
        assert found, (line, proc.stderr.read() if proc.poll() is not None else "")
        conn = http.client.HTTPConnection("127.0.0.1", int(found.group(1)), timeout=20)
        conn.request("POST", CHAT, body=json.dumps(body("w1 w2 w3", stream=True)), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        events = [resp.readline()]  # the role chunk: the generation is under way
        proc.send_signal(signal.SIGINT)
        events += resp.read().splitlines(keepends=True)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    data = [e.decode()[6:].strip() for e in events if e.startswith(b"data: ")]
    assert data[-1] == "[DONE]"
    bodies = [json.loads(d) for d in data[:-1]]  # every event whole
    last = bodies[-1]
    assert last.get("error", {}).get("code") == "shutting_down" or last["choices"][0]["finish_reason"] in ("stop", "length")
    assert proc.returncode == 0, err
    assert "Traceback" not in err and "stopped after 1 generation" in err, err


def test_a_failing_generation_is_a_500_and_one_log_line(session, viasd_home, capfd, caplog):  # noqa: F811
    inner = session.engine.steps

    def boom(*args, **kwargs):
        raise RuntimeError("boom")

    session.engine.steps = boom
    try:
        with running(session) as (base, _):
            status, _, answer = raw(base, "POST", CHAT, body("w1 w2"))
            assert status == 500 and answer["error"]["message"] == "internal error: RuntimeError: boom"
            # A stream has sent its 200 once the prompt fitted: the error is its last event.
            status, _, events = raw(base, "POST", CHAT, body("w1 w2", stream=True))
            data = [line[6:] for line in events.splitlines() if line.startswith("data: ")]
            assert status == 200 and data[-1] == "[DONE]"
            assert json.loads(data[-2])["error"]["message"] == "internal error: RuntimeError: boom"
            session.engine.steps = inner
            assert raw(base, "POST", CHAT, body("w1 w2"))[0] == 200  # the next request is served
    finally:
        session.engine.steps = inner
    assert [r.getMessage() for r in caplog.records if r.name == "viasd.serve"] == ["generation failed: RuntimeError: boom"] * 2
    assert_clean_log(capfd)
