"""`viasd chat` in a real terminal (a pseudo-terminal): the live status line appears and
updates while an answer streams, and Ctrl-C stops that answer without ending the session.

Nothing here assumes a speed: every wait is for an event (text on the terminal) with a generous
deadline, and the interrupted answer is far too long (NEW tokens) to finish before the Ctrl-C.
"""

import os
import re
import select
import signal
import shutil
import struct
import subprocess
import sys
import time

import pytest

fcntl = pytest.importorskip("fcntl", reason="needs a POSIX pseudo-terminal (fcntl)")
termios = pytest.importorskip("termios", reason="needs a POSIX pseudo-terminal (termios)")
if not hasattr(os, "openpty"):
    pytest.skip("needs os.openpty (a POSIX pseudo-terminal)", allow_module_level=True)

from conftest import tiny_model

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[()][A-Z0-9]|\r")
DEADLINE = 300.0  # seconds: only reached when something is wrong (a loaded machine stays well inside it)
NEW = 4000  # the budget of the interrupted answer; the slow target's context holds it
STATUS = re.compile(r"\bsd · (\d+) tok · [\d.]+ tok/s · [\d.-]+ tok/pass · [\d.-]+ accepted · A\d+ S\d+ F\d+ B\d+ % tiers")


@pytest.fixture(scope="module")
def slow_target(tiny_dirs, tmp_path_factory):
    """A larger random target (slow enough to interrupt) that never chooses EOS, sharing the
    tiny models' tokenizer and vocabulary."""
    import torch

    folder = tmp_path_factory.mktemp("slow") / "target"
    model = tiny_model("llama", n_layers=8, seed=41, hidden_size=384, intermediate_size=1536, num_attention_heads=6,
                       num_key_value_heads=2, max_position_embeddings=NEW + 96)
    with torch.no_grad():
        model.lm_head.weight[2] = 0  # EOS logit 0: below the greedy maximum of 255 large random logits
    model.generation_config.eos_token_id = 2
    model.save_pretrained(folder)
    for f in os.listdir(tiny_dirs["target"]):
        if "token" in f or f.endswith(".jinja"):
            shutil.copy(tiny_dirs["target"] / f, folder / f)
    return folder


class Terminal:
    """A child process on a pseudo-terminal that is its controlling terminal (so ^C is SIGINT)."""

    def __init__(self, argv, env, cols=120, rows=40):
        master, slave = os.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
        self.proc = subprocess.Popen(
            argv, stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True, start_new_session=True,
            preexec_fn=self._session_child,
        )
        os.close(slave)
        self.fd = master
        self.raw = b""

    @staticmethod
    def _session_child() -> None:
        """In the child: the terminal becomes its controlling terminal, and Ctrl-C's signal gets its
        default action back, as in a login shell (a suite started in the background by a
        non-interactive shell inherits SIGINT ignored, and Python then installs no handler)."""
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    def read(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            ready, _, _ = select.select([self.fd], [], [], max(0.0, min(0.05, end - time.monotonic())))
            if ready:
                try:
                    chunk = os.read(self.fd, 65536)
                except OSError:  # the child closed the terminal
                    return
                if not chunk:
                    return
                self.raw += chunk

    @property
    def text(self) -> str:
        return ANSI.sub("", self.raw.decode("utf-8", "replace"))

    def expect(self, pattern, timeout: float, start: int = 0):
        """Read until `pattern` matches the plain text from `start`; the match, or fail with the screen."""
        end = time.monotonic() + timeout
        while True:
            m = re.compile(pattern).search(self.text, start)
            if m:
                return m
            if time.monotonic() > end or self.proc.poll() is not None and not select.select([self.fd], [], [], 0)[0]:
                pytest.fail(f"no {pattern!r} within {timeout} s; terminal output:\n{self.text[-3000:]}")
            self.read(0.1)

    def send(self, data: str) -> None:
        os.write(self.fd, data.encode())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        os.close(self.fd)


def test_live_status_and_ctrl_c_in_a_terminal(tiny_dirs, slow_target, viasd_home):
    env = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "COLUMNS", "LINES")}
    env.update(TERM="xterm-256color", PYTHONUNBUFFERED="1")
    argv = [sys.executable, "-c", "from viasd_cli.app import main; main()", "chat", "-m", str(slow_target),
            "-d", str(tiny_dirs["draft"]), "-n", str(NEW)]
    term = Terminal(argv, env)
    try:
        term.expect(r"you> ", timeout=DEADLINE)
        assert "tiers: accept" in term.text  # the legend
        term.send("w1 w2 w3\n")
        # The status line appears, then shows a larger token count: it is live.
        first = term.expect(STATUS, timeout=DEADLINE)
        later = first
        deadline = time.monotonic() + DEADLINE
        while int(later.group(1)) <= int(first.group(1)) and time.monotonic() < deadline:
            term.read(0.2)
            later = list(STATUS.finditer(term.text))[-1]
        assert int(later.group(1)) > int(first.group(1)), term.text[-2000:]
        assert "\x1b[" in term.raw.decode("utf-8", "replace")  # colored tokens and a redrawn status

        term.send("\x03")  # Ctrl-C: stops this answer, not the session
        summary = term.expect(r"\[sd\] (\d+) tokens in .*?interrupted", timeout=DEADLINE)
        assert int(summary.group(1)) < NEW
        prompt = term.expect(r"you> ", timeout=DEADLINE, start=summary.end())
        assert term.proc.poll() is None

        term.send("/max 5\n")
        term.expect(r"at most 5 new tokens per answer", timeout=DEADLINE, start=prompt.end())
        term.send("w4 w5\n")
        second = term.expect(r"\[sd\] (\d+) tokens in [^\n]*", timeout=DEADLINE, start=prompt.end())
        assert int(second.group(1)) == 5 and "interrupted" not in second.group(0)
        assert "from cache" in second.group(0) and not re.search(r"prefill \d+ processed, 0 from cache", second.group(0))

        term.send("/exit\n")
        term.expect(r"Session: 2 turns", timeout=DEADLINE, start=second.end())
        assert term.proc.wait(DEADLINE) == 0
    finally:
        term.close()
