"""Prometheus metrics of one node at ``GET /metrics`` (text exposition format, through
``prometheus_client``).

Counted where this node took the request: requests by API and finish reason, prompt and
generated tokens, time to first token and request duration; requests whose instance
failed after they gave tokens, continued or not (``shardline_continuations_total``, by
the router of the node that streamed them). Read at scrape time: the
cluster's live nodes and instances by status as this node sees them, this node's
available memory, and the running and waiting sequences of this node's ranks.
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from shardline.node.node import Node
from shardline.node.status import InstanceStatus

# Seconds: TTFT from a few ms (a short prompt on a GPU) to minutes (a long CPU prefill).
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class RequestMetrics:
    """The request counters and histograms of one node, in their own registry."""

    def __init__(self, node: Node) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "shardline_requests",
            "Requests this node took, by API and finish reason",
            ["api", "finish_reason"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "shardline_prompt_tokens", "Prompt tokens of finished requests", registry=self.registry
        )
        self.cached_prompt_tokens = Counter(
            "shardline_cached_prompt_tokens",
            "Prompt tokens of finished requests that a prefix cache held (not computed)",
            registry=self.registry,
        )
        self.generation_tokens = Counter("shardline_generation_tokens", "Tokens generated", registry=self.registry)
        self.ttft = Histogram(
            "shardline_time_to_first_token_seconds",
            "Time to the first token",
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        )
        self.duration = Histogram(
            "shardline_request_duration_seconds",
            "Time from taking a request to its end",
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_ClusterCollector(node))

    def record(
        self,
        api: str,
        finish_reason: str,
        prompt_tokens: int,
        generated: int,
        ttft_s: float | None,
        duration_s: float,
        cached_tokens: int = 0,
    ) -> None:
        """One request ended (``finish_reason``: stop, length, error or cancelled);
        ``cached_tokens``: of its prompt, those its instance's prefix cache held."""
        self.requests.labels(api, finish_reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.cached_prompt_tokens.inc(cached_tokens)
        self.generation_tokens.inc(generated)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        self.duration.observe(duration_s)


class _ClusterCollector:
    """Gauges read from the node when scraped."""

    def __init__(self, node: Node) -> None:
        self.node = node

    def collect(self):
        node = self.node
        live = GaugeMetricFamily("shardline_nodes_live", "Live nodes this node sees, itself included")
        live.add_metric([], len(node.live_node_ids()))
        instances = GaugeMetricFamily("shardline_instances", "Instances by status", labels=["status"])
        for status in InstanceStatus:
            instances.add_metric([status.value], sum(1 for i in node.instances.values() if i.status == status))
        memory = GaugeMetricFamily("shardline_available_memory_bytes", "Memory this node offers to models")
        memory.add_metric([], node.info().available_bytes)
        running = GaugeMetricFamily(
            "shardline_running_sequences", "Sequences in this node's rank's batch", labels=["instance"]
        )
        waiting = GaugeMetricFamily("shardline_waiting_sequences", "Requests waiting for a slot", labels=["instance"])
        cached = GaugeMetricFamily(
            "shardline_prefix_cache_tokens",
            "Prompt tokens this node's rank holds in its prefix cache",
            labels=["instance"],
        )
        cached_bytes = GaugeMetricFamily(
            "shardline_prefix_cache_bytes",
            "Bytes of keys and values of this node's rank's prefix cache (in its KV pool)",
            labels=["instance"],
        )
        admitted = CounterMetricFamily(
            "shardline_rank_prompt_tokens",
            "Prompt tokens of the requests this node's rank started",
            labels=["instance"],
        )
        reused = CounterMetricFamily(
            "shardline_rank_reused_prompt_tokens",
            "Of those, the tokens its prefix cache held (the hit rate: this / shardline_rank_prompt_tokens)",
            labels=["instance"],
        )
        drafted = CounterMetricFamily(
            "shardline_rank_drafted_tokens",
            "Tokens this node's rank's speculative decoding drafted and checked",
            labels=["instance"],
        )
        accepted = CounterMetricFamily(
            "shardline_rank_accepted_draft_tokens",
            "Of those, the tokens taken (the acceptance rate: this / shardline_rank_drafted_tokens)",
            labels=["instance"],
        )
        for instance_id, stats in node.engine_stats.items():
            running.add_metric([instance_id], len(stats.get("running", ())))
            waiting.add_metric([instance_id], len(stats.get("waiting", ())))
            cached.add_metric([instance_id], stats.get("cached_tokens", 0))
            cached_bytes.add_metric([instance_id], stats.get("cached_bytes", 0))
            admitted.add_metric([instance_id], stats.get("prompt_tokens", 0))
            reused.add_metric([instance_id], stats.get("reused_tokens", 0))
            drafted.add_metric([instance_id], stats.get("drafted_tokens", 0))
            accepted.add_metric([instance_id], stats.get("accepted_tokens", 0))
        continuations = CounterMetricFamily(
            "shardline_continuations",
            "Requests whose instance failed after they gave tokens, streamed by "
            "this node: continued on another instance (each time), or failed (ended with the error)",
            labels=["outcome"],
        )
        for outcome, count in node.router.continuations.items():
            continuations.add_metric([outcome], count)
        yield from (live, instances, memory, running, waiting, cached, cached_bytes, admitted, reused)
        yield from (drafted, accepted, continuations)


def router(metrics: RequestMetrics) -> APIRouter:
    api = APIRouter()

    @api.get("/metrics", include_in_schema=False)
    async def scrape() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return api
