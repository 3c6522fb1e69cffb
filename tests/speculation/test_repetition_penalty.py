"""The repetition penalty (issue #51): transformers' rule in one function (sampling.penalize), each
row over its own history, so greedy ar equals transformers' generate(repetition_penalty=...), greedy
sd (self draft, another draft, prompt lookup, trees), exact and a lossless viasd emit ar's tokens,
sampled sd follows the penalized target distribution, and the CLI and the server honour it."""

from __future__ import annotations

import pytest
import torch

from conftest import TinyTokenizer, tiny_model
from support.engine_cases import make_engine, prompt_for
from support.serve_support import N, client, generate_texts, running, session  # noqa: F401
from support.tree_cases import FutureTrees
from viasd_core.speculation.drafters import ModelDrafter
from viasd_core.speculation.engine import Engine, GenerationConfig
from viasd_core.runtime.model import FastModel
from viasd_core.speculation.router import Thresholds
from viasd_core.speculation.sampling import SamplingParams, chain_presence, penalize, presence, process_logits
from viasd_core.runtime.token_tree import TokenTree, ancestor_matrix
from viasd_core.speculation.tree import TreeShape

NEW = 24
PENALTY = 1.8  # strong: the tiny models repeat themselves, so the penalty changes their answers


def hf_processor(penalty):
    from transformers import RepetitionPenaltyLogitsProcessor

    return RepetitionPenaltyLogitsProcessor(penalty)


def test_penalize_is_transformers_rule_per_row():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 10, generator=g) * 3
    history = torch.tensor([1, 4, 4])
    block = torch.tensor([7, 1, 2])
    rows = penalize(logits, chain_presence(presence(history, 10), block), 1.7)
    for j in range(4):  # row j saw the history and block[:j]
        context = torch.cat([history, block[:j]]).view(1, -1)
        want = hf_processor(1.7)(context, logits[j : j + 1].clone())
        torch.testing.assert_close(rows[j : j + 1], want)
    assert torch.equal(penalize(logits, presence(history, 10), 1.0), logits)  # 1: off


def hf_generate(model, prompt, new, penalty):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=0, do_sample=False,
                             repetition_penalty=penalty, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_greedy_ar_equals_transformers(family):
    target = tiny_model(family, n_layers=3, seed=11)
    eng = make_engine(target)
    for seed in range(2):
        prompt = prompt_for(seed)
        got = eng.generate(prompt, GenerationConfig(mode="ar", max_new_tokens=NEW, repetition_penalty=PENALTY)).tokens
        assert got == hf_generate(target, prompt, NEW, PENALTY)
        plain = eng.generate(prompt, GenerationConfig(mode="ar", max_new_tokens=NEW)).tokens
        assert got != plain  # the penalty changes the answer here, so the equalities below test it


def _penalized_ar(eng, prompt):
    return eng.generate(prompt, GenerationConfig(mode="ar", max_new_tokens=NEW, repetition_penalty=PENALTY)).tokens


@pytest.mark.parametrize("draft", ["self", "other", "ngram"])
def test_greedy_sd_and_exact_equal_ar(draft):
    target = tiny_model("llama", n_layers=4, seed=12)
    draft_model = {"self": target, "other": tiny_model("llama", n_layers=1, seed=13), "ngram": None}[draft]
    eng = make_engine(target, draft_model, ngram=draft == "ngram", slim_layers=[0, 1, 3])
    for seed in range(2):
        prompt = prompt_for(seed)
        ar = _penalized_ar(eng, prompt)
        for gamma in (1, 3, 6):
            for mode in ("sd", "exact"):
                cfg = GenerationConfig(mode=mode, max_new_tokens=NEW, gamma=gamma, adaptive=False,
                                       repetition_penalty=PENALTY)
                got = eng.generate(prompt, cfg)
                assert got.tokens == ar, (mode, gamma, seed)
                if draft == "self" and mode == "sd":  # the draft penalized as the target: everything accepted
                    assert sum(got.stats.position_accepts) == sum(got.stats.position_attempts) > 0


def test_viasd_slim_rows_are_penalized():
    """A slim verifier that is the whole target, and tiers that accept only the slim's choice: viasd is
    then lossless, and equals ar only if the slim's rows (gate and tokens) see the penalty too."""
    target = tiny_model("llama", n_layers=3, seed=14)
    eng = make_engine(target, tiny_model("llama", n_layers=1, seed=15), slim_layers=[0, 1, 2])
    for seed in range(2):
        prompt = prompt_for(seed)
        ar = _penalized_ar(eng, prompt)
        got = eng.generate(prompt, GenerationConfig(mode="viasd", max_new_tokens=NEW, gamma=4, adaptive=False,
                                                    thresholds=Thresholds(1.0, 0.0), repetition_penalty=PENALTY))
        assert got.tokens == ar
        assert got.stats.tier_counts["slim"] > 0


class OracleTrees(FutureTrees):
    """Knows penalized ar's continuation and hides it in a tree: root -> [X, RIGHT0], X -> RIGHT1,
    RIGHT0 -> [Y, RIGHT1], RIGHT1 -> RIGHT2, with X = RIGHT1 and Y = RIGHT2 where siblings allow: a
    row penalized over the nodes before it (not over its ancestors) would penalize its own answer."""

    def propose_tree(self, ids, n, shape, params, sampler, host_tokens=None) -> TokenTree:
        k = n - self.start
        r = (self.future + [0, 0, 0])[k : k + 3]
        x = r[1] if r[1] != r[0] else (r[0] + 1) % self.vocab
        y = r[2] if r[2] != r[1] else (r[1] + 1) % self.vocab
        parents = torch.tensor([-1, -1, 0, 1, 1, 4])
        tokens = torch.tensor([x, r[0], r[1], y, r[1], r[2]])
        return TokenTree(tokens, parents, torch.tensor([1, 1, 2, 2, 2, 3]), ancestor_matrix(parents, 3), 3)


