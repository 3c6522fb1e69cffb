"""The summary of a `viasd bench` run: per method, recomputed from the result rows alone (so
`summary.json` can always be checked against `results.jsonl`)."""

from __future__ import annotations

import statistics

from viasd_core.bench.harness import PHASES
from viasd_core.speculation.stats import NO_DRAFT, TIERS

PLAIN = "plain"  # acceptance_breakdown's step_counts: steps that asked no draft (the draft policy's plain steps)


def _mean(xs):
    return sum(xs) / len(xs) if xs else None


def _std(xs):
    return statistics.stdev(xs) if len(xs) > 1 else 0.0 if xs else None


def _ratio(a, b):
    return a / b if a is not None and b else None


def summarize(rows: list[dict], statuses: dict[str, dict], peaks: dict[str, int] | None = None,
              methods: list[str] | None = None) -> dict[str, dict]:
    """Per method, recomputed from the result rows only (status 'ok')."""
    peaks = peaks or {}
    methods = methods or list(statuses)
    ok = {m: [r for r in rows if r["method"] == m and r["status"] == "ok"] for m in methods}
    tps = {m: _mean([r["tokens_per_s"] for r in rs]) for m, rs in ok.items()}
    cats = sorted({r["category"] for rs in ok.values() for r in rs})
    cat_tps = {m: {c: _mean([r["tokens_per_s"] for r in rs if r["category"] == c]) for c in cats} for m, rs in ok.items()}
    out: dict[str, dict] = {}
    for m in methods:
        st = statuses.get(m, {"status": "failed", "reason": "not run"})
        rs = ok[m]
        entry = {"status": st["status"], "reason": st["reason"], "runs": len(rs)}
        if st.get("build"):
            entry["build"] = st["build"]
        if st["status"] != "ok" or not rs:
            out[m] = entry
            continue
        new = sum(r["new_tokens"] for r in rs)
        passes = sum(r["target_passes"] for r in rs)
        lengths = [n for r in rs for n in (r["accepted_lengths"] or [])]
        att = _sum_lists([r["position_attempts"] for r in rs if r["position_attempts"] is not None])
        acc = _sum_lists([r["position_accepts"] for r in rs if r["position_accepts"] is not None])
        steps = [r["steps"] for r in rs if r["steps"] is not None]
        drafted = [r["draft_tokens"] for r in rs if r["draft_tokens"] is not None]
        counts = [r["tier_counts"] for r in rs if r["tier_counts"] is not None]
        fids = [r["fidelity"] for r in rs]
        entry.update(
            prompts=len({r["prompt_id"] for r in rs}),
            tokens_per_s_mean=tps[m],
            tokens_per_s_std=_std([r["tokens_per_s"] for r in rs]),
            speedup_vs_ar=_ratio(tps[m], tps.get("ar")),
            speedup_vs_hf=_ratio(tps[m], tps.get("hf")),
            new_tokens_mean=new / len(rs),
            wall_s_mean=_mean([r["wall_s"] for r in rs]),
            ttft_s_mean=_mean([r["ttft_s"] for r in rs if r.get("ttft_s") is not None]),  # None: not measured
            mean_accepted_length=new / passes if passes else None,
            target_passes_per_token=passes / new if new else None,
            accepted_length_counts=_histogram(lengths),
            acceptance_rate=(sum(acc) / sum(att)) if att and sum(att) else None,
            acceptance_by_position=[a / t if t else 0.0 for a, t in zip(acc, att)] if att else None,
            mean_block_length=(sum(drafted) / sum(steps)) if steps and sum(steps) else None,
            target_passes_per_step=(passes / sum(steps)) if steps and sum(steps) else None,
            tier_shares=_shares(counts),
            fidelity_mean=_mean(fids),
            fidelity_min=min(fids),
            peak_memory_bytes=peaks.get(m),
            by_category={c: {"tokens_per_s_mean": cat_tps[m][c], "speedup_vs_ar": _ratio(cat_tps[m][c], cat_tps.get("ar", {}).get(c))}
                         for c in cats if cat_tps[m][c] is not None},
            breakdown=_breakdown([r for r in rs if r["times"] is not None]),
            acceptance_breakdown=_acceptance_breakdown(rs, cats),
        )
        out[m] = entry
    return out


