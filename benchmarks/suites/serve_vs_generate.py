"""Tokens per second through `viasd serve` against `viasd generate`, same prompts, model and mode
(issue 25's goal: the server within 5% of generate), and the time to the first streamed token.

    python benchmarks/suites/serve_vs_generate.py [--prompts 8] [-n 64] [--mode sd] [-- MODEL OPTIONS...]

Both run as their own processes with the same options (default: the embedded pair):
  generate  `viasd generate --json` over the prompts (after one warm-up prompt); its rate is the
            engine's (sum of new tokens / sum of RunStats.time_total), as it prints it
  serve     `viasd serve --port 0`, one warm-up request, then the prompts one at a time through
            POST /v1/chat/completions: `client` = completion tokens / the request's wall time seen by
            the client (HTTP, JSON and tokenization included), `engine` = the same tokens / the
            server's own RunStats time (the `viasd` extension); then each prompt streamed, for the
            time to the first content chunk, seen by the client
generate's own time to the first token (RunStats.time_first_token: prefill and the first step, as
the engine times it) is the baseline of the streamed one (issue 51: within 10%).
The greedy texts of both are compared (they must be equal). Note: the server keeps the KV cache
of the previous request, so a prompt prefix shared with it (a chat template's system text) is not
prefilled again, while generate starts every prompt from an empty cache.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import statistics
import subprocess
import sys
import time
import urllib.request

from viasd_core.loading.prompts import default_prompts


def run_generate(prompts: list[str], args, model_args: list[str]) -> list[dict]:
    """generate's records for the prompts, after the first prompt once more as a warm-up (dropped)."""
    cmd = [sys.executable, "-m", "viasd_cli", "generate", prompts[0], *prompts, "--json", "-q", "-n", str(args.n),
           "--mode", args.mode, *model_args]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return [json.loads(line) for line in out.splitlines()][1:]


def post(base: str, body: dict, stream: bool = False):
    req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps({**body, "stream": stream}).encode(),
                                 headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=600)


def run_serve(prompts: list[str], args, model_args: list[str]) -> tuple[list[dict], list[float]]:
    cmd = [sys.executable, "-m", "viasd_cli", "serve", "--port", "0", "-n", str(args.n), "--mode", args.mode, *model_args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        found = re.search(r"(http://\S+)/v1", proc.stdout.readline())
        if not found:
            raise SystemExit("viasd serve did not start")
        base = found.group(1)
        body = lambda p: {"messages": [{"role": "user", "content": p}], "max_tokens": args.n}  # noqa: E731
        post(base, body(prompts[0])).read()  # warm-up
        rows = []
        for p in prompts:
            t0 = time.perf_counter()
            answer = json.loads(post(base, body(p)).read())
            wall = time.perf_counter() - t0
            rows.append({"text": answer["choices"][0]["message"]["content"], "tokens": answer["usage"]["completion_tokens"],
                         "wall": wall, "engine": answer["viasd"]["time_s"]})
        ttft = []
        for p in prompts:
            t0 = time.perf_counter()
            with post(base, body(p), stream=True) as resp:
                for line in resp:
                    if line.startswith(b"data: {") and b'"content":"' in line and b'"content":""' not in line:
                        ttft.append(time.perf_counter() - t0)
                        break
                resp.read()
        return rows, ttft
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8, help="how many of the shipped prompts")
    ap.add_argument("-n", type=int, default=64, help="new tokens per prompt")
    ap.add_argument("--mode", default="sd")
    ap.add_argument("model_args", nargs="*", help="model options for both, after --")
    args = ap.parse_args()
    prompts = [p.text for p in default_prompts()[: args.prompts]]
    gen = run_generate(prompts, args, args.model_args)
    rows, ttft = run_serve(prompts, args, args.model_args)
    gen_tokens = sum(r["new_tokens"] for r in gen)
    gen_rate = gen_tokens / sum(r["stats"]["time_total"] for r in gen)
    tokens = sum(r["tokens"] for r in rows)
    client_rate = tokens / sum(r["wall"] for r in rows)
    engine_rate = tokens / sum(r["engine"] for r in rows)
    same = sum(r["text"] == g["text"] for r, g in zip(rows, gen))
    gen_ttft = [r["stats"]["time_first_token"] for r in gen if r["stats"].get("time_first_token") is not None]
    gen_ttft_median = statistics.median(gen_ttft) if gen_ttft else None  # None: not measured
    result = {
        "date": time.strftime("%Y-%m-%d"), "mode": args.mode, "prompts": len(prompts), "max_new_tokens": args.n,
        "model_args": args.model_args, "generate_tok_s": gen_rate, "serve_client_tok_s": client_rate,
        "serve_engine_tok_s": engine_rate, "serve_vs_generate": client_rate / gen_rate,
        "ttft_median_s": statistics.median(ttft), "ttft_max_s": max(ttft),
        "generate_ttft_median_s": gen_ttft_median,
        "ttft_vs_generate": statistics.median(ttft) / gen_ttft_median if gen_ttft_median else None,
        "equal_texts": f"{same}/{len(prompts)}",
        "tokens": {"generate": gen_tokens, "serve": tokens},
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
