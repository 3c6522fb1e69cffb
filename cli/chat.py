"""`viasd chat`: a multi-turn terminal chat that keeps the KV caches between turns.

The conversation logic lives in viasd_core.frontends.chat (slash commands in chat_commands, status line
and summaries in chat_status); this module only reads lines and draws:
  - a terminal (stdout is a TTY, no --plain): tokens colored by tier, a live status line
  - otherwise (piped): plain answers on stdout, everything else on stderr, no escape codes
"""

from __future__ import annotations

import sys
from typing import Annotated, Optional

import typer
from rich import box
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from viasd_core.frontends.chat import Chat
from viasd_core.frontends.chat_commands import parse_command, run_command
from viasd_core.frontends.chat_status import STATS_COLUMNS, TIER_LEGEND, session_summary, stats_rows, turn_summary
from viasd_core.speculation.engine import GenerationConfig
from viasd_core.errors import ViasdError
from viasd_core.loading.options import ModelOptions
from viasd_core.frontends.streaming import TextStream, TieredText

from .app import app
from .options import generation_options, handle_errors, model_options, open_session

EXAMPLES = """
EXAMPLES

  viasd chat                                  (embedded model and draft, mode sd)

  viasd chat --mode viasd                     (three tiers; needs `viasd calibrate` first)

  viasd chat -m ./my-model -d ngram --plain   (prompt lookup, no colors)

  printf 'Hi\\nTell me more\\n' | viasd chat   (one turn per line; answers on stdout)

Inside: /help, /stats, /mode sd, /gamma 4, /temp 0.7, /max 64, /system TEXT, /reset, /save FILE, /exit.
"""

TIER_STYLES = {"accept": "green", "slim": "cyan", "full": "yellow", "bonus": "magenta", "ar": ""}
PROMPT = "you> "


class Display:
    """Where the chat's output goes. Plain: answers on stdout, the rest on stderr, no styles."""

    def __init__(self, fancy: bool):
        self.fancy = fancy
        self.out = Console(highlight=False, soft_wrap=False) if fancy else None
        # Piped: no styles, and wide enough that the /stats table is not cut at 80 columns.
        self.err = Console(stderr=True, highlight=False, no_color=True, width=120) if not fancy else self.out

    def note(self, text: str, style: str = "dim") -> None:
        if self.fancy:  # soft wrap: the terminal wraps long lines, so they stay one line when copied
            self.out.print(Text(text, style=style), soft_wrap=True)
        else:
            self.err.print(text, markup=False, highlight=False, soft_wrap=True)

    def error(self, text: str) -> None:
        self.note(text, style="bold red")

    def table(self, chat: Chat) -> None:
        rows = stats_rows(chat)
        if not rows:
            self.note("no turns yet")
            return
        table = Table(*STATS_COLUMNS, title="chat statistics", title_justify="left", box=box.SIMPLE_HEAD,
                      show_edge=False, pad_edge=False)
        for i, row in enumerate(rows):
            table.add_row(*row, end_section=(i == len(rows) - 2))
        reused, processed = chat.prefill_totals()
        target = self.out if self.fancy else self.err
        target.print(table)
        saved = reused / (reused + processed) if reused + processed else 0.0
        self.note(f"cached = prompt tokens re-used from the KV cache, prefill = prompt tokens processed; "
                  f"{100 * saved:.0f}% of the prefill saved")

    def legend(self) -> None:
        if not self.fancy:
            return
        line = Text("tiers: ", style="dim")
        for i, (tier, meaning) in enumerate(TIER_LEGEND.items()):
            line.append(" · " if i else "", style="dim")
            line.append(tier, style=TIER_STYLES[tier])
            line.append(f" ({meaning})", style="dim")
        self.out.print(line)


