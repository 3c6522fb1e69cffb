"""The viasd tier walk: one pure walk (router.walk_block) behind both the engine and replay.

Pure walks on hand-made blocks; then real runs on tiny random models with thresholds that
force each tier, against tokens computed by hand from the models' own argmaxes (transformers
forwards over the whole context, no cache); then a real run recorded and replayed.
"""

import copy

import pytest
import torch

from conftest import TinyTokenizer, record_forward, tiny_model
from viasd_core.calibration.recording import BlockRecorder
from viasd_core.speculation.drafters import ModelDrafter
from viasd_core.speculation.engine import Engine, GenerationConfig
from viasd_core.speculation.fidelity import fidelity, target_argmax_along
from viasd_core.runtime.model import FastModel
from viasd_core.speculation.router import OFF, BlockRecord, Thresholds, replay, walk_block
from viasd_kernels import TIER_ACCEPT as A
from viasd_kernels import TIER_FULL as F
from viasd_kernels import TIER_SLIM as S


# ---------------------------------------------------------------------- the pure walk
class Target:
    """target_agrees for walk_block: the answers per position, and which positions were asked."""

    def __init__(self, agrees):
        self.agrees = agrees
        self.asked = []

    def __call__(self, j):
        self.asked.append(j)
        return self.agrees[j]


@pytest.mark.parametrize(
    "tiers, draft_eq_slim, agrees, expected, asked",
    [
        # every gate accepts: the block is kept and the slim gives the token at G, no target
        ([A, A, A], [False, False, False], [False] * 3, ["accept", "accept", "accept", "slim"], []),
        # a slim token equal to the draft's keeps going; one that differs ends the block
        ([S, A, S, A], [True, False, False, True], [True] * 4, ["slim", "accept", "slim"], []),
        # the slim agrees with every draft token: the block is kept, then the slim's token at G
        ([S, S], [True, True], [False, False], ["slim", "slim", "slim"], []),
        # the first full position hands the rest to the target: its tokens up to its disagreement
        ([A, F, A, S], [True, True, True, True], [True, True, False, True], ["accept", "full", "full"], [1, 2]),
        # the target agrees through the end: its bonus token at G
        ([F, S, A], [False, False, False], [True, True, True], ["full", "full", "full", "bonus"], [0, 1, 2]),
        # the target disagrees at once
        ([F, F], [True, True], [False, True], ["full"], [0]),
    ],
)
def test_walk_block_on_hand_blocks(tiers, draft_eq_slim, agrees, expected, asked):
    target = Target(agrees)
    assert walk_block(tiers, draft_eq_slim, target) == expected
    assert target.asked == asked  # lazily: the target only from the first full position on


# ---------------------------------------------------------------------- models and hand maths
PROMPT = torch.randint(3, 256, (9,), generator=torch.Generator().manual_seed(5)).tolist()
TARGET = tiny_model("llama", n_layers=4, seed=51)
OTHER_DRAFT = tiny_model("llama", n_layers=2, seed=52)  # unrelated to the target
OTHER_SLIM = tiny_model("llama", n_layers=2, seed=53)  # unrelated to the target and OTHER_DRAFT
SLIM_LAYERS = [0, 1, 3]


def near_copy(model, scale: float, seed: int):
    """The model with small noise on every weight: a draft that often, not always, agrees."""
    copied = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in copied.parameters():
            param.add_(scale * torch.randn(param.shape, generator=gen))
    return copied


def kept_layers(model, kept):
    """A transformers model running only the kept layers: the slim verifier's reference."""
    reference = copy.deepcopy(model)
    reference.model.layers = torch.nn.ModuleList([reference.model.layers[i] for i in kept])
    reference.config.num_hidden_layers = len(kept)
    return reference


NEAR = near_copy(TARGET, 0.006, seed=7)
SLIM_REF = kept_layers(TARGET, SLIM_LAYERS)


@torch.no_grad()
def next_token(model, context: list[int]) -> int:
    return int(model(torch.tensor([context]), use_cache=False).logits[0, -1].argmax())


def greedy(model, context: list[int], k: int) -> list[int]:
    out: list[int] = []
    for _ in range(k):
        out.append(next_token(model, context + out))
    return out


