"""Prometheus metrics of the daemon, computed at scrape time from their owners.

Nothing is counted twice: a scrape asks the pool, the ledger, the job table and
each rank for their figures (``Service.node_stats`` and ``RankOptimizer.stats``)
and renders them; no metric is updated on the hot path.  Names follow
Prometheus conventions (base units, ``_total`` for counters, ``_ratio`` for
fractions); per-job series carry ``job`` and ``rank`` labels.

``serve_metrics`` starts prometheus_client's HTTP server on ``metrics.address``
and ``metrics.port`` with a registry of its own (never the global one).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from tiermemd.rank import RankOptimizer

if TYPE_CHECKING:
    from tiermemd.service import Service

__all__ = ["ServiceCollector", "serve_metrics"]

log = logging.getLogger(__name__)

_RANK_COUNTERS = {
    "last_step": ("tiermem_rank_steps_total", "Steps applied (or skipped on overflow) for the rank."),
    "skipped_steps": ("tiermem_rank_skipped_steps_total", "Steps skipped because a gradient was inf/nan."),
    "update_s": ("tiermem_rank_update_seconds_total", "Time spent in Adam updates (synchronous steps)."),
    "stats_s": ("tiermem_rank_grad_stats_seconds_total", "Time spent on gradient norms and overflow checks."),
    "wait_s": ("tiermem_rank_wait_seconds_total", "Time FETCH_PARAMS waited for a delayed update."),
    "nvme_wait_s": ("tiermem_rank_nvme_wait_seconds_total", "Time the update waited for state reads from NVMe."),
    "nvme_io_errors": ("tiermem_rank_nvme_io_errors_total", "Failed swap reads or writes of the rank's state."),
}


class ServiceCollector(Collector):
    def __init__(self, service: Service) -> None:
        self.service = service

    def collect(self) -> Iterator[Any]:
        node = self.service.node_stats()
        pool = GaugeMetricFamily("tiermem_pool_bytes", "Bytes of the daemon's host-memory pool.", labels=["state"])
        pool.add_metric(["capacity"], node["pool_capacity_bytes"])
        pool.add_metric(["used"], node["pool_used_bytes"])
        pool.add_metric(["free"], node["pool_free_bytes"])
        pool.add_metric(["largest_free_block"], node["pool_largest_free_bytes"])
        yield pool
        yield GaugeMetricFamily(
            "tiermem_pool_fragmentation_ratio",
            "1 - largest free block / free bytes.",
            value=node["pool_fragmentation"],
        )
        yield GaugeMetricFamily("tiermem_pool_blocks", "Live blocks in the pool.", value=node["pool_blocks"])
        yield GaugeMetricFamily(
            "tiermem_pool_locked", "1 when the pool is locked in RAM (mlock).", value=node["pool_locked"]
        )
        yield CounterMetricFamily(
            "tiermem_pool_compactions", "Compactions of the pool.", value=node["pool_compactions"]
        )
        yield CounterMetricFamily(
            "tiermem_pool_moved_bytes", "Bytes moved by compaction.", value=node["pool_bytes_moved"]
        )
        budget = GaugeMetricFamily(
            "tiermem_budget_bytes", "Node budgets and what jobs hold of them.", labels=["resource", "kind"]
        )
        for resource in ("pool", "window", "swap"):
            budget.add_metric([resource, "capacity"], node[f"budget_{resource}_capacity_bytes"])
            budget.add_metric([resource, "held"], node[f"budget_{resource}_held_bytes"])
        yield budget
        yield GaugeMetricFamily("tiermem_jobs", "Jobs known to the daemon.", value=node["jobs"])
        yield GaugeMetricFamily("tiermem_sessions", "Open client connections.", value=node["sessions"])
        yield GaugeMetricFamily(
            "tiermem_scheduler_queued_tasks", "CPU tasks waiting to run.", value=node["scheduler_queued"]
        )
        yield from self._ranks()

    def _ranks(self) -> Iterator[Any]:
        counters = {
            key: CounterMetricFamily(name[: -len("_total")], doc, labels=["job", "rank"])
            for key, (name, doc) in _RANK_COUNTERS.items()
        }
        swap = CounterMetricFamily(
            "tiermem_swap_bytes", "Optimizer state moved between pool and swap.", labels=["job", "rank", "direction"]
        )
        elements = GaugeMetricFamily(
            "tiermem_rank_state_elements", "Elements of fp32 state held.", labels=["job", "rank"]
        )
        for job in self.service.jobs.jobs():
            for rank in list(job.ranks.values()):
                if not isinstance(rank, RankOptimizer):
                    continue
                labels = [job.job_id, str(rank.rank)]
                stats = rank.stats()
                for key, family in counters.items():
                    if key in stats:
                        family.add_metric(labels, stats[key])
                if "nvme_bytes_in" in stats:
                    swap.add_metric([*labels, "in"], stats["nvme_bytes_in"])
                    swap.add_metric([*labels, "out"], stats["nvme_bytes_out"])
                elements.add_metric(labels, stats["numel"])
        yield from counters.values()
        yield swap
        yield elements


def serve_metrics(service: Service) -> CollectorRegistry | None:
    """Serve ``/metrics`` when ``metrics.port`` is set; returns the registry (None when disabled)."""
    config = service.config.metrics
    if not config.port:
        return None
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ServiceCollector(service))
    start_http_server(config.port, addr=config.address, registry=registry)
    log.info("serving Prometheus metrics on http://%s:%d/metrics", config.address, config.port)
    return registry
