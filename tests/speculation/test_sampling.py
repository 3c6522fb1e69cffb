"""The acceptance rule on hand-made rows, logits processing, and a Monte-Carlo distribution test."""

import pytest
import torch

from viasd_core.speculation.sampling import Sampler, SamplingParams, greedy_accept, process_logits, speculative_sample


class FixedSampler(Sampler):
    """Replaces the randomness seam: categorical draws return the argmax of the given row."""

    def __init__(self):
        super().__init__(seed=0)
        self.rows = []

    def categorical(self, probs):
        self.rows.append(probs.clone())
        return probs.argmax(-1)


def test_greedy_accept_hand_rows():
    draft = torch.tensor([5, 6, 7])
    emitted, n = greedy_accept(draft, torch.tensor([5, 6, 9, 1]))
    assert int(n) == 2 and emitted[:3].tolist() == [5, 6, 9]
    emitted, n = greedy_accept(draft, torch.tensor([5, 6, 7, 4]))
    assert int(n) == 3 and emitted.tolist() == [5, 6, 7, 4]  # bonus token
    emitted, n = greedy_accept(draft, torch.tensor([0, 6, 7, 4]))
    assert int(n) == 0 and emitted[0].item() == 0  # a later match does not count


def test_speculative_sample_hand_rows():
    """(emitted [G + 1], n): only emitted[:n + 1] is meaningful; the sampler gets every row's recovery
    distribution at once (rows 0..G-1 residuals, row G the bonus row) and row n is the one kept."""
    draft_probs = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]])
    target_probs = torch.tensor([[0.25, 0.25, 0.5, 0.0], [0.0, 0.5, 0.5, 0.0], [0.1, 0.2, 0.3, 0.4]])
    tokens = torch.tensor([0, 1])
    s = FixedSampler()

    def kept(out, n):
        return out[: int(n) + 1].tolist()

    # position 0: accept prob = 0.25 / 0.5 = 0.5; u = 0.49 accepts. position 1: 0.5 / 1.0; u = 0.51 rejects.
    out, n = speculative_sample(tokens, draft_probs, target_probs, torch.tensor([0.49, 0.51]), s)
    assert int(n) == 1 and out.shape == (3,)
    # residual at position 1: max(0, [0, .5, .5, 0] - [0, 1, 0, 0]) = [0, 0, .5, 0] -> normalized one-hot on 2
    torch.testing.assert_close(s.rows[-1][1], torch.tensor([0.0, 0.0, 1.0, 0.0]))
    assert kept(out, n) == [0, 2]
    # u equal to the acceptance probability rejects (accept iff u < ratio); the rest of the block is dropped
    out, n = speculative_sample(tokens, draft_probs, target_probs, torch.tensor([0.5, 0.0]), s)
    assert int(n) == 0 and kept(out, n) == [2]  # residual at 0: [0, 0, .5, 0] / .5 after max(0, [-.25, -.25, .5, 0])
    torch.testing.assert_close(s.rows[-1][0], torch.tensor([0.0, 0.0, 1.0, 0.0]))
    # all accepted: the bonus token is sampled from the last target row, unchanged
    out, n = speculative_sample(tokens, draft_probs, target_probs, torch.tensor([0.1, 0.1]), s)
    assert int(n) == 2 and kept(out, n) == [0, 1, 3]
    torch.testing.assert_close(s.rows[-1][2], target_probs[2])
    # target gives the draft token more mass than the draft: always accepted (u < 1)
    out, n = speculative_sample(torch.tensor([2]), torch.tensor([[0.0, 0.0, 0.1, 0.9]]), torch.tensor([[0, 0, 1.0, 0], [1.0, 0, 0, 0]]), torch.tensor([0.999]), s)
    assert int(n) == 1 and kept(out, n) == [2, 0]
    # a residual spread over several tokens is renormalized: max(0, [.2, .3, .5] - [.5, .1, .4]) = [0, .2, .1]
    out, n = speculative_sample(torch.tensor([0]), torch.tensor([[0.5, 0.1, 0.4]]), torch.tensor([[0.2, 0.3, 0.5], [1.0, 0, 0]]), torch.tensor([0.9]), s)
    assert int(n) == 0 and kept(out, n) == [1]
    torch.testing.assert_close(s.rows[-1][0], torch.tensor([0.0, 2 / 3, 1 / 3]))


def test_categorical_on_the_device_follows_the_distribution():
    """The exponential race draws each row from its own distribution (no multinomial, no host read)."""
    probs = torch.tensor([[0.1, 0.2, 0.7, 0.0], [0.5, 0.0, 0.0, 0.5]])
    sampler = Sampler(seed=7)
    draws = torch.stack([sampler.categorical(probs) for _ in range(20000)])  # [N, 2]
    for row in range(2):
        freq = torch.bincount(draws[:, row], minlength=4).float() / draws.shape[0]
        assert _tv(freq, probs[row]) < 0.015
    assert (draws[:, 0] != 3).all() and (draws[:, 1] != 1).all()  # zero-probability tokens never drawn