class LiveAnswer:
    """Streams an answer above a live status line: finished lines are printed for good, the
    line being written and the status stay in the live area (transient: gone at the end)."""

    def __init__(self, console: Console, chat: Chat):
        self.console = console
        self.decoder = TieredText(chat.session.tokenizer)
        self.meter = chat.meter()
        self.line = Text()
        self.live = Live(console=console, get_renderable=self._render, refresh_per_second=8, transient=True,
                         redirect_stdout=False, redirect_stderr=False)

    def _status(self) -> Text:
        status = Text("  ")
        for i, (value, label) in enumerate(self.meter.fields()):
            if i:
                status.append(" · ", style="dim")
            status.append(value, style="bold")
            if label:
                status.append(f" {label}", style="dim")
        return status

    def _render(self):
        return Group(self.line, self._status())

    def _add(self, text: str, style: str) -> None:
        parts = text.split("\n")
        for i, part in enumerate(parts):
            if i:  # a finished line: print it above the live area
                self.live.console.print(self.line)
                self.line = Text()
            if part:
                self.line.append(part, style=style)
        # A line taller than the screen would scroll out of the live area: print its first rows.
        rows = self.line.wrap(self.console, self.console.width)
        if len(rows) > max(self.console.height - 4, 2):
            for row in rows[:-1]:
                self.live.console.print(row)
            self.line = rows[-1]

    def __call__(self, tokens, tiers) -> None:
        for text, tier in self.decoder.feed(tokens, tiers):
            self._add(text, TIER_STYLES.get(tier, ""))
        self.live.refresh()

    def finish(self, final_text: str) -> None:
        rest = self.decoder.finish(final_text)
        if rest:
            self._add(rest, "")
        self.live.stop()
        self.console.print(self.line)


def read_lines(interactive: bool, display: Display):
    """User lines; Ctrl-C at the prompt only clears the line. Ends at Ctrl-D / end of input."""
    if not interactive:
        for line in sys.stdin:
            yield line.rstrip("\n")
        return
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    while True:
        try:
            if display.fancy:
                line = input(PROMPT)
            else:
                sys.stderr.write(PROMPT)
                sys.stderr.flush()
                line = input()
        except EOFError:
            if display.fancy:
                print()
            return
        except KeyboardInterrupt:
            print()
            display.note("(Ctrl-D or /exit to leave)")
            continue
        yield line


def run_turn(chat: Chat, text: str, display: Display) -> None:
    streamer = LiveAnswer(display.out, chat) if display.fancy else TextStream(chat.session.tokenizer, sys.stdout)
    try:
        if display.fancy:
            streamer.live.start()
        try:
            turn = chat.ask(text, on_emit=streamer, meter=getattr(streamer, "meter", None))
        finally:
            if display.fancy and streamer.live.is_started:
                streamer.live.stop()
    except ViasdError as e:
        display.error(f"Error: {e.message}")
        return
    except KeyboardInterrupt:  # outside the engine's own handling (encoding, fidelity): nothing half-done
        display.note("(interrupted)")
        return
    streamer.finish(turn.assistant)
    if turn.dropped_messages:
        display.note(f"(context full: the oldest {turn.dropped_messages} messages were dropped)")
    display.note(turn_summary(turn))


@app.command(epilog=EXAMPLES)
@handle_errors
@generation_options(max_new_tokens=256)
@model_options
def chat(
    *,
    opts: ModelOptions,
    config: GenerationConfig,
    system: Annotated[Optional[str], typer.Option("--system", help="System message for the chat template.")] = None,
    plain: Annotated[bool, typer.Option("--plain", help="No colors and no live status line (NO_COLOR turns colors off too).")] = False,
    fidelity_check: Annotated[Optional[bool], typer.Option("--fidelity/--no-fidelity", help="Measure each answer's fidelity by teacher-forcing the target over it (default: on in viasd mode).")] = None,
):
    """Chat with the model, keeping the KV caches across turns; /help lists the commands."""
    interactive = sys.stdin is not None and sys.stdin.isatty()
    display = Display(fancy=not plain and sys.stdout.isatty())
    session, config = open_session(opts, config, progress=display.note)
    chat = Chat(session, config, system=system, measure_fidelity=fidelity_check, progress=display.note)
    budget = f", fidelity budget >= {1 - session.profile.budget:.3f}" if config.mode == "viasd" else ""
    display.note(f"viasd chat: {session.target.model_id}, draft {session.draft_id}, mode {config.mode}{budget}; /help for commands")
    display.legend()

    for line in read_lines(interactive, display):
        if not line.strip():
            continue
        if parse_command(line) is not None:
            reply = run_command(chat, line)
            if reply.kind == "exit":
                break
            if reply.kind == "stats":
                display.table(chat)
            elif reply.kind == "error":
                display.error(reply.text)
            else:
                display.note(reply.text, style="" if reply.kind == "help" else "dim")
            continue
        text = line.strip()[1:] if line.strip().startswith("//") else line
        run_turn(chat, text, display)
    display.note(session_summary(chat), style="bold")
