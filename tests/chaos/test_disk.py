"""Chaos, quick versions: what the disk can do to NVMe state.  Typed errors, other jobs unaffected, nothing silent.

- flipped bytes, a truncated swap file, a deleted manifest, each done to one
  job's files between two daemons: that job's reattach raises a typed error
  (``CorruptionError``/``SwapIOError``/``DataLostError``), a job next to it
  reattaches and trains on exactly;
- EIO from the swap engine (``tests/faults.py``'s fault-injecting engine) on
  one job's store: every injected fault is raised, the other store reads back
  its bytes;
- a full disk (a 4 MiB tmpfs as the swap directory, root only): a job that
  does not fit is refused at admission (``AdmissionError`` from the swap
  budget, ``SwapFullError`` from the disk itself); the job that
  fits trains on;
- a disk filled by something else (the swap directory's, the state
  directory's) while a job trains with ``jobs.commit_every = 1``: its
  commits are deferred, it trains on exactly,
  the first commit with room catches up, and a stop while still full comes
  back at the last commit that landed.

Each prints its figures: faults injected, detected, and silent corruptions.
"""

from __future__ import annotations

import contextlib
import json
import random
import socket
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from faults import Fault, FaultyEngine, mounted
from hostile import ChaosDaemon

from tiermem.client.link import Client, connect
from tiermem.client.offload import OffloadAdam
from tiermem.core.errors import AdmissionError, CorruptionError, DataLostError, SwapFullError, SwapIOError, TiermemError
from tiermem.engine.swap.engine import IOOp
from tiermem.engine.swap.engine_threads import ThreadEngine
from tiermem.engine.swap.manifest import read_manifest
from tiermem.engine.swap.store import SwapStore

pytestmark = pytest.mark.timeout(600)

X, Y = torch.randn(8, 32, generator=torch.Generator().manual_seed(1)), torch.randn(8, 32)


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 32))


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    torch.nn.functional.mse_loss(model(X), Y).backward()
    opt.step()
    opt.zero_grad()


class Job:
    def __init__(self, name: str, seed: int) -> None:
        self.name, self.seed = name, seed
        self.model = _model(seed)
        self.reference = _model(seed)
        self.ref_opt = torch.optim.AdamW(self.reference.parameters(), lr=1e-3)
        self.token: str | None = None

    def attach(self, client: Client) -> OffloadAdam:
        self.model = _model(self.seed + 1000)  # a restarted trainer: params come back from the daemon
        return OffloadAdam(
            self.model.parameters(), lr=1e-3, client=client, job_id=self.name, token=self.token, offload="nvme"
        )

    def train(self, opt: OffloadAdam, steps: int) -> None:
        for _ in range(steps):
            _step(self.model, opt)
            _step(self.reference, self.ref_opt)

    def equal(self) -> bool:
        """Equal to torch's AdamW on the same steps, as ``torch.testing.assert_close`` judges fp32."""
        try:
            for a, b in zip(self.model.parameters(), self.reference.parameters(), strict=True):
                torch.testing.assert_close(a, b)
        except AssertionError:
            return False
        return True


@pytest.fixture
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChaosDaemon]:
    d = ChaosDaemon(tmp_path_factory.mktemp("disk"), overrides={"jobs": {"grace_period_s": 60.0}}).start()
    try:
        yield d
    finally:
        d.cleanup()


def _store_files(daemon: ChaosDaemon, job: str) -> tuple[Path, Path]:
    swap = daemon.root / "swap"
    swap_file = next(p for p in swap.iterdir() if p.name.endswith(".swap") and f"-{job}-" in p.name)
    return swap_file, swap_file.with_suffix(".manifest")


