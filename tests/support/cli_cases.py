"""The command line as the tests call it, and a prompts file (a helper module, not a test file)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from viasd_cli.app import get_app


def invoke(*args, input=None):
    return CliRunner().invoke(get_app(), [*map(str, args)], input=input)


@pytest.fixture
def prompt_file(tmp_path):
    path = tmp_path / "prompts.txt"
    words = [f"w{i}" for i in range(10, 60)]
    path.write_text("\n".join(" ".join(words[i : i + 6]) for i in range(0, 48, 6)) + "\n")
    return path


def one_line_error(r, code: int, message: str) -> None:
    """A command's refusal: exit `code`, one `Error:` line naming `message` on stderr, nothing on stdout."""
    assert r.exit_code == code, (r.exit_code, r.stderr)
    assert message in r.stderr, r.stderr
    assert r.stderr.startswith("Error: ") and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert r.stdout == ""
