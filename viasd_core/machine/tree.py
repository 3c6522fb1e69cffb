"""`--tree auto|off|N`: the draft tree a session uses, chosen by measuring this machine.

`auto` measures two things once per (machine, pair, weight format) and caches them under the
user's cache folder (`viasd doctor --refresh` measures again; machine/record.py):

    verify curve   seconds of one target pass over 1..16 tokens after a cached context, here
    acceptance     tokens per target pass (tau) and drafting seconds per step of each candidate
                   (a plain step, chains of 1..5, three tree shapes) on a few shipped prompts

and picks the candidate of most expected tokens per second (speculation/tree_size.py). A chain or a
plain step means no tree (chains are what `sd` drafts without one); a draft model that grows no
trees has its chains measured alone (prompt lookup, which runs no model, is not measured). The
fastest chain is also where sd's adaptive block starts when the user gives no `-g`
(TreeChoice.best_chain, machine/first_block.py). `N` grows trees of N nodes without measuring;
`off` never grows one.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from viasd_core.speculation.drafters import NgramDrafter
from viasd_core.speculation.engine import Engine, GenerationConfig
from viasd_core.runtime.model import PASS_WIDTHS
from viasd_core.runtime.pass_timing import time_passes
from viasd_core.speculation.tree import TreeShape
from viasd_core.speculation.tree_size import Option, choose
from viasd_core.errors import UsageError
from viasd_core.machine.record import Decision

TREE_CHOICES = "auto, off or a node count 1-15"
CANDIDATE_TREES = (TreeShape(2, 4, 5), TreeShape(3, 5, 10), TreeShape(4, 6, 15))
NO_TREES = "the draft grows no trees (an EAGLE-3 head does) or the target uses sliding-window attention"
CHAIN = 5  # the probe's chain: tau of every shorter chain comes from its per-position acceptance
CURVE_WIDTHS = (1, 2, 3, 4, 6, 8, 11, 16)
PROBE_TOKENS = 32


def shape_for_size(size: int) -> TreeShape:
    """The tree grown for `--tree N`: wider at the top as N grows (EAGLE-2 style)."""
    topk = 2 if size <= 7 else 3 if size <= 11 else 4
    return TreeShape(topk, min(size, topk + 3), size)


def parse_tree(text: str | int | None) -> str | int:
    """'auto' | 'off' | N (1..15) from the option's text."""
    value = str(text if text is not None else "auto").strip().lower()
    if value in ("auto", "off"):
        return value
    if value.isdigit() and 1 <= int(value) <= PASS_WIDTHS[-1] - 1:
        return int(value)
    raise UsageError(f"--tree must be {TREE_CHOICES} (got '{text}')")


@dataclass
class TreeChoice:
    """What `--tree` resolved to and why (shown by doctor and --verbose)."""

    shape: TreeShape | None
    reason: str
    options: list[dict]  # every candidate: name, width, tau, draft_seconds, tokens_per_s (auto only)
    verify_seconds: dict[int, float]  # the measured curve (auto only)

    def to_dict(self) -> dict:
        """JSON-ready: the cache file, bench's meta block, doctor's report."""
        return {"shape": asdict(self.shape) if self.shape else None, "reason": self.reason, "options": self.options,
                "verify_seconds": {str(k): v for k, v in self.verify_seconds.items()}}

    def best_chain(self) -> int | None:
        """Drafts in the chain of most expected tokens/s among the probe's options (the first among
        equals); None where the probe did not run (`off`, `N`, no trees)."""
        chains = [o for o in self.options if o["shape"] is None and o["width"] > 1]
        if not chains:
            return None
        return max(chains, key=lambda o: (o["tokens_per_s"], -chains.index(o)))["width"] - 1