def expected_run(step, max_new: int, gamma: int):
    """The engine's schedule (gamma fixed): blocks of min(gamma, left - 1) drafts while more than
    one token is left, a plain target step for the last one; `step(context, g)` gives the tokens
    and tiers of one block."""
    context, tokens, tiers, blocks = list(PROMPT), [], [], 0
    while len(tokens) < max_new:
        left = max_new - len(tokens)
        if left == 1:
            out, names = [next_token(TARGET, context)], ["full"]
        else:
            out, names = step(context, min(gamma, left - 1))
            blocks += 1
        context += out
        tokens += out
        tiers += names
    return tokens, tiers, blocks


def engine(draft_model, slim: FastModel) -> Engine:
    e = Engine(FastModel(TARGET, max_len=96), TinyTokenizer(), drafter=ModelDrafter(FastModel(draft_model, max_len=96), 256),
               slim=slim)
    e.observers.append(BlockRecorder())  # every viasd block is recorded for replay
    return e


def recorded(e: Engine) -> list:
    return e.observers[0].blocks


def run_viasd(e: Engine, thresholds: Thresholds, max_new: int, gamma: int = 3):
    return e.generate(PROMPT, GenerationConfig(mode="viasd", max_new_tokens=max_new, gamma=gamma, adaptive=False,
                                               thresholds=thresholds))


def check_run(e: Engine, gen, thresholds: Thresholds, tokens, tiers, blocks):
    """The run emitted exactly the hand-computed tokens and tiers, and replaying its recorded
    blocks walks the same tiers (the last plain target step, if any, is not a block)."""
    assert gen.tokens == tokens
    assert gen.tiers == tiers
    assert len(recorded(e)) == blocks
    plain = gen.stats.steps - blocks  # 0, or 1 plain target step for a last single token
    assert replay(recorded(e), thresholds).tiers == tiers[: len(tiers) - plain]


# ---------------------------------------------------------------------- each tier, forced
def test_accept_tier_keeps_the_draft_block_and_the_slim_gives_the_next_token():
    def step(context, g):  # every gate >= 0: the draft's greedy block, then the slim's token at G
        block = greedy(NEAR, context, g)
        return block + [next_token(SLIM_REF, context + block)], ["accept"] * g + ["slim"]

    th = Thresholds(accept=0.0, slim=0.0)
    tokens, tiers, blocks = expected_run(step, max_new=12, gamma=3)  # 3 blocks of 3 + 1, no plain step
    e = engine(NEAR, FastModel(TARGET, layer_ids=SLIM_LAYERS, max_len=96))
    gen = run_viasd(e, th, 12)
    check_run(e, gen, th, tokens, tiers, blocks)
    assert blocks == 3 and gen.stats.target_passes == 0 and gen.stats.slim_passes == 3


def test_slim_tier_gives_the_slim_token_and_stops_where_it_differs_from_the_draft():
    stops = []

    def step(context, g):  # theta_accept off, every gate >= 0: the slim decides every position
        block = greedy(NEAR, context, g)
        out = []
        for j in range(g):
            out.append(next_token(SLIM_REF, context + block[:j]))
            if out[-1] != block[j]:
                stops.append(j)
                return out, ["slim"] * len(out)
        return out + [next_token(SLIM_REF, context + block)], ["slim"] * (g + 1)

    th = Thresholds(accept=OFF, slim=0.0)
    tokens, tiers, blocks = expected_run(step, max_new=24, gamma=3)
    assert any(j > 0 for j in stops), "the case must keep at least one slim token that equals the draft's"
    e = engine(NEAR, FastModel(TARGET, layer_ids=SLIM_LAYERS, max_len=96))
    gen = run_viasd(e, th, 24)
    check_run(e, gen, th, tokens, tiers, blocks)
    assert gen.stats.target_passes == gen.stats.steps - blocks  # only a last plain step runs the target


def full_step(draft_ref, slim_ref):
    """theta_slim = 1 with the slim's argmax never the draft's (checked): gate < 1 at position 0,
    so the target decides every block: its tokens to its first disagreement, or its bonus."""

    def step(context, g):
        block = greedy(draft_ref, context, g)
        assert next_token(slim_ref, context) != block[0], "the case needs the slim to reject position 0"
        out = []
        for j in range(g):
            out.append(next_token(TARGET, context + block[:j]))
            if out[-1] != block[j]:
                return out, ["full"] * len(out)
        return out + [next_token(TARGET, context + block)], ["full"] * g + ["bonus"]

    return step


