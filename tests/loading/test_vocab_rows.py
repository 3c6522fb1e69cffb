"""Target, draft and tokenizer with different row counts (like Qwen2.5-7B 152064, its 0.5B draft
151936, their tokenizer 151665): every mode runs, no id past the smallest row count is ever emitted,
and the exact modes still equal ar token for token.

The pairs are built so that the target's padding rows WIN without the mask: each padding row is
twice a real row, so the unmasked argmax lands there whenever the best real logit is positive.
"""

import pytest
import torch

from conftest import save_tiny_model_dir, tiny_model
from viasd_core.speculation.drafters import ModelDrafter
from viasd_core.speculation.engine import GenerationConfig
from viasd_core.runtime.model import FastModel
from viasd_core.loading.profile import Profile, save_profile
from viasd_core.speculation.sampling import Sampler, SamplingParams
from viasd_core.session import build_session, thresholds_of
from viasd_core.loading.vocab_rows import emittable
from viasd_core.loading.options import ModelOptions

# name: (tokenizer size, draft rows, target rows) -> the expected limit of the target's ids
LAYOUTS = {
    "target-more-rows": ((64, 100, 128), 64),  # Qwen's layout: tokenizer < draft rows < target rows
    "target-fewer-rows": ((48, 128, 100), 48),  # the draft has more rows than the target
    "draft-short": ((128, 64, 128), 64),  # the draft's rows are the bound, not the tokenizer
}
NEW = 24
PROMPT = [5, 17, 9, 33, 12, 40, 7, 21, 30, 11]  # ids below every limit


def padded_model(rows: int, real: int, n_layers: int, seed: int):
    """A tiny Llama of `rows` embedding rows whose rows from `real` on are attractive padding."""
    model = tiny_model("llama", n_layers=n_layers, seed=seed, vocab=rows)
    with torch.no_grad():
        head = model.get_output_embeddings().weight
        for row in range(real, rows):
            head[row] = 2 * head[(row - real) % real]
    return model


def make_pair(base, tok_size: int, draft_rows: int, target_rows: int):
    words = [f"w{i}" for i in range(tok_size - 8)]
    dirs = {}
    for name, rows, layers, seed in (("target", target_rows, 4, 41), ("draft", draft_rows, 1, 42)):
        folder = save_tiny_model_dir(base / name, n_layers=layers, seed=seed, words=words)  # the tokenizer
        padded_model(rows, min(tok_size, draft_rows, target_rows), layers, seed).save_pretrained(folder)
        dirs[name] = folder
    profile = Profile(target_id="target", draft_id="draft", quant="none", device="cpu", dtype="float32",
                      layer_ids=[0, 2, 3], n_layers=4, theta_accept=0.9, theta_slim=0.3, budget=1.0,
                      heldout_fidelity=1.0)
    dirs["profile"] = save_profile(profile, base / "profile.json")
    return dirs


@pytest.fixture(scope="module", params=list(LAYOUTS))
def pair(request, tmp_path_factory):
    (tok_size, draft_rows, target_rows), limit = LAYOUTS[request.param]
    dirs = make_pair(tmp_path_factory.mktemp(request.param), tok_size, draft_rows, target_rows)
    opts = ModelOptions(model=str(dirs["target"]), draft=str(dirs["draft"]), profile=str(dirs["profile"]))
    session = build_session(opts, mode="viasd")
    return session, limit, target_rows


def generate(session, mode, **kw):
    config = GenerationConfig(mode=mode, max_new_tokens=NEW, gamma=4, thresholds=thresholds_of(session.profile), **kw)
    return session.engine.generate(PROMPT, config)


def test_padding_rows_would_win_without_the_mask(pair):
    # The set-up is meaningful: the bare target (no mask) picks a padding id after the prompt.
    session, limit, target_rows = pair
    bare = FastModel(session.target.model, max_len=64)
    assert bare.shape.vocab_size == target_rows
    assert int(bare.forward(torch.tensor(PROMPT), 0, 1).argmax()) >= limit


def test_every_model_of_the_session_is_masked_at_the_smallest_row_count(pair):
    session, limit, target_rows = pair
    engine = session.engine
    assert engine.target.vocab_limit == limit
    assert engine.slim.vocab_limit == limit
    assert emittable(engine.drafter.model) == limit  # masked there, or no rows beyond it
    logits = engine.target.forward(torch.tensor(PROMPT), 0, 3)
    assert logits.shape == (3, target_rows)
    assert torch.isneginf(logits[:, limit:]).all() and torch.isfinite(logits[:, :limit]).all()
    engine.reset()


def test_greedy_modes_stay_below_the_limit_and_exact_modes_equal_ar(pair):
    session, limit, _ = pair
    outs = {mode: generate(session, mode).tokens for mode in ("ar", "sd", "exact", "viasd")}
    for mode, tokens in outs.items():
        assert tokens and max(tokens) < limit, (mode, tokens)
    assert len(outs["ar"]) >= 8  # (EOS may end it before NEW)
    assert outs["sd"] == outs["ar"]
    assert outs["exact"] == outs["ar"]


@pytest.mark.parametrize("mode", ["ar", "sd", "exact"])
def test_sampling_modes_stay_below_the_limit(pair, mode):
    session, limit, _ = pair
    for seed in (1,):
        gen = generate(session, mode, temperature=1.0, top_k=0, top_p=1.0, seed=seed)
        assert len(gen.tokens) >= 1 and max(gen.tokens) < limit, gen.tokens
        if mode == "sd":
            assert gen.stats.draft_tokens > 0  # the draft really proposed (and its probs were compared)


def test_draft_probs_come_back_in_the_target_width(pair):
    # The draft's probabilities are returned over the target's ids: zero from the limit on, a
    # distribution on the ids below it, and the sampled tokens among them.
    session, limit, target_rows = pair
    drafter = session.engine.drafter
    assert isinstance(drafter, ModelDrafter) and drafter.vocab_size == target_rows
    ids = torch.zeros(64, dtype=torch.long)
    ids[: len(PROMPT)] = torch.tensor(PROMPT)
    drafter.reset()
    proposal = drafter.propose(ids, len(PROMPT), 4, SamplingParams(temperature=1.0), Sampler(3))
    assert proposal.probs.shape == (4, target_rows)
    assert (proposal.probs[:, limit:] == 0).all()
    torch.testing.assert_close(proposal.probs.sum(-1), torch.ones(4))
    assert (proposal.tokens < limit).all()
    assert (proposal.probs[torch.arange(4), proposal.tokens] > 0).all()
    session.engine.reset()
