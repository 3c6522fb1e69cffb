"""Load through `viasd serve --slots 4` with the official openai client (issue 51's goal): several
clients at once, a mix of requests, every answer checked against the same request sent alone.

    python benchmarks/suites/serve_load.py --out DIR [--clients 8] [--requests 20] [--slots 4]
        [-m MODEL] [--mode sd] [-- MORE SERVE OPTIONS...]

It starts `viasd serve --port 0 --slots S` (default: the embedded SmolLM2 pair), then:

  solo  every distinct request of the plan once, one at a time (nothing else running): the
        reference answer, and the solo latency; one warm-up request before it is dropped
  load  C clients in threads, each sending its R requests one after the other; client c's i-th
        request is kind KINDS[(c + i) % 6] on prompt (c * R + i) % P, so kinds and prompts mix

The kinds (chat, greedy): short (a few tokens), long, stream (streamed, accumulated by the client's
`chat.completions.stream`), tools (a required call of one tool), tools_stream (the same, streamed)
and json (`response_format` json_schema). Checked: every loaded answer equals its solo answer
(content, tool calls' names and arguments, finish reason; call ids aside), and every JSON answer
and tool call's arguments validate against their schema (jsonschema), solo and loaded alike.
Reported: per kind the count and latencies, and the short requests' p95 latency under load
against their solo latencies (wall time seen by the client, to the last byte or chunk).

The JSON goes to DIR/serve_load.json (written to a temporary file, then renamed); the exit status
is 1 when a check failed. The same functions run on a tiny model in tests/serve/test_serve_load.py.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

KINDS = ("short", "long", "stream", "tools", "tools_stream", "json")
SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                           "rain": {"type": "boolean"},
                                           "degrees": {"type": "integer", "minimum": -30, "maximum": 45}},
          "required": ["city", "rain", "degrees"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "weather", "description": "the weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}}


@dataclass(frozen=True)
class Budgets:
    """max_tokens per kind: calls and JSON get enough for a whole object (its schema bounds it)."""

    short: int = 16
    long: int = 128
    stream: int = 64
    call: int = 96


def plan(clients: int, requests: int, n_prompts: int) -> list[list[tuple[str, int]]]:
    """Per client, its requests as (kind, prompt index)."""
    return [[(KINDS[(c + i) % len(KINDS)], (c * requests + i) % n_prompts) for i in range(requests)]
            for c in range(clients)]


def _args(kind: str, prompt: str, model: str, budgets: Budgets) -> dict:
    args = {"model": model, "messages": [{"role": "user", "content": prompt}], "temperature": 0}
    if kind in ("tools", "tools_stream"):
        return {**args, "tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False,
                "max_tokens": budgets.call}
    if kind == "json":
        return {**args, "max_tokens": budgets.call,
                "response_format": {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}}}
    return {**args, "max_tokens": {"short": budgets.short, "long": budgets.long, "stream": budgets.stream}[kind]}


def ask(client, model: str, kind: str, prompt_index: int, prompt: str, budgets: Budgets) -> dict:
    """One request's answer: content, tool calls [(name, arguments)], finish reason, tokens, latency."""
    args = _args(kind, prompt, model, budgets)
    t0 = time.perf_counter()
    if kind.endswith("stream"):
        with client.chat.completions.stream(**args, stream_options={"include_usage": True}) as stream:
            for _ in stream:
                pass
            # what the client accumulated (get_final_completion would raise on a 'length' finish)
            done = stream.current_completion_snapshot
    else:
        done = client.chat.completions.create(**args)
    latency = time.perf_counter() - t0
    choice = done.choices[0]
    return {"kind": kind, "prompt": prompt_index, "content": choice.message.content or None,
            "calls": [[c.function.name, c.function.arguments] for c in choice.message.tool_calls or []],
            "finish": choice.finish_reason, "tokens": done.usage.completion_tokens if done.usage else None,
            "latency_s": latency}


def same(a: dict, b: dict) -> bool:
    return (a["content"], a["calls"], a["finish"]) == (b["content"], b["calls"], b["finish"])


def invalid(answer: dict) -> str | None:
    """Why a JSON or tool-call answer does not hold to its schema (None: it does, or it has none)."""
    import jsonschema

    if answer["kind"] == "json":
        if answer["finish"] != "stop":
            return f"finish_reason {answer['finish']}"
        pairs = [(answer["content"], SCHEMA)]
    elif answer["kind"] in ("tools", "tools_stream"):
        if answer["finish"] != "tool_calls" or len(answer["calls"]) != 1 or answer["calls"][0][0] != "weather":
            return f"not one weather call (finish_reason {answer['finish']}, calls {answer['calls']})"
        pairs = [(answer["calls"][0][1], WEATHER["function"]["parameters"])]
    else:
        return None
    for text, schema in pairs:
        try:
            jsonschema.validate(json.loads(text or ""), schema)
        except (ValueError, jsonschema.ValidationError) as e:
            return f"{type(e).__name__}: {str(e).splitlines()[0]}"
    return None


