"""Real Prometheus scrapes of a real tiermemd, checked against what the test itself did.

One daemon (metrics on a free loopback port, ``metrics.job_labels`` on, small
Adam chunks and a pool quota per job so that an NVMe job pages) serves the
module.  Each test scrapes
before and after its own actions and checks the differences: steps it ran,
parameters it stepped, bytes it allocated, errors it provoked.  Every scrape
also goes through ``promtool check metrics`` (Debian's prometheus package,
which ``run.sh setup`` installs as root); without promtool that check is
skipped with the reason, the rest still runs.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from child_env import child_env
from conftest import DaemonProcess, RawConn, start_daemon
from prometheus_client.parser import text_string_to_metric_families

from tiermem import __version__
from tiermem.client.offload import OffloadAdam
from tiermem.core.errors import AuthError
from tiermem.core.protocol import Ping
from tiermem.core.step_rules import decide
from tiermem.core.units import parse_size

pytestmark = pytest.mark.timeout(300)

DASHBOARD = Path(__file__).resolve().parents[2] / "dashboards" / "tiermem.json"
CHUNK_NUMEL = 1024
Samples = dict[str, list[tuple[dict[str, str], float]]]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def metered(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DaemonProcess, int]]:
    port = _free_port()
    d = start_daemon(
        tmp_path_factory.mktemp("metered"),
        {
            "metrics": {"port": port, "job_labels": True},
            "adam": {"chunk_numel": CHUNK_NUMEL},
            "jobs": {"max_pool": 100_000},  # less than the NVMe job's state: its chunk cache cannot hold it all
        },
    )
    try:
        yield d, port
        assert d.stop() == 0, d.log_text()[-3000:]
    finally:
        d.cleanup()


def scrape(port: int) -> Samples:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    promtool_check(text)
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


def find_promtool() -> str | None:
    """promtool on PATH, or the one ``run.sh setup`` unpacked into the virtual environment."""
    return shutil.which("promtool") or shutil.which("promtool", path=str(Path(sys.executable).parent))


def promtool_check(text: str) -> None:
    promtool = find_promtool()
    if promtool is None:
        return  # test_promtool_is_available reports the skip once, with its reason
    result = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0 and not result.stdout.strip() and not result.stderr.strip(), (
        f"promtool check metrics: rc {result.returncode}\n{result.stdout}{result.stderr}"
    )


def value(samples: Samples, name: str, **labels: str) -> float:
    found = [v for lb, v in samples.get(name, []) if all(lb.get(k) == want for k, want in labels.items())]
    assert len(found) == 1, f"{name}{labels}: {len(found)} samples in {samples.get(name)}"
    return found[0]


def train(
    daemon: DaemonProcess, model: torch.nn.Linear, job_id: str, offload: str, steps: int, **options: Any
) -> OffloadAdam:
    """``steps`` steps of ``model`` under an ``OffloadAdam`` of job ``job_id`` (and ``options``), left open."""
    opt = OffloadAdam(model.parameters(), lr=1e-3, client=daemon.client(), job_id=job_id, offload=offload, **options)
    for _ in range(steps):
        model(torch.randn(4, model.in_features)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return opt


def test_promtool_is_available() -> None:
    if find_promtool() is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus; run.sh setup does it as root)")


def test_an_idle_node_reports_its_pool_and_build(metered: tuple[DaemonProcess, int]) -> None:
    daemon, port = metered
    idle = scrape(port)
    capacity = parse_size(daemon.settings["pool"]["size"])
    assert value(idle, "tiermem_pool_capacity_bytes") == capacity
    assert value(idle, "tiermem_pool_bytes", state="used") + value(idle, "tiermem_pool_bytes", state="free") == capacity
    assert value(idle, "tiermem_budget_capacity_bytes", resource="pool") == capacity
    assert value(idle, "tiermem_jobs") == 0
    (labels, one), = idle["tiermem_build_info"]  # fmt: skip
    assert one == 1 and labels["version"] == __version__
    assert "tiermem_job_state_bytes" not in idle  # no job, no per-job series


def test_a_cpu_job_is_counted_as_the_test_ran_it(metered: tuple[DaemonProcess, int]) -> None:
    daemon, port = metered
    before = scrape(port)
    model = torch.nn.Linear(32, 32)
    numel = 32 * 32 + 32
    steps = 3
    opt = train(daemon, model, "metrics-cpu", "cpu", steps)
    busy = scrape(port)
    window = opt.stats().rank.window_nbytes

    def grew(name: str, **labels: str) -> float:
        return value(busy, name, **labels) - value(before, name, **labels)

    assert grew("tiermem_steps_total") == steps
    assert grew("tiermem_adam_updates_total") == steps
    assert grew("tiermem_adam_updated_params_total") == steps * numel
    assert grew("tiermem_adam_update_seconds_count") == steps
    assert grew("tiermem_attaches_total") == 1
    assert value(busy, "tiermem_jobs") == 1 and value(busy, "tiermem_clients") >= 1
    job = {"tiermem_job": "metrics-cpu", "uid": str(os.getuid())}
    # fp32 params are their own master: the daemon keeps exp_avg and exp_avg_sq, 8 bytes per parameter
    assert value(busy, "tiermem_job_state_bytes", tier="cpu", **job) == 8 * numel
    assert value(busy, "tiermem_job_state_bytes", tier="nvme", **job) == 0
    assert value(busy, "tiermem_job_window_bytes", **job) == window
    assert value(busy, "tiermem_job_last_step", **job) == steps
    assert value(busy, "tiermem_state_bytes", tier="cpu") == 8 * numel
    assert value(busy, "tiermem_budget_held_bytes", resource="pool") == 8 * numel
    opt.close()
    after = scrape(port)
    assert value(after, "tiermem_jobs") == 0
    assert "tiermem_job_state_bytes" not in after
    assert value(after, "tiermem_state_bytes", tier="cpu") == 0
    # the job is gone, its work stays counted: node counters never go down
    assert value(after, "tiermem_steps_total") == value(busy, "tiermem_steps_total")
    assert value(after, "tiermem_adam_updated_params_total") == value(busy, "tiermem_adam_updated_params_total")


def test_skipped_steps_are_counted_by_the_daemon_and_survive_a_reattach(metered: tuple[DaemonProcess, int]) -> None:
    """GradScaler overflows reach the daemon as skipped STEPs: it counts them (not as steps), the optimizer
    mirrors its counts, a reattach restores them, and the node's counters never go down."""
    daemon, port = metered
    before = scrape(port)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = OffloadAdam(model.parameters(), lr=1e-3, client=daemon.client(), job_id="metrics-skips", offload="cpu")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**127, growth_interval=1000)  # overflows fp32 for a while
    history = []
    for _ in range(14):
        scaler.scale(model(torch.randn(4, 8)).square().mean() * 1000).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        history.append(opt.last_skipped)
    skipped, applied = sum(history), len(history) - sum(history)
    assert skipped >= 2 and applied >= 1, history
    assert (opt.steps, opt.skipped_steps) == (applied, skipped)
    busy = scrape(port)
    assert value(busy, "tiermem_skipped_steps_total") - value(before, "tiermem_skipped_steps_total") == skipped
    assert value(busy, "tiermem_steps_total") - value(before, "tiermem_steps_total") == applied
    token = opt.token
    opt.close(keep_state=True)
    again = OffloadAdam(
        model.parameters(), lr=1e-3, client=daemon.client(), job_id="metrics-skips", offload="cpu", token=token
    )
    assert (again.steps, again.skipped_steps) == (applied, skipped)
    again.step(decision=decide(None, scaler_found_inf=True))  # one more skip, as the sharded optimizers hand it
    assert (again.steps, again.skipped_steps, again.last_skipped) == (applied, skipped + 1, True)
    after = scrape(port)
    for name in ("tiermem_steps_total", "tiermem_skipped_steps_total"):
        assert value(after, name) >= value(busy, name), name
    again.close()
    gone = scrape(port)
    for name in ("tiermem_steps_total", "tiermem_skipped_steps_total"):
        assert value(gone, name) >= value(after, name), name


