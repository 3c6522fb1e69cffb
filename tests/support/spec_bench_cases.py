"""The Spec-Bench prompts shipped in benchmarks/data (Apache-2.0, attribution in benchmarks/data), as the
real-model tests read them."""

from __future__ import annotations

import json
from pathlib import Path

SPEC_BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "spec_bench_dev.jsonl"


def spec_bench_rows() -> list[dict]:
    return [json.loads(line) for line in SPEC_BENCH.read_text(encoding="utf-8").splitlines()]


def spec_bench_prompts(categories=("writing", "summarization", "qa")) -> dict[str, str]:
    """The first turn of the first question of each category, from the repository's copy."""
    rows = spec_bench_rows()
    return {cat: next(r for r in rows if r["category"] == cat)["turns"][0] for cat in categories}
