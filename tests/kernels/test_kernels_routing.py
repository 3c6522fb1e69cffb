"""Tier routing + greedy acceptance for one block: reference vs naive maths, Triton vs reference.

The Triton tests run on CUDA when there is a GPU, else in the Triton interpreter on CPU
tensors. Triton reads TRITON_INTERPRET when it is first imported (its own tl.* helpers
are decorated then) and again when each kernel is decorated, so without CUDA this module
sets TRITON_INTERPRET=1 at import, before anything imports triton; the `fused` fixture
fails loudly if triton was imported earlier without it. Explicitly:
`TRITON_INTERPRET=1 pytest tests/kernels/test_kernels_routing.py`.

Random cases draw a fresh base seed per run; a failure prints it: rerun with
VIASD_TEST_SEED=<seed> to reproduce.
"""

from __future__ import annotations

import importlib
import math
import os
import secrets
import sys

import pytest
import torch

import viasd_kernels
from viasd_kernels import (
    TIER_ACCEPT,
    TIER_FULL,
    TIER_SLIM,
    RouteResult,
    route_block,
    route_block_reference,
    tiers_from_gate,
)

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
BASE_SEED = int(os.environ.get("VIASD_TEST_SEED", secrets.randbelow(2**31)))
NEG_INF = float("-inf")


# --- the naive float64 computation the reference must match --------------------------------


def naive_route(logits, draft_tokens, temperature, theta_accept, theta_slim) -> dict:
    """Softmax in float64, one row at a time, Python loops for the block logic."""
    T = temperature if temperature > 0 else 1.0
    rows = logits.double().cpu()
    drafts = draft_tokens.tolist()
    out = {"argmax": [], "max_logit": [], "lse": [], "token_logprob": [], "gate": [], "tiers": []}
    for r, row in enumerate(rows):
        values = row.tolist()
        out["argmax"].append(values.index(max(values)))  # first index of the max
        out["max_logit"].append(max(values))
        out["lse"].append(math.log(sum(math.exp(v / T) for v in values)))
        if r < len(drafts):
            probs = torch.softmax(row / T, dim=-1)
            p_draft = probs[drafts[r]].item()
            gate = p_draft / probs.max().item()
            out["token_logprob"].append(math.log(p_draft) if p_draft > 0 else NEG_INF)
            out["gate"].append(gate)
            out["tiers"].append(
                TIER_ACCEPT
                if gate >= theta_accept
                else TIER_SLIM
                if gate >= theta_slim
                else TIER_FULL
            )
    n_match = 0
    while n_match < len(drafts) and drafts[n_match] == out["argmax"][n_match]:
        n_match += 1
    out["n_match"] = n_match
    out["first_non_accept"] = next(
        (j for j, tier in enumerate(out["tiers"]) if tier != TIER_ACCEPT), len(drafts)
    )
    return out


def assert_matches_naive(result: RouteResult, naive: dict) -> None:
    assert result.argmax.tolist() == naive["argmax"]
    assert result.tiers.tolist() == naive["tiers"]
    assert result.n_match.item() == naive["n_match"]
    assert result.first_non_accept.item() == naive["first_non_accept"]
    for name in ("max_logit", "lse", "token_logprob", "gate"):
        expected = torch.tensor(naive[name], dtype=torch.float64)
        torch.testing.assert_close(
            getattr(result, name).double(), expected, rtol=1e-6, atol=1e-6, msg=name
        )


def assert_result_types(result: RouteResult, num_rows: int, num_draft: int) -> None:
    for name, dtype, shape in [
        ("argmax", torch.int64, (num_rows,)),
        ("max_logit", torch.float32, (num_rows,)),
        ("lse", torch.float32, (num_rows,)),
        ("token_logprob", torch.float32, (num_draft,)),
        ("gate", torch.float32, (num_draft,)),
        ("tiers", torch.int8, (num_draft,)),
        ("n_match", torch.int64, ()),
        ("first_non_accept", torch.int64, ()),
    ]:
        value = getattr(result, name)
        assert (value.dtype, tuple(value.shape)) == (dtype, shape), name


# --- hand-made blocks (G = 3; the optional 4th row is the bonus position) --------------------

