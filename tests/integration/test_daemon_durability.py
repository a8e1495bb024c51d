"""Never silently wrong after a restart: what a restarted tiermemd serves, and what the client is told.

Real daemon processes on the same state and swap directories, one after the
other, stopped with SIGTERM or killed with SIGKILL in between; a real client
in this process; a torch AdamW reference trained on the same data.
"""

from __future__ import annotations

import copy
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tiermem.client.link import Client, connect
from tiermem.client.offload import OffloadAdam
from tiermem.core.errors import DaemonUnavailable, DataLostError, StaleStateError
from tiermemd.exits import EXIT_DATA_LOST

pytestmark = pytest.mark.timeout(600)

LR, WD = 3e-3, 0.05


class Node:
    """One state directory and swap directory, and the daemon currently running on them."""

    def __init__(self, root: Path, commit_every: int = 0) -> None:
        self.root = root
        self.commit_every = commit_every
        self.grace_period_s = 60.0
        self.proc: subprocess.Popen[bytes] | None = None
        self.clients: list[Client] = []
        self.starts = 0

    @property
    def log(self) -> str:
        return (self.root / "daemon.log").read_text()

    @property
    def swap(self) -> Path:
        return self.root / "swap"

    def write_config(self, swap_dirs: list[Path] | None = None) -> Path:
        """The daemon's settings file: this node's directories (``swap_dirs`` in place of its swap directory)."""
        sock = self.root / "tiermemd.sock"
        config = self.root / "tiermemd.toml"
        dirs = ", ".join(f'"{d}"' for d in swap_dirs or [self.swap])
        config.write_text(
            f'[pool]\nsize = "96MiB"\n[swap]\ndirs = [{dirs}]\n'
            f"[adam]\nchunk_numel = 1024\ncompile = false\n"
            f"[jobs]\ngrace_period_s = {self.grace_period_s}\ncommit_every = {self.commit_every}\n"
            f'[server]\nsocket = "{sock}"\nstate_dir = "{self.root / "state"}"\n'
        )
        return config

    def start(self) -> Client:
        sock = self.root / "tiermemd.sock"
        config = self.write_config()
        with open(self.root / "daemon.log", "ab") as log:
            log.write(f"---- start {self.starts}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tiermemd.main", "--config", str(config)], stderr=log, stdout=log
            )
        self.starts += 1
        deadline = time.monotonic() + 180  # a loaded 2-core machine may take long to import torch
        while time.monotonic() < deadline:
            try:
                client = connect(str(sock), embed=False)
            except DaemonUnavailable:
                if self.proc.poll() is not None:
                    pytest.fail(f"tiermemd exited {self.proc.returncode}: {self.log[-2000:]}")
                time.sleep(0.05)
                continue
            # the socket accepts before start-up finished logging (what it restored): wait for "ready"
            while self.log.count("INFO tiermemd: ready:") < self.starts and time.monotonic() < deadline:
                time.sleep(0.05)
            try:
                client.stats()  # right after a kill, the killed daemon's acceptor may have taken this connection
            except DaemonUnavailable:
                client.close()
                continue
            self.clients.append(client)
            return client
        pytest.fail("tiermemd did not come up")

    def stop(self, sig: signal.Signals = signal.SIGTERM) -> int:
        assert self.proc is not None
        self.proc.send_signal(sig)
        code = self.proc.wait(180)
        for client in self.clients:
            client.conn.close()
        self.clients.clear()
        self.proc = None
        return code

    def store_files(self) -> list[Path]:
        return sorted(self.swap.iterdir()) if self.swap.exists() else []


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    n = Node(tmp_path)
    yield n
    if n.proc is not None:
        n.proc.kill()
        n.proc.wait()


def _model() -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(48, 96), torch.nn.Tanh(), torch.nn.Linear(96, 48))


Snapshot = tuple[dict[str, torch.Tensor], dict[str, object]]
"""The reference model's and optimizer's state dicts at one step."""


