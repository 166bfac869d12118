"""Prometheus metrics of one server: requests by endpoint and status, prompt and generated tokens, time to
first token and inter-token latency, failed steps, running and waiting sequences, prefix-cache counters."""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from k3run.engine.async_engine import AsyncEngine


class Metrics:
    """Prometheus metrics of one server (its own registry, so several servers in one process stay apart)."""

    def __init__(self, async_engine: "AsyncEngine") -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "k3run_requests", "HTTP requests answered, by endpoint and status", ["endpoint", "status"],
            registry=r,
        )  # fmt: skip
        self.prompt_tokens = Counter("k3run_prompt_tokens", "prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("k3run_generation_tokens", "tokens generated", registry=r)
        self.step_failures = Counter("k3run_engine_step_failures", "engine steps that raised", registry=r)
        latency = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
        self.ttft = Histogram(
            "k3run_time_to_first_token_seconds", "from admission to the first token", buckets=latency,
            registry=r,
        )  # fmt: skip
        self.itl = Histogram(
            "k3run_inter_token_latency_seconds", "between a request's successive outputs", buckets=latency,
            registry=r,
        )  # fmt: skip
        running = Gauge("k3run_requests_running", "sequences in the running batch", registry=r)
        waiting = Gauge("k3run_requests_waiting", "sequences queued for admission", registry=r)
        running.set_function(lambda: async_engine.counts()[0])
        waiting.set_function(lambda: async_engine.counts()[1])
        pc = getattr(getattr(async_engine, "engine", None), "prefix_cache", None)
        if pc is not None:  # read at scrape time from the engine thread's counters
            for name, doc, read in (
                ("k3run_prefix_cache_lookups", "admitted prompts long enough to look up", lambda: pc.lookups),
                ("k3run_prefix_cache_hits", "lookups that found a stored prefix", lambda: pc.hits),
                (
                    "k3run_prefix_cache_hit_tokens",
                    "prompt tokens restored instead of computed",
                    lambda: pc.hit_tokens,
                ),
                ("k3run_prefix_cache_bytes", "bytes of stored snapshots", lambda: pc.used_bytes),
            ):
                Gauge(name, doc, registry=r).set_function(read)

    def exposition(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)
