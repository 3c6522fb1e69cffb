"""Constrained decoding: a grammar (JSON schema, regex, Lark or GBNF) masks the logits to the tokens
it allows, through llguidance (docs/engine.md, "Constrained decoding", says why that library).

`Grammar` is what a request asks for (hashable, in GenerationConfig.grammar); `Constraint` is one
generation's matcher over the engine's tokenizer. The matcher's state is the committed tokens plus
a speculative tail: a step pushes the draft's tokens onto it (`push`), reads the allowed tokens after
each prefix of them (`allowed(k)`: row k is the state after the first k pushed tokens), and the
engine's commit settles it on the emitted tokens (`commit`: the tail rolled back, the emitted
tokens consumed). `drafting` masks a chain draft's logits with the same rows while it drafts, so
the draft proposes only what the grammar allows and its proposals stay acceptable.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass

import torch

from viasd_core.errors import UsageError, ViasdError

FORMATS = ("json_schema", "regex", "lark", "gbnf", "choice")
# JSON in the compact layout json.dumps writes: a grammar that lets whitespace repeat lets a model
# write it forever (a known failure of constrained JSON); this keeps every answer finite in its layout.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Grammar:
    """What the output must match: `text` in `format` (one of FORMATS; a JSON schema as JSON text)."""

    format: str
    text: str

    @staticmethod
    def json_schema(schema: dict | bool) -> Grammar:
        return Grammar("json_schema", json.dumps(schema))

    def definition(self) -> str:
        """llguidance's grammar definition, or a one-line UsageError saying what is wrong with it."""
        import llguidance

        if self.format not in FORMATS:
            raise UsageError(f"unknown grammar format '{self.format}': use one of {', '.join(FORMATS)}")
        text = self.text
        if self.format == "json_schema":
            schema = json.loads(text)
            if isinstance(schema, dict) and "x-guidance" not in schema:
                text = json.dumps({**schema, "x-guidance": JSON_LAYOUT})
        try:
            grammar = llguidance.grammar_from(self.format, text)
        except ValueError as e:
            raise UsageError(f"the {self.format} grammar is not valid: {_first_line(e)}")
        error = llguidance.LLMatcher.validate_grammar(grammar)
        if error:
            raise UsageError(f"the {self.format} grammar is not valid: {_first_line(error)}")
        return grammar


def grammar_option(json_schema: str | None = None, grammar: str | None = None, regex: str | None = None) -> Grammar | None:
    """The grammar the command line asks for (`viasd generate`), checked before any model loads; a
    one-line UsageError for two at once, an unreadable file or an invalid grammar.

    json_schema: a file holding the schema, or the schema's JSON text; grammar: a file of GBNF or
    Lark (by its suffix: `.lark` is Lark, anything else GBNF; llguidance reads both); regex: the pattern."""
    given = [(n, v) for n, v in (("--json-schema", json_schema), ("--grammar", grammar), ("--regex", regex)) if v is not None]
    if not given:
        return None
    if len(given) > 1:
        raise UsageError(f"{' and '.join(n for n, _ in given)} each constrain the output: give one")
    if regex is not None:
        out = Grammar("regex", regex)
    elif grammar is not None:
        out = Grammar("lark" if grammar.endswith(".lark") else "gbnf", _read(grammar, "--grammar"))
    else:
        text = _read(json_schema, "--json-schema") if not json_schema.lstrip().startswith(("{", "[")) else json_schema
        try:
            out = Grammar.json_schema(json.loads(text))
        except json.JSONDecodeError as e:
            raise UsageError(f"--json-schema is not JSON: {e.msg} (line {e.lineno}, column {e.colno})")
    out.definition()  # a one-line UsageError when llguidance refuses it
    return out


def _read(path: str, option: str) -> str:
    from pathlib import Path

    try:
        return Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"{option}: cannot read '{path}': {e.strerror or e}")


def _first_line(error) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


_TOKENIZERS: dict[tuple, tuple] = {}  # (id(tokenizer), width, eos) -> (tokenizer, llguidance's view of it)


def _ll_tokenizer(tokenizer, width: int, eos: tuple[int, ...]):
    """llguidance's tokenizer for `tokenizer` at logit width `width`, built once (0.5 s for SmolLM2's
    49152 tokens, measured on a loaded 2-core machine) and kept with the tokenizer it reads."""
    key = (id(tokenizer), width, eos)
    if key not in _TOKENIZERS:
        import llguidance.hf

        try:
            made = llguidance.hf.from_tokenizer(tokenizer, n_vocab=width, eos_token=list(eos) or None)
        except Exception as e:  # a slow (Python) tokenizer, a vocabulary llguidance cannot read
            raise ViasdError(f"constrained output needs a fast tokenizer llguidance can read: {_first_line(e)}")
        _TOKENIZERS[key] = (tokenizer, made)
    return _TOKENIZERS[key][1]


