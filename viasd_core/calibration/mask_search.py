"""The layer-mask search (docs/algorithm.md section 4): which layers the slim verifier skips.

A mask is scored teacher-forced on fixed calibration text against the target's own logits: top-1
agreement first, then mean KL(target || slim). The search ranks layers by the harm of skipping
each alone, skips the least harmful, then tries local swaps; random masks of the same size are
scored as a check that the search beats chance.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import torch

from viasd_core.runtime.model import FastModel


@dataclass
class MaskScore:
    layer_ids: list[int]
    agreement: float  # top-1 agreement with the target, teacher-forced
    kl: float  # mean KL(target || slim) per position


@dataclass
class MaskSearch:
    best: MaskScore
    random_best: MaskScore | None
    evaluations: int
    seconds: float
    history: list[MaskScore] = field(default_factory=list)


class MaskEvaluator:
    """Scores layer masks on fixed calibration sequences against the target's own logits."""

    def __init__(self, hf_model, sequences: list[list[int]]):
        self.hf_model = hf_model
        self.max_len = max(len(s) for s in sequences) + 1
        self.device = next(hf_model.parameters()).device
        self.sequences = [torch.tensor(s, dtype=torch.long, device=self.device) for s in sequences]
        full = FastModel(hf_model, max_len=self.max_len, name="target")
        self.n_layers = full.shape.n_layers
        self.target_logp = [self._logits(full, s).log_softmax(-1) for s in self.sequences]
        self.target_argmax = [lp.argmax(-1) for lp in self.target_logp]
        self.evaluations = 0

    @staticmethod
    def _logits(model: FastModel, seq: torch.Tensor) -> torch.Tensor:
        model.reset()
        return model.forward(seq, 0, n_logits=seq.shape[0])

    def score(self, layer_ids: list[int]) -> MaskScore:
        self.evaluations += 1
        slim = FastModel(self.hf_model, layer_ids=layer_ids, max_len=self.max_len, name="slim")
        agreement, kl = self.compare(slim)
        return MaskScore(sorted(layer_ids), agreement, kl)

    def compare(self, slim: FastModel) -> tuple[float, float]:
        """(top-1 agreement, mean KL(target || slim)) of any view of the target on the sequences."""
        slim.allocate(self.max_len)
        agree = total = 0
        kl_sum = 0.0
        for seq, t_logp, t_arg in zip(self.sequences, self.target_logp, self.target_argmax):
            s_logp = self._logits(slim, seq).log_softmax(-1)
            agree += int((s_logp.argmax(-1) == t_arg).sum())
            total += seq.shape[0]
            t_prob = t_logp.exp()
            kl_sum += float(torch.where(t_prob > 0, t_prob * (t_logp - s_logp), 0.0).sum())  # 0 log 0 = 0
        slim.reset()
        return agree / total, kl_sum / total


def _better(a: MaskScore, b: MaskScore) -> bool:
    return (a.agreement, -a.kl) > (b.agreement, -b.kl)


def search_layer_mask(evaluator: MaskEvaluator, skip_ratio: float, swap_rounds: int = 2, n_random: int = 6,
                      seed: int = 0, progress=None) -> MaskSearch:
    """Greedy importance ranking + local swap search; random masks of the same size as a check.

    First and last layers are always kept. Step 1 scores skipping each candidate layer alone;
    the initial mask skips the k least harmful. Step 2 tries swapping each skipped layer with
    the most promising kept ones and keeps improvements.
    """
    t0 = time.perf_counter()
    L = evaluator.n_layers
    k = int(round(skip_ratio * L))
    candidates = list(range(1, L - 1))
    k = min(k, len(candidates))
    everything = list(range(L))
    if k == 0:
        best = evaluator.score(everything)
        return MaskSearch(best, None, evaluator.evaluations, time.perf_counter() - t0, [best])
    single = {}
    for i in candidates:
        single[i] = evaluator.score([j for j in everything if j != i])
        if progress:
            progress()
    ranked = sorted(candidates, key=lambda i: (single[i].agreement, -single[i].kl), reverse=True)
    skipped = set(ranked[:k])
    best = evaluator.score([j for j in everything if j not in skipped])
    history = [best]
    for _ in range(swap_rounds):
        improved = False
        outside = [i for i in ranked if i not in skipped][:3]  # the least harmful layers still kept
        for out_layer in sorted(skipped, key=lambda i: (single[i].agreement, -single[i].kl))[:3]:
            for in_layer in outside:
                trial = (skipped - {out_layer}) | {in_layer}
                score = evaluator.score([j for j in everything if j not in trial])
                if progress:
                    progress()
                if _better(score, best):
                    best, skipped, improved = score, trial, True
                    history.append(best)
                    break
            if improved:
                break
        if not improved:
            break
    rng = random.Random(seed)
    random_best = None
    for _ in range(n_random):
        trial = set(rng.sample(candidates, k))
        score = evaluator.score([j for j in everything if j not in trial])
        if progress:
            progress()
        if random_best is None or _better(score, random_best):
            random_best = score
    return MaskSearch(best, random_best, evaluator.evaluations, time.perf_counter() - t0, history)


