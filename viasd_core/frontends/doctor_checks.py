"""doctor's checks: the compiled pass against the eager one, and the exact modes against `ar`.

What "equal" means is the engine's promise for the target as it runs (speculation/exactness.py's
`promise`, shown as `exactness` in the report and in --json), never the dtype alone. Where the
promise is bit-exact (eager passes on a CPU whose short passes are row-invariant, as in float32 and
the int8/int4 weight-only formats, whose activations are bfloat16) any divergence fails: a token's
logits do not depend on the pass that computed them, so a flip, however near the tie, is a broken
invariant. Where it is "up to rounding" (bitsandbytes' 8bit/4bit kernels, which round a row
differently with the number of rows in its pass; compiled passes; anything on a GPU, not measured
here) the exact modes may flip a near-tie: a token is scored by passes of different widths in
different modes (`ar` one position at a time, `sd` a whole block), and kernels reduce a different
number of rows or queries in a different order. A development probe on CPU (the embedded SmolLM2,
--quant none, bf16 before its passes were row-invariant; 16 shipped prompts x 32 greedy positions,
each row's top 5 logits, `ar`'s 1-token passes against one pass over the whole text): the same
position's logits differed by up to 4 bf16 spacings at the row's largest |logit|, and where that
flipped the argmax (5 positions), `ar`'s own margin between the two tokens was at most 1 spacing.
So there a divergence fails only when `ar`'s logits separate the two tokens (`ar`'s choice and the
other mode's) by more than RESOLUTION_FACTOR spacings at the row's largest |logit| of the dtype the
kernels round in (`rounding_dtype`: float16 for bitsandbytes, whose kernels compute in it, unless
the model runs in bfloat16; the model's dtype otherwise): twice the largest measured difference,
since a flip needs both logits to move. The margin at each first divergence is in the report
(`--json`: the check's `facts`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from viasd_core.speculation.engine import GenerationConfig
from viasd_core.speculation.exactness import Promise, promise
from viasd_core.runtime.model import FastModel
from viasd_core.speculation.tree import TreeShape
from viasd_core.runtime.slim_view import SlimView, slim_verifier
from viasd_core.session import Session

PASS, FAIL, SKIP = "pass", "fail", "skip"
RESOLUTION_FACTOR = 8  # spacings of a bf16/fp16 row's largest |logit| that rounding alone explains
FLOAT32_PASS_TOLERANCE = 1e-3  # compiled vs eager in float32: inductor fuses, so not bit for bit


@dataclass
class Check:
    name: str
    status: str  # pass / fail / skip
    detail: str
    facts: dict = field(default_factory=dict)  # the measured numbers behind the status (--json)


def cuda_graphs_recorded(device: torch.device) -> int | None:
    """CUDA graphs inductor's CUDA-graph trees hold for `device` (recorded, not warm-up runs): 0 off
    CUDA or before any was recorded; None where this torch's trees cannot be read."""
    if device.type != "cuda":
        return 0
    try:
        from torch._inductor import cudagraph_trees

        index = device.index if device.index is not None else torch.cuda.current_device()
        manager = cudagraph_trees.get_manager(index, create_if_none_exists=False)
        if manager is None:
            return 0
        nodes = [node for roots in manager.roots.values() for node in roots]
        count = 0
        while nodes:
            node = nodes.pop()
            count += 1
            nodes.extend(child for children in node.children.values() for child in children)
        return count
    except (ImportError, AttributeError, TypeError):
        return None


# ---------------------------------------------------------------------- rounding
EXACT, ROUNDING = "bit-exact", "up to rounding"  # the two promises, as the report names them


def bit_exact(dtype: torch.dtype) -> bool:
    """The dtype's own default where no promise is given: bit for bit in float32 only. The checks
    follow the engine's promise for the model instead (`exactness`)."""
    return dtype not in (torch.bfloat16, torch.float16)


def exactness(model: FastModel) -> Promise:
    """What the exact modes promise against `ar` for `model` as it runs (speculation/exactness.py)."""
    return promise(model)


def promise_words(p: Promise) -> str:
    """The promise as the report says it."""
    return (f"{EXACT}: sd and exact emit ar's greedy tokens bit for bit" if p.exact
            else f"{ROUNDING}: sd and exact equal ar up to the kernel's rounding (a near-tie may flip)")


def rounding_dtype(model: FastModel) -> torch.dtype:
    """The dtype whose resolution a near-tie is judged in where the promise is up to rounding:
    bitsandbytes' kernels compute in float16 (bfloat16 where the model runs in it), others in the
    model's own dtype."""
    if model.quantized:
        return torch.bfloat16 if model.dtype == torch.bfloat16 else torch.float16
    return model.dtype