def test_process_logits_top_k_top_p_temperature():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    p = process_logits(logits, SamplingParams(temperature=1.0))
    torch.testing.assert_close(p, logits.softmax(-1))
    p = process_logits(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (p[0, 2:] == 0).all() and p[0, :2].sum() == pytest.approx(1.0)
    full = logits.softmax(-1)[0]
    # top_p = 0.7: the first token has 0.64 < 0.7, so the second is kept too; the rest dropped
    p = process_logits(logits, SamplingParams(temperature=1.0, top_p=0.7))
    assert (p[0, 2:] == 0).all()
    torch.testing.assert_close(p[0, :2], full[:2] / full[:2].sum())
    p = process_logits(logits, SamplingParams(temperature=0.5))
    torch.testing.assert_close(p, (logits / 0.5).softmax(-1))


def test_process_logits_min_p():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    full = logits.softmax(-1)[0]  # [0.644, 0.237, 0.087, 0.032]
    # min_p = 0.2: the threshold is 0.2 * 0.644 = 0.129, so the last two go
    p = process_logits(logits, SamplingParams(temperature=1.0, min_p=0.2))
    assert (p[0, 2:] == 0).all()
    torch.testing.assert_close(p[0, :2], full[:2] / full[:2].sum())
    # min_p = 1: only the most likely token; 0: off
    assert process_logits(logits, SamplingParams(temperature=1.0, min_p=1.0))[0].tolist() == [1.0, 0.0, 0.0, 0.0]
    torch.testing.assert_close(process_logits(logits, SamplingParams(temperature=1.0, min_p=0.0)), full[None])


@pytest.mark.parametrize("temperature, top_k, top_p, min_p", [(1.0, 0, 1.0, 0.1), (0.7, 50, 0.9, 0.05), (1.5, 0, 0.8, 0.3)])
def test_process_logits_equals_transformers_warpers(temperature, top_k, top_p, min_p):
    """The whole chain, min-p last, against transformers' own warpers in their order."""
    from transformers.generation.logits_process import (MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)

    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(3)) * 3
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    scores = MinPLogitsWarper(min_p)(None, TopPLogitsWarper(top_p)(None, scores))
    ours = process_logits(logits, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p))
    torch.testing.assert_close(ours, scores.softmax(-1))
    assert ((ours > 0).sum(-1) < 300).all()  # the filters did drop tokens


def _tv(a, b):
    return 0.5 * (a - b).abs().sum().item()


@pytest.mark.parametrize("gamma", [1, 3])
def test_monte_carlo_output_follows_target_distribution(gamma):
    """Like vLLM's rejection-sampler test: the empirical distribution of the first emitted token
    approaches the target's distribution much faster than it approaches random references."""
    V = 8
    g = torch.Generator().manual_seed(0)
    target_probs = torch.softmax(torch.randn(gamma + 1, V, generator=g) * 1.5, -1)
    draft_probs = torch.softmax(torch.randn(gamma, V, generator=g) * 1.5, -1)
    references = [torch.softmax(torch.randn(V, generator=g) * 1.5, -1) for _ in range(5)]
    sampler = Sampler(seed=123)
    counts = torch.zeros(V)
    distances = []
    n_total = 0
    for n_samples in (1000, 10000, 40000):
        while n_total < n_samples:
            tokens = sampler.categorical(draft_probs)  # the draft really samples what it reports
            out, _ = speculative_sample(tokens, draft_probs, target_probs, sampler.uniform(gamma, "cpu"), sampler)
            counts[out[0]] += 1
            n_total += 1
        empirical = counts / counts.sum()
        distances.append(_tv(empirical, target_probs[0]))
        ref_distance = min(_tv(empirical, r) for r in references)
        assert distances[-1] < ref_distance / 3
    assert distances[-1] < 0.015
    assert distances[-1] < distances[0]


