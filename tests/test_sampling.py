"""The acceptance rule on hand-made rows, logits processing, and a Monte-Carlo distribution test."""

import pytest
import torch

from viasd_core.sampling import Sampler, SamplingParams, greedy_accept, process_logits, speculative_sample


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
    V = 4
    draft_probs = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]])
    target_probs = torch.tensor([[0.25, 0.25, 0.5, 0.0], [0.0, 0.5, 0.5, 0.0], [0.1, 0.2, 0.3, 0.4]])
    tokens = torch.tensor([0, 1])
    s = FixedSampler()
    # position 0: accept prob = 0.25 / 0.5 = 0.5; u = 0.49 accepts. position 1: 0.5 / 1.0; u = 0.51 rejects.
    out, n = speculative_sample(tokens, draft_probs, target_probs, torch.tensor([0.49, 0.51]), s)
    assert n == 1
    # residual at position 1: max(0, [0, .5, .5, 0] - [0, 1, 0, 0]) = [0, 0, .5, 0] -> normalized one-hot on 2
    torch.testing.assert_close(s.rows[-1][0], torch.tensor([0.0, 0.0, 1.0, 0.0]))
    assert out.tolist() == [0, 2]
    # all accepted: the bonus token comes from the last target row
    out, n = speculative_sample(tokens, draft_probs, target_probs, torch.tensor([0.1, 0.1]), s)
    assert n == 2 and out.tolist() == [0, 1, 3]
    # target gives the draft token more mass than the draft: always accepted (u < 1)
    out, n = speculative_sample(torch.tensor([2]), torch.tensor([[0.0, 0.0, 0.1, 0.9]]), torch.tensor([[0, 0, 1.0, 0], [1.0, 0, 0, 0]]), torch.tensor([0.999]), s)
    assert n == 1
    assert V == 4


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


def test_sampling_engine_is_reproducible_with_a_seed_and_follows_target():
    from conftest import TinyTokenizer, tiny_model
    from viasd_core.drafters import ModelDrafter
    from viasd_core.engine import Engine, GenerationConfig
    from viasd_core.model import FastModel

    target = tiny_model("llama", seed=21, initializer_range=0.05)
    draft = tiny_model("llama", n_layers=1, seed=22, initializer_range=0.05)

    def run(seed):
        eng = Engine(FastModel(target, max_len=64), TinyTokenizer(), drafter=ModelDrafter(FastModel(draft, max_len=64), 256))
        return eng.generate([5, 6, 7], GenerationConfig(mode="sd", max_new_tokens=12, gamma=3, temperature=0.8, top_k=50, seed=seed)).tokens

    assert run(7) == run(7)
    assert run(7) != run(8)
