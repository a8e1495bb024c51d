"""tiermemd with several jobs and real client processes: parity, crashes, reattach, leaks.

Clients are ``daemon_client.py`` processes; their numbers are functions of
(seed, step), replayed here through ``torch.optim.AdamW``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from conftest import GRACE_PERIOD_S
from daemon_client import adamw_reference

from tiermem.core.protocol import NodeReport, Stats

SIZES = [300, 40, 7]
SIZES_ARG = ",".join(map(str, SIZES))


def assert_matches_adamw(path: Path, seed: int, steps: int, sizes: list[int] = SIZES) -> None:
    got = torch.from_numpy(np.load(path))
    torch.testing.assert_close(got, torch.from_numpy(adamw_reference(seed, sizes, steps)))


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def leak_figures(node: NodeReport) -> dict[str, int]:
    held = {b.resource: b.held_nbytes for b in node.budgets}
    return {
        "pool_used": node.pool.used_nbytes,
        "pool_held": held["pool"],
        "window_held": held["window"],
        "jobs": node.jobs,
    }


def test_two_jobs_in_two_processes_match_adamw(daemon, run_client, tmp_path):
    a = run_client(
        "train",
        daemon,
        "--job",
        "two-a",
        "--sizes",
        SIZES_ARG,
        "--steps",
        "12",
        "--seed",
        "1",
        "--out",
        str(tmp_path / "a.npy"),
    )
    b = run_client(
        "train",
        daemon,
        "--job",
        "two-b",
        "--sizes",
        SIZES_ARG,
        "--steps",
        "15",
        "--seed",
        "2",
        "--out",
        str(tmp_path / "b.npy"),
    )
    assert a.result()["last_step"] == 12
    assert b.result()["last_step"] == 15
    assert_matches_adamw(tmp_path / "a.npy", seed=1, steps=12)
    assert_matches_adamw(tmp_path / "b.npy", seed=2, steps=15)


def test_sigkill_of_a_looping_client_spares_the_other_job_and_leaks_nothing(daemon, run_client, tmp_path):
    baseline = leak_figures(daemon.wait_stats(lambda s: s.jobs == 0, 10.0))
    assert baseline["jobs"] == 0
    baseline_fds = fd_count(daemon.pid)
    victim = run_client(
        "train",
        daemon,
        "--job",
        "victim",
        "--sizes",
        "200000,3000",
        "--steps",
        "1000000",
        "--grads",
        "fixed",
        "--no-detach",
    )
    victim.wait_step(3)
    survivor = run_client(
        "train",
        daemon,
        "--job",
        "survivor",
        "--sizes",
        SIZES_ARG,
        "--steps",
        "30",
        "--seed",
        "3",
        "--step-delay",
        "0.01",
        "--out",
        str(tmp_path / "s.npy"),
    )
    survivor.wait_step(2)
    during = daemon.stats()
    assert during.jobs == 2
    assert during.pool.used_nbytes > baseline["pool_used"]
    victim.process.send_signal(signal.SIGKILL)
    victim.process.wait()
    assert survivor.result()["last_step"] == 30
    assert_matches_adamw(tmp_path / "s.npy", seed=3, steps=30)
    after = daemon.wait_stats(lambda s: leak_figures(s) == baseline, 3 * GRACE_PERIOD_S + 5.0)
    assert leak_figures(after) == baseline
    deadline = time.monotonic() + 5.0
    while fd_count(daemon.pid) > baseline_fds and time.monotonic() < deadline:
        time.sleep(0.05)
    assert fd_count(daemon.pid) <= baseline_fds, "windows, sockets or pidfds of the dead client were not closed"


def test_reattach_with_the_token_after_a_crash_continues_as_if_uninterrupted(daemon, run_client, tmp_path):
    """SIGKILL lands during the run (usually mid-step); a new process reattaches and the result is unchanged."""
    steps, sizes = 150, [30000, 5000, 7]
    sizes_arg = ",".join(map(str, sizes))
    progress = str(tmp_path / "crash.json")
    # both processes train the same job, from the same seed, reporting through the same progress file
    same_run = ["--job", "phoenix", "--sizes", sizes_arg, "--steps", str(steps), "--seed", "4", "--progress", progress]
    crashed = run_client("train", daemon, *same_run, "--no-detach")
    heir = run_client(
        "train",
        daemon,
        *same_run,
        "--reattach",
        "--wait-stdin",
        "--out",
        str(tmp_path / "p.npy"),
        stdin=subprocess.PIPE,
    )
    reached = crashed.wait_step(5)["step"]
    crashed.process.send_signal(signal.SIGKILL)
    crashed.process.wait()
    assert heir.process.stdin is not None
    heir.process.stdin.write("go\n")
    heir.process.stdin.flush()
    result = heir.result()
    print(f"killed after step {reached}; the daemon had applied {result['reattached_at']}")
    assert result["last_step"] == steps
    assert reached <= result["reattached_at"] < steps
    assert_matches_adamw(tmp_path / "p.npy", seed=4, steps=steps, sizes=sizes)


def test_stats_answers_promptly_while_another_client_runs_a_large_update(daemon, run_client, tmp_path):
    """The control path does not queue behind CPU work: STATS from another connection during 3M-param steps."""
    stop = tmp_path / "stop"
    big = run_client(
        "train",
        daemon,
        "--job",
        "big",
        "--sizes",
        "3000000",
        "--steps",
        "1000000",
        "--grads",
        "fixed",
        "--stop-file",
        str(stop),
    )
    first = big.wait_step(2)["step"]
    latencies = []
    with daemon.connection() as conn:
        while len(latencies) < 40:
            t0 = time.perf_counter()
            conn.request(Stats())
            latencies.append(time.perf_counter() - t0)
            time.sleep(0.02)
    during = big.progress()["step"]
    stop.touch()
    result = big.result()
    latencies.sort()
    print(
        f"STATS latency during 3M-param steps: median {latencies[len(latencies) // 2] * 1e3:.2f} ms, "
        f"max {latencies[-1] * 1e3:.2f} ms over {len(latencies)} requests, steps {first}..{during}"
    )
    assert during > first, "the large client made no progress while STATS was measured"
    assert result["last_step"] >= during
    assert latencies[-1] < 2.0


UNCLOSED_TRAINER = """
import sys, torch, tiermem
model = torch.nn.Linear(16, 16)
opt = tiermem.OffloadAdam(model.parameters(), job_id=sys.argv[1])
model(torch.randn(4, 16)).sum().backward()
opt.step()
if sys.argv[2] == "fails":
    raise RuntimeError("the trainer fails after a step")
