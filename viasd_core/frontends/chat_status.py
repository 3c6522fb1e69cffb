"""What the chat shows besides the answers: the live status line while an answer is generated
(`LiveMeter`), the summary after each turn and at the end, and the rows of the /stats table.

Nothing here writes to a terminal: `cli/chat.py` renders what these functions return.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from viasd_core.speculation.stats import RunStats
from viasd_core.frontends.streaming import stats_line

if TYPE_CHECKING:
    from viasd_core.frontends.chat import Chat, Turn

TIER_LEGEND = {  # who decided a token
    "accept": "draft kept",
    "slim": "slim verifier",
    "full": "target",
    "bonus": "target's extra token",
}


# ---------------------------------------------------------------------- text
def turn_summary(turn: Turn) -> str:
    """One line after each answer."""
    parts = [stats_line(turn.stats, turn.mode)]
    parts.append(f"prefill {turn.processed_tokens} processed, {turn.reused_tokens} from cache")
    if turn.mismatch_tokens and turn.reused_tokens:
        parts.append(f"{turn.mismatch_tokens} cached tokens re-encoded differently")
    if turn.finish_reason == "interrupted":
        parts.append("interrupted")
    return ", ".join(parts)


def session_summary(chat: Chat) -> str:
    if not chat.turns:
        return "Session: no turns."
    s = chat.totals()
    reused, processed = chat.prefill_totals()
    saved = reused / (reused + processed) if reused + processed else 0.0
    line = (f"Session: {len(chat.turns)} turns, {s.new_tokens} tokens in {s.time_total:.2f} s ({s.tokens_per_s:.1f} tok/s), "
            f"{s.target_passes / s.new_tokens if s.new_tokens else 0:.2f} target passes/token; "
            f"prefill {reused} tokens re-used from cache, {processed} processed ({100 * saved:.0f}% saved)")
    return line


STATS_COLUMNS = ("turn", "mode", "prompt", "cached", "prefill", "new", "tok/s", "tok/pass", "accept", "pass/tok", "finish")


def stats_rows(chat: Chat) -> list[list[str]]:
    """Rows of the /stats table: one per turn, then the session total."""

    def row(label, mode, prompt, reused, processed, s: RunStats, finish):
        spec = mode != "ar"
        return [label, mode, str(prompt), str(reused), str(processed), str(s.new_tokens), f"{s.tokens_per_s:.1f}",
                f"{s.mean_accepted_length:.2f}" if spec else "-", f"{s.acceptance_rate:.2f}" if spec else "-",
                f"{s.target_passes / s.new_tokens:.2f}" if s.new_tokens else "-", finish]

    rows = [row(str(t.index), t.mode, t.prompt_tokens, t.reused_tokens, t.processed_tokens, t.stats, t.finish_reason)
            for t in chat.turns]
    if chat.turns:
        reused, processed = chat.prefill_totals()
        modes = sorted({t.mode for t in chat.turns})
        rows.append(row("all", "/".join(modes), sum(t.prompt_tokens for t in chat.turns), reused, processed,
                        chat.totals(), ""))
    return rows
