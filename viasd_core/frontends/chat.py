"""Multi-turn chat over one Engine: the conversation, its turns and their statistics.

The engine keeps its committed tokens and KV caches between calls, so each turn passes the
whole conversation (chat template applied) and the engine re-uses every cached position of
the common prefix. The chat template may re-encode an earlier answer differently from the
ids that were generated, so the re-use is measured per turn, never assumed (the engine counts
it in its prefill, `RunStats.prefill_cached` / `prefill_processed`):

  reused     positions of the new prompt whose K/V were already in the target's cache
  processed  prompt positions the target had to run
  mismatch   tokens of the cached context that the new prompt no longer matches

The slash commands are in chat_commands.py, the live status line and the text shown after a
turn in chat_status.py. Nothing here writes to a terminal: `cli/chat.py` renders what these
functions return.
"""

from __future__ import annotations

import datetime as _dt
from dataclasses import asdict, dataclass, field

from viasd_core.speculation.engine import Generation, GenerationConfig, common_prefix
from viasd_core.speculation.fidelity import fidelity
from viasd_core.speculation.stats import RunStats
from viasd_core.errors import UsageError, ViasdError
from viasd_core.frontends.chat_meter import LiveMeter
from viasd_core.loading.prompts import encode
from viasd_core.loading.drafter_factory import load_drafter
from viasd_core.session import Session, attach_profile

SAVE_VERSION = 1


# ---------------------------------------------------------------------- records
@dataclass
class Turn:
    index: int
    conversation: int
    user: str
    assistant: str
    mode: str
    gamma: int
    temperature: float
    finish_reason: str
    prompt_tokens: int
    reused_tokens: int  # prompt positions served from the target's KV cache
    processed_tokens: int  # prompt positions the target ran (prefill)
    mismatch_tokens: int  # cached context tokens the re-encoded prompt no longer matched
    dropped_messages: int  # oldest messages dropped to fit the context
    new_tokens: int
    tokens: list[int]  # the answer's token ids (EOS included when it ended on it)
    fidelity: float | None
    stats: RunStats = field(repr=False, default_factory=RunStats)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["stats"] = self.stats.to_dict()
        return d


