"""PNG plots of a `viasd bench` run: speedup by category, accepted-length histogram, tier shares."""

from __future__ import annotations

import os
from pathlib import Path

from viasd_core.speculation.stats import TIERS

PLOTS = ("speedup_by_category.png", "accepted_length_hist.png", "tier_shares.png")


def write_plots(out: Path, rows: list[dict], methods: dict[str, dict]) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [m for m, s in methods.items() if s["status"] == "ok"]
    paths = []

    # 1. speedup over ar per category (tokens/s when ar did not run)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    cats = sorted({c for m in ok for c in (methods[m].get("by_category") or {})})
    have_ar = methods.get("ar", {}).get("status") == "ok"
    key = "speedup_vs_ar" if have_ar else "tokens_per_s_mean"
    width = 0.8 / max(1, len(ok))
    for i, m in enumerate(ok):
        vals = [((methods[m]["by_category"] or {}).get(c) or {}).get(key) or 0.0 for c in cats]
        ax.bar([j + i * width for j in range(len(cats))], vals, width, label=m)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cats))], cats, rotation=30, ha="right")
    ax.set_ylabel("speedup over ar (tokens/s ratio)" if have_ar else "tokens/s (ar did not run)")
    if have_ar:
        ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set_title("Speedup by category" if have_ar else "Tokens/s by category")
    _legend_or_note(ax, ok)
    paths.append(_save(fig, out / PLOTS[0]))

    # 2. accepted length (tokens per target pass) histogram
    fig, ax = plt.subplots(figsize=(8, 4.5))
    with_len = [m for m in ok if methods[m].get("accepted_length_counts")]
    top = max((int(k) for m in with_len for k in methods[m]["accepted_length_counts"]), default=1)
    width = 0.8 / max(1, len(with_len))
    for i, m in enumerate(with_len):
        counts = methods[m]["accepted_length_counts"]
        total = sum(counts.values())
        ax.bar([k + i * width for k in range(1, top + 1)], [counts.get(str(k), 0) / total for k in range(1, top + 1)],
               width, label=m)
    ax.set_xlabel("tokens emitted per target pass")
    ax.set_ylabel("fraction of target passes")
    ax.set_title("Accepted length per target pass")
    _legend_or_note(ax, with_len)
    paths.append(_save(fig, out / PLOTS[1]))

    # 3. tier shares, stacked per method
    fig, ax = plt.subplots(figsize=(8, 4.5))
    with_tiers = [m for m in ok if methods[m].get("tier_shares")]
    bottom = [0.0] * len(with_tiers)
    for t in TIERS:
        vals = [methods[m]["tier_shares"][t] for m in with_tiers]
        ax.bar(with_tiers, vals, bottom=bottom, label=t)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylabel("share of emitted tokens")
    ax.set_title("Tier shares (accept / slim / full / bonus)")
    _legend_or_note(ax, with_tiers)
    paths.append(_save(fig, out / PLOTS[2]))
    plt.close("all")
    return paths


def _legend_or_note(ax, shown: list[str]) -> None:
    if shown:
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no data: no method produced these statistics", ha="center", va="center", transform=ax.transAxes)


def _save(fig, path: Path) -> Path:
    """Write the figure atomically (a temporary file beside it, then a rename) and close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    try:
        fig.savefig(tmp, dpi=100)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
        plt.close(fig)
    return path
