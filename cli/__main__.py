"""`python -m viasd_cli` runs the CLI."""

from viasd_cli.app import main

main()
