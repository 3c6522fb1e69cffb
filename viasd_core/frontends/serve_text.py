"""Streamed text that a stop string can never take back.

The engine emits the tokens of each step, then ends the generation when the decoded text holds a
stop string, and cuts its final text before it. A stream that sent every piece at once would
have sent the stop string (and anything after it in the same step) already. So a piece is held
back while a stop string could still start inside it: the last len(longest stop) - 1 characters
wait for the next step. A character before them is final: a stop string that starts at or
before it would end within the text decoded so far, and would have been found.

With no stop strings this is streaming.TieredText's text as it comes; at the end `finish` sends
the rest of the final text, so the pieces always add up to the non-streamed answer.
"""

from __future__ import annotations

from viasd_core.frontends.streaming import TieredText


class StopAwareText:
    def __init__(self, tokenizer, stops: tuple[str, ...] = ()):
        self.decoder = TieredText(tokenizer)
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.text = ""  # what the decoder released so far
        self.sent = 0  # characters of `text` handed out

    def feed(self, tokens: list[int], tiers: list[str]) -> str:
        """The text that became final with these tokens ('' if none did)."""
        self.text += "".join(piece for piece, _ in self.decoder.feed(tokens, tiers))
        end = len(self.text) - self.hold
        found = [i for i in (self.text.find(s) for s in self.stops) if i >= 0]
        if found:
            end = min(found)
        if end <= self.sent:
            return ""
        piece, self.sent = self.text[self.sent : end], end
        return piece

    def finish(self, final_text: str) -> str:
        """The rest of `final_text` (the engine's answer, cut at a stop string)."""
        rest = final_text[self.sent :] if len(final_text) > self.sent else ""
        self.sent = max(self.sent, len(final_text))
        return rest
