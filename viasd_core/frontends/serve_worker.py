"""One engine, several conversations: a worker thread fed by a queue, taking turns between requests.

The HTTP side (asyncio) submits a Job and reads its events; the worker thread runs the Job on
the engine and posts the events back into the job's event loop:

  ("started", prompt_tokens)  the prompt is tokenized and fits: the answer will come
  ("text", piece)             streamed requests: text that no later token can change
  ("done", Generation)        the generation ended by itself (eos, length, stop)
  ("error", ApiError)         it did not: bad prompt, time limit, shutdown, internal error

Slots and turns. The engine's caches form a bounded set of KV slots (serve_slots.SlotPool). Every
job taken from the queue is a candidate for each engine step (Engine.steps), in the order of
serve_turns.turn_order (stopped, then the earliest deadline: arrival plus the budget left): the
first that can get a slot takes the step, its slot swapped in. A job starts on the free slot whose
cache it may keep most of; when every slot is held, the holder that comes last in that order is
parked (its used state copied out, serve_parking.py) while the parked bytes stay within the
pool's limit, and its slot goes to the job whose turn it is; a parked job goes back into a free
slot when its turn comes. So a short request is not stuck behind long ones, none waits without bound, and
each answer is the one the engine gives alone. A slot re-uses its KV cache only where a fresh
server computes alike (serve_cache.PrefixReuse, which follows its job when parked): an answer
never depends on what the earlier requests were, nor on which ran beside it.

A job ends early when its `reason` is set, polled after every engine step (Engine.steps'
should_stop): 'abort' (the client went away), 'timeout' (its deadline passed; the deadline
counts from arrival, queueing included) or 'shutdown'. A job still waiting is simply skipped.
Everything tokenizer- and engine-side runs on the worker thread only.
"""

from __future__ import annotations

import asyncio
import logging
import math
import queue
import threading
import time
from dataclasses import dataclass, field

from viasd_core.speculation.drafters import NgramDrafter
from viasd_core.speculation.engine import Generation
from viasd_core.speculation.fidelity import fidelity
from viasd_core.errors import ViasdError
from viasd_core.frontends.serve_errors import ApiError, bad_request, internal, queue_full, shutting_down, timed_out
from viasd_core.frontends.serve_metrics import ServeMetrics
from viasd_core.frontends.serve_schema import GenRequest
from viasd_core.frontends.serve_parking import Parked
from viasd_core.frontends.serve_prompts import prompt_ids
from viasd_core.frontends.serve_slots import Slot, SlotPool
from viasd_core.frontends.serve_text import StopAwareText
from viasd_core.frontends.serve_turns import turn_order
from viasd_core.session import Session

log = logging.getLogger("viasd.serve")


@dataclass(eq=False)
class Job:
    request: GenRequest
    limit: float  # seconds from arrival
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrived: float = field(default_factory=time.monotonic)
    state: str = "waiting"  # waiting -> running (started: on a slot or parked) -> done (or waiting -> done when skipped)
    reason: str | None = None  # why it is stopped early: abort, timeout, shutdown
    tokens: int = 0  # new tokens so far
    ids: list[int] | None = None  # the prompt's tokens, once tokenized (on the worker thread)
    slot: Slot | None = None  # held while it runs, None while parked
    parked: Parked | None = None  # its slot state while parked
    steps: object = None  # its generator of engine steps (EngineWorker._steps)
    started: float = 0.0  # when it first got a slot
    budget: int = 0  # most new tokens: max_tokens cut to what the context leaves (serve_turns)
    binds: bool = False  # whether max_tokens sets that budget (not the context's end)
    service: float = 0.0  # seconds on the engine so far
    born: int = 0  # the engine step the engine took it at (serve_turns' deadlines)
    seq: int = 0  # the order the engine took jobs in
    parks: int = 0  # times it was parked

    @property
    def deadline(self) -> float:
        return self.arrived + self.limit