class Run:
    """The offloaded model and a torch AdamW reference trained side by side on fixed data."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.data = [torch.randn(16, 48), torch.randn(16, 48)]
        self.model = _model()
        self.reference = _model()
        self.ref_opt = torch.optim.AdamW(self.reference.parameters(), lr=LR, weight_decay=WD)
        self.opt: OffloadAdam | None = None

    def attach(self, client: Client, **kwargs: object) -> OffloadAdam:
        self.model = _model()  # a restarted trainer: its params come back from the daemon
        self.opt = OffloadAdam(
            self.model.parameters(), lr=LR, weight_decay=WD, offload="nvme", client=client, job_id="durable", **kwargs
        )
        return self.opt

    def train(self, steps: int, *, reference: bool = True) -> None:
        assert self.opt is not None
        x, y = self.data
        pairs = [(self.model, self.opt)] + ([(self.reference, self.ref_opt)] if reference else [])
        for _ in range(steps):
            for model, opt in pairs:
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                opt.zero_grad()

    def snapshot(self) -> Snapshot:
        return copy.deepcopy(self.reference.state_dict()), copy.deepcopy(self.ref_opt.state_dict())

    def rewind(self, snap: Snapshot) -> None:
        self.reference.load_state_dict(snap[0])
        self.ref_opt.load_state_dict(snap[1])

    def roll_back(
        self, client: Client, token: str | None, *, client_step: int, commit: Snapshot, commit_step: int
    ) -> OffloadAdam:
        """Attach at ``client_step`` accepting the roll-back: the job comes back at its commit of ``commit_step``,
        the reference is rewound to ``commit`` (its snapshot then), and the two are equal."""
        opt = self.attach(client, token=token, expected_step=client_step, rollback=True)
        assert (opt.steps, opt.state_from) == (commit_step, "commit")
        self.rewind(commit)
        self.assert_equal()
        return opt

    def assert_equal(self) -> None:
        for a, b in zip(self.model.parameters(), self.reference.parameters(), strict=True):
            torch.testing.assert_close(a, b)


def trained_and_stopped(node: Node, steps: int) -> tuple[Run, str | None]:
    """A job of ``Run`` trained ``steps`` steps (no reference) and its node stopped cleanly: (run, its token)."""
    run = Run()
    token = run.attach(node.start()).token
    run.train(steps, reference=False)
    assert node.stop() == 0
    return run, token


def test_a_killed_daemon_serves_its_last_commit_and_the_client_refuses_it_unless_rolling_back(node: Node) -> None:
    node.commit_every = 3
    run = Run()
    opt = run.attach(node.start())
    assert (opt.steps, opt.state_from) == (0, "new")
    run.train(6)
    at_six = run.snapshot()
    run.train(2)  # steps 7 and 8 are not committed
    token = opt.token
    assert node.stop(signal.SIGKILL) == -signal.SIGKILL

    client = node.start()
    assert "did not stop cleanly" in node.log and "step 6 (rank 0)" in node.log
    with pytest.raises(StaleStateError) as caught:
        run.attach(client, token=token, expected_step=8)
    err = caught.value
    assert (err.state_step, err.client_step) == (6, 8)
    assert "steps 7..8" in str(err)
    # the refusal left the state as it was: a client that accepts the roll-back gets step 6
    opt = run.roll_back(client, token, client_step=8, commit=at_six, commit_step=6)
    run.train(4)
    run.assert_equal()
    saved = opt.state_dict()["state"]
    for index, entry in run.ref_opt.state_dict()["state"].items():
        torch.testing.assert_close(saved[index]["exp_avg_sq"], entry["exp_avg_sq"])
        assert float(saved[index]["step"]) == float(entry["step"]) == 10.0
    opt.close()
    assert node.stop() == 0
    assert node.store_files() == []


def test_a_sighup_turns_periodic_commits_on_and_off_for_running_jobs(node: Node) -> None:
    """An operator tightens durability without a restart: ``jobs.commit_every`` from 0 to 2 by SIGHUP, then a
    kill loses only the steps since the last periodic commit; back to 0, a kill loses all since then."""
    run = Run()
    opt = run.attach(node.start())
    run.train(3)  # no periodic commits: a kill now would lose all three steps

    def reload(commit_every: int) -> None:
        assert node.proc is not None
        node.commit_every = commit_every
        node.write_config()
        said = f"jobs.commit_every: {f'a commit every {commit_every} steps' if commit_every else '0'}"
        node.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 60
        while said not in node.log:
            assert time.monotonic() < deadline, node.log[-3000:]
            time.sleep(0.05)

    reload(2)
    run.train(1)  # step 4: 4 steps since no commit, commits at once
    run.train(2)  # steps 5, 6: commits at 6
    at_six = run.snapshot()
    run.train(1)  # step 7, not committed
    reload(0)
    run.train(3)  # steps 8..10: no commit
    assert "changed, but applied only by a restart" not in node.log
    token = opt.token
    assert node.stop(signal.SIGKILL) == -signal.SIGKILL

    client = node.start()
    assert "did not stop cleanly" in node.log and "step 6 (rank 0)" in node.log
    opt = run.roll_back(client, token, client_step=10, commit=at_six, commit_step=6)
    opt.close()
    assert node.stop() == 0


def test_without_periodic_commits_a_kill_after_a_reopen_comes_back_at_the_last_clean_stop(node: Node) -> None:
    run = Run()
    opt = run.attach(node.start())
    run.train(5)
    at_five = run.snapshot()
    token = opt.token
    assert node.stop() == 0

    opt = run.attach(node.start(), token=token, expected_step=5)
    assert (opt.steps, opt.state_from) == (5, "shutdown")
    run.assert_equal()
    run.train(4)  # steps 6..9, never committed
    assert node.stop(signal.SIGKILL) == -signal.SIGKILL

    client = node.start()
    with pytest.raises(StaleStateError, match="at step 5, older than this client's step 9"):
        run.attach(client, token=token, expected_step=9)
    opt = run.roll_back(client, token, client_step=9, commit=at_five, commit_step=5)
    opt.close()
    assert node.stop() == 0


def test_a_deleted_manifest_is_data_lost_at_start_and_at_reattach_never_zeros(node: Node) -> None:
    run, token = trained_and_stopped(node, 3)
    manifests = [p for p in node.store_files() if p.suffix == ".manifest"]
    assert len(manifests) == 1
    manifests[0].unlink()

    client = node.start()
    assert "is lost" in node.log and "manifest" in node.log
    with pytest.raises(DataLostError, match=r"cannot be reopened: its swap manifest .* is missing"):
        run.attach(client, token=token)
    # the lost job's files are gone and its id starts afresh
    assert list((node.root / "state" / "jobs").glob("*.job.json")) == []
    assert node.store_files() == []
    opt = run.attach(client)
    assert (opt.steps, opt.state_from) == (0, "new")
    opt.close()
    assert node.stop() == 0


def test_a_deleted_swap_file_is_data_lost_at_start_and_at_reattach_not_a_checksum_error(node: Node) -> None:
    run, token = trained_and_stopped(node, 3)
    (swap_file,) = [p for p in node.store_files() if p.suffix == ".swap"]
    swap_file.unlink()

    client = node.start()
    assert "is lost" in node.log and f"its swap file {swap_file} is missing" in node.log
    with pytest.raises(DataLostError, match=r"cannot be reopened: its swap file .* is missing"):
        run.attach(client, token=token)
    assert node.stop() == 0


def test_swap_dirs_reordered_refuse_to_start_and_the_state_comes_back_in_the_old_order(node: Node) -> None:
    run, token = trained_and_stopped(node, 3)
    kept = {p.name: p.read_bytes() for p in node.store_files()}
    new = node.root / "new-swap"
    done = subprocess.run(
        [sys.executable, "-m", "tiermemd.main", "--config", str(node.write_config([new, node.swap]))],
        capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    assert done.returncode == 4, done.stderr[-2000:]
    assert f"its swap manifest is in {node.swap}, but the first of swap.dirs is {new}" in done.stderr
    assert {p.name: p.read_bytes() for p in node.store_files()} == kept  # nothing was removed or rewritten

    opt = run.attach(node.start(), token=token)  # the old order: the job comes back whole
    assert (opt.steps, opt.state_from) == (3, "shutdown")
    opt.close()
    assert node.stop() == 0


def test_a_corrupt_manifest_is_data_lost(node: Node) -> None:
    run, token = trained_and_stopped(node, 2)
    manifest = next(p for p in node.store_files() if p.suffix == ".manifest")
    data = bytearray(manifest.read_bytes())
    data[len(data) // 2] ^= 0x01
    manifest.write_bytes(bytes(data))
    client = node.start()
    with pytest.raises(DataLostError, match="unreadable"):
        run.attach(client, token=token)
    assert node.stop() == 0


def test_a_failed_commit_at_shutdown_exits_6_and_the_next_start_serves_the_last_commit(node: Node) -> None:
    node.commit_every = 2
    run = Run()
    opt = run.attach(node.start())
    run.train(4)
    at_four = run.snapshot()
    run.train(1)
    token = opt.token
    manifest = next(p for p in node.store_files() if p.suffix == ".manifest")
    manifest.with_name(manifest.name + ".tmp").mkdir()  # the manifest write at shutdown fails (EISDIR)
    assert node.stop() == EXIT_DATA_LOST
    assert "the commit at shutdown failed" in node.log and "serves its last commit: step 4, not step 5" in node.log
    manifest.with_name(manifest.name + ".tmp").rmdir()

    client = node.start()
    with pytest.raises(StaleStateError, match="at step 4, older than this client's step 5"):
        run.attach(client, token=token, expected_step=5)
    opt = run.roll_back(client, token, client_step=5, commit=at_four, commit_step=4)
    run.train(2)
    run.assert_equal()
    opt.close()
    assert node.stop() == 0


def test_files_no_job_owns_are_reported_at_start_and_removed_after_the_grace_period(node: Node) -> None:
    run, token = trained_and_stopped(node, 2)
    kept = node.store_files()
    ghosts = [node.swap / "u0-ghost-0123456789.r0.swap", node.swap / "u0-ghost-0123456789.r0.manifest"]
    for ghost in ghosts:
        ghost.write_bytes(b"\x01" * 8192)
    half_written = node.root / "state" / "jobs" / "u0-ghost-0123456789.job.tmp"
    half_written.write_text("{")

    node.grace_period_s = 5.0  # also the restored job's: it reattaches at once
    client = node.start()
    opt = run.attach(client, token=token, expected_step=2)
    assert (opt.steps, opt.state_from) == (2, "shutdown")
    assert "3 file(s)" in node.log and "that no job owns" in node.log
    deadline = time.monotonic() + 30
    while any(p.exists() for p in [*ghosts, half_written]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(p.exists() for p in [*ghosts, half_written])
    assert node.store_files() == kept  # the restored job's files were never orphans
    opt.close()
    assert node.stop() == 0


def test_a_new_job_never_reads_the_files_of_an_earlier_job_of_its_name(node: Node) -> None:
    trained_and_stopped(node, 3)
    for job_file in (node.root / "state" / "jobs").glob("*.job.json"):
        job_file.unlink()  # its job file is gone: the swap store is an orphan with a valid manifest
    client = node.start()
    fresh = Run()
    fresh.opt = fresh.attach(client)  # the same job id, no token: a new job
    assert (fresh.opt.steps, fresh.opt.state_from) == (0, "new")
    for p in fresh.opt.param_groups[0]["params"]:
        assert float(fresh.opt.state[p]["exp_avg_sq"].abs().sum()) == 0.0
    fresh.train(3)
    fresh.assert_equal()
    fresh.opt.close()
    assert node.stop() == 0
