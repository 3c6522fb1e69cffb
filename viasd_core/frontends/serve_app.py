"""The HTTP API (a Starlette app): OpenAI's endpoints over one EngineWorker, plus health and metrics.

  GET  /v1/models              the served model (and its modes and drafts, under `viasd`)
  POST /v1/chat/completions    chat template applied; `stream: true` answers server-sent events
  POST /v1/completions         raw text or token ids, no template
  GET  /health                 200 while serving, 503 while shutting down (no key needed)
  GET  /metrics                Prometheus text (no key needed)

A request is parsed and checked (serve_schema) before it queues; a streamed answer starts (its
status and headers go out) only once the worker has taken the job and its prompt fits, so every
refusal has its own status. A client that goes away, waiting or streaming, cancels its job.
Every error is OpenAI's error object (serve_errors); nothing raised here reaches the server's
log as a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import logging
import time
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from viasd_core.frontends.serve_errors import ApiError, internal, unauthorized
from viasd_core.frontends.serve_metrics import ServeMetrics
from viasd_core.frontends.serve_responses import DONE, EXTENSION, Reply, sse
from viasd_core.frontends.serve_schema import ServedModel, parse_chat, parse_completion, parse_json, request_seed
from viasd_core.frontends.serve_worker import EngineWorker, Job
from viasd_core.session import Session

log = logging.getLogger("viasd.serve")
access = logging.getLogger("viasd.serve.access")
CLIENT_CLOSED = 499  # the status counted for a request whose client went away before its answer


@dataclass
class ServeSettings:
    api_key: str | None = None  # required as a Bearer token on /v1/* when set
    max_queue: int = 16  # requests waiting beside the running ones; more get 503
    slots: int | None = 1  # KV slots, each a conversation's cache; requests beside each other; None: by memory (serve_slots)
    timeout: float = 300.0  # seconds from arrival to the last token, per request
    max_body: int = 8 * 2**20  # bytes of a request body
    fidelity: bool = False  # viasd requests: measure fidelity (a full uncached target forward each)
    cors: tuple[str, ...] = ()  # origins browser pages may call from ('*': any); none: no CORS headers
    access_log: bool = True  # one line per request on the log (stderr under `viasd serve`)


def _error(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers())


async def _read_body(request: Request, limit: int) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"the request body is larger than {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


class AccessLog:
    """One log line per HTTP request once its response is sent (or the client left):
    `POST /v1/chat/completions 200 42 tokens 1.234 s` (new tokens of its generation, if any)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        began, status = time.monotonic(), [CLIENT_CLOSED]

        async def send_noting_status(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_noting_status)
        finally:
            job = scope.get("state", {}).get("job")
            access.info("%s %s %d %d tokens %.3f s", scope["method"], scope["path"], status[0],
                        job.tokens if job is not None else 0, time.monotonic() - began)


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone away (the body is already read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def create_app(session: Session, served: ServedModel, settings: ServeSettings) -> Starlette:
    metrics = ServeMetrics(served.name)
    worker = EngineWorker(session, metrics, served.draft, settings.max_queue, fidelity=settings.fidelity,
                          slots=settings.slots)
    started = int(time.time())
    numbers = itertools.count()  # the requests accepted so far: a server --seed's per-request offset
    key = settings.api_key.encode() if settings.api_key else None

    def authorize(request: Request) -> None:
        if key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key):
            raise unauthorized()

    def answer(endpoint: str, response: Response) -> Response:
        metrics.answered(endpoint, response.status_code)
        return response

    async def next_or_gone(job: Job, gone: asyncio.Task):
        """The job's next event, or None (and the job cancelled) when the client goes away first."""
        event = asyncio.ensure_future(worker.next_event(job))
        await asyncio.wait({event, gone}, return_when=asyncio.FIRST_COMPLETED)
        if event.done():
            return event.result()
        event.cancel()
        worker.cancel(job, "abort")
        return None

    async def stream(job: Job, reply: Reply):
        finished = False
        try:
            first = reply.first_chunk()
            if first:
                yield first
            while True:
                kind, payload = await worker.next_event(job)
                if kind == "text":
                    chunk = reply.text_chunk(payload)
                    if chunk is not None:
                        yield chunk
                elif kind == "done":
                    for chunk in reply.last_chunks(payload, job.request.draft, job.request.include_usage):
                        yield chunk
                    finished = True
                    return
                elif kind == "error":  # the status is sent already: the error travels as an event
                    yield sse(payload.body())
                    yield DONE
                    finished = True
                    return
        except Exception as e:  # a bug: the stream still ends whole
            log.error("stream failed: %s: %s", type(e).__name__, e)
            yield sse(internal(e).body())
            yield DONE
        finally:
            if not finished:  # the client went away (or the server is stopping)
                worker.cancel(job, "abort")

    async def generate(request: Request, kind: str) -> Response:
        endpoint = request.url.path
        try:
            authorize(request)
            body = parse_json(await _read_body(request, settings.max_body))
            req = (parse_chat if kind == "chat" else parse_completion)(body, served)
            req.config.seed = request_seed(req.config.seed, served.config.seed, next(numbers))
            job = worker.submit(req, settings.timeout)
            request.state.job = job  # for the access log's token count
        except ApiError as e:
            return answer(endpoint, _error(e))
        except ClientDisconnect:
            return answer(endpoint, Response(status_code=CLIENT_CLOSED))
        except Exception as e:  # a bug: a 500 and one line in the log
            log.error("request failed: %s: %s", type(e).__name__, e)
            return answer(endpoint, _error(internal(e)))
        reply = Reply(kind, req.model, req.config.seed, req.tools)
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            while True:
                event = await next_or_gone(job, gone)
                if event is None:
                    return answer(endpoint, Response(status_code=CLIENT_CLOSED))
                kind_, payload = event
                if kind_ == "error":
                    return answer(endpoint, _error(payload))
                if kind_ == "started" and req.stream:
                    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
                    return answer(endpoint, StreamingResponse(stream(job, reply), media_type="text/event-stream",
                                                              headers=headers))
                if kind_ == "done":
                    return answer(endpoint, JSONResponse(reply.whole(payload, req.draft)))
        except Exception as e:  # a bug: the job stops, the client gets a 500, the log one line
            worker.cancel(job, "abort")
            log.error("request failed: %s: %s", type(e).__name__, e)
            return answer(endpoint, _error(internal(e)))
        finally:
            gone.cancel()

    async def chat(request: Request) -> Response:
        return await generate(request, "chat")

    async def completions(request: Request) -> Response:
        return await generate(request, "completion")

    def model_card() -> dict:
        return {"id": served.name, "object": "model", "created": started, "owned_by": "viasd",
                EXTENSION: {"model_id": session.target.model_id, "draft": served.draft, "drafts": list(served.drafts),
                            "mode": served.config.mode, "modes": list(served.modes),
                            "context_len": session.engine.context_len,
                            "max_tokens": min(served.config.max_new_tokens, session.engine.context_len)}}

    async def models(request: Request) -> Response:
        try:
            authorize(request)
        except ApiError as e:
            return answer("/v1/models", _error(e))
        name = request.path_params.get("name")
        if name is None:
            return answer("/v1/models", JSONResponse({"object": "list", "data": [model_card()]}))
        if name != served.name and name not in served.aliases:
            return answer("/v1/models", _error(ApiError(404, f"model '{name}' is not served here", param="model",
                                                        code="model_not_found")))
        return answer("/v1/models", JSONResponse(model_card()))

    async def health(request: Request) -> Response:
        closing = worker.closing
        return JSONResponse({"status": "shutting down" if closing else "ok", "model": served.name},
                            status_code=503 if closing else 200)

    async def metrics_text(request: Request) -> Response:
        return Response(metrics.render(), media_type=metrics.content_type)

    async def http_error(request: Request, exc: HTTPException) -> Response:
        message = {404: f"no route {request.url.path}: see GET /v1/models, POST /v1/chat/completions, POST /v1/completions",
                   405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, str(exc.detail))
        return JSONResponse(ApiError(exc.status_code, message).body(), status_code=exc.status_code)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        worker.start()
        try:
            yield
        finally:
            await asyncio.to_thread(worker.stop)

    routes = [
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{name:path}", models, methods=["GET"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics_text, methods=["GET"]),
    ]
    middleware = [Middleware(AccessLog)] if settings.access_log else []
    if settings.cors:  # preflight (OPTIONS) answered here, before routes and the API key
        middleware.append(Middleware(CORSMiddleware, allow_origins=list(settings.cors), allow_methods=["GET", "POST"],
                                     allow_headers=["*"], max_age=600))
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: http_error},
                    middleware=middleware)
    app.state.worker = worker
    app.state.metrics = metrics
    app.state.served = served
    return app