@pytest.mark.parametrize("filters", [{"top_k": 20}, {"min_p": 0.03}])
def test_sampling_engine_follows_the_target_distribution(filters):
    """The engine end to end (draft sampling, processed probabilities, acceptance, bonus and the
    next step): over many seeds, the first two emitted tokens follow the target's distributions
    (temperature and top-k, or min-p, applied), not the draft's; a seed reproduces a run."""
    from conftest import TinyTokenizer, tiny_model
    from viasd_core.speculation.drafters import ModelDrafter
    from viasd_core.speculation.engine import Engine, GenerationConfig
    from viasd_core.runtime.model import FastModel

    target = tiny_model("llama", n_layers=2, seed=21)
    prompt = [5, 6, 7]
    params = SamplingParams(temperature=1.0, **filters)

    def target_probs(ids):
        with torch.no_grad():
            return process_logits(target(torch.tensor([ids])).logits[0, -1:], params)[0]

    # Independent expectations from transformers' own forward: the first token's distribution, and
    # the second token's marginal sum_x P(first = x) * P(second | prompt + [x]).
    first_expected = target_probs(prompt)
    second_expected = sum(first_expected[x] * target_probs(prompt + [x]) for x in range(256) if first_expected[x] > 0)
    # The draft: the target's first layer only (it agrees sometimes, so both rule paths run).
    draft = FastModel(target, layer_ids=[0], max_len=64, name="draft")
    draft_first = process_logits(draft.forward(torch.tensor(prompt), 0, 1), params)[0]
    draft.reset()
    assert _tv(draft_first, first_expected) > 0.5  # a wrong engine that followed the draft would show

    eng = Engine(FastModel(target, max_len=64), TinyTokenizer(), drafter=ModelDrafter(draft, 256))

    def run(seed, new=3):
        return eng.generate(prompt, GenerationConfig(mode="sd", max_new_tokens=new, gamma=2, adaptive=False,
                                                     temperature=1.0, seed=seed, **filters))

    n = 1000
    first_counts, second_counts = torch.zeros(256), torch.zeros(256)
    accepted = drafted = 0
    for seed in range(n):
        out = run(seed)
        first_counts[out.tokens[0]] += 1
        second_counts[out.tokens[1]] += 1
        accepted += sum(out.stats.position_accepts)
        drafted += sum(out.stats.position_attempts)
    assert 0.1 < accepted / drafted < 0.9  # acceptance and rejection both exercised
    # Sampling noise of the total variation at n = 1000 is ~0.05 (first) and ~0.13 (second, broader).
    assert _tv(first_counts / n, first_expected) < 0.1
    assert _tv(first_counts / n, draft_first) > 0.4
    assert _tv(second_counts / n, second_expected) < 0.2
    assert _tv(second_counts / n, first_expected) > 0.5  # not the first position's distribution again
    assert (first_expected == 0).sum() > 100  # the filter drops most of the 256 tokens
    assert (first_counts[first_expected == 0] == 0).all()  # nothing outside the tokens the filter keeps

    long_a, long_b = run(7, 12).tokens, run(8, 12).tokens
    assert run(7, 12).tokens == long_a and long_a != long_b


@pytest.mark.parametrize("limit", [0, 1, 2])
def test_monte_carlo_positions_past_the_limit_are_no_proposals(limit):
    """A block of 3 drafted tokens of which only `limit` are proposals (the confidence stop decided on
    the device): the first emitted token still follows the target, and nothing past the limit is
    ever accepted; greedy acceptance stops there too."""
    V, gamma = 8, 3
    g = torch.Generator().manual_seed(1)
    target_probs = torch.softmax(torch.randn(gamma + 1, V, generator=g) * 1.5, -1)
    draft_probs = torch.softmax(torch.randn(gamma, V, generator=g) * 1.5, -1)
    sampler = Sampler(seed=7)
    counts = torch.zeros(V)
    lim = torch.tensor(limit)
    for _ in range(20000):
        tokens = sampler.categorical(draft_probs)
        out, n_acc = speculative_sample(tokens, draft_probs, target_probs, sampler.uniform(gamma, "cpu"), sampler, lim)
        assert int(n_acc) <= limit
        counts[out[0]] += 1
    assert _tv(counts / counts.sum(), target_probs[0]) < 0.02
    # greedy: a block the target agrees with everywhere is accepted only up to the limit
    argmax = torch.tensor([3, 4, 5, 6])
    _, n = greedy_accept(argmax[:3], argmax, lim)
    assert int(n) == limit


def test_generate_min_p_reaches_the_sampler(tiny_dirs, viasd_home):
    """`viasd generate --min-p 1` keeps only the most likely token: a sampled run prints the greedy
    answer; out of range it is a one-line usage error before any model loads."""
    import json

    from typer.testing import CliRunner

    from viasd_cli.app import get_app

    def run(*args):
        argv = ["generate", "w1 w2 w3", "-m", str(tiny_dirs["target"]), "-d", str(tiny_dirs["draft"]), "-n", "8",
                "--json", "-q", *args]
        return CliRunner().invoke(get_app(), argv)

    greedy = json.loads(run().stdout)["text"]
    for seed in ("1", "2"):
        r = run("-t", "1.5", "--seed", seed, "--min-p", "1")
        assert r.exit_code == 0, r.stderr
        assert json.loads(r.stdout)["text"] == greedy
    assert {json.loads(run("-t", "1.5", "--seed", s).stdout)["text"] for s in ("1", "2", "3")} != {greedy}
    r = run("--min-p", "1.5")
    assert r.exit_code == 2 and "min-p must be in [0, 1]" in r.stderr and r.stderr.count("\n") == 1, r.stderr