class EngineWorker:
    def __init__(self, session: Session, metrics: ServeMetrics, served_draft: str, max_queue: int,
                 fidelity: bool = False, slots: int | None = 1):
        self.session = session
        self.engine = session.engine
        self.metrics = metrics
        self.max_queue = max_queue  # jobs waiting beside the running ones
        self.fidelity = fidelity  # viasd answers: one full target forward over prompt + answer each
        drafter = self.engine.drafter
        self.drafters = {"none": None, "ngram": drafter if served_draft == "ngram" else NgramDrafter(), served_draft: drafter}
        self._attached = {id(drafter)}  # drafters the engine has sized and compiled (Engine.drafter's setter)
        self.pool = SlotPool(self.engine, list(self.drafters.values()), slots)  # slots=None: by memory
        self.pool.live.drafter = served_draft
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._live: set[Job] = set()  # waiting or running
        self._waiting = 0  # queued, and parked (vLLM counts a preempted request as waiting)
        self._closing = False
        self._service_s = 1.0  # moving average of a job's time on the engine (for Retry-After)
        self.jobs_run = 0
        self.parks = 0  # jobs parked so far
        self._taken = 0  # jobs the engine has taken (their seq)
        self.steps_run = 0  # engine steps run (the jobs' `born`)
        self._thread: threading.Thread | None = None
        self._in_caller = False  # run_here(): the caller's thread runs the jobs, start() spawns nothing

    # ------------------------------------------------------------------ HTTP side
    def start(self) -> None:
        if not self._in_caller:
            self._thread = threading.Thread(target=self._run, name="viasd-engine", daemon=True)
            self._thread.start()

    def will_run_here(self) -> None:
        """The engine will run in the thread that calls run_here() (the process's main thread):
        PyTorch's CPU kernels measured about half as fast from a second thread on this project's
        CPU (an SmolLM2 sd generation: 57 vs 27-32 tok/s), so `viasd serve` keeps the engine in
        the main thread and the HTTP server in another."""
        self._in_caller = True

    def run_here(self) -> None:
        """Run jobs in the calling thread until stop()."""
        self._run()

    def submit(self, request: GenRequest, limit: float) -> Job:
        """Queue a job (call from the event loop); 503 when the queue is full or the server closes."""
        job = Job(request, limit, asyncio.get_running_loop())
        with self._lock:
            if self._closing:
                raise shutting_down()
            if len(self._live) >= self.max_queue + self.pool.count:  # max_queue waiting beside the slots' jobs
                raise queue_full(max(1, math.ceil(self._service_s * len(self._live) / self.pool.count)))
            self._waiting += 1
            self._live.add(job)
            self.metrics.set_waiting(self._waiting)
        self._queue.put(job)
        return job

    def cancel(self, job: Job, reason: str) -> None:
        """Stop `job`: skipped if still waiting, ended after the engine's current step if running."""
        with self._lock:
            if job.reason is None and job.state != "done":
                job.reason = reason
            if job.state == "waiting":
                self._finish_waiting(job)

    def _finish_waiting(self, job: Job) -> None:
        job.state = "done"
        self._waiting -= 1
        self._live.discard(job)
        self.metrics.set_waiting(self._waiting)

    async def next_event(self, job: Job) -> tuple[str, object]:
        """The job's next event; a job still waiting at its deadline is dropped with a 504."""
        while True:
            if job.state != "waiting":
                return await job.events.get()
            try:
                return await asyncio.wait_for(job.events.get(), timeout=max(job.deadline - time.monotonic(), 0.0))
            except asyncio.TimeoutError:
                with self._lock:
                    expired = job.state == "waiting"
                    if expired:
                        job.reason = "timeout"
                        self._finish_waiting(job)
                if expired:
                    return "error", timed_out(job.limit, 0)
                # it started meanwhile: its own deadline ends it within a step

    def shutdown(self) -> None:
        """Refuse new jobs and stop every live one (safe from a signal handler: flags only)."""
        with self._lock:
            self._closing = True
            for job in list(self._live):
                if job.reason is None:
                    job.reason = "shutdown"
                if job.state == "waiting":
                    self._finish_waiting(job)

    def stop(self, timeout: float = 30.0) -> None:
        """Shut down and wait for the worker thread to end (the running job ends within a step)."""
        self.shutdown()
        self._queue.put(None)  # ends the job loop, in its thread or in run_here's caller
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def closing(self) -> bool:
        return self._closing

    @property
    def busy(self) -> bool:
        """A job is waiting or running."""
        return bool(self._live)

    @property
    def waiting(self) -> int:
        return self._waiting

    # ------------------------------------------------------------------ worker thread
    def _post(self, job: Job, kind: str, payload) -> None:
        try:
            job.loop.call_soon_threadsafe(job.events.put_nowait, (kind, payload))
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def _run(self) -> None:
        live: list[Job] = []  # taken from the queue: waiting for a first slot, running, or parked
        ending = False
        while True:
            while not ending:  # take what has arrived; wait only when there is nothing to run
                try:
                    job = self._queue.get(block=not live)
                except queue.Empty:
                    break
                if job is None:
                    ending = True
                else:
                    self._take(job, live)
            job = self._next(live)
            if job is not None:
                if not self._step(job):
                    live.remove(job)
            elif ending and not live:
                break

    def _take(self, job: Job, live: list[Job]) -> None:
        """A job from the queue becomes a candidate for turns (a prompt that is refused ends here)."""
        if job.state == "done":  # cancelled while queued
            self._post(job, "error", self._stopped_error(job))
            return
        try:
            job.ids = prompt_ids(self.session.tokenizer, job.request, self.engine.context_len)
        except ApiError as e:
            self._end_waiting(job, ("error", e))
            return
        room = self.engine.context_len - len(job.ids)
        job.budget, job.binds = min(job.request.config.max_new_tokens, room), job.request.config.max_new_tokens < room
        job.seq, self._taken, job.born = self._taken, self._taken + 1, self.steps_run
        live.append(job)

    def _next(self, live: list[Job]) -> Job | None:
        """The job that takes the next engine step, on its slot (serve_turns.turn_order; jobs that
        were cancelled before they started leave here)."""
        now = time.monotonic()
        for job in list(live):
            if job.state == "done":  # cancelled or timed out before it started: nothing ran
                live.remove(job)
                self._post(job, "error", self._stopped_error(job))
            elif job.state == "running" and job.reason is None and now >= job.deadline:
                job.reason = "timeout"  # parked or not: its last step ends it
        order = turn_order(live)
        for i, job in enumerate(order):
            if self._place(job, order[i + 1:]):
                return job
        return None

    def _place(self, job: Job, after: list[Job]) -> bool:
        """Give `job` a slot if it has none: a free one, else that of the last job in `after` (the
        jobs whose turn comes later) holding one whose parking fits the pool's limit. False: none."""
        if job.slot is not None:
            return True
        slot = self.pool.choose(job.ids) if job.parked is None else self.pool.spare()
        if slot is None:
            freed = job.parked.nbytes if job.parked is not None else 0
            victim = next((v for v in reversed(after) if v.slot is not None and self.pool.can_park(v.slot, freed)), None)
            if victim is None:
                return False
            slot, victim.slot = victim.slot, None
            victim.parked = self.pool.park(slot)
            victim.parks += 1
            self.parks += 1
            self._count(waiting=+1)
        if job.parked is None:  # its first slot
            with self._lock:
                if job.state != "waiting":  # cancelled meanwhile: _next drops it
                    return False
                job.state = "running"
            job.started = time.monotonic()
            job.steps = self._steps(job)
        else:
            self.pool.restore(job.parked, slot)
            job.parked = None
        self.pool.hold(slot, job)
        job.slot = slot
        self._count(waiting=-1)
        return True

    def _count(self, waiting: int) -> None:
        """Move the gauges: `waiting` more queued or parked jobs; running: the jobs holding a slot."""
        with self._lock:
            self._waiting += waiting
            self.metrics.set_waiting(self._waiting)
        self.metrics.set_running(self.pool.held())

    def _end_waiting(self, job: Job, last: tuple[str, object]) -> None:
        with self._lock:
            if job.state == "waiting":
                self._finish_waiting(job)
        self._post(job, *last)

    def _step(self, job: Job) -> bool:
        """Run one engine step of `job` on its slot; False once it has ended (its answer posted)."""
        self.pool.activate(job.slot)
        self._attach(job.request.draft)
        t0 = time.perf_counter()
        try:
            next(job.steps)
            return True
        except StopIteration as done:
            last = done.value
        except Exception as e:  # a bug: one line in the log, a clean slot for the next request
            log.error("generation failed: %s: %s", type(e).__name__, e, exc_info=log.isEnabledFor(logging.DEBUG))
            self.engine.reset()
            job.slot.reuse.forget()
            job.slot.drafter = None
            last = "error", internal(e)
        finally:
            job.service += time.perf_counter() - t0
            self.steps_run += 1
        self.pool.release(job.slot)
        with self._lock:  # the job leaves before its answer goes out: the client's next request fits
            job.state = "done"
            self._live.discard(job)
        self._count(waiting=0)
        self._service_s = 0.8 * self._service_s + 0.2 * (time.monotonic() - job.started)
        self.jobs_run += 1
        self._post(job, *last)
        return False

    def _stopped_error(self, job: Job) -> ApiError:
        if job.reason == "timeout":
            return timed_out(job.limit, job.tokens)
        if job.reason == "shutdown":
            return shutting_down()
        return ApiError(499, "the client closed the request", code="client_closed")  # nobody reads it

    def _attach(self, name: str) -> None:
        """Attach a request's drafter to the engine: through Engine.drafter's setter the first time
        (it sizes, links and compiles it), by reference afterwards (the setter would warm a
        compiled drafter up again, running passes on the live slot's caches)."""
        wanted = self.drafters[name]
        if self.engine.drafter is wanted:
            return
        if wanted is None or id(wanted) in self._attached:
            self.engine._drafter = wanted
        else:
            self.engine.drafter = wanted
            self._attached.add(id(wanted))

    def _steps(self, job: Job):
        """The job's engine steps (a generator: it pauses after each), posting 'started' and text;
        returns its last event. Runs with its slot live and its drafter attached."""
        request, config, slot = job.request, job.request.config, job.slot  # its first slot (parking may move it)
        emitted: list[tuple[float, int]] = []  # (time, new tokens) of each step that emitted some
        stream = StopAwareText(self.session.tokenizer, config.stop) if request.stream else None

        def on_emit(tokens, tiers):
            job.tokens += len(tokens)
            if tokens:
                emitted.append((time.monotonic(), len(tokens)))
            if stream is not None:
                piece = stream.feed(tokens, tiers)
                if piece:
                    self._post(job, "text", piece)

        def should_stop() -> bool:
            if job.reason is None and time.monotonic() >= job.deadline:
                job.reason = "timeout"
            return job.reason is not None

        ids, started = job.ids, job.started
        self._post(job, "started", len(ids))
        if slot.drafter != request.draft:  # the drafter's state here followed other tokens: start it afresh
            if self.engine.drafter is not None:
                self.engine.drafter.reset()
            slot.drafter = request.draft
        try:
            slot.reuse.before(ids)
            try:
                gen: Generation = yield from self.engine.steps(ids, config, on_emit=on_emit, should_stop=should_stop)
            finally:
                if job.slot is not None:  # None: the generator was dropped while parked
                    job.slot.reuse.after(ids)
        except ApiError as e:
            return "error", e
        except ViasdError as e:  # the engine's own checks
            return "error", bad_request(e.message)
        done = time.monotonic()
        stopped = gen.finish_reason == "cancelled"
        if config.mode == "viasd" and self.fidelity and not stopped:
            gen.stats.fidelity = fidelity(self.session.target.model, ids, gen.tokens)
        reason = job.reason if stopped else ("stop" if gen.finish_reason in ("eos", "stop") else gen.finish_reason)
        self.metrics.generation(gen.stats, reason, started - job.arrived, done - started,
                                emitted[0][0] - job.arrived if emitted else None, done - job.arrived, emitted)
        if stopped:
            return "error", self._stopped_error(job)
        if stream is not None:
            rest = stream.finish(gen.text)
            if rest:
                self._post(job, "text", rest)
        return "done", gen