@pytest.mark.parametrize("draft_name", ["unrelated", "the target itself"])
def test_full_tier_gives_the_target_tokens_and_its_bonus(draft_name):
    draft = OTHER_DRAFT if draft_name == "unrelated" else TARGET
    th = Thresholds(accept=OFF, slim=1.0)
    tokens, tiers, blocks = expected_run(full_step(draft, OTHER_SLIM), max_new=16, gamma=3)
    if draft is TARGET:  # the draft always agrees: every block ends on the target's bonus token
        assert tiers.count("bonus") == blocks and blocks > 0
    else:
        assert "bonus" not in tiers
    e = engine(draft, FastModel(OTHER_SLIM, max_len=96))  # an unrelated slim: it never agrees with the draft here
    gen = run_viasd(e, th, 16)
    check_run(e, gen, th, tokens, tiers, blocks)
    assert tokens == greedy(TARGET, PROMPT, 16)  # only the target decided
    assert gen.stats.target_passes == gen.stats.steps  # one target pass per block and per plain step


@pytest.mark.parametrize("theta_accept", [1.0, OFF])
@pytest.mark.parametrize("theta_slim", [0.0, 0.3, 1.0])
def test_slim_verifier_with_all_layers_keeps_fidelity_exactly_one(theta_accept, theta_slim):
    """With every layer the slim verifier IS the target: its tokens and its bonus are the target's,
    and a gate of 1 (the only one theta_accept >= 1 keeps) means the draft is the target's choice.
    (theta_accept < 1 keeps draft tokens nobody checked: lossy whatever the slim verifier.)"""
    th = Thresholds(accept=theta_accept, slim=theta_slim)
    e = engine(NEAR, FastModel(TARGET, layer_ids=[0, 1, 2, 3], max_len=96))
    gen = run_viasd(e, th, 24)
    assert gen.tokens == greedy(TARGET, PROMPT, 24)
    assert fidelity(TARGET, PROMPT, gen.tokens) == 1.0
    assert len(recorded(e)) == gen.stats.slim_passes > 0
    assert replay(recorded(e), th).wrong == 0
    used = set(gen.tiers)
    assert "full" in used and ("accept" in used or "slim" in used)


# ---------------------------------------------------------------------- record, replay, compare
@pytest.mark.parametrize("thresholds", [Thresholds(0.9, 0.2), Thresholds(0.6, 0.1), Thresholds(0.3, 0.01),
                                        Thresholds(0.3, 0.01, 0.2)])
def test_replay_of_a_recorded_run_matches_the_run_token_for_token(thresholds):
    e = engine(NEAR, FastModel(TARGET, layer_ids=SLIM_LAYERS, max_len=96))
    gen = run_viasd(e, thresholds, 32)
    assert set(gen.tiers) == {"accept", "slim", "full", "bonus"}, "the case must use every tier"
    blocks: list[BlockRecord] = recorded(e)
    replayed = replay(blocks, thresholds)
    plain = gen.stats.steps - len(blocks)  # plain target steps (only the last token, if one was left)
    assert plain in (0, 1) and len(blocks) == replayed.steps
    assert gen.tiers == replayed.tiers + ["full"] * plain
    assert len(gen.tokens) == replayed.tokens + plain
    assert gen.stats.target_passes == replayed.target_passes + plain
    assert gen.stats.slim_passes == replayed.slim_passes == len(blocks)
    assert gen.stats.draft_tokens == replayed.drafted
    if thresholds.confidence:  # the confidence condition sent some positions to the target
        assert replay(blocks, Thresholds(thresholds.accept, thresholds.slim)).tiers != replayed.tiers
    # the positions the target runs in the blocks' passes (after the prefill, before a last plain
    # step), in the same run without recording (recording runs the target every step for its labels)
    quiet = engine(NEAR, FastModel(TARGET, layer_ids=SLIM_LAYERS, max_len=96))
    quiet.observers.clear()
    calls = record_forward(quiet.target)
    assert run_viasd(quiet, thresholds, 32).tokens == gen.tokens
    assert sum(length for _, length in calls[1 : len(calls) - plain]) == replayed.target_positions
    # wrong tokens against the target's teacher-forced choices along the emitted text
    labels = target_argmax_along(TARGET, PROMPT, gen.tokens)
    wrong = sum(a != b for a, b in zip(labels, gen.tokens))
    assert wrong > 0, "the case must be lossy"
    assert replayed.wrong == wrong
    assert replayed.fidelity == 1 - wrong / replayed.tokens  # the plain step's token is the target's own
    assert fidelity(TARGET, PROMPT, gen.tokens) == pytest.approx(1 - wrong / len(gen.tokens), abs=1e-12)