# Row j scores block position j. Thresholds 0.5 / 0.1 unless a test says otherwise.
HAND_BLOCKS = {
    # ties: argmax is the lowest index; draft 2 ties the max (gate 1, accepted) but is not
    # the argmax, so the greedy count is 0 while the gate accepts everything.
    "ties": (
        [[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0], [0.0, 5.0, 1.0, 5.0], [4.0, 4.0, -1.0, 4.0]],
        [2, 0, 1],
        dict(argmax=[1, 0, 1, 0], tiers=[0, 0, 0], n_match=0, first_non_accept=3),
    ),
    "all_accepted": (
        [[0.0, 9.0, 1.0, 2.0], [7.0, 1.0, 1.0, 1.0], [0.5, 0.5, 0.5, 3.0], [1.0, 2.0, 3.0, 4.0]],
        [1, 0, 3],
        dict(argmax=[1, 0, 3, 3], tiers=[0, 0, 0], n_match=3, first_non_accept=3),
    ),
    "none_accepted": (
        [[0.0, 9.0, 1.0, 2.0], [7.0, 1.0, 1.0, 1.0], [0.5, 0.5, 0.5, 8.0], [1.0, 2.0, 3.0, 4.0]],
        [0, 1, 2],
        dict(argmax=[1, 0, 3, 3], tiers=[2, 2, 2], n_match=0, first_non_accept=0),
    ),
    # accept, then slim (gate e^-1 = 0.37; e^(-1/0.7) = 0.24 at T = 0.7), then full (gate
    # e^-5 = 0.007); the greedy count stops at position 1 where the draft is not the argmax.
    "one_of_each_tier": (
        [[3.0, 0.0, 0.0, 0.0], [0.0, 2.0, 1.0, 0.0], [5.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]],
        [0, 2, 1],
        dict(argmax=[0, 1, 0, 0], tiers=[0, 1, 2], n_match=1, first_non_accept=1),
    ),
    # masked vocabulary (top-k style -inf): a masked draft token has gate 0 and logprob -inf.
    "masked_vocab": (
        [
            [NEG_INF, 1.0, NEG_INF, 0.0],
            [2.0, NEG_INF, 2.0, NEG_INF],
            [0.0, 1.0, 2.0, NEG_INF],
            [NEG_INF, NEG_INF, 1.0, NEG_INF],
        ],
        [1, 0, 3],
        dict(argmax=[1, 0, 2, 2], tiers=[0, 0, 2], n_match=2, first_non_accept=2),
    ),
}


def hand_block(name: str, with_bonus: bool, dtype=torch.float32, device="cpu"):
    rows, drafts, expected = HAND_BLOCKS[name]
    num_rows = len(drafts) + 1 if with_bonus else len(drafts)
    logits = torch.tensor(rows[:num_rows], dtype=dtype, device=device)
    draft_tokens = torch.tensor(drafts, dtype=torch.int64, device=device)
    expected = dict(expected, argmax=expected["argmax"][:num_rows])
    return logits, draft_tokens, expected


@pytest.mark.parametrize("with_bonus", [False, True], ids=["R=G", "R=G+1"])
@pytest.mark.parametrize("temperature", [0.0, 0.7])
@pytest.mark.parametrize("name", sorted(HAND_BLOCKS))
def test_reference_matches_naive_on_hand_blocks(name, temperature, with_bonus):
    logits, draft_tokens, expected = hand_block(name, with_bonus)
    result = route_block_reference(logits, draft_tokens, temperature, 0.5, 0.1)

    assert_result_types(result, logits.shape[0], draft_tokens.shape[0])
    assert_matches_naive(result, naive_route(logits, draft_tokens, temperature, 0.5, 0.1))
    assert result.argmax.tolist() == expected["argmax"]
    assert result.tiers.tolist() == expected["tiers"]
    assert result.n_match.item() == expected["n_match"]
    assert result.first_non_accept.item() == expected["first_non_accept"]


def test_bonus_row_only_adds_row_statistics():
    logits, draft_tokens, _ = hand_block("one_of_each_tier", with_bonus=True)
    with_bonus = route_block_reference(logits, draft_tokens, 0.7, 0.5, 0.1)
    without = route_block_reference(logits[:-1], draft_tokens, 0.7, 0.5, 0.1)
    for name in RouteResult._fields:
        block_part = getattr(with_bonus, name)
        if block_part.ndim == 1 and block_part.shape[0] == logits.shape[0]:
            block_part = block_part[:-1]
        assert torch.equal(block_part, getattr(without, name)), name


