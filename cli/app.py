"""The Typer app: registers one module per command and turns errors into one-line messages."""

from __future__ import annotations

import os
import sys

import typer

from viasd_core.errors import ViasdError

app = typer.Typer(
    name="viasd",
    help="Multi-tier speculative decoding (VIA-SD) for fast local LLM generation.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _register() -> None:
    # Each command lives in its own module; importing it attaches it to `app`.
    import importlib
    import logging

    # bitsandbytes logs notices on import and on every 8-bit matmul; stderr is for our statistics.
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)

    for name in ("generate", "calibrate", "bench", "chat", "pull", "models", "distill"):
        try:
            importlib.import_module(f"viasd_cli.{name}")
        except ModuleNotFoundError as e:  # a command not built yet
            if e.name != f"viasd_cli.{name}":
                raise


def main() -> None:
    """Entry point: click's standalone mode prints usage errors (exit 2) and applies exit codes;
    commands turn ViasdError into one line (options.handle_errors); anything else is one line too."""
    _register()
    try:
        app()
    except ViasdError as e:
        if os.environ.get("VIASD_DEBUG"):
            raise
        typer.echo(f"Error: {e.message}", err=True)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        typer.echo("Interrupted.", err=True)
        sys.exit(130)
    except Exception as e:
        if os.environ.get("VIASD_DEBUG"):
            raise
        typer.echo(f"Error: {type(e).__name__}: {e} (set VIASD_DEBUG=1 for the traceback)", err=True)
        sys.exit(1)


def get_app() -> typer.Typer:
    """The app with every command registered (for tests: `CliRunner().invoke(get_app(), ...)`)."""
    _register()
    return app


if __name__ == "__main__":  # `python -m viasd_cli.app`: run the imported module's app, where commands attach
    from viasd_cli.app import main as _main

    _main()