def test_greedy_tree_sd_equals_ar():
    """Tree rows are penalized over their ancestors: an oracle tree, and an EAGLE-3 head's own trees."""
    from support.head_cases import engine_with_head, make_head

    target = tiny_model("llama", n_layers=5, seed=5)
    eng = make_engine(target)
    for seed in range(3):
        prompt = prompt_for(seed)
        ar = _penalized_ar(eng, prompt)
        eng.drafter = OracleTrees(ar, len(prompt), 256)
        cfg = GenerationConfig(mode="sd", max_new_tokens=NEW, tree=TreeShape(2, 3, 6), adaptive=False,
                               repetition_penalty=PENALTY)
        got = eng.generate(prompt, cfg)
        assert got.tokens == ar and got.stats.target_passes == NEW // 4  # three accepted and a bonus per pass
        eng.drafter = None
    eng = engine_with_head(target, make_head(target, seed=5, full=True))
    for seed in range(2):
        prompt = prompt_for(seed)
        ar = _penalized_ar(eng, prompt)
        for shape in (TreeShape(2, 3, 5), TreeShape(3, 4, 10)):
            cfg = GenerationConfig(mode="sd", max_new_tokens=NEW, tree=shape, adaptive=False, repetition_penalty=PENALTY)
            assert eng.generate(prompt, cfg).tokens == ar, shape


def _tv(a, b):
    return 0.5 * (a - b).abs().sum().item()


def test_sampled_sd_follows_the_penalized_target():
    """As tests/speculation/test_sampling.py: over many seeds the first two emitted tokens follow the target's
    penalized distributions, computed here with transformers' own processor (the second over the
    prompt plus the first token), not the unpenalized ones nor a second row penalized over the
    committed tokens only. A penalty below 1 (it favours repeats) moves this tiny model's mass most."""
    target = tiny_model("llama", n_layers=2, seed=21)
    prompt = [5, 6, 7]
    params = SamplingParams(temperature=1.0, top_k=20)
    penalty = 0.45

    def target_probs(ids, history, pen=penalty):
        with torch.no_grad():
            logits = target(torch.tensor([ids])).logits[0, -1:]
            return process_logits(hf_processor(pen)(torch.tensor([history]), logits), params)[0]

    first_expected = target_probs(prompt, prompt)
    support = [x for x in range(256) if first_expected[x] > 0]
    second_expected = sum(first_expected[x] * target_probs(prompt + [x], prompt + [x]) for x in support)
    second_blind = sum(first_expected[x] * target_probs(prompt + [x], prompt) for x in support)
    first_unpenalized = target_probs(prompt, prompt, 1.0)

    draft = FastModel(target, layer_ids=[0], max_len=64, name="draft")
    eng = Engine(FastModel(target, max_len=64), TinyTokenizer(), drafter=ModelDrafter(draft, 256))
    n = 1000
    first_counts, second_counts = torch.zeros(256), torch.zeros(256)
    accepted = drafted = 0
    for seed in range(n):
        out = eng.generate(prompt, GenerationConfig(mode="sd", max_new_tokens=3, gamma=2, adaptive=False,
                                                    temperature=1.0, top_k=20, seed=seed, repetition_penalty=penalty))
        first_counts[out.tokens[0]] += 1
        second_counts[out.tokens[1]] += 1
        accepted += sum(out.stats.position_accepts)
        drafted += sum(out.stats.position_attempts)
    assert 0.1 < accepted / drafted < 0.9  # acceptance and rejection both exercised
    first, second = first_counts / n, second_counts / n
    assert _tv(first, first_expected) < 0.08 and _tv(first, first_unpenalized) > 0.2
    assert _tv(second, second_expected) < 0.15
    assert _tv(second, second_blind) > _tv(second, second_expected) + 0.1


def test_config_refuses_a_penalty_not_above_zero():
    from viasd_core.errors import UsageError

    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(UsageError, match="repetition-penalty must be > 0"):
            GenerationConfig(repetition_penalty=bad).validate()


def test_the_server_honours_it_as_generate_does(session, tiny_dirs, viasd_home):  # noqa: F811
    import openai

    prompt = "w1 w2 w3 w1 w2 w3"
    [ref] = generate_texts(tiny_dirs, [prompt], "--repetition-penalty", PENALTY)
    [plain] = generate_texts(tiny_dirs, [prompt])
    assert ref["text"] != plain["text"]  # the tiny pair answers otherwise with the penalty
    with running(session) as (base, _):
        c = client(base)
        args = {"model": "target", "messages": [{"role": "user", "content": prompt}]}
        for mode in ("sd", "ar"):
            got = c.chat.completions.create(**args, extra_body={"repetition_penalty": PENALTY, "mode": mode})
            assert got.choices[0].message.content == ref["text"], mode
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(**args, extra_body={"repetition_penalty": 0})
        assert e.value.param == "repetition_penalty" and "repetition_penalty" in e.value.message


def test_generate_refuses_a_bad_penalty_in_one_line(tiny_dirs, viasd_home):
    from typer.testing import CliRunner

    from viasd_cli.app import get_app

    r = CliRunner().invoke(get_app(), ["generate", "w1", "-m", str(tiny_dirs["target"]), "--repetition-penalty", "0"])
    assert r.exit_code == 2 and "repetition-penalty must be > 0" in r.stderr and r.stderr.count("\n") == 1, r.stderr
