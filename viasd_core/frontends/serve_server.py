"""From a loaded Session to a listening server, and a clean stop on Ctrl-C.

`prepare` decides what the server offers: besides the modes its --mode needed at load time, the
pair's calibration profile (when one is saved, or given with --profile) is loaded too, so that
exact and viasd requests can run. `serve` binds the socket itself (port 0 picks a free port, and
the printed address is the real one), then runs uvicorn until SIGINT/SIGTERM.

Stopping: the first Ctrl-C stops admission (new requests get 503), ends the running generation
after its current step and answers every queued one with 503, so each response is complete (a
stream ends with an error event and `data: [DONE]`); uvicorn then closes the connections and the
process exits 0. A second Ctrl-C forces the exit.
"""

from __future__ import annotations

import ipaddress
import logging
import signal
import socket
import threading
import sys

import uvicorn

from viasd_core.speculation.engine import GenerationConfig
from viasd_core.errors import ViasdError
from viasd_core.frontends.serve_app import ServeSettings, create_app
from viasd_core.frontends.serve_schema import ServedModel
from viasd_core.frontends.serve_tools import tool_style
from viasd_core.loading.profile import profile_path
from viasd_core.session import Session, attach_profile, resolve_config
from viasd_core.loading.vocab_rows import token_rows


def prepare(session: Session, config: GenerationConfig, name: str | None = None) -> ServedModel:
    """What the server offers, with the pair's profile loaded when there is one (exact, viasd)."""
    engine, opts = session.engine, session.options
    if session.profile is None and engine.drafter is not None:
        device = engine.target.device.type
        if opts.profile or profile_path(session.target.model_id, session.draft_id, opts.quant, device).exists():
            attach_profile(session)
    config = resolve_config(session, config)  # a new config: the profile's thresholds, one attached just now too
    thresholds = config.thresholds
    aliases = frozenset({session.target.model_id, session.target.ref, opts.model} - {None})
    return ServedModel(name=name or session.target.model_id, aliases=aliases, config=config, draft=session.draft_id,
                       calibrated=engine.slim is not None and thresholds is not None, thresholds=thresholds,
                       vocab_size=token_rows(session.target.model), tool_style=tool_style(session.tokenizer))


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def listen(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (port 0: a free one)."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        return socket.create_server((host, port), family=family, backlog=128)
    except (OSError, OverflowError) as e:
        raise ViasdError(f"cannot listen on {host}:{port}: {getattr(e, 'strerror', None) or e}")


def address(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


class Server(uvicorn.Server):
    """uvicorn's server, whose first Ctrl-C also stops the engine's jobs (else a long stream
    would hold the shutdown until it ends)."""

    def __init__(self, config: uvicorn.Config, on_stopped=None):
        super().__init__(config)
        self.on_stopped = on_stopped

    @property
    def worker(self):
        return self.config.app.state.worker

    def handle_exit(self, sig, frame) -> None:
        self.worker.shutdown()
        super().handle_exit(sig, frame)

    def stop(self) -> None:
        """What a Ctrl-C does, for a server run in a thread (tests)."""
        self.worker.shutdown()
        self.should_exit = True

    async def shutdown(self, sockets=None) -> None:
        await super().shutdown(sockets)
        if self.on_stopped is not None:
            self.on_stopped(self.worker.jobs_run)


def make_server(session: Session, served: ServedModel, settings: ServeSettings, on_stopped=None) -> Server:
    app = create_app(session, served, settings)
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on", timeout_graceful_shutdown=30)
    return Server(config, on_stopped)


def _setup_log() -> None:
    log = logging.getLogger("viasd.serve")
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("viasd serve: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


def serve(session: Session, config: GenerationConfig, settings: ServeSettings, host: str, port: int,
          name: str | None = None, progress=print, out=print) -> None:
    """Serve until Ctrl-C: the address on `out` (stdout), everything else on `progress`."""
    _setup_log()
    served = prepare(session, config, name)
    if not is_loopback(host) and not settings.api_key:
        progress(f"warning: listening on {host} without --api-key: anyone who reaches this address can use the model")
    sock = listen(host, port)
    server = make_server(session, served, settings,
                         on_stopped=lambda n: progress(f"stopped after {n} generation{'s' * (n != 1)}"))
    progress(f"model {served.name}: mode {config.mode}, draft {served.draft}, modes {', '.join(served.modes)}; "
             f"context {session.engine.context_len}, {server.worker.pool.describe()}, queue {settings.max_queue}, "
             f"timeout {settings.timeout:g} s")
    out(f"serving on {address(sock)}/v1 (Ctrl-C stops)")
    # The engine runs in this (main) thread, HTTP in another: see EngineWorker.will_run_here.
    server.worker.will_run_here()

    def run_http() -> None:
        try:
            server.run(sockets=[sock])
        finally:
            server.worker.stop()  # however HTTP ended, the job loop below ends too

    http = threading.Thread(target=run_http, name="viasd-http", daemon=True)
    previous = signal.signal(signal.SIGINT, lambda sig, frame: server.stop())  # flags only: no exception mid-step
    try:
        http.start()
        server.worker.run_here()  # until the server's shutdown stops the worker
    finally:
        server.stop()
        http.join(60)
        signal.signal(signal.SIGINT, previous)
        sock.close()