def test_an_nvme_job_pages_and_its_io_is_counted(metered: tuple[DaemonProcess, int]) -> None:
    daemon, port = metered
    before = scrape(port)
    model = torch.nn.Linear(128, 64)  # 8256 params: 9 chunks of 1024, more than the 6 the chunk cache holds
    steps = 3
    opt = train(daemon, model, "metrics-nvme", "nvme", steps)
    # the pager may still read ahead for the next pass (and evict to make room) after the last step returned:
    # take the scrape between two equal reports, so both sides count the same page-outs
    for _ in range(50):
        first = opt.stats().rank.nvme
        busy = scrape(port)
        nvme = opt.stats().rank.nvme
        if nvme == first:
            break
        time.sleep(0.05)
    assert nvme is not None

    def grew(name: str, **labels: str) -> float:
        return value(busy, name, **labels) - value(before, name, **labels)

    chunks = -(-(128 * 64 + 64) // CHUNK_NUMEL)
    parts = chunks * 2  # each chunk's master and its moments are paged apart
    assert grew("tiermem_prefetch_acquires_total") == steps * parts  # one acquire per chunk part and step
    assert grew("tiermem_tier_pages_total", direction="out") == nvme.page_outs > 0
    chunk_nbytes = CHUNK_NUMEL * 4 * 3  # master, exp_avg, exp_avg_sq
    assert grew("tiermem_swap_bytes_total", direction="write") >= nvme.page_outs * 4096
    assert grew("tiermem_swap_bytes_total", direction="write") >= chunk_nbytes
    assert grew("tiermem_swap_io_seconds_count", op="write") >= nvme.page_outs
    # a part's first page-in fills zeros (nothing on disk yet); every later one is a swap read
    assert grew("tiermem_swap_io_seconds_count", op="read") == grew("tiermem_tier_pages_total", direction="in") - parts
    assert value(busy, "tiermem_swap_io_errors_total", op="read") == 0
    assert value(busy, "tiermem_swap_checksum_failures_total") == 0
    job = {"tiermem_job": "metrics-nvme", "uid": str(os.getuid())}
    assert value(busy, "tiermem_job_state_bytes", tier="nvme", **job) == value(busy, "tiermem_swap_used_bytes") > 0
    opt.close()
    after = scrape(port)
    assert value(after, "tiermem_swap_used_bytes") == 0
    assert value(after, "tiermem_swap_bytes_total", direction="write") == value(
        busy, "tiermem_swap_bytes_total", direction="write"
    )


def test_provoked_protocol_and_auth_errors_are_counted(metered: tuple[DaemonProcess, int]) -> None:
    daemon, port = metered
    before = scrape(port)
    raw = RawConn(daemon.socket_path)
    try:
        raw.send(b"XX" + bytes(30))  # bad magic: answered with an error, then the session is closed
        raw.recv()
    finally:
        raw.close()
    with daemon.client() as owner:
        owner.attach("metrics-auth", window_nbytes=4096)
        with daemon.client() as intruder, pytest.raises(AuthError):
            intruder.attach("metrics-auth", window_nbytes=4096, token="not-the-token")
        owner.detach()
    deadline = time.monotonic() + 30
    while True:  # the sessions end on their own threads
        after = scrape(port)
        closed = value(after, "tiermem_disconnects_total", reason="protocol_error")
        if closed > value(before, "tiermem_disconnects_total", reason="protocol_error") or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert value(after, "tiermem_protocol_errors_total") - value(before, "tiermem_protocol_errors_total") == 1
    assert value(after, "tiermem_auth_errors_total") - value(before, "tiermem_auth_errors_total") == 1
    assert closed - value(before, "tiermem_disconnects_total", reason="protocol_error") == 1


def test_idle_scrape_connections_are_bounded_and_hold_no_threads(metered: tuple[DaemonProcess, int]) -> None:
    daemon, port = metered
    cap = 16  # metrics.max_connections's default
    threads = len(os.listdir(f"/proc/{daemon.pid}/task"))
    idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(3 * cap)]
    try:
        time.sleep(0.5)  # let the endpoint accept (and refuse) them all
        assert len(os.listdir(f"/proc/{daemon.pid}/task")) <= threads
        served = 0
        for s in idle:  # past the cap the longest idle ones were closed to make room: their peer reads end-of-stream
            s.settimeout(0.2)
            try:
                served += s.recv(1) != b""
            except TimeoutError:
                served += 1
            except ConnectionResetError:
                pass
        assert served == cap
    finally:
        for s in idle:
            s.close()
    scrape(port)  # still serving