class Constraint:
    """One generation's grammar state over logits of `width` columns (the target's vocabulary)."""

    def __init__(self, grammar: Grammar, tokenizer, width: int, eos: set[int], device: torch.device):
        import llguidance
        import llguidance.torch

        self.matcher = llguidance.LLMatcher(_ll_tokenizer(tokenizer, width, tuple(sorted(eos))), grammar.definition())
        if self.matcher.is_error():
            raise ViasdError(f"the grammar cannot start: {_first_line(self.matcher.get_error())}")
        self.width, self.device = width, device
        self._bits = llguidance.torch.allocate_token_bitmask(1, width)  # [1, ceil(width / 32)] int32, CPU
        self._shifts = torch.arange(32, dtype=torch.int32)
        self.pushed = 0  # speculative tokens consumed on top of the committed ones
        self._rows: list[torch.Tensor] = []  # [width] bool per state 0 .. pushed (computed lazily)
        self.reads = 0  # device-to-host reads made while drafting (the step adds them to the engine's)

    # ------------------------------------------------------------------ state
    def _row(self) -> torch.Tensor:
        """The tokens allowed in the matcher's current state: [width] bool on the device."""
        import llguidance.torch

        llguidance.torch.fill_next_token_bitmask(self.matcher, self._bits, 0)
        bits = (self._bits.view(-1, 1) >> self._shifts) & 1  # [words, 32]: bit j of word w is token 32 w + j
        return bits.view(-1)[: self.width].bool().to(self.device)

    def allowed(self, k: int) -> torch.Tensor:
        """[k, width] bool: row i allows what the grammar allows after the first i pushed tokens."""
        assert k <= self.pushed + 1, (k, self.pushed)
        while len(self._rows) < k:
            if len(self._rows) < self.pushed:  # rows below the tail's end: step back to that state
                raise AssertionError("rows are computed as tokens are pushed")
            self._rows.append(self._row())
        return torch.stack(self._rows[:k])

    def push(self, token: int) -> bool:
        """Consume a speculative token; False (nothing consumed) where the grammar rejects it."""
        self.allowed(self.pushed + 1)  # the row before it, computed while the matcher is in that state
        if self.matcher.is_stopped() or self.matcher.try_consume_tokens([token]) != 1:
            return False
        self.pushed += 1
        return True

    def follow(self, tokens: list[int]) -> int:
        """Push `tokens` from the first not yet pushed; the count the grammar accepts (a prefix)."""
        for token in tokens[self.pushed:]:
            if not self.push(token):
                break
        return min(self.pushed, len(tokens))

    def commit(self, tokens: list[int]) -> None:
        """The step emitted `tokens`: the speculative tail is dropped and they are consumed."""
        if self.pushed:
            self.matcher.rollback(self.pushed)
        self.pushed, self._rows = 0, []
        for token in tokens:
            if self.matcher.is_stopped():
                break  # the grammar ended (on EOS): the engine ends the generation on it too
            if not self.matcher.consume_token(token):
                raise ViasdError(f"the grammar refused an emitted token ({token}): {_first_line(self.matcher.get_error())}")

    # ------------------------------------------------------------------ masks
    def mask(self, logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """logits [R, width] with every token a row's state does not allow at -inf."""
        return logits.masked_fill(~allowed, float("-inf"))

    @contextlib.contextmanager
    def drafting(self, drafter, ids: torch.Tensor, n: int):
        """While a chain drafter (a draft model or head, alone or in a hybrid) proposes from ids[n:],
        its logits are masked by the state after the tokens it drafted so far; a drafter of another
        kind (prompt lookup) drafts as it would, and the step cuts its block where the grammar says."""
        chain = getattr(drafter, "model_drafter", drafter)
        if not (hasattr(chain, "_first_logits") and hasattr(chain, "_next_logits")):
            yield
            return
        first, after = chain._first_logits, chain._next_logits

        def masked(logits: torch.Tensor | None, k: int) -> torch.Tensor | None:
            if logits is None or k > self.pushed:  # the grammar rejected an earlier token: the step cuts there
                return logits
            allowed = self.allowed(k + 1)[k]
            if chain.vocab_map is not None:
                return logits.masked_fill(~allowed[chain.vocab_map].view(1, -1), float("-inf"))
            cols = min(logits.shape[-1], self.width)
            out = logits.clone()
            out[:, :cols] = logits[:, :cols].masked_fill(~allowed[:cols], float("-inf"))
            out[:, cols:] = float("-inf")
            return out

        def next_logits(ids_, n_, i):
            self.reads += 1
            if self.pushed == i:  # the tokens before it were allowed
                self.push(int(ids_[n_ + i]))
            return masked(after(ids_, n_, i), i + 1)

        chain._first_logits = lambda ids_, n_: masked(first(ids_, n_), 0)
        chain._next_logits = next_logits
        try:
            yield
        finally:
            del chain._first_logits, chain._next_logits  # the class's own methods again
