"""Prometheus metrics of the daemon: one collector that renders the owners' stats records at scrape time.

Nothing is counted here and no family is written out here: a scrape takes
one ``NodeStats`` snapshot (``tiermemd.stats``: the pool's, ledger's,
scheduler's, server's and every rank's typed record, plus the counters of
ranks that ended) and walks the figures declared on those records' fields
(``tiermem.core.figures``: name, type, help, label): node-scope records as
they are, rank figures rolled up over the node's ranks and, with
``metrics.job_labels``, over each job's.  Only what no owner's field carries
is declared below: the build, fragmentation, budgets per resource, counts of
jobs and ranks, and the Adam kernels' build states (``tiermem_kernel_state``:
one series per kernel and state, 1 for the state it is in, so an alert on
``state="failed"`` sees a fallback to the slower path).

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
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, InfoMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector

from tiermem import __version__
from tiermem.core.figures import Family, Kind, declared, rollup, value_at, zero
from tiermem.core.modes import STATE_DTYPES
from tiermem.core.protocol import KERNEL_PATHS, PROTOCOL_VERSION
from tiermem.engine.pool import PoolStats
from tiermemd.kernel import BuildState, KernelStatus
from tiermemd.ledger import Resource
from tiermemd.rank import RankStats
from tiermemd.scheduler import SchedulerStats
from tiermemd.scrape import ScrapeServer
from tiermemd.serverstats import ServerStats
from tiermemd.stats import NodeStats, node_stats

if TYPE_CHECKING:
    from tiermemd.service import Service

__all__ = ["ServiceCollector", "families", "render", "serve_metrics"]

log = logging.getLogger(__name__)

JOB_LABELS = ["tiermem_job", "uid"]
_FAMILY = {Kind.COUNTER: CounterMetricFamily, Kind.GAUGE: GaugeMetricFamily, Kind.HISTOGRAM: HistogramMetricFamily}

# What no owner's field carries: derived from one, or a count of records.
FRAGMENTATION = Family(
    "tiermem_pool_fragmentation_ratio", "1 - largest free block / free bytes (0: all free space in one piece)."
)
BUDGET_CAPACITY = Family("tiermem_budget_capacity_bytes", "Node budget per resource.", label="resource")
BUDGET_HELD = Family("tiermem_budget_held_bytes", "Bytes of each budget jobs hold.", label="resource")
SWAP_CAPACITY = Family("tiermem_swap_capacity_bytes", "Swap budget: free space of the swap directories at start.")
JOBS = Family("tiermem_jobs", "Jobs the daemon holds.")
RANKS = Family("tiermem_ranks", "Ranks holding state in the daemon.")
JOB_RANKS = Family("tiermem_job_ranks", "Ranks of a job holding state.", per_job=True)
KERNEL_STATE = Family(
    "tiermem_kernel_state",
    "Adam kernels by build state (building, built, failed: the slower fallback runs, off: turned off by "
    "adam.compile): 1 for the state each kernel is in.",
)
KERNEL_PATH_RANKS = Family(
    "tiermem_kernel_path_ranks",
    "Ranks by the code their last Adam update ran (native, compiled, fallback: the slower eager update or "
    "plain-torch reference).",
    label="path",
)
JOB_KERNEL_PATH_RANKS = Family(
    "tiermem_job_kernel_path_ranks",
    "A job's ranks by the code their last Adam update ran (native, compiled, fallback).",
    label="path",
    per_job=True,
)
DEFERRED_COMMIT_RANKS = Family(
    "tiermem_deferred_commit_ranks",
    "NVMe ranks whose last periodic commit was deferred (its manifest or job file could not be written, a full "
    "disk most often): a restart now comes back at their last commit that landed.",
)
STATE_DTYPE_RANKS = Family(
    "tiermem_state_dtype_ranks",
    "Ranks holding state, by how they store the Adam moments (fp32, bf16, int8).",
    label="state_dtype",
)


class ServiceCollector(Collector):
    """Renders one ``NodeStats`` snapshot per scrape (see the module docstring)."""

    def __init__(self, service: Service) -> None:
        self.service = service

    def collect(self) -> Iterator[Any]:
        yield build_info()
        yield from families(node_stats(self.service), per_job=self.service.config.metrics.job_labels)


def build_info() -> InfoMetricFamily:
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
    return info


class _Families:
    """The families of one scrape, each made at its first sample."""

    def __init__(self) -> None:
        self.made: dict[str, Any] = {}

    def add(self, family: Family, kind: Kind, value: Any, labels: Sequence[str] = (), series: str = "") -> None:
        out = self.made.get(family.name)
        if out is None:
            names = [*(JOB_LABELS if family.per_job else ()), *((family.label,) if family.label else ())]
            out = self.made[family.name] = _FAMILY[kind](family.name, family.help, labels=names)
        pairs = value if isinstance(value, tuple) else ((series, value),)  # (key, count) pairs: a series per key
        for key, v in pairs:
            at = [*labels, getattr(key, "value", key)] if family.label else list(labels)
            if kind is Kind.HISTOGRAM:
                out.add_metric(at, buckets=v.cumulative(), sum_value=v.sum)
            else:
                out.add_metric(at, v)

    def figures(self, cls: type, records: Sequence[Any], labels: Sequence[str] = (), *, per_job: bool) -> None:
        """Every family declared on ``cls``'s fields, its figure rolled up over ``records``."""
        for path, fig in declared(cls):
            values = [v for r in records if (v := value_at(r, path)) is not None]
            for s in fig.series:
                if s.family.per_job == per_job:
                    kind = fig.type_in(s.family)
                    self.add(s.family, kind, rollup(s.family, kind, values), labels, s.value)


