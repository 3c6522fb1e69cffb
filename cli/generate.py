"""`viasd generate`: multi-tier generation for shell pipelines (results on stdout, stats on stderr)."""

from __future__ import annotations

import json
import sys
from typing import Annotated, Optional

import typer

from viasd_core.speculation.engine import GenerationConfig
from viasd_core.speculation.grammar import grammar_option
from viasd_core.errors import UsageError
from viasd_core.speculation.fidelity import fidelity
from viasd_core.loading.prompts import encode
from viasd_core.loading.options import ModelOptions
from viasd_core.frontends.streaming import TextStream, stats_line

from .app import app
from .options import StderrLog, generation_options, handle_errors, model_options, open_session

EXAMPLES = """
EXAMPLES

  viasd generate "Write a haiku about rain"            (embedded model, best draft)

  echo "Explain KV caches" | viasd generate --json     (stdin, one JSON object)

  viasd generate --lines --mode ar < prompts.txt        (one prompt per line)

  viasd generate -m ./my-model -d ngram -n 256 "..."    (local folder, prompt lookup)

  viasd generate -m ./model.Q4_K_M.gguf "..."           (a GGUF file: converted once, weights dequantized)

  viasd generate -m Qwen/Qwen2.5-0.5B-Instruct "..."    (a hub id: downloaded on first use)

  viasd generate --json-schema person.json "Describe Ada Lovelace as JSON"   (output constrained to the schema)
"""


def read_prompts(prompts: list[str], lines: bool) -> list[str]:
    """The prompts to run, checked before any model loads (an empty one is refused here)."""
    if prompts and prompts != ["-"]:
        if any(not p.strip() for p in prompts):
            raise UsageError("the prompt is empty: give some text")
        return prompts
    if sys.stdin is None or sys.stdin.isatty():
        raise UsageError("no prompt: give it as an argument or pipe it on stdin")
    data = sys.stdin.read()
    if lines:
        out = [line for line in data.splitlines() if line.strip()]
    else:
        out = [data.strip()] if data.strip() else []
    if not out:
        raise UsageError("stdin held no prompt text")
    return out


@app.command(epilog=EXAMPLES)
@handle_errors
@generation_options(max_new_tokens=128)
@model_options
def generate(
    prompts: Annotated[Optional[list[str]], typer.Argument(help="Prompt(s); none or '-' reads stdin.")] = None,
    *,
    opts: ModelOptions,
    config: GenerationConfig,
    lines: Annotated[bool, typer.Option("--lines", help="Read one prompt per stdin line.")] = False,
    raw: Annotated[bool, typer.Option("--raw", help="Do not apply the chat template.")] = False,
    system: Annotated[Optional[str], typer.Option("--system", help="System message for the chat template.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per prompt on stdout.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No statistics or progress on stderr (a clipped --max-new-tokens is still said).")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Also say on stderr what viasd chose for this machine (weights, draft, threads, short passes, compile, trees) and why.")] = False,
    fidelity_check: Annotated[Optional[bool], typer.Option("--fidelity/--no-fidelity", help="Measure fidelity with one teacher-forced target pass (default: on in viasd mode).")] = None,
    json_schema: Annotated[Optional[str], typer.Option("--json-schema", help="The output is JSON matching this schema: a file, or the schema's JSON text ('{\"type\": \"object\"}' for any object). Exact in sd/exact as unconstrained.")] = None,
    grammar: Annotated[Optional[str], typer.Option("--grammar", help="The output matches the grammar in this file (GBNF; Lark for a .lark file).")] = None,
    regex: Annotated[Optional[str], typer.Option("--regex", help="The output matches this regular expression.")] = None,
):
    """Generate text for each prompt; text (or JSON lines) on stdout, statistics on stderr."""
    config.grammar = grammar_option(json_schema, grammar, regex)  # checked before any model loads
    texts = read_prompts(prompts or [], lines)
    log = StderrLog(quiet)
    session, config = open_session(opts, config, progress=log)
    if verbose:
        for setting, value, reason in session.choices():
            typer.echo(f"{setting}: {value} ({reason})", err=True)
    mode = config.mode
    measure = fidelity_check if fidelity_check is not None else mode == "viasd"
    for i, text in enumerate(texts):
        ids = encode(session.tokenizer, text, raw=raw, system=system)
        session.engine.reset()
        streamer = None if as_json else TextStream(session.tokenizer, sys.stdout)
        result = session.engine.generate(ids, config, on_emit=streamer)
        if measure:
            result.stats.fidelity = fidelity(session.target.model, ids, result.tokens)
        if as_json:
            record = {
                "index": i, "prompt": text, "text": result.text, "mode": mode, "model": session.target.model_id,
                "draft": session.draft_id, "prompt_tokens": len(ids), "new_tokens": len(result.tokens),
                "finish_reason": result.finish_reason, "clipped_to": result.clipped_to, "fidelity": result.stats.fidelity,
                "stats": result.stats.to_dict(),
            }
            sys.stdout.write(json.dumps(record) + "\n")
            sys.stdout.flush()
        else:
            streamer.finish(result.text)
        if result.clipped_to is not None:
            typer.echo(f"--max-new-tokens {config.max_new_tokens} clipped to {result.clipped_to}: the prompt's {len(ids)} "
                       f"tokens fill the rest of the {session.engine.context_len}-position context (raise --max-context)",
                       err=True)
        log(stats_line(result.stats, mode))
