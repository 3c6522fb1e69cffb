"""Parking a running request (serve_slots.SlotPool.park / restore, serve_parking.py): its slot's used
state copied out, another conversation run on that slot, the state copied back into a slot (a new
one, or one another conversation used): it then emits exactly the tokens it emits undisturbed, and
its caches hold the same bits. The memory bound, and the server parking a long request for a short
one on a single slot (and not when parking is out of memory)."""

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from conftest import tiny_model
from support.head_cases import engine_with_head, make_head, prompt_for
from support.serve_support import raw, running, session, slow_target, timed_calls  # noqa: F401 (fixture)
from viasd_core.speculation.drafters import NgramDrafter
from viasd_core.speculation.engine import GenerationConfig
from viasd_core.frontends.serve_slots import SlotPool


def config(mode: str, n: int = 24) -> GenerationConfig:
    return GenerationConfig(mode=mode, max_new_tokens=n, gamma=4, adaptive=False)


def cached(pool: SlotPool) -> dict:
    """Every model's valid cached positions (K/V, and captured features where there are some)."""
    out = {}
    for m in pool.models:
        out[m.name, "kv"] = [t[:, :, : m.seen].clone() for c in m.cache.layers for t in (c.k, c.v)]
        if m.cache.features is not None:
            out[m.name, "features"] = m.cache.features[: m.seen].clone()
    return out


def same_bits(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        all(torch.equal(x, y) for x, y in zip(a[k], b[k])) if isinstance(a[k], list) else torch.equal(a[k], b[k])
        for k in a)


def parked_run(engine, drafters, prompt, other, cfg, park_after: int, into: str):
    """`prompt`'s tokens and final caches when parked after `park_after` steps while `other` runs
    on its slot, then restored into a new slot ('new') or back into the slot `other` used ('used')."""
    engine.reset()
    pool = SlotPool(engine, drafters, 2 if into == "new" else 1)
    first = pool.live
    pool.hold(first, "a")
    steps = engine.steps(prompt, cfg)
    for _ in range(park_after):
        next(steps)
    parked = pool.park(first)
    assert first.holder is None and pool.parked_bytes == parked.nbytes > 0
    assert parked.nbytes < pool.slot_bytes()  # the used positions only, not the whole context
    pool.hold(first, "b")
    pool.activate(first)
    other_tokens = engine.generate(other, cfg).tokens  # overwrites the positions `prompt` used
    pool.release(first)
    target = pool.spare()
    assert (target is first) == (into == "used")
    pool.restore(parked, target)
    assert pool.live is target and pool.parked_bytes == 0
    pool.hold(target, "a")
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value.tokens, cached(pool), other_tokens


def undisturbed(engine, drafters, prompt, cfg):
    engine.reset()
    pool = SlotPool(engine, drafters, 1)
    return engine.generate(prompt, cfg).tokens, cached(pool)


@pytest.mark.parametrize("mode, draft", [("ar", "model"), ("sd", "model"), ("sd", "ngram")])
@pytest.mark.parametrize("into", ["new", "used"])
def test_a_parked_request_resumes_exactly(session, mode, draft, into):  # noqa: F811
    engine = session.engine
    model_drafter, ngram = engine.drafter, NgramDrafter()
    engine._drafter = model_drafter if draft == "model" else ngram  # as the server attaches a request's draft
    eos, engine.eos = engine.eos, set()  # answers of the whole length: several verify passes after the restore
    try:
        drafters = [model_drafter, ngram]
        prompt, other = prompt_for(1, 20), prompt_for(2, 40)
        cfg = config(mode)
        want, want_caches = undisturbed(engine, drafters, prompt, cfg)
        want_other = undisturbed(engine, drafters, other, cfg)[0]
        got, got_caches, got_other = parked_run(engine, drafters, prompt, other, cfg, 3, into)
    finally:
        engine._drafter, engine.eos = model_drafter, eos
        engine.reset()
    assert got == want and len(got) == 24
    assert got_other == want_other
    assert same_bits(got_caches, want_caches)


@pytest.mark.parametrize("into", ["new", "used"])
def test_a_parked_request_with_an_eagle_head_and_prompt_lookup_resumes_exactly(into):
    """The head's cache, the target's captured features, the feature drafter's last feature and the
    lookup's index all go out and come back."""
    target = tiny_model("llama", seed=5)
    engine = engine_with_head(target, make_head(target, seed=6, full=True), hybrid=True)
    drafters = [engine.drafter]
    engine.eos = set()  # answers of the whole length
    prompt, other = prompt_for(3, 16), prompt_for(4, 30)
    cfg = config("sd", 32)
    want, want_caches = undisturbed(engine, drafters, prompt, cfg)
    assert ("target", "features") in want_caches
    want_other = undisturbed(engine, drafters, other, cfg)[0]
    got, got_caches, got_other = parked_run(engine, drafters, prompt, other, cfg, 2, into)
    assert got == want and got_other == want_other
    assert same_bits(got_caches, want_caches)


