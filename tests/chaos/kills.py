"""Chaos scenarios of crashes: trainers SIGKILLed at random points, and the daemon itself killed and restarted.

Run as a script, this module is the *trainer side* of a scenario, in a process
of its own that imports torch once and forks every victim from there (a
victim is ready in milliseconds, and the zygote runs no torch op and starts no
thread, so forking it is safe)::

    python kills.py victims --socket S --kills N --seed X     # JSON figures on stdout
    python kills.py survivor --socket S --job J --steps N      # trains N steps, prints a digest
    python kills.py survivor --socket S --job J --until FILE   # trains until FILE exists

Imported, it gives the scenario functions the tests and ``benchmarks/soak.py``
call with a running daemon (``hostile.ChaosDaemon``); each returns a dict of
figures:

- ``client_kills``: victims attach (new jobs, CPU or NVMe state, the shared or
  the staged exchange, some with a forked child that keeps the inherited
  socket open), train, save state, and are SIGKILLed at a random moment; survivor jobs train through all of it, and
  their final params must equal (bitwise) those of the same job run again
  with no chaos.
- ``daemon_kill``: a job trains with ``jobs.commit_every``; the daemon is
  SIGKILLed mid-training; the client's next request fails (how long it took is
  a figure), the next daemon reopens the last commit, says so, and the
  reattaching client is told that step; training goes on from there and ends
  equal to a run that was never interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SCRIPT = str(Path(__file__).resolve())

__all__ = ["SCRIPT", "client_kills", "daemon_kill", "run_survivor", "start_survivor"]


# ----------------------------------------------------------------- the trainer side (this file as a script)


def _model(seed: int) -> Any:
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 32))


def _batch(seed: int, step: int) -> tuple[Any, Any]:
    import torch

    g = torch.Generator().manual_seed(seed * 100_003 + step)
    return torch.randn(8, 32, generator=g), torch.randn(8, 32, generator=g)


def _train_step(model: Any, opt: Any, seed: int, step: int) -> None:
    import torch

    x, y = _batch(seed, step)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def _digest(model: Any) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def _victim(socket_path: str, index: int, rng: random.Random) -> None:
    """One victim (a forked child): attach a new job, train, maybe fork a socket holder, maybe save state."""
    import torch

    from tiermem.client.link import connect
    from tiermem.client.offload import OffloadAdam

    torch.set_num_threads(1)
    client = connect(socket_path, embed=False)
    model = _model(index)
    opt = OffloadAdam(
        model.parameters(),
        lr=1e-3,
        client=client,
        job_id=f"victim-{index}",
        offload=rng.choice(["cpu", "nvme"]),
        exchange=rng.choice(["shared", "staged"]),  # the staged one is a GPU model's and every paged one's
        window_nbytes=64 << 10,
    )
    if rng.random() < 0.15 and os.fork() == 0:  # a child holding the inherited socket outlives the victim
        time.sleep(rng.uniform(0.2, 1.5))
        os._exit(0)
    for step in range(rng.randint(1, 12)):
        _train_step(model, opt, index, step)
        if rng.random() < 0.1:
            opt.state_dict()
    opt.close()


def _victims(socket_path: str, kills: int, seed: int, max_delay_s: float) -> dict[str, Any]:
    import torch  # noqa: F401 - imported once here, so a forked victim starts in milliseconds

    import tiermem.client.offload  # noqa: F401

    # Python finds its temp directory once per process by creating a file of 8 random characters there and
    # removing it; torch asks for it at a victim's first optimizer (dynamo's cache dir), so a victim killed in
    # between left an empty /tmp/xxxxxxxx.  Asked here, the answer is inherited and no victim makes that file.
    tempfile.gettempdir()

    rng = random.Random(seed)
    killed = finished = failed = holders = 0
    started = time.monotonic()
    for index in range(kills):
        child_seed = rng.randrange(1 << 30)
        delay = rng.uniform(0.0, max_delay_s)
        replay = random.Random(child_seed)  # the victim's own draws: its placement, then whether it forks
        replay.choice(["cpu", "nvme"])
        holders += replay.random() < 0.15
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                _victim(socket_path, index, random.Random(child_seed))
            except BaseException:
                code = 1
            os._exit(code)
        time.sleep(delay)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        if os.WIFSIGNALED(status):
            killed += 1
        elif os.WEXITSTATUS(status) == 0:
            finished += 1
        else:
            failed += 1
    return {
        "victims": kills,
        "killed": killed,
        "finished_before_kill": finished,
        "victim_errors": failed,
        "victims_forking_a_socket_holder": holders,
        "seconds": round(time.monotonic() - started, 1),
    }


def _survivor(
    socket_path: str, job: str, seed: int, steps: int | None, until: str | None, interval_s: float = 0.0
) -> dict[str, Any]:
    import torch

    from tiermem.client.link import connect
    from tiermem.client.offload import OffloadAdam

    torch.set_num_threads(1)
    client = connect(socket_path, embed=False)
    model = _model(seed)
    opt = OffloadAdam(model.parameters(), lr=1e-3, client=client, job_id=job, offload="nvme", window_nbytes=64 << 10)
    step = 0
    while (steps is not None and step < steps) or (until is not None and not os.path.exists(until)):
        _train_step(model, opt, seed, step)
        step += 1
        if until is not None and interval_s:
            time.sleep(interval_s)  # paced: it spans the chaos without making its reference run long
    digest = _digest(model)
    opt.close()
    client.close()
    return {"job": job, "steps": step, "digest": digest}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    v = sub.add_parser("victims")
    v.add_argument("--socket", required=True)
    v.add_argument("--kills", type=int, required=True)
    v.add_argument("--seed", type=int, default=0)
    v.add_argument("--max-delay-s", type=float, default=1.0)
    s = sub.add_parser("survivor")
    s.add_argument("--socket", required=True)
    s.add_argument("--job", required=True)
    s.add_argument("--seed", type=int, default=7)
    s.add_argument("--steps", type=int)
    s.add_argument("--until")
    s.add_argument("--interval-s", type=float, default=0.2)
    args = parser.parse_args(argv)
    if args.what == "victims":
        out = _victims(args.socket, args.kills, args.seed, args.max_delay_s)
    else:
        out = _survivor(args.socket, args.job, args.seed, args.steps, args.until, args.interval_s)
    print(json.dumps(out), flush=True)
    return 0


# ----------------------------------------------------------------- the scenarios (imported)


def _env() -> dict[str, str]:
    from child_env import child_env  # the scenarios run under pytest; this file also runs as the processes' script

    env = child_env()
    env["TIERMEM_NO_EMBED"] = "1"
    return env


def _survivor_args(socket_path: str, job: str, seed: int) -> list[str]:
    return [sys.executable, SCRIPT, "survivor", "--socket", socket_path, "--job", job, "--seed", str(seed)]


def start_survivor(socket_path: str, job: str, seed: int, until: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*_survivor_args(socket_path, job, seed), "--until", str(until)],
        env=_env(),
        stdout=subprocess.PIPE,
        text=True,
    )


def run_survivor(socket_path: str, job: str, seed: int, steps: int) -> dict[str, Any]:
    out = subprocess.run(
        [*_survivor_args(socket_path, job, seed), "--steps", str(steps)],
        env=_env(),
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    return json.loads(out.stdout)


def client_kills(daemon: Any, kills: int, *, seed: int = 0, survivors: int = 2) -> dict[str, Any]:
    """``kills`` victims SIGKILLed at random points while ``survivors`` jobs train; see the module docstring."""
    stop = daemon.root / f"stop-survivors-{seed}"
    stop.unlink(missing_ok=True)
    procs = [start_survivor(daemon.socket_path, f"survivor-{seed}-{i}", seed + i, stop) for i in range(survivors)]
    try:
        out = subprocess.run(
            [
                sys.executable,
                SCRIPT,
                "victims",
                "--socket",
                daemon.socket_path,
                "--kills",
                str(kills),
                "--seed",
                str(seed),
            ],
            check=False,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=3600,
        )
        if out.returncode != 0:
            raise AssertionError(f"the victims' zygote failed: {out.stderr[-3000:]}")
        figures: dict[str, Any] = json.loads(out.stdout)
    finally:
        stop.write_text("")
    results = []
    for proc in procs:
        text, _ = proc.communicate(timeout=600)
        if proc.returncode != 0:
            raise AssertionError(f"a survivor failed ({proc.returncode})")
        results.append(json.loads(text))
    stop.unlink(missing_ok=True)
    equal = 0
    for i, result in enumerate(results):
        reference = run_survivor(daemon.socket_path, f"reference-{seed}-{i}", seed + i, result["steps"])
        equal += reference["digest"] == result["digest"]
    figures.update(
        survivors=survivors,
        survivor_steps=[r["steps"] for r in results],
        survivors_equal_to_uninterrupted=equal,
    )
    return figures


def daemon_kill(daemon: Any, *, commit_every: int, steps_before: int, steps_after: int) -> dict[str, Any]:
    """Kill the daemon while a job trains; restart it; see the module docstring.  ``daemon`` must have been
    started with ``jobs.commit_every = commit_every``; it is running again (a new process) on return."""
    from tiermem.client.link import connect
    from tiermem.client.offload import OffloadAdam
    from tiermem.core.errors import DaemonUnavailable, StaleStateError

    seed, job = 11, f"phoenix-{steps_before}"
    model = _model(seed)
    client = connect(daemon.socket_path, embed=False)
    opt = OffloadAdam(model.parameters(), lr=1e-3, client=client, job_id=job, offload="nvme", window_nbytes=64 << 10)
    for step in range(steps_before):
        _train_step(model, opt, seed, step)
    token = opt.token
    daemon.process.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    daemon.process.wait()
    error = ""
    try:
        _train_step(model, opt, seed, steps_before)
    except DaemonUnavailable as exc:
        error = type(exc).__name__
    error_after_s = time.monotonic() - killed_at
    client.conn.close()
    log_mark = len(daemon.log_text())
    shutil.rmtree(daemon.socket_dir, ignore_errors=True)  # start() makes a new socket directory
    daemon.start()
    reported = "did not stop cleanly" in daemon.log_text()[log_mark:]
    client = connect(daemon.socket_path, embed=False)
    model = _model(seed)
    refused = None
    kwargs: dict[str, Any] = dict(lr=1e-3, client=client, job_id=job, token=token, offload="nvme")
    try:
        opt = OffloadAdam(model.parameters(), window_nbytes=64 << 10, expected_step=steps_before, **kwargs)
    except StaleStateError as exc:  # the last commit is older than the step the client reached
        refused = (exc.state_step, exc.client_step)
        opt = OffloadAdam(
            model.parameters(), window_nbytes=64 << 10, expected_step=steps_before, rollback=True, **kwargs
        )
    back_at = opt.steps
    for step in range(back_at, back_at + steps_after):
        _train_step(model, opt, seed, step)
    digest = _digest(model)
    opt.close()
    client.close()
    reference = run_survivor(daemon.socket_path, f"{job}-reference", seed, back_at + steps_after)
    return {
        "steps_before_kill": steps_before,
        "commit_every": commit_every,
        "client_error": error,
        "client_error_after_s": round(error_after_s, 3),
        "loss_reported_at_start": reported,
        "refused_without_rollback": list(refused) if refused else None,
        "came_back_at_step": back_at,
        "steps_lost": steps_before - back_at,
        "equal_to_uninterrupted": digest == reference["digest"],
    }


if __name__ == "__main__":
    sys.exit(main())