def test_temperature_zero_means_temperature_one_for_the_gate():
    logits, draft_tokens, _ = hand_block("one_of_each_tier", with_bonus=True)
    greedy = route_block_reference(logits, draft_tokens, 0.0, 0.5, 0.1)
    unit = route_block_reference(logits, draft_tokens, 1.0, 0.5, 0.1)
    warm = route_block_reference(logits, draft_tokens, 0.7, 0.5, 0.1)
    for name in RouteResult._fields:
        assert torch.equal(getattr(greedy, name), getattr(unit, name)), name
    assert torch.allclose(greedy.gate, torch.tensor([1.0, math.exp(-1.0), math.exp(-5.0)]))
    # r_T = r_1 ** (1 / T): a lower temperature sharpens the gate, argmax and n_match do not move.
    torch.testing.assert_close(warm.gate, greedy.gate ** (1 / 0.7))
    assert torch.equal(warm.argmax, greedy.argmax) and warm.n_match == greedy.n_match
    assert not torch.allclose(warm.lse, greedy.lse)


def test_thresholds_exactly_at_the_gate_value():
    # Row 0 drafts the argmax (gate exactly 1.0); row 1's gate is some float32 value g.
    logits = torch.tensor([[2.0, 0.0, 0.0], [0.0, 1.3, 0.2]])
    draft_tokens = torch.tensor([0, 2])
    g = route_block_reference(logits, draft_tokens, 0.7, 0.5, 0.1).gate[1].item()
    just_above_g = torch.nextafter(torch.tensor(g), torch.tensor(1.0)).item()

    def tiers(theta_accept, theta_slim):
        return route_block_reference(
            logits, draft_tokens, 0.7, theta_accept, theta_slim
        ).tiers.tolist()

    assert tiers(1.0, 1.0) == [TIER_ACCEPT, TIER_FULL]  # r = 1 >= theta_accept = 1
    assert tiers(g, 0.0) == [TIER_ACCEPT, TIER_ACCEPT]  # r == theta_accept -> accept
    assert tiers(just_above_g, g) == [TIER_ACCEPT, TIER_SLIM]  # r == theta_slim -> slim
    assert tiers(just_above_g, just_above_g) == [TIER_ACCEPT, TIER_FULL]
    assert tiers(0.0, 0.0) == [TIER_ACCEPT, TIER_ACCEPT]  # theta_accept = 0 accepts everything


def test_tiers_from_gate_is_the_rule_route_block_applies():
    logits, draft_tokens, _ = hand_block("one_of_each_tier", with_bonus=True)
    result = route_block_reference(logits, draft_tokens, 0.7, 0.5, 0.1)
    recorded = torch.tensor(result.gate.tolist())  # through Python floats, as calibration records them
    assert torch.equal(tiers_from_gate(recorded, 0.5, 0.1), result.tiers)
    assert tiers_from_gate(recorded, 0.5, 0.1).tolist() == [TIER_ACCEPT, TIER_SLIM, TIER_FULL]
    # Thresholds compare in float32: one a hair above a gate in float64 is that gate in float32.
    g = result.gate[1].item()
    theta = g + 1e-12
    assert theta > g and torch.tensor(theta, dtype=torch.float32).item() == g
    assert route_block_reference(logits, draft_tokens, 0.7, theta, 0.0).tiers[1] == TIER_ACCEPT
    assert tiers_from_gate(recorded, theta, 0.0).tolist() == [TIER_ACCEPT, TIER_ACCEPT, TIER_SLIM]
    assert tiers_from_gate(torch.tensor([float("nan"), 1.0]), 0.0, 0.0).tolist() == [TIER_FULL, TIER_ACCEPT]


def tiers_at_exact_gates(route, device="cpu") -> dict:
    """Tiers where the gates are exactly 1 (draft = argmax) and 0 (a masked draft token).

    exp(0) = 1 and exp(-inf) = 0 in every exp implementation, so the `>=` boundaries can be
    checked exactly on any backend.
    """
    logits, draft_tokens, _ = hand_block("masked_vocab", with_bonus=False, device=device)
    thetas = {"accept_1_slim_0": (1.0, 0.0), "both_0": (0.0, 0.0), "both_1": (1.0, 1.0)}
    return {
        name: route(logits, draft_tokens, 0.7, theta_accept, theta_slim).tiers.tolist()
        for name, (theta_accept, theta_slim) in thetas.items()
    }