def test_every_metric_the_dashboard_queries_exists(metered: tuple[DaemonProcess, int]) -> None:
    daemon, port = metered
    opt = train(daemon, torch.nn.Linear(128, 64), "metrics-dash", "nvme", 1)
    try:
        names = set(scrape(port))
    finally:
        opt.close()
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    assert exprs, "the dashboard queries nothing"
    queried = {m for e in exprs for m in re.findall(r"\btiermem_[a-z0-9_]+", _without_labels(e))}
    missing = sorted(queried - names)
    assert not missing, f"the dashboard queries metrics the daemon does not export: {missing}"


def _without_labels(expr: str) -> str:
    """A PromQL expression without its label matchers and ``by``/``without`` lists: what is left names metrics."""
    expr = re.sub(r"\b(by|without)\s*\([^)]*\)", "", expr)
    return re.sub(r"\{[^}]*\}", "", expr)


def status(daemon: DaemonProcess) -> tuple[dict[str, Any], str]:
    """``tiermem status`` of ``daemon``: its ``--json`` report and its screen."""
    cmd = [sys.executable, "-m", "tiermem.client.cli", "status", "--socket", daemon.socket_path]
    shown = subprocess.run([*cmd, "--json"], capture_output=True, text=True, timeout=120, check=True)
    screen = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True).stdout
    return json.loads(shown.stdout), screen


