"""Prometheus metrics of the server, named in the style of vLLM's (`vllm:` -> `viasd:`).

Counters add up what the engine did for every generation it ran (finished, cancelled or timed
out alike), labelled by mode; the derived figures are ratios of counters (PromQL `rate()` of
both sides):

  tokens per target pass      viasd:generation_tokens_total / viasd:target_passes_total
  acceptance at position j    viasd:spec_decode_num_accepted_tokens_per_pos_total{position=j}
                              / viasd:spec_decode_num_draft_tokens_per_pos_total{position=j}
  mean acceptance length      1 + viasd:spec_decode_num_accepted_tokens_total / viasd:spec_decode_num_drafts_total
  tier share                  viasd:tier_tokens_total{tier=t} / viasd:generation_tokens_total

Each server owns its registry (two apps in one process never share counters). As vLLM does, the
`_created` series that prometheus_client adds to every counter are turned off (process-wide).
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

from viasd_core.decoding.stats import RunStats

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class ServeMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self):
        disable_created_metrics()
        r = self.registry = CollectorRegistry()
        m = ["mode"]
        self.requests = Counter("viasd:requests", "API requests answered, by endpoint and HTTP status",
                                ["endpoint", "status"], registry=r)
        self.finished = Counter("viasd:request_success", "Generations the engine ran, by how they ended "
                                "(stop, length, abort: client gone, timeout, shutdown)", ["finished_reason", "mode"], registry=r)
        self.running = Gauge("viasd:num_requests_running", "Requests on the engine now (0 or 1)", registry=r)
        self.waiting = Gauge("viasd:num_requests_waiting", "Requests queued for the engine", registry=r)
        self.prompt_tokens = Counter("viasd:prompt_tokens", "Prompt tokens of the generations", m, registry=r)
        self.cached_tokens = Counter("viasd:prefix_cache_hits", "Prompt tokens served from the KV cache "
                                     "(the prefix shared with the previous request)", m, registry=r)
        self.generation_tokens = Counter("viasd:generation_tokens", "New tokens generated", m, registry=r)
        self.target_passes = Counter("viasd:target_passes", "Target model passes (a plain step or a block verification)",
                                     m, registry=r)
        self.slim_passes = Counter("viasd:slim_passes", "Slim verifier passes (exact and viasd)", m, registry=r)
        self.drafts = Counter("viasd:spec_decode_num_drafts", "Drafted blocks (speculative steps)", m, registry=r)
        self.draft_tokens = Counter("viasd:spec_decode_num_draft_tokens", "Draft tokens proposed", m, registry=r)
        self.accepted_tokens = Counter("viasd:spec_decode_num_accepted_tokens", "Draft tokens kept", m, registry=r)
        self.draft_per_pos = Counter("viasd:spec_decode_num_draft_tokens_per_pos", "Draft tokens proposed at block position j",
                                     m + ["position"], registry=r)
        self.accepted_per_pos = Counter("viasd:spec_decode_num_accepted_tokens_per_pos", "Draft tokens kept at block position j",
                                        m + ["position"], registry=r)
        self.tier_tokens = Counter("viasd:tier_tokens", "New tokens by the tier that decided them "
                                   "(accept, slim, full, bonus)", m + ["tier"], registry=r)
        self.e2e = Histogram("viasd:e2e_request_latency_seconds", "Arrival to last token", m, buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("viasd:time_to_first_token_seconds", "Arrival to first new token", m,
                              buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("viasd:request_queue_time_seconds", "Arrival to the start on the engine",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.inference_time = Histogram("viasd:request_inference_time_seconds", "Time on the engine", m,
                                        buckets=LATENCY_BUCKETS, registry=r)

    def answered(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def generation(self, stats: RunStats, finished_reason: str, queue_s: float, inference_s: float,
                   ttft_s: float | None, e2e_s: float) -> None:
        """One generation the engine ran: what it did and how long it took."""
        mode = stats.mode
        self.finished.labels(finished_reason, mode).inc()
        self.prompt_tokens.labels(mode).inc(stats.prompt_tokens)
        self.cached_tokens.labels(mode).inc(stats.prefill_cached)
        self.generation_tokens.labels(mode).inc(stats.new_tokens)
        self.target_passes.labels(mode).inc(stats.target_passes)
        self.slim_passes.labels(mode).inc(stats.slim_passes)
        self.drafts.labels(mode).inc(len(stats.position_attempts) and stats.position_attempts[0])
        self.draft_tokens.labels(mode).inc(stats.draft_tokens)
        self.accepted_tokens.labels(mode).inc(sum(stats.position_accepts))
        for j, (tried, kept) in enumerate(zip(stats.position_attempts, stats.position_accepts)):
            self.draft_per_pos.labels(mode, str(j)).inc(tried)
            self.accepted_per_pos.labels(mode, str(j)).inc(kept)
        for tier, count in stats.tier_counts.items():
            self.tier_tokens.labels(mode, tier).inc(count)
        self.queue_time.observe(queue_s)
        self.inference_time.labels(mode).observe(inference_s)
        if ttft_s is not None:
            self.ttft.labels(mode).observe(ttft_s)
        self.e2e.labels(mode).observe(e2e_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
