"""A real Prometheus scrape of a real tiermemd while a job trains through it."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from tiermem.client import connect
from tiermem.errors import DaemonUnavailable
from tiermem.offload import OffloadAdam

pytestmark = pytest.mark.timeout(180)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _scrape(port: int) -> dict[str, list[tuple[dict[str, str], float]]]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


def test_metrics_report_pool_budgets_and_per_job_figures(tmp_path: Path) -> None:
    port = _free_port()
    sock = tmp_path / "d.sock"
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "tiermemd.main", "--socket", str(sock), "--pool-size", "64MiB",
            "--state-dir", str(tmp_path / "state"), "--swap-dir", str(tmp_path / "swap"),
            "--metrics-port", str(port),
        ],
        env={"PATH": "/usr/bin:/bin", "TIERMEM_ADAM_COMPILE": "false", "HOME": str(tmp_path)},
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                client = connect(str(sock), embed=False)
                break
            except DaemonUnavailable:
                if time.monotonic() > deadline or proc.poll() is not None:
                    pytest.fail("tiermemd did not come up")
                time.sleep(0.05)
        idle = _scrape(port)
        pool = {labels["state"]: value for labels, value in idle["tiermem_pool_bytes"]}
        assert pool["capacity"] == 64 * 2**20 and pool["used"] == 0
        assert idle["tiermem_jobs"] == [({}, 0.0)]

        model = torch.nn.Linear(32, 32)
        opt = OffloadAdam(model.parameters(), lr=1e-3, client=client, job_id="scraped", offload="cpu")
        for _ in range(3):
            model(torch.randn(4, 32)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        busy = _scrape(port)
        steps = {labels["job"]: value for labels, value in busy["tiermem_rank_steps_total"]}
        assert steps == {"scraped": 3.0}
        held = {(lb["resource"], lb["kind"]): v for lb, v in busy["tiermem_budget_bytes"]}
        assert held[("pool", "held")] == 8 * (32 * 32 + 32)  # fp32 params on the CPU tier: moments only
        assert dict(busy["tiermem_rank_state_elements"][0][0]) == {"job": "scraped", "rank": "0"}
        opt.close()
        assert _scrape(port)["tiermem_jobs"] == [({}, 0.0)]
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0


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
            env={"PATH": "/usr/bin:/bin", "TIERMEM_ADAM_COMPILE": "false", "HOME": str(tmp_path)},
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
    assert result.returncode == 5
    assert f"cannot serve metrics on 127.0.0.1:{port}" in result.stderr