def test_tiermem_status_shows_the_node_and_the_job(metered: tuple[DaemonProcess, int]) -> None:
    daemon, _ = metered
    model = torch.nn.Linear(32, 32)
    opt = train(daemon, model, "status-job", "cpu", 2)
    try:
        report, screen = status(daemon)
    finally:
        opt.close()
    assert report["socket"] == daemon.socket_path
    assert report["node"]["pool"]["capacity_nbytes"] == parse_size(daemon.settings["pool"]["size"])
    (job,) = [j for j in report["jobs"] if j["job_id"] == "status-job"]
    assert job["last_step"] == 2 and job["cpu_state_nbytes"] == 8 * (32 * 32 + 32) and job["ranks"] == 1
    assert job["state_dtypes"] == ["fp32"]
    assert job["kernel_paths"] == ["native"]  # fp32 params that are their own master: torch's fused AdamW
    assert "status-job" in screen and "Pool" in screen and "Swap" in screen
    (row,) = [line for line in screen.splitlines() if "status-job" in line]
    assert row.split()[-4:-1] == ["fp32", "0", "native"], row  # ADAM, DPU, KERNEL
    adam = report["node"]["adam"]
    assert adam["busy_periods"] >= 2 and adam["busy_period_s"] >= adam["cpu_busy_s"] > 0, adam  # one per update
    assert f"periods {adam['busy_periods']}" in screen, screen
    assert max(len(line) for line in screen.splitlines()) <= 97


