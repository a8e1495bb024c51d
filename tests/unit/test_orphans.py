"""Orphan swap and job files found at start: reported, kept for the grace period, then removed."""

from __future__ import annotations

from pathlib import Path

from tiermemd.orphans import Orphans, store_of


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _files(root: Path) -> tuple[Path, Path, Path]:
    swap, jobs = root / "swap", root / "state" / "jobs"
    swap.mkdir(parents=True)
    jobs.mkdir(parents=True)
    for name in ("u0-kept-aa.r0.swap", "u0-kept-aa.r0.manifest", "u0-gone-bb.r0.swap", "u0-gone-bb.r0.manifest.tmp"):
        (swap / name).write_bytes(b"x" * 4096)
    (swap / "notes.txt").write_text("not a store's")
    (jobs / "u0-gone-bb.job.tmp").write_text("{")
    (jobs / "u0-kept-aa.job.json").write_text("{}")
    return swap, jobs, root


def test_store_names_come_from_the_three_kinds_of_store_files() -> None:
    assert store_of(Path("u0-a-1.r0.swap")) == "u0-a-1.r0"
    assert store_of(Path("u0-a-1.r0.manifest")) == "u0-a-1.r0"
    assert store_of(Path("u0-a-1.r0.manifest.tmp")) == "u0-a-1.r0"
    assert store_of(Path("readme.txt")) is None and store_of(Path(".swap")) is None


def test_files_no_job_owns_are_kept_for_the_grace_period_then_removed(tmp_path: Path) -> None:
    swap, jobs, _ = _files(tmp_path)
    clock = Clock()
    orphans = Orphans(swap_dirs=[swap], jobs_dir=jobs, grace_period_s=30.0, clock=clock)
    found = orphans.scan({"u0-kept-aa.r0"})
    assert sorted(p.name for p in found) == ["u0-gone-bb.job.tmp", "u0-gone-bb.r0.manifest.tmp", "u0-gone-bb.r0.swap"]
    clock.t = 29.0
    assert orphans.sweep() == []
    assert (swap / "u0-gone-bb.r0.swap").exists()
    clock.t = 30.0
    assert sorted(p.name for p in orphans.sweep()) == sorted(p.name for p in found)
    assert sorted(p.name for p in swap.iterdir()) == ["notes.txt", "u0-kept-aa.r0.manifest", "u0-kept-aa.r0.swap"]
    assert [p.name for p in jobs.iterdir()] == ["u0-kept-aa.job.json"]
    assert (orphans.removed_files, orphans.removed_nbytes) == (3, 2 * 4096 + 1)
    assert orphans.sweep() == []


def test_a_new_store_of_the_same_name_takes_its_files_over(tmp_path: Path) -> None:
    swap, jobs, _ = _files(tmp_path)
    clock = Clock()
    orphans = Orphans(swap_dirs=[swap], jobs_dir=jobs, grace_period_s=0.0, clock=clock)
    orphans.scan(set())
    orphans.forget("u0-gone-bb.r0")
    removed = {p.name for p in orphans.sweep()}
    assert "u0-gone-bb.r0.swap" not in removed and "u0-kept-aa.r0.swap" in removed
    assert (swap / "u0-gone-bb.r0.swap").exists()