def test_damaged_swap_files_give_typed_errors_and_leave_the_other_job_exact(daemon: ChaosDaemon, capsys) -> None:  # type: ignore[no-untyped-def]
    jobs = {name: Job(name, seed) for seed, name in enumerate(["flipped", "truncated", "unlisted", "intact"])}
    for job in jobs.values():
        opt = job.attach(connect(daemon.socket_path, embed=False))
        job.model.load_state_dict(job.reference.state_dict())
        job.train(opt, 5)
        job.token = opt.token
        opt.close(keep_state=True)
    assert daemon.stop() == 0

    rng = random.Random(0)
    swap_file, manifest_path = _store_files(daemon, "flipped")
    manifest = read_manifest(manifest_path)
    assert manifest is not None
    flips = 0
    with open(swap_file, "r+b") as f:
        for record in manifest.records.values():
            extent = record.extents[0]
            f.seek(extent.offset + rng.randrange(extent.nbytes))
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0x10]))
            flips += 1
    swap_file, manifest_path = _store_files(daemon, "truncated")
    manifest = read_manifest(manifest_path)
    assert manifest is not None
    first = min(e.offset for r in manifest.records.values() for e in r.extents)
    swap_file.write_bytes(swap_file.read_bytes()[: first + 4096])  # cut inside its first committed extent
    _store_files(daemon, "unlisted")[1].unlink()

    daemon.start()
    detected: dict[str, str] = {}
    silent = 0
    for name in ("flipped", "truncated", "unlisted"):
        try:
            opt = jobs[name].attach(connect(daemon.socket_path, embed=False))
        except (CorruptionError, SwapIOError, DataLostError) as exc:
            detected[name] = type(exc).__name__
        else:
            silent += not jobs[name].equal()
            opt.close()
    intact = jobs["intact"]
    opt = intact.attach(connect(daemon.socket_path, embed=False))
    intact_equal_at_reopen = intact.equal()
    intact.train(opt, 3)
    intact_equal = intact.equal()
    opt.close()
    figures = {
        "faults_injected": 3,
        "flipped_bytes": flips,
        "detected": len(detected),
        "errors": detected,
        "silent_corruptions": silent,
        "other_job_exact": intact_equal_at_reopen and intact_equal,
    }
    with capsys.disabled():
        print(f"\nchaos damaged swap files: {json.dumps(figures)}")
    assert detected == {
        "flipped": "CorruptionError",
        "truncated": "DataLostError",  # the start finds the file shorter than its manifest's extents
        "unlisted": "DataLostError",
    }
    assert silent == 0 and figures["other_job_exact"]
    assert daemon.stop() == 0