def check(solo: dict, loaded: list[dict]) -> dict:
    """Loaded answers against their solo answers, and every JSON answer against its schema."""
    mismatches = [{"kind": a["kind"], "prompt": a["prompt"], "solo": solo[(a["kind"], a["prompt"])], "loaded": a}
                  for a in loaded if not same(a, solo[(a["kind"], a["prompt"])])]
    answers = [*solo.values(), *loaded]
    bad = [{"kind": a["kind"], "prompt": a["prompt"], "why": why, "answer": a} for a in answers
           if (why := invalid(a)) is not None]
    checked = sum(a["kind"] in ("json", "tools", "tools_stream") for a in answers)
    return {"answers": len(loaded), "equal": len(loaded) - len(mismatches), "mismatches": mismatches,
            "json_checked": checked, "invalid_json": bad}


def p95(values: list[float]) -> float:
    """The nearest-rank 95th percentile."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


def latencies(solo: dict, loaded: list[dict]) -> dict:
    out = {}
    for kind in KINDS:
        alone = [a["latency_s"] for a in solo.values() if a["kind"] == kind]
        under = [a["latency_s"] for a in loaded if a["kind"] == kind]
        if under:
            out[kind] = {"count": len(under), "load_median_s": statistics.median(under), "load_p95_s": p95(under),
                         "solo_median_s": statistics.median(alone), "solo_p95_s": p95(alone)}
    short = out.get("short")
    if short:
        short["p95_load_over_solo_p95"] = short["load_p95_s"] / short["solo_p95_s"]
    return out


def run_load(base: str, prompts: list[str], clients: int, requests: int, budgets: Budgets = Budgets(),
             api_key: str = "none") -> dict:
    """The solo pass, then the load, against a server at `base`; the checks and latencies."""
    from openai import OpenAI

    def connect():
        return OpenAI(base_url=base + "/v1", api_key=api_key, max_retries=0, timeout=1800)

    first = connect()
    model = first.models.list().data[0].id
    todo = plan(clients, requests, len(prompts))
    ask(first, model, "short", 0, prompts[0], budgets)  # warm-up, dropped
    solo = {key: ask(first, model, *key, prompts[key[1]], budgets) for key in dict.fromkeys(k for row in todo for k in row)}

    def one_client(row):
        client = connect()
        return [ask(client, model, kind, p, prompts[p], budgets) for kind, p in row]

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        loaded = [a for answers in pool.map(one_client, todo) for a in answers]
    wall = time.perf_counter() - t0
    return {"model": model, "clients": clients, "requests_per_client": requests, "prompts": len(prompts),
            "budgets": asdict(budgets), **check(solo, loaded), "latency": latencies(solo, loaded), "load_wall_s": wall,
            "load_completion_tokens": sum(a["tokens"] or 0 for a in loaded)}


# ---------------------------------------------------------------------- the command
def start_server(args, log) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "viasd_cli", "serve", "--port", "0", "--slots", str(args.slots), "--mode", args.mode,
           "--max-queue", str(max(16, args.clients)), "--no-access-log", *(["-m", args.model] if args.model else []),
           *args.serve_args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True)
    found = re.search(r"(http://\S+)/v1", proc.stdout.readline())
    if not found:
        proc.wait(30)
        raise SystemExit(f"viasd serve did not start (its stderr: {log.name})")
    return proc, found.group(1)


def write_json(out: Path, result: dict) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "serve_load.json"
    fd, tmp = tempfile.mkstemp(dir=out, prefix=".serve_load.", suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
    return path


def main() -> None:
    from viasd_core.loading.prompts import default_prompts

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path, help="folder for serve_load.json (and the server's stderr)")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=20, help="requests per client")
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=8, help="how many of the shipped prompts")
    ap.add_argument("-m", "--model", default=None, help="the served model (default: the embedded one)")
    ap.add_argument("--mode", default="sd")
    ap.add_argument("--short-tokens", type=int, default=Budgets.short)
    ap.add_argument("--long-tokens", type=int, default=Budgets.long)
    ap.add_argument("--stream-tokens", type=int, default=Budgets.stream)
    ap.add_argument("--call-tokens", type=int, default=Budgets.call)
    ap.add_argument("serve_args", nargs="*", help="more `viasd serve` options, after --")
    args = ap.parse_args()
    if min(args.clients, args.requests, args.slots, args.prompts) < 1:
        raise SystemExit("--clients, --requests, --slots and --prompts must be at least 1")
    prompts = [p.text for p in default_prompts()[: args.prompts]]
    budgets = Budgets(args.short_tokens, args.long_tokens, args.stream_tokens, args.call_tokens)
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "serve_load.server.log", "w") as log:
        proc, base = start_server(args, log)
        try:
            result = run_load(base, prompts, args.clients, args.requests, budgets)
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait(60)
    result = {"date": time.strftime("%Y-%m-%d"), "machine": platform.processor() or platform.machine(),
              "mode": args.mode, "slots": args.slots, "model_arg": args.model or "embedded default",
              "serve_args": args.serve_args, **result}
    path = write_json(args.out, result)
    short = result["latency"].get("short", {})
    print(f"{result['equal']}/{result['answers']} answers equal to solo, {len(result['invalid_json'])} of "
          f"{result['json_checked']} JSON answers invalid; short requests: p95 {short.get('load_p95_s', float('nan')):.3f} s "
          f"under load, {short.get('solo_p95_s', float('nan')):.3f} s solo (p95); {path}")
    sys.exit(1 if result["mismatches"] or result["invalid_json"] else 0)


if __name__ == "__main__":
    main()
