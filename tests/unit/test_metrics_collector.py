"""The collector's families from a node snapshot built of real stats records: job ids only when asked."""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

from tiermem.core.figures import ended, zero
from tiermem.core.histogram import UPDATE_SECONDS, Histogram
from tiermem.core.modes import Placement
from tiermem.engine.pool import PoolStats
from tiermemd.kernel import BuildState, KernelStatus
from tiermemd.ledger import Ledger, Resource
from tiermemd.metrics import build_info, families
from tiermemd.rank import RankStats
from tiermemd.scheduler import SchedulerStats
from tiermemd.serverstats import DisconnectReason, ServerCounters
from tiermemd.state import StateStats
from tiermemd.stats import JobStats, NodeStats, stats_reply


def _rank(
    job_id: str, *, updates: int, elements: int, cpu_nbytes: int, state_dtype: str = "fp32", kernel_path: str = "native"
) -> RankStats:
    h = Histogram(UPDATE_SECONDS)
    for _ in range(updates):
        h.observe(0.02)
    return RankStats(
        job_id=job_id, rank=0, placement=Placement.CPU, last_step=updates, skipped_steps=0, failed=False,
        overlapped_tensors=0, tensors=2, numel=elements, window_nbytes=1 << 21, storage_nbytes=8192,
        state_keys=2, adopted_elements=0, updates=updates, updated_elements=updates * elements,
        update_s=0.02 * updates, update_seconds=h.snapshot(), grad_stats_s=0.0, wait_s=0.0, staleness_steps=0,
        state=StateStats(cpu_nbytes=cpu_nbytes), state_dtype=state_dtype, kernel_path=kernel_path,
    )  # fmt: skip


def _node(retired: RankStats | None = None) -> NodeStats:
    ledger = Ledger({Resource.POOL: 1 << 30, Resource.WINDOW: 1 << 30, Resource.SWAP: 0, Resource.STORAGE: 1 << 30})
    ledger.reserve("secret-job-a", Resource.POOL, 4096)
    counters = ServerCounters()
    counters.accepted()
    counters.disconnected(DisconnectReason.CLIENT_EXITED)
    int8_rank = _rank("secret-job-b", updates=2, elements=5, cpu_nbytes=40, state_dtype="int8", kernel_path="fallback")
    jobs = (
        JobStats("secret-job-a", 1000, "active", 1, (_rank("secret-job-a", updates=3, elements=10, cpu_nbytes=80),), 0),
        JobStats("secret-job-b", 1001, "active", 1, (int8_rank,), 0),
    )
    return NodeStats(
        pool=PoolStats(capacity=1 << 30, used=4096, free=(1 << 30) - 4096, largest_free=1 << 29, blocks=1,
                       compactions=0, bytes_moved=0, locked=1 << 30),
        ledger=ledger.stats(),
        scheduler=SchedulerStats(queued=0, tasks=5, busy_s=0.1, tenants=2, busy_periods=2, busy_period_s=0.12),
        server=counters.stats(sessions=2),
        jobs=jobs,
        retired=retired or zero(RankStats),
        kernels=(
            KernelStatus("lowbit", BuildState.FAILED, "FileNotFoundError: no C compiler 'cc' on PATH"),
            KernelStatus("adam grad=float16 out=float16", BuildState.BUILT),
        ),
    )  # fmt: skip


class _Fixed(Collector):
    def __init__(self, node: NodeStats, per_job: bool) -> None:
        self.node, self.per_job = node, per_job

    def collect(self):  # type: ignore[no-untyped-def]
        yield from families(self.node, per_job=self.per_job)


def _exposition(node: NodeStats, per_job: bool) -> str:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed(node, per_job))
    return generate_latest(registry).decode()


def test_without_job_labels_no_job_id_leaves_the_daemon() -> None:
    text = _exposition(_node(), per_job=False)
    assert "secret-job" not in text and "tiermem_job=" not in text and "tiermem_job_" not in text
    assert "tiermem_jobs 2.0" in text
    assert 'tiermem_state_bytes{tier="cpu"} 120.0' in text  # summed over the jobs
    assert "tiermem_adam_updated_params_total 40.0" in text  # 3 x 10 + 2 x 5


