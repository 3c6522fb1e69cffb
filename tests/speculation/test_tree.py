"""Token trees (speculation/tree.py): the tree's pure pieces against plain references written here,
then sd over trees in the engine: token-identical to ar (greedy; every family's tiny model, int4,
compiled with graph outputs checked), the accepted path's K/V moved into place, one host read per
step, and the target's distribution kept when sampling."""

from __future__ import annotations

import pytest
import torch

from conftest import FAMILIES, TinyTokenizer, tiny_model
from support.head_cases import engine_with_head, make_head, prompt_for
from support.tree_cases import FutureTrees
from viasd_core.runtime import graph_outputs
from viasd_core.speculation.engine import Engine, GenerationConfig
from viasd_core.speculation.feature_drafter import FeatureDrafter
from viasd_core.runtime.model import FastModel
from viasd_core.runtime.pass_widths import PASS_WIDTHS
from viasd_core.speculation.sampling import SamplingParams, process_logits
from viasd_core.runtime.token_tree import TokenTree, ancestor_matrix, slot_mask
from viasd_core.speculation.tree import Candidates, TreeShape, accept_path, select_tree
from viasd_core.runtime.weight_format import WeightFormat
from viasd_core.runtime.weight_formats import apply_weight_format
from viasd_core.errors import UsageError

NEW = 24
SHAPES = [TreeShape(2, 3, 5), TreeShape(3, 4, 10), TreeShape(4, 5, 15)]


def random_tree(g: torch.Generator, n: int, vocab: int = 6) -> TokenTree:
    """A random tree in growth order (each node's parent is an earlier node or the root); siblings
    hold distinct tokens, as a draft's top-k children do."""
    parents = [-1] + [int(torch.randint(-1, j, (1,), generator=g)) for j in range(1, n)]
    depths, tokens = [], []
    for j, p in enumerate(parents):
        depths.append(1 if p < 0 else depths[p] + 1)
        taken = {tokens[i] for i in range(j) if parents[i] == p}
        free = [t for t in range(vocab) if t not in taken]
        tokens.append(free[int(torch.randint(0, len(free), (1,), generator=g))] if free else vocab + j)
    parents_t = torch.tensor(parents)
    D = max(depths)
    return TokenTree(torch.tensor(tokens), parents_t, torch.tensor(depths), ancestor_matrix(parents_t, D), D)


def walk(tree: TokenTree, choices: list[int]) -> list[int]:
    """The reference: from the root follow the child holding the target's choice; emit the choices."""
    node, out = -1, []
    while True:
        choice = choices[node + 1]
        out.append(choice)
        children = [j for j in range(tree.size) if int(tree.parents[j]) == node and int(tree.tokens[j]) == choice]
        if not children:
            return out
        node = children[0]


class OracleTrees(FutureTrees):
    """Knows ar's continuation `future` of a prompt of `start` tokens and hides it in a tree off the
    first branch: [wrong, RIGHT], under wrong one node, under RIGHT [wrong, RIGHT], under that RIGHT.
    The accepted path is nodes 1, 4, 5: their K/V must move from slots n+1, n+4, n+5 to n..n+2."""

    def propose_tree(self, ids, n, shape, params, sampler, host_tokens=None) -> TokenTree:
        k = n - self.start
        right = (self.future + [0, 0, 0])[k : k + 3]
        wrong = [(t + 1) % self.vocab for t in right]
        parents = torch.tensor([-1, -1, 0, 1, 1, 4])
        tokens = torch.tensor([wrong[0], right[0], right[1], wrong[1], right[1], right[2]])
        return TokenTree(tokens, parents, torch.tensor([1, 1, 2, 2, 2, 3]), ancestor_matrix(parents, 3), 3)


def oracle_engine(target, prompt, compiled=False):
    """An engine whose tree drafter knows ar's answer to `prompt` (and that answer)."""
    fast = FastModel(target, max_len=128)
    eng = Engine(fast, TinyTokenizer())
    ar = eng.generate(prompt, GenerationConfig(mode="ar", max_new_tokens=NEW)).tokens
    eng.drafter = OracleTrees(ar, len(prompt), fast.shape.vocab_size)
    if compiled:
        assert eng.compile()
        eng.warm_up()
        eng.warm_up_tree(ORACLE)
    return eng, ar


