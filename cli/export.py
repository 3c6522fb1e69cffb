"""`viasd export`: an EAGLE-3 head written in the layout vLLM or SGLang loads, with the command
that serves it (viasd_core.loading.head_export; docs/export.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from viasd_cli.app import app
from viasd_cli.options import handle_errors
from viasd_core.loading.head_export import export_head

EXAMPLES = """
EXAMPLES

  viasd export ./head --to vllm ./head-vllm --target meta-llama/Llama-3.1-8B-Instruct

  viasd export ./head --to sglang ./head-sglang --target ./my-llama     # a local target: the head is checked against it

  viasd export ./head --to vllm --layout speculators ./head-spec --target Qwen/Qwen3-8B

The folder is written whole or not at all; the serve command goes to stdout, notes to stderr.
No engine is run: the files follow what vLLM's and SGLang's loaders read (docs/export.md).
"""


@app.command(epilog=EXAMPLES)
@handle_errors
def export(
    head: Annotated[Path, typer.Argument(help="The head's folder (viasd distill --kind feature --out, or any EAGLE-3 head viasd loads).", show_default=False)],
    out: Annotated[Path, typer.Argument(help="Folder to write (new, empty, or an earlier export: replaced atomically).", show_default=False)],
    to: Annotated[str, typer.Option("--to", help="The engine: vllm or sglang.")] = "vllm",
    layout: Annotated[str, typer.Option("--layout", help="eagle3 (vLLM and SGLang) or speculators (vLLM's own library's layout; vLLM only).")] = "eagle3",
    target: Annotated[Optional[str], typer.Option("--target", help="The target model as the engine names it (hub id or folder); a local folder is also checked against the head.")] = None,
    tokens: Annotated[Optional[int], typer.Option("--tokens", help="Draft length (num_speculative_tokens). [default: from the head's measured agreement by position, else 3]")] = None,
) -> None:
    """Write an EAGLE-3 head for vLLM or SGLang and print the command that serves it."""
    result = export_head(head, to, out, layout=layout, target=target, tokens=tokens)
    typer.echo(f"wrote {result.folder} ({result.layout} layout for {result.engine}); draft length {result.tokens_why}", err=True)
    for note in result.notes:
        typer.echo(f"note: {note}", err=True)
    typer.echo(result.command)