def test_tiermem_status_shows_how_each_job_keeps_its_moments(metered: tuple[DaemonProcess, int]) -> None:
    daemon, port = metered
    opt = train(daemon, torch.nn.Linear(32, 32), "int8-job", "cpu", 1, state_dtype="int8")
    try:
        report, screen = status(daemon)
        scraped = scrape(port)
    finally:
        opt.close()
    (job,) = [j for j in report["jobs"] if j["job_id"] == "int8-job"]
    assert job["state_dtypes"] == ["int8"]
    (row,) = [line for line in screen.splitlines() if "int8-job" in line]
    assert row.split()[-4] == "int8", row
    assert value(scraped, "tiermem_state_dtype_ranks", state_dtype="int8") >= 1
    (path,) = job["kernel_paths"]  # the C kernel where this host compiles it, else the plain-torch reference
    assert path in ("native", "fallback") and row.split()[-2] == path, row
    assert value(scraped, "tiermem_kernel_path_ranks", path=path) >= 1


def test_tiermem_status_without_a_daemon_says_so(tmp_path: Path) -> None:
    missing = tmp_path / "nobody.sock"
    result = subprocess.run(
        [sys.executable, "-m", "tiermem.client.cli", "status", "--socket", str(missing)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 1
    assert "no tiermemd to show" in result.stderr and str(missing) in result.stderr


WATCH_ARGS = ("--json", "--watch", "0.2", "--timeout", "5")


def test_tiermem_status_watch_rides_out_a_daemon_restart(tmp_path: Path) -> None:
    """An operator watching ``status --watch`` through a ``systemctl restart``: it says the daemon stopped
    answering, asks again at each interval, and shows the new daemon (its own counters) when it is back."""
    d = start_daemon(tmp_path / "first")
    watch = subprocess.Popen(
        [sys.executable, "-m", "tiermem.client.cli", "status", "--socket", d.socket_path, *WATCH_ARGS],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    samples: list[dict[str, Any]] = []
    reader = threading.Thread(target=lambda: samples.extend(json.loads(line) for line in watch.stdout or ()))
    reader.start()
    again: subprocess.Popen[bytes] | None = None
    try:
        for _ in range(3):
            with d.connection() as conn:
                conn.request(Ping())
        _wait(lambda: any(s["node"]["server"]["disconnects"] >= 3 for s in samples), "a sample of the first daemon")
        assert d.stop() == 0
        assert watch.stderr is not None
        assert "the daemon stopped answering" in watch.stderr.readline()
        seen = len(samples)
        with open(tmp_path / "again.log", "wb") as log:
            again = subprocess.Popen(
                [sys.executable, "-m", "tiermemd.main", "--config", str(d.config_path)],
                env=child_env("NOTIFY_SOCKET", "LISTEN_"), stdout=log, stderr=log,
            )  # fmt: skip
        assert f"{d.socket_path} answers again" in watch.stderr.readline()
        _wait(lambda: len(samples) > seen, "a sample of the restarted daemon")
        assert samples[-1]["node"]["server"]["disconnects"] == 0  # the new daemon's counters
        watch.send_signal(signal.SIGINT)
        assert watch.wait(30) == 0
    finally:
        if watch.poll() is None:
            watch.kill()
            watch.wait()
        reader.join(30)
        if again is not None:
            again.terminate()
            again.wait(60)
        d.cleanup()


def _wait(done: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"no {what} after {timeout_s} s"
        time.sleep(0.05)


def test_metrics_port_in_use_is_a_startup_error_with_the_socket_code(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = subprocess.run(
            [
                sys.executable, "-m", "tiermemd.main", "--socket", str(tmp_path / "d.sock"), "--pool-size", "16MiB",
                "--state-dir", str(tmp_path / "state"), "--metrics-port", str(port),
            ],
            env={"PATH": "/usr/bin:/bin", "TIERMEM_ADAM_COMPILE": "false", "HOME": str(tmp_path),
                 "TIERMEM_CONFIG": os.environ["TIERMEM_CONFIG"]},
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
    assert result.returncode == 5
    assert f"cannot serve metrics on 127.0.0.1:{port}" in result.stderr