ORACLE = TreeShape(2, 3, 6)  # the oracle's tree: 6 nodes, 3 deep


# ---------------------------------------------------------------------- the pure pieces
def test_the_ancestor_matrix_and_slot_mask_follow_the_parents():
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        tree = random_tree(g, int(torch.randint(1, 12, (1,), generator=g)))
        for i in range(tree.size):
            chain, j = {i}, i
            while int(tree.parents[j]) >= 0:
                j = int(tree.parents[j])
                chain.add(j)
            assert {j for j in range(tree.size) if tree.ancestors[i, j]} == chain
        context = 7
        mask = slot_mask(tree, context, torch.arange(context + tree.size + 3))
        assert mask[0].tolist() == [s < context for s in range(context + tree.size + 3)]
        for i in range(tree.size):
            seen = {s for s in range(context)} | {context + j for j in range(tree.size) if tree.ancestors[i, j]}
            assert {s for s, m in enumerate(mask[1 + i].tolist()) if m} == seen


def test_the_accepted_path_is_the_walk_of_the_targets_choices():
    g = torch.Generator().manual_seed(1)
    walked_deep = 0
    for _ in range(300):
        tree = random_tree(g, int(torch.randint(1, 12, (1,), generator=g)), vocab=3)
        # the target often picks a child's token: deep paths are exercised
        choices = torch.randint(0, 3, (tree.size + 1,), generator=g)
        n_acc, path, emitted = accept_path(tree, choices)
        want = walk(tree, choices.tolist())
        k = int(n_acc)
        assert emitted[: k + 1].tolist() == want
        assert [int(tree.depths[j]) for j in path[:k]] == list(range(1, k + 1))
        assert tree.tokens[path[:k]].tolist() == want[:k]
        walked_deep += k >= 2
    assert walked_deep > 20


def test_selection_keeps_the_best_nodes_with_all_their_ancestors():
    g = torch.Generator().manual_seed(2)
    for _ in range(30):
        # a grown tree: depth-1 candidates, then children of earlier ones, scores falling with depth
        parents, scores = [-1, -1, -1], [-0.1, -0.5, -0.5]  # a tie between siblings
        for j in range(3, 20):
            p = int(torch.randint(0, j, (1,), generator=g))
            parents.append(p)
            scores.append(scores[p] - float(torch.rand(1, generator=g)) * (j % 3))  # some children tie their parent
        depths = []
        for p in parents:
            depths.append(1 if p < 0 else depths[p] + 1)
        cands = Candidates([torch.arange(20)], [torch.tensor(parents)], [torch.tensor(scores)], [torch.tensor(depths)])
        tree = select_tree(cands, 8, max(depths))
        kept = tree.tokens.tolist()  # the token is the candidate's index here
        assert kept == sorted(kept)
        best = sorted(range(20), key=lambda j: (-scores[j], j))[:8]
        assert sorted(best) == kept
        for i, j in enumerate(kept):
            p = parents[j]
            assert (int(tree.parents[i]) == -1) if p < 0 else (kept[int(tree.parents[i])] == p)


def test_a_tree_shape_is_validated():
    assert TreeShape(3, 4, 10).candidates == 3 + 3 * 9
    with pytest.raises(ValueError):
        TreeShape(2, 2, 7)  # only 2 + 4 candidates
    with pytest.raises(UsageError):
        GenerationConfig(mode="sd", tree=TreeShape(4, 6, 16)).validate()  # 17 positions in one pass