"""


def _job_ids(daemon) -> set[str]:
    with daemon.connection() as conn:
        reply = conn.request(Stats())
    return {j.job_id for j in reply.jobs}


def test_a_trainer_that_ends_without_close_frees_its_job_and_one_that_crashes_keeps_it(daemon_factory, tmp_path):
    """A script that ends normally without ``opt.close()`` frees its job at once (it held it, and a slot of
    ``jobs.max_jobs_per_uid``, for the whole grace period before); one that ends on an unhandled exception
    leaves it for a reattach, as a killed trainer does."""
    from child_env import child_env

    daemon = daemon_factory({"jobs": {"grace_period_s": 120.0}})
    script = tmp_path / "unclosed.py"
    script.write_text(UNCLOSED_TRAINER)
    env = {**child_env(), "TIERMEM_SOCKET_PATH": daemon.socket_path, "TIERMEM_NO_EMBED": "1"}
    for outcome, job in (("ends", "unclosed-ends"), ("fails", "unclosed-fails")):
        done = subprocess.run(
            [sys.executable, str(script), job, outcome],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == (1 if outcome == "fails" else 0), done.stderr[-2000:]
    jobs = _job_ids(daemon)
    assert "unclosed-ends" not in jobs  # detached at exit, before the process ended: no grace period
    assert "unclosed-fails" in jobs  # kept for a reattach within jobs.grace_period_s
