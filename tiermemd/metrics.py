"""Prometheus metrics of the daemon: one collector that renders the owners' stats records at scrape time.

Nothing is counted here and nothing on the hot path knows a metric name: a
scrape takes one ``NodeStats`` snapshot (``tiermemd.stats``: the pool's,
ledger's, scheduler's, server's and every rank's typed record, plus the
figures of ranks that ended) and turns it into metric families.

Names follow Prometheus conventions: base units (``_bytes``, ``_seconds``),
``_total`` counters, ``_ratio`` fractions, histograms for latencies
(``tiermem_swap_io_seconds``, ``tiermem_adam_update_seconds``) and
``tiermem_build_info``.  Labels are bounded: ``state``, ``resource``,
``direction``, ``op``, ``tier``, ``reason``, and, only with
``metrics.job_labels``, ``tiermem_job`` (the job id; Prometheus' own ``job``
label names the scrape target) with the owner's ``uid``, since job ids are
scoped per uid.  Never a pid, a tensor name or a rank.  Node counters include
the jobs that ended, so they never go down while the daemon runs.

``serve_metrics`` serves ``/metrics`` (prometheus_client's exposition of a
registry of our own) through ``tiermemd.scrape``'s bounded server on
``metrics.address``:``metrics.port``.
"""

from __future__ import annotations

import logging
import platform
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, InfoMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector

from tiermem import __version__
from tiermem.core.histogram import HistogramSnapshot
from tiermem.core.protocol import PROTOCOL_VERSION
from tiermemd.ledger import Resource
from tiermemd.scrape import ScrapeServer
from tiermemd.stats import NodeStats, node_stats

if TYPE_CHECKING:
    from tiermemd.service import Service

__all__ = ["ServiceCollector", "render", "serve_metrics"]

log = logging.getLogger(__name__)

JOB_LABELS = ["tiermem_job", "uid"]


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _labelled(family: Any, label: str, values: dict[str, float]) -> Any:
    for key, value in values.items():
        family.add_metric([key], value)
    return family


def _histogram(family: HistogramMetricFamily, labels: list[str], h: HistogramSnapshot) -> HistogramMetricFamily:
    family.add_metric(labels, buckets=h.cumulative(), sum_value=h.sum)
    return family


class ServiceCollector(Collector):
    """Renders one ``NodeStats`` snapshot per scrape (see the module docstring)."""

    def __init__(self, service: Service) -> None:
        self.service = service

    def collect(self) -> Iterator[Any]:
        node = node_stats(self.service)
        yield from build_info()
        yield from pool_families(node)
        yield from swap_families(node)
        yield from adam_families(node)
        yield from server_families(node)
        yield from job_families(node, per_job=self.service.config.metrics.job_labels)


def build_info() -> Iterator[Any]:
    info = InfoMetricFamily("tiermem_build", "tiermem's version and what it runs on.")
    info.add_metric(
        [],
        {
            "version": __version__,
            "protocol_version": str(PROTOCOL_VERSION),
            "python_version": platform.python_version(),
            "torch_version": torch.__version__,
        },
    )
    yield info


def pool_families(node: NodeStats) -> Iterator[Any]:
    pool = node.pool
    yield _gauge("tiermem_pool_capacity_bytes", "Bytes of the daemon's host-memory pool.", pool.capacity)
    yield _labelled(
        GaugeMetricFamily("tiermem_pool_bytes", "Pool bytes in live blocks (used) and not (free).", labels=["state"]),
        "state",
        {"used": pool.used, "free": pool.free},
    )
    yield _gauge("tiermem_pool_locked_bytes", "Pool bytes locked in RAM (mlock).", pool.locked)
    yield _gauge("tiermem_pool_largest_free_block_bytes", "The largest free extent of the pool.", pool.largest_free)
    yield _gauge(
        "tiermem_pool_fragmentation_ratio", "1 - largest free block / free bytes (0: all free space in one piece).",
        pool.fragmentation,
    )  # fmt: skip
    yield _gauge("tiermem_pool_blocks", "Live blocks in the pool.", pool.blocks)
    yield _counter("tiermem_pool_compactions", "Compactions of the pool.", pool.compactions)
    yield _counter("tiermem_pool_compaction_moved_bytes", "Bytes moved by compactions.", pool.bytes_moved)
    capacity = GaugeMetricFamily("tiermem_budget_capacity_bytes", "Node budget per resource.", labels=["resource"])
    held = GaugeMetricFamily("tiermem_budget_held_bytes", "Bytes of each budget jobs hold.", labels=["resource"])
    for b in node.ledger.budgets:
        capacity.add_metric([b.resource.value], b.capacity)
        held.add_metric([b.resource.value], b.held)
    yield capacity
    yield held


