"""Prometheus metrics of the server under vLLM's names and labels, so a vLLM dashboard reads them:
every series is labelled `model_name` (the served name), and a metric vLLM has is named as vLLM
names it (`vllm:e2e_request_latency_seconds`, `vllm:spec_decode_num_accepted_tokens_per_pos`, ...).
What vLLM has no metric for is `viasd:` (target and slim passes, tiers, proposals per position,
requests by endpoint and status). Generation series also carry the request's `mode`.

Counters add up what the engine did for every generation it ran (finished, cancelled or timed
out alike); the derived figures are ratios of counters (PromQL `rate()` of both sides):

  tokens per target pass      vllm:generation_tokens_total / viasd:target_passes_total
  acceptance at position j    vllm:spec_decode_num_accepted_tokens_per_pos_total{position=j}
                              / viasd:spec_decode_num_draft_tokens_per_pos_total{position=j}
  mean acceptance length      1 + vllm:spec_decode_num_accepted_tokens_total / vllm:spec_decode_num_drafts_total
  tier share                  viasd:tier_tokens_total{tier=t} / vllm:generation_tokens_total

Time per output token, as vLLM: `vllm:inter_token_latency_seconds` observes the time between
consecutive engine steps that emitted tokens (one observation per step: a speculative step emits
several tokens at once, which is what it is for), `vllm:time_per_output_token_seconds` the same
observations under vLLM's older name, and `vllm:request_time_per_output_token_seconds` one per
request: (last token - first token) / (new tokens - 1).

Each server owns its registry (two apps in one process never share counters). As vLLM does, the
`_created` series that prometheus_client adds to every counter are turned off (process-wide).
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

from viasd_core.speculation.stats import RunStats

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0)  # vLLM's, with three below 10 ms (a CPU's small models)


class ServeMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str):
        disable_created_metrics()
        self.model_name = model_name
        r = self.registry = CollectorRegistry()
        name, m = ["model_name"], ["model_name", "mode"]

        def histogram(metric, doc, labels, buckets=LATENCY_BUCKETS):
            return Histogram(metric, doc, labels, buckets=buckets, registry=r)

        self.requests = Counter("viasd:requests", "API requests answered, by endpoint and HTTP status",
                                name + ["endpoint", "status"], registry=r)
        self.finished = Counter("vllm:request_success", "Generations the engine ran, by how they ended "
                                "(stop, length, abort: client gone, timeout, shutdown)", m + ["finished_reason"], registry=r)
        self.running = Gauge("vllm:num_requests_running", "Requests holding a slot now (0 to --slots)", name, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests queued for the engine, or parked", name, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of the generations", m, registry=r)
        self.cache_queries = Counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the KV cache", m, registry=r)
        self.cached_tokens = Counter("vllm:prefix_cache_hits", "Prompt tokens served from the KV cache "
                                     "(the prefix shared with the previous request)", m, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "New tokens generated", m, registry=r)
        self.target_passes = Counter("viasd:target_passes", "Target model passes (a plain step or a block verification)",
                                     m, registry=r)
        self.slim_passes = Counter("viasd:slim_passes", "Slim verifier passes (exact and viasd)", m, registry=r)
        self.drafts = Counter("vllm:spec_decode_num_drafts", "Drafted blocks (speculative steps)", m, registry=r)
        self.draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed", m, registry=r)
        self.accepted_tokens = Counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens kept", m, registry=r)
        self.draft_per_pos = Counter("viasd:spec_decode_num_draft_tokens_per_pos", "Draft tokens proposed at block position j",
                                     m + ["position"], registry=r)
        self.accepted_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Draft tokens kept at block position j",
                                        m + ["position"], registry=r)
        self.tier_tokens = Counter("viasd:tier_tokens", "New tokens by the tier that decided them "
                                   "(accept, slim, full, bonus)", m + ["tier"], registry=r)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Arrival to last token", m)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Arrival to first new token", m)
        self.queue_time = histogram("vllm:request_queue_time_seconds", "Arrival to the start on the engine", name)
        self.inference_time = histogram("vllm:request_inference_time_seconds", "Time on the engine", m)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Time between consecutive steps that emitted tokens",
                             m, TOKEN_BUCKETS)
        self.tpot_step = histogram("vllm:time_per_output_token_seconds", "The same as vllm:inter_token_latency_seconds "
                                   "(vLLM's older name)", m, TOKEN_BUCKETS)
        self.tpot = histogram("vllm:request_time_per_output_token_seconds", "Per request: (last token - first token) "
                              "/ (new tokens - 1)", m, TOKEN_BUCKETS)
        self.running.labels(model_name).set(0)
        self.waiting.labels(model_name).set(0)

    def set_running(self, n: int) -> None:
        self.running.labels(self.model_name).set(n)

    def set_waiting(self, n: int) -> None:
        self.waiting.labels(self.model_name).set(n)

    def answered(self, endpoint: str, status: int) -> None:
        self.requests.labels(self.model_name, endpoint, str(status)).inc()

    def generation(self, stats: RunStats, finished_reason: str, queue_s: float, inference_s: float,
                   ttft_s: float | None, e2e_s: float, emitted: list[tuple[float, int]] = ()) -> None:
        """One generation the engine ran: what it did and how long it took. `emitted`: (time, new
        tokens) of each engine step that emitted tokens, in order."""
        labels = (self.model_name, stats.mode)
        self.finished.labels(*labels, finished_reason).inc()
        self.prompt_tokens.labels(*labels).inc(stats.prompt_tokens)
        self.cache_queries.labels(*labels).inc(stats.prompt_tokens)
        self.cached_tokens.labels(*labels).inc(stats.prefill_cached)
        self.generation_tokens.labels(*labels).inc(stats.new_tokens)
        self.target_passes.labels(*labels).inc(stats.target_passes)
        self.slim_passes.labels(*labels).inc(stats.slim_passes)
        self.drafts.labels(*labels).inc(len(stats.position_attempts) and stats.position_attempts[0])
        self.draft_tokens.labels(*labels).inc(stats.draft_tokens)
        self.accepted_tokens.labels(*labels).inc(sum(stats.position_accepts))
        for j, (tried, kept) in enumerate(zip(stats.position_attempts, stats.position_accepts)):
            self.draft_per_pos.labels(*labels, str(j)).inc(tried)
            self.accepted_per_pos.labels(*labels, str(j)).inc(kept)
        for tier, count in stats.tier_counts.items():
            self.tier_tokens.labels(*labels, tier).inc(count)
        self.queue_time.labels(self.model_name).observe(queue_s)
        self.inference_time.labels(*labels).observe(inference_s)
        if ttft_s is not None:
            self.ttft.labels(*labels).observe(ttft_s)
        self.e2e.labels(*labels).observe(e2e_s)
        for (before, _), (after, _) in zip(emitted, emitted[1:]):
            self.itl.labels(*labels).observe(after - before)
            self.tpot_step.labels(*labels).observe(after - before)
        tokens = sum(n for _, n in emitted)
        if tokens > 1:
            self.tpot.labels(*labels).observe((emitted[-1][0] - emitted[0][0]) / (tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