def test_eio_on_one_store_is_raised_every_time_and_the_other_store_reads_back(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    engine = FaultyEngine(ThreadEngine(block_size=1 << 20, threads=2))
    stores = {name: SwapStore.open([tmp_path], name, engine, 8 << 20, fsync=False) for name in ("victim", "bystander")}
    data = {name: bytearray(random.Random(i).randbytes(256 << 10)) for i, name in enumerate(stores)}
    try:
        for name, store in stores.items():
            store.write("k", data[name]).result(timeout=30)
        faults = []
        detected = bystander_ok = silent = 0
        for i in range(50):
            faults.append(engine.inject(Fault(IOOp.READ, path_contains="victim", skip=i % 3)))
            for name, store in stores.items():
                out = bytearray(len(data[name]))
                try:
                    store.read("k", out).result(timeout=30)
                except (SwapIOError, CorruptionError):
                    detected += name == "victim"
                    continue
                if name == "bystander":
                    bystander_ok += out == data[name]
                elif out != data[name]:
                    silent += 1
            # a fault whose skip outlives this round's read fires in a later one (or never: not counted)
        fired = sum(f.hits for f in faults)
        figures = {
            "faults_injected": fired,
            "detected": detected,
            "bystander_reads_ok": bystander_ok,
            "silent": silent,
        }
        with capsys.disabled():
            print(f"\nchaos EIO: {json.dumps(figures)}")
        assert silent == 0 and bystander_ok == 50
        assert fired >= 40 and detected == fired
    finally:
        for store in stores.values():
            store.close(remove=True)
        engine.close()


def test_a_full_disk_refuses_the_job_that_does_not_fit_and_the_other_trains_on(tmp_path_factory, capsys) -> None:  # type: ignore[no-untyped-def]
    with mounted("tmpfs", "size=4m") as small:
        root = tmp_path_factory.mktemp("full")
        # the daemon makes its own 0700 directory in the (world-writable, sticky) mount
        d = ChaosDaemon(root, overrides={"swap": {"dirs": [str(small / "swap")]}}).start()
        try:
            client = connect(d.socket_path, embed=False)
            fits = Job("fits", 0)
            opt = fits.attach(client)
            fits.model.load_state_dict(fits.reference.state_dict())
            fits.train(opt, 2)
            big = torch.nn.Linear(1024, 1024)  # 12 MiB of state, twice: cannot fit 4 MiB
            refused = ""
            try:
                OffloadAdam(big.parameters(), client=connect(d.socket_path, embed=False), job_id="big", offload="nvme")
            except (SwapFullError, AdmissionError) as exc:  # the swap budget, or the disk itself
                refused = type(exc).__name__
            except TiermemError as exc:  # pragma: no cover - reported by the assert below
                refused = f"other: {exc!r}"
            fits.train(opt, 3)
            figures = {"refused": refused, "fitting_job_exact": fits.equal()}
            opt.close()
            client.close()
            with capsys.disabled():
                print(f"\nchaos disk full: {json.dumps(figures)}")
            assert refused in ("SwapFullError", "AdmissionError") and figures["fitting_job_exact"]
            assert d.stop() == 0
        finally:
            d.cleanup()


def _fill(directory: Path) -> Path:
    """Take every free byte of ``directory``'s file system with one file; its path (remove it to free them)."""
    filler = directory / "filler"
    with open(filler, "wb", buffering=0) as f, contextlib.suppress(OSError):
        while True:
            f.write(bytes(65536))
    return filler


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _gauge(port: int, name: str) -> float:
    """The value of the unlabelled series ``name`` in a scrape of the daemon's metrics."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    return next(float(line.split()[1]) for line in text.splitlines() if line.startswith(name + " "))


def _snapshot(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("full", ["swap", "state"])
def test_a_full_disk_at_a_periodic_commit_defers_it_and_loses_nothing(tmp_path_factory, capsys, full) -> None:  # type: ignore[no-untyped-def]
    """The swap files are preallocated, so a full swap file system fails only the manifest's write, and a
    full state directory the job file's.  The synced data stands: the trainer trains on, the operator is
    told (log; a manifest in ``io_errors``), the next commit with room catches up, and a stop with the disk
    still full comes back at the last commit that landed."""
    with mounted("tmpfs", "size=4m") as small:
        root = tmp_path_factory.mktemp("fullcommit")
        port = _free_port()
        overrides: dict[str, dict[str, Any]] = {
            "jobs": {"commit_every": 1, "grace_period_s": 60.0},
            "metrics": {"port": port},
        }
        if full == "swap":
            overrides["swap"] = {"dirs": [str(small / "swap")]}
        else:
            overrides["server"] = {"state_dir": str(small / "state")}
        d = ChaosDaemon(root, overrides=overrides).start()
        try:
            job = Job("fills", 0)
            opt = job.attach(connect(d.socket_path, embed=False))
            job.model.load_state_dict(job.reference.state_dict())
            job.train(opt, 2)
            leaver = Job("leaves", 1)  # a job that ends while its commits are deferred
            leaver_opt = leaver.attach(connect(d.socket_path, embed=False))
            filler = _fill(small)
            job.train(opt, 3)  # each step's commit finds no room for the manifest
            leaver.train(leaver_opt, 2)
            exact_while_full = job.equal()
            errors_while_full = opt.client.stats().node.swap.io_errors
            deferred_while_full = _gauge(port, "tiermem_deferred_commit_ranks")
            leaver_opt.close()
            deferred_after_leaving = _gauge(port, "tiermem_deferred_commit_ranks")
            filler.unlink()
            job.train(opt, 1)  # room again: this commit lands, with every step since
            deferred_after = _gauge(port, "tiermem_deferred_commit_ranks")
            job.token = opt.token
            opt.close(keep_state=True)
            stopped = d.stop()
            log = d.log_text()

            d.start()
            opt = job.attach(connect(d.socket_path, embed=False))
            steps_after_restart, exact_after_restart = opt.steps, job.equal()
            filler = _fill(small)
            at_last_commit = _snapshot(job.reference)
            job.train(opt, 2)  # deferred again; the stop's own commit fails too
            opt.close(keep_state=True)
            stopped_full = d.stop()
            log_full = d.log_text()
            filler.unlink()

            d.start()
            opt = job.attach(connect(d.socket_path, embed=False))
            steps_after_full_stop = opt.steps
            back_at_last_commit = all(  # assert_close's fp32 tolerances, as ``Job.equal``
                torch.allclose(a, b, rtol=1.3e-6, atol=1e-5)
                for a, b in zip(job.model.parameters(), at_last_commit, strict=True)
            )
            opt.close()
            figures = {
                "exact_while_full": exact_while_full,
                "io_errors_while_full": errors_while_full,
                "deferred_commit_ranks": [deferred_while_full, deferred_after_leaving, deferred_after],
                "stop_exit": stopped,
                "steps_after_restart": steps_after_restart,
                "exact_after_restart": exact_after_restart,
                "stop_exit_disk_full": stopped_full,
                "steps_after_full_stop": steps_after_full_stop,
                "back_at_last_commit": back_at_last_commit,
            }
            with capsys.disabled():
                print(f"\nchaos disk full at commit: {json.dumps(figures)}")
            assert exact_while_full and errors_while_full >= (5 if full == "swap" else 0)
            assert (deferred_while_full, deferred_after_leaving, deferred_after) == (2, 1, 0)
            assert "No space left on device" in log and "is deferred, training goes on" in log
            assert "landed, after 3 deferred" in log
            assert stopped == 0 and steps_after_restart == 6 and exact_after_restart
            assert stopped_full == 6, log_full[-3000:]  # EXIT_DATA_LOST: the stop's commit did not land
            assert "the next start serves its last commit: step 6" in log_full
            assert steps_after_full_stop == 6 and back_at_last_commit
            assert d.stop() == 0
        finally:
            d.cleanup()