def swap_families(node: NodeStats) -> Iterator[Any]:
    t = node.totals
    yield _gauge(
        "tiermem_swap_capacity_bytes", "Swap budget: free space of the swap directories at start.",
        node.ledger.budget(Resource.SWAP).capacity,
    )  # fmt: skip
    yield _gauge(
        "tiermem_swap_reserved_bytes", "Bytes preallocated in the jobs' swap files.", node.swap_reserved_nbytes
    )
    yield _gauge("tiermem_swap_used_bytes", "Swap bytes holding optimizer state.", node.swap_used_nbytes)
    yield _labelled(
        CounterMetricFamily("tiermem_swap_bytes", "Bytes read from and written to swap.", labels=["direction"]),
        "direction",
        {"read": t.swap_read_nbytes, "write": t.swap_written_nbytes},
    )
    io = HistogramMetricFamily(
        "tiermem_swap_io_seconds", "Time from submitting a swap read or write to its (verified) completion.",
        labels=["op"],
    )  # fmt: skip
    _histogram(io, ["read"], t.swap_read_seconds)
    yield _histogram(io, ["write"], t.swap_write_seconds)
    yield _labelled(
        CounterMetricFamily(
            "tiermem_swap_io_errors",
            "Swap reads and writes that failed with an I/O error (checksum failures are counted apart).",
            labels=["op"],
        ),
        "op",
        {"read": t.swap_read_errors, "write": t.swap_write_errors},
    )
    yield _counter(
        "tiermem_swap_checksum_failures", "Swap reads whose checksum did not verify.", t.swap_checksum_failures
    )
    yield _counter(
        "tiermem_prefetch_acquires",
        "State chunks acquired from the NVMe tier (by updates, grad statistics and state or param transfers).",
        t.prefetch_acquires,
    )
    yield _counter("tiermem_prefetch_hits", "Chunk acquires that found the chunk resident.", t.prefetch_hits)
    yield _counter(
        "tiermem_prefetch_stall_seconds", "Time chunk acquires waited for page-ins the prefetch did not hide.",
        t.prefetch_stall_s,
    )  # fmt: skip
    yield _labelled(
        CounterMetricFamily("tiermem_tier_pages", "Chunks paged between pool and swap.", labels=["direction"]),
        "direction",
        {"in": t.page_ins, "out": t.page_outs},
    )


def adam_families(node: NodeStats) -> Iterator[Any]:
    t = node.totals
    yield _counter("tiermem_adam_updates", "CPU Adam updates that completed (a step or a bucket).", t.updates)
    yield _counter(
        "tiermem_adam_updated_params", "Parameter elements stepped by the CPU Adam updates.", t.updated_elements
    )
    yield _histogram(
        HistogramMetricFamily("tiermem_adam_update_seconds", "Duration of one rank's Adam update."),
        [],
        t.update_seconds,
    )
    yield _counter(
        "tiermem_adam_grad_stats_seconds", "Time spent on gradient norms and overflow checks.", t.grad_stats_s
    )
    yield _counter(
        "tiermem_steps",
        "Steps applied: each rank's last applied step, summed over ranks (skips are not steps).",
        t.steps,
    )
    yield _counter(
        "tiermem_skipped_steps", "Steps skipped on an inf/nan grad under loss scaling (the GradScaler's verdict), "
        "summed over ranks.", t.skipped_steps,
    )  # fmt: skip
    ranks = [r for job in node.jobs for r in job.ranks]
    yield _gauge(
        "tiermem_dpu_staleness_steps", "Largest lag of the params behind the state over ranks (1: a delayed update "
        "is running).", max((r.staleness_steps for r in ranks), default=0),
    )  # fmt: skip
    sched = node.scheduler
    yield _gauge("tiermem_scheduler_queued_tasks", "CPU tasks waiting for the scheduler.", sched.queued)
    yield _counter("tiermem_scheduler_tasks", "CPU tasks the scheduler ran.", sched.tasks)
    yield _counter("tiermem_scheduler_busy_seconds", "Time the scheduler spent running tasks.", sched.busy_s)
    yield _counter(
        "tiermem_scheduler_busy_periods", "Busy periods of the scheduler (tasks back to back until none is queued).",
        sched.busy_periods,
    )  # fmt: skip
    yield _counter(
        "tiermem_scheduler_busy_period_seconds", "Total length of the busy periods: tasks and the gaps between them.",
        sched.busy_period_s,
    )  # fmt: skip


