"""Per-run statistics (docs/algorithm.md section 6)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

TIERS = ("accept", "slim", "full", "bonus")
NOT_MEASURED = "not measured"
NO_DRAFT = "none"  # RunStats.draft_sources: the drafter was asked and proposed nothing


def format_fidelity(value: float | None, spec: str = ".4f") -> str:
    """A fidelity for people to read: NOT_MEASURED where none was measured (None), never 1.0."""
    return NOT_MEASURED if value is None else format(value, spec)


@dataclass
class RunStats:
    mode: str = "ar"
    prompt_tokens: int = 0
    prefill_cached: int = 0  # prompt positions the target's KV cache already held (earlier turns)
    prefill_processed: int = 0  # prompt positions the target ran (the last one in the first step)
    new_tokens: int = 0
    steps: int = 0
    target_passes: int = 0
    slim_passes: int = 0
    draft_tokens: int = 0  # tokens proposed
    accepted_lengths: list[int] = field(default_factory=list)  # tokens emitted per target pass
    position_attempts: list[int] = field(default_factory=list)  # per block position j: drafted
    position_accepts: list[int] = field(default_factory=list)  # per block position j: kept
    tier_counts: dict[str, int] = field(default_factory=lambda: {t: 0 for t in TIERS})
    # Per step that asked the drafter for a block: who proposed it (Proposal.source: 'model', 'feature',
    # 'ngram', 'suffix', ...), or NO_DRAFT when nothing was proposed (the step ran plain). The steps
    # not counted here are the plain steps the draft policy chose (or a last step with one token left).
    draft_sources: dict[str, int] = field(default_factory=dict)
    source_tokens: dict[str, list[int]] = field(default_factory=dict)  # per source: [drafted, kept] over its blocks
    time_prefill: float = 0.0
    time_draft: float = 0.0
    time_slim: float = 0.0
    time_verify: float = 0.0
    time_total: float = 0.0
    time_first_token: float | None = None  # from the call to its first new token: prefill and the first step
    fidelity: float | None = None  # lossy modes: fraction of tokens equal to the target's greedy choice

    def __post_init__(self) -> None:
        self._source: str | None = None  # the source of the step being recorded (not a field: not reported)

    def record_source(self, source: str) -> None:
        """Who proposed this step's block (called before the step's record_block, which it labels)."""
        self.draft_sources[source] = self.draft_sources.get(source, 0) + 1
        self._source = source

    @property
    def policy_plain_steps(self) -> int:
        """Steps that asked no draft: the draft policy's plain steps (and a last step with one token
        left); every step in ar."""
        return self.steps - sum(self.draft_sources.values())

    def record_block(self, drafted: int, kept: int) -> None:
        while len(self.position_attempts) < drafted:
            self.position_attempts.append(0)
            self.position_accepts.append(0)
        for j in range(drafted):
            self.position_attempts[j] += 1
            self.position_accepts[j] += int(j < kept)
        if self._source is not None:
            tokens = self.source_tokens.setdefault(self._source, [0, 0])
            tokens[0] += drafted
            tokens[1] += kept
            self._source = None

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.time_total if self.time_total > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        t = self.time_total - self.time_prefill
        return self.new_tokens / t if t > 0 else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per target pass."""
        return self.new_tokens / self.target_passes if self.target_passes else 0.0

    @property
    def acceptance_rate(self) -> float:
        tried = sum(self.position_attempts)
        return sum(self.position_accepts) / tried if tried else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / t if t else 0.0 for a, t in zip(self.position_accepts, self.position_attempts)]

    @property
    def tier_shares(self) -> dict[str, float]:
        total = sum(self.tier_counts.values())
        return {k: (v / total if total else 0.0) for k, v in self.tier_counts.items()}

    def merge(self, other: "RunStats") -> None:
        for name in ("prompt_tokens", "prefill_cached", "prefill_processed", "new_tokens", "steps", "target_passes", "slim_passes", "draft_tokens"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name in ("time_prefill", "time_draft", "time_slim", "time_verify", "time_total"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        if self.time_first_token is None:
            self.time_first_token = other.time_first_token
        self.accepted_lengths += other.accepted_lengths
        n = max(len(self.position_attempts), len(other.position_attempts))
        for lst_name in ("position_attempts", "position_accepts"):
            mine = getattr(self, lst_name) + [0] * (n - len(getattr(self, lst_name)))
            theirs = getattr(other, lst_name) + [0] * (n - len(getattr(other, lst_name)))
            setattr(self, lst_name, [a + b for a, b in zip(mine, theirs)])
        for k, v in other.tier_counts.items():
            self.tier_counts[k] = self.tier_counts.get(k, 0) + v
        for k, v in other.draft_sources.items():
            self.draft_sources[k] = self.draft_sources.get(k, 0) + v
        for k, (drafted, kept) in other.source_tokens.items():
            mine = self.source_tokens.setdefault(k, [0, 0])
            mine[0] += drafted
            mine[1] += kept

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(
            tokens_per_s=self.tokens_per_s,
            mean_accepted_length=self.mean_accepted_length,
            acceptance_rate=self.acceptance_rate,
            acceptance_by_position=self.acceptance_by_position,
            tier_shares=self.tier_shares,
            target_passes_per_token=(self.target_passes / self.new_tokens if self.new_tokens else 0.0),
            policy_plain_steps=self.policy_plain_steps,
        )
        return d
