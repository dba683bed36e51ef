"""Prometheus metrics of one server: a registry per app, so several apps can live in one process.

Counters and histograms are updated by the HTTP side as responses finish; engine gauges (running and
waiting requests, cache usage, prefix hits) are read from the engine loop's last snapshot at scrape time.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0)


class _EngineCollector:
    def __init__(self, loop, model_name: str):
        self.loop = loop
        self.model_name = model_name

    def collect(self):
        s = self.loop.snapshot
        labels = ["model_name"]

        def gauge(name: str, doc: str, value: float):
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric([self.model_name], value)
            return g

        def counter(name: str, doc: str, value: float):
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric([self.model_name], value)
            return c

        yield gauge("kimik3_num_requests_running", "Sequences the engine is running.", s["running"])
        yield gauge("kimik3_num_requests_waiting", "Sequences accepted but not yet running.", s["waiting"])
        yield gauge("kimik3_kv_cache_usage_ratio", "Fraction of cache blocks held by requests (0..1).",
                    s["cache_usage"])
        yield gauge("kimik3_kv_cache_free_blocks", "Cache blocks not held by any request.", s["free_blocks"])
        yield gauge("kimik3_prefix_cache_hit_rate", "Prompt tokens served from the prefix cache / prompt tokens "
                    "queried, since start.", s["prefix_hit_rate"])
        yield counter("kimik3_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      s["prefix_queried_tokens"])
        yield counter("kimik3_prefix_cache_hits", "Prompt tokens found in the prefix cache.", s["prefix_hit_tokens"])
        yield counter("kimik3_num_preemptions", "Sequences preempted for lack of cache.", s["preemptions"])
        yield counter("kimik3_spec_decode_num_draft_tokens", "Speculative draft tokens verified.", s["draft_tokens"])
        yield counter("kimik3_spec_decode_num_accepted_tokens", "Speculative draft tokens accepted.",
                      s["accepted_tokens"])
        yield counter("kimik3_engine_step_failures", "Engine steps that raised.", s["step_failures"])


class ServerMetrics:
    def __init__(self, loop, model_name: str):
        self.registry = r = CollectorRegistry()
        self.model_name = model_name
        self.requests = Counter("kimik3_requests", "HTTP requests by route and status code.",
                                ["route", "status"], registry=r)
        self.finished = Counter("kimik3_request_finish", "Finished sequences by finish reason.",
                                ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("kimik3_prompt_tokens", "Prompt tokens of accepted requests.", registry=r)
        self.generation_tokens = Counter("kimik3_generation_tokens", "Generated tokens.", registry=r)
        self.ttft = Histogram("kimik3_time_to_first_token_seconds", "Request received to first token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("kimik3_inter_token_latency_seconds", "Time between successive token deliveries "
                             "of one sequence.", buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("kimik3_e2e_request_latency_seconds", "Request received to last token.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        r.register(_EngineCollector(loop, model_name))

    def render(self) -> bytes:
        return generate_latest(self.registry)