def server_families(node: NodeStats) -> Iterator[Any]:
    s = node.server
    yield _gauge("tiermem_clients", "Client connections being served.", s.sessions if s else 0)
    yield _counter("tiermem_attaches", "Successful ATTACH requests (new jobs and reattaches).", s.attaches if s else 0)
    disconnects = CounterMetricFamily(
        "tiermem_disconnects", "Client sessions that ended, by reason.", labels=["reason"]
    )
    for reason, count in s.disconnects if s else ():
        disconnects.add_metric([reason.value], count)
    yield disconnects
    yield _counter("tiermem_connections_refused", "Connections refused at accept.", s.refused if s else 0)
    yield _counter(
        "tiermem_protocol_errors", "Frames refused with a protocol error (malformed, oversized, or not a request "
        "the session may send), each answered with an error.",
        s.protocol_errors if s else 0,
    )  # fmt: skip
    yield _counter(
        "tiermem_auth_errors", "Authentication failures: uids not allowed, wrong job tokens.",
        s.auth_errors if s else 0,
    )  # fmt: skip


def job_families(node: NodeStats, *, per_job: bool) -> Iterator[Any]:
    jobs = node.jobs
    yield _gauge("tiermem_jobs", "Jobs the daemon holds.", len(jobs))
    ranks = [r for job in jobs for r in job.ranks]
    yield _gauge("tiermem_ranks", "Ranks holding state in the daemon.", len(ranks))
    yield _gauge(
        "tiermem_failed_ranks", "Ranks whose last update failed (FAILED until reloaded).", sum(r.failed for r in ranks)
    )
    yield _labelled(
        GaugeMetricFamily(
            "tiermem_state_bytes",
            "Optimizer state of all jobs, per tier (cpu: pool bytes, NVMe chunk caches included; nvme: swap bytes).",
            labels=["tier"],
        ),
        "tier",
        {"cpu": sum(j.cpu_state_nbytes for j in jobs), "nvme": sum(j.nvme_state_nbytes for j in jobs)},
    )
    yield _gauge("tiermem_window_bytes", "Staging windows of all jobs.", sum(j.window_nbytes for j in jobs))
    yield _gauge(
        "tiermem_storage_bytes", "Shared param and grad storage of all jobs.", sum(j.storage_nbytes for j in jobs)
    )
    if not per_job:
        return
    state = GaugeMetricFamily(
        "tiermem_job_state_bytes",
        "A job's optimizer state, per tier (cpu: pool bytes, NVMe chunk caches included; nvme: swap bytes).",
        labels=[*JOB_LABELS, "tier"],
    )
    window = GaugeMetricFamily("tiermem_job_window_bytes", "A job's staging windows.", labels=JOB_LABELS)
    storage = GaugeMetricFamily(
        "tiermem_job_storage_bytes", "A job's shared param and grad storage.", labels=JOB_LABELS
    )
    step = GaugeMetricFamily("tiermem_job_last_step", "The highest step a job's ranks applied.", labels=JOB_LABELS)
    job_ranks = GaugeMetricFamily("tiermem_job_ranks", "Ranks of a job holding state.", labels=JOB_LABELS)
    failed = GaugeMetricFamily("tiermem_job_failed_ranks", "Ranks of a job that are FAILED.", labels=JOB_LABELS)
    stale = GaugeMetricFamily(
        "tiermem_job_dpu_staleness_steps", "Lag of a job's params behind its state (1: delayed update running).",
        labels=JOB_LABELS,
    )  # fmt: skip
    updated = CounterMetricFamily(
        "tiermem_job_updated_params", "Parameter elements a job's Adam updates stepped.", labels=JOB_LABELS
    )
    for job in jobs:
        labels = [job.job_id, str(job.owner_uid)]
        state.add_metric([*labels, "cpu"], job.cpu_state_nbytes)
        state.add_metric([*labels, "nvme"], job.nvme_state_nbytes)
        window.add_metric(labels, job.window_nbytes)
        storage.add_metric(labels, job.storage_nbytes)
        step.add_metric(labels, job.last_step)
        job_ranks.add_metric(labels, len(job.ranks))
        failed.add_metric(labels, job.failed_ranks)
        stale.add_metric(labels, job.staleness_steps)
        updated.add_metric(labels, sum(r.updated_elements for r in job.ranks))
    yield from (state, window, storage, step, job_ranks, failed, stale, updated)


def render(registry: CollectorRegistry) -> bytes:
    """The text exposition of ``registry`` (prometheus_client's)."""
    return generate_latest(registry)


def serve_metrics(service: Service) -> ScrapeServer | None:
    """Serve ``/metrics`` when ``metrics.port`` is set (None when disabled); ``OSError`` when it cannot bind."""
    config = service.config.metrics
    if not config.port:
        return None
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ServiceCollector(service))
    server = ScrapeServer(
        config.address,
        config.port,
        lambda: render(registry),
        content_type=CONTENT_TYPE_LATEST,
        max_connections=config.max_connections,
        idle_timeout_s=config.idle_timeout_s,
    )
    server.start()
    log.info("serving Prometheus metrics on http://%s:%d/metrics", config.address, server.port)
    return server