# ---------------------------------------------------------------------- in the engine
@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "mistral"])
def test_greedy_tree_sd_equals_ar(family):
    target = tiny_model(family, n_layers=5, seed=5)
    eng = engine_with_head(target, make_head(target, seed=5, full=True))
    for seed in range(3):
        prompt = prompt_for(seed)
        ar = eng.generate(prompt, GenerationConfig(mode="ar", max_new_tokens=NEW)).tokens
        for shape in SHAPES:
            reads = eng.host_reads
            got = eng.generate(prompt, GenerationConfig(mode="sd", max_new_tokens=NEW, tree=shape, adaptive=False))
            assert got.tokens == ar
            assert eng.host_reads - reads == got.stats.steps  # one read per step
    # a drafter that hides the answer off the first branch: deep paths, moved into place
    eng, ar = oracle_engine(target, prompt_for(4))
    got = eng.generate(prompt_for(4), GenerationConfig(mode="sd", max_new_tokens=NEW, tree=ORACLE, adaptive=False))
    assert got.tokens == ar
    assert got.stats.accepted_lengths == [4] * (NEW // 4)


def test_a_sliding_window_target_refuses_trees_with_one_line():
    target = tiny_model("mistral", n_layers=5, seed=5)
    eng = engine_with_head(target, make_head(target, seed=5, full=True))
    if eng.target.supports_tree:
        pytest.fail("the tiny mistral model is built with a sliding window")
    with pytest.raises(UsageError, match="--tree off"):
        eng.generate(prompt_for(0), GenerationConfig(mode="sd", max_new_tokens=4, tree=SHAPES[0]))


def test_the_accepted_paths_keys_and_values_are_moved_into_place():
    """After tree steps the target's cache holds what ar's holds at every committed position."""
    target = tiny_model("llama", n_layers=5, seed=6)
    head = make_head(target, seed=6, full=True)
    prompt = prompt_for(3)
    ref = engine_with_head(target, head)
    ar = ref.generate(prompt, GenerationConfig(mode="ar", max_new_tokens=NEW))
    eng, _ = oracle_engine(target, prompt)
    eng.target.capture_features((1, 2, 3))
    got = eng.generate(prompt, GenerationConfig(mode="sd", max_new_tokens=NEW, tree=ORACLE, adaptive=False))
    assert got.tokens == ar.tokens and max(got.stats.accepted_lengths) == 4
    seen = eng.target.seen
    assert seen == ref.target.seen == len(prompt) + NEW - 1
    for a, b in zip(eng.target.cache.layers, ref.target.cache.layers):
        assert torch.allclose(a.k[:, :, :seen], b.k[:, :, :seen], atol=1e-4)
        assert torch.allclose(a.v[:, :, :seen], b.v[:, :, :seen], atol=1e-4)
    assert torch.allclose(eng.target.cache.features[:seen], ref.target.cache.features[:seen], rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_tree_sd_equals_ar_in_the_int_formats(fmt):
    """The int formats' eager passes attend row by row; a tree row gathers exactly its own keys."""
    target = tiny_model("llama", n_layers=5, seed=7).to(torch.bfloat16)
    head = make_head(target, seed=7, full=True).to(torch.bfloat16)
    apply_weight_format(target, WeightFormat.parse(fmt))
    eng = engine_with_head(target, head)
    assert eng.target.row_attention
    for seed in range(2):
        prompt = prompt_for(seed)
        ar = eng.generate(prompt, GenerationConfig(mode="ar", max_new_tokens=NEW)).tokens
        for shape in SHAPES[:2]:
            assert eng.generate(prompt, GenerationConfig(mode="sd", max_new_tokens=NEW, tree=shape, adaptive=False)).tokens == ar
    eng, ar = oracle_engine(target, prompt_for(5))
    got = eng.generate(prompt_for(5), GenerationConfig(mode="sd", max_new_tokens=NEW, tree=ORACLE, adaptive=False))
    assert got.tokens == ar and max(got.stats.accepted_lengths) == 4


def test_compiled_tree_passes_equal_eager_ones_and_read_no_stale_output():
    target = tiny_model("llama", n_layers=5, seed=8)
    head = make_head(target, seed=8, full=True)
    shape = TreeShape(3, 3, 7)  # the same verify width as the oracle's tree (8): one graph
    eager = engine_with_head(target, head)
    fast = FastModel(target, max_len=128)
    eng = Engine(fast, TinyTokenizer(), drafter=FeatureDrafter(make_head(target, seed=8, full=True), fast))
    assert eng.compile()
    eng.warm_up()
    eng.warm_up_tree(shape)
    eager_calls = []
    run = fast._run
    fast._run = lambda *a, **k: eager_calls.append(a[0].shape[0]) or run(*a, **k)
    with graph_outputs.checking():
        for seed in range(2):
            prompt = prompt_for(seed)
            want = eager.generate(prompt, GenerationConfig(mode="sd", max_new_tokens=NEW, tree=shape, adaptive=False)).tokens
            eager_calls.clear()
            got = eng.generate(prompt, GenerationConfig(mode="sd", max_new_tokens=NEW, tree=shape, adaptive=False))
            assert got.tokens == want
            # nothing ran eagerly but a prompt's prefill longer than the widest graph (16 tokens)
            assert eager_calls == ([len(prompt) - 1] if len(prompt) - 1 > PASS_WIDTHS[-1] else [])
    eng, ar = oracle_engine(target, prompt_for(6), compiled=True)
    with graph_outputs.checking():
        got = eng.generate(prompt_for(6), GenerationConfig(mode="sd", max_new_tokens=NEW, tree=ORACLE, adaptive=False))
    assert got.tokens == ar and max(got.stats.accepted_lengths) == 4


class FixedTree(OracleTrees):
    """Proposes the same tree at every step (given tokens and parents)."""

    def __init__(self, tokens: list[int], parents: list[int]):
        self.tokens, self.parents = torch.tensor(tokens), torch.tensor(parents)
        depths = []
        for p in parents:
            depths.append(1 if p < 0 else depths[p] + 1)
        self.depths = torch.tensor(depths)

    def propose_tree(self, ids, n, shape, params, sampler, host_tokens=None) -> TokenTree:
        D = int(self.depths.max())
        return TokenTree(self.tokens, self.parents, self.depths, ancestor_matrix(self.parents, D), D)


def test_sampling_over_trees_keeps_the_targets_distribution():
    """The first two tokens' marginals against the target's own (computed here): the walk emits
    the target's samples whatever the tree holds, also where the tree predicted them. The tree holds
    the target's 3 likeliest first tokens, each with its likeliest follower: both ways of emitting
    the second token (from a node's row, or from the next step) are exercised."""
    target = tiny_model("llama", n_layers=5, seed=9)
    params = SamplingParams(temperature=1.0, top_k=6)
    prompt = prompt_for(9, 6)
    with torch.no_grad():
        first = process_logits(target(torch.tensor([prompt])).logits[0, -1:], params)[0]
        second = torch.zeros_like(first)
        follower = {}
        for t in first.nonzero().squeeze(1).tolist():
            after = process_logits(target(torch.tensor([prompt + [t]])).logits[0, -1:], params)[0]
            second += first[t] * after
            follower[t] = int(after.argmax())
    top = first.topk(3).indices.tolist()
    fast = FastModel(target, max_len=64)
    eng = Engine(fast, TinyTokenizer(), drafter=FixedTree(top + [follower[t] for t in top], [-1, -1, -1, 0, 1, 2]))
    n = 1500
    counts = torch.zeros(2, first.shape[0])
    deep = 0
    for seed in range(n):
        out = eng.generate(prompt, GenerationConfig(mode="sd", max_new_tokens=2, temperature=1.0, top_k=6, seed=seed,
                                                    tree=TreeShape(3, 2, 6), adaptive=False))
        counts[0, out.tokens[0]] += 1
        counts[1, out.tokens[1]] += 1
        deep += out.stats.accepted_lengths[0] >= 2
    assert 0.1 * n < deep < 0.9 * n
    for row, want in zip(counts / n, (first, second)):
        assert 0.5 * (row - want).abs().sum() < 0.08  # sampling noise at n = 1500 is ~0.04
        assert (row[want == 0] == 0).all()