def resolve_tree(engine: Engine, prompts: list[list[int]], choice: str | int, key: dict, progress=None,
                 refresh: bool = False) -> TreeChoice:
    """The tree a session's sd steps grow. `prompts` (token ids) are what `auto` measures acceptance
    on; `key` names the pair and format (the cache key, with the machine's identity and the draft's
    weights fingerprint)."""
    choice = parse_tree(choice)
    if choice == "off":
        return TreeChoice(None, "--tree off", [], {})
    if engine.drafter is None:
        return TreeChoice(None, "no draft", [], {})
    if isinstance(engine.drafter, NgramDrafter):
        return TreeChoice(None, "prompt lookup grows no trees and drafts at no cost: nothing to measure", [], {})
    if isinstance(choice, int):
        if not engine.supports_tree:
            return TreeChoice(None, NO_TREES, [], {})
        return TreeChoice(shape_for_size(choice), f"--tree {choice}", [], {})
    weights = engine.drafter.weights_identity()
    if weights is not None:
        key = {**key, "draft_weights": weights}  # a head retrained in place is measured again
    record = DECISION.record(engine.device, key)
    cached = None if refresh else record.read(_from_json)
    if cached is not None:
        return cached
    if progress:
        progress("measuring this machine's verify costs and the draft's acceptance for --tree auto "
                 "(once; cached)...")
    verify, options = measure(engine, prompts)
    best = choose(options, verify)
    result = TreeChoice(best.shape, f"auto: {best.name} has the most expected tokens/s here "
                                    f"({best.rate(verify):.1f} measured"
                                    f"{'' if engine.supports_tree else '; ' + NO_TREES})",
                        [{**asdict(o), "shape": asdict(o.shape) if o.shape else None,
                          "tokens_per_s": o.rate(verify)} for o in options], verify)
    record.store(result.to_dict())
    return result


def measure_verify_curve(engine: Engine, widths=CURVE_WIDTHS, context: int = 128, repeats: int = 5) -> dict[int, float]:
    """Median seconds of a target pass over w tokens (all rows' logits: a verify pass) after
    `context` cached positions, for each width w (runtime/pass_timing.py)."""
    curve = time_passes(engine.target, widths, context, repeats)
    engine.reset()
    return curve


def probe_options(engine: Engine, prompts: list[list[int]], trees=CANDIDATE_TREES,
                  max_new: int = PROBE_TOKENS) -> list[Option]:
    """tau and drafting seconds per step of a plain step, chains of 1..CHAIN and the candidate
    `trees`, on `prompts` (greedy, fixed blocks)."""

    def run(tree: TreeShape | None):
        tokens = passes = steps = 0
        draft = 0.0
        attempts = accepts = None
        for ids in prompts:
            engine.reset()
            out = engine.generate(ids, GenerationConfig(mode="sd", max_new_tokens=max_new, gamma=CHAIN,
                                                        adaptive=False, tree=tree))
            s = out.stats
            tokens, passes, steps, draft = tokens + s.new_tokens, passes + s.target_passes, steps + s.steps, draft + s.time_draft
            attempts = _add(attempts, s.position_attempts)
            accepts = _add(accepts, s.position_accepts)
        engine.reset()
        return tokens / max(passes, 1), draft / max(steps, 1), attempts or [], accepts or []

    options = [Option("plain", None, 1, 1.0, 0.0)]
    _, chain_draft, attempts, accepts = run(None)
    tau = 1.0
    for g in range(1, CHAIN + 1):
        tau += accepts[g - 1] / attempts[g - 1] if g <= len(attempts) and attempts[g - 1] else 0.0
        options.append(Option(f"chain of {g}", None, g + 1, tau, chain_draft * g / CHAIN))
    for shape in trees:
        tau_t, draft_t, _, _ = run(shape)
        options.append(Option(f"tree of {shape.size} (top-{shape.topk}, depth {shape.depth})", shape, shape.size + 1,
                              tau_t, draft_t))
    return options


def _add(total: list[int] | None, more: list[int]) -> list[int]:
    total = list(total or [])
    total += [0] * (len(more) - len(total))
    return [t + (more[i] if i < len(more) else 0) for i, t in enumerate(total)]


def _from_json(data: dict) -> TreeChoice:
    shape = TreeShape(**data["shape"]) if data["shape"] else None
    return TreeChoice(shape, data["reason"] + " (cached)", data["options"],
                      {int(k): float(v) for k, v in data["verify_seconds"].items()})


def measure(engine: Engine, prompts: list[list[int]]) -> tuple[dict[int, float], list[Option]]:
    """This machine's verify curve and the draft's options on `prompts` (what `auto` chooses from)."""
    verify = measure_verify_curve(engine)
    return verify, probe_options(engine, prompts, CANDIDATE_TREES if engine.supports_tree else ())


# versions: 2: int8/int4 passes fused (their costs changed); 3: their rows attend through the row kernel;
# 4: the embedded head retrained (its acceptance changed); 5: int8/int4 short passes through cpu_packed_mm,
# rows attend faster; 6: cpu_packed_mm reads its scales block by block (a flatter verify curve); 7: int4
# layers' calls up to the MLP in one C call (every int4 pass ~1 ms faster)
DECISION = Decision("tree", "--tree auto", 7, measure,
                    "the draft tree, chain or plain step of most expected tokens/s from this machine's verify curve "
                    "and the draft's measured acceptance")
