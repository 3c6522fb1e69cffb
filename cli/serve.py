"""`viasd serve`: an OpenAI-compatible HTTP server over one loaded pair (docs/serve.md)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from viasd_core.speculation.engine import GenerationConfig
from viasd_core.errors import UsageError
from viasd_core.loading.options import ModelOptions

from .app import app
from .options import StderrLog, generation_options, handle_errors, model_options, open_session

EXAMPLES = """
EXAMPLES

  viasd serve                                   (embedded model and draft on http://127.0.0.1:8000/v1)

  viasd serve -m ./my-model -d ngram --port 9000

  viasd serve --host 0.0.0.0 --api-key "$KEY"   (reachable from other machines: set a key)

  viasd serve --cors http://localhost:3000      (a chat UI in the browser at that origin may call it)

  curl http://127.0.0.1:8000/v1/chat/completions -d '{"messages": [{"role": "user", "content": "Hi"}]}'
"""


class _ContextEnd(int):
    """serve's --max-new-tokens default: every answer may run to the end of the context (as OpenAI,
    llama-server and Ollama); the engine cuts any limit to what the context leaves. --help shows it
    by name."""

    def __str__(self) -> str:
        return "the context's end"

    __repr__ = __str__


UNTIL_CONTEXT_END = _ContextEnd(2**31 - 1)


def _check_origin(origin: str) -> str:
    scheme, sep, rest = origin.partition("://")
    if origin != "*" and not (sep and scheme in ("http", "https") and rest and "/" not in rest):
        raise UsageError(f"--cors takes an origin such as http://localhost:3000 (scheme, host, port; no path) or '*', got '{origin}'")
    return origin


@app.command(epilog=EXAMPLES)
@handle_errors
@generation_options(max_new_tokens=UNTIL_CONTEXT_END)
@model_options
def serve(
    *,
    opts: ModelOptions,
    config: GenerationConfig,
    host: Annotated[str, typer.Option("--host", help="Address to listen on (loopback unless given; another one warns without --api-key).")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="Port to listen on (0: a free one, printed).")] = 8000,
    api_key: Annotated[Optional[str], typer.Option("--api-key", envvar="VIASD_API_KEY", help="Require 'Authorization: Bearer KEY' on /v1/* (also from VIASD_API_KEY).")] = None,
    served_model_name: Annotated[Optional[str], typer.Option("--served-model-name", help="The model id clients use (default: the model's id).")] = None,
    max_queue: Annotated[int, typer.Option("--max-queue", help="Requests that may wait beside the running ones (one a slot); more get 503 with Retry-After.")] = 16,
    slots: Annotated[Optional[int], typer.Option("--slots", help="KV slots: conversations whose caches the server keeps, and requests that take turns on the engine (default: 4, fewer where they would take more than half the free memory).")] = None,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds a request may take from arrival (queueing included) to its last token.")] = 300.0,
    fidelity: Annotated[bool, typer.Option("--fidelity/--no-fidelity", help="viasd requests: report fidelity, from one full uncached target forward over prompt and answer per request (off: no such cost, fidelity null).")] = False,
    cors: Annotated[Optional[list[str]], typer.Option("--cors", help="Allow browser pages from this origin (repeatable; '*': any) to call the API: CORS headers and preflight answers. Off by default.")] = None,
    access_log: Annotated[bool, typer.Option("--access-log/--no-access-log", help="One line per request on stderr: method, path, status, new tokens, seconds.")] = True,
):
    """Serve the model over OpenAI's HTTP API (chat and completions, streamed or not), with
    /health and Prometheus /metrics; several conversations cached (--slots), their requests taking
    turns on the engine step by step, the rest queued."""
    if not 0 <= port <= 65535:
        raise UsageError(f"--port must be in [0, 65535], got {port}")
    if max_queue < 0:
        raise UsageError(f"--max-queue must be >= 0, got {max_queue}")
    if slots is not None and slots < 1:
        raise UsageError(f"--slots must be >= 1, got {slots}")
    if not timeout > 0:
        raise UsageError(f"--timeout must be > 0 seconds, got {timeout}")
    origins = tuple(_check_origin(o) for o in cors or ())
    try:
        from viasd_core.frontends.serve_app import ServeSettings
        from viasd_core.frontends.serve_server import serve as run
    except ModuleNotFoundError as e:
        raise UsageError(f"viasd serve needs '{e.name}': install the serve extra (pip install 'viasd[serve]')")
    log = StderrLog()
    session, config = open_session(opts, config, progress=log, long_lived=True)
    settings = ServeSettings(api_key=api_key or None, max_queue=max_queue, slots=slots, timeout=timeout, fidelity=fidelity,
                             cors=origins, access_log=access_log)
    run(session, config, settings, host, port, name=served_model_name, progress=log, out=typer.echo)
