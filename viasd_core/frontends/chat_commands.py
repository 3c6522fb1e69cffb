"""The chat's slash commands: `/mode sd`, `/gamma 4`, `/save chat.json`...

`run_command(chat, line)` runs one on a Chat and answers with a `Reply`; a bad value gives an
'error' reply and changes nothing (a setting is validated with the whole GenerationConfig and
rolled back when refused). Nothing here writes to a terminal: `cli/chat.py` renders the replies.
"""

from __future__ import annotations

from dataclasses import dataclass

from viasd_core import paths
from viasd_core.speculation.draft_policy import FLOOR
from viasd_core.speculation.engine import MODES, GenerationConfig
from viasd_core.errors import UsageError, ViasdError
from viasd_core.frontends.chat import Chat
from viasd_core.session import thresholds_of

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


def run_command(chat: Chat, line: str) -> Reply:
    """Run a slash command on `chat`; a bad value gives an 'error' reply and changes nothing."""
    parsed = parse_command(line)
    if parsed is None:
        return Reply("error", f"not a command: {line!r}")
    name, arg = parsed
    handler = COMMANDS.get(name)
    if handler is None:
        return Reply("error", f"unknown command '/{name}': /help lists the commands")
    try:
        return handler(chat, arg)
    except ViasdError as e:
        return Reply("error", e.message)


def _help(chat: Chat, arg: str) -> Reply:
    return Reply("help", HELP)


def _stats(chat: Chat, arg: str) -> Reply:
    return Reply("stats", "")


def _exit(chat: Chat, arg: str) -> Reply:
    return Reply("exit", "")


def _try_config(config: GenerationConfig, **changes) -> None:
    old = {k: getattr(config, k) for k in changes}
    for k, v in changes.items():
        setattr(config, k, v)
    try:
        config.validate()
    except ViasdError:
        for k, v in old.items():
            setattr(config, k, v)
        raise


def _mode(chat: Chat, arg: str) -> Reply:
    mode = arg.lower()
    if mode not in MODES:
        raise UsageError(f"unknown mode '{arg}': use one of {', '.join(MODES)}")
    if mode == "viasd" and chat.config.temperature > 0:
        raise UsageError("viasd mode is greedy-only: set /temp 0 first")
    chat.ensure_mode(mode)
    _try_config(chat.config, mode=mode, thresholds=thresholds_of(chat.session.profile))
    extra = f" (fidelity budget >= {1 - chat.session.profile.budget:.3f})" if mode == "viasd" else ""
    return Reply("info", f"mode {mode}{extra}")


def _gamma(chat: Chat, arg: str) -> Reply:
    try:
        n = int(arg)
    except ValueError:
        raise UsageError(f"/gamma needs a whole number, got '{arg}'")
    # a block length given: the measured start's floor no longer holds (draft_policy.FLOOR does)
    _try_config(chat.config, gamma=n, gamma_max=max(chat.config.gamma_max, n), gamma_floor=FLOOR)
    adaptive = f" (adaptive: the first block; then it follows acceptance, up to {chat.config.gamma_max})"
    return Reply("info", f"gamma {n}" + (adaptive if chat.config.adaptive else ""))


def _temp(chat: Chat, arg: str) -> Reply:
    try:
        x = float(arg)
    except ValueError:
        raise UsageError(f"/temp needs a number, got '{arg}'")
    if x != x or x in (float("inf"),):
        raise UsageError(f"/temp needs a finite number, got '{arg}'")
    _try_config(chat.config, temperature=x)
    return Reply("info", f"temperature {x:g}" + (" (greedy)" if x == 0 else ""))


def _max(chat: Chat, arg: str) -> Reply:
    try:
        n = int(arg)
    except ValueError:
        raise UsageError(f"/max needs a whole number, got '{arg}'")
    if n < 1:
        raise UsageError(f"/max must be at least 1 (got {n})")
    _try_config(chat.config, max_new_tokens=n)
    return Reply("info", f"at most {n} new tokens per answer")


def _system(chat: Chat, arg: str) -> Reply:
    chat.system = arg or None
    return Reply("info", f"system message set ({len(arg)} characters)" if arg else "system message removed")


def _reset(chat: Chat, arg: str) -> Reply:
    chat.messages = []
    chat.engine.reset()
    chat.conversation += 1
    return Reply("info", "new conversation (history and caches cleared)")


def _save(chat: Chat, arg: str) -> Reply:
    if not arg:
        raise UsageError("/save needs a file name: /save chat.json")
    path = paths.check_writable_file(arg, "/save", noun="transcript file")  # one line; the chat goes on
    try:
        paths.atomic_write_json(path, chat.to_json())
    except OSError as e:
        raise ViasdError(f"cannot write '{path}': {e.strerror or e}")
    return Reply("info", f"saved {len(chat.turns)} turns to {path}")


COMMANDS = {
    "help": _help, "?": _help, "stats": _stats, "mode": _mode, "gamma": _gamma,
    "temp": _temp, "temperature": _temp, "max": _max, "system": _system,
    "reset": _reset, "save": _save, "exit": _exit, "quit": _exit,
}