def test_parking_keeps_within_its_memory_limit(session):  # noqa: F811
    engine = session.engine
    engine.reset()
    pool = SlotPool(engine, [engine.drafter], 1)
    assert pool.park_limit == pool.slot_bytes() and pool.parked_bytes == 0
    engine.generate(prompt_for(5, 30), config("sd", 8))
    need = pool.park_bytes(pool.live)
    # K and V of every layer at each model's valid positions, 4 bytes a value, and 8 bytes a token id
    expected = sum(m.seen * len(m.cache.layers) * 2 * m.shape.n_kv_heads * m.shape.head_dim * 4 for m in pool.models)
    assert need == expected + 8 * len(engine.tokens) and len(engine.tokens) == 38
    pool.park_limit = need - 1
    assert not pool.can_park(pool.live)
    assert pool.can_park(pool.live, freed=1)  # another parked request going back frees room
    pool.park_limit = need
    assert pool.can_park(pool.live)
    parked = pool.park(pool.live)
    assert parked.nbytes == need == pool.parked_bytes and pool.live is None
    spare = pool.spare()
    pool.restore(parked, spare)
    assert pool.parked_bytes == 0 and pool.live is spare and engine.tokens == parked.tokens
    engine.reset()


def ask(base, prompt, max_tokens, stream=False) -> str:
    """A completion's text (a stream's joined from its events)."""
    status, _, body = raw(base, "POST", "/v1/completions", {"model": "target", "prompt": prompt, "max_tokens": max_tokens,
                                                            "mode": "ar", "stream": stream})
    assert status == 200, body
    if not stream:
        return body["choices"][0]["text"]
    events = [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: {")]
    return "".join(e["choices"][0]["text"] for e in events if e["choices"])


def alone(session, prompt, n):  # noqa: F811
    session.engine.reset()
    return session.engine.generate(prompt, config("ar", n)).text


@pytest.mark.parametrize("limit", [None, 0])
def test_one_slot_a_short_request_parks_the_long_one_unless_parking_is_out_of_memory(session, viasd_home, limit):  # noqa: F811
    long_prompt, short_prompt = prompt_for(6, 40), prompt_for(7, 12)
    want_long, want_short = alone(session, long_prompt, 48), alone(session, short_prompt, 4)
    undo = slow_target(session, 0.02)  # ar: one target pass a token, so the long one takes about 1 s
    try:
        with running(session, config("sd", 8), slots=1) as (base, server):
            worker = server.worker
            if limit is not None:
                worker.pool.park_limit = limit
            events = []
            take, step = worker._take, worker._step
            worker._take = lambda job, live: (take(job, live), events.append(("take", job.budget)))[0]
            worker._step = lambda job: (events.append(("step", job.budget)), step(job))[1]
            gauges, metrics = [], worker.metrics
            for name in ("running", "waiting"):
                setter = getattr(metrics, f"set_{name}")
                setattr(metrics, f"set_{name}", lambda n, name=name, setter=setter: (gauges.append((name, n)), setter(n)))
            timed, finished = timed_calls(lambda *args, **kwargs: ask(base, *args, **kwargs))

            pool = ThreadPoolExecutor(2)
            long = pool.submit(timed, "long", long_prompt, 48, stream=True)
            t0 = time.monotonic()
            while sum(e == ("step", 48) for e in events) < 5:  # a few of the long one's steps ran
                assert time.monotonic() - t0 < 20
                time.sleep(0.005)
            short = pool.submit(timed, "short", short_prompt, 4)
            assert short.result(30) == want_short
            assert long.result(30) == want_long  # streamed, parked or not: the same text
            assert worker.jobs_run == 2
    finally:
        undo()
    taken, shorts = events.index(("take", 4)), events.count(("step", 4))
    assert shorts >= 2  # ar: a step a token (its last step ends it)
    held = [n for name, n in gauges if name == "running"]
    assert max(held) == 1 and held[-1] == 0  # the gauge counts slot holders: a parked request holds none
    assert [n for name, n in gauges if name == "waiting"][-1] == 0
    if limit is None:  # the short one took every step from its arrival to its end: the long one was parked
        assert worker.parks == 1
        assert ("waiting", 2) in gauges  # the parked one waits again (as vLLM counts a preempted request)
        assert events[taken + 1 : taken + 1 + shorts] == [("step", 4)] * shorts
        assert finished["short"] < finished["long"]
    else:  # nothing may be parked: the short one waits for the slot
        assert worker.parks == 0
        assert ("step", 48) in events[taken + 1 :] and events[-1] == ("step", 4)
        assert finished["short"] > finished["long"]