def _sum_lists(lists: list[list[int]]) -> list[int]:
    n = max((len(x) for x in lists), default=0)
    return [sum(x[j] for x in lists if j < len(x)) for j in range(n)]


def _histogram(values: list[int]) -> dict[str, int] | None:
    if not values:
        return None
    counts: dict[int, int] = {}
    for v in values:
        counts[v] = counts.get(v, 0) + 1
    return {str(k): counts[k] for k in sorted(counts)}


def _shares(counts: list[dict]) -> dict[str, float] | None:
    if not counts:
        return None
    total = {t: sum(c.get(t, 0) for c in counts) for t in TIERS}
    n = sum(total.values())
    return {t: (v / n if n else 0.0) for t, v in total.items()}


def _breakdown(rows: list[dict]) -> dict[str, dict] | None:
    """Where the time of our engine's runs goes: share of the run time and ms per new token."""
    if not rows:
        return None
    total = {p: sum(r["times"][p] for r in rows) for p in PHASES}
    all_time = sum(total.values())
    new = sum(r["new_tokens"] for r in rows)
    return {p: {"share": total[p] / all_time if all_time else 0.0, "ms_per_token": 1000 * total[p] / new if new else 0.0}
            for p in PHASES}


def _acceptance_breakdown(rows: list[dict], cats: list[str]) -> dict | None:
    """Where the tokens are lost (our engine's runs): over all prompts and per category, acceptance by
    block position, tokens per target pass, and what each step was: PLAIN (no draft asked), NO_DRAFT
    (asked, nothing proposed) or the source that proposed its block. The step counts sum to the steps."""
    rows = [r for r in rows if r.get("draft_sources") is not None]
    if not rows:
        return None
    return {"all": _acceptance(rows),
            "by_category": {c: _acceptance(cr) for c in cats if (cr := [r for r in rows if r["category"] == c])}}


def _acceptance(rows: list[dict]) -> dict:
    steps = sum(r["steps"] for r in rows)
    passes = sum(r["target_passes"] for r in rows)
    att = _sum_lists([r["position_attempts"] for r in rows])
    acc = _sum_lists([r["position_accepts"] for r in rows])
    counts = {PLAIN: sum(r["policy_plain_steps"] for r in rows)}
    for r in rows:
        for source, n in r["draft_sources"].items():
            counts[source] = counts.get(source, 0) + n
    counts.setdefault(NO_DRAFT, 0)
    by_source: dict[str, list[int]] = {}
    for r in rows:
        for source, (drafted, kept) in (r.get("source_tokens") or {}).items():
            tokens = by_source.setdefault(source, [0, 0])
            tokens[0] += drafted
            tokens[1] += kept
    return {
        "runs": len(rows), "steps": steps, "target_passes": passes,
        "tokens_per_target_pass": sum(r["new_tokens"] for r in rows) / passes if passes else None,
        "position_attempts": att, "position_accepts": acc,
        # of the blocks that reached position j, the share that kept it
        "acceptance_by_position": [a / t if t else 0.0 for a, t in zip(acc, att)],
        # of all steps, the share whose block kept position j
        "accepted_share_by_position": [a / steps if steps else 0.0 for a in acc],
        "step_counts": counts,
        "step_shares": {k: v / steps if steps else 0.0 for k, v in counts.items()},
        # per source: drafted tokens, kept tokens, and the share kept
        "source_tokens": by_source,
        "acceptance_by_source": {k: kept / drafted if drafted else 0.0 for k, (drafted, kept) in by_source.items()},
    }
