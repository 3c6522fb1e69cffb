"""Multi-turn chat over one Engine: history, slash commands, per-turn statistics, save.

The engine keeps its committed tokens and KV caches between calls, so each turn passes the
whole conversation (chat template applied) and the engine re-uses every cached position of
the common prefix. The chat template may re-encode an earlier answer differently from the
ids that were generated, so the re-use is measured per turn, never assumed (the engine counts
it in its prefill, `RunStats.prefill_cached` / `prefill_processed`):

  reused     positions of the new prompt whose K/V were already in the target's cache
  processed  prompt positions the target had to run
  mismatch   tokens of the cached context that the new prompt no longer matches

Nothing here writes to a terminal: `cli/chat.py` renders what these functions return.
"""

from __future__ import annotations

import datetime as _dt
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from viasd_core import paths
from viasd_core.decoding.engine import MODES, Generation, GenerationConfig, common_prefix
from viasd_core.errors import UsageError, ViasdError
from viasd_core.decoding.fidelity import fidelity
from viasd_core.loading.prompts import encode
from viasd_core.session import Session, thresholds_of
from viasd_core.loading.drafter_factory import load_drafter
from viasd_core.decoding.slim_view import slim_verifier
from viasd_core.decoding.stats import TIERS, RunStats
from viasd_core.frontends.streaming import stats_line

SAVE_VERSION = 1

HELP = """Commands:
  /help            this list
  /stats           per-turn and session statistics
  /mode MODE       ar, sd, exact or viasd (exact/viasd need a calibration profile)
  /gamma N         draft tokens per step (N >= 1)
  /temp X          temperature (0 = greedy; viasd is greedy-only)
  /max N           largest number of new tokens per answer
  /system TEXT     set the system message (no text: remove it); the history is kept
  /reset           start a new conversation (clears history and caches)
  /save FILE       write the transcript and statistics as JSON
  /exit            leave (Ctrl-D too); Ctrl-C stops the answer being generated
  //text           send a message that starts with '/'"""

TIER_LEGEND = {  # who decided a token
    "accept": "draft kept",
    "slim": "slim verifier",
    "full": "target",
    "bonus": "target's extra token",
}


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


@dataclass
class Reply:
    """What a slash command answers: kind is info, error, help, stats or exit."""

    kind: str
    text: str = ""


def parse_command(line: str) -> tuple[str, str] | None:
    """('gamma', '4') for '/gamma 4'; None when the line is a message ('//x' is the message '/x')."""
    line = line.strip()
    if not line.startswith("/") or line.startswith("//"):
        return None
    name, _, arg = line[1:].partition(" ")
    return name.lower(), arg.strip()


# ---------------------------------------------------------------------- live meter
class DraftTap:
    """A drafter that delegates everything and remembers its last proposal (live acceptance)."""

    def __init__(self, inner):
        self.inner = inner
        self.last: list[int] | None = None

    def propose(self, *args, **kwargs):
        proposal = self.inner.propose(*args, **kwargs)
        self.last = proposal.tokens.tolist()  # read now: the buffer is overwritten at commit
        return proposal

    def __getattr__(self, name):
        return getattr(self.inner, name)


class LiveMeter:
    """Running statistics of the answer being generated, from the engine's on_emit calls.

    One on_emit call is one engine step; a step cost a target pass when it holds an
    ar / full / bonus token (viasd skips the target when the slim verifier decides all).
    The exact numbers come from RunStats when the answer ends.
    """

    def __init__(self, mode: str, tap: DraftTap | None = None, budget: float | None = None):
        self.mode = mode
        self.tap = tap
        self.budget = budget
        self.start = time.perf_counter()
        self.tokens = 0
        self.passes = 0
        self.drafted = 0
        self.kept = 0
        self.tier_counts = {t: 0 for t in TIERS}

    def on_emit(self, tokens: list[int], tiers: list[str]) -> None:
        self.tokens += len(tokens)
        for t in tiers:
            if t in self.tier_counts:
                self.tier_counts[t] += 1
        if any(t in ("ar", "full", "bonus") for t in tiers):
            self.passes += 1
        drafted = self.tap.last if self.tap is not None else None
        if drafted:
            self.drafted += len(drafted)
            self.kept += common_prefix(tokens, drafted)
            self.tap.last = None

    def fields(self) -> list[tuple[str, str]]:
        """(value, label) pairs for a status line."""
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        out = [(self.mode, ""), (str(self.tokens), "tok"), (f"{self.tokens / elapsed:.1f}", "tok/s")]
        if self.mode != "ar":
            total = sum(self.tier_counts.values()) or 1
            out.append((f"{self.tokens / self.passes:.2f}" if self.passes else "-", "tok/pass"))
            out.append((f"{self.kept / self.drafted:.2f}" if self.drafted else "-", "accepted"))
            out.append((" ".join(f"{t[0].upper()}{100 * self.tier_counts[t] / total:.0f}" for t in TIERS), "% tiers"))
        out.append((f"{self.passes / self.tokens:.2f}" if self.tokens else "-", "passes/tok"))
        if self.mode == "viasd" and self.budget is not None:
            out.append((f">= {1 - self.budget:.3f}", "fidelity budget"))
        return out