def spacing(dtype: torch.dtype, magnitude: float) -> float:
    """The distance between neighbouring `dtype` numbers at `magnitude`: eps * 2**floor(log2 |x|)."""
    info = torch.finfo(dtype)
    return info.eps * 2.0 ** math.floor(math.log2(max(abs(magnitude), info.tiny)))


def logit_scale(logits: torch.Tensor) -> float:
    """The largest finite |logit| of `logits` (0.0 when none is finite)."""
    finite = logits[torch.isfinite(logits)]
    return float(finite.abs().max()) if finite.numel() else 0.0


def rounding_limit(dtype: torch.dtype, logits: torch.Tensor, exact: bool | None = None) -> float | None:
    """The largest logit difference rounding alone explains in `logits` computed in `dtype`:
    RESOLUTION_FACTOR spacings at their largest |logit|; None where the passes must be bit-exact
    (`exact`: the engine's promise; None: the dtype's default, bit_exact)."""
    exact = bit_exact(dtype) if exact is None else exact
    return None if exact else RESOLUTION_FACTOR * spacing(dtype, logit_scale(logits))


def judge_divergence(reference: torch.Tensor, ar_token: int, token: int, dtype: torch.dtype,
                     exact: bool | None = None) -> dict:
    """Whether a mode emitting `token` where ar emitted `ar_token` is a rounding flip of a near-tie.

    `reference`: ar's logits [V] that chose `ar_token`. The margin is how much more they score
    `ar_token` than `token`; it is tolerated when within rounding_limit (never where the promise,
    `exact`, is bit-exact; None: the dtype's default).
    """
    limit = rounding_limit(dtype, reference, exact)
    margin = float(reference[ar_token] - reference[token])
    chose = bool(reference[ar_token] == reference.max())  # the logits are ar's own choice
    if not math.isfinite(margin):  # `token` is masked out (-inf): no rounding gets there
        return {"ar_token": int(ar_token), "token": int(token), "margin": None, "limit": limit,
                "scale": logit_scale(reference), "tolerated": False, "why": "ar's logits rule the token out"}
    return {"ar_token": int(ar_token), "token": int(token), "margin": margin, "limit": limit,
            "scale": logit_scale(reference), "tolerated": chose and limit is not None and margin <= limit}


@torch.inference_mode()
def check_compiled_matches_eager(session: Session, probe_ids: list[int]) -> Check:
    """The compiled target pass against the same pass run eagerly, on prefill, steps and a block."""
    engine = session.engine
    if not engine.compiled:
        return Check("compiled == eager", SKIP, "not compiled (eager path): nothing to compare")
    target = engine.target
    eager = FastModel(target.hf_model, max_len=len(probe_ids) + 16, name="eager")
    eager.vocab_limit = target.vocab_limit
    ids = torch.tensor(probe_ids, dtype=torch.long, device=engine.device)
    n = len(probe_ids) - 6
    engine.reset()
    worst, worst_limit, excess = 0.0, 0.0, 0.0
    passes = []
    for start, length in ((0, n), (n, 1), (n + 1, 1), (n + 2, 4)):
        rows = length if start else 1
        want = eager.forward(ids[start : start + length], start, rows)
        got = target.forward(ids[start : start + length], start, rows)
        finite = torch.isfinite(want)
        diff = float((got[finite] - want[finite]).abs().max())
        limit = rounding_limit(target.dtype, want)
        limit = FLOAT32_PASS_TOLERANCE if limit is None else limit
        ratio = diff / limit if math.isfinite(diff) else math.inf  # a NaN or inf in the compiled pass fails
        passes.append({"start": start, "length": length, "difference": diff, "limit": limit})
        if ratio >= excess:
            worst, worst_limit, excess = diff, limit, ratio
    engine.reset()
    status = PASS if excess <= 1 else FAIL
    return Check("compiled == eager", status, f"largest logit difference {worst:.2e} (limit {worst_limit:.1e})",
                 {"largest_difference": worst, "limit": worst_limit, "passes": passes})


# ---------------------------------------------------------------------- exact modes
class ScoreTap:
    """Keeps a copy of the last logit row of every pass `model.extend` runs while entered, by the
    position of the token that row chooses (the engine's steps call `extend`)."""

    def __init__(self, model: FastModel):
        self.model = model
        self.rows: dict[int, torch.Tensor] = {}  # position of the chosen token -> its logits [V]

    def __enter__(self) -> "ScoreTap":
        self._shadowed = vars(self.model).get("extend")  # a wrapper already set on the instance, if any
        inner = self.model.extend

        def extend(ids, end, n_logits=1):
            logits = inner(ids, end, n_logits)
            self.rows[end] = logits[-1].clone()  # CUDA graphs overwrite their outputs on the next run
            return logits

        self.model.extend = extend  # shadows the method on this instance only
        return self

    def __exit__(self, *exc) -> None:
        if self._shadowed is None:
            del self.model.extend
        else:
            self.model.extend = self._shadowed