EXACT_GATE_TIERS = {
    "accept_1_slim_0": [TIER_ACCEPT, TIER_ACCEPT, TIER_SLIM],  # r = 1 >= 1; r = 0 >= 0
    "both_0": [TIER_ACCEPT, TIER_ACCEPT, TIER_ACCEPT],  # theta_accept = 0 accepts everything
    "both_1": [TIER_ACCEPT, TIER_ACCEPT, TIER_FULL],
}


def test_reference_tiers_at_gates_exactly_zero_and_one():
    assert tiers_at_exact_gates(route_block_reference) == EXACT_GATE_TIERS


def test_reference_computes_in_float32_for_half_inputs():
    logits, draft_tokens, expected = hand_block("one_of_each_tier", with_bonus=True)
    for dtype in (torch.bfloat16, torch.float16):
        result = route_block_reference(logits.to(dtype), draft_tokens, 0.7, 0.5, 0.1)
        assert_result_types(result, 4, 3)
        assert result.tiers.tolist() == expected["tiers"]


BAD_INPUTS = [
    (dict(logits=torch.zeros(3)), "2-D"),
    (dict(draft_tokens=torch.zeros(1, 3, dtype=torch.int64)), "1-D"),
    (dict(draft_tokens=torch.zeros(0, dtype=torch.int64)), "at least one"),
    (dict(logits=torch.zeros(5, 10)), "G or G \\+ 1 rows"),
    (dict(logits=torch.zeros(2, 10)), "G or G \\+ 1 rows"),
    (dict(logits=torch.zeros(4, 0)), "empty vocabulary"),
    (dict(logits=torch.zeros(4, 10, dtype=torch.float64)), "float32, bfloat16 or float16"),
    (dict(draft_tokens=torch.zeros(3, dtype=torch.int32)), "int64"),
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(theta_accept=0.2, theta_slim=0.3), "theta_slim <= theta_accept"),
    (dict(theta_accept=2.5), "theta_accept <= 2"),
    (dict(theta_slim=-0.1), "0 <= theta_slim"),
    (dict(theta_accept=float("nan")), "theta_accept"),
]


@pytest.mark.parametrize("bad, message", BAD_INPUTS, ids=[m for _, m in BAD_INPUTS])
def test_bad_inputs_raise_clear_value_errors(bad, message):
    args = dict(
        logits=torch.zeros(4, 10),
        draft_tokens=torch.zeros(3, dtype=torch.int64),
        temperature=0.7,
        theta_accept=0.5,
        theta_slim=0.1,
    )
    args.update(bad)
    with pytest.raises(ValueError, match=message):
        route_block(
            args["logits"],
            args["draft_tokens"],
            args["temperature"],
            args["theta_accept"],
            args["theta_slim"],
        )


def test_route_block_uses_the_reference_on_cpu():
    logits, draft_tokens, _ = hand_block("ties", with_bonus=True)
    result = route_block(logits, draft_tokens, 0.7, 0.5, 0.1)
    expected = route_block_reference(logits, draft_tokens, 0.7, 0.5, 0.1)
    for name in RouteResult._fields:
        assert torch.equal(getattr(result, name), getattr(expected, name)), name


# --- Triton vs reference ---------------------------------------------------------------------


@pytest.mark.skipif(not os.environ.get("CI"), reason="only CI is required to have triton")
def test_triton_is_installed_in_ci():
    # The Triton tests below skip without triton; CI must never skip them silently.
    import triton  # noqa: F401

    assert viasd_kernels.triton_available()


@pytest.fixture(scope="module")
def fused():
    """(route_block_triton, device): compiled on CUDA, else the Triton interpreter on CPU."""
    triton = pytest.importorskip("triton")
    name = "viasd_kernels.triton_routing"
    if HAS_CUDA:
        yield importlib.import_module(name).route_block_triton, "cuda"
        return
    from triton.runtime.interpreter import InterpretedFunction

    # triton's own @jit helpers (tl.sigmoid...) are decorated once, when triton is imported.
    if not isinstance(triton.language.sigmoid, InterpretedFunction):
        pytest.fail(
            "no CUDA and triton is not in interpreter mode (TRITON_INTERPRET was unset or 0 when "
            "triton was imported); run: TRITON_INTERPRET=1 pytest tests/kernels/test_kernels_routing.py"
        )
    with pytest.MonkeyPatch.context() as mp:
        # Decorate the kernels afresh in case their module was imported in compiled mode.
        mp.delitem(sys.modules, name, raising=False)
        mp.delattr(viasd_kernels, "triton_routing", raising=False)
        yield importlib.import_module(name).route_block_triton, "cpu"


