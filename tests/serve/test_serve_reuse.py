"""`viasd serve` answers never depend on the requests before them: a sequence of requests in
different modes and lengths gives, request by request, what the same request gives on a fresh
server (the same text, decoded from the same K/V cache of the prompt, bit for bit), while a growing
conversation still re-uses the previous prompt's whole prefill chunks (serve_cache.PrefixReuse)."""

import pytest
import torch

from support.serve_support import raw, running
from viasd_core.speculation.engine import GenerationConfig
from viasd_core.runtime.model_pass import PREFILL_CHUNK
from viasd_core.frontends.serve_cache import prefill_boundary
from viasd_core.loading.options import ModelOptions
from viasd_core.loading.profile import Profile, profile_path, save_profile
from viasd_core.session import build_session

M = 24  # new tokens a request: the viasd answer runs the target over blocks it did not verify


def test_prefill_boundary():
    # B is a multiple of 256 and a prefill from B runs more than 16 of the n - 1 positions
    assert [prefill_boundary(n) for n in (1, 2, 18, 256, 273, 274, 529, 530)] == [0, 0, 0, 0, 0, 256, 256, 512]


def prompt_caches(engine, n: int) -> dict:
    """Each model's cached K/V of the prompt positions it holds, [0, min(seen, n - 1)) (a copy): the
    state a request decodes from. The answer's own positions are left out: their passes' widths
    follow the adaptive draft length, which follows wall time."""
    return {m.name: [t[:, :, : min(m.seen, n - 1)].clone() for c in m.cache.layers for t in (c.k, c.v)]
            for m in engine.all_models()}


def differing(a: dict, b: dict) -> list[str]:
    """The models whose prompt caches differ in any bit over the positions both hold (a model that
    did not run, such as the slim verifier under sd, holds none on a fresh server)."""
    def differs(x, y):
        p = min(x.shape[2], y.shape[2])
        return not torch.equal(x[:, :, :p], y[:, :, :p])

    return [k for k in a if k not in b or any(differs(x, y) for x, y in zip(a[k], b[k]))]


def calibrated_session(tiny_dirs, quant: str):
    """A tiny target + draft with a saved profile, so exact and viasd run (the slim: layers 0 and 1)."""
    options = ModelOptions(model=str(tiny_dirs["target"]), draft=str(tiny_dirs["draft"]), quant=quant)
    s = build_session(options, mode="sd")
    save_profile(Profile(target_id=s.target.model_id, draft_id=s.draft_id, quant=quant, device="cpu",
                         dtype=str(s.engine.target.dtype).removeprefix("torch."), layer_ids=[0, 1], n_layers=4,
                         theta_accept=0.9, theta_slim=0.6, budget=0.05, heldout_fidelity=0.97),
                 profile_path(s.target.model_id, s.draft_id, quant, "cpu"))
    return build_session(options, mode="sd")


def words(seed: int, n: int) -> list[int]:
    """n token ids of the tiny WordLevel vocabulary's words (ids 8..255), no special token."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(8, 256, (n,), generator=g)).tolist()


@pytest.mark.parametrize("quant", ["none", "int8"])
def test_an_answer_does_not_depend_on_earlier_requests(tiny_dirs, viasd_home, quant):
    warm, fresh = calibrated_session(tiny_dirs, quant), calibrated_session(tiny_dirs, quant)
    # A fixed draft length: an adaptive one follows wall time, and viasd's answer follows its blocks.
    config = GenerationConfig(mode="sd", max_new_tokens=M, gamma=4, adaptive=False)
    with running(warm, config) as (base, _), running(fresh, config) as (fresh_base, _):
        def ask(url, prompt, mode):
            status, _, body = raw(url, "POST", "/v1/completions",
                                  {"model": "target", "prompt": prompt, "max_tokens": M, "mode": mode})
            assert status == 200, body
            return body

        def check(prompt, mode):
            """The request on the warm server, then on a fresh one: the same answer and caches."""
            got = ask(base, prompt, mode)
            fresh.engine.reset()  # between requests: the fresh server's worker is idle
            want = ask(fresh_base, prompt, mode)
            assert got["choices"][0]["text"] == want["choices"][0]["text"], (mode, len(prompt))
            diff = differing(prompt_caches(warm.engine, len(prompt)), prompt_caches(fresh.engine, len(prompt)))
            assert not diff, (mode, len(prompt), diff)
            assert want["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            return got["usage"]["prompt_tokens_details"]["cached_tokens"]

        a = words(1, 300)
        assert check(a, "viasd") == 0
        grown = list(warm.engine.tokens) + words(2, 30)  # the conversation goes on, under sd
        assert check(grown, "sd") == prefill_boundary(len(a)) == PREFILL_CHUNK  # the first prompt's whole chunk
        assert check(list(warm.engine.tokens) + words(3, 5), "exact") == PREFILL_CHUNK
        long = words(4, 440)
        assert check(long, "sd") == 0
        assert check(long[:300], "sd") == PREFILL_CHUNK  # a short one sharing the long one's prefix
        assert check(list(warm.engine.tokens) + words(5, 40), "ar") == PREFILL_CHUNK
        assert check(list(warm.engine.tokens) + words(6, 40), "viasd") == PREFILL_CHUNK
        assert check(list(warm.engine.tokens)[:290], "sd") == PREFILL_CHUNK  # back into the answers' positions
        assert check(list(warm.engine.tokens)[:100], "sd") == 0  # too short to keep anything


def test_what_each_model_keeps(tiny_dirs, viasd_home):
    """The bookkeeping itself: each model's exact prefix after a request, what the next one keeps,
    a model that did not run keeping its part, and nothing kept of a model run outside the server."""
    from viasd_core.frontends.serve_cache import PrefixReuse

    s = build_session(ModelOptions(model=str(tiny_dirs["target"]), draft=str(tiny_dirs["draft"]), quant="none"), mode="sd")
    engine, reuse = s.engine, PrefixReuse(s.engine)
    draft = engine.drafter.model
    sd, ar = (GenerationConfig(mode=mode, max_new_tokens=8, gamma=4, adaptive=False) for mode in ("sd", "ar"))

    def run(ids, config):
        kept = reuse.before(ids)
        engine.generate(ids, config)
        reuse.after(ids)
        return kept

    first = words(1, 300)
    assert run(first, sd) == 0
    assert reuse.exact_prefix(engine.target) == reuse.exact_prefix(draft) == PREFILL_CHUNK
    assert run(list(engine.tokens) + words(2, 20), ar) == PREFILL_CHUNK  # ar: the draft does not run
    assert engine.target.seen > draft.seen == PREFILL_CHUNK and reuse.exact_prefix(draft) == PREFILL_CHUNK
    grown = list(engine.tokens) + words(3, 10)
    kept = reuse.before(grown)  # the rollback alone: the engine then keeps no more than that
    assert kept == PREFILL_CHUNK and engine.tokens == grown[:kept] and engine.target.seen == draft.seen == kept
    engine.generate(grown, sd)
    reuse.after(grown)
    assert reuse.exact_prefix(engine.target) == PREFILL_CHUNK
    engine.generate(list(engine.tokens) + words(4, 5), sd)  # the engine run outside the server's requests
    assert reuse.exact_prefix(engine.target) == reuse.exact_prefix(draft) == 0
    assert run(list(engine.tokens) + words(5, 30), sd) == 0
    engine.reset()
    assert reuse.before(first) == 0 and engine.tokens == []