# ---------------------------------------------------------------------- the chat
class Chat:
    """A conversation over a Session's engine; `ask` runs one turn (chat_commands.run_command a slash command)."""

    def __init__(self, session: Session, config: GenerationConfig, system: str | None = None,
                 measure_fidelity: bool | None = None, progress=None):
        self.session = session
        self.engine = session.engine
        self.config = config
        self.system = system or None
        self.measure_fidelity = measure_fidelity  # None: on in viasd mode
        self.progress = progress
        self.messages: list[dict] = []  # user / assistant turns of the current conversation
        self.turns: list[Turn] = []
        self.conversation = 1
        self.started = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")

    # ------------------------------------------------------------------ turns
    @property
    def context_len(self) -> int:
        return self.engine.context_len

    def encode(self, messages: list[dict]) -> list[int]:
        return encode(self.session.tokenizer, messages, system=self.system)

    def _fit(self, user: str) -> tuple[list[int], int]:
        """Prompt ids for the history plus `user`, dropping the oldest exchanges to leave room."""
        room = min(self.config.max_new_tokens, max(self.context_len // 4, 1))
        dropped = 0
        while True:
            ids = self.encode(self.messages + [{"role": "user", "content": user}])
            if len(ids) + room <= self.context_len or not self.messages:
                break
            del self.messages[:2]  # the oldest user message and its answer
            dropped += 2
        if len(ids) >= self.context_len:
            raise ViasdError(f"the message needs {len(ids)} tokens but the model's context is {self.context_len}: send a shorter one")
        return ids, dropped

    def budget(self) -> float | None:
        p = self.session.profile
        return p.budget if p is not None else None

    def meter(self) -> LiveMeter:
        return LiveMeter(self.config.mode, budget=self.budget())

    def ask(self, user: str, on_emit=None, meter: LiveMeter | None = None) -> Turn:
        """One turn: the answer to `user` given the history. A Ctrl-C during generation ends the
        answer early (finish_reason 'interrupted'); the partial answer stays in the history."""
        if not user.strip():
            raise UsageError("the message is empty")
        ids, dropped = self._fit(user)
        engine = self.engine
        cached = engine.tokens
        common = common_prefix(cached, ids)

        def emit(tokens, tiers):
            if meter is not None:
                meter.on_emit(tokens, tiers)
            if on_emit is not None:
                on_emit(tokens, tiers)

        if meter is not None:  # the meter counts drafted and kept tokens from each step's result
            engine.observers.append(meter.on_step)
        try:
            gen: Generation = engine.generate(ids, self.config, on_emit=emit)
        finally:
            if meter is not None:
                engine.observers.remove(meter.on_step)
        fid = None
        if self.measure_fidelity or (self.measure_fidelity is None and self.config.mode == "viasd"):
            fid = fidelity(self.session.target.model, ids, gen.tokens)
            gen.stats.fidelity = fid
        self.messages.append({"role": "user", "content": user})
        self.messages.append({"role": "assistant", "content": gen.text})
        turn = Turn(
            index=len(self.turns) + 1, conversation=self.conversation, user=user, assistant=gen.text,
            mode=self.config.mode, gamma=self.config.gamma, temperature=self.config.temperature,
            finish_reason=gen.finish_reason, prompt_tokens=len(ids), reused_tokens=gen.stats.prefill_cached,
            processed_tokens=gen.stats.prefill_processed, mismatch_tokens=len(cached) - common, dropped_messages=dropped,
            new_tokens=len(gen.tokens), tokens=list(gen.tokens), fidelity=fid, stats=gen.stats,
        )
        self.turns.append(turn)
        return turn

    # ------------------------------------------------------------------ modes
    def ensure_mode(self, mode: str) -> None:
        """Load what `mode` needs and the session lacks: a drafter; a profile and slim verifier."""
        s, engine = self.session, self.engine
        if mode != "ar" and engine.drafter is None:
            drafter, s.draft_id, s.draft = load_drafter(s.options, s.target, engine.target, self.progress)
            if drafter is None:
                raise UsageError(f"mode '{mode}' needs a draft, and the session runs with --draft none")
            engine.drafter = drafter
        if mode in ("exact", "viasd") and engine.slim is None:
            attach_profile(s, self.progress)

    # ------------------------------------------------------------------ statistics
    def totals(self) -> RunStats:
        total = RunStats(mode=self.config.mode)
        for t in self.turns:
            total.merge(t.stats)
        return total

    def prefill_totals(self) -> tuple[int, int]:
        """(tokens re-used from cache, tokens processed) over the session."""
        return sum(t.reused_tokens for t in self.turns), sum(t.processed_tokens for t in self.turns)

    def to_json(self) -> dict:
        s = self.session
        reused, processed = self.prefill_totals()
        return {
            "version": SAVE_VERSION,
            "started": self.started,
            "saved": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "model": s.target.model_id,
            "draft": s.draft_id,
            "settings": {"mode": self.config.mode, "gamma": self.config.gamma, "adaptive": self.config.adaptive,
                         "temperature": self.config.temperature, "top_k": self.config.top_k, "top_p": self.config.top_p,
                         "min_p": self.config.min_p, "repetition_penalty": self.config.repetition_penalty,
                         "max_new_tokens": self.config.max_new_tokens, "seed": self.config.seed},
            "profile_budget": self.budget(),
            "system": self.system,
            "messages": ([{"role": "system", "content": self.system}] if self.system else []) + list(self.messages),
            "turns": [t.to_dict() for t in self.turns],
            "totals": {"turns": len(self.turns), "reused_tokens": reused, "processed_tokens": processed,
                       "stats": self.totals().to_dict()},
        }
