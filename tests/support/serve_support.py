"""What the `viasd serve` tests share: a tiny session (and one of the byte-level model, which can spell
JSON and tool calls), a server run in a thread on a free
loopback port, raw HTTP for what the openai client will not send, and `viasd generate` as the
reference answer. (No tests here: the name keeps pytest from collecting it.)"""

from __future__ import annotations

import contextlib
import http.client
import json
import threading
import time

import pytest
from typer.testing import CliRunner

from viasd_cli.app import get_app
from viasd_core.speculation.engine import GenerationConfig
from viasd_core.frontends.serve_app import ServeSettings
from viasd_core.frontends.serve_server import listen, make_server, prepare
from viasd_core.session import build_session
from viasd_core.loading.options import ModelOptions

N = 8  # new tokens per answer: several verification passes, still fast on a busy CPU


@pytest.fixture(scope="module")
def session(tiny_dirs, tmp_path_factory):
    """One tiny target + draft session per test module (the servers of a module share its engine)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VIASD_HOME", str(tmp_path_factory.mktemp("viasd_home")))
        yield build_session(ModelOptions(model=str(tiny_dirs["target"]), draft=str(tiny_dirs["draft"])), mode="sd")


@pytest.fixture(scope="module")
def byte_session(tmp_path_factory):
    """The same with the byte-level tiny pair of grammar_tiny (a Qwen-style tool template)."""
    from support.grammar_tiny import save_byte_model_dir

    base = tmp_path_factory.mktemp("byte_models")
    target, draft = save_byte_model_dir(base / "target", seed=51), save_byte_model_dir(base / "draft", n_layers=1, seed=52)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VIASD_HOME", str(tmp_path_factory.mktemp("viasd_home")))
        yield build_session(ModelOptions(model=str(target), draft=str(draft)), mode="sd")


@contextlib.contextmanager
def running(session, config: GenerationConfig | None = None, name: str | None = None, **settings):
    """A server on 127.0.0.1 (a free port) in a thread; yields (base url, server); stops it after."""
    config = config or GenerationConfig(mode="sd", max_new_tokens=N)
    server = make_server(session, prepare(session, config, name), ServeSettings(**settings))
    sock = listen("127.0.0.1", 0)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", server
    finally:
        server.stop()
        thread.join(20)
        sock.close()
        assert not thread.is_alive(), "the server did not stop"


def client(base: str, key: str = "none", **kwargs):
    from openai import OpenAI

    return OpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=30, **kwargs)


def raw(base: str, method: str, path: str, body: bytes | str | dict | None = None, headers: dict | None = None):
    """(status, headers, decoded JSON or text) of one plain HTTP request."""
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    if isinstance(body, dict):
        body = json.dumps(body)
    conn.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    data = resp.read().decode()
    conn.close()
    try:
        data = json.loads(data)
    except ValueError:
        pass
    return resp.status, dict(resp.getheaders()), data


def generate_texts(tiny_dirs, prompts: list[str], *args) -> list[dict]:
    """`viasd generate --json` for the prompts (one session): one record per prompt."""
    argv = ["generate", *prompts, "-m", str(tiny_dirs["target"]), "-d", str(tiny_dirs["draft"]), "-n", str(N),
            "--json", "-q", *map(str, args)]
    r = CliRunner().invoke(get_app(), argv)
    assert r.exit_code == 0, r.stderr
    return [json.loads(line) for line in r.stdout.splitlines()]


def slow_target(session, seconds: float):
    """Make every target pass sleep first (a slow model, for timing tests); returns the undo."""
    fast = session.engine.target
    inner = fast.forward

    def forward(*args, **kwargs):
        time.sleep(seconds)
        return inner(*args, **kwargs)

    fast.forward = forward
    return lambda: setattr(fast, "forward", inner)


def timed_calls(call):
    """`call` wrapped so that `timed(name, *args)` records when the call named `name` returned:
    (timed, finished: name -> time.monotonic())."""
    finished: dict[str, float] = {}

    def timed(name, *args, **kwargs):
        out = call(*args, **kwargs)
        finished[name] = time.monotonic()
        return out

    return timed, finished


def metric_samples(base: str) -> dict:
    """{(sample name, sorted labels): value} from /metrics, read by Prometheus' own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    status, _, text = raw(base, "GET", "/metrics")
    assert status == 200
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def total(samples: dict, name: str, **labels) -> float:
    """The sum of `name` over the samples whose labels include `labels`."""
    return sum(v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls))


def assert_clean_log(capfd) -> None:
    """Nothing the server wrote (uvicorn's log included) holds a traceback."""
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err and "Exception" not in out + err, (out + err)[-3000:]