def families(node: NodeStats, *, per_job: bool) -> Iterator[Any]:
    """The snapshot's families: the owners' declared figures, node totals over ranks, and per job if asked."""
    out = _Families()
    out.figures(PoolStats, [node.pool], per_job=False)
    out.add(FRAGMENTATION, Kind.GAUGE, node.pool.fragmentation)
    for b in node.ledger.budgets:
        out.add(BUDGET_CAPACITY, Kind.GAUGE, b.capacity, series=b.resource.value)
        out.add(BUDGET_HELD, Kind.GAUGE, b.held, series=b.resource.value)
    out.add(SWAP_CAPACITY, Kind.GAUGE, node.ledger.budget(Resource.SWAP).capacity)
    out.figures(SchedulerStats, [node.scheduler], per_job=False)
    out.figures(ServerStats, [node.server or zero(ServerStats)], per_job=False)
    out.add(JOBS, Kind.GAUGE, len(node.jobs))
    out.add(RANKS, Kind.GAUGE, sum(len(job.ranks) for job in node.jobs))
    out.add(DEFERRED_COMMIT_RANKS, Kind.GAUGE, node.deferred_commits)
    registered = [r.state_dtype for job in node.jobs for r in job.ranks]
    for state_dtype in STATE_DTYPES:  # every format, zeros too: a dashboard's series exist before the first job
        out.add(STATE_DTYPE_RANKS, Kind.GAUGE, registered.count(state_dtype), series=state_dtype)
    paths = [r.kernel_path for job in node.jobs for r in job.ranks]
    for path in KERNEL_PATHS:  # every path, zeros too: a fallback shows as a series leaving zero
        out.add(KERNEL_PATH_RANKS, Kind.GAUGE, paths.count(path), series=path)
    out.figures(RankStats, node.ranks, per_job=False)
    for job in node.jobs if per_job else ():
        labels = [job.job_id, str(job.owner_uid)]
        out.add(JOB_RANKS, Kind.GAUGE, len(job.ranks), labels)
        job_paths = [r.kernel_path for r in job.ranks]
        for path in KERNEL_PATHS:
            out.add(JOB_KERNEL_PATH_RANKS, Kind.GAUGE, job_paths.count(path), labels, path)
        out.figures(RankStats, job.ranks, labels, per_job=True)
    out.made[KERNEL_STATE.name] = kernel_states(node.kernels)
    return iter(out.made.values())


def kernel_states(kernels: Sequence[KernelStatus]) -> GaugeMetricFamily:
    """``tiermem_kernel_state{kernel, state}``: every state of every kernel, 1 where it is."""
    family = GaugeMetricFamily(KERNEL_STATE.name, KERNEL_STATE.help, labels=["kernel", "state"])
    for kernel in kernels:
        for state in BuildState:
            family.add_metric([kernel.name, state.value], 1.0 if kernel.state is state else 0.0)
    return family


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