def assert_same_routing(actual: RouteResult, expected: RouteResult, context: str) -> None:
    for name in ("argmax", "max_logit", "tiers", "n_match", "first_non_accept"):
        assert torch.equal(getattr(actual, name), getattr(expected, name)), f"{name} {context}"
    for name in ("lse", "token_logprob"):
        torch.testing.assert_close(
            getattr(actual, name),
            getattr(expected, name),
            rtol=1e-5,
            atol=1e-5,
            msg=lambda m, name=name: f"{name} {context}\n{m}",
        )
    torch.testing.assert_close(
        actual.gate,
        expected.gate,
        rtol=1e-5,
        atol=1e-7,
        msg=lambda m: f"gate {context}\n{m}",
    )


def random_block(vocab_size, num_draft, with_bonus, dtype, temperature, seed, device):
    """Random logits and drafts that exercise every tier and a random greedy prefix length.

    The first n_agree drafts are the argmax; the others are either a token whose logit is
    put at most 2.5 below the row max (gate in [0.03, 1]) or a uniformly random token.
    """
    generator = torch.Generator().manual_seed(seed)
    num_rows = num_draft + 1 if with_bonus else num_draft
    logits = torch.randn(num_rows, vocab_size, generator=generator) * 4.0
    draft_tokens = torch.randint(0, vocab_size, (num_draft,), generator=generator)
    kinds = torch.randint(0, 2, (num_draft,), generator=generator)
    near_gaps = torch.rand(num_draft, generator=generator) * 2.5
    for j in range(num_draft):
        if kinds[j] == 0:
            logits[j, draft_tokens[j]] = logits[j].max() - near_gaps[j]
    logits = logits.to(dtype)
    n_agree = int(torch.randint(0, num_draft + 1, (1,), generator=generator))
    draft_tokens[:n_agree] = logits[:n_agree].float().argmax(dim=-1)
    return logits.to(device), draft_tokens.to(device)