# ---------------------------------------------------------------------- the chat
class Chat:
    """A conversation over a Session's engine; `ask` runs one turn, `command` one slash command."""

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
        tap = DraftTap(engine.drafter) if engine.drafter is not None else None
        if meter is not None:
            meter.tap = tap

        def emit(tokens, tiers):
            if meter is not None:
                meter.on_emit(tokens, tiers)
            if on_emit is not None:
                on_emit(tokens, tiers)

        if tap is not None:
            engine.drafter = tap
        try:
            gen: Generation = engine.generate(ids, self.config, on_emit=emit)
        finally:
            if tap is not None:
                engine.drafter = tap.inner
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

    # ------------------------------------------------------------------ commands
    def command(self, line: str) -> Reply:
        """Run a slash command; a bad value gives an 'error' reply and changes nothing."""
        parsed = parse_command(line)
        if parsed is None:
            return Reply("error", f"not a command: {line!r}")
        name, arg = parsed
        handler = {
            "help": self._help, "?": self._help, "stats": self._stats, "mode": self._mode, "gamma": self._gamma,
            "temp": self._temp, "temperature": self._temp, "max": self._max, "system": self._system,
            "reset": self._reset, "save": self._save, "exit": self._exit, "quit": self._exit,
        }.get(name)
        if handler is None:
            return Reply("error", f"unknown command '/{name}': /help lists the commands")
        try:
            return handler(arg)
        except ViasdError as e:
            return Reply("error", e.message)

    def _help(self, arg: str) -> Reply:
        return Reply("help", HELP)

    def _stats(self, arg: str) -> Reply:
        return Reply("stats", "")

    def _exit(self, arg: str) -> Reply:
        return Reply("exit", "")

    def _try_config(self, **changes) -> None:
        old = {k: getattr(self.config, k) for k in changes}
        for k, v in changes.items():
            setattr(self.config, k, v)
        try:
            self.config.validate()
        except ViasdError:
            for k, v in old.items():
                setattr(self.config, k, v)
            raise

    def _mode(self, arg: str) -> Reply:
        mode = arg.lower()
        if mode not in MODES:
            raise UsageError(f"unknown mode '{arg}': use one of {', '.join(MODES)}")
        if mode == "viasd" and self.config.temperature > 0:
            raise UsageError("viasd mode is greedy-only: set /temp 0 first")
        self.ensure_mode(mode)
        self._try_config(mode=mode, thresholds=thresholds_of(self.session.profile))
        extra = f" (fidelity budget >= {1 - self.session.profile.budget:.3f})" if mode == "viasd" else ""
        return Reply("info", f"mode {mode}{extra}")

    def ensure_mode(self, mode: str) -> None:
        """Load what `mode` needs and the session lacks: a drafter; a profile and slim verifier."""
        from viasd_core.loading.profile import find_profile

        s, engine = self.session, self.engine
        if mode != "ar" and engine.drafter is None:
            drafter, s.draft_id, s.draft = load_drafter(s.options, s.target, engine.target, self.progress)
            if drafter is None:
                raise UsageError(f"mode '{mode}' needs a draft, and the session runs with --draft none")
            engine.drafter = drafter
        if mode in ("exact", "viasd") and engine.slim is None:
            shape = engine.target.shape
            s.profile = find_profile(s.target.model_id, s.draft_id, s.options.quant, engine.target.device.type,
                                     shape.n_layers, explicit=s.options.profile)
            engine.slim = slim_verifier(engine.target, s.profile.view)

    def _gamma(self, arg: str) -> Reply:
        try:
            n = int(arg)
        except ValueError:
            raise UsageError(f"/gamma needs a whole number, got '{arg}'")
        self._try_config(gamma=n, gamma_max=max(self.config.gamma_max, n))
        return Reply("info", f"gamma {n}" + (" (adaptive: the largest)" if self.config.adaptive else ""))

    def _temp(self, arg: str) -> Reply:
        try:
            x = float(arg)
        except ValueError:
            raise UsageError(f"/temp needs a number, got '{arg}'")
        if x != x or x in (float("inf"),):
            raise UsageError(f"/temp needs a finite number, got '{arg}'")
        self._try_config(temperature=x)
        return Reply("info", f"temperature {x:g}" + (" (greedy)" if x == 0 else ""))

    def _max(self, arg: str) -> Reply:
        try:
            n = int(arg)
        except ValueError:
            raise UsageError(f"/max needs a whole number, got '{arg}'")
        if n < 1:
            raise UsageError(f"/max must be at least 1 (got {n})")
        self._try_config(max_new_tokens=n)
        return Reply("info", f"at most {n} new tokens per answer")

    def _system(self, arg: str) -> Reply:
        self.system = arg or None
        return Reply("info", f"system message set ({len(arg)} characters)" if arg else "system message removed")

    def _reset(self, arg: str) -> Reply:
        self.messages = []
        self.engine.reset()
        self.conversation += 1
        return Reply("info", "new conversation (history and caches cleared)")

    def _save(self, arg: str) -> Reply:
        if not arg:
            raise UsageError("/save needs a file name: /save chat.json")
        path = Path(arg).expanduser()
        try:
            paths.atomic_write_json(path, self.to_json())
        except OSError as e:
            raise ViasdError(f"cannot write '{path}': {e.strerror or e}")
        return Reply("info", f"saved {len(self.turns)} turns to {path}")

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
                         "max_new_tokens": self.config.max_new_tokens, "seed": self.config.seed},
            "profile_budget": self.budget(),
            "system": self.system,
            "messages": ([{"role": "system", "content": self.system}] if self.system else []) + list(self.messages),
            "turns": [t.to_dict() for t in self.turns],
            "totals": {"turns": len(self.turns), "reused_tokens": reused, "processed_tokens": processed,
                       "stats": self.totals().to_dict()},
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
