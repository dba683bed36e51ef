"""Prometheus metrics of one server under vLLM's names (``vllm:*``), each series labelled ``model_name``.

A registry per app, so several apps can live in one process. The HTTP side counts tokens, finish
reasons, time to first token and inter-token latency as responses stream; the engine loop reports each
finished engine request (queue, prefill, decode, inference and end-to-end time, prompt and generation
lengths, its n and max_tokens) through ``observe_finished``; engine gauges (running and waiting requests,
cache usage, prefix-cache and speculation counters) are read from the loop's last snapshot at scrape
time. ``vllm:gpu_cache_usage_perc`` repeats ``vllm:kv_cache_usage_perc`` under the older name vLLM's
example Grafana dashboard still queries. Series vLLM has no name for are ``kimik3:*``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TOKEN_BUCKETS = tuple(float(b * 10**e) for e in range(7) for b in (1, 2, 5))   # 1 .. 5M
_N_BUCKETS = (1, 2, 5, 10, 20)


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

        yield gauge("vllm:num_requests_running", "Sequences the engine is running.", s["running"])
        yield gauge("vllm:num_requests_waiting", "Sequences accepted but not yet running.", s["waiting"])
        yield gauge("vllm:kv_cache_usage_perc", "Fraction of cache blocks held by requests (0..1).",
                    s["cache_usage"])
        yield gauge("vllm:gpu_cache_usage_perc", "Same as vllm:kv_cache_usage_perc (vLLM's older name).",
                    s["cache_usage"])
        yield gauge("kimik3:kv_cache_free_blocks", "Cache blocks not held by any request.", s["free_blocks"])
        yield counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      s["prefix_queried_tokens"])
        yield counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", s["prefix_hit_tokens"])
        yield counter("vllm:num_preemptions", "Sequences preempted for lack of cache.", s["preemptions"])
        yield counter("vllm:spec_decode_num_draft_tokens", "Speculative draft tokens verified.", s["draft_tokens"])
        yield counter("vllm:spec_decode_num_accepted_tokens", "Speculative draft tokens accepted.",
                      s["accepted_tokens"])
        yield counter("vllm:spec_decode_num_drafts", "Speculative verify chunks (one per request and step with "
                      "drafts).", s.get("drafts", 0.0))
        per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Speculative draft tokens accepted at each draft position.",
                                      labels=labels + ["position"])
        for j, n in enumerate(s.get("accepted_per_position", ())):
            per_pos.add_metric([self.model_name, str(j)], n)
        yield per_pos
        yield counter("kimik3:engine_step_failures", "Engine steps that raised.", s["step_failures"])


class ServerMetrics:
    def __init__(self, loop, model_name: str):
        self.registry = r = CollectorRegistry()
        self.model_name = model_name
        m = ["model_name"]

        def hist(name: str, doc: str, buckets):
            return Histogram(name, doc, m, buckets=buckets, registry=r).labels(model_name)

        self.requests = Counter("kimik3:http_requests", "HTTP requests by route and status code.",
                                ["model_name", "route", "status"], registry=r)
        self._finished = Counter("vllm:request_success", "Finished sequences by finish reason.",
                                 ["model_name", "finished_reason"], registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of accepted requests.", m,
                                     registry=r).labels(model_name)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens.", m,
                                         registry=r).labels(model_name)
        self.ttft = hist("vllm:time_to_first_token_seconds", "Request received to first token.", _LATENCY_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds", "Time between successive token deliveries of one "
                        "sequence.", _LATENCY_BUCKETS)
        self.tpot = hist("vllm:time_per_output_token_seconds", "Per request: decode time / (output tokens - 1).",
                         _LATENCY_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Engine arrival to last token.", _LATENCY_BUCKETS)
        self.queue = hist("vllm:request_queue_time_seconds", "Arrival to first scheduled.", _LATENCY_BUCKETS)
        self.prefill = hist("vllm:request_prefill_time_seconds", "First scheduled to first token.", _LATENCY_BUCKETS)
        self.decode = hist("vllm:request_decode_time_seconds", "First token to last token.", _LATENCY_BUCKETS)
        self.inference = hist("vllm:request_inference_time_seconds", "First scheduled to last token.",
                              _LATENCY_BUCKETS)
        self.prompt_len = hist("vllm:request_prompt_tokens", "Prompt tokens per request.", _TOKEN_BUCKETS)
        self.generation_len = hist("vllm:request_generation_tokens", "Generated tokens per request (all n).",
                                   _TOKEN_BUCKETS)
        self.max_generation = hist("vllm:request_max_num_generation_tokens", "Most tokens one sample of the "
                                   "request generated.", _TOKEN_BUCKETS)
        self.params_n = hist("vllm:request_params_n", "The n of each request.", _N_BUCKETS)
        self.params_max_tokens = hist("vllm:request_params_max_tokens", "The max_tokens of each request.",
                                      _TOKEN_BUCKETS)
        r.register(_EngineCollector(loop, model_name))
        loop.on_finished = self.observe_finished

    def request(self, route: str, status: str) -> None:
        self.requests.labels(self.model_name, route, status).inc()

    def finished(self, reason: str) -> None:
        self._finished.labels(self.model_name, reason).inc()

    def observe_finished(self, metrics: dict, num_prompt_tokens: int, params) -> None:
        """One finished engine request (called on the engine thread; prometheus_client is thread-safe)."""
        for key, h in (("e2e_s", self.e2e), ("queue_s", self.queue), ("prefill_s", self.prefill),
                       ("decode_s", self.decode), ("inference_s", self.inference), ("tpot_s", self.tpot)):
            if key in metrics:
                h.observe(metrics[key])
        self.prompt_len.observe(num_prompt_tokens)
        self.generation_len.observe(metrics.get("num_output_tokens", 0.0))
        self.max_generation.observe(metrics.get("max_output_tokens", 0.0))
        self.params_n.observe(params.n)
        self.params_max_tokens.observe(params.max_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
