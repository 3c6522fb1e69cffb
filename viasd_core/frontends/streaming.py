"""A generation shown as it happens: text released as soon as no later token can change it (each
piece with the tier that decided it), and the one line of statistics after it.

Used by `viasd generate` and `viasd chat` alike; nothing here knows about a terminal.
"""

from __future__ import annotations

from typing import TextIO

from viasd_core.speculation.stats import RunStats


class TieredText:
    """Incremental detokenization that keeps each token's tier: feed() returns (text, tier)
    chunks that a later token cannot change; finish() returns what is left of the final text."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.printed = 0

    def feed(self, tokens: list[int], tiers: list[str]) -> list[tuple[str, str]]:
        out = []
        for token, tier in zip(tokens, tiers):
            self.tokens.append(token)
            text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
            if text.endswith("\ufffd"):  # an incomplete multi-byte character: wait for more
                continue
            if len(text) > self.printed:
                out.append((text[self.printed :], tier))
            self.printed = max(self.printed, len(text))
        return out

    def finish(self, final_text: str) -> str:
        rest = final_text[self.printed :] if len(final_text) > self.printed else ""
        self.printed = max(self.printed, len(final_text))
        return rest


class TextStream:
    """Plain text on `out` (an engine `on_emit` callback), flushed as soon as a later token cannot
    change it; finish() writes the rest of the final text and a newline."""

    def __init__(self, tokenizer, out: TextIO):
        self.decoder = TieredText(tokenizer)
        self.out = out

    def __call__(self, tokens: list[int], tiers: list[str]) -> None:
        text = "".join(t for t, _ in self.decoder.feed(tokens, tiers))
        if text:
            self.out.write(text)
            self.out.flush()

    def finish(self, final_text: str) -> None:
        self.out.write(self.decoder.finish(final_text) + "\n")
        self.out.flush()


def stats_line(stats: RunStats, mode: str) -> str:
    """One line after an answer: speed, tokens per target pass and acceptance (speculative modes),
    tier shares (viasd) and the fidelity when it was measured."""
    parts = [f"[{mode}] {stats.new_tokens} tokens in {stats.time_total:.2f} s ({stats.tokens_per_s:.1f} tok/s)"]
    if mode != "ar":
        parts.append(f"{stats.mean_accepted_length:.2f} tokens/target pass")
        parts.append(f"acceptance {stats.acceptance_rate:.2f}")
    if mode == "viasd":
        shares = stats.tier_shares
        parts.append(f"tiers accept {shares['accept']:.2f} / slim {shares['slim']:.2f} / full {shares['full'] + shares['bonus']:.2f}")
    if stats.fidelity is not None:
        parts.append(f"fidelity {stats.fidelity:.3f}")
    return ", ".join(parts)
