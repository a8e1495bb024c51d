"""Sample STATS_REPLY records for tests that need a well-formed one (codec, transport, fuzzing)."""

from __future__ import annotations

from tiermem.core.protocol import (
    AdamReport,
    BudgetReport,
    JobReport,
    NodeReport,
    PoolReport,
    PrefetchReport,
    ServerReport,
    StatsReply,
    SwapReport,
)


def sample_node(*, jobs: int = 0, version: str = "0.1.0") -> NodeReport:
    return NodeReport(
        version=version,
        pool=PoolReport(
            capacity_nbytes=1 << 30,
            used_nbytes=1 << 20,
            free_nbytes=(1 << 30) - (1 << 20),
            largest_free_nbytes=1 << 29,
            locked_nbytes=1 << 30,
            blocks=3,
            compactions=1,
            moved_nbytes=4096,
        ),
        swap=SwapReport(
            capacity_nbytes=1 << 40,
            reserved_nbytes=1 << 21,
            used_nbytes=1 << 20,
            read_nbytes=8192,
            written_nbytes=12288,
            reads=2,
            writes=3,
            io_errors=0,
            checksum_failures=0,
        ),
        budgets=(BudgetReport("pool", 1 << 30, 1 << 20), BudgetReport("window", 1 << 30, 1 << 21)),
        adam=AdamReport(
            updates=5,
            updated_elements=5000,
            update_s=0.25,
            steps=5,
            skipped_steps=1,
            cpu_busy_s=0.2,
            busy_periods=4,
            busy_period_s=0.22,
        ),
        prefetch=PrefetchReport(acquires=10, hits=7, stall_s=0.5),
        server=ServerReport(sessions=1, attaches=2, disconnects=1, refused=0, protocol_errors=0, auth_errors=0),
        jobs=jobs,
        queued_tasks=0,
    )


def sample_job(job_id: str = "job-1") -> JobReport:
    return JobReport(
        job_id=job_id,
        owner_uid=1000,
        state="active",
        world_size=1,
        ranks=1,
        failed_ranks=0,
        last_step=5,
        window_nbytes=1 << 21,
        storage_nbytes=1 << 20,
        cpu_state_nbytes=1 << 20,
        nvme_state_nbytes=0,
        updated_elements=5000,
        staleness_steps=0,
    )


def sample_reply(*, jobs: int = 0) -> StatsReply:
    return StatsReply(node=sample_node(jobs=jobs), jobs=(sample_job(),))
