"""`viasd serve --slots`: several conversations keep their KV caches (serve_slots.SlotPool), the
running requests take turns step by step, and every answer is the one the engine gives alone."""

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from support.serve_support import raw, running, session, slow_target, timed_calls  # noqa: F401 (fixture)
from viasd_core.speculation.engine import GenerationConfig
from viasd_core.runtime.model_pass import PREFILL_CHUNK
from viasd_core.frontends.serve_slots import SlotPool

import torch

# A fixed draft length: an adaptive one follows wall time (the answer does not, the caches' bits do).
SD = GenerationConfig(mode="sd", max_new_tokens=8, gamma=4, adaptive=False)


def words(seed: int, n: int) -> list[int]:
    """n token ids of the tiny vocabulary's words (ids 8..255), no special token."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(8, 256, (n,), generator=g).tolist()


def alone(session, prompt: list[int], max_tokens: int, mode: str = "sd") -> str:  # noqa: F811
    """The request's answer from the engine alone, from empty caches."""
    session.engine.reset()
    config = GenerationConfig(mode=mode, max_new_tokens=max_tokens, gamma=4, adaptive=False)
    return session.engine.generate(prompt, config).text


def ask(base: str, prompt: list[int], max_tokens: int = 8, mode: str = "sd", stream: bool = False):
    """(text, cached prompt tokens) of a completion; a stream's text joined from its events."""
    status, _, body = raw(base, "POST", "/v1/completions", {"model": "target", "prompt": prompt, "max_tokens": max_tokens,
                                                            "mode": mode, "stream": stream})
    assert status == 200, body
    if not stream:
        return body["choices"][0]["text"], body["usage"]["prompt_tokens_details"]["cached_tokens"]
    events = [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: {")]
    return "".join(e["choices"][0]["text"] for e in events if e["choices"]), None


def test_two_clients_taking_turns_keep_their_caches(session, viasd_home):  # noqa: F811
    a, b = words(1, 300), words(2, 300)
    turns = [a, b, a + words(3, 20), b + words(4, 20), a + words(5, 30)]
    with running(session, SD, slots=2) as (base, server):
        got = [ask(base, p) for p in turns]
        assert server.worker.pool.count == 2 and len(server.worker.pool.slots) == 2
    # Each second turn keeps its own first turn's whole prefill chunk, whatever ran in between.
    assert [cached for _, cached in got] == [0, 0, PREFILL_CHUNK, PREFILL_CHUNK, PREFILL_CHUNK]
    assert [text for text, _ in got] == [alone(session, p, 8) for p in turns]
    # One slot: the other client's request took it, so nothing of a first turn is left.
    with running(session, SD, slots=1) as (base, _):
        assert [ask(base, p)[1] for p in turns] == [0, 0, 0, 0, 0]


def test_slots_are_evicted_least_recently_used(session, viasd_home):  # noqa: F811
    a, b, c = words(11, 300), words(12, 300), words(13, 300)
    with running(session, SD, slots=2) as (base, _):
        for p in (a, b, c):  # c takes a's slot: a's was used least recently
            assert ask(base, p)[1] == 0
        assert ask(base, b + words(14, 20))[1] == PREFILL_CHUNK  # b kept its slot
        assert ask(base, a + words(15, 20))[1] == 0  # a was evicted; it takes c's slot (the LRU now)
        assert ask(base, c + words(16, 20))[1] == 0  # so c's cache is gone too; it takes b's (the LRU now)
        assert ask(base, a + words(17, 20))[1] == PREFILL_CHUNK  # a's survived c's request
        assert ask(base, b + words(18, 20))[1] == 0  # b's did not


def test_a_short_request_finishes_before_a_long_one_that_started_first(session, viasd_home):  # noqa: F811
    long_prompt, short_prompt = words(21, 40), words(22, 12)
    want_long, want_short = alone(session, long_prompt, 48, "ar"), alone(session, short_prompt, 4, "ar")
    undo = slow_target(session, 0.02)  # ar: one target pass a token, so the long one takes about 1 s
    try:
        with running(session, SD, slots=2) as (base, server):
            worker = server.worker
            timed, finished = timed_calls(lambda *args, **kwargs: ask(base, *args, **kwargs))

            pool = ThreadPoolExecutor(2)
            long = pool.submit(timed, "long", long_prompt, 48, "ar", stream=True)
            t0 = time.monotonic()
            while not (worker.busy and worker.waiting == 0 and worker.jobs_run == 0):
                assert time.monotonic() - t0 < 20
                time.sleep(0.005)
            time.sleep(0.1)  # a few of its steps have run
            short = pool.submit(timed, "short", short_prompt, 4, "ar")
            assert short.result(30)[0] == want_short
            assert long.result(30)[0] == want_long  # streamed, interleaved, and the same text
            assert finished["short"] < finished["long"]
    finally:
        undo()


def test_a_swapped_slot_holds_its_own_caches(session):  # noqa: F811
    """The pool itself: a slot put aside and taken up again finds its caches, tokens and counts as
    it left them; a new slot starts empty without touching the first one's."""
    engine = session.engine
    engine.reset()
    pool = SlotPool(engine, [engine.drafter], 2)
    first = pool.live
    engine.generate(words(31, 50), SD)
    kept = {m.name: (m.seen, [t.clone() for c in m.cache.layers for t in (c.k, c.v)]) for m in pool.models}
    tokens = list(engine.tokens)
    pool.hold(first, "job")
    second = pool.choose(words(32, 50))
    assert second is not first and pool.choose(words(32, 50)) is second  # a new slot, then that one
    pool.release(first)
    pool.hold(second, "job")
    assert pool.choose(words(33, 50)) is first  # held slots are not given out
    pool.activate(second)
    assert engine.tokens == [] and all(m.seen == 0 for m in pool.models)
    engine.generate(words(32, 60), SD)
    pool.activate(first)
    assert engine.tokens == tokens
    for m in pool.models:
        seen, caches = kept[m.name]
        assert m.seen == seen
        assert all(torch.equal(t, k) for t, k in zip([t for c in m.cache.layers for t in (c.k, c.v)], caches))
    pool.release(second)
    assert pool.slot_bytes() > 0 and pool.describe().startswith("2 KV slots of ")


@pytest.mark.parametrize("free, count", [(10**15, 4), (0, 1)])
def test_the_default_count_follows_free_memory(session, monkeypatch, free, count):  # noqa: F811
    import viasd_core.frontends.serve_slots as slots

    monkeypatch.setattr(slots, "free_memory_bytes", lambda device: free)
    assert SlotPool(session.engine, [session.engine.drafter]).count == count