def _first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _divergence(engine, ids: list[int], mode: str, max_new_tokens: int, tree: TreeShape | None = None) -> dict | None:
    """ar and `mode` on one prompt: None when they emit the same tokens, else the first divergence
    judged against ar's logits there (judge_divergence, plus `new_token`: its index)."""
    engine.reset()
    with ScoreTap(engine.target) as tap:
        ar = engine.generate(ids, GenerationConfig(mode="ar", max_new_tokens=max_new_tokens)).tokens
    engine.reset()
    got = engine.generate(ids, GenerationConfig(mode=mode, max_new_tokens=max_new_tokens, tree=tree)).tokens
    where = _first_difference(ar, got)
    if where is None:
        return None
    reference = tap.rows.get(len(ids) + where)
    ended = where >= min(len(ar), len(got))
    if ended or reference is None:
        return {"new_token": where, "ar_token": ar[where] if where < len(ar) else None,
                "token": got[where] if where < len(got) else None, "margin": None, "limit": None,
                "scale": None, "tolerated": False,
                "why": "one of them ended early" if ended else "no logits of ar's seen there"}
    target = engine.target
    exact = exactness(target).exact
    return {"new_token": where, **judge_divergence(reference, ar[where], got[where],
                                                   target.dtype if exact else rounding_dtype(target), exact)}


def _describe(d: dict, dtype: torch.dtype, label: str) -> str:
    """`dtype`: the one near-ties are judged in; `label`: what runs (float32, int8, 4bit, ...)."""
    if d["margin"] is None:
        return d["why"]
    if d["limit"] is None:
        return f"margin {d['margin']:.3g}; {label} must match exactly (promised bit-exact here)"
    sign = "<=" if d["tolerated"] else ">"
    return (f"margin {d['margin']:.3g} {sign} {d['limit']:.3g} = {RESOLUTION_FACTOR} "
            f"{str(dtype).replace('torch.', '')} spacings at |logit| {d['scale']:.3g}")


def _label(session: Session) -> str:
    """What the target runs as: its weight format where it has one, else its dtype."""
    fmt = str(session.target.format)
    return fmt if fmt not in ("none", "None", "") else str(session.engine.target.dtype).replace("torch.", "")


def check_exact_mode(session: Session, mode: str, prompts_ids: list[list[int]], max_new_tokens: int,
                     tree: TreeShape | None = None) -> Check:
    """`mode` (sd over trees of `tree`'s shape, if given) must emit ar's greedy tokens on every
    prompt: bit for bit where the engine promises it (`exactness`); elsewhere up to rounding flips
    of near-ties at the first divergence (see the module doc)."""
    engine = session.engine
    name = f"{mode} == ar (greedy)" if tree is None else f"{mode} with trees of {tree.size} == ar (greedy)"
    if engine.drafter is None:
        return Check(name, SKIP, "no draft (--draft none)")
    if tree is not None and not engine.supports_tree:
        return Check(name, SKIP, "the draft grows no trees")
    promised = exactness(engine.target)
    dtype = engine.target.dtype if promised.exact else rounding_dtype(engine.target)
    label = _label(session)
    own_slim = engine.slim
    if mode == "exact" and own_slim is None:
        # exactness does not depend on which layers the slim keeps: the first half and the last
        n_layers = engine.target.shape.n_layers
        engine.slim = slim_verifier(engine.target, SlimView(tuple(sorted(set(range(n_layers // 2)) | {n_layers - 1}))))
    divergences = []
    try:
        for i, ids in enumerate(prompts_ids):
            d = _divergence(engine, ids, mode, max_new_tokens, tree)
            if d is not None:
                divergences.append({"prompt": i + 1, **d})
    finally:
        engine.slim = own_slim
        engine.reset()
    facts = {"rule": "bit-exact" if promised.exact else "rounding", "promise": EXACT if promised.exact else ROUNDING,
             "why": promised.why, "factor": RESOLUTION_FACTOR, "divergences": divergences}
    failed = [d for d in divergences if not d["tolerated"]]
    if failed:
        d = failed[0]
        return Check(name, FAIL, f"prompt {d['prompt']}: differs from ar at new token {d['new_token']} "
                                 f"({_describe(d, dtype, label)})", facts)
    if divergences:
        d = divergences[0]
        return Check(name, PASS, f"{len(prompts_ids) - len(divergences)} of {len(prompts_ids)} prompts identical; "
                                 f"the others flip a near-tie, equal to ar up to the kernel's rounding (prompt "
                                 f"{d['prompt']} at new token {d['new_token']}: {_describe(d, dtype, label)})", facts)
    kind = "bit-exact" if promised.exact else "equal to ar up to the kernel's rounding, and here identical"
    return Check(name, PASS, f"{len(prompts_ids)} prompts x {max_new_tokens} tokens identical ({label}: {kind})", facts)
