from __future__ import annotations

import pytest

from tiermem.core.errors import AdmissionError, AuthError, InvalidArgument, UnknownJob
from tiermemd.jobs import JobState, JobTable


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def table(clock: Clock, grace: float = 10.0, max_jobs: int = 4) -> JobTable:
    return JobTable(grace_period_s=grace, max_jobs=max_jobs, clock=clock)


def test_first_attach_creates_the_job_and_later_ranks_need_the_token() -> None:
    jobs = table(Clock())
    job, created = jobs.attach(job_id="a", rank=0, world_size=2, uid=1000, token=None, session=1)
    assert created and job.owner_uid == 1000 and len(job.token) == 32
    with pytest.raises(AuthError, match="needs its token"):
        jobs.attach(job_id="a", rank=1, world_size=2, uid=1000, token=None, session=2)
    with pytest.raises(AuthError, match="needs its token"):
        jobs.attach(job_id="a", rank=1, world_size=2, uid=1000, token="0" * 32, session=2)
    again, created = jobs.attach(job_id="a", rank=1, world_size=2, uid=1000, token=job.token, session=2)
    assert again is job and not created


def test_job_ids_are_scoped_per_uid_so_another_uid_never_reaches_or_claims_a_job() -> None:
    jobs = table(Clock())
    job, _ = jobs.attach(job_id="a", rank=0, world_size=1, uid=1000, token=None, session=1)
    jobs.session_gone(1)
    # the same id from another uid names that uid's own job: with the first job's token there is none
    with pytest.raises(UnknownJob, match="uid 1001 has no job 'a'"):
        jobs.attach(job_id="a", rank=0, world_size=1, uid=1001, token=job.token, session=2)
    theirs, created = jobs.attach(job_id="a", rank=0, world_size=1, uid=1001, token=None, session=2)
    assert created and theirs is not job and theirs.key != job.key and theirs.token != job.token
    # and the first uid still reattaches to its own job, untouched
    again, created = jobs.attach(job_id="a", rank=0, world_size=1, uid=1000, token=job.token, session=3)
    assert again is job and not created
    assert jobs.get("a", 1000) is job and jobs.get("a", 1001) is theirs


def test_one_uid_cannot_fill_max_jobs_for_everyone() -> None:
    jobs = table(Clock(), max_jobs=4)
    assert jobs.per_uid_limit == 2
    for i in range(2):
        jobs.attach(job_id=f"j{i}", rank=0, world_size=1, uid=1000, token=None, session=i)
    with pytest.raises(AdmissionError, match="uid 1000 already holds 2 jobs"):
        jobs.attach(job_id="j2", rank=0, world_size=1, uid=1000, token=None, session=9)
    for i in range(2):
        jobs.attach(job_id=f"j{i}", rank=0, world_size=1, uid=1001, token=None, session=10 + i)
    with pytest.raises(AdmissionError, match=r"jobs\.max_jobs = 4"):
        jobs.attach(job_id="x", rank=0, world_size=1, uid=1002, token=None, session=20)
    jobs.max_jobs_per_uid = 3
    jobs.max_jobs = 8
    jobs.attach(job_id="j2", rank=0, world_size=1, uid=1000, token=None, session=21)


def test_a_live_rank_cannot_be_taken_over() -> None:
    jobs = table(Clock())
    job, _ = jobs.attach(job_id="a", rank=0, world_size=1, uid=0, token=None, session=1)
    with pytest.raises(AdmissionError, match="already attached"):
        jobs.attach(job_id="a", rank=0, world_size=1, uid=0, token=job.token, session=2)


def test_crash_orphans_the_job_and_reattach_within_grace_revives_it() -> None:
    clock = Clock()
    jobs = table(clock)
    job, _ = jobs.attach(job_id="a", rank=0, world_size=1, uid=0, token=None, session=1)
    assert jobs.session_gone(1) == [job]
    assert job.state is JobState.ORPHANED
    clock.t = 9.0
    assert jobs.expire() == []
    jobs.attach(job_id="a", rank=0, world_size=1, uid=0, token=job.token, session=2)
    assert job.state is JobState.ACTIVE
    clock.t = 100.0
    assert jobs.expire() == []


def test_grace_period_end_reclaims_and_the_token_no_longer_works() -> None:
    clock = Clock()
    jobs = table(clock)
    job, _ = jobs.attach(job_id="a", rank=0, world_size=1, uid=0, token=None, session=1)
    jobs.session_gone(1)
    clock.t = 10.0
    assert jobs.expire() == [job]
    assert job.state is JobState.RECLAIMED
    with pytest.raises(UnknownJob, match="reclaimed"):
        jobs.attach(job_id="a", rank=0, world_size=1, uid=0, token=job.token, session=2)


def test_detach_of_every_rank_finishes_the_job() -> None:
    jobs = table(Clock())
    job, _ = jobs.attach(job_id="a", rank=0, world_size=2, uid=0, token=None, session=1)
    jobs.attach(job_id="a", rank=1, world_size=2, uid=0, token=job.token, session=2)
    job.ranks.update({0: object(), 1: object()})
    assert jobs.detach("a", 0, 1, 0) is False
    assert jobs.detach("a", 1, 2, 0) is True
    assert job.state is JobState.RECLAIMED


def test_bad_ranks_ids_and_the_job_limit_are_refused() -> None:
    jobs = table(Clock(), max_jobs=1)
    assert jobs.per_uid_limit == 1
    with pytest.raises(InvalidArgument, match="rank 2"):
        jobs.attach(job_id="a", rank=2, world_size=2, uid=0, token=None, session=1)
    with pytest.raises(InvalidArgument, match="job id"):
        jobs.attach(job_id="", rank=0, world_size=1, uid=0, token=None, session=1)
    jobs.attach(job_id="a", rank=0, world_size=1, uid=0, token=None, session=1)
    with pytest.raises(AdmissionError, match="max_jobs"):
        jobs.attach(job_id="b", rank=0, world_size=1, uid=0, token=None, session=2)


def test_ranks_with_an_agreed_token_create_the_job_in_any_order() -> None:
    t = table(Clock())
    agreed = "f" * 32
    job, created = t.attach(job_id="run", rank=1, world_size=2, uid=5, token=agreed, session=1, create=True)
    assert created and job.token == agreed
    again, created = t.attach(job_id="run", rank=0, world_size=2, uid=5, token=agreed, session=2, create=True)
    assert again is job and not created
    with pytest.raises(AuthError):  # another run that reuses the id with its own token
        t.attach(job_id="run", rank=0, world_size=2, uid=5, token="e" * 32, session=3, create=True)
    with pytest.raises(UnknownJob):  # without create, a token still names a job that must exist
        t.attach(job_id="gone", rank=0, world_size=1, uid=5, token=agreed, session=4)
