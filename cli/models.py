"""`viasd models`: the catalog of known-good pairs, what is local and what is calibrated."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from viasd_cli.app import app
from viasd_cli.options import handle_errors
from viasd_core.loading import catalog
from viasd_core.loading import hub

EXAMPLES = """
EXAMPLES

  viasd models                 # a table on stdout

  viasd models --json | jq '.[] | select(.target_local and .draft_local) | .name'

`local`: in the Hugging Face cache (HF_HUB_CACHE), or installed for the embedded pair.
`profile`: a calibration profile saved by `viasd calibrate` for this pair.
"""


def pair_rows() -> list[dict]:
    """One dict per catalog pair: the catalog fields plus local and profile status (the --json schema)."""
    embedded = catalog.embedded_available()
    rows = []
    for pair in catalog.PAIRS:
        if pair.embedded:
            target_local = draft_local = embedded
        else:
            target_local, draft_local = hub.is_cached(pair.target), hub.is_cached(pair.draft)
        profiles = catalog.profiles_for(pair)
        rows.append(
            pair.to_dict()
            | {
                "target_local": target_local,
                "draft_local": draft_local,
                "has_profile": bool(profiles),
                "profiles": [str(p) for p in profiles],
            }
        )
    return rows


@app.command(epilog=EXAMPLES)
@handle_errors
def models(
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON list instead of a table.")] = False,
) -> None:
    """List the known-good target/draft pairs, whether they are local and calibrated."""
    rows = pair_rows()
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return

    from rich.console import Console
    from rich.table import Table

    def yes_no(value: bool) -> str:
        return "[green]yes[/]" if value else "[dim]no[/]"

    table = Table(title="viasd pairs (pull one with `viasd pull NAME`)")
    for column in ("pair", "target", "draft", "params", "download", "target local", "draft local", "profile"):
        table.add_column(column, overflow="fold")  # wrap long repo ids, never cut them
    for row in rows:
        download = "embedded" if row["embedded"] else f"~{row['approx_download_gb']:g} GB"
        if row["gated"]:
            download += " (gated)"
        table.add_row(
            row["name"],
            row["target"],
            row["draft"] + (" (EAGLE-3 head)" if row["draft_kind"] == "feature" else ""),
            f"{catalog.human_params(row['target_params'])} / {catalog.human_params(row['draft_params'])}",
            download,
            yes_no(row["target_local"]),
            yes_no(row["draft_local"]),
            yes_no(row["has_profile"]),
        )
    console = Console()
    if not console.is_terminal:  # piped: no terminal width to respect, keep one row per line
        console = Console(width=200)
    console.print(table)