def test_with_job_labels_each_job_has_its_series_under_tiermem_job() -> None:
    text = _exposition(_node(), per_job=True)
    assert 'tiermem_job_state_bytes{tier="cpu",tiermem_job="secret-job-a",uid="1000"} 80.0' in text
    assert 'tiermem_job_updated_params_total{tiermem_job="secret-job-b",uid="1001"} 10.0' in text
    assert 'job="' not in text.replace('tiermem_job="', "")  # never Prometheus' own job label


def test_ranks_are_counted_by_how_they_store_the_moments() -> None:
    text = _exposition(_node(), per_job=False)
    assert 'tiermem_state_dtype_ranks{state_dtype="fp32"} 1.0' in text
    assert 'tiermem_state_dtype_ranks{state_dtype="int8"} 1.0' in text
    assert 'tiermem_state_dtype_ranks{state_dtype="bf16"} 0.0' in text  # the series exists before its first rank


def test_ranks_are_counted_by_the_kernel_path_their_updates_ran() -> None:
    text = _exposition(_node(), per_job=False)
    assert 'tiermem_kernel_path_ranks{path="native"} 1.0' in text
    assert 'tiermem_kernel_path_ranks{path="fallback"} 1.0' in text
    assert 'tiermem_kernel_path_ranks{path="compiled"} 0.0' in text  # the series exists before its first rank


def test_with_job_labels_each_job_counts_its_ranks_by_kernel_path() -> None:
    text = _exposition(_node(), per_job=True)
    assert 'tiermem_job_kernel_path_ranks{path="fallback",tiermem_job="secret-job-b",uid="1001"} 1.0' in text
    assert 'tiermem_job_kernel_path_ranks{path="native",tiermem_job="secret-job-b",uid="1001"} 0.0' in text


def test_the_stats_reply_names_each_jobs_kernel_paths() -> None:
    reply = stats_reply(_node(), uid=None, rank=_node().jobs[1].ranks[0])
    assert [job.kernel_paths for job in reply.jobs] == [("native",), ("fallback",)]
    assert reply.rank is not None and reply.rank.kernel_path == "fallback"


def test_each_kernel_shows_the_state_it_is_in_and_a_fallback_is_failed() -> None:
    text = _exposition(_node(), per_job=False)
    assert 'tiermem_kernel_state{kernel="lowbit",state="failed"} 1.0' in text
    assert 'tiermem_kernel_state{kernel="lowbit",state="built"} 0.0' in text
    assert 'tiermem_kernel_state{kernel="adam grad=float16 out=float16",state="built"} 1.0' in text
    assert text.count("tiermem_kernel_state{") == 2 * len(BuildState)


def test_node_counters_include_ranks_that_ended() -> None:
    gone = _rank("ended", updates=4, elements=100, cpu_nbytes=0)
    text = _exposition(_node(retired=ended(gone)), per_job=False)
    assert "tiermem_adam_updates_total 9.0" in text  # 3 + 2 live, 4 retired
    assert "tiermem_adam_update_seconds_count 9.0" in text
    assert 'tiermem_disconnects_total{reason="client_exited"} 1.0' in text
    assert 'tiermem_disconnects_total{reason="protocol_error"} 0.0' in text


def test_the_operating_guide_lists_every_family_as_declared() -> None:
    text = (Path(__file__).resolve().parents[2] / "docs" / "operating.md").read_text()
    documented = {}
    for row in re.findall(r"^\| `(tiermem_\w+)`[^|]* \| (\w+) \| ([^|]*) \| (.*) \|$", text, re.M):
        name, kind, labels, meaning = row
        documented[re.sub(r"_(total|bucket|info)$", "", name)] = (kind, sorted(re.findall(r"`(\w+)`", labels)), meaning)
    exposed = {}
    for family in [build_info(), *families(_node(), per_job=True)]:
        labels = sorted({k for s in family.samples for k in s.labels if k != "le"})
        exposed[family.name] = (family.type, labels, family.documentation)
    assert documented == exposed
