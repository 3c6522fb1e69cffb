"""The Typer app: registers one module per command and turns errors into one-line messages."""

from __future__ import annotations

import os
import sys

import typer

app = typer.Typer(
    name="viasd",
    help="Multi-tier speculative decoding (VIA-SD) for fast local LLM generation.",
    no_args_is_help=True,
    add_completion=True,  # --install-completion / --show-completion (bash, zsh, fish, PowerShell)
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            typer.echo(f"viasd {version('viasd')}")
        except PackageNotFoundError:  # run from a source tree that was never installed
            typer.echo("viasd (version unknown: not installed; pip install -e .)")
        raise typer.Exit()


@app.callback()
def _main(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version and exit."),
) -> None:
    """Multi-tier speculative decoding (VIA-SD) for fast local LLM generation."""


def _register() -> None:
    # Each command lives in its own module; importing it attaches it to `app`.
    import importlib
    import logging

    from viasd_core import paths

    # bitsandbytes logs notices on import and on every 8-bit matmul; stderr is for our statistics.
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    # inductor's compiled kernels, kept for later runs under our cache (not a temporary folder).
    # Set before anything imports torch._dynamo, which fixes the folder on import.
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(paths.cache_dir() / "inductor"))

    for name in ("generate", "calibrate", "bench", "chat", "pull", "models", "distill", "doctor", "serve", "export"):
        try:
            importlib.import_module(f"viasd_cli.{name}")
        except ModuleNotFoundError as e:  # a command not built yet
            if e.name != f"viasd_cli.{name}":
                raise


def main() -> None:
    """Entry point: click's standalone mode prints usage errors (exit 2) and applies exit codes;
    every other error is one line (options.report_error), Ctrl-C exits 130."""
    from viasd_cli.options import report_error

    _register()
    try:
        _check_isa_cap()
        app()
    except KeyboardInterrupt:
        typer.echo("Interrupted.", err=True)
        sys.exit(130)
    except Exception as e:
        sys.exit(report_error(e))


def _check_isa_cap() -> None:
    """VIASD_MAX_CPU_ISA is read by every kernel build: a value it does not know is a usage error now,
    not a kernel quietly left unbuilt later."""
    from viasd_kernels import instruction_set

    from viasd_core.errors import UsageError

    try:
        instruction_set.max_isa()
    except ValueError as e:
        raise UsageError(str(e)) from None


def get_app() -> typer.Typer:
    """The app with every command registered (for tests: `CliRunner().invoke(get_app(), ...)`)."""
    _register()
    return app


if __name__ == "__main__":  # `python -m viasd_cli.app`: run the imported module's app, where commands attach
    import viasd_cli.app

    viasd_cli.app.main()