# (V, G) pairs: every V with every G, except the big vocabulary (slow in the interpreter).
RANDOM_SIZES = [(v, g) for v in (100, 8193, 49152) for g in (1, 2, 7, 16)] + [
    (151936, 1),
    (151936, 2),
]
# Interpreter chunk width: big chunks keep the CPU run short while still covering several
# chunks and a masked tail (100 -> 1 chunk with tail, 8193 -> 2, 49152 -> 6 exact, 151936 -> 3).
INTERPRETER_BLOCK_V = {100: 128, 8193: 8192, 49152: 8192, 151936: 65536}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "vocab_size, num_draft", RANDOM_SIZES, ids=[f"V{v}-G{g}" for v, g in RANDOM_SIZES]
)
def test_triton_matches_reference_on_random_blocks(fused, vocab_size, num_draft, dtype):
    route_block_triton, device = fused
    block_v = None if device == "cuda" else INTERPRETER_BLOCK_V[vocab_size]
    case = RANDOM_SIZES.index((vocab_size, num_draft)) * 2 + (dtype == torch.bfloat16)
    seed = BASE_SEED + case
    with_bonus = seed % 2 == 0
    temperature = (0.0, 0.7)[(seed // 2) % 2]
    logits, draft_tokens = random_block(
        vocab_size, num_draft, with_bonus, dtype, temperature, seed, device
    )

    actual = route_block_triton(logits, draft_tokens, temperature, 0.6, 0.15, block_v=block_v)
    expected = route_block_reference(logits, draft_tokens, temperature, 0.6, 0.15)

    assert_result_types(actual, logits.shape[0], num_draft)
    context = f"(seed {seed}, T {temperature}, R {logits.shape[0]}; VIASD_TEST_SEED={BASE_SEED})"
    assert_same_routing(actual, expected, context)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("with_bonus", [False, True], ids=["R=G", "R=G+1"])
@pytest.mark.parametrize("name", sorted(HAND_BLOCKS))
def test_triton_matches_hand_blocks(fused, name, with_bonus, dtype):
    route_block_triton, device = fused
    logits, draft_tokens, expected = hand_block(name, with_bonus, dtype, device)
    for temperature in (0.0, 0.7):
        result = route_block_triton(logits, draft_tokens, temperature, 0.5, 0.1)
        assert result.argmax.tolist() == expected["argmax"]
        assert result.tiers.tolist() == expected["tiers"]
        assert result.n_match.item() == expected["n_match"]
        assert result.first_non_accept.item() == expected["first_non_accept"]
        reference = route_block_reference(logits, draft_tokens, temperature, 0.5, 0.1)
        assert_same_routing(result, reference, f"({name}, T {temperature})")


def test_triton_tiers_follow_tiers_from_gate_at_a_float32_boundary(fused):
    route_block_triton, device = fused
    logits, draft_tokens, _ = hand_block("one_of_each_tier", with_bonus=True, device=device)
    gate = route_block_triton(logits, draft_tokens, 0.7, 0.5, 0.1).gate.cpu()
    for theta in (gate[1].item(), gate[1].item() + 1e-12, gate[2].item() + 1e-12):
        result = route_block_triton(logits, draft_tokens, 0.7, theta, theta / 2)
        assert torch.equal(result.tiers.cpu(), tiers_from_gate(gate, theta, theta / 2)), theta


def test_triton_tiers_at_gates_exactly_zero_and_one(fused):
    route_block_triton, device = fused
    assert tiers_at_exact_gates(route_block_triton, device) == EXACT_GATE_TIERS


def test_triton_ties_across_chunks_pick_the_lowest_index(fused):
    # With BLOCK_V = 128, columns c and c + 128 share a lane: the first chunk must win
    # inside a lane, and the lowest column must win across lanes.
    route_block_triton, device = fused
    logits = torch.zeros(3, 300)
    logits[0, [5, 133, 261]] = 7.0  # one lane, three chunks -> 5
    logits[1, [130, 3]] = 7.0  # lane 2 in chunk 1 vs lane 3 in chunk 0 -> 3
    logits[2, [299, 171]] = 7.0  # both in later chunks, masked tail -> 171
    logits = logits.to(device)
    draft_tokens = torch.tensor([133, 3], device=device)
    result = route_block_triton(logits, draft_tokens, 0.7, 0.5, 0.1, block_v=128)
    assert result.argmax.tolist() == [5, 3, 171]
    assert result.tiers.tolist() == [TIER_ACCEPT, TIER_ACCEPT]  # a tied draft has gate 1
    assert result.n_match.item() == 0
    assert_same_routing(result, route_block_reference(logits, draft_tokens, 0.7, 0.5, 0.1), "")


def test_triton_default_chunking_and_strided_rows(fused):
    # Default BLOCK_V (several chunks with a masked tail) on a row-strided view.
    route_block_triton, device = fused
    logits, draft_tokens = random_block(8193, 3, True, torch.float32, 0.7, BASE_SEED, device)
    padded = torch.zeros(4, 8200, device=device)
    padded[:, :8193] = logits
    view = padded[:, :8193]
    assert not view.is_contiguous()
    actual = route_block_triton(view, draft_tokens, 0.7, 0.6, 0.15)
    expected = route_block_reference(logits, draft_tokens, 0.7, 0.6, 0.15)
    assert_same_routing(actual, expected, f"(seed {BASE_SEED})")


def test_triton_routes_out_of_range_draft_tokens_to_full(fused):
    # The reference raises (torch.gather); the kernel reads NaN and routes to the full tier.
    route_block_triton, device = fused
    logits = torch.randn(2, 100, device=device)
    draft_tokens = torch.tensor([100, -1], device=device)
    result = route_block_triton(logits, draft_tokens, 0.7, 0.5, 0.1)
    assert result.tiers.tolist() == [TIER_FULL, TIER_FULL]
    assert result.gate.isnan().all() and result.first_non_accept.item() == 0


def test_triton_rejects_a_block_v_that_is_not_a_power_of_two(fused):
    route_block_triton, device = fused
    logits, draft_tokens, _ = hand_block("ties", with_bonus=False, device=device)
    with pytest.raises(ValueError, match="power of two"):
        route_block_triton(logits, draft_tokens, 0.7, 0.5, 0.1, block_v=100)


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_route_block_on_cuda_uses_triton_without_host_sync():
    pytest.importorskip("triton")
    logits, draft_tokens = random_block(151936, 8, True, torch.bfloat16, 0.7, BASE_SEED, "cuda")
    route_block(logits, draft_tokens, 0.7, 0.6, 0.15)  # compile outside the sync check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        result = route_block(logits, draft_tokens, 0.7, 0.6, 0.15)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    expected = route_block_reference(logits, draft_tokens, 0.7, 0.6, 0.15)
    assert_same_routing(result, expected, f"(seed {BASE_SEED})")
